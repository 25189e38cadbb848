"""A table that draws only its visible rows (Textual's Line API).

DataTable measures every cell of every row when rows are added: 10,000 sections
took seconds before the first frame, and each status update re-measured. Here a
row is a key; its cells come from a function when the row is drawn, column widths
are fixed or fitted once, and updating a row costs one redraw of what is visible.
Sideways it scrolls by whole columns, the first (the row's name) staying; a column cut
at the right edge ends in ``…``: a cell never shows part of a number unmarked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

GAP = 2  # spaces between columns
MORE = "›"  # more columns to the right, no room to start the next
CUT = "…"  # a column cut at the right edge
MIN_CUT = 4  # room below which the next column is not started


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    width: int | None = None  # None: fitted to the data by ``fit``
    justify: str = "left"


Cell = Callable[[str, str], "Text | str"]


class VTable(ScrollView, can_focus=True):
    """Rows are keys; ``cell(key, column_key)`` gives what a cell shows."""

    COMPONENT_CLASSES = {"vtable--header", "vtable--cursor", "vtable--even"}
    DEFAULT_CSS = """
    VTable {
        height: 1fr;
        background: $surface;
        & > .vtable--header { text-style: bold; background: $panel; }
        & > .vtable--cursor { background: $block-cursor-blurred-background; }
        &:focus > .vtable--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
        &:dark > .vtable--even { background: $surface-darken-1 40%; }
    }
    """
    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "edge(0)", "First", show=False),
        Binding("end", "edge(1)", "Last", show=False),
        Binding("enter", "select", "Open", show=False),
        Binding("left", "column(-1)", "Left", show=False),
        Binding("right", "column(1)", "Right", show=False),
    ]

    class Selected(Message):
        """Enter (or a click) on a row."""

        def __init__(self, table: "VTable", key: str) -> None:
            super().__init__()
            self.table, self.key = table, key

        @property
        def control(self) -> "VTable":
            return self.table

    class Highlighted(Message):
        def __init__(self, table: "VTable", key: str) -> None:
            super().__init__()
            self.table, self.key = table, key

        @property
        def control(self) -> "VTable":
            return self.table

    def __init__(self, columns: Sequence[Column], cell: Cell, *, keys: Sequence[str] = (), **kw) -> None:
        super().__init__(**kw)
        self.columns = list(columns)
        self.cell = cell
        self.widths = {c.key: c.width or len(c.title) for c in self.columns}
        self.keys: list[str] = []
        self._index: dict[str, int] = {}
        self.cursor_row = 0
        self.set_rows(keys)

    # -- data
    @property
    def row_count(self) -> int:
        return len(self.keys)

    @property
    def cursor_key(self) -> str | None:
        return self.keys[self.cursor_row] if self.keys else None

    def set_rows(self, keys: Sequence[str], *, fit: bool = True) -> None:
        """Replace the rows (the cursor stays on its key when that key is still there)."""
        current = self.cursor_key
        self.keys = list(keys)
        self._index = {k: i for i, k in enumerate(self.keys)}
        if fit:
            self.fit()
        self.cursor_row = self._index.get(current, min(self.cursor_row, max(0, len(self.keys) - 1)))
        self._resize()

    def fit(self, columns: Sequence[str] | None = None) -> None:
        """Fit the widths of columns declared without one to their widest cell (O(rows))."""
        for c in self.columns:
            if c.width is None and (columns is None or c.key in columns):
                widest = len(c.title)
                for k in self.keys:
                    v = self.cell(k, c.key)
                    widest = max(widest, v.cell_len if isinstance(v, Text) else len(str(v)))
                self.widths[c.key] = widest
        self._resize()

    def set_width(self, column: str, width: int) -> None:
        self.widths[column] = max(width, len(next(c.title for c in self.columns if c.key == column)))
        self._resize()

    def _resize(self) -> None:
        width = 1 + sum(self.widths.values()) + GAP * max(0, len(self.columns) - 1) + 1
        self.virtual_size = Size(width, len(self.keys) + 1)
        self.refresh()

    def _spans(self) -> list[tuple[int, int]]:
        """(start, end) of each column in a drawn line (a leading space, GAP between)."""
        spans, x = [], 1
        for c in self.columns:
            spans.append((x, x + self.widths[c.key]))
            x += self.widths[c.key] + GAP
        return spans

    def _window(self, scroll_x: int, width: int) -> tuple[int, int, int, bool]:
        """The part of a line shown at a scroll offset: the first column (the row's name)
        stays; the offset counts through the other columns, and from the first of them that
        starts at or after it, the whole columns that fit; and whether more columns follow.
        (frozen end, lo, hi, more)"""
        spans = self._spans()
        if not spans:
            return 0, 0, width, False
        frozen = spans[0][1] + GAP if scroll_x > 0 and len(spans) > 1 else 0
        room = width - frozen
        if frozen and room < max(b - a for a, b in spans[1:]):  # no room beside it: plain scrolling
            frozen, room = 0, width
        base = spans[1][0] if frozen else 0
        lo = 0 if scroll_x <= 0 else next((a for a, _ in spans if a - base >= scroll_x and a >= base), spans[-1][0])
        ends = [b for a, b in spans if a >= lo and b <= lo + room]
        if not ends:  # one column wider than the view: cut (its cells end in … themselves)
            return frozen, lo, lo + room, False
        hi = ends[-1]
        more = spans[-1][1] > hi
        if not more:
            hi = lo + room  # the trailing space and the cursor bar to the edge
        return frozen, lo, hi, more

    def action_column(self, delta: int) -> None:
        """Scroll sideways by one whole column (the offsets _window reads)."""
        spans = self._spans()
        if len(spans) < 2:
            return
        offsets = [a - spans[1][0] for a, _ in spans[1:]]
        x = round(self.scroll_x)
        if delta > 0:
            target = min(next((o for o in offsets if o > x), x), max(x, round(self.max_scroll_x)))
        else:
            target = max([o for o in offsets if o < x], default=0)
        self.scroll_to(x=target, animate=False)

    def get_cell(self, key: str, column: str) -> Text:
        value = self.cell(key, column)
        return value if isinstance(value, Text) else Text(str(value))

    def get_row_index(self, key: str) -> int:
        return self._index[key]

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def refresh_key(self, key: str) -> None:
        i = self._index.get(key)
        if i is not None:
            y = i + 1 - round(self.scroll_y)
            if 1 <= y < self.size.height:
                self.refresh(Region(0, y, self.size.width, 1))

    # -- cursor
    def move_cursor(self, row: int, *, scroll: bool = True) -> None:
        if not self.keys:
            return
        row = max(0, min(row, len(self.keys) - 1))
        changed = row != self.cursor_row
        self.cursor_row = row
        if scroll:
            self.scroll_to_row(row)
        self.refresh()
        if changed:
            self.post_message(self.Highlighted(self, self.keys[row]))

    def show(self, key: str) -> None:
        if key in self._index:
            self.move_cursor(self._index[key])

    def scroll_to_row(self, row: int) -> None:
        body = max(1, self.size.height - 1 - (1 if self.show_horizontal_scrollbar else 0))
        top = round(self.scroll_y)
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif row >= top + body:
            self.scroll_to(y=row - body + 1, animate=False)

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_page(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta * max(1, self.size.height - 2))

    def action_edge(self, end: int) -> None:
        self.move_cursor(len(self.keys) - 1 if end else 0)

    def action_select(self) -> None:
        if self.keys:
            self.post_message(self.Selected(self, self.keys[self.cursor_row]))

    async def _on_click(self, event: events.Click) -> None:
        row = event.y - 1 + round(self.scroll_y)
        if event.y >= 1 and 0 <= row < len(self.keys):
            self.move_cursor(row, scroll=False)
            self.post_message(self.Selected(self, self.keys[row]))

    # -- drawing
    def _line_text(self, cells: Sequence[Text]) -> Text:
        line = Text(" ", no_wrap=True, end="")
        for i, (c, cell) in enumerate(zip(self.columns, cells)):
            w = self.widths[c.key]
            cell = cell.copy()
            cell.truncate(w, overflow="ellipsis")
            pad = w - cell.cell_len
            if c.justify == "right":
                line.append(" " * pad)
                line.append_text(cell)
            else:
                line.append_text(cell)
                line.append(" " * pad)
            if i < len(self.columns) - 1:
                line.append(" " * GAP)
        line.append(" ")
        return line

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        base = self.rich_style
        if y == 0:
            text = self._line_text([Text(c.title, justify=c.justify) for c in self.columns])
            style = self.get_component_rich_style("vtable--header")
            return self._strip(text, scroll_x, width, base + style)
        row = scroll_y + y - 1
        if row >= len(self.keys):
            return Strip.blank(width, base)
        key = self.keys[row]
        text = self._line_text([self.get_cell(key, c.key) for c in self.columns])
        style = base
        if row % 2 == 0:
            style += self.get_component_rich_style("vtable--even")
        post = self.get_component_rich_style("vtable--cursor") if row == self.cursor_row else None
        return self._strip(text, scroll_x, width, style, post)

    def _strip(self, text: Text, scroll_x: int, width: int, style: Style, post: Style | None = None) -> Strip:
        segments = list(text.render(self.app.console))
        segments = list(Segment.apply_style(segments, style=style, post_style=post))
        fill = style + post if post else style
        view = self.scrollable_content_region.width or width  # without the vertical scrollbar
        line = Strip(segments)
        frozen, lo, hi, more = self._window(scroll_x, min(width, view))
        parts = [line.crop_extend(0, frozen, fill)] if frozen else []
        parts.append(line.crop_extend(lo, hi, fill))
        if more:  # at the edge: the next column started and cut (…), or no room to start it (›)
            rest = max(1, view - sum(p.cell_length for p in parts))
            shown = rest - 1 if rest >= MIN_CUT + GAP else 0
            hidden = line.crop(hi + shown, line.cell_length).text.strip()  # a blank cell needs no mark
            mark = (CUT if shown else MORE) if hidden else " "
            parts += [line.crop_extend(hi, hi + shown, fill), Strip([Segment(mark.rjust(rest - shown), fill)])]
        return Strip.join(parts).crop_extend(0, width, fill)
