"""The request record: sampling, stop conditions, streamed progress, remaining
budget, output logprobs as a sparkline, and the token history page by page.

The summary takes at most part of the pane (it scrolls; sampling and the
engine's extra fields fold away), so the token table always has room, at 80×24
too; ``g`` goes to a position, ``o`` to the first output token, ``<``/``>`` to
the first/last page."""

from __future__ import annotations

from typing import Callable

import numpy as np
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Collapsible, DataTable, Sparkline, Static

from hsnap_format import HsnapError

from ..model import Document
from ..text import describe_error, fmt_num, safe

MAX_SPARK_POINTS = 4096


def _map_text(items: dict) -> Text:
    return safe(", ".join(f"{k}={v}" for k, v in sorted(items.items())) or "none")


def _request_table(req: dict, token_text: str | None = None, token_text_style: str = "") -> Table:
    stop, streamed = req.get("stop", {}), req.get("streamed", {})
    n_out = req.get("output_tokens", 0)
    pct = f" ({100 * streamed.get('tokens', 0) // n_out}%)" if n_out else ""
    rows = [
        ("request id", safe(req.get("rid", ""))),
        ("tokens", Text(f"prompt {req.get('prompt_tokens')} + output {n_out}, state position {req.get('state_position')}")),
        *([("token text", safe(token_text, token_text_style))] if token_text else []),
        ("stop", safe(f"max_new_tokens={stop.get('max_new_tokens')}, min_new_tokens={stop.get('min_new_tokens')}, "
                      f"ignore_eos={stop.get('ignore_eos')}, token ids {stop.get('stop_token_ids')}, strings {stop.get('stop_strings')!r}")),
        ("streamed", Text(f"{streamed.get('tokens', 0)} of {n_out} output tokens{pct}, {streamed.get('text_chars', 0)} chars, "
                          f"reasoning {streamed.get('reasoning_tokens', 0)} tokens"
                          f"{' (finished)' if streamed.get('reasoning_finished') else ''}")),
        ("remaining budget", Text(fmt_num(req.get("remaining_budget")))),
    ]
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    return table


class RequestPanel(Vertical):
    page: reactive[int] = reactive(0, init=False)

    def __init__(self, doc: Document, *, decoder: Callable[[int], str] | None = None, token_text_note: str | None = None,
                 page_size: int = 100, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc
        self.decoder = decoder
        self.token_text_note = token_text_note
        self.page_size = page_size
        self.errors: list[str] = []
        self.prompt = self._record("prompt_ids", empty=True)
        self.output = self._record("output_ids", empty=True)
        self.logprobs = self._record("output_logprobs")
        self.top_ids = self._record("top_logprob_ids")
        self.top_values = self._record("top_logprob_values")
        if self.top_ids is None or self.top_values is None:
            self.top_ids = self.top_values = None

    def _record(self, kind: str, empty: bool = False):
        """A record section, or None (empty for token ids) when the file lacks or cannot give it."""
        try:
            arr = self.doc.record_array(kind)
        except HsnapError as e:  # a partial file: say so, show the rest
            self.errors.append(describe_error(e))
            arr = None
        return np.zeros(0, dtype=np.int32) if arr is None and empty else arr

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.page_size))

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    def compose(self) -> ComposeResult:
        req = self.doc.first.request
        with VerticalScroll(id="request-head"):
            yield Static(_request_table(req, self.token_text_note, "" if self.decoder else "yellow"), id="request-summary")
            for key, title in (("sampling", "sampling"), ("extra", "extra (engine fields)")):
                items = req.get(key, {})
                with Collapsible(title=f"{title}: {len(items)}", collapsed=True, id=f"request-{key}"):
                    yield Static(_map_text(items))
            if self.logprobs is not None and len(self.logprobs):
                lp = self.logprobs
                yield Static(Text(f"output logprobs: min {fmt_num(float(lp.min()))}, max {fmt_num(float(lp.max()))}, "
                                  f"mean {fmt_num(float(lp.mean(dtype=np.float64)))}", style="bold"), id="logprob-label")
                step = max(1, len(lp) // MAX_SPARK_POINTS)
                yield Sparkline([float(v) for v in lp[::step]], id="logprobs")
        if self.errors:
            yield Static(Text("record not all readable: " + "; ".join(self.errors), style="bold red"), id="request-errors")
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
        label.append(f"  ·  outputs from {self.n_prompt}", style="")
        hint = "  [ ] page  < > first/last  " if self.pages > 1 else "  "
        label.append(hint + "o outputs  g position", style="dim")
        self.query_one("#token-page", Static).update(label)

    def validate_page(self, page: int) -> int:
        return min(max(0, page), self.pages - 1)

    def next_page(self) -> None:
        self.page += 1

    def previous_page(self) -> None:
        self.page -= 1

    def goto_position(self, pos: int) -> int:
        """Show the page holding history position ``pos`` with the cursor on it (clamped)."""
        pos = min(max(0, pos), max(0, self.total - 1))
        page = pos // self.page_size
        if page != self.page:
            self.page = page
        else:
            self.watch_page(page)
        table = self.query_one("#tokens", DataTable)
        row = pos - page * self.page_size
        table.move_cursor(row=row, animate=False)
        # the row a third of the way down, with what follows it in view (not on the last line);
        # after the table's own scroll-into-view, which runs after the next refresh
        table.call_after_refresh(lambda: table.scroll_to(y=max(0, row - max(0, table.scrollable_content_region.height - 1) // 3),
                                                          animate=False))
        table.focus()
        return pos

    def goto_outputs(self) -> int:
        return self.goto_position(self.n_prompt)
