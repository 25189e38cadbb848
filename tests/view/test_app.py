"""Pilot tests of hsnap-view: selection and statistics, digest verification,
diff mode, compatibility, request paging, the command palette and errors."""

from __future__ import annotations

import glob
import json
import os
import threading

import pytest
from rich.console import Console
from textual.widgets import DataTable, Static

from view_fixtures import CHANGED_SECTIONS, CORRUPT_SECTION
from hsnap_format import open_snapshot
from hsnap_format.tools.stats import array_stats
from hsnap_view.app import main, make_app
from hsnap_view.screens.diff import DiffScreen
from hsnap_view.screens.error import ErrorScreen
from hsnap_view.screens.main import MainScreen
from hsnap_view.text import fmt_num
from hsnap_view.widgets.digest_panel import DigestPanel
from hsnap_view.widgets.request_panel import RequestPanel
from hsnap_view.widgets.section_detail import SectionDetail
from hsnap_view.widgets.section_tree import SectionTree
from hsnap_view.widgets.vtable import VTable

SIZE = (130, 40)
_VECTOR_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "spec", "vectors")
VECTORS = sorted(glob.glob(os.path.join(_VECTOR_DIR, "*.hsnap")) + [
    os.path.dirname(m) for m in glob.glob(os.path.join(_VECTOR_DIR, "*", "manifest.json"))
])


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


def plain(widget: Static) -> str:
    """What a Static shows, as plain text."""
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(widget.content)
    return console.export_text()


async def test_selecting_a_section_shows_its_stats(in_fixtures):
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        tree = app.screen.query_one(SectionTree)
        tree.focus()
        tree.select_key("0:attn.0.k")  # as a click would: the tree posts SectionChosen
        await settle(app, pilot)
        assert app.screen.query_one("#tabs").active == "section"
        detail = app.screen.query_one(SectionDetail)
        assert detail.ref.info.name == "attn.0.k"
        with open_snapshot("hybrid.hsnap") as snap:
            expected = array_stats(snap.array("attn.0.k"))
        shown = plain(detail.query_one("#detail-stats", Static))
        for value in (expected.mean, expected.std, expected.min, expected.max):
            assert fmt_num(value) in shown
        assert "elements" in shown and "NaN" in shown


async def test_geometry_table_row_opens_the_section(in_fixtures):
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#geometry-table", VTable)
        table.focus()
        table.move_cursor(row=3)
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.screen.query_one(SectionDetail).ref.info.name == "mamba.1.temporal"


async def test_corrupted_copy_shows_mismatch_on_the_right_section(in_fixtures):
    app = make_app("hybrid-corrupt.hsnap")
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.screen.query_one(DigestPanel)
        assert panel.mismatches == [f"0:{CORRUPT_SECTION}"]
        assert set(panel.status.values()) == {"ok", "MISMATCH"}
        table = panel.query_one(VTable)
        assert table.get_cell(f"0:{CORRUPT_SECTION}", "status").plain == "MISMATCH"
        assert table.get_cell("0:attn.0.k", "status").plain == "ok"
        tree = app.screen.query_one(SectionTree)
        assert tree._section_nodes[f"0:{CORRUPT_SECTION}"].label.plain.startswith("✗")
        # verifying again from the key binding gives the same verdict
        await pilot.press("v")
        await settle(app, pilot)
        assert panel.mismatches == [f"0:{CORRUPT_SECTION}"]
        assert app.screen.query_one("#tabs").active == "digests"


async def test_verification_can_be_cancelled(in_fixtures):
    """The scan stops between sections: hold the first section, cancel, release."""
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        snap, gate = app.document.first, threading.Event()
        verify_section = snap.verify_section

        def held(info, **kw):  # finishes its section whatever happens meanwhile
            gate.wait(10)
            return verify_section(info)

        snap.verify_section = held  # iter_verify calls it per section
        await pilot.press("v")
        await pilot.pause()
        panel = app.screen.query_one(DigestPanel)
        assert panel.running
        await pilot.press("x")
        gate.set()
        await settle(app, pilot)
        assert not panel.running and panel._note == "cancelled"
        assert list(panel.status.values()).count("ok") == 1
        assert list(panel.status.values()).count("pending") == len(panel.status) - 1


async def test_intact_directory_verifies_every_rank(in_fixtures):
    app = make_app("tp2")
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.screen.query_one(DigestPanel)
        assert len(panel.status) == 22 and set(panel.status.values()) == {"ok"}
        assert "rank 1 of 2" in [str(n.label) for n in app.screen.query_one(SectionTree).root.children]


async def test_diff_mode(in_fixtures):
    app = make_app("hybrid.hsnap", "hybrid-b.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, DiffScreen)
        status = {key.split(":", 1)[1]: d.status for key, d in screen.results.items()}
        assert len(status) == 11
        assert {n for n, s in status.items() if s != "equal"} == set(CHANGED_SECTIONS)
        assert screen.results["0:attn.2.k"].first_diff == (5, 1, 3)
        table = screen.query_one("#section-diffs", VTable)
        assert table.get_cell("0:mamba.3.temporal", "status").plain == "differ"
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, MainScreen)
        await pilot.press("d")
        await settle(app, pilot)
        assert isinstance(app.screen, DiffScreen)


