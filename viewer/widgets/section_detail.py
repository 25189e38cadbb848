"""One section, loaded only when selected: a banner when it is not intact, its
description, statistics and per-row norms (computed in a worker while its bytes
are hashed, so what is shown was checked), and a scrollable value grid."""

from __future__ import annotations

import math

import numpy as np
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Sparkline, Static
from textual.worker import get_current_worker

from hsnap_format import DigestMismatchError, HsnapError
from hsnap_format.spec import DTYPES
from hsnap_format.tools.stats import Cancelled, SectionStats, as_float64, chunks_stats
from hsnap_format.tools.viewmodel import NORM_FAMILIES, Selection, fmt_bytes

from ..model import MISMATCH, MISSING, OK, Document, SectionRef, aligned_to
from ..text import describe_error, fmt_num, safe
from .value_grid import ValueGrid

MAX_SPARK_POINTS = 512

# SectionStats field -> label, in display order
STAT_ROWS = (
    ("count", "elements"),
    ("finite", "finite"),
    ("nan", "NaN"),
    ("posinf", "+Inf"),
    ("neginf", "-Inf"),
    ("zero", "zeros"),
    ("min", "min"),
    ("max", "max"),
    ("mean", "mean"),
    ("std", "std"),
)

# digest status -> banner (what a user must know before reading any value)
BANNERS = {
    MISMATCH: "✗ DIGEST MISMATCH: these bytes are not what was written. The values below are what the file holds now.",
    MISSING: "✗ MISSING: this section lies beyond the end of the file (truncated or unfinished); nothing of it can be read.",
}


def stats_table(stats: SectionStats) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for field, label in STAT_ROWS:
        table.add_row(label, Text(fmt_num(getattr(stats, field))))
    return table


def whole(shape) -> Selection:
    return Selection(None, tuple(range(n) for n in (shape or (1,))))


