"""A section's values as a scrollable grid: one row per index of the leading axes
(``[token, head, :]``), one column per index of the last axis; 1-D sections wrap
eight to a row. Only the visible rows are read (pread), so a 1 GiB section scrolls
as freely as a small one. A selection (``[100:120, 0, :8]``) narrows the grid;
the cursor cell's value is shown in full, with its bits, on the top line.

A cell never shows part of a number: columns scroll by whole cells, and a value
longer than a cell is rounded to fit and marked ``≈`` (never cut to a prefix or a
suffix of its digits, which reads as another value)."""

from __future__ import annotations

import math

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from hsnap_format import HsnapError
from hsnap_format.tools.stats import is_float
from hsnap_format.spec import DTYPES
from hsnap_format.tools.viewmodel import Selection, fmt_value, value_bits

from ..model import Document, SectionRef
from ..text import describe_error

CELL = 12
APPROX = "≈"  # a value rounded to fit its cell (the top line shows it exactly)
MORE = "›"  # more columns to the right than fit
WRAP = 8  # values per row of a 1-D section
CACHE_ROWS = 1024
HEAD_LINES = 2  # the cursor line and the column indices

_LABEL = Style(color="cyan")
_HEAD = Style(bold=True)
_CURSOR = Style(reverse=True, bold=True)
_MARK = Style(bgcolor="red", color="white", bold=True)
_ZERO = Style(dim=True)
_NONFINITE = Style(color="magenta", bold=True)
_ERROR = Style(color="red")


def cell_text(v, dtype: str, width: int = CELL - 1) -> str:
    """The value as stored when it fits ``width`` (in fewer digits if they read back to
    the same stored value), else rounded to fit and marked ``≈``."""
    text = fmt_value(v, dtype)
    if len(text) <= width:
        return text
    x = float(v)
    dt = DTYPES[dtype]
    for digits in range(width, 0, -1):
        short = f"{x:.{digits}g}"
        if len(short) <= width and is_float(dt) and np.asarray(float(short)).astype(dt) == np.asarray(v).astype(dt):
            return short
        if len(short) < width:
            return APPROX + short
    return APPROX * width  # unreachable for width >= 8 ("≈-1e+308")


def fit_parts(parts: list[str], width: int, sep: str = "  ") -> str:
    """Whole parts while they fit, then ``…``: a number is never cut to its first digits."""
    text = parts[0] if len(parts[0]) <= width else parts[0][: max(0, width - 1)] + "…"
    for part in parts[1:]:
        if len(text) + len(sep) + len(part) > width:
            return text + sep + "…" if len(text) + len(sep) + 1 <= width else text
        text += sep + part
    return text


