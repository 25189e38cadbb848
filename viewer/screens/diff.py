"""Two snapshots side by side: header differences (identity, geometry, request)
and, from a worker, per section equal / max abs diff / first differing element."""

from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, ProgressBar, Static
from textual.worker import Worker, get_current_worker

from hsnap_format.diff import EQUAL, SectionDiff, SectionPair, compare_pair, header_differences, rank_map, section_pairs
from hsnap_format.stats import Cancelled

from ..model import Document
from ..text import describe_error, fmt_num, safe

STATUS_STYLES = {"equal": "green", "differ": "bold red", "only-in-A": "yellow", "only-in-B": "yellow", "shape-mismatch": "bold red"}
SECTION_COLUMNS = ("section", "status", "max abs", "max rel", "differing", "first diff", "A value", "B value")


def _key(pair: SectionPair) -> str:
    return f"{pair.rank}:{pair.name}"


def diff_cells(d: SectionDiff) -> dict[str, Text]:
    """Cells of one compared section, by column."""
    first = "" if d.first_diff is None else str(list(d.first_diff))
    if d.status == "shape-mismatch":
        first = f"shape {list(d.shape_a)} vs {list(d.shape_b)}"
    elif d.dtype_mismatch:
        first = f"dtype {d.dtype_a} vs {d.dtype_b} {first}"
    counted = d.status in ("equal", "differ")
    return {
        "status": Text(d.status, style=STATUS_STYLES[d.status]),
        "max abs": Text(fmt_num(d.max_abs_diff), justify="right"),
        "max rel": Text(fmt_num(d.max_rel_diff), justify="right"),
        "differing": Text(f"{d.count_differ:,}/{d.elements:,}" if counted else "", justify="right"),
        "first diff": Text(first),
        "A value": Text(fmt_num(d.first_a) if d.first_diff else "", justify="right"),
        "B value": Text(fmt_num(d.first_b) if d.first_diff else "", justify="right"),
    }


class DiffScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("r", "rerun", "Compare again"),
        Binding("x", "cancel", "Cancel"),
    ]

    class Compared(Message):
        def __init__(self, key: str, result: SectionDiff | None, nbytes: int, error: str = "") -> None:
            super().__init__()
            self.key, self.result, self.nbytes, self.error = key, result, nbytes, error

    class Done(Message):
        def __init__(self, cancelled: bool) -> None:
            super().__init__()
            self.cancelled = cancelled

    def __init__(self, a: Document, b: Document, *, atol: float = 0.0, rtol: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.atol, self.rtol = atol, rtol
        self.pairs = section_pairs(a.source, b.source)
        self.results: dict[str, SectionDiff] = {}
        self._worker: Worker | None = None

    def _label(self, pair: SectionPair) -> str:
        return f"rank{pair.rank}/{pair.name}" if (self.a.multi_rank or self.b.multi_rank) else pair.name

    def compose(self) -> ComposeResult:
        title = Text("diff  A ")
        title.append_text(safe(self.a.label, "bold"))
        title.append("  B ")
        title.append_text(safe(self.b.label, "bold"))
        title.append(f"  ·  atol {self.atol:g}  rtol {self.rtol:g}", style="dim")
        yield Static(title, id="title")
        with Vertical(id="diff-body"):
            yield Static(id="diff-verdict")
            yield DataTable(cursor_type="row", id="header-diffs")
            yield ProgressBar(total=sum(self._nbytes(p) for p in self.pairs) or 1, show_eta=False, id="diff-progress")
            yield DataTable(cursor_type="row", zebra_stripes=True, id="section-diffs")
        yield Footer()

    @staticmethod
    def _nbytes(pair: SectionPair) -> int:
        return (pair.a.length if pair.a else 0) + (pair.b.length if pair.b else 0)

    def on_mount(self) -> None:
        headers = self.query_one("#header-diffs", DataTable)
        headers.add_columns("part", "field", "A", "B")
        ra, rb = rank_map(self.a.source), rank_map(self.b.source)
        diffs = {rank: header_differences(ra[rank], rb[rank]) for rank in sorted(set(ra) & set(rb))}
        self.header_same = set(ra) == set(rb) and all(h.same for h in diffs.values())
        if set(ra) != set(rb):
            headers.add_row(Text("ranks", style="bold"), Text("ranks present"), Text(str(sorted(ra))), Text(str(sorted(rb))))
        for rank, h in diffs.items():
            where = f"rank {rank} " if len(ra) > 1 or len(rb) > 1 else ""
            for part, rows in (("identity", h.identity), ("geometry", h.geometry), ("request", h.request), ("info", h.info)):
                for field, x, y in rows:
                    headers.add_row(Text(where + part, style="dim" if part == "info" else "bold"), safe(field), safe(repr(x)), safe(repr(y)))
        headers.display = headers.row_count > 0
        table = self.query_one("#section-diffs", DataTable)
        for col in SECTION_COLUMNS:
            table.add_column(col, key=col)
        for pair in self.pairs:
            cells = {c: Text("") for c in SECTION_COLUMNS}
            cells["section"] = safe(self._label(pair))
            cells["status"] = Text("pending", style="dim")
            table.add_row(*cells.values(), key=_key(pair))
        self.action_rerun()

    def _verdict(self, note: str) -> None:
        differ = [d for d in self.results.values() if d.status != EQUAL]
        text = Text(f"{len(self.results)}/{len(self.pairs)} sections compared, ")
        text.append(f"{len(differ)} differ", style="bold red" if differ else "green")
        text.append("  ·  headers ")
        text.append("same" if self.header_same else "DIFFER (see below)", style="green" if self.header_same else "bold red")
        text.append(f"  ·  {note}", style="dim")
        self.query_one("#diff-verdict", Static).update(text)

    @work(thread=True, exclusive=True, group="diff")
    def _compare(self) -> None:
        worker = get_current_worker()
        for pair in self.pairs:
            if worker.is_cancelled:
                break
            try:
                result = compare_pair(pair, atol=self.atol, rtol=self.rtol, cancelled=lambda: worker.is_cancelled)
            except Cancelled:
                break
            except Exception as e:  # shown in the row; the scan goes on
                self.post_message(self.Compared(_key(pair), None, self._nbytes(pair), describe_error(e)))
                continue
            self.post_message(self.Compared(_key(pair), result, self._nbytes(pair)))
        self.post_message(self.Done(worker.is_cancelled))

    @on(Compared)
    def _compared(self, event: Compared) -> None:
        table = self.query_one("#section-diffs", DataTable)
        if event.result is None:
            table.update_cell(event.key, "status", Text("error", style="bold red"), update_width=True)
            table.update_cell(event.key, "first diff", Text(event.error, style="red"), update_width=True)
        else:
            self.results[event.key] = event.result
            for col, cell in diff_cells(event.result).items():
                table.update_cell(event.key, col, cell, update_width=True)
        self.query_one(ProgressBar).advance(event.nbytes)
        self._verdict("comparing…")

    @on(Done)
    def _done(self, event: Done) -> None:
        self._verdict("cancelled" if event.cancelled else "done")

    def action_rerun(self) -> None:
        self.results.clear()
        self.query_one(ProgressBar).update(progress=0)
        self._verdict("comparing…")
        self._worker = self._compare()

    def action_cancel(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()
