"""hsnap-view DIR of a directory the server writes — a drain's (snapshots, TP sets), a checkpointer's (a chain of
``<name>.ckNNNNNN.hsnap`` links), with a page store and a writer's leftover — opens a listing of what a resume of
it reads, the same entries ``hsnap info DIR`` prints: one row per entry with its rid, what it is and its position,
a damaged newest link passed over (why, and the link used instead), the page store and the leftover. ``enter``
opens an entry on the main screen, ``escape`` comes back, ``q`` quits; a directory with nothing to view says so
in one line; the listing fits 80x24."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from textual.geometry import Region
from textual.widgets import OptionList, Static

from view_fixtures import flip_byte
from hsnap_format import open_snapshot
from hsnap_format.chain import base_ref
from hsnap_format.tools import cli
from hsnap_view.app import main, make_app
from hsnap_view.listing import NothingToViewError
from hsnap_view.screens.directory import DirectoryScreen
from hsnap_view.screens.error import ErrorScreen
from hsnap_view.screens.main import MainScreen

VEC = Path(__file__).resolve().parents[2] / "spec" / "vectors"
LINKS = ("c.ck000001.hsnap", "c.ck000002.hsnap", "c.ck000003.hsnap")
CHAIN_POSITIONS = (3, 5, 8)  # spec/vectors/chain.json's links
SMALL, SIZE = (80, 24), (130, 30)


def write_checkpoint_chain(directory: Path, names=LINKS) -> None:
    """spec/vectors/chain.json's three links (a plain snapshot, two deltas) under a checkpointer's names: each
    delta names the link below it, as a checkpointer writes them."""
    spec = importlib.util.spec_from_file_location("vector_generator", VEC / "generate.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    below = None
    for name, link in zip(names, generator.load("chain")["links"]):
        base = None
        if below is not None:
            with open_snapshot(str(below)) as snap:
                base = base_ref(snap, below.name)
        generator.write_rank(link, directory / name, base)
        below = directory / name


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A drain's directory: a snapshot, a TP set, a checkpoint chain of three links, a page store, a leftover."""
    d = tmp_path_factory.mktemp("listing") / "drained"
    d.mkdir()
    shutil.copyfile(VEC / "hybrid.hsnap", d / "a.hsnap")
    shutil.copytree(VEC / "two-rank", d / "b")
    write_checkpoint_chain(d)
    shutil.copytree(VEC / "pages", d / "pages")
    (d / ".a.hsnap.tmp-1234").write_bytes(b"half written")
    return d


@pytest.fixture
def drained(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "drained"))


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


def visible(widget) -> list[str]:
    """What a widget shows now (cropped to its size), line by line."""
    return [s.text for s in widget.render_lines(Region(0, 0, *widget.outer_size))]


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"\s{2,}", line.strip()) if c.strip()]


def rows(app) -> dict[str, list[str]]:
    """The listing's rows as shown, by their first cell."""
    shown = [cells(line) for line in visible(app.screen.query_one(OptionList))]
    return {c[0]: c for c in shown if c}


def title(app) -> str:
    return " ".join(visible(app.screen.query_one("#title"))).strip()


def plain(widget: Static) -> str:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(widget.content)
    return console.export_text()


def detail(app) -> str:
    """The line under the table (whole: it wraps)."""
    return " ".join(plain(app.screen.query_one("#listing-detail", Static)).split())


