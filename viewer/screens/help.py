"""Keys and what the panes show (a modal over the current screen)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# hsnap-view

A read-only viewer for hsnap request snapshots (a rank file or a snapshot directory), and for
the directories a drain, a checkpointer or a migration writes: a listing of their entries to open.

| key | does |
|---|---|
| `1`–`7` | Geometry, Section, Digests, Identity, Request, Hex, Map tabs (the tab shown takes the keys) |
| arrows, `pgup` `pgdn` `home` `end` | move in the tab shown; tables move sideways by whole columns |
| `enter` | open the selected section (tree, geometry table, diff table); in a directory's listing, the entry |
| `escape` | from an entry back to the directory's listing it was opened from |
| `t` | hide / show the section tree (hidden at start below 100 columns) |
| `/` | search sections by name or label; `n` / `N` next / previous match |
| `g` | go to: `[5, 1, 3]` an element, `[100:120, 0, :8]` a slice, `attn.3.k[0, :, :]` another section; on the Request tab a history position |
| `o` | Request tab: the first output token |
| `[` `]` `<` `>` | Request tab: previous / next / first / last page of the token history |
| `r` | next rank (snapshot directories): Identity and Map tabs |
| `e` | export the open section to a `.npy` file (digest checked; bf16/fp8 as float32) |
| `y` | copy the value under the grid cursor, or the section's digest |
| `v` / `x` | verify every digest (background; Digests tab) and, for a delta or a paged file, its chain and pages as `hsnap verify` does, link by link / cancel |
| `d` | diff mode: against the second snapshot given, or one you name |
| `c` | check compatibility against another snapshot or an identity `.json` |
| `ctrl+p` | command palette: jump to a layer or a section |
| `?` / `f1` | this help; `escape` closes it |
| `q` / `ctrl+c` | quit |

**Section** hashes the section while computing its statistics over finite values
(NaN, ±Inf and zeros counted apart; bf16/fp8 in float64) and the norm of every
slice along its first axis (per token for K/V), and shows a red banner when the
bytes do not match the stored digest. The value grid reads only visible rows; the
top line gives the cursor value exactly, with its bits. A cell never shows part of a
number: `≈` marks a value rounded to fit its cell, `›` more columns to the right.

**Map** draws, per family (K, V, conv, temporal), one line per layer and one cell
per token / channel / head, coloured by L2 norm: an all-zero slice is a red `0`,
NaN/Inf a magenta `!`. A zeroed recurrent state still yields plausible tokens;
here it shows.

**Digests** lists sections that fail their digest (or are missing from a
truncated file) first, and names them in the summary. A delta's chain (the tree
shows each link and the attention rows it holds) and a paged file's pages are then
proved as `hsnap verify` proves them: the summary says `3 links ok`, or which link
failed and why.

**Diff** compares section by section in float64: status, largest absolute and
relative difference, the first differing element with both values (digits enough
to tell them apart, ulp distance, bits). Troubled sections come first and the
cursor starts on the first of them; `enter` opens A's section at its first
difference. Same as `hsnap diff A B`.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,f1", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)

    def action_close(self) -> None:
        self.dismiss(None)