class ValueGrid(ScrollView, can_focus=True):
    DEFAULT_CSS = "ValueGrid { height: 1fr; }"
    BINDINGS = [
        Binding("up", "move(-1, 0)", show=False),
        Binding("down", "move(1, 0)", show=False),
        Binding("left", "move(0, -1)", show=False),
        Binding("right", "move(0, 1)", show=False),
        Binding("pageup", "page(-1)", show=False),
        Binding("pagedown", "page(1)", show=False),
        Binding("home", "edge(0)", show=False),
        Binding("end", "edge(1)", show=False),
    ]

    class Moved(Message):
        def __init__(self, index: tuple[int, ...] | None) -> None:
            super().__init__()
            self.index = index

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.doc: Document | None = None
        self.ref: SectionRef | None = None
        self.selection: Selection | None = None
        self.mark: tuple[int, ...] | None = None
        self.row = self.col = 0
        self._cache: dict[int, np.ndarray | HsnapError] = {}
        self._lead: list[list[int]] = []  # per leading axis: the selected indices
        self._flat1: list[int] = []  # 1-D sections: the selected indices
        self._cols: list[int] = []
        self._rows = 0
        self._label_w = 8

    # -- what is shown
    def show(self, doc: Document, ref: SectionRef, selection: Selection, *, cursor: tuple[int, ...] | None = None,
             mark: tuple[int, ...] | None = None) -> None:
        self.doc, self.ref, self.selection, self.mark = doc, ref, selection, mark
        self._cache.clear()
        shape = ref.info.shape or (1,)
        axes = selection.axes or (0,)
        picks = [[a] if isinstance(a, int) else list(a) for a in axes]
        if len(shape) == 1:
            flat = picks[0]
            self._lead = []
            self._flat1 = flat
            self._cols = list(range(WRAP))
            self._rows = -(-len(flat) // WRAP)
        else:
            self._lead = picks[:-1]
            self._flat1 = []
            self._cols = picks[-1]
            self._rows = math.prod(len(p) for p in self._lead)
        self._label_w = len(self._label(max(0, self._rows - 1))) + 1
        self.virtual_size = Size(self._label_w + CELL * len(self._cols) + 1, self._rows + HEAD_LINES)
        self.row = self.col = 0
        if cursor is not None:
            self.goto(cursor)
        else:
            self.scroll_to(0, 0, animate=False)
        self.refresh()

    def clear(self) -> None:
        self.doc = self.ref = self.selection = None
        self._rows = 0
        self.virtual_size = Size(0, 0)
        self.refresh()

    # -- index arithmetic
    def _leading(self, row: int) -> tuple[int, ...]:
        out = []
        for picks in reversed(self._lead):
            row, r = divmod(row, len(picks))
            out.append(picks[r])
        return tuple(reversed(out))

    def _label(self, row: int) -> str:
        if self.ref is None:
            return ""
        if not self._lead:
            return f"[{self._flat1[min(row * WRAP, len(self._flat1) - 1)]}]" if self._flat1 else "[]"
        return "[" + ",".join(map(str, self._leading(row))) + ",:]"

    def index_at(self, row: int, col: int) -> tuple[int, ...] | None:
        """The section index of a grid cell (None outside the selection)."""
        if self.ref is None or not (0 <= row < self._rows and 0 <= col < len(self._cols)):
            return None
        if not self._lead:
            i = row * WRAP + col
            return (self._flat1[i],) if i < len(self._flat1) else None
        return self._leading(row) + (self._cols[col],)

    def cell_of(self, index: tuple[int, ...]) -> tuple[int, int] | None:
        """The grid cell of a section index, or None when the selection does not hold it."""
        if self.ref is None:
            return None
        if not self._lead:
            try:
                i = self._flat1.index(index[0])
            except ValueError:
                return None
            return divmod(i, WRAP)
        row = 0
        for picks, k in zip(self._lead, index[:-1]):
            try:
                row = row * len(picks) + picks.index(k)
            except ValueError:
                return None
        try:
            return row, self._cols.index(index[-1])
        except ValueError:
            return None

    def goto(self, index: tuple[int, ...]) -> bool:
        cell = self.cell_of(index)
        if cell is None:
            return False
        self.row, self.col = cell
        self._scroll_to_cursor()
        self.refresh()
        self.post_message(self.Moved(index))
        return True

    @property
    def cursor_index(self) -> tuple[int, ...] | None:
        return self.index_at(self.row, self.col)

    def value_at(self, index: tuple[int, ...]):
        """The stored value at a section index (read with pread), as a numpy scalar."""
        shape = self.ref.info.shape or (1,)
        flat = int(np.ravel_multi_index(index, shape))
        return self.doc.read_flat(self.ref, flat, 1)[0]

    # -- reading
    def _row_values(self, row: int) -> np.ndarray | HsnapError:
        hit = self._cache.get(row)
        if hit is not None:
            return hit
        if len(self._cache) > CACHE_ROWS:
            self._cache.clear()
        try:
            if not self._lead:
                idx = self._flat1[row * WRAP : (row + 1) * WRAP]
                lo = idx[0]
                block = self.doc.read_flat(self.ref, lo, idx[-1] - lo + 1)
                values = block[[i - lo for i in idx]]
            else:
                shape = self.ref.info.shape
                start = int(np.ravel_multi_index(self._leading(row), shape[:-1])) * shape[-1]
                line = self.doc.read_flat(self.ref, start, shape[-1])
                values = line[self._cols]
        except HsnapError as e:  # pread: a truncated file is a line of text, never SIGBUS
            values = e
        self._cache[row] = values
        return values

    # -- cursor
    def _body_height(self) -> int:
        return max(1, self.size.height - HEAD_LINES - (1 if self.show_horizontal_scrollbar else 0))

    def _scroll_to_cursor(self) -> None:
        top, body = round(self.scroll_y), self._body_height()
        if self.row < top:
            self.scroll_to(y=self.row, animate=False)
        elif self.row >= top + body:
            self.scroll_to(y=self.row - body + 1, animate=False)
        first, fits = self._first_col(round(self.scroll_x)), self._cols_that_fit()
        if self.col < first:
            self.scroll_to(x=self.col * CELL, animate=False)
        elif self.col >= first + fits:
            self.scroll_to(x=(self.col - fits + 1) * CELL, animate=False)

    def _cols_that_fit(self) -> int:
        return max(1, (self._view_width() - self._label_w) // CELL)

    def _view_width(self) -> int:
        """What shows between the border and the vertical scrollbar (``size`` counts the scrollbar)."""
        return self.scrollable_content_region.width or self.size.width

    @staticmethod
    def _first_col(scroll_x: int) -> int:
        """The first whole cell at a horizontal scroll (the mouse can leave any offset)."""
        return -(-scroll_x // CELL)

    def action_move(self, drow: int, dcol: int) -> None:
        if self.ref is None:
            return
        self.row = max(0, min(self._rows - 1, self.row + drow))
        self.col = max(0, min(len(self._cols) - 1, self.col + dcol))
        if self.index_at(self.row, self.col) is None:  # the last row of a wrapped 1-D section
            self.col = max(0, len(self._flat1) - 1 - self.row * WRAP) if not self._lead else self.col
        self._scroll_to_cursor()
        self.refresh()
        self.post_message(self.Moved(self.cursor_index))

    def action_page(self, delta: int) -> None:
        self.action_move(delta * self._body_height(), 0)

    def action_edge(self, end: int) -> None:
        self.action_move((self._rows if end else -self._rows), 0)

    # -- drawing
    def _cursor_line(self) -> list[Segment]:
        index = self.cursor_index
        if index is None:
            return [Segment("")]
        try:
            v = self.value_at(index)
        except HsnapError as e:
            return [Segment(f"{list(index)}  unreadable: {describe_error(e)}", _ERROR)]
        dtype = self.ref.info.dtype
        parts = [f"{list(index)} = {fmt_value(v, dtype)}"]
        if is_float(v.dtype):
            parts += [f"exactly {float(v)!r}", f"bits {value_bits(v, dtype)}"]
        if self.selection is not None and not all(isinstance(a, range) and len(a) == n for a, n in zip(self.selection.axes, self.ref.info.shape)):
            parts.append(f"selection {self.selection}")
        width, named = self._view_width(), self.ref.info.name + "  ".join(parts)
        # narrow: the section's name (it heads the pane) gives way to the exact value
        return [Segment(named if len(named) <= width else fit_parts(parts, width), _HEAD)]

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        if self.ref is None:
            return Strip.blank(width)
        if y == 0:
            return Strip(self._cursor_line()).crop_extend(0, width, None)
        if y == 1:
            head = [Segment(" " * self._label_w)]
            head += [Segment(f"{c:>{CELL - 1}} ", _LABEL) for c in (self._cols if self._lead else range(WRAP))]
            strip = Strip(head)
            return self._frozen(strip, scroll_x, width)
        row = scroll_y + y - HEAD_LINES
        if row >= self._rows:
            return Strip.blank(width)
        values = self._row_values(row)
        segs = [Segment(self._label(row).ljust(self._label_w), _LABEL)]
        if isinstance(values, HsnapError):
            segs.append(Segment(f"unreadable: {describe_error(values)}", _ERROR))
            return Strip(segs).crop_extend(0, width, None)  # a message, not cells: never scrolled away
        dtype = self.ref.info.dtype
        floating = is_float(values.dtype)
        for c, v in enumerate(values):
            text = cell_text(v, dtype)
            style = None
            if floating and not math.isfinite(float(v)):
                style = _NONFINITE
            elif not v:
                style = _ZERO
            if self.mark is not None and self.index_at(row, c) == tuple(self.mark):
                style = _MARK
            if row == self.row and c == self.col:
                style = _CURSOR if style is not _MARK else _MARK + _CURSOR
            segs.append(Segment(f"{text:>{CELL - 1}}", style))
            segs.append(Segment(" "))
        return self._frozen(Strip(segs), scroll_x, width)

    def _frozen(self, strip: Strip, scroll_x: int, width: int) -> Strip:
        """Keep the row labels in place while the values scroll sideways, by whole cells:
        the room left over at the right shows ``›`` when more columns follow, never the
        first digits of a cell that does not fit."""
        label = strip.crop(0, self._label_w)
        room = max(0, min(width, self._view_width()) - self._label_w)
        first = self._label_w + self._first_col(scroll_x) * CELL
        whole = room // CELL * CELL
        body = strip.crop(first, first + whole)
        parts = [label, body]
        if room > whole and strip.cell_length > first + whole:
            parts.append(Strip([Segment(MORE.rjust(room - whole), _LABEL)]))
        return Strip.join(parts).crop_extend(0, width, None)
