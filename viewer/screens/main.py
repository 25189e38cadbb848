"""One snapshot: tree on the left (``t`` hides it), tabs on the right (geometry,
section, digests, identity, request, hex, map). Widgets post messages up; this
screen sets attributes down.

The first frame never waits for data: the digest scan starts after it, the
tree builds large snapshots lazily, and the tables draw only visible rows."""

from __future__ import annotations

import os
from typing import Callable

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Static, TabbedContent, TabPane

from hsnap_format import HsnapError
from hsnap_format.tools.export_npy import export_npy
from hsnap_format.tools.viewmodel import SelectionError, fmt_bytes, fmt_rows, fmt_value, parse_selection, plural, resolve_selection

from ..compat import Reference, load_reference
from ..messages import PaneWanted, SectionChosen
from ..model import Document, full_attention_runs
from ..text import Packed, describe_error, safe
from ..widgets.digest_panel import DigestPanel
from ..widgets.geometry_table import GeometryTable
from ..widgets.hex_view import HexView
from ..widgets.identity_panel import IdentityPanel
from ..widgets.norm_map import NormPanel
from ..widgets.request_panel import RequestPanel
from ..widgets.section_detail import SectionDetail
from ..widgets.section_tree import MAX_SHARE, SectionTree
from ..widgets.value_grid import ValueGrid
from .prompt import PathPrompt

MISMATCH_TOAST_SECONDS = 30  # a corrupted snapshot deserves more than a glance
NARROW = 100  # below this many columns the tree starts hidden (t shows it)

# tab id -> title, in order (keys 1..7)
PANES = {"geometry": "Geometry", "section": "Section", "digests": "Digests", "identity": "Identity",
         "request": "Request", "hex": "Hex", "map": "Map"}

# tab id -> the widget that takes the keys there (arrows, page keys scroll it)
PANE_FOCUS = {"geometry": "#geometry-table", "section": "#detail-grid", "digests": "#digest-table", "identity": "#identity-panel",
              "request": "#tokens", "hex": "#detail-hex", "map": "#norm-map"}

# tab -> what ``g`` asks for there
GOTO_QUESTIONS = {
    "request": "Go to history position (0 is the first prompt token; o jumps to the outputs):",
    None: "Go to an index [token, head, dim], a slice like [100:120, 0, :8], or name[...] for another section:",
}


def title_parts(doc: Document) -> list[Text]:
    """What the title bar says, part by part (it breaks between parts only): the file, its
    model and ranks, and for a delta which link of how many it is and the attention rows it
    holds, for a paged file its pages (from the header: a chain that did not open still has
    its place; why it did not is on the Digests tab)."""
    snap = doc.first
    ranks = f"ranks {', '.join(map(str, sorted(doc.ranks)))} of {snap.identity.tp_size}" if doc.multi_rank \
        else f"rank {snap.identity.tp_rank} of {snap.identity.tp_size}"
    payload = sum(s.payload_bytes for s in doc.ranks.values())
    files = sum(s.file_length for s in doc.ranks.values())
    model = Text("model ")
    model.append_text(safe(snap.identity.model_id, "bold"))
    parts = [safe(doc.label, "bold"), model, Text(ranks), Text(plural(len(doc.refs), "section")),
             Text(f"state {fmt_bytes(payload)} of {fmt_bytes(files)}"), Text(f"position {snap.state_position}")]
    if snap.base is not None:
        links = snap.base.depth + 1
        parts += [Text(f"link {links} of {links}", style="bold"), Text(fmt_rows(full_attention_runs(snap), snap.state_position))]
    pages = doc.pages_text(min(doc.ranks), short=True)
    if pages:
        parts.append(Text(pages))
    if any(not doc.links(r) for r in doc.chains):
        parts.append(Text("chain does not open", style="bold red"))
    parts.append(Text(f"hsnap {snap.version[0]}.{snap.version[1]}"))
    return parts


def title_text(doc: Document) -> Packed:
    return Packed(title_parts(doc))


