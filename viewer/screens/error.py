"""Shown instead of a traceback when a snapshot cannot be read."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Static

from hsnap_format.errors import HsnapIOError

from ..text import describe_error, safe


class ErrorScreen(Screen):
    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]

    def __init__(self, label: str, error: BaseException) -> None:
        super().__init__()
        self.label, self.error = label, error

    def compose(self) -> ComposeResult:
        text = Text("Cannot open ", style="bold")
        text.append_text(safe(self.label, "bold"))
        text.append("\n\n")
        text.append(describe_error(self.error), style="red")
        # a failed read (a disk, a store that does not answer) says nothing about the snapshot itself
        hint = ("Reading it failed; the snapshot itself may be intact." if isinstance(self.error, HsnapIOError)
                else "The file is not a readable hsnap snapshot.")
        text.append(f"\n\n{hint} `hsnap verify` gives the same verdict.", style="dim")
        with Vertical(id="error"):
            yield Static(text, id="error-text")
        yield Footer()
