"""On the GPU machine: import what bench/gpu_check.py steps 1-5 import (with ``servers``: step 6's server modules
too); print the first absent top-level module's name (MISSING NAME) or OK.  scripts/gpu_machine/run serves each one
found as a placeholder and asks again (a server module that is then *called* fails the step: carry its wheel)."""

import os
import re
import sys

sys.path.insert(0, os.getcwd())
try:
    import bench.gpu_check  # noqa: F401
    from bench.run import build_reference_pools

    build_reference_pools(53, device=sys.argv[1] if len(sys.argv) > 1 else "cpu")
    import hsnap_io.transfer  # noqa: F401

    if "servers" in sys.argv[2:]:  # step 6: what a server and the plug-in import (a module missing here must be carried)
        import hsnap_sglang.plugin  # noqa: F401
        import sglang.srt.entrypoints.http_server  # noqa: F401
        import sglang.srt.managers.detokenizer_manager  # noqa: F401
        import sglang.srt.managers.scheduler  # noqa: F401
        import sglang.srt.models.nemotron_h  # noqa: F401
        import sglang.srt.models.qwen3_next  # noqa: F401
except ImportError as e:
    m = re.search(r"missing module '([^']+)'", str(e))  # hsnap_io.sglang_env's wording
    name = m.group(1) if m else ""
    c: BaseException | None = e
    while not name and c is not None:  # else the deepest absent module in the chain
        name = getattr(c, "name", None) or ""
        c = c.__cause__
    print("MISSING", name.split(".")[0])
    raise
print("OK")
