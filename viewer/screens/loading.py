"""Shown while a snapshot on an object store opens: the network may keep the viewer
waiting, so it says what it waits for, where, for how long so far and at most."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, Static

from ..text import safe


class LoadingScreen(Screen):
    DEFAULT_CSS = """
    #opening { align: center middle; }
    #opening-text { width: 100; max-width: 100%; height: auto; padding: 1 2; border: round $primary; }
    #opening LoadingIndicator { height: 3; }
    """
    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]

    def __init__(self, labels: list[str], endpoint: str, bound_s: float) -> None:
        super().__init__()
        self.labels, self.endpoint, self.bound_s = labels, endpoint, bound_s
        self.started = time.monotonic()

    def message(self) -> Text:
        text = Text("Opening ", style="bold")
        for i, label in enumerate(self.labels):
            text.append_text(safe(label, "bold"))
            if i + 1 < len(self.labels):
                text.append(" and ", style="bold")
        text.append(" from ")
        text.append_text(safe(self.endpoint))
        waited = time.monotonic() - self.started
        text.append(f"\n\nWaiting for the store: {waited:.0f} s so far; a store that does not answer is given up "
                    f"after at most {self.bound_s:.0f} s (HSNAP_S3_TIMEOUT, HSNAP_S3_RETRIES).", style="dim")
        return text

    def compose(self) -> ComposeResult:
        with Vertical(id="opening"):
            yield Static(self.message(), id="opening-text")
            yield LoadingIndicator()
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(1.0, self._tick)

    def _tick(self) -> None:
        self.query_one("#opening-text", Static).update(self.message())
