"""Moved to :mod:`hsnap_sglang.retract` (SGLang's names live in the edge package, issue 19).

``hsnap_io.retract`` stays importable for existing code: it *is* that module (the same
module object)."""

import sys

from hsnap_sglang import retract as _retract

sys.modules[__name__] = _retract
