"""The request record: sampling, stop conditions, streamed progress, remaining
budget, output logprobs as a sparkline, and the token history page by page."""

from __future__ import annotations

from typing import Callable

import numpy as np
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import DataTable, Sparkline, Static

from ..model import Document
from ..text import fmt_num, safe

MAX_SPARK_POINTS = 4096


def _request_table(req: dict) -> Table:
    stop, streamed = req.get("stop", {}), req.get("streamed", {})
    n_out = req.get("output_tokens", 0)
    pct = f" ({100 * streamed.get('tokens', 0) // n_out}%)" if n_out else ""
    rows = [
        ("request id", safe(req.get("rid", ""))),
        ("tokens", Text(f"prompt {req.get('prompt_tokens')} + output {n_out}, state position {req.get('state_position')}")),
        ("sampling", safe(", ".join(f"{k}={v}" for k, v in sorted(req.get("sampling", {}).items())) or "defaults")),
        ("stop", safe(f"max_new_tokens={stop.get('max_new_tokens')}, min_new_tokens={stop.get('min_new_tokens')}, "
                      f"ignore_eos={stop.get('ignore_eos')}, token ids {stop.get('stop_token_ids')}, strings {stop.get('stop_strings')!r}")),
        ("streamed", Text(f"{streamed.get('tokens', 0)} of {n_out} output tokens{pct}, {streamed.get('text_chars', 0)} chars, "
                          f"reasoning {streamed.get('reasoning_tokens', 0)} tokens"
                          f"{' (finished)' if streamed.get('reasoning_finished') else ''}")),
        ("remaining budget", Text(fmt_num(req.get("remaining_budget")))),
    ]
    extra = req.get("extra", {})
    if extra:
        rows.append(("extra", safe(", ".join(f"{k}={v}" for k, v in sorted(extra.items())))))
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    return table


class RequestPanel(Vertical):
    page: reactive[int] = reactive(0, init=False)

    def __init__(self, doc: Document, *, decoder: Callable[[int], str] | None = None, page_size: int = 100, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc
        self.decoder = decoder
        self.page_size = page_size
        self.prompt = doc.record_array("prompt_ids")
        self.output = doc.record_array("output_ids")
        self.logprobs = doc.record_array("output_logprobs")
        self.top_ids = doc.record_array("top_logprob_ids")
        self.top_values = doc.record_array("top_logprob_values")

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.page_size))

    def compose(self) -> ComposeResult:
        yield Static(_request_table(self.doc.first.request), id="request-summary")
        if self.logprobs is not None and len(self.logprobs):
            lp = self.logprobs
            yield Static(Text(f"output logprobs: min {fmt_num(float(lp.min()))}, max {fmt_num(float(lp.max()))}, "
                              f"mean {fmt_num(float(lp.mean(dtype=np.float64)))}", style="bold"), id="logprob-label")
            step = max(1, len(lp) // MAX_SPARK_POINTS)
            yield Sparkline([float(v) for v in lp[::step]], id="logprobs")
        yield Static(id="token-page")
        yield DataTable(cursor_type="row", zebra_stripes=True, id="tokens")

    def on_mount(self) -> None:
        table = self.query_one("#tokens", DataTable)
        cols = ["pos", "part", "token id"] + (["text"] if self.decoder else []) + ["logprob"]
        if self.top_ids is not None:
            cols.append(f"top-{self.top_ids.shape[1]} (id: logprob)")
        table.add_columns(*cols)
        self.watch_page(self.page)  # first page; later pages when ``page`` changes

    def _row(self, pos: int) -> list:
        n_prompt = len(self.prompt)
        out = pos - n_prompt
        token = int(self.prompt[pos] if out < 0 else self.output[out])
        cells = [Text(str(pos), justify="right"), Text("prompt" if out < 0 else "output", style="dim" if out < 0 else "")]
        cells.append(Text(str(token), justify="right"))
        if self.decoder:
            cells.append(self._token_text(token))
        lp = "" if out < 0 or self.logprobs is None else fmt_num(float(self.logprobs[out]))
        cells.append(Text(lp, justify="right"))
        if self.top_ids is not None:
            top = "" if out < 0 else "  ".join(f"{int(i)}: {fmt_num(float(v))}" for i, v in zip(self.top_ids[out], self.top_values[out]))
            cells.append(Text(top))
        return cells

    def _token_text(self, token: int) -> Text:
        try:
            return safe(repr(self.decoder(token)))
        except Exception:  # an id outside the vocabulary: show it, do not fail
            return Text("?", style="dim")

    def watch_page(self, page: int) -> None:
        table = self.query_one("#tokens", DataTable)
        table.clear()
        start = page * self.page_size
        stop = min(self.total, start + self.page_size)
        for pos in range(start, stop):
            table.add_row(*self._row(pos))
        label = Text(f"tokens {start}–{max(start, stop - 1)} of {self.total}  ·  page {page + 1}/{self.pages}", style="bold")
        if self.pages > 1:
            label.append("  ([ previous, ] next)", style="dim")
        self.query_one("#token-page", Static).update(label)

    def validate_page(self, page: int) -> int:
        return min(max(0, page), self.pages - 1)

    def next_page(self) -> None:
        self.page += 1

    def previous_page(self) -> None:
        self.page -= 1
