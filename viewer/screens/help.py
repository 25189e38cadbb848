"""Keys and what the panes show (a modal over the current screen)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# hsnap-view

A read-only viewer for hsnap request snapshots (a rank file or a snapshot directory).

| key | does |
|---|---|
| `v` | verify every section digest (background; progress on the Digests tab) |
| `x` | cancel the running scan |
| `d` | diff mode, when two snapshots were given (`hsnap-view A B`) |
| `c` | check compatibility against another snapshot or an identity `.json` |
| `[` `]` | previous / next page of the token history (Request tab) |
| `1`–`5` | Geometry, Section, Digests, Identity, Request tabs |
| `enter` | open the selected section (tree or geometry table) |
| `ctrl+p` | command palette: type a layer or a section name to jump to it |
| `?` / `f1` | this help; `escape` closes it |
| `q` | quit |

**Section** shows, for the selected section only: statistics over its finite values
(NaN, ±Inf and zeros counted apart; bf16 and fp8 computed in float64, chunk by chunk),
the first values, and a hex view with absolute file offsets.

**Diff** compares section by section in float64: status (equal, differ, only-in-A,
only-in-B, shape-mismatch), largest absolute and relative difference, and the first
differing element, plus identity, geometry and request differences.
The same comparison is `hsnap diff A B` (exit 0 same, 1 differ, 2 error).
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,f1", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)

    def action_close(self) -> None:
        self.dismiss(None)
