"""Heatmaps of state norms: one map per family (attention K, V, conv, temporal),
one line per layer, one cell per token (K/V), channel (conv) or head (temporal),
coloured by the L2 norm of that slice. A zeroed or stale layer is the failure that
matters most (a zeroed recurrent state still yields plausible tokens): an all-zero
slice is a red ``0``, NaN/Inf a magenta ``!``, and each line ends with its verdict.

Norms are computed on demand (the Map tab), in a worker, with pread."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static
from textual.worker import Worker, get_current_worker

from hsnap_format import HsnapError
from hsnap_format.tools.stats import Cancelled
from hsnap_format.tools.viewmodel import NormRow, norm_groups, row_norms

from ..model import Document
from ..text import describe_error

# low -> high norm (viridis): no red in it, so the red of an all-zero slice stands alone
RAMP = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725")
ZERO = Style(color="white", bgcolor="red", bold=True)
NONFINITE = Style(color="white", bgcolor="magenta", bold=True)
TITLE = Style(bold=True)
LABEL = Style(color="cyan")
BAD = Style(color="red", bold=True)
DIM = Style(dim=True)
TAIL = 14  # the verdict at the end of each line
MAX_CELL = 4  # cells per value when there are few values (heads)


@dataclass
class _Group:
    title: str
    rows: list[NormRow] = field(default_factory=list)
    vmax: float = 0.0


class NormMapView(ScrollView, can_focus=True):
    """Draws the groups line by line; each line is binned to the width it has."""

    DEFAULT_CSS = "NormMapView { height: 1fr; padding: 0 1; }"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.groups: dict[str, _Group] = {}
        self._lines: list[tuple[str, str, int]] = []  # (kind, group, row index)
        self._label_w = 8

    def add_rows(self, group: str, rows: list[NormRow]) -> None:
        g = self.groups.setdefault(group, _Group(group))
        for r in rows:
            g.rows.append(r)
            finite = r.norms[np.isfinite(r.norms)]
            if finite.size:
                g.vmax = max(g.vmax, float(finite.max()))
            self._label_w = max(self._label_w, len(r.name) + 1)
        self._layout()

    def _layout(self) -> None:
        lines = []
        for name, g in self.groups.items():
            lines.append(("title", name, 0))
            lines.append(("legend", name, 0))
            lines += [("row", name, i) for i in range(len(g.rows))]
            lines.append(("blank", name, 0))
        self._lines = lines
        self.virtual_size = Size(self.size.width, len(lines))
        self.refresh()

    def clear(self) -> None:
        self.groups.clear()
        self._layout()

    def row_text(self, group: str, i: int, width: int = 80) -> str:
        """A row as plain text (tests and copying): label, one character per bin, verdict."""
        return Strip(self._row(self.groups[group], i, width)).text

    def _row(self, g: _Group, i: int, width: int) -> list[Segment]:
        r = g.rows[i]
        segs = [Segment(r.name.ljust(self._label_w), LABEL)]
        cells = max(1, width - self._label_w - TAIL)
        n = r.norms.size
        bins = min(n, cells)
        wide = max(1, min(MAX_CELL, cells // max(1, bins)))  # few values: wider cells
        edges = np.linspace(0, n, bins + 1).astype(int) if n else np.zeros(1, int)
        for b in range(bins):
            seg = r.norms[edges[b] : max(edges[b] + 1, edges[b + 1])]
            finite = seg[np.isfinite(seg)]
            if finite.size < seg.size:
                segs.append(Segment("!".ljust(wide), NONFINITE))
            elif np.any(seg == 0):  # zero wins over the mean: one stale token must not hide
                segs.append(Segment("0".ljust(wide), ZERO))
            else:
                level = float(finite.mean()) / g.vmax if g.vmax > 0 else 0.0
                color = RAMP[min(len(RAMP) - 1, int(level * len(RAMP)))]
                segs.append(Segment(" " * wide, Style(bgcolor=color)))
        finite = r.norms[np.isfinite(r.norms)]
        if r.all_zero:
            tail, style = "ALL ZERO", BAD
        elif finite.size < n:
            tail, style = f"{n - finite.size} NaN/Inf", BAD
        elif np.any(r.norms == 0):
            tail, style = f"{int(np.sum(r.norms == 0))} zero", BAD
        else:
            tail, style = f"max {float(finite.max()):.3g}" if finite.size else "", DIM
        segs.append(Segment(" " + tail.ljust(TAIL - 1), style))
        return segs

    def render_line(self, y: int) -> Strip:
        _, scroll_y = self.scroll_offset
        width = self.size.width
        i = scroll_y + y
        if i >= len(self._lines):
            return Strip.blank(width)
        kind, name, k = self._lines[i]
        g = self.groups[name]
        if kind == "title":
            n = g.rows[0].norms.size if g.rows else 0
            text = f"{name}: {len(g.rows)} layers × {n}"
            return Strip([Segment(text, TITLE)]).crop_extend(0, width, None)
        if kind == "legend":
            segs = [Segment(" " * self._label_w), Segment("0 ", DIM)]
            segs += [Segment(" ", Style(bgcolor=c)) for c in RAMP]
            segs += [Segment(f" {g.vmax:.3g}  L2 norm  ", DIM), Segment("0", ZERO), Segment(" all zero  ", DIM),
                     Segment("!", NONFINITE), Segment(" NaN/Inf", DIM)]
            return Strip(segs).crop_extend(0, width, None)
        if kind == "blank":
            return Strip.blank(width)
        return Strip(self._row(g, k, width)).crop_extend(0, width, None)

    def on_resize(self) -> None:
        self._layout()


class NormPanel(Vertical):
    """The Map tab: a status line and the heatmaps, computed the first time it is shown."""

    class Rows(Message):
        def __init__(self, group: str, rows: list[NormRow], nbytes: int) -> None:
            super().__init__()
            self.group, self.rows, self.nbytes = group, rows, nbytes

    class Done(Message):
        def __init__(self, cancelled: bool, errors: list[str]) -> None:
            super().__init__()
            self.cancelled, self.errors = cancelled, errors

    def __init__(self, doc: Document, rank: int, **kw) -> None:
        super().__init__(**kw)
        self.doc, self.rank = doc, rank
        self._worker: Worker | None = None
        self.started = False
        snap = doc.ranks[rank]
        self._groups = norm_groups(snap.sections)
        self._total = sum(s.length for g in self._groups.values() for s in g) or 1
        self._done_bytes = 0

    def compose(self) -> ComposeResult:
        yield Static(id="norm-status")
        yield NormMapView(id="norm-map")

    def on_mount(self) -> None:
        self._status("norms are computed when this tab is opened" if self._groups else "no state sections")

    def _status(self, text: str, style: str = "dim") -> None:
        from rich.text import Text

        self.query_one("#norm-status", Static).update(Text(text, style=style))

    def start(self) -> None:
        if self.started or not self._groups:
            return
        self.started = True
        self._status(f"computing norms of rank {self.rank}…")
        self._worker = self._compute()

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    def set_rank(self, rank: int, *, start: bool) -> None:
        if rank == self.rank:
            return
        self.cancel()
        self.rank, self.started, self._done_bytes = rank, False, 0
        self._groups = norm_groups(self.doc.ranks[rank].sections)
        self._total = sum(s.length for g in self._groups.values() for s in g) or 1
        self.query_one(NormMapView).clear()
        self._status(f"rank {rank}: norms are computed when this tab is opened")
        if start:
            self.start()

    @work(thread=True, exclusive=True, group="norms")
    def _compute(self) -> None:
        worker = get_current_worker()
        snap = self.doc.ranks[self.rank]
        errors = []
        for group, sections in self._groups.items():
            for s in sections:
                if worker.is_cancelled:
                    break
                try:
                    norms = row_norms(snap, s, cancelled=lambda: worker.is_cancelled)
                except Cancelled:
                    break
                except HsnapError as e:  # a missing (truncated) section: a row of NaN, named below
                    errors.append(f"{s.name}: {describe_error(e)}")
                    norms = np.full(s.shape[0] if s.shape else 1, np.nan)
                self.post_message(self.Rows(group, [NormRow(s.layer or 0, s.name, f"{self.rank}:{s.name}", norms)], s.length))
        self.post_message(self.Done(worker.is_cancelled, errors))

    def on_norm_panel_rows(self, event: Rows) -> None:
        if not event.rows or not event.rows[0].key.startswith(f"{self.rank}:"):
            return  # from a rank no longer shown
        self.query_one(NormMapView).add_rows(event.group, event.rows)
        self._done_bytes += event.nbytes
        self._status(f"computing norms of rank {self.rank}… {100 * self._done_bytes // self._total}%")

    def on_norm_panel_done(self, event: Done) -> None:
        view = self.query_one(NormMapView)
        zero = [r.name for g in view.groups.values() for r in g.rows if r.all_zero]
        text = f"rank {self.rank}: {sum(len(g.rows) for g in view.groups.values())} sections"
        if event.cancelled:
            text += " (cancelled)"
        if zero:
            text += f"  ·  ALL-ZERO: {', '.join(zero[:6])}{' …' if len(zero) > 6 else ''}"
        if event.errors:
            text += f"  ·  unreadable: {'; '.join(event.errors[:2])}"
        self._status(text, "bold red" if zero or event.errors else "")


__all__ = ["NormPanel", "NormMapView", "RAMP"]
