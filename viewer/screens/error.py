"""Shown instead of a traceback when a snapshot cannot be read."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Static

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
        text.append("\n\nThe file is not a readable hsnap snapshot. `hsnap verify` gives the same verdict.", style="dim")
        with Vertical(id="error"):
            yield Static(text, id="error-text")
        yield Footer()
