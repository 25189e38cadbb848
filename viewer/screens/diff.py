"""Two snapshots side by side: header differences (identity, geometry, request)
and, from a worker, per section: equal / max abs diff / first differing element,
its two values told apart (enough digits, ulp and bits). Troubled sections come
first and are named in the verdict; a side that fails its own digests is flagged.
Enter on a row opens the section (of A) at its first difference; until the cursor is
moved by hand it stays on the first row, the first difference once it is known."""

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

from hsnap_format.tools.diff import CORRUPT, EQUAL, SectionDiff, SectionPair, compare_pair, header_differences, rank_map, section_pairs
from hsnap_format.tools.stats import Cancelled
from hsnap_format.tools.viewmodel import fmt_value, ulp_distance, value_bits

from ..model import Document
from ..text import describe_error, fmt_num, safe
from ..widgets.vtable import Column, VTable

ERROR, PENDING = "error", "pending"
STATUS_STYLES = {"equal": "green", "differ": "bold red", "only-in-A": "yellow", "only-in-B": "yellow",
                 "shape-mismatch": "bold red", CORRUPT: "bold white on red", ERROR: "bold red", PENDING: "dim"}
# status -> place in the table: what needs a look comes first
ORDER = {CORRUPT: 0, ERROR: 0, "shape-mismatch": 1, "only-in-A": 2, "only-in-B": 2, "differ": 3, PENDING: 4, "equal": 5}
NAMES_IN_VERDICT = 4
BATCH_SECONDS = 0.1

COLUMNS = (  # what tells a user the most first: the first differing element and its two values
    ("section", None, "left"), ("status", 16, "left"), ("first diff", 16, "left"), ("A value", 13, "right"),
    ("B value", 13, "right"), ("ulp · bits", 28, "left"), ("differing", 15, "right"), ("max abs", 11, "right"), ("max rel", 11, "right"),
)


def _key(pair: SectionPair) -> str:
    return f"{pair.rank}:{pair.name}"


def diff_cells(d: SectionDiff) -> dict[str, Text]:
    """Cells of one compared section, by column."""
    first = "" if d.first_diff is None else str(list(d.first_diff))
    if d.status == "shape-mismatch":
        first = f"shape {list(d.shape_a)} vs {list(d.shape_b)}"
    elif d.status == CORRUPT:
        first = f"{d.corrupt} fails its digest"
    elif d.dtype_mismatch:
        first = f"dtype {d.dtype_a} vs {d.dtype_b} {first}"
    counted = d.status in ("equal", "differ")
    status = d.status if d.status != CORRUPT else f"{CORRUPT} ({d.corrupt})"
    bits = ""
    if d.first_diff is not None and d.dtype_a == d.dtype_b:
        ulp = ulp_distance(d.first_a, d.first_b, d.dtype_a)
        ba, bb = value_bits(d.first_a, d.dtype_a), value_bits(d.first_b, d.dtype_b)
        bits = ("" if ulp is None else f"{ulp} ulp · ") + f"{ba}/{bb}"
    return {
        "status": Text(status, style=STATUS_STYLES[d.status]),
        "max abs": Text(fmt_num(d.max_abs_diff)),
        "max rel": Text(fmt_num(d.max_rel_diff)),
        "differing": Text(f"{d.count_differ:,}/{d.elements:,}" if counted else ""),
        "first diff": Text(first),
        "A value": Text(fmt_value(d.first_a, d.dtype_a) if d.first_diff else ""),
        "B value": Text(fmt_value(d.first_b, d.dtype_b) if d.first_diff else ""),
        "ulp · bits": Text(bits, style="dim"),
    }


class DiffScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("enter", "open_section", "Open at 1st difference", show=True),
        Binding("r", "rerun", "Compare again"),
        Binding("x", "cancel", "Cancel"),
    ]

    class Compared(Message):
        """Results since the last batch (posted from the worker thread)."""

        def __init__(self, results: list[tuple[str, SectionDiff | None, str]], nbytes: int) -> None:
            super().__init__()
            self.results, self.nbytes = results, nbytes

    class Done(Message):
        def __init__(self, cancelled: bool) -> None:
            super().__init__()
            self.cancelled = cancelled

    def __init__(self, a: Document, b: Document, *, atol: float = 0.0, rtol: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.atol, self.rtol = atol, rtol
        self.pairs = section_pairs(a.source, b.source)
        self._pairs = {_key(p): p for p in self.pairs}
        self.results: dict[str, SectionDiff] = {}
        self.errors: dict[str, str] = {}
        self._worker: Worker | None = None
        self._note = "comparing…"
        self._following: str | None = None  # the key the cursor was put on (row 0); None once moved by hand

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
            width = max([7, *(len(self._label(p)) for p in self.pairs)])
            columns = [Column(name, name, width if w is None else w, justify) for name, w, justify in COLUMNS]
            yield VTable(columns, self._cell, keys=self._order(), id="section-diffs")
        yield Footer()

    @staticmethod
    def _nbytes(pair: SectionPair) -> int:
        return (pair.a.length if pair.a else 0) + (pair.b.length if pair.b else 0)

    def status_of(self, key: str) -> str:
        if key in self.errors:
            return ERROR
        d = self.results.get(key)
        return PENDING if d is None else d.status

    def _order(self) -> list[str]:
        keys = [_key(p) for p in self.pairs]
        return sorted(keys, key=lambda k: ORDER.get(self.status_of(k), 4))  # stable: file order within a status

    def _cell(self, key: str, column: str):
        if column == "section":
            st = self.status_of(key)
            return safe(self._label(self._pairs[key]), "bold red" if ORDER.get(st, 4) < 4 and st != "equal" else "")
        if key in self.errors:
            return {"status": Text(ERROR, style="bold red"), "first diff": Text(self.errors[key], style="red")}.get(column, Text(""))
        d = self.results.get(key)
        if d is None:
            return Text(PENDING, style="dim") if column == "status" else Text("")
        return diff_cells(d).get(column, Text(""))

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
        self.query_one(VTable).focus()
        self.action_rerun()

    def verdict_text(self) -> Text:
        troubled = [k for k in self._order() if self.status_of(k) not in (EQUAL, PENDING)]
        text = Text(f"{len(self.results) + len(self.errors)}/{len(self.pairs)} sections compared, ")
        text.append(f"{len(troubled)} differ", style="bold red" if troubled else "green")
        if troubled:
            names = ", ".join(self._label(self._pairs[k]) for k in troubled[:NAMES_IN_VERDICT])
            more = f" and {len(troubled) - NAMES_IN_VERDICT} more" if len(troubled) > NAMES_IN_VERDICT else ""
            text.append(": ")
            text.append_text(safe(names + more, "bold red"))
        text.append("  ·  headers ")
        text.append("same" if self.header_same else "DIFFER (see below)", style="green" if self.header_same else "bold red")
        text.append(f"  ·  {self._note}", style="dim")
        for side, doc in (("A", self.a), ("B", self.b)):
            bad = [self._label(self._pairs[k]) for k, d in self.results.items() if d.status == CORRUPT and side in (d.corrupt or "")]
            if bad:
                text.append(f"\n{side} ({doc.label}) FAILS ITS OWN DIGESTS: ", style="bold white on red")
                text.append_text(safe(", ".join(bad[:NAMES_IN_VERDICT]) + (" …" if len(bad) > NAMES_IN_VERDICT else ""), "bold red"))
                text.append("  (its values are not what was written)", style="red")
        return text

    def _verdict(self) -> None:
        self.query_one("#diff-verdict", Static).update(self.verdict_text())

    @work(thread=True, exclusive=True, group="diff")
    def _compare(self) -> None:
        import time

        worker = get_current_worker()
        batch, nbytes, last = [], 0, time.monotonic()
        for pair in self.pairs:
            if worker.is_cancelled:
                break
            try:
                result = compare_pair(pair, atol=self.atol, rtol=self.rtol, cancelled=lambda: worker.is_cancelled)
                batch.append((_key(pair), result, ""))
            except Cancelled:
                break
            except Exception as e:  # shown in the row; the scan goes on
                batch.append((_key(pair), None, describe_error(e)))
            nbytes += self._nbytes(pair)
            if time.monotonic() - last >= BATCH_SECONDS:
                self.post_message(self.Compared(batch, nbytes))
                batch, nbytes, last = [], 0, time.monotonic()
        if batch:
            self.post_message(self.Compared(batch, nbytes))
        self.post_message(self.Done(worker.is_cancelled))

    @on(Compared)
    def _compared(self, event: Compared) -> None:
        for key, result, error in event.results:
            if result is None:
                self.errors[key] = error
            else:
                self.results[key] = result
        self._set_rows()
        self.query_one(ProgressBar).advance(event.nbytes)
        self._verdict()

    @on(Done)
    def _done(self, event: Done) -> None:
        self._note = "cancelled" if event.cancelled else "done"
        self._verdict()

    def action_rerun(self) -> None:
        self.results.clear()
        self.errors.clear()
        self.query_one(ProgressBar).update(progress=0)
        self._note = "comparing…"
        self._set_rows(follow=True)
        self._verdict()
        self._worker = self._compare()

    def action_cancel(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    def _set_rows(self, *, follow: bool = False) -> None:
        """Rows in the current order; the cursor on row 0 (what needs a look first) while
        it is where this put it, on its own key once moved by hand."""
        table = self.query_one(VTable)
        follow = follow or (self._following is not None and table.cursor_key == self._following)
        table.set_rows(self._order(), fit=False)
        if follow:
            table.move_cursor(0)
        self._following = table.cursor_key if follow else None

    @on(VTable.Selected)
    def _row_selected(self, event: VTable.Selected) -> None:
        event.stop()
        self.open_section(event.key)

    def action_open_section(self) -> None:
        key = self.query_one(VTable).cursor_key
        if key is not None:
            self.open_section(key)

    def open_section(self, key: str) -> None:
        """The section of A, its grid at the first differing element (marked)."""
        if key not in self.a:
            self.notify(f"{self._label(self._pairs[key])} is only in B", severity="warning", markup=False)
            return
        d = self.results.get(key)
        first = d.first_diff if d is not None else None
        self.app.open_section_at(key, first)

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()
