"""Human-readable output that fits a terminal: ``hsnap``'s commands print through a :class:`Printer`, which by default
keeps every line within 80 columns — tables give up columns and shorten their cells (a path or a name loses its
middle, a digest shows its first characters), prose wraps — and with ``--wide`` prints everything in full.

Widths are counted in characters: what the commands print is escaped (``escape_text``) to printable text, and its
few non-ASCII characters (``×``, ``…``) take one column each."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from typing import Sequence

WIDTH = 80  # the default: a terminal's classic width, whatever the one at hand
GAP = "  "  # between two columns of a table
ELLIPSIS = "…"
DIGEST_SHOWN = 12  # hex digits of a digest in the narrow view (git's short hashes are 7 to 12)
MORE_INDENT = "    "  # a wrapped line's continuation, and a row's detail line


def elide_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its middle replaced by ``…`` (a path keeps its file name: the end
    gets the larger part)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    keep = width - 1
    head = keep // 3
    return text[:head] + ELLIPSIS + text[len(text) - (keep - head):]


def elide_end(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its end replaced by ``…``."""
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + ELLIPSIS if width >= 1 else ""


ELIDE = {"middle": elide_middle, "end": elide_end}


@dataclass(frozen=True)
class Column:
    """One column of a table: its title, ``<`` or ``>`` alignment, how a cell too long for the width left is
    shortened (``middle``, ``end``, or None: never), the fewest characters it shrinks to, and whether it is shown
    only with ``--wide``."""

    title: str
    align: str = "<"
    elide: str | None = None
    min_width: int = 6
    wide_only: bool = False


def render_table(columns: Sequence[Column], rows: Sequence[Sequence[object]], width: int | None, indent: str = "") -> list[str]:
    """The title line, then one line per row. With a ``width``, the columns whose cells may be shortened give up
    characters, the one with the most to spare first, until the table fits (or each is at its ``min_width``)."""
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max([len(c.title)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    if width is not None:
        over = len(indent) + sum(widths) + len(GAP) * (len(columns) - 1) - width
        shrinkable = [i for i, c in enumerate(columns) if c.elide is not None]
        while over > 0 and shrinkable:
            i = max(shrinkable, key=lambda k: widths[k] - columns[k].min_width)
            if widths[i] <= columns[i].min_width:
                break
            widths[i] -= 1
            over -= 1

    def line(values: Sequence[str], titles: bool = False) -> str:
        parts = []
        for c, w, v in zip(columns, widths, values):
            v = elide_end(v, w) if titles else ELIDE[c.elide](v, w) if c.elide else v
            parts.append(f"{v:{c.align}{w}}")
        return (indent + GAP.join(parts)).rstrip()

    return [line([c.title for c in columns], titles=True)] + [line(r) for r in cells]


class Printer:
    """Where a command's human-readable output goes, and how wide it may be: 80 columns, or (``wide``) unbounded
    with every path, digest and column in full."""

    def __init__(self, wide: bool = False, file=None, width: int = WIDTH) -> None:
        self.wide = wide
        self.width: int | None = None if wide else width
        self.file = file

    def line(self, text: str = "") -> None:
        """One line of prose: as it is when wide, else wrapped (continuations indented)."""
        for part in self.wrapped(text):
            print(part, file=self.file or sys.stdout, flush=True)

    def wrapped(self, text: str, indent: str = "") -> list[str]:
        if self.width is None or len(indent) + len(text) <= self.width:
            return [indent + text]
        return textwrap.wrap(text, self.width, initial_indent=indent, subsequent_indent=indent + MORE_INDENT,
                             break_long_words=True, break_on_hyphens=False) or [""]

    def table(self, columns: Sequence[Column], rows: Sequence[Sequence[object]], details: Sequence[str | None] | None = None,
              indent: str = "") -> None:
        """A table of the columns this width shows; ``details[i]``, when given, is printed (wrapped) under row i."""
        shown = [i for i, c in enumerate(columns) if self.wide or not c.wide_only]
        lines = render_table([columns[i] for i in shown], [[row[i] for i in shown] for row in rows], self.width, indent)
        out = self.file or sys.stdout
        print(lines[0], file=out)
        for k, text in enumerate(lines[1:]):
            print(text, file=out)
            if details and details[k]:
                for part in self.wrapped(str(details[k]), indent=indent + MORE_INDENT):
                    print(part, file=out)

    def path(self, path: str, room: int = 48) -> str:
        """A path (already escaped) in at most ``room`` characters, its middle elided; whole when wide."""
        return path if self.wide else elide_middle(path, room)

    def digest(self, digest: str | None) -> str:
        """A hex digest (``algorithm:hex`` too): its first characters and ``…``; whole when wide."""
        if digest is None:
            return "-"
        algorithm, _, hexdigits = digest.rpartition(":")
        if self.wide or len(hexdigits) <= DIGEST_SHOWN:
            return digest
        return digest[: len(algorithm) + bool(algorithm) + DIGEST_SHOWN] + ELLIPSIS


def relative_to(path: str, base: str) -> str:
    """``path`` without the leading ``base`` and separator when it lies below it (a local path or an ``s3://`` URL:
    compared as text), else ``path``."""
    stem = base.rstrip("/")
    if stem and path.startswith(stem + "/") and len(path) > len(stem) + 1:
        return path[len(stem) + 1:]
    return path


__all__ = ["WIDTH", "Column", "Printer", "render_table", "elide_middle", "elide_end", "relative_to"]
