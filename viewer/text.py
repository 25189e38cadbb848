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


class Packed:
    """Parts joined by a separator, broken between parts only, never inside one (a title
    that wrapped mid-word read ``11`` / ``sections``); a part wider than the line is cut
    with an ellipsis. Measured at the width it is drawn at, so it re-packs on resize."""

    def __init__(self, parts: list[Text], separator: str = " · ") -> None:
        self.parts = [p for p in parts if p.cell_len]
        self.separator = separator

    def lines(self, width: int) -> list[Text]:
        width = max(1, width)
        out: list[Text] = []
        line = Text()
        for part in self.parts:
            part = part.copy()
            if part.cell_len > width:
                part.truncate(width, overflow="ellipsis")
            if line.cell_len and line.cell_len + len(self.separator) + part.cell_len > width:
                out.append(line)
                line = Text()
            if line.cell_len:
                line.append(self.separator)
            line.append_text(part)
        out.append(line)
        return out

    def __rich_console__(self, console, options):
        for line in self.lines(options.max_width):
            line.no_wrap = True
            yield line

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        widest = max((p.cell_len for p in self.parts), default=1)
        whole = sum(p.cell_len for p in self.parts) + len(self.separator) * max(0, len(self.parts) - 1)
        return Measurement(min(widest, options.max_width), min(whole, options.max_width))
