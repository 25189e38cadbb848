"""Digest verification in a background thread: a progress bar (by bytes) and a
status per section: ok / MISMATCH / pending. Cancellable between sections."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, ProgressBar, Static
from textual.worker import Worker, get_current_worker

from hsnap_format import DigestMismatchError, HsnapError

from ..model import Document
from ..text import describe_error, safe

OK, MISMATCH, PENDING = "ok", "MISMATCH", "pending"
STATUS_STYLES = {OK: "green", MISMATCH: "bold red", PENDING: "dim"}


def _detail(err: HsnapError | None) -> str:
    if err is None:
        return ""
    return f"computed {err.found}" if isinstance(err, DigestMismatchError) else describe_error(err)


class DigestPanel(Vertical):
    class Checked(Message):
        """One section verified (posted from the worker thread)."""

        def __init__(self, key: str, status: str, nbytes: int, detail: str = "") -> None:
            super().__init__()
            self.key, self.status, self.nbytes, self.detail = key, status, nbytes, detail

    class Finished(Message):
        def __init__(self, cancelled: bool, padding: str) -> None:
            super().__init__()
            self.cancelled, self.padding = cancelled, padding

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc
        self.status: dict[str, str] = {ref.key: PENDING for ref in doc.refs}
        self._worker: Worker | None = None
        self._note = "not verified yet: press v"

    def compose(self) -> ComposeResult:
        yield Static(id="digest-summary")
        yield ProgressBar(total=sum(r.info.length for r in self.doc.refs) or 1, show_eta=False, id="digest-progress")
        yield DataTable(cursor_type="row", id="digest-table")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        rank = ("rank",) if self.doc.multi_rank else ()
        for label in (*rank, "section", "stored digest", "status", "detail"):
            table.add_column(label, key=label)
        for ref in self.doc.refs:
            table.add_row(*([Text(str(ref.rank))] if rank else []), safe(ref.info.name), safe(ref.info.digest, "dim"),
                          self._status_text(PENDING), Text(""), key=ref.key)
        self._summarize()

    @staticmethod
    def _status_text(status: str) -> Text:
        return Text(status, style=STATUS_STYLES[status])

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.is_running

    @property
    def mismatches(self) -> list[str]:
        return [k for k, s in self.status.items() if s == MISMATCH]

    def _summarize(self) -> None:
        counts = {s: sum(v == s for v in self.status.values()) for s in (OK, MISMATCH, PENDING)}
        text = Text()
        text.append(f"{counts[OK]} ok", style="green")
        text.append("  ")
        text.append(f"{counts[MISMATCH]} MISMATCH", style="bold red" if counts[MISMATCH] else "")
        text.append(f"  {counts[PENDING]} pending  ·  {self._note}")
        self.query_one("#digest-summary", Static).update(text)

    def start(self) -> None:
        """(Re)start the scan from the first section."""
        table = self.query_one(DataTable)
        for key in self.status:
            self.status[key] = PENDING
            table.update_cell(key, "status", self._status_text(PENDING))
        self.query_one(ProgressBar).update(progress=0)
        self._note = "verifying…"
        self._summarize()
        self._worker = self._scan()

    def cancel(self) -> None:
        if self.running:
            self._worker.cancel()

    @work(thread=True, exclusive=True, group="verify")
    def _scan(self) -> None:
        worker = get_current_worker()
        padding = []
        for rank, snap in sorted(self.doc.ranks.items()):
            for info, err in snap.iter_verify(cancelled=lambda: worker.is_cancelled):
                self.post_message(self.Checked(f"{rank}:{info.name}", OK if err is None else MISMATCH, info.length, _detail(err)))
            if worker.is_cancelled:
                break
            try:
                snap.check_padding()
            except HsnapError as e:
                padding.append(describe_error(e))
        self.post_message(self.Finished(worker.is_cancelled, "; ".join(padding) or "padding all zero"))

    def on_digest_panel_checked(self, event: Checked) -> None:
        self.status[event.key] = event.status
        table = self.query_one(DataTable)
        table.update_cell(event.key, "status", self._status_text(event.status), update_width=True)
        if event.detail:
            table.update_cell(event.key, "detail", Text(event.detail, style="red"), update_width=True)
        self.query_one(ProgressBar).advance(event.nbytes)
        self._summarize()  # the event bubbles on to the screen (tree marks)

    def on_digest_panel_finished(self, event: Finished) -> None:
        self._note = "cancelled" if event.cancelled else f"done; {event.padding}"
        self._summarize()
