"""Snapshot -> manifest and ranks -> layers -> sections, and the request record."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from ..messages import PaneWanted, SectionChosen
from ..model import Document
from ..text import safe

# digest status -> (mark, style) in front of a section's label
STATUS_MARKS = {"ok": ("✓ ", "green"), "MISMATCH": ("✗ ", "bold red"), "pending": ("· ", "dim")}


class SectionTree(Tree):
    """Node data: ("section", key) or ("pane", pane id)."""

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(safe(doc.label, "bold"), data=("pane", "identity"), **kw)
        self.doc = doc
        self.show_root = True
        self._section_nodes: dict[str, TreeNode] = {}

    def on_mount(self) -> None:
        doc, root = self.doc, self.root
        if doc.manifest is not None:
            m = doc.manifest
            root.add_leaf(Text(f"manifest · tp {m.tp_size} · position {m.state_position}"), data=("pane", "identity"))
        for rank, snap in sorted(doc.ranks.items()):
            ident = snap.identity
            rank_node = root.add(Text(f"rank {rank} of {ident.tp_size}"), data=("pane", "geometry"), expand=True)
            for group in doc.groups(rank):
                pane = "request" if group.layer is None else "geometry"
                node = rank_node.add(Text(group.label), data=("pane", pane), expand=True)
                for ref in group.refs:
                    self._section_nodes[ref.key] = node.add_leaf(self._label(ref.info.name), data=("section", ref.key))
        root.expand()

    @staticmethod
    def _label(name: str, status: str = "pending") -> Text:
        mark, style = STATUS_MARKS[status]
        text = Text(mark, style=style)
        text.append_text(safe(name, "bold red" if status == "MISMATCH" else ""))
        return text

    def mark(self, key: str, status: str) -> None:
        """Show a section's digest status next to its name."""
        node = self._section_nodes.get(key)
        if node is not None:
            node.set_label(self._label(self.doc.ref(key).info.name, status))

    def select_key(self, key: str) -> None:
        node = self._section_nodes.get(key)
        if node is not None:
            self.select_node(node)
            self.scroll_to_node(node)

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        what, value = event.node.data or ("pane", "geometry")
        self.post_message(SectionChosen(value) if what == "section" else PaneWanted(value))
