"""hsnap-view at 80x24: every tab takes the keys once shown (the Map
tab scrolls to its temporal-state rows), the diff's cursor starts on the first
difference, no cell shows part of a number, and after ``o`` the tab keys still work
and the first output token is not on the last visible line."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from textual.geometry import Region
from textual.widgets import DataTable, TabbedContent

from view_fixtures import CHANGED_SECTIONS, ZEROED_SECTION, _write, hybrid_geometry
from hsnap_format.tools.viewmodel import fmt_value
from hsnap_view.app import make_app
from hsnap_view.screens.diff import DiffScreen
from hsnap_view.screens.main import PANES, MainScreen
from hsnap_view.widgets.norm_map import NormMapView
from hsnap_view.widgets.request_panel import RequestPanel
from hsnap_view.widgets.value_grid import APPROX, ValueGrid, cell_text
from hsnap_view.widgets.vtable import VTable

SMALL = (80, 24)


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


def visible(widget) -> str:
    return "\n".join(s.text for s in widget.render_lines(Region(0, 0, widget.size.width, widget.size.height)))


async def test_map_tab_scrolls_from_the_keyboard_at_80x24(in_fixtures):
    """The temporal-state rows (where a zeroed state shows) were below the fold and the
    keys went to the hidden tree; now 7 gives the keys to the map and End shows them."""
    app = make_app("zeroed.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("7")
        await settle(app, pilot)
        view = app.screen.query_one(NormMapView)
        assert ZEROED_SECTION not in visible(view)  # below the fold at 80x24
        await pilot.press("end")
        await pilot.pause()
        shown = visible(view)
        assert ZEROED_SECTION in shown and "ALL ZERO" in shown
        await pilot.press("home")
        await pilot.pause()
        assert ZEROED_SECTION not in visible(view)


@pytest.mark.parametrize("size", [SMALL, (160, 48)], ids=["80x24", "160x48"])
@pytest.mark.parametrize("pane", list(PANES))
async def test_every_tab_takes_the_keys(in_fixtures, pane, size):
    """Whichever tab a digit shows, the keys go to a widget on it (never the hidden tree,
    nor the tree beside it: a digit asks for that tab)."""
    app = make_app("long.hsnap", verify_on_open=False)
    async with app.run_test(size=size) as pilot:
        await pilot.press(str(list(PANES).index(pane) + 1))
        await settle(app, pilot)
        focused = app.focused
        assert app.screen.query_one(TabbedContent).active == pane
        assert focused is not None and app.screen.query_one(f"TabPane#{pane}") in focused.ancestors_with_self


async def test_the_tree_keeps_the_keys_while_browsing(in_fixtures):
    """Opening a section from the tree shows the Section tab but leaves the arrows with
    the tree, so the next section is one key away."""
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        tree = app.screen.query_one("#tree")
        tree.focus()
        await pilot.pause()
        app.screen.select_section("0:attn.2.k")
        await settle(app, pilot)
        assert app.screen.query_one(TabbedContent).active == "section" and app.focused is tree


async def test_diff_enter_right_after_opening_opens_the_first_difference(in_fixtures):
    app = make_app("hybrid.hsnap", "hybrid-b.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, DiffScreen)
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, MainScreen)
        ref = app.screen.current_ref
        assert ref.info.name in CHANGED_SECTIONS
        grid = app.screen.query_one(ValueGrid)
        assert grid.mark is not None and grid.cursor_index == grid.mark


async def test_diff_cursor_moved_by_hand_stays(in_fixtures):
    app = make_app("hybrid.hsnap", "hybrid-b.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        table = app.screen.query_one("#section-diffs", VTable)
        await pilot.press("down", "down", "down")
        key = table.cursor_key
        app.screen._set_rows()  # more results arriving
        assert table.cursor_key == key


def _cell_tokens(line: str, label_w: int) -> list[str]:
    return line[label_w:].split()


async def test_value_grid_never_shows_part_of_a_number(in_fixtures):
    """At 80x24 the grid is narrower than a row of attn.2.k: whole cells only, at every
    sideways position the cursor takes, and ``›`` where more columns follow; before, the
    right edge showed a value's first digits and a scrolled grid its last ones."""
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        screen = app.screen
        screen.select_section("0:attn.2.k")
        await settle(app, pilot)
        grid = screen.query_one(ValueGrid)
        grid.focus()
        for _ in range(200):  # on a loaded machine the grid's first layout can come after the workers finish
            if len(visible(grid).splitlines()) > 2:
                break
            await pilot.pause(0.05)
        k = app.document.first.read(app.document.first.section("attn.2.k"))
        n_cols = k.shape[-1]
        for step in range(n_cols):
            lines = visible(grid).splitlines()
            shown_cols = [int(c) for c in lines[1].split() if c.isdigit()]
            assert shown_cols and "›" in lines[1] or shown_cols[-1] == n_cols - 1
            for r in range(grid._body_height()):
                row = round(grid.scroll_y) + r
                if row >= grid._rows:
                    break
                tokens = [t for t in _cell_tokens(lines[2 + r], grid._label_w) if t != "›"]
                lead = grid._leading(row)
                want = [cell_text(k[lead + (c,)], "bfloat16") for c in shown_cols]
                assert tokens == want, (step, r, tokens, want)
            await pilot.press("right")
            await pilot.pause()
        assert grid.cursor_index[-1] == n_cols - 1


