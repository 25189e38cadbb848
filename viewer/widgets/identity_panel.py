"""Who wrote the snapshot and for what, and, when a reference is set, a field by
field compatibility check against it (another snapshot or a JSON identity)."""

from __future__ import annotations

import os

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widgets import DataTable, Static

from hsnap_format.tools.viewmodel import fmt_bytes, fmt_runs, paged_positions, plural

from ..compat import Reference, compat_rows, is_compatible
from ..model import Document
from ..text import safe

VERDICT_STYLES = {"same": "green", "DIFFERS": "bold red"}


def _kv_table(rows) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(safe(key), value if isinstance(value, Text) else safe(value))  # numerics keys come from the file
    return table


def identity_rows(doc: Document, rank: int | None = None) -> list[tuple[str, object]]:
    rank = min(doc.ranks) if rank is None else rank
    snap = doc.ranks[rank]
    ident, header = snap.identity, snap.header
    tp = Text(f"rank {ident.tp_rank} of {ident.tp_size}")
    if len(doc.ranks) > 1:
        tp.append(f"  ·  this snapshot holds ranks {', '.join(map(str, sorted(doc.ranks)))}", style="bold")
        tp.append("  (r: next rank)", style="dim")
    engine = f"{ident.engine.name} {ident.engine.version}" + (f" ({ident.engine.commit})" if ident.engine.commit else "")
    rows = [
        ("file", os.path.basename(snap.path) if doc.multi_rank else doc.label),
        ("format", f"hsnap {snap.version[0]}.{snap.version[1]}, digest {header['digest']}"),
        ("features", ", ".join(header["features"]["required"] + header["features"]["optional"]) or "none"),
        ("model", ident.model_id),
        ("weights", f"{ident.weights_version} {ident.weights_hash}".strip()),
        ("engine", engine),
        ("tensor parallel", tp),
        ("device", ident.device),
        ("snapshot id", ident.snapshot_id),
        ("created at", ident.created_at),
        ("written by", f"hsnap {ident.hsnap_version}"),
    ]
    if snap.base is not None:  # a delta (spec 5.9): its attention rows start at its base's position
        b = snap.base
        rows.append(("delta of", f"{b.name} at position {b.state_position} (snapshot {b.snapshot_id}, root {b.root_digest}), "
                                 f"{b.depth} link{'s' if b.depth != 1 else ''} below: attention rows from position {b.state_position}"))
    span = paged_positions(snap)
    if span is not None:  # spec 5.10: its full pages' attention rows are page objects beside it
        p = snap.pages
        rows.append(("pages", f"{plural(p.count, 'page')} of {p.page_size} positions in {p.store}/: "
                              f"the full-attention rows of positions {fmt_runs([span])}"))
    rows += [(f"numerics.{k}", v) for k, v in sorted(ident.numerics.items())]
    if doc.manifest is not None:
        m = doc.manifest
        rows.append(("manifest", f"id {m.snapshot_id}, tp {m.tp_size}, state position {m.state_position}"))
    if doc.partial:
        rows.append(("PARTIAL", Text(doc.partial, style="bold red")))
    for r, s in sorted(doc.ranks.items()):
        here = Text(f"{fmt_bytes(s.file_length)} file, {fmt_bytes(s.payload_bytes)} payload, root {s.root_digest or 'unknown'}",
                    style="bold" if r == rank else "")
        rows.append((f"rank {r}" + (" (shown)" if r == rank and len(doc.ranks) > 1 else ""), here))
    return rows


class IdentityPanel(VerticalScroll):
    reference: reactive[Reference | None] = reactive(None, init=False)
    rank: reactive[int | None] = reactive(None, init=False)

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(**kw)
        self.doc = doc

    def compose(self) -> ComposeResult:
        yield Static(_kv_table(identity_rows(self.doc, self.rank)), id="identity-fields")
        yield Static(id="compat-verdict")
        yield DataTable(cursor_type="row", id="compat-table")

    def on_mount(self) -> None:
        self.watch_reference(self.reference)

    def watch_rank(self, rank: int | None) -> None:
        self.query_one("#identity-fields", Static).update(_kv_table(identity_rows(self.doc, rank)))
        self.watch_reference(self.reference)

    def watch_reference(self, ref: Reference | None) -> None:
        table = self.query_one("#compat-table", DataTable)
        table.clear(columns=True)
        table.add_columns("result", "field", "this snapshot", "reference")
        verdict = self.query_one("#compat-verdict", Static)
        table.display = ref is not None
        if ref is None:
            verdict.update(Text("No reference: press c to check against a snapshot or an identity JSON file.", style="dim"))
            return
        snap = self.doc.ranks[min(self.doc.ranks) if self.rank is None else self.rank]
        rows = compat_rows(snap.identity, snap.geometry, ref)
        head = Text("compatibility with ")
        head.append_text(safe(ref.label, "bold"))
        ok = is_compatible(rows)
        head.append(": compatible" if ok else f": INCOMPATIBLE ({sum(not r.same and r.level == 'strict' for r in rows)} fields differ)",
                    style="green" if ok else "bold red")
        if ref.geometry is None:
            head.append("  (identity only: the reference has no geometry)", style="dim")
        verdict.update(head)
        for r in rows:
            table.add_row(Text(r.verdict, style=VERDICT_STYLES.get(r.verdict, "yellow")), safe(r.field), safe(repr(r.this)), safe(repr(r.other)))
