"""Terminal-safe text. Every string that came from a file goes through
:func:`safe`: control characters escaped (hsnap_format.tools.viewmodel.escape) and
wrapped in a Rich ``Text`` so that no ``[markup]`` in it is ever interpreted."""

from __future__ import annotations

import math
import os

from rich.text import Text

from hsnap_format import HsnapError
from hsnap_format.tools.viewmodel import escape


def safe(value, style: str = "") -> Text:
    return Text(escape(value), style=style)


def fmt_num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return str(v) if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


def describe_error(e: BaseException) -> str:
    """One line naming the error type; the file is named by its basename only."""
    msg = str(e)
    if isinstance(e, HsnapError) and e.path:
        msg = msg.replace(e.path, os.path.basename(os.path.normpath(e.path)) or e.path, 1)
    return escape(f"{type(e).__name__}: {msg}")