def _edit_long_values(state) -> None:
    t = np.array(state["mamba.1.temporal"])
    t.flat[0] = -1.2345678e-05
    t.flat[1] = 123456789.0
    state["mamba.1.temporal"] = t


async def test_value_grid_marks_a_value_rounded_to_fit(tmp_path):
    """A value longer than its cell is rounded to fit and marked ≈ (before: cut to
    ``-1.2345678…``, which reads as -1.23); the top line has it exactly."""
    path = tmp_path / "long-values.hsnap"
    _write(str(path), hybrid_geometry(), edit=_edit_long_values)
    assert cell_text(np.float32(-1.2345678e-05), "float32") == f"{APPROX}-1.235e-05"
    assert cell_text(np.float32(0.25), "float32") == "0.25"
    app = make_app(str(path), verify_on_open=False)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)  # mounted: the first tab's focus cannot pull the tabs back later
        app.screen.select_section("0:mamba.1.temporal")
        await settle(app, pilot)
        grid = app.screen.query_one(ValueGrid)
        lines = visible(grid).splitlines()
        first_row = _cell_tokens(lines[2], grid._label_w)
        assert first_row[0] == f"{APPROX}-1.235e-05" and first_row[1] == "123456792"  # exact in fewer digits: no mark
        assert "-1.2345678e-05" in lines[0]  # the cursor line: exactly
        for line in lines[2:]:  # every other cell is its exact shortest form
            for tok in _cell_tokens(line, grid._label_w):
                assert tok.startswith(APPROX) or re.fullmatch(r"-?[0-9.]+(e[-+][0-9]+)?|nan|inf|-inf", tok), tok


async def test_cursor_line_never_cuts_a_number(in_fixtures):
    """At 80x24 the line above the grid ended in ``(exactly -0.239257``: a number cut short."""
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)  # mounted: the first tab's focus cannot pull the tabs back later
        app.screen.select_section("0:attn.2.k")
        await settle(app, pilot)
        grid = app.screen.query_one(ValueGrid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # laid out and drawn (a loaded machine can take more than one pause)
            if grid.cursor_index is not None and grid.scrollable_content_region.width and visible(grid).strip():
                break
            await pilot.pause(0.05)
        assert app.screen.active_pane == "section" and visible(grid).strip(), (app.screen.active_pane, grid.region)
        top = visible(grid).splitlines()[0].rstrip()
        v = grid.value_at(grid.cursor_index)
        assert f"= {fmt_value(v, 'bfloat16')}" in top
        m = re.search(r"exactly (\S+?)[,)]?(?:\s|$)", top)
        assert m is not None or top.endswith("…"), top
        if m:
            assert m.group(1) == repr(float(v)), top  # whole, or not there at all


async def test_tables_show_whole_columns_when_scrolled(in_fixtures):
    """The diff table is wider than 80 columns: sideways it moves a whole column per key,
    the section names stay, and no cell shows part of a number."""
    app = make_app("hybrid.hsnap", "hybrid-b.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        table = app.screen.query_one("#section-diffs", VTable)
        key = next(k for k in table.keys if k.endswith("mamba.3.temporal"))
        values = {c: table.get_cell(key, c).plain for c in ("A value", "B value", "max abs", "max rel")}
        whole = {tok for c in table.columns for tok in table.get_cell(key, c.key).plain.split()}
        row = table.get_row_index(key) + 1
        seen = set()
        for _ in range(len(table.columns)):
            lines = visible(table).splitlines()
            assert "mamba.3.temporal" in lines[row]
            for tok in lines[row].split():
                if re.search(r"[0-9]", tok) and "…" not in tok:  # (a cell cut to its width ends in …)
                    seen.add(tok)
                    assert tok in whole, tok
            await pilot.press("right")
            await pilot.pause()
        assert set(values.values()) <= seen  # every column was reached


async def test_after_o_the_tab_keys_work_and_the_first_output_is_in_view(in_fixtures):
    app = make_app("long.hsnap", verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("5")
        await pilot.pause()
        await pilot.press("o")
        await pilot.pause()
        await pilot.pause()
        panel = app.screen.query_one(RequestPanel)
        table = panel.query_one("#tokens", DataTable)
        assert table.get_row_at(table.cursor_row)[0].plain == str(panel.n_prompt)
        body = table.scrollable_content_region.height - 1  # the header row is fixed
        line = table.cursor_row - round(table.scroll_y)
        assert 0 <= line <= body // 3, (line, body)  # a third of the way down, not the last line
        tabs = app.screen.query_one(TabbedContent)
        for key, pane in (("1", "geometry"), ("7", "map"), ("5", "request"), ("3", "digests")):
            await pilot.press(key)
            await pilot.pause()
            assert tabs.active == pane, key
