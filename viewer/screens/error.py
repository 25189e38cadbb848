"""Shown instead of a traceback when a snapshot cannot be read."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Static

from hsnap_format.errors import HsnapIOError

from ..listing import NothingToViewError
from ..text import describe_error, safe

# what the error says about the path, by its type (the first that matches; else the last line)
HINTS = (
    # a failed read (a disk, a store that does not answer) says nothing about the snapshot itself
    (HsnapIOError, "Reading it failed; the snapshot itself may be intact. `hsnap verify` gives the same verdict."),
    (NothingToViewError, "A drain, a checkpointer or a migration writes <rid>.hsnap files, TP sets (directories with "
                         "manifest.json) and <name>.ckNNNNNN.hsnap checkpoint links; `hsnap info` lists the same."),
    (BaseException, "The file is not a readable hsnap snapshot. `hsnap verify` gives the same verdict."),
)


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
        hint = next(hint for kind, hint in HINTS if isinstance(self.error, kind))
        text.append(f"\n\n{hint}", style="dim")
        with Vertical(id="error"):
            yield Static(text, id="error-text")
        yield Footer()
