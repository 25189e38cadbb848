"""The section table: where every section lives in the file and what it holds
(an attention section: which of the request's positions, ``rows 280..296 of 297`` for
a delta or a paged file). Drawn line by line (VTable): a 10,000-section snapshot costs
what is visible."""

from __future__ import annotations

import math

from rich.text import Text

from hsnap_format.tools.viewmodel import fmt_bytes

from ..messages import SectionChosen
from ..model import MISSING, Document, aligned_to
from ..text import safe
from .vtable import Column, VTable

DIGEST_CHARS = 12  # the full digest is on the Section and Digests tabs


def _shape(shape) -> str:
    return "×".join(map(str, shape)) or "scalar"


class GeometryTable(VTable):
    """One row per section, keyed by section key; Enter posts :class:`SectionChosen`."""

    def __init__(self, doc: Document, **kw) -> None:
        self.doc = doc
        refs = doc.refs
        rank = [Column("rank", "rank", 4, "right")] if doc.multi_rank else []
        columns = rank + [
            Column("name", "name", max([4, *(len(r.info.name) for r in refs)])),
            Column("kind", "kind", max([4, *(len(r.kind_label) for r in refs)])),
            Column("layer", "layer", 5, "right"),
            Column("dtype", "dtype / storage", max([15, *(len(doc.storage_dtype(r)) for r in refs[:64])])),
            Column("shape", "shape", max([5, *(len(_shape(r.info.shape)) for r in refs)])),
            Column("rows", "positions", max([9, *(len(doc.rows_text(r)) for r in refs)])),
            Column("bytes", "bytes", max([5, *(len(f"{r.info.length:,}") for r in refs)]), "right"),
            Column("size", "size", 9, "right"),
            Column("offset", "offset", max([6, *(len(f"{r.info.offset:,}") for r in refs)]), "right"),
            Column("aligned", "aligned to", 10, "right"),
            Column("digest", "stored digest", DIGEST_CHARS + 1),
        ]
        super().__init__(columns, self._cell, keys=[r.key for r in refs], **kw)
        total = sum(math.prod(r.info.shape) for r in refs)
        self.tooltip = (f"{len(refs)} sections, {total:,} elements. 'aligned to' is the largest power of two "
                        "dividing the offset (the format requires 4 KiB)")

    def _cell(self, key: str, column: str):
        ref = self.doc.ref(key)
        s = ref.info
        missing = self.doc.status.get(key) == MISSING
        return {
            "rank": lambda: Text(str(ref.rank)),
            "name": lambda: safe(s.name, "red" if missing else ""),
            "kind": lambda: Text(ref.kind_label),
            "layer": lambda: Text("" if s.layer is None else str(s.layer)),
            "dtype": lambda: Text(self.doc.storage_dtype(ref)),
            "shape": lambda: Text(_shape(s.shape)),
            "rows": lambda: Text(self.doc.rows_text(ref)),
            "bytes": lambda: Text(f"{s.length:,}"),
            "size": lambda: Text(fmt_bytes(s.length)),
            "offset": lambda: Text(f"{s.offset:,}"),
            "aligned": lambda: Text(aligned_to(s.offset)),
            "digest": lambda: Text("missing", style="bold red") if missing else safe(s.digest[:DIGEST_CHARS] + "…", "dim"),
        }[column]()

    def on_vtable_selected(self, event: VTable.Selected) -> None:
        event.stop()
        self.post_message(SectionChosen(event.key))
