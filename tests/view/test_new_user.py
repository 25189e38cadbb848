"""hsnap-view from a new user's chair: one test per bug a user hit, each
failing on the viewer before the fix, then what users expected to find (value
grid with go-to and slices, search, diff row -> first difference, export, copy,
partial view of a truncated file) and the 10,000-section budget. The norm heatmap
is checked in test_snapshots.py (an SVG and the text of its lines)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import numpy as np
import pytest
from rich.console import Console
from textual.geometry import Region
from textual.widgets import DataTable, Static

from view_fixtures import CHANGED_SECTIONS, CORRUPT_SECTION
from hsnap_format import open_snapshot
from hsnap_format.tools.export_npy import load_npy_as
from hsnap_view.app import main, make_app
from hsnap_view.screens.diff import DiffScreen
from hsnap_view.screens.help import HelpScreen
from hsnap_view.screens.main import MainScreen
from hsnap_view.screens.prompt import PathPrompt
from hsnap_view.widgets.digest_panel import DigestPanel
from hsnap_view.widgets.hex_view import HexView
from hsnap_view.widgets.identity_panel import IdentityPanel
from hsnap_view.widgets.request_panel import RequestPanel
from hsnap_view.widgets.section_detail import SectionDetail
from hsnap_view.widgets.section_tree import SectionTree
from hsnap_view.widgets.value_grid import ValueGrid
from hsnap_view.widgets.vtable import VTable

SIZE = (130, 40)
VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "spec", "vectors")


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


def plain(widget: Static) -> str:
    console = Console(width=400, record=True, file=open(os.devnull, "w"))
    console.print(widget.content)
    return console.export_text()


def visible(widget) -> str:
    """What a widget shows on screen now (cropped to its size), as text."""
    return "\n".join(s.text for s in widget.render_lines(Region(0, 0, widget.size.width, widget.size.height)))


async def type_into_prompt(pilot, text: str) -> None:
    await pilot.pause()
    assert isinstance(pilot.app.screen, PathPrompt)
    pilot.app.screen.query_one("#prompt-input").value = text
    await pilot.press("enter")
    await pilot.pause()


# ---------------------------------------------------------------------------- bugs


@pytest.mark.parametrize("size", [(160, 48), (80, 24)])
async def test_output_tokens_are_reachable_by_key(in_fixtures, size):
    """A long summary (34 sampling + 51 engine fields) hid the token table: at 80x24 it did
    not show at all, and the outputs took a page key per 100 tokens. ``o`` goes there."""
    app = make_app("long.hsnap", verify_on_open=False)
    async with app.run_test(size=size) as pilot:
        await pilot.press("5")
        await pilot.pause()
        panel = app.screen.query_one(RequestPanel)
        table = panel.query_one("#tokens", DataTable)
        assert table.size.height >= 4  # the table has room whatever the summary holds

        async def at(pos: int) -> None:
            await pilot.pause()
            row = table.cursor_row
            assert table.get_row_at(row)[0].plain == str(pos)
            assert table.scroll_y <= row < table.scroll_y + table.size.height - 1  # on screen, not below the fold

        await pilot.press("o")
        await at(150)
        assert panel.page == 1 and table.get_row_at(table.cursor_row)[1].plain == "output"
        await pilot.press("less_than_sign")
        assert panel.page == 0
        await pilot.press("greater_than_sign")
        assert panel.page == panel.pages - 1
        await pilot.press("g")
        await type_into_prompt(pilot, "99")
        await at(99)
        assert panel.page == 0


def test_a_bad_tokenizer_is_one_line_not_a_traceback(in_fixtures, capsys):
    assert main(["--tokenizer", "/nonexistent", "hybrid.hsnap"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hsnap-view: --tokenizer: /nonexistent") and "Traceback" not in err


async def test_a_file_truncated_under_the_viewer_gives_messages(in_fixtures, tmp_path):
    """Reads are pread (typed errors): the section shows MISSING, the app keeps running,
    and no section is ever mapped (a map is what turned a truncation into SIGBUS)."""
    path = tmp_path / "t.hsnap"
    shutil.copy("hybrid.hsnap", path)
    app = make_app(str(path), verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        cut = app.document.first.section("attn.2.k")
        os.truncate(path, cut.offset + 8)
        app.screen.select_section("0:attn.2.k")
        await settle(app, pilot)
        assert app.document.status["0:attn.2.k"] == "MISSING"
        detail = app.screen.query_one(SectionDetail)
        for _ in range(200):  # on a loaded machine the banner's first layout can come after the workers finish
            if "MISSING" in visible(detail.query_one("#detail-banner")):
                break
            await pilot.pause(0.05)
        assert "MISSING" in visible(detail.query_one("#detail-banner"))
        assert "unreadable: TruncatedError" in visible(detail.query_one(ValueGrid))
        await pilot.press("6")
        await pilot.pause()
        assert "unreadable" in visible(app.screen.query_one(HexView))
        await pilot.press("v")
        await settle(app, pilot)
        status = app.document.status
        assert status["0:attn.0.k"] == "ok" and status["0:attn.2.v"] == "MISSING"
        assert not any(s.source.mapped for s in app.document.ranks.values())
        await pilot.press("q")
    assert not app.return_code


def _run_in_pty(argv, until: bytes, timeout: float = 30.0):
    """Start argv on a pseudo-terminal (80x24); return (pid, fd, output so far) once ``until`` was drawn."""
    import fcntl
    import pty
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # child
        os.environ.update(TERM="xterm-256color", COLUMNS="80", LINES="24")
        os.execv(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    out, deadline = b"", time.monotonic() + timeout
    while until not in out and time.monotonic() < deadline:
        try:
            out += os.read(fd, 65536)
        except OSError:
            break
    return pid, fd, out


def _drain(fd) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.skipif(sys.platform != "linux", reason="pty and signals as on Linux")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_gives_the_terminal_back(in_fixtures, sig):
    """Killed politely (SIGTERM, as a supervisor does; SIGINT from outside), the viewer
    leaves the alternate screen and exits 128 + signal; before, SIGTERM killed it on the
    alternate screen and SIGINT ended it with status 0."""
    pid, fd, out = _run_in_pty([sys.executable, "-m", "hsnap_view", "--no-verify", "hybrid.hsnap"], b"sections")
    assert b"\x1b[?1049h" in out and b"sections" in out, out[-400:]
    os.kill(pid, sig)
    out += _drain(fd)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + sig
    assert b"\x1b[?1049l" in out[out.rindex(b"\x1b[?1049h"):]  # the alternate screen was left


async def test_a_corrupt_section_says_so_and_comes_first(in_fixtures):
    """Opening the section hashes it: a banner, before any scan; the Digests table lists it
    first and its summary names it; the same after a full scan."""
    key = f"0:{CORRUPT_SECTION}"
    app = make_app("hybrid-corrupt.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        screen.select_section("0:attn.0.k")
        await settle(app, pilot)
        assert not screen.query_one("#detail-banner").display
        screen.select_section(key)
        await settle(app, pilot)
        banner = screen.query_one("#detail-banner")
        assert banner.display and "DIGEST MISMATCH" in visible(banner)
        panel = screen.query_one(DigestPanel)
        assert panel.query_one(VTable).keys[0] == key
        assert CORRUPT_SECTION in plain(panel.query_one("#digest-summary"))
        await pilot.press("v")
        await settle(app, pilot)
        assert panel.query_one(VTable).keys[0] == key and panel.mismatches == [key]
        assert CORRUPT_SECTION in visible(panel.query_one("#digest-summary"))
        assert SectionTree._label(CORRUPT_SECTION, "MISMATCH").plain.startswith("✗")


async def test_diff_lists_what_differs_first_and_flags_a_corrupt_side(in_fixtures):
    app = make_app("hybrid.hsnap", "hybrid-b.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        table = screen.query_one("#section-diffs", VTable)
        assert {k.split(":", 1)[1] for k in table.keys[:2]} == set(CHANGED_SECTIONS)
        verdict = plain(screen.query_one("#diff-verdict"))
        assert all(name in verdict for name in CHANGED_SECTIONS)
        # the first differing values are told apart (bf16: the table, then the bits)
        row = {c: table.get_cell("0:attn.2.k", c).plain for c in ("A value", "B value", "ulp · bits")}
        assert row["A value"] != row["B value"] and "ulp" in row["ulp · bits"]
    app = make_app("hybrid.hsnap", "hybrid-corrupt.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        verdict = plain(app.screen.query_one("#diff-verdict"))
        assert "B (hybrid-corrupt.hsnap) FAILS ITS OWN DIGESTS" in verdict and CORRUPT_SECTION in verdict
        assert app.screen.query_one("#section-diffs", VTable).keys[0] == f"0:{CORRUPT_SECTION}"


async def test_tree_labels_are_whole():
    """In the hybrid vector two nodes both read ``request.top_logprob`` (cut at ~30 columns)."""
    app = make_app(os.path.join(VECTORS, "hybrid.hsnap"), verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        tree = app.screen.query_one(SectionTree)
        shown = visible(tree)
        for ref in app.document.refs:
            assert ref.info.name in shown, ref.info.name


async def test_usable_at_80x24(in_fixtures):
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        screen = app.screen
        title = visible(screen.query_one("#title"))
        assert "tiny/hybrid-4L" in title and "KiB" in title  # model and units survive the width
        tree = screen.query_one(SectionTree)
        assert not tree.display  # hidden at start below 100 columns...
        await pilot.press("t")
        assert tree.display  # ...and shown (or hidden again) with t
        await pilot.press("t")
        screen.select_section("0:attn.2.k")
        await settle(app, pilot)
        grid = screen.query_one(ValueGrid)
        first = fmt_first(app, "attn.2.k")
        assert first in visible(grid) and "…" not in visible(grid).splitlines()[2].split()[1]
        await pilot.press("6")
        await pilot.pause()
        assert screen.query_one(HexView).size.height >= 10
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert app.screen.query_one("#help").region.right <= 80


def fmt_first(app, name: str) -> str:
    from hsnap_format.tools.viewmodel import fmt_value

    info = app.document.first.section(name)
    return fmt_value(app.document.first.read(info)[(0,) * len(info.shape)], info.dtype)


# Regression guards, not speed targets (speed is bench/viewer.py's: 0.3-0.7 CPU s to the
# first frame, ~1 s scan, 0.1 s to quit). Each is many times the measured figure, so a
# loaded machine never decides the verdict (a 2.0 CPU s guard failed under load);
# what they still catch is a first frame or scan that grows with the section count again
# (it once took minutes) or a quit that hangs. The batch count below is the exact guard.
GUARD_FIRST_FRAME_CPU_S = 10.0
GUARD_SCAN_S = 60.0
GUARD_QUIT_S = 10.0


async def test_ten_thousand_sections_first_frame_scan_and_quit(big_snapshot):
    """A first frame, a linear scan (results in batches, not a message per section:
    10,006 sections took minutes), and q quits, even mid-scan. The first frame is counted
    in CPU seconds of this process (wall time is reported on failure)."""
    t0, c0 = time.perf_counter(), time.process_time()
    app = make_app(big_snapshot)
    async with app.run_test(size=(160, 48)) as pilot:
        first_frame, first_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert isinstance(app.screen, MainScreen)
        panel = app.screen.query_one(DigestPanel)
        batches = []
        original = panel.on_digest_panel_checked
        panel.on_digest_panel_checked = lambda e: (batches.append(len(e.results)), original(e))[1]
        deadline = time.monotonic() + GUARD_SCAN_S
        while (panel.running or set(panel.status.values()) != {"ok"}) and time.monotonic() < deadline:
            await pilot.pause(0.05)
        scan = time.perf_counter() - t0 - first_frame
        assert len(panel.status) == 10006 and set(panel.status.values()) == {"ok"}, f"scan unfinished after {scan:.1f} s"
        assert len(batches) < 200  # batched: the UI work per section is constant
        assert first_cpu < GUARD_FIRST_FRAME_CPU_S, f"first frame after {first_cpu:.2f} CPU s ({first_frame:.2f} s wall)"
        await pilot.press("v")  # scan again, and leave in the middle of it
        t1 = time.perf_counter()
        await pilot.press("q")
    assert time.perf_counter() - t1 < GUARD_QUIT_S


async def test_d_asks_for_the_other_file_and_enter_opens_the_first_difference(in_fixtures):
    """``d`` with one file open did nothing; now it asks. Enter on a diff row opens A's
    section with the grid cursor on (and the cell marked at) the first difference."""
    app = make_app("hybrid.hsnap", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("d")
        await type_into_prompt(pilot, "hybrid-b.hsnap")
        await settle(app, pilot)
        assert isinstance(app.screen, DiffScreen) and len(app.screen.results) == 11
        table = app.screen.query_one("#section-diffs", VTable)
        table.move_cursor(table.get_row_index("0:attn.2.k"))
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, MainScreen)
        grid = app.screen.query_one(ValueGrid)
        assert app.screen.current_ref.info.name == "attn.2.k"
        assert grid.cursor_index == (5, 1, 3) and grid.mark == (5, 1, 3)


async def test_two_ranks_show_the_set_and_switch(in_fixtures):
    app = make_app("tp2", verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4")
        await pilot.pause()
        panel = app.screen.query_one(IdentityPanel)
        text = plain(panel.query_one("#identity-fields"))
        assert "rank 0 of 2" in text and "holds ranks 0, 1" in text
        await pilot.press("r")
        await pilot.pause()
        assert panel.rank == 1 and "rank 1 of 2" in plain(panel.query_one("#identity-fields"))
        titles = [c.title for c in app.screen.query_one("#geometry-table", VTable).columns]
        assert "aligned to" in titles and "align" not in titles


def test_a_leftover_temp_file_points_to_gc(tmp_path, capsys):
    leftover = tmp_path / ".x.hsnap.hsnap-tmp-123-abcd"
    leftover.write_bytes(bytes(4096))  # a write that never got its first bytes down
    assert main([str(leftover)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BadMagicError" in err and "hsnap gc" in err


# ---------------------------------------------------------------------------- what users expect


async def test_value_grid_goto_slices_search_copy_and_export(in_fixtures, tmp_path, monkeypatch):
    """g: an element, a slice, another section, a refusal; / with n and N; y copies the
    value under the grid cursor (else the digest); e writes a .npy that round-trips."""
    monkeypatch.chdir(tmp_path)
    src = str(in_fixtures / "hybrid.hsnap")
    with open_snapshot(src) as snap:
        k = snap.read("attn.2.k")
    app = make_app(src, verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await pilot.press("slash")
        await type_into_prompt(pilot, "temporal")
        assert screen.current_ref.info.name == "mamba.1.temporal"
        await pilot.press("n")
        assert screen.current_ref.info.name == "mamba.3.temporal"
        await pilot.press("N")
        assert screen.current_ref.info.name == "mamba.1.temporal"
        await pilot.press("y")  # no grid focus: the digest
        assert app.clipboard == screen.current_ref.info.digest

        screen.select_section("0:attn.2.k")
        await settle(app, pilot)
        grid = screen.query_one(ValueGrid)
        await pilot.press("g")
        await type_into_prompt(pilot, "[5, 1, 3]")
        assert grid.cursor_index == (5, 1, 3) and grid.value_at((5, 1, 3)) == k[5, 1, 3]
        await pilot.press("right", "down")
        assert grid.cursor_index == (6, 0, 4)  # rows walk [token, head]
        await pilot.press("e")
        await type_into_prompt(pilot, "k.npy")
        await settle(app, pilot)
        got = load_npy_as(str(tmp_path / "k.npy"), "bfloat16")
        assert got.shape == k.shape and got.view(np.uint16).tobytes() == k.view(np.uint16).tobytes()

        # what g hands to the screen (the prompt itself was exercised above)
        screen.goto_index("[2:4, 1, :3]")
        await pilot.pause()
        assert (grid._rows, len(grid._cols)) == (2, 3) and grid.index_at(1, 2) == (3, 1, 2)
        screen.goto_index("attn.0.v[-1, 0, 0]")
        await pilot.pause()
        assert screen.current_ref.info.name == "attn.0.v" and grid.cursor_index == (11, 0, 0)
        screen.goto_index("[99, 0, 0]")
        await pilot.pause()
        assert any("outside" in n.message for n in app._notifications)
        await pilot.press("y")  # the value under the cursor
        assert app.clipboard.startswith("attn.0.v[11, 0, 0] = ")


async def test_partial_view_of_a_truncated_file(in_fixtures, tmp_path):
    """Cut short (a copy interrupted): the header and the intact sections are shown,
    the missing ones marked; before, only an error screen."""
    path = tmp_path / "cut.hsnap"
    data = open("hybrid.hsnap", "rb").read()
    with open_snapshot("hybrid.hsnap") as snap:
        cut = snap.section("attn.2.k").offset + 10
    path.write_bytes(data[:cut])
    app = make_app(str(path))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, MainScreen) and app.document.partial
        assert "PARTIAL VIEW" in plain(app.screen.query_one("#partial-banner"))
        status = app.document.status
        assert status["0:attn.0.k"] == status["0:mamba.1.temporal"] == "ok"
        assert status["0:attn.2.k"] == status["0:request.output_ids"] == "MISSING"
        assert app.screen.query_one(DigestPanel).query_one(VTable).keys[0] == "0:attn.2.k"
        await pilot.press("5")  # the record is beyond the cut: said, not a crash
        await pilot.pause()
        assert "record not all readable" in plain(app.screen.query_one("#request-errors"))