async def test_diff_mode_reports_geometry_differences(in_fixtures):
    app = make_app("hybrid.hsnap", "fp8.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        headers = app.screen.query_one("#header-diffs", DataTable)
        fields = [headers.get_row_at(i)[1].plain for i in range(headers.row_count)]
        assert "geometry.attention.dtype" in fields
        statuses = {d.status for d in app.screen.results.values()}
        assert {"shape-mismatch", "only-in-A", "only-in-B"} <= statuses


async def test_compatibility_against_a_json_identity(in_fixtures, tmp_path):
    with open_snapshot("hybrid.hsnap") as snap:
        ident = dict(snap.header["identity"], model_id="other/model")
    path = tmp_path / "target.json"
    path.write_text(json.dumps({"identity": ident}))
    app = make_app("hybrid.hsnap", against=path, verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4")
        await settle(app, pilot)
        verdict = plain(app.screen.query_one("#compat-verdict", Static))
        assert "INCOMPATIBLE (1 fields differ)" in verdict
        table = app.screen.query_one("#compat-table", DataTable)
        rows = {table.get_row_at(i)[1].plain: table.get_row_at(i)[0].plain for i in range(table.row_count)}
        assert rows["identity.model_id"] == "DIFFERS" and rows["identity.tp_size"] == "same"


async def test_check_against_prompt_and_bad_reference(in_fixtures, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c")
        await pilot.pause()
        app.screen.query_one("#prompt-input").value = str(bad)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, MainScreen)
        assert any("MalformedHeaderError" in n.message for n in app._notifications)
        await pilot.press("c")
        await pilot.pause()
        app.screen.query_one("#prompt-input").value = "fp8.hsnap"
        await pilot.press("enter")
        await settle(app, pilot)
        assert "INCOMPATIBLE" in plain(app.screen.query_one("#compat-verdict", Static))


async def test_request_history_pages_and_token_text(in_fixtures):
    app = make_app("hybrid.hsnap", page_size=5, tokenizer=lambda i: f"<{i}>", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await pilot.pause()
        panel = app.screen.query_one(RequestPanel)
        table = panel.query_one("#tokens", DataTable)
        assert (panel.pages, table.row_count) == (3, 5)
        first_token = int(panel.prompt[0])
        assert table.get_row_at(0)[3].plain == repr(f"<{first_token}>")
        await pilot.press("right_square_bracket", "right_square_bracket", "right_square_bracket")
        await pilot.pause()
        assert panel.page == 2 and table.row_count == 3  # 13 tokens: 5 + 5 + 3
        assert table.get_row_at(2)[1].plain == "output" and table.get_row_at(2)[4].plain != ""
        summary = plain(panel.query_one("#request-summary", Static))
        assert "req-7\\x1b[31m" in summary and "\x1b" not in summary  # control characters escaped
        assert "remaining budget  124" in summary


async def test_command_palette_jumps_to_a_section(in_fixtures):
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.press(*"layer 3 temporal")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, MainScreen)
        assert app.screen.query_one(SectionDetail).ref.info.name == "mamba.3.temporal"


async def test_help_screen(in_fixtures):
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, MainScreen)


async def test_unreadable_file_shows_an_error_screen(in_fixtures, tmp_path):
    bad = tmp_path / "garbage.hsnap"
    bad.write_bytes(b"\x89HSN but not really")
    app = make_app(bad)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, ErrorScreen)
        text = plain(app.screen.query_one("#error-text", Static))
        assert "BadMagicError" in text and str(tmp_path) not in text
        await pilot.press("q")


def test_cli_exits_2_with_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing.hsnap")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hsnap-view: HsnapIOError")


@pytest.mark.parametrize("vector", VECTORS or [pytest.param(None, marks=pytest.mark.skip(reason="no spec/vectors yet"))])
async def test_golden_vectors_open_verify_and_match_their_description(vector):
    """Every vector opens, verifies, and is compatible with the identity + geometry of its JSON."""
    description = os.path.splitext(os.path.normpath(vector))[0] + ".json"
    against = description if os.path.isfile(description) and os.path.isfile(vector) else None
    app = make_app(vector, against=against)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.error is None and not app.warnings
        panel = app.screen.query_one(DigestPanel)
        assert set(panel.status.values()) == {"ok"}
        if against:
            assert "compatible" in plain(app.screen.query_one("#compat-verdict", Static))
            assert "INCOMPATIBLE" not in plain(app.screen.query_one("#compat-verdict", Static))


async def test_verify_again_after_an_in_place_change_shows_the_mismatch(in_fixtures, tmp_path):
    """The viewer's "Verify digests" re-reads the bytes every time
    (it showed all ok on a handle that had verified the file before it changed)."""
    import shutil

    path = tmp_path / "h.hsnap"
    shutil.copy("hybrid.hsnap", path)
    app = make_app(str(path))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.screen.query_one(DigestPanel)
        assert panel.mismatches == []
        info = next(s for s in app.document.first.sections if s.name == "attn.0.k")
        with open(path, "r+b") as f:
            f.seek(info.offset)
            b = f.read(1)
            f.seek(info.offset)
            f.write(bytes([b[0] ^ 1]))
        await pilot.press("v")
        await settle(app, pilot)
        assert panel.mismatches == ["0:attn.0.k"]


def test_a_non_string_optional_feature_is_refused_not_a_crash_with_exit_0(tmp_path, capsys):
    """Once, the viewer crashed at start with a TypeError and still exited 0."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import craft

    data = open(os.path.join(_VECTOR_DIR, "hybrid.hsnap"), "rb").read()
    bad = craft.mutate_header(data, lambda h: h["features"].__setitem__("optional", [7]))
    p = craft.write(tmp_path / "bad.hsnap", bad)
    assert main([p]) == 2
    assert "header.features.optional" in capsys.readouterr().err
