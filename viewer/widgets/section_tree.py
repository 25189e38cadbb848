"""Snapshot -> manifest, chain and pages, ranks -> layers -> sections, and the request record.

A delta's chain is a node of its links, bottom first, each with the attention rows it
holds (``link 1 of 3 · rows 0..2 · base.hsnap``); a file that takes rows from a page store
has a pages node (count, rows, store). Both are marked once the digest scan proved them.

Small snapshots are built expanded; large ones (thousands of sections) build a
node's children only when it is first expanded, so the first frame does not wait
for 10,000 nodes. The tree is as wide as its longest label (up to a share of the
screen) and can be hidden (``t``)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from ..messages import PaneWanted, SectionChosen
from ..model import Document, Group
from ..text import safe

# digest status -> (mark, style) in front of a section's label
STATUS_MARKS = {"ok": ("✓ ", "green"), "MISMATCH": ("✗ ", "bold red"), "MISSING": ("✗ ", "bold red"), "pending": ("· ", "dim")}
EAGER_SECTIONS = 600  # up to this many sections, every node exists from the start
MAX_SHARE = 0.45  # of the screen width
GUIDE = 4  # cells per tree level


class SectionTree(Tree):
    """Node data: ("section", key), ("pane", pane id), ("rank", rank), ("group", (rank, i)),
    ("link", (rank, i)) or ("pages", rank)."""

    def __init__(self, doc: Document, **kw) -> None:
        super().__init__(safe(doc.label, "bold"), data=("pane", "identity"), **kw)
        self.doc = doc
        self.show_root = True
        self.guide_depth = GUIDE
        self._section_nodes: dict[str, TreeNode] = {}
        self._rank_nodes: dict[int, TreeNode] = {}
        self._groups: dict[int, list[Group]] = {}
        self._group_nodes: dict[tuple[int, int], TreeNode] = {}
        self._group_of: dict[str, tuple[int, int]] = {}
        self._chain_nodes: dict[tuple[str, object], TreeNode] = {}  # ("link", (rank, i)) / ("pages", rank) -> node
        self.eager = len(doc.refs) <= EAGER_SECTIONS

    @property
    def wanted_width(self) -> int:
        """Cells the longest section label needs (guides, mark, name, scrollbar)."""
        depth = 3  # root, rank, group
        longest = max([len(self.doc.label), *(len(r.info.name) for r in self.doc.refs)], default=10)
        chain = max([0, *(len(text) for _, _, text in self._chain_rows())])
        return max(depth * GUIDE + 2 + longest, 2 * GUIDE + 2 + chain) + 3

    def on_mount(self) -> None:
        doc, root = self.doc, self.root
        if doc.manifest is not None:
            m = doc.manifest
            root.add_leaf(Text(f"manifest · tp {m.tp_size} · position {m.state_position}"), data=("pane", "identity"))
        self._add_chains(root)
        for rank, snap in sorted(doc.ranks.items()):
            label = Text(f"rank {rank} of {snap.identity.tp_size}")
            if doc.partial:
                label.append("  partial", style="bold red")
            node = root.add(label, data=("rank", rank), expand=self.eager)
            self._rank_nodes[rank] = node
            if self.eager:
                self._populate(node)
        root.expand()

    # -- chains and pages
    def _chain_rows(self) -> list[tuple[str, object, str]]:
        """(what, key, label) of every chain node, in tree order: a "chain" node (its "link"
        nodes follow, inside it, and its "pages" node when it has more than one link),
        "pages" of a single paged file, or "broken" for a chain that did not open."""
        doc, out = self.doc, []
        for rank, chain in sorted(doc.chains.items()):
            where = f"rank {rank} chain" if doc.multi_rank else "chain"
            links = doc.links(rank)
            if not links:
                out.append(("broken", rank, f"{where} does not open: {type(chain).__name__} (Digests tab)"))
                continue
            if len(links) > 1:
                out.append(("chain", rank, f"{where} · {len(links)} links to position {doc.ranks[rank].state_position}"))
                out += [("link", (rank, link.index), link.label) for link in links]
            pages = doc.pages_text(rank)
            if pages:
                out.append(("pages", rank, f"rank {rank}: {pages}" if doc.multi_rank else pages))
        return out

    def _add_chains(self, root: TreeNode) -> None:
        parent = root
        for what, key, text in self._chain_rows():
            if what == "chain":
                parent = root.add(Text(text), data=("pane", "digests"), expand=True)
            elif what == "broken":
                parent = root
                root.add_leaf(safe(text, "bold red"), data=("pane", "digests"))
            else:
                self._chain_nodes[(what, key)] = parent.add_leaf(self._label(text, self._chain_status(what, key)), data=("pane", "digests"))
            if what == "pages":
                parent = root

    def _chain_status(self, what: str, key) -> str:
        return self.doc.link_status(*key) if what == "link" else self.doc.pages_status(key)

    def mark_chain(self, rank: int) -> None:
        """Show the proof's verdict on ``rank``'s link and pages nodes."""
        for what, key, text in self._chain_rows():
            node = self._chain_nodes.get((what, key))
            if node is not None and (key[0] if what == "link" else key) == rank:
                node.set_label(self._label(text, self._chain_status(what, key)))

    # -- lazy building
    def _populate(self, node: TreeNode) -> None:
        kind, value = node.data
        if node.children:
            return
        if kind == "rank":
            groups = self._groups.setdefault(value, self.doc.groups(value))
            for i, group in enumerate(groups):
                child = node.add(Text(group.label), data=("group", (value, i)), expand=self.eager)
                self._group_nodes[(value, i)] = child
                if self.eager:
                    self._populate(child)
        elif kind == "group":
            rank, i = value
            for ref in self._groups[rank][i].refs:
                self._section_nodes[ref.key] = node.add_leaf(self._label(ref.info.name, self.doc.status.get(ref.key, "pending")),
                                                             data=("section", ref.key))

    def on_tree_node_expanded(self, event: Tree.NodeExpanded) -> None:
        event.stop()
        if event.node.data and event.node.data[0] in ("rank", "group"):
            self._populate(event.node)

    def _locate(self, key: str) -> tuple[int, int] | None:
        if not self._group_of:
            for rank in self.doc.ranks:
                for i, g in enumerate(self._groups.setdefault(rank, self.doc.groups(rank))):
                    for ref in g.refs:
                        self._group_of[ref.key] = (rank, i)
        return self._group_of.get(key)

    def _node_for(self, key: str) -> TreeNode | None:
        """The node of a section, building (and expanding) its rank and group first."""
        node = self._section_nodes.get(key)
        if node is not None:
            return node
        where = self._locate(key)
        if where is None:
            return None
        rank_node = self._rank_nodes[where[0]]
        self._populate(rank_node)
        rank_node.expand()
        group_node = self._group_nodes[where]
        self._populate(group_node)
        group_node.expand()
        return self._section_nodes.get(key)

    # -- labels
    @staticmethod
    def _label(name: str, status: str = "pending") -> Text:
        mark, style = STATUS_MARKS[status]
        text = Text(mark, style=style)
        text.append_text(safe(name, "bold red" if status in ("MISMATCH", "MISSING") else ""))
        return text

    def mark(self, key: str, status: str) -> None:
        """Show a section's digest status next to its name (nodes not built yet take it when built)."""
        node = self._section_nodes.get(key)
        if node is not None:
            node.set_label(self._label(self.doc.ref(key).info.name, status))

    def mark_many(self, keys) -> None:
        for key in keys:
            self.mark(key, self.doc.status.get(key, "pending"))

    def select_key(self, key: str) -> None:
        node = self._node_for(key)
        if node is not None:
            self.select_node(node)
            self.scroll_to_node(node, animate=False)

    def move_to_key(self, key: str) -> None:
        """Put the cursor on a section without opening it (search)."""
        node = self._node_for(key)
        if node is not None:
            self.move_cursor(node)
            self.scroll_to_node(node, animate=False)

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        what, value = event.node.data or ("pane", "geometry")
        if what == "section":
            self.post_message(SectionChosen(value))
        elif what == "group":
            rank, i = value
            self.post_message(PaneWanted("request" if self._groups[rank][i].layer is None else "geometry"))
        else:
            self.post_message(PaneWanted(value if what == "pane" else "geometry"))
