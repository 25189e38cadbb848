"""Messages that travel up from widgets to their screen (attributes go down)."""

from __future__ import annotations

from textual.message import Message


class SectionChosen(Message):
    """The user picked a section (tree, geometry table, command palette)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key


class PaneWanted(Message):
    """The user picked a node that has a pane of its own (manifest, request record)."""

    def __init__(self, pane: str) -> None:
        super().__init__()
        self.pane = pane
