"""Digest verification in a background thread: a progress bar (by bytes) and a
status per section (ok / MISMATCH / MISSING / pending), problems listed first and
named in the summary line. Cancellable between sections and between 2 MiB chunks.

A delta or a paged file is then proved as ``hsnap verify`` proves it: its chain's one
proof (hsnap_format's ``Chain.proof_failures``: every link's bytes, each base's record
a prefix of its delta's, every page reference and page), reported per link and for
the pages. That proof has no progress or cancel hook: it runs after the bar is full,
and a cancel takes effect when it returns.

The scan is linear in the number of sections: results travel in batches (a few
per second, not one message per section), counts are kept as they change, and
the table draws only its visible rows.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import ProgressBar, Static
from textual.worker import Worker, get_current_worker

from hsnap_format import DigestMismatchError, HsnapError, TruncatedError
from hsnap_format.chain import Chain
from hsnap_format.tools.viewmodel import ChainProof, prove_chain

from ..model import MISMATCH, MISSING, OK, PENDING, PROBLEMS, Document
from ..text import describe_error, safe
from .vtable import Column, VTable

STATUS_STYLES = {OK: "green", MISMATCH: "bold red", MISSING: "bold red", PENDING: "dim"}
BATCH_SECONDS = 0.1  # how often results reach the screen while scanning
NAMES_IN_SUMMARY = 4

# refusal -> (status, detail) of a section that did not verify; anything else is a MISMATCH
VERDICTS = {
    DigestMismatchError: lambda e: (MISMATCH, f"computed {e.found}"),
    TruncatedError: lambda e: (MISSING, "beyond the end of the file"),
}


def _verdict(err: HsnapError | None) -> tuple[str, str]:
    """(status, detail) of a verified section."""
    if err is None:
        return OK, ""
    rule = next((f for t, f in VERDICTS.items() if isinstance(err, t)), None)
    return rule(err) if rule else (MISMATCH, describe_error(err))


class DigestPanel(Vertical):
    class Checked(Message):
        """Sections verified since the last batch: ``[(key, status)]`` (posted from the worker thread)."""

        def __init__(self, results: list[tuple[str, str, str]], nbytes: int) -> None:
            super().__init__()
            self.results, self.nbytes = results, nbytes

        @property
        def keys(self) -> list[str]:
            return [k for k, _, _ in self.results]

    class ChainChecked(Message):
        """A rank's chain proved (``verdict``: the proof, or the error that stopped it), or,
        with ``verdict`` None, its proof started (posted from the worker thread)."""

        def __init__(self, rank: int, verdict: ChainProof | HsnapError | None) -> None:
            super().__init__()
            self.rank, self.verdict = rank, verdict

    class Finished(Message):
        def __init__(self, cancelled: bool, padding: str) -> None:
            super().__init__()
            self.cancelled, self.padding = cancelled, padding

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc
        self.status = doc.status  # shared with the tree, the tables and the Section tab
        self._counts = {s: 0 for s in STATUS_STYLES}
        for st in self.status.values():
            self._counts[st] += 1
        self._worker: Worker | None = None
        self._note = "not verified yet: press v"

    def compose(self) -> ComposeResult:
        yield Static(id="digest-summary")
        yield ProgressBar(total=sum(r.info.length for r in self.doc.refs) or 1, show_eta=False, id="digest-progress")
        rank = [Column("rank", "rank", 4, "right")] if self.doc.multi_rank else []
        columns = rank + [
            Column("section", "section", max([7, *(len(r.info.name) for r in self.doc.refs)])),
            Column("status", "status", 8),
            Column("digest", "stored digest", 32),
            Column("detail", "detail", 44),
        ]
        yield VTable(columns, self._cell, keys=self._order(), id="digest-table")

    def on_mount(self) -> None:
        self._summarize()

    def _cell(self, key: str, column: str):
        ref = self.doc.ref(key)
        st = self.status[key]
        if column == "rank":
            return Text(str(ref.rank))
        if column == "section":
            return safe(ref.info.name, "bold red" if st in PROBLEMS else "")
        if column == "status":
            return Text(st, style=STATUS_STYLES[st])
        if column == "digest":
            return safe(ref.info.digest, "dim")
        return Text(self.doc.status_detail.get(key, ""), style="red")

    def _order(self) -> list[str]:
        """Problems first (what a user opened this tab for), then file order."""
        problems = self.doc.problems()
        if not problems:
            return [r.key for r in self.doc.refs]
        bad = set(problems)
        return problems + [r.key for r in self.doc.refs if r.key not in bad]

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.is_running

    @property
    def mismatches(self) -> list[str]:
        return [k for k, s in self.status.items() if s == MISMATCH]

    def summary_text(self) -> Text:
        c = self._counts
        text = Text()
        text.append(f"{c[OK]} ok", style="green")
        for st in PROBLEMS:
            if c[st] or st == MISMATCH:
                text.append("  ")
                text.append(f"{c[st]} {st}", style="bold red" if c[st] else "")
        text.append(f"  {c[PENDING]} pending  ·  {self._note}")
        problems = self.doc.problems()
        if problems:
            names = ", ".join(self.doc.ref(k).info.name for k in problems[:NAMES_IN_SUMMARY])
            more = f" and {len(problems) - NAMES_IN_SUMMARY} more" if len(problems) > NAMES_IN_SUMMARY else ""
            text.append("\nnot intact: ", style="bold red")
            text.append_text(safe(names + more, "bold red"))
        for rank in sorted(self.doc.chains):
            for status, line in self.doc.chain_report(rank):
                text.append("\n")
                text.append_text(safe(line, STATUS_STYLES[status]))
        return text

    def _summarize(self) -> None:
        self.query_one("#digest-summary", Static).update(self.summary_text())

    def _set(self, key: str, status: str, detail: str = "") -> None:
        old = self.status[key]
        self._counts[old] -= 1
        self._counts[status] += 1
        self.status[key] = status
        if detail:
            self.doc.status_detail[key] = detail
        else:
            self.doc.status_detail.pop(key, None)

    def start(self) -> None:
        """(Re)start the scan from the first section (missing sections stay missing)."""
        if self.running:
            self._worker.cancel()
        for key in list(self.status):
            if self.status[key] != MISSING:
                self._set(key, PENDING)
        for rank in self.doc.proofs:
            self.doc.proofs[rank] = None
        self.query_one(VTable).set_rows(self._order(), fit=False)
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
        cancelled = lambda: worker.is_cancelled  # noqa: E731
        batch: list[tuple[str, str, str]] = []
        nbytes = [0]
        last = time.monotonic()
        padding = []

        def progress(n: int) -> None:
            nbytes[0] += n

        def flush(force: bool = False) -> None:
            nonlocal batch, last
            if batch or nbytes[0]:
                if force or time.monotonic() - last >= BATCH_SECONDS:
                    self.post_message(self.Checked(batch, nbytes[0]))
                    batch, nbytes[0], last = [], 0, time.monotonic()

        for rank, snap in sorted(self.doc.ranks.items()):
            for info in snap.sections:
                if worker.is_cancelled:
                    break
                key = f"{rank}:{info.name}"
                if self.status.get(key) == MISSING:
                    nbytes[0] += info.length
                    continue
                try:
                    done = snap.verify_section(info, cancelled=cancelled, progress=progress)
                    err = None
                except HsnapError as e:
                    done, err = True, e
                if not done:
                    break
                status, detail = _verdict(err)
                batch.append((key, status, detail))
                flush()
            if worker.is_cancelled:
                break
            if self.doc.partial is None:
                try:
                    snap.check_padding()
                except HsnapError as e:
                    padding.append(describe_error(e))
        flush(force=True)
        for rank, chain in sorted(self.doc.chains.items()):
            if worker.is_cancelled:
                break
            verdict: ChainProof | HsnapError = chain
            if isinstance(chain, Chain):
                self.post_message(self.ChainChecked(rank, None))
                try:
                    verdict = prove_chain(chain)
                except HsnapError as e:  # the proof lists its failures; a refusal outside them still reads as one
                    verdict = e
            if not worker.is_cancelled:
                self.post_message(self.ChainChecked(rank, verdict))
        note = "; ".join(padding) or ("padding all zero" if self.doc.partial is None else "padding not checked (partial file)")
        self.post_message(self.Finished(worker.is_cancelled, note))

    def record(self, key: str, status: str, detail: str = "") -> None:
        """A verdict reached elsewhere (the Section tab hashes what it shows)."""
        self._apply([(key, status, detail)])
        self._summarize()

    def _apply(self, results) -> None:
        reorder = False
        for key, status, detail in results:
            reorder = reorder or (status in PROBLEMS) != (self.status[key] in PROBLEMS)
            self._set(key, status, detail)
        table = self.query_one(VTable)
        if reorder:
            table.set_rows(self._order(), fit=False)
        else:
            table.refresh()

    def on_digest_panel_checked(self, event: Checked) -> None:
        self._apply(event.results)
        self.query_one(ProgressBar).advance(event.nbytes)
        self._summarize()  # the event bubbles on to the screen (tree marks)

    def on_digest_panel_chain_checked(self, event: ChainChecked) -> None:
        if event.verdict is None:
            self._note = "proving the chain (every link and page, as hsnap verify)…"
        else:
            self.doc.proofs[event.rank] = event.verdict
        self._summarize()  # the event bubbles on to the screen (tree marks)

    def on_digest_panel_finished(self, event: Finished) -> None:
        self._note = "cancelled" if event.cancelled else f"done; {event.padding}"
        self._summarize()