class SectionDetail(Vertical):
    """Set ``ref`` to show a section; its statistics arrive from a worker."""

    ref: reactive[SectionRef | None] = reactive(None)

    class StatsReady(Message):
        def __init__(self, key: str, stats: SectionStats | None, norms: np.ndarray | None, error: str | None = None) -> None:
            super().__init__()
            self.key, self.stats, self.norms, self.error = key, stats, norms, error

    class Verified(Message):
        """The section's bytes were hashed while computing its statistics (bubbles to the screen)."""

        def __init__(self, key: str, status: str, detail: str = "") -> None:
            super().__init__()
            self.key, self.status, self.detail = key, status, detail

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc
        self._pending_view: tuple | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="detail-banner")
        yield Static(Text("Select a section in the tree or the geometry table.", style="dim"), id="detail-head")
        with Horizontal(id="detail-body"):
            with Vertical(id="detail-side"):
                yield Static(id="detail-stats")
                yield Static(id="norm-label")
                yield Sparkline([], id="detail-norms")
            yield ValueGrid(id="detail-grid")

    def on_mount(self) -> None:
        self.query_one("#detail-banner").display = False
        self.query_one("#detail-norms").display = False

    def show(self, ref: SectionRef, selection: Selection | None = None, cursor=None, mark=None) -> None:
        """Open ``ref`` with a selection / cursor cell / marked cell (diff: its first difference)."""
        self._pending_view = (selection, cursor, mark)
        if self.ref is not None and self.ref.key == ref.key:
            self._apply_view(ref)
        else:
            self.ref = ref

    def _apply_view(self, ref: SectionRef) -> None:
        selection, cursor, mark = self._pending_view or (None, None, None)
        self._pending_view = None
        self.query_one(ValueGrid).show(self.doc, ref, selection or whole(ref.info.shape), cursor=cursor, mark=mark)

    def update_banner(self) -> None:
        banner = self.query_one("#detail-banner", Static)
        status = self.doc.status.get(self.ref.key) if self.ref is not None else None
        text = BANNERS.get(status)
        banner.display = text is not None
        if text is not None:
            line = Text(text, style="bold")
            detail = self.doc.status_detail.get(self.ref.key)
            if detail:
                line.append(f"  ({detail})")
            banner.update(line)

    def watch_ref(self, ref: SectionRef | None) -> None:
        if ref is None:
            return
        s = ref.info
        head = Text()
        head.append_text(safe(self.doc.section_label(ref), "bold"))
        axes = f" [{', '.join(s.axes)}]" if s.axes else ""
        head.append(f"\n{self.doc.storage_dtype(ref)}  {list(s.shape)}{axes}  {math.prod(s.shape):,} elements  "
                    f"{fmt_bytes(s.length)} at {s.offset:,} (0x{s.offset:x}, aligned to {aligned_to(s.offset)})")
        head.append("\nstored digest ")
        head.append_text(safe(s.digest, "dim"))
        self.query_one("#detail-head", Static).update(head)
        self.update_banner()
        self.query_one("#detail-stats", Static).update(Text("hashing and computing statistics…", style="dim"))
        self.query_one("#norm-label", Static).update("")
        self.query_one("#detail-norms").display = False
        self._apply_view(ref)
        if self.doc.present(ref):
            self._compute(ref)
        else:
            self.query_one("#detail-stats", Static).update(Text("no data: missing from the file", style="red"))

    @work(thread=True, exclusive=True, group="stats")
    def _compute(self, ref: SectionRef) -> None:
        """One pass: hash (the verdict), statistics, and the norm of every slice along axis 0."""
        worker = get_current_worker()
        info = ref.info
        snap = self.doc.snapshot(ref)
        shape = info.shape or (1,)
        rows, per_row = shape[0], max(1, math.prod(shape[1:]))
        sums = np.zeros(rows, dtype=np.float64)
        verdict: list[HsnapError] = []

        def tapped():
            try:
                for start, chunk in snap.iter_chunks(info, verify=True, cancelled=lambda: worker.is_cancelled):
                    x = as_float64(chunk)
                    idx = (start + np.arange(x.size)) // per_row
                    if x.size:
                        with np.errstate(over="ignore", invalid="ignore"):
                            _add_rows(sums, idx, x * x)
                    yield start, chunk
            except DigestMismatchError as e:  # raised after the last chunk: the statistics stand
                verdict.append(e)

        try:
            stats = chunks_stats(tapped(), math.prod(info.shape), DTYPES[info.dtype], lambda: worker.is_cancelled)
        except Cancelled:
            return
        except Exception as e:  # shown, not raised: a bad section must not end the app
            self.post_message(self.StatsReady(ref.key, None, None, describe_error(e)))
            if isinstance(e, HsnapError):
                self.post_message(self.Verified(ref.key, MISSING if isinstance(e, EOFError) else MISMATCH, describe_error(e)))
            return
        if worker.is_cancelled:
            return
        norms = np.sqrt(sums) if len(shape) > 1 and info.kind in NORM_FAMILIES else None
        self.post_message(self.StatsReady(ref.key, stats, norms))
        if verdict:
            self.post_message(self.Verified(ref.key, MISMATCH, f"computed {verdict[0].found}"))
        else:
            self.post_message(self.Verified(ref.key, OK))

    def on_section_detail_stats_ready(self, event: StatsReady) -> None:
        event.stop()
        if self.ref is None or event.key != self.ref.key:
            return  # a stale result for a section no longer shown
        body = stats_table(event.stats) if event.stats else Text(event.error or "", style="red")
        self.query_one("#detail-stats", Static).update(body)
        spark = self.query_one("#detail-norms", Sparkline)
        if event.norms is not None and event.norms.size > 1:
            n = event.norms
            step = max(1, -(-n.size // MAX_SPARK_POINTS))
            spark.data = [float(v) for v in n[::step]]
            spark.display = True
            axis = NORM_FAMILIES.get(self.ref.info.kind, (None, "row"))[1]
            zeros = int(np.sum(n == 0))
            label = Text(f"norm per {axis} ({n.size})", style="bold")
            if zeros:
                label.append(f"  {zeros} all-zero", style="bold red")
            self.query_one("#norm-label", Static).update(label)


def _add_rows(sums: np.ndarray, idx: np.ndarray, sq: np.ndarray) -> None:
    """sums[idx] += sq for sorted, contiguous row indices (bincount: fast)."""
    lo = int(idx[0])
    part = np.bincount(idx - lo, weights=sq)
    sums[lo : lo + part.size] += part
