"""One snapshot: tree on the left, tabs on the right (geometry, section, digests,
identity, request). Widgets post messages up; this screen sets attributes down."""

from __future__ import annotations

from typing import Callable

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Static, TabbedContent, TabPane

from ..compat import Reference, load_reference
from ..messages import PaneWanted, SectionChosen
from ..model import Document, fmt_bytes
from ..text import describe_error, safe
from ..widgets.digest_panel import DigestPanel
from ..widgets.geometry_table import GeometryTable
from ..widgets.identity_panel import IdentityPanel
from ..widgets.request_panel import RequestPanel
from ..widgets.section_detail import SectionDetail
from ..widgets.section_tree import SectionTree
from .prompt import PathPrompt

MISMATCH_TOAST_SECONDS = 30  # a corrupted snapshot deserves more than a glance

# tab id -> title, in order
PANES = {"geometry": "Geometry", "section": "Section", "digests": "Digests", "identity": "Identity", "request": "Request"}


def title_text(doc: Document) -> Text:
    snap = doc.first
    text = safe(doc.label, "bold")
    ranks = f"{len(doc.ranks)} ranks" if doc.multi_rank else f"rank {snap.identity.tp_rank} of {snap.identity.tp_size}"
    payload = sum(s.payload_bytes for s in doc.ranks.values())
    text.append(f"  ·  hsnap {snap.version[0]}.{snap.version[1]}  ·  {ranks}  ·  {len(doc.refs)} sections  ·  payload {fmt_bytes(payload)}  ·  model ")
    text.append_text(safe(snap.identity.model_id))
    return text


class MainScreen(Screen):
    BINDINGS = [
        Binding("v", "verify", "Verify digests"),
        Binding("x", "cancel_verify", "Cancel scan"),
        Binding("d", "diff", "Diff"),
        Binding("c", "check_against", "Check against…"),
        Binding("left_square_bracket", "page(-1)", "Prev page"),
        Binding("right_square_bracket", "page(1)", "Next page"),
        *[Binding(str(i), f"show_pane('{pane}')", title, show=False) for i, (pane, title) in enumerate(PANES.items(), 1)],
    ]

    def __init__(self, doc: Document, *, reference: Reference | None = None, decoder: Callable[[int], str] | None = None,
                 page_size: int = 100, verify_on_open: bool = True, can_diff: bool = False) -> None:
        super().__init__()
        self.doc = doc
        self.reference = reference
        self.decoder = decoder
        self.page_size = page_size
        self.verify_on_open = verify_on_open
        self.can_diff = can_diff

    def compose(self) -> ComposeResult:
        yield Static(title_text(self.doc), id="title")
        with Horizontal():
            yield SectionTree(self.doc, id="tree")
            with TabbedContent(initial="geometry", id="tabs"):
                widgets = {
                    "geometry": lambda: GeometryTable(self.doc, id="geometry-table"),
                    "section": lambda: SectionDetail(self.doc, id="detail"),
                    "digests": lambda: DigestPanel(self.doc, id="digest-panel"),
                    "identity": lambda: IdentityPanel(self.doc, id="identity-panel"),
                    "request": lambda: RequestPanel(self.doc, decoder=self.decoder, page_size=self.page_size, id="request-panel"),
                }
                for pane, title in PANES.items():
                    with TabPane(title, id=pane):
                        yield widgets[pane]()
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(IdentityPanel).reference = self.reference
        if self.verify_on_open:
            self.query_one(DigestPanel).start()

    # -- messages up
    @on(SectionChosen)
    def _section_chosen(self, event: SectionChosen) -> None:
        self.select_section(event.key)

    @on(PaneWanted)
    def _pane_wanted(self, event: PaneWanted) -> None:
        self.action_show_pane(event.pane)

    @on(DigestPanel.Checked)
    def _digest_checked(self, event: DigestPanel.Checked) -> None:
        self.query_one(SectionTree).mark(event.key, event.status)

    @on(TabbedContent.TabActivated)
    def _tab_changed(self) -> None:
        self.refresh_bindings()

    # -- attributes down
    def select_section(self, key: str) -> None:
        if key not in self.doc:
            return
        self.query_one(SectionDetail).ref = self.doc.ref(key)
        self.query_one(GeometryTable).show(key)
        tree = self.query_one(SectionTree)
        if tree.cursor_node is None or tree.cursor_node.data != ("section", key):
            tree.select_key(key)
        self.action_show_pane("section")

    # -- actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Footer shows: Diff only with a second snapshot, paging only on a paged Request tab."""
        if action == "diff":
            return self.can_diff
        try:
            if action == "page":
                return self.query_one(TabbedContent).active == "request" and self.query_one(RequestPanel).pages > 1
            if action == "cancel_verify":
                return True if self.query_one(DigestPanel).running else None
        except NoMatches:  # asked before the widgets are mounted
            return False
        return True

    def action_show_pane(self, pane: str) -> None:
        self.query_one(TabbedContent).active = pane

    def action_verify(self) -> None:
        self.action_show_pane("digests")
        self.query_one(DigestPanel).start()
        self.refresh_bindings()

    def action_cancel_verify(self) -> None:
        self.query_one(DigestPanel).cancel()

    def action_page(self, delta: int) -> None:
        panel = self.query_one(RequestPanel)
        panel.page += delta

    def action_diff(self) -> None:
        self.app.action_open_diff()

    def action_check_against(self) -> None:
        self.app.push_screen(PathPrompt("Check against a snapshot (file or directory) or an identity .json file:"), self._set_reference)

    def _set_reference(self, path: str | None) -> None:
        if not path:
            return
        try:
            ref = load_reference(path, rank=min(self.doc.ranks))
        except Exception as e:  # HsnapError, or an OS error on a path typed by hand
            self.notify(describe_error(e), title="Cannot read the reference", severity="error", markup=False)
            return
        self.query_one(IdentityPanel).reference = ref
        self.action_show_pane("identity")

    def on_digest_panel_finished(self, event: DigestPanel.Finished) -> None:
        self.refresh_bindings()
        bad = self.query_one(DigestPanel).mismatches
        if bad:
            names = ", ".join(self.doc.ref(k).info.name for k in bad[:5])
            self.notify(f"{len(bad)} section(s) do not match their digest: {names}", title="Digest MISMATCH",
                        severity="error", markup=False, timeout=MISMATCH_TOAST_SECONDS)
