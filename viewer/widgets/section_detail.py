"""One section, loaded only when selected: description, statistics (computed in a
worker, chunked), a sample of values and a hex view with absolute offsets."""

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
from textual.widgets import Static
from textual.worker import get_current_worker

from hsnap_format import HsnapError
from hsnap_format.stats import Cancelled, SectionStats, is_float

from ..model import Document, SectionRef, alignment
from ..text import describe_error, fmt_num, safe
from .hex_view import HexView

SAMPLE_ROWS = 10
SAMPLE_COLS = 6

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


def stats_table(stats: SectionStats) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for field, label in STAT_ROWS:
        table.add_row(label, Text(fmt_num(getattr(stats, field))))
    return table


def sample_text(arr: np.ndarray, shape: tuple[int, ...] | None = None) -> Text:
    """The first rows along the last axis, each labelled with its index in ``shape``
    (the section's shape; ``arr`` may hold only its first rows)."""
    shape = arr.shape if shape is None else tuple(shape)
    if arr.size == 0:
        return Text("(empty)", style="dim")
    rows = arr.reshape(-1, shape[-1]) if len(shape) > 1 else arr.reshape(1, -1)
    lead = shape[:-1] if len(shape) > 1 else ()
    out = Text(no_wrap=True, overflow="crop")  # a narrow pane crops rows, never wraps them
    for i in range(min(SAMPLE_ROWS, rows.shape[0])):
        row = rows[i, :SAMPLE_COLS]
        values = row.astype(np.float64) if is_float(arr.dtype) else row.view(np.uint8) if row.dtype == np.bool_ else row
        index = ",".join(map(str, np.unravel_index(i, lead))) + ",:" if lead else ":"
        out.append(f"[{index}]".ljust(10), style="cyan")
        out.append(" ".join(f"{fmt_num(v.item()):>11}" for v in values))
        if rows.shape[1] > SAMPLE_COLS:
            out.append("  …", style="dim")
        out.append("\n")
    total_rows = math.prod(lead) if lead else 1
    if total_rows > SAMPLE_ROWS:
        out.append(f"… {total_rows - SAMPLE_ROWS:,} more rows", style="dim")
    return out


class SectionDetail(Vertical):
    """Set ``ref`` to show a section; its statistics arrive from a worker."""

    ref: reactive[SectionRef | None] = reactive(None)

    class StatsReady(Message):
        def __init__(self, key: str, stats: SectionStats | None, error: str | None = None) -> None:
            super().__init__()
            self.key, self.stats, self.error = key, stats, error

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc

    def compose(self) -> ComposeResult:
        yield Static(Text("Select a section in the tree or the geometry table.", style="dim"), id="detail-head")
        with Horizontal(id="detail-body"):
            yield Static(id="detail-stats")
            yield Static(id="detail-sample")
        yield HexView(id="detail-hex")

    def watch_ref(self, ref: SectionRef | None) -> None:
        if ref is None:
            return
        s = ref.info
        head = Text()
        head.append_text(safe(self.doc.section_label(ref), "bold"))
        axes = f" [{', '.join(s.axes)}]" if s.axes else ""
        head.append(f"\n{self.doc.storage_dtype(ref)}  shape {list(s.shape)}{axes}  {math.prod(s.shape):,} elements  "
                    f"{s.length:,} bytes at offset {s.offset:,} (0x{s.offset:x}, align {alignment(s.offset)})")
        head.append("\nstored digest ")
        head.append_text(safe(s.digest, "dim"))
        self.query_one("#detail-head", Static).update(head)
        self.query_one("#detail-stats", Static).update(Text("computing statistics…", style="dim"))
        sample = Text("first values (C order)\n", style="bold", no_wrap=True)
        try:
            sample.append_text(sample_text(self.doc.head(ref, SAMPLE_ROWS + 1), s.shape))
        except HsnapError as e:  # e.g. the file was truncated after open: say so, keep running
            sample.append_text(Text(describe_error(e), style="red"))
        self.query_one("#detail-sample", Static).update(sample)
        self.query_one(HexView).show(self.doc.raw(ref), s.offset)
        self._compute(ref)

    @work(thread=True, exclusive=True, group="stats")
    def _compute(self, ref: SectionRef) -> None:
        worker = get_current_worker()
        try:
            stats = self.doc.stats(ref, cancelled=lambda: worker.is_cancelled)
        except Cancelled:
            return
        except Exception as e:  # shown, not raised: a bad section must not end the app
            self.post_message(self.StatsReady(ref.key, None, describe_error(e)))
            return
        self.post_message(self.StatsReady(ref.key, stats))

    def on_section_detail_stats_ready(self, event: StatsReady) -> None:
        event.stop()
        if self.ref is None or event.key != self.ref.key:
            return  # a stale result for a section no longer shown
        body = stats_table(event.stats) if event.stats else Text(event.error or "", style="red")
        self.query_one("#detail-stats", Static).update(body)
