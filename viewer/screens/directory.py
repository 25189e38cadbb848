"""A directory of snapshots — what a drain, a checkpointer or a migration writes — as a table to open: one row
per snapshot, TP set and checkpoint chain (its newest committed link), each chain's passed-over links under it,
then the page store and the leftovers; the line below says what the highlighted row is. ``enter`` opens an
entry on the main screen (``escape`` there comes back here).

The listing reads files (each chain's newest link is verified whole, as a resume does): it runs off the event
loop, the screen saying so meanwhile. Its table is ``hsnap info DIR``'s, fitted to the width the same way."""

from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, OptionList, Static

from hsnap_format.tools.fit import render_table
from hsnap_format.tools.viewmodel import directory_entries

from ..listing import LISTING_COLUMNS, ListingRow, NothingToViewError, listing_rows, listing_summary
from ..model import display_name
from ..text import Packed, describe_error, safe

INDENT = " "  # the table's left margin, as the title's


class DirectoryScreen(Screen):
    DEFAULT_CSS = """
    #listing-head { height: 1; text-style: bold; background: $panel; }
    #listing { height: 1fr; }
    #listing-detail { height: auto; max-height: 8; padding: 0 1; border-top: hkey $primary-background; }
    """
    BINDINGS = [
        Binding("question_mark,f1", "app.help", "Help"),
        Binding("q", "app.quit", "Quit"),
        Binding("enter", "open_entry", "Open", priority=True),  # before the list's own (hidden) enter: the footer names it
    ]

    class Listed(Message):
        """The listing is done (``error``: why it could not be read)."""

        def __init__(self, rows: list[ListingRow], summary: list[str], error: BaseException | None) -> None:
            super().__init__()
            self.rows, self.summary, self.error = rows, summary, error

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.label = display_name(path)
        self.rows: list[ListingRow] = []

    def compose(self) -> ComposeResult:
        yield Static(self._title(["listing…"]), id="title")
        yield Static("", id="listing-head")
        yield OptionList(id="listing", compact=True)
        yield Static(Text("Listing it as a resume would: each checkpoint chain's newest link is verified whole, "
                          "every byte read.", style="dim"), id="listing-detail")
        yield Footer()

    def _title(self, parts: list[str]) -> Packed:
        return Packed([safe(self.label, "bold"), *(Text(p) for p in parts)])

    def on_mount(self) -> None:
        self.list_entries()

    @work(thread=True, exclusive=True, group="listing")
    def list_entries(self) -> None:
        try:
            listing, entries = directory_entries(self.path)
            message = self.Listed(listing_rows(self.path, listing, entries), listing_summary(listing, entries), None)
        except Exception as e:  # noqa: BLE001 - a store that fails, a directory gone: said on screen, never a traceback
            message = self.Listed([], [], e)
        self.post_message(message)  # thread-safe: handled on the app's loop

    def on_directory_screen_listed(self, event: "DirectoryScreen.Listed") -> None:
        self.rows = event.rows
        detail = self.query_one("#listing-detail", Static)
        if event.error is not None or not self.rows:
            error = event.error or NothingToViewError(f"{self.label} holds no snapshot, TP set or checkpoint chain to view")
            self.query_one("#title", Static).update(self._title(["nothing to view"]))
            detail.update(Text(describe_error(error), style="red"))
            return
        self.query_one("#title", Static).update(self._title(event.summary))
        self._fill()
        listing = self.query_one(OptionList)
        listing.highlighted = 0
        listing.focus()

    def on_resize(self) -> None:
        if self.rows:
            self._fill()

    def _fill(self) -> None:
        """The table at the width there is (the head and the rows from one rendering: their columns line up)."""
        listing = self.query_one(OptionList)
        width = (listing.size.width or self.app.size.width) - listing.styles.scrollbar_size_vertical
        lines = render_table(LISTING_COLUMNS, [r.cells for r in self.rows], width, indent=INDENT)
        self.query_one("#listing-head", Static).update(Text(lines[0]))
        highlighted = listing.highlighted
        listing.clear_options()
        listing.add_options([Text(line, style=row.style) for line, row in zip(lines[1:], self.rows)])
        listing.highlighted = highlighted

    @on(OptionList.OptionHighlighted)
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.query_one("#listing-detail", Static).update(Text(self.rows[event.option_index].detail))

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.open_row(event.option_index)

    def action_open_entry(self) -> None:
        index = self.query_one(OptionList).highlighted
        if index is not None:
            self.open_row(index)

    def open_row(self, index: int) -> None:
        row = self.rows[index]
        if row.opens is None:
            self.notify(f"{row.cells[0]}: {row.cells[2]}, not a snapshot: nothing to open", markup=False)
            return
        self.query_one("#listing-detail", Static).update(Text(f"opening {row.cells[0]}…", style="dim"))
        self.app.open_entry(row.opens)

    def show_detail(self) -> None:
        """The highlighted row's line (again: after an open, or coming back)."""
        index = self.query_one(OptionList).highlighted
        if index is not None and self.rows:
            self.query_one("#listing-detail", Static).update(Text(self.rows[index].detail))