def cli_rows(path: Path) -> dict[str, list[str]]:
    """``hsnap info DIR``'s table rows, by entry."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["info", str(path)]) == 0
    lines = out.getvalue().splitlines()
    head = next(i for i, line in enumerate(lines) if cells(line) == ["entry", "rid", "what", "positions", "size"])
    table = [cells(line) for line in lines[head + 1:] if re.match(r"  \S", line)]  # not the wrapped details
    return {c[0]: c for c in table}


async def highlight(app, pilot, name: str) -> None:
    listing = app.screen.query_one(OptionList)
    names = [c[0] if c else "" for c in (cells(str(listing.get_option_at_index(i).prompt)) for i in range(listing.option_count))]
    listing.highlighted = names.index(name)
    await pilot.pause()


async def test_a_drain_directory_lists_each_entry_as_hsnap_info_does(drained):
    app = make_app(drained, verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, DirectoryScreen) and app.error is None
        shown = rows(app)
        assert shown["a.hsnap"][1:4] == ["vector-hybrid", "snapshot", "5"]
        assert shown["b/"][2:4] == ["TP set of 2 ranks", "4"]
        assert shown["c.ck000003.hsnap"][1:4] == ["vector-chain", "chain of 3 links", str(CHAIN_POSITIONS[-1])]
        assert shown["pages/"][2:4] == ["page store", "3 pages"]
        assert shown[".a.hsnap.tmp-1234"][2] == "leftover"
        assert "c.ck000002.hsnap" not in shown  # the chain's older links are below its newest, not entries
        for entry, row in cli_rows(drained).items():  # the same cells as the command line's table
            assert shown[entry + "/" * (entry == "b")][1:] == row[1:], entry
        assert "drained/ · 2 snapshots · 1 checkpoint chain · page store pages/: 3 pages" in title(app) and "1 leftover" in title(app)
        await highlight(app, pilot, "c.ck000003.hsnap")
        assert "the newest committed link of c's 3 checkpoint links" in detail(app)


async def test_a_damaged_newest_link_is_passed_over_naming_the_link_used_instead(drained):
    newest = str(drained / LINKS[-1])
    with open_snapshot(newest) as snap:
        flip_byte(newest, snap.sections[0].name)
    app = make_app(drained, verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        shown = rows(app)
        assert shown["c.ck000002.hsnap"][1:4] == ["vector-chain", "chain of 3 links", str(CHAIN_POSITIONS[1])]
        assert shown["c.ck000003.hsnap"][2] == "passed over"
        names = list(shown)
        assert names.index("c.ck000003.hsnap") == names.index("c.ck000002.hsnap") + 1  # under the link used
        await highlight(app, pilot, "c.ck000003.hsnap")
        said = detail(app)
        assert "c.ck000003.hsnap passed over: its chain does not hold (DigestMismatchError" in said, said
        assert "c.ck000002.hsnap is used instead" in said
        assert str(drained) not in said  # named below the directory
        assert "1 passed over" in title(app)


async def test_enter_opens_an_entry_and_escape_comes_back_to_the_listing(drained):
    app = make_app(drained, verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        listing = app.screen
        await highlight(app, pilot, "c.ck000003.hsnap")
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, MainScreen)
        assert title(app).startswith("c.ck000003.hsnap · ") and "link 3 of 3" in title(app)
        assert app.screen.active_bindings["escape"].binding.description == "Back"  # in the footer: opened from a listing
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is listing and app.document is None
        assert "c.ck000003.hsnap: the newest committed link" in detail(app)  # the cursor where it was
        await highlight(app, pilot, "b/")
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, MainScreen) and title(app).startswith("b/ · ")
        await pilot.press("escape")
        await highlight(app, pilot, "pages/")
        await pilot.press("enter")  # the page store: nothing to open, said so
        await settle(app, pilot)
        assert app.screen is listing
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0 and app.error is None


@pytest.mark.parametrize("holds", [{}, {"notes.txt": b"not a snapshot"}, {"pages/": None}], ids=["empty", "other-files", "page-store"])
async def test_a_directory_with_nothing_to_view_says_so_in_one_line(tmp_path, capsys, holds):
    d = tmp_path / "nothing"
    d.mkdir()
    for name, data in holds.items():
        if data is None:
            shutil.copytree(VEC / "pages", d / name)
        else:
            (d / name).write_bytes(data)
    app = make_app(d)
    assert app.error is not None and isinstance(app.error[1], NothingToViewError)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, ErrorScreen)
        said = plain(app.screen.query_one("#error-text", Static))
        assert "NothingToViewError: nothing/ holds no snapshot, TP set or checkpoint chain to view" in said
    assert main([str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hsnap-view: NothingToViewError: nothing/ holds no snapshot")
    assert ("page store pages/ of 3 pages" in err) == ("pages/" in holds) and "Traceback" not in err


async def test_the_listing_fits_80x24_eliding_only_with_a_mark(drained):
    long_name = "a-request-with-a-name-longer-than-any-terminal-is-wide-0123456789abcdef.hsnap"
    shutil.copyfile(drained / "a.hsnap", drained / long_name)
    app = make_app(drained, verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        listing = app.screen.query_one(OptionList)
        lines = [line.rstrip() for line in visible(listing) if line.strip()]
        assert len(lines) == listing.option_count == 6  # one line each: none wrapped, all on screen
        for line in lines:
            row = cells(line)
            assert len(row) == 5, line  # every column there
            assert len(line) <= listing.size.width
        elided = [c[0] for c in map(cells, lines) if "…" in c[0]]
        assert len(elided) == 1 and elided[0].startswith("a-req") and elided[0].endswith("abcdef.hsnap")  # its middle elided
        assert rows(app)["c.ck000003.hsnap"][2:] == ["chain of 3 links", str(CHAIN_POSITIONS[-1]), rows(app)["c.ck000003.hsnap"][-1]]
        head = cells(visible(app.screen.query_one("#listing-head"))[0])
        assert head == ["entry", "rid", "what", "positions", "size"]
        footer_top = app.screen.query_one("Footer").region.y
        assert app.screen.query_one("#listing-detail").region.bottom <= footer_top  # the detail line is on screen
        assert detail(app).startswith(f"{long_name}: a snapshot of request vector-hybrid at position 5")