class MainScreen(Screen):
    BINDINGS = [
        Binding("question_mark,f1", "app.help", "Help"),  # first: the footer is cut at 80 columns
        Binding("q", "app.quit", "Quit"),
        Binding("escape", "back", "Back"),  # to the directory's listing it was opened from (hidden otherwise)
        Binding("v", "verify", "Verify"),
        Binding("x", "cancel_verify", "Cancel scan"),
        Binding("d", "diff", "Diff…"),
        Binding("c", "check_against", "Check…"),
        Binding("t", "toggle_tree", "Tree"),
        Binding("slash", "search", "Search"),
        Binding("g", "goto", "Go to"),
        Binding("e", "export", "Export"),
        Binding("y", "copy", "Copy"),
        Binding("r", "next_rank", "Rank"),
        Binding("o", "outputs", "Outputs"),
        Binding("left_square_bracket", "page(-1)", "Prev page"),
        Binding("right_square_bracket", "page(1)", "Next page"),
        Binding("less_than_sign", "edge_page(0)", "First page", show=False),
        Binding("greater_than_sign", "edge_page(1)", "Last page", show=False),
        Binding("n", "next_match(1)", "Next match", show=False),
        Binding("N", "next_match(-1)", "Previous match", show=False),
        *[Binding(str(i), f"show_pane('{pane}')", title, show=False) for i, (pane, title) in enumerate(PANES.items(), 1)],
    ]

    def __init__(self, doc: Document, *, reference: Reference | None = None, decoder: Callable[[int], str] | None = None,
                 token_text_note: str | None = None, page_size: int = 100, verify_on_open: bool = True, can_diff: bool = False,
                 back_to: str | None = None) -> None:
        super().__init__()
        self.doc = doc
        self.reference = reference
        self.decoder = decoder
        self.token_text_note = token_text_note
        self.page_size = page_size
        self.verify_on_open = verify_on_open
        self.can_diff = can_diff
        self.back_to = back_to  # the directory listing it was opened from (escape goes back), or None
        self.rank = min(doc.ranks)
        self.matches: list[str] = []
        self.match_index = 0

    def compose(self) -> ComposeResult:
        yield Static(title_text(self.doc), id="title")
        if self.doc.partial:
            yield Static(Text(f"PARTIAL VIEW: {self.doc.partial}. Missing sections are marked ✗.", style="bold"), id="partial-banner")
        with Horizontal(id="main-body"):
            yield SectionTree(self.doc, id="tree")
            with TabbedContent(initial="geometry", id="tabs"):
                widgets = {
                    "geometry": lambda: [GeometryTable(self.doc, id="geometry-table")],
                    "section": lambda: [SectionDetail(self.doc, id="detail")],
                    "digests": lambda: [DigestPanel(self.doc, id="digest-panel")],
                    "identity": lambda: [IdentityPanel(self.doc, id="identity-panel")],
                    "request": lambda: [RequestPanel(self.doc, decoder=self.decoder, token_text_note=self.token_text_note,
                                                        page_size=self.page_size, id="request-panel")],
                    "hex": lambda: [Static(Text("Select a section: its bytes, with absolute file offsets.", style="dim"), id="hex-title"),
                                    HexView(id="detail-hex")],
                    "map": lambda: [NormPanel(self.doc, self.rank, id="norm-panel")],
                }
                for pane, title in PANES.items():
                    with TabPane(title, id=pane):
                        with Vertical(classes="pane"):
                            yield from widgets[pane]()
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(IdentityPanel).reference = self.reference
        tree = self.query_one(SectionTree)
        if self.app.size.width < NARROW:
            tree.display = False
        self._fit_tree()
        self._focus_pane(self.active_pane)  # not the hidden tree: keys would go nowhere visible
        if self.verify_on_open:  # after the first frame: a big snapshot shows at once, then fills in
            self.call_after_refresh(self.query_one(DigestPanel).start)

    def on_resize(self) -> None:
        self._fit_tree()

    def _fit_tree(self) -> None:
        tree = self.query_one(SectionTree)
        tree.styles.width = max(20, min(tree.wanted_width, int(self.app.size.width * MAX_SHARE)))

    # -- messages up
    @on(SectionChosen)
    def _section_chosen(self, event: SectionChosen) -> None:
        self.select_section(event.key)

    @on(PaneWanted)
    def _pane_wanted(self, event: PaneWanted) -> None:
        self.show_pane(event.pane)  # asked from the tree: browsing it goes on

    @on(DigestPanel.Checked)
    def _digest_checked(self, event: DigestPanel.Checked) -> None:
        self._statuses_changed(event.keys)

    @on(DigestPanel.ChainChecked)
    def _chain_checked(self, event: DigestPanel.ChainChecked) -> None:
        self.query_one(SectionTree).mark_chain(event.rank)

    @on(SectionDetail.Verified)
    def _section_verified(self, event: SectionDetail.Verified) -> None:
        panel = self.query_one(DigestPanel)
        if self.doc.status.get(event.key) != event.status:
            panel.record(event.key, event.status, event.detail)
            self._statuses_changed([event.key])

    def _statuses_changed(self, keys) -> None:
        self.query_one(SectionTree).mark_many(keys)
        self.query_one(GeometryTable).refresh()
        detail = self.query_one(SectionDetail)
        if detail.ref is not None and detail.ref.key in keys:
            detail.update_banner()

    @on(TabbedContent.TabActivated)
    def _tab_changed(self, event: TabbedContent.TabActivated) -> None:
        self.refresh_bindings()
        self._focus_pane(self.active_pane)
        if self.query_one(TabbedContent).active == "map":
            self.query_one(NormPanel).start()

    # -- attributes down
    def select_section(self, key: str, selection=None, cursor=None, mark=None) -> None:
        if key not in self.doc:
            return
        ref = self.doc.ref(key)
        self.query_one(SectionDetail).show(ref, selection, cursor, mark)
        self.query_one(GeometryTable).show(key)
        tree = self.query_one(SectionTree)
        if tree.cursor_node is None or tree.cursor_node.data != ("section", key):
            tree.move_to_key(key)  # the cursor only: selecting would open the section a second time
        self.query_one(HexView).show(self.doc.raw(ref), ref.info.offset)
        hex_title = Text("hex of ")
        hex_title.append_text(safe(ref.info.name, "bold"))
        hex_title.append(f": {ref.info.length:,} bytes, offsets absolute in the file", style="dim")
        self.query_one("#hex-title", Static).update(hex_title)
        self.show_pane("section")

    @property
    def active_pane(self) -> str:
        return self.query_one(TabbedContent).active

    @property
    def current_ref(self):
        return self.query_one(SectionDetail).ref

    # -- actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The footer shows what applies: paging on a paged Request tab, Rank with several ranks."""
        if action == "back":  # only with a listing to go back to (False: not in the footer at all)
            return self.back_to is not None
        try:
            pane = self.active_pane
            if action in ("page", "edge_page"):
                return pane == "request" and self.query_one(RequestPanel).pages > 1
            if action == "outputs":
                return True if pane == "request" else None
            if action == "cancel_verify":
                return True if self.query_one(DigestPanel).running else None
            if action == "next_rank":
                return True if len(self.doc.ranks) > 1 else None
            if action in ("export", "copy"):
                return True if self.current_ref is not None else None
            if action == "next_match":
                return bool(self.matches)
        except NoMatches:  # asked before the widgets are mounted
            return False
        return True

    def action_show_pane(self, pane: str) -> None:
        """A tab asked for by key (1-7, v, o, ...): it takes the keys, arrows and page keys scroll it."""
        self.query_one(TabbedContent).active = pane
        self._focus_pane(pane, keep_tree=False)

    def show_pane(self, pane: str) -> None:
        """A tab shown for a choice made in the tree: the tree keeps the keys if it has them."""
        self.query_one(TabbedContent).active = pane
        self._focus_pane(pane)

    def _focus_pane(self, pane: str, *, keep_tree: bool = True) -> None:
        """Give the keys to the pane's own widget, unless they are already inside that pane
        (or, with ``keep_tree``, with the visible tree). Focus left in a hidden pane pulled
        the tabs back to it (1-7 stopped working after ``o``), and a focused hidden tree
        took the arrows the Map tab needed."""
        focused = self.focused
        tree = self.query_one(SectionTree)
        try:
            target = self.query_one(PANE_FOCUS[pane])
            pane_widget = self.query_one(f"TabPane#{pane}")
        except (NoMatches, KeyError):
            return
        if focused is not None and (keep_tree and focused is tree and tree.display or pane_widget in focused.ancestors_with_self):
            return
        target.focus(scroll_visible=False)

    def action_back(self) -> None:
        if self.back_to is not None:
            self.app.back_to_listing()

    def action_toggle_tree(self) -> None:
        tree = self.query_one(SectionTree)
        tree.display = not tree.display
        if tree.display:
            self._fit_tree()
            tree.focus()
        else:
            self._focus_pane(self.active_pane)

    def action_verify(self) -> None:
        self.action_show_pane("digests")
        self.query_one(DigestPanel).start()
        self.refresh_bindings()

    def action_cancel_verify(self) -> None:
        self.query_one(DigestPanel).cancel()

    def action_page(self, delta: int) -> None:
        panel = self.query_one(RequestPanel)
        panel.page += delta

    def action_edge_page(self, end: int) -> None:
        panel = self.query_one(RequestPanel)
        panel.page = panel.pages - 1 if end else 0

    def action_outputs(self) -> None:
        self.action_show_pane("request")
        pos = self.query_one(RequestPanel).goto_outputs()
        self.notify(f"first output token: position {pos}", timeout=3)

    def action_next_rank(self) -> None:
        ranks = sorted(self.doc.ranks)
        self.rank = ranks[(ranks.index(self.rank) + 1) % len(ranks)]
        self.query_one(IdentityPanel).rank = self.rank
        self.query_one(NormPanel).set_rank(self.rank, start=self.active_pane == "map")
        self.notify(f"showing rank {self.rank} of {self.doc.first.identity.tp_size}", timeout=3)

    def action_diff(self) -> None:
        if self.can_diff:
            self.app.action_open_diff()
            return
        self.app.push_screen(PathPrompt("Diff against a second snapshot (file or directory):"), self._diff_with)

    def _diff_with(self, path: str | None) -> None:
        if path:
            self.app.open_diff_with(path)

    def action_check_against(self) -> None:
        self.app.push_screen(PathPrompt("Check against a snapshot (file or directory) or an identity .json file:"), self._set_reference)

    def _set_reference(self, path: str | None) -> None:
        if not path:
            return
        try:
            ref = load_reference(path, rank=self.rank)
        except Exception as e:  # HsnapError, or an OS error on a path typed by hand
            self.notify(describe_error(e), title="Cannot read the reference", severity="error", markup=False)
            return
        self.query_one(IdentityPanel).reference = ref
        self.action_show_pane("identity")

    # -- search: less-style, over section names and labels
    def action_search(self) -> None:
        self.app.push_screen(PathPrompt("Search sections (part of a name or label, e.g. temporal, layer 3, v):",
                                        placeholder="text"), self.search)

    def search(self, text: str | None) -> None:
        if not text:
            return
        needle = text.lower()
        self.matches = [r.key for r in self.doc.refs if needle in self.doc.section_label(r).lower()]
        self.match_index = 0
        self.refresh_bindings()
        if not self.matches:
            self.notify(f"no section matches {text!r}", severity="warning", markup=False)
            return
        self._show_match()

    def action_next_match(self, delta: int) -> None:
        if self.matches:
            self.match_index = (self.match_index + delta) % len(self.matches)
            self._show_match()

    def _show_match(self) -> None:
        key = self.matches[self.match_index]
        self.select_section(key)
        self.notify(f"match {self.match_index + 1} of {len(self.matches)}: {self.doc.ref(key).info.name}  (n next, N previous)",
                    timeout=4, markup=False)

    # -- go to: a history position (Request tab) or an index / slice of a section
    def action_goto(self) -> None:
        pane = self.active_pane
        if pane == "request":
            self.app.push_screen(PathPrompt(GOTO_QUESTIONS["request"], placeholder="position"), self.goto_position)
            return
        ref = self.current_ref
        hint = f"[{', '.join(ref.info.axes or ('i',) * len(ref.info.shape))}] of {ref.info.name} {list(ref.info.shape)}" if ref else "name[...]"
        self.app.push_screen(PathPrompt(GOTO_QUESTIONS[None], placeholder=hint), self.goto_index)

    def goto_position(self, text: str | None) -> None:
        if not text:
            return
        try:
            pos = int(text)
        except ValueError:  # name[...]: a section, from any tab
            self.goto_index(text)
            return
        self.query_one(RequestPanel).goto_position(pos)

    def goto_index(self, text: str | None) -> None:
        """``[5, 1, 3]`` moves the cursor there; ``[100:120, 0, :8]`` narrows the grid; ``name[...]`` opens name."""
        if not text:
            return
        try:
            name, parts = parse_selection(text)
            ref = self._ref_named(name) if name else self.current_ref
            if ref is None:
                raise SelectionError("no section is open: name one, e.g. attn.3.k[0, 0, :]")
            sel = resolve_selection(name, parts, ref.info.shape or (1,))
        except SelectionError as e:
            self.notify(str(e), title="Go to", severity="warning", markup=False)
            return
        if sel.is_point:
            self.select_section(ref.key, cursor=sel.axes)
        else:
            self.select_section(ref.key, selection=sel)
        self.query_one(ValueGrid).focus()

    def _ref_named(self, name: str):
        rank = self.rank
        if name.startswith("rank") and "/" in name:
            head, name = name.split("/", 1)
            try:
                rank = int(head[4:])
            except ValueError:
                raise SelectionError(f"{head!r}: expected rankN/name") from None
        key = f"{rank}:{name}"
        if key not in self.doc:
            raise SelectionError(f"no section {name!r} in rank {rank}")
        return self.doc.ref(key)

    # -- export and copy
    def action_export(self) -> None:
        ref = self.current_ref
        if ref is None:
            self.notify("open a section first", severity="warning")
            return
        self.app.push_screen(PathPrompt(f"Export {ref.info.name} ({ref.info.dtype} {list(ref.info.shape)}, digest-checked) to a .npy file:",
                                        value=ref.info.name + ".npy"), lambda path: self._export(ref, path))

    def _export(self, ref, path: str | None) -> None:
        if path:
            self._export_worker(ref, os.path.expanduser(path))

    @work(thread=True, group="export")
    def _export_worker(self, ref, path: str) -> None:
        try:
            e = export_npy(self.doc.snapshot(ref), ref.info, path, source=self.doc.source)
        except HsnapError as err:
            self.app.call_from_thread(self.notify, describe_error(err), title="Export refused", severity="error", markup=False)
            return
        note = "" if e.stored_as == ref.info.dtype else f" as {e.stored_as}"
        self.app.call_from_thread(self.notify, f"{ref.info.name}{note} → {path}", title="Exported", markup=False)

    def action_copy(self) -> None:
        """The value under the grid cursor (Section tab, grid focused), else the section's digest."""
        ref = self.current_ref
        if ref is None:
            return
        grid = self.query_one(ValueGrid)
        if self.active_pane == "section" and grid.has_focus and grid.cursor_index is not None:
            index = grid.cursor_index
            try:
                v = grid.value_at(index)
            except HsnapError as e:
                self.notify(describe_error(e), severity="error", markup=False)
                return
            text = f"{ref.info.name}{list(index)} = {fmt_value(v, ref.info.dtype)}"
        else:
            text = ref.info.digest
        self.app.copy_to_clipboard(text)
        self.notify(f"copied: {text}", timeout=3, markup=False)

    def on_digest_panel_finished(self, event: DigestPanel.Finished) -> None:
        self.refresh_bindings()
        bad = self.doc.problems()
        if bad:
            names = ", ".join(self.doc.ref(k).info.name for k in bad[:5])
            self.notify(f"{len(bad)} section(s) are not intact: {names}", title="Digest MISMATCH",
                        severity="error", markup=False, timeout=MISMATCH_TOAST_SECONDS)
        broken = [] if event.cancelled else self.doc.chain_problems()
        if broken:
            self.notify("\n".join(broken), title="Chain FAILED", severity="error", markup=False, timeout=MISMATCH_TOAST_SECONDS)
