"""The section table: where every section lives in the file and what it holds."""

from __future__ import annotations

import math

from rich.text import Text
from textual.widgets import DataTable

from ..messages import SectionChosen
from ..model import Document, alignment
from ..text import safe


DIGEST_CHARS = 12  # the full digest is on the Section and Digests tabs


class GeometryTable(DataTable):
    """One row per section, keyed by section key; Enter posts :class:`SectionChosen`."""

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.doc = doc

    def on_mount(self) -> None:
        rank = ("rank",) if self.doc.multi_rank else ()
        self.add_columns(*rank, "name", "kind", "layer", "dtype / storage", "shape", "bytes", "offset", "align", "stored digest")
        for ref in self.doc.refs:
            s = ref.info
            cells = [
                safe(s.name),
                Text(ref.kind_label),
                Text("" if s.layer is None else str(s.layer), justify="right"),
                Text(self.doc.storage_dtype(ref)),
                Text("×".join(map(str, s.shape)) or "scalar"),
                Text(f"{s.length:,}", justify="right"),
                Text(f"{s.offset:,}", justify="right"),
                Text(str(alignment(s.offset)), justify="right"),
                safe(s.digest[:DIGEST_CHARS] + "…", "dim"),
            ]
            self.add_row(*([Text(str(ref.rank))] if rank else []), *cells, key=ref.key)
        total = sum(math.prod(r.info.shape) for r in self.doc.refs)
        self.tooltip = f"{len(self.doc.refs)} sections, {total:,} elements"

    def show(self, key: str) -> None:
        if key in self.rows:
            self.move_cursor(row=self.get_row_index(key))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.post_message(SectionChosen(event.row_key.value))
