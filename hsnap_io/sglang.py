"""Moved to :mod:`hsnap_sglang.req` (SGLang's names live in the edge package, issue 19).

``hsnap_io.sglang`` stays importable for existing code: it *is* that module (the same
module object, so attributes, private helpers and monkeypatches are shared)."""

import sys

from hsnap_sglang import req as _req

sys.modules[__name__] = _req
