"""A table that draws only its visible rows (Textual's Line API).

DataTable measures every cell of every row when rows are added: 10,000 sections
took seconds before the first frame, and each status update re-measured. Here a
row is a key; its cells come from a function when the row is drawn, column widths
are fixed or fitted once, and updating a row costs one redraw of what is visible.
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
        return Strip(segments).crop_extend(scroll_x, scroll_x + width, style + post if post else style)
