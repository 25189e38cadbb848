"""hsnap-view on chains and paged files: a delta opens and shows its base; the title,
the tree and the Geometry tab say which link it is and which attention rows each link
holds; a paged file shows its pages; ``v`` makes the one proof ``hsnap verify`` makes
(hsnap_format's Chain.proof_failures) and reports it link by link, naming a damaged
link; the Request tab says how to get token text; prompts and the title fit 80x24
and 160x48."""

from __future__ import annotations

import glob
import os
import re
import shutil

import numpy as np
import pytest
from rich.console import Console
from textual.geometry import Region
from textual.widgets import DataTable, Label, Static

from view_fixtures import flip_byte
from hsnap_format import AttentionGeometry, Geometry, open_snapshot, write_snapshot
from hsnap_format import reference as ref
from hsnap_format.chain import Chain, open_chain
from hsnap_format.pages import open_page
from hsnap_format.tools.viewmodel import row_runs
from hsnap_view.app import make_app
from hsnap_view.screens.main import MainScreen, title_parts
from hsnap_view.screens.prompt import PathPrompt
from hsnap_view.widgets.digest_panel import DigestPanel
from hsnap_view.widgets.geometry_table import GeometryTable
from hsnap_view.widgets.identity_panel import identity_rows
from hsnap_view.widgets.request_panel import RequestPanel
from hsnap_view.widgets.section_tree import SectionTree

SIZE = (130, 40)
SMALL, LARGE = (80, 24), (160, 48)
VEC = os.path.join(os.path.dirname(__file__), "..", "..", "spec", "vectors")
CHAIN_FILES = ("chain-base.hsnap", "chain-delta-1.hsnap", "chain-delta-2.hsnap")
CHAIN_SETS = ("chain-tp2-base", "chain-tp2-delta-1", "chain-tp2-delta-2")


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


def visible(widget) -> str:
    """What a widget shows on screen now (cropped to its size), as text."""
    return "\n".join(s.text for s in widget.render_lines(Region(0, 0, *widget.outer_size)))


def plain(widget: Static) -> str:
    console = Console(width=400, record=True, file=open(os.devnull, "w"))
    console.print(widget.content)
    return console.export_text()


def summary(app) -> str:
    return plain(app.screen.query_one("#digest-summary", Static))


def copy_vectors(names, into) -> None:
    for name in names:
        src = os.path.join(VEC, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(into, name))


@pytest.mark.parametrize("name,base", [("chain-delta-2.hsnap", "chain-delta-1.hsnap"), ("chain-tp2-delta-1", "chain-tp2-base")])
async def test_viewer_opens_a_delta_and_shows_its_base(name, base):
    app = make_app(os.path.join(VEC, name))
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.error is None and not app.warnings
        assert set(app.screen.query_one(DigestPanel).status.values()) == {"ok"}
        await pilot.press("4")  # the Identity tab
        await pilot.pause()
        rows = dict((k, str(v)) for k, v in identity_rows(app.document))
        assert rows["delta of"].startswith(f"{base} at position") and "delta" in rows["features"]


# ---------------------------------------------------------------------------- what it shows


@pytest.mark.parametrize("name,chains,links", [
    ("chain-delta-2.hsnap", ["chain · 3 links to position 8"],
     ["link 1 · rows 0..2 · chain-base.hsnap", "link 2 · rows 3..4 · chain-delta-1.hsnap",
      "link 3 · rows 5..7 · chain-delta-2.hsnap"]),
    ("chain-tp2-delta-2", ["rank 0 chain · 3 links to position 5", "rank 1 chain · 3 links to position 5"],
     ["link 1 · rows 0..1 · chain-tp2-base/", "link 2 · rows 2..2 · chain-tp2-delta-1/",
      "link 3 · rows 3..4 · chain-tp2-delta-2/"]),
])
async def test_title_and_tree_show_the_chain_and_the_rows_each_link_holds(name, chains, links):
    app = make_app(os.path.join(VEC, name), verify_on_open=False)
    async with app.run_test(size=LARGE) as pilot:
        await pilot.pause()
        title = visible(app.screen.query_one("#title"))
        head_rows = links[-1].split(" · ")[1]
        assert "link 3 of 3" in title and f"{head_rows} of " in title
        tree = visible(app.screen.query_one(SectionTree))
        for line in chains + links:
            assert line in tree, line
        assert tree.count("link 1 ·") == len(chains)  # one chain node per rank


@pytest.mark.parametrize("name,pages,rows", [("paged-a.hsnap", "2 pages", "0..3"), ("paged-b.hsnap", "3 pages", "0..5")])
async def test_a_paged_file_shows_its_pages(name, pages, rows):
    app = make_app(os.path.join(VEC, name), verify_on_open=False)
    async with app.run_test(size=LARGE) as pilot:
        await pilot.pause()
        assert f"{pages} (rows {rows}) in pages/" in visible(app.screen.query_one("#title"))
        assert f"{pages} of 2 positions (rows {rows}) in pages/" in visible(app.screen.query_one(SectionTree))
        await pilot.press("4")
        await pilot.pause()
        assert dict(identity_rows(app.document))["pages"].startswith(f"{pages} of 2 positions in pages/")


@pytest.mark.parametrize("name,cells", [
    ("chain-delta-2.hsnap", {"attn.1.k": "rows 5..7 of 8", "swa.3.v": "rows 5..7 of 8", "mamba.0.conv.0": ""}),
    ("chain-tp2-delta-2", {"attn.1.v": "rows 3..4 of 5", "request.prompt_ids": ""}),
    ("paged-a.hsnap", {"attn.1.k": "rows 4..4 of 5", "swa.3.k": "rows 1..4 of 5"}),  # its pages hold 0..3
    ("paged-b.hsnap", {"attn.1.v": "rows 6..6 of 7"}),
    ("hybrid.hsnap", {"attn.1.k": "rows 0..4 of 5"}),  # a plain file: all of them
])
async def test_geometry_says_which_positions_an_attention_section_holds(name, cells):
    app = make_app(os.path.join(VEC, name), verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        table = app.screen.query_one(GeometryTable)
        for section, text in cells.items():
            key = next(k for k in table.keys if k.endswith(":" + section))
            assert table.get_cell(key, "rows").plain == text, section


@pytest.mark.parametrize("vector", sorted(glob.glob(os.path.join(VEC, "*.hsnap"))
                                          + [os.path.dirname(m) for m in glob.glob(os.path.join(VEC, "*", "manifest.json"))]))
def test_the_positions_named_are_the_rows_the_section_has(vector):
    """Whatever the file (plain, delta, paged, sliding window, TP), the positions the
    Geometry tab names for a section are as many as the rows it holds."""
    with open_snapshot(vector) as snap:
        for s in (snap.ranks.values() if hasattr(snap, "ranks") else [snap]):
            for info in s.sections:
                runs = row_runs(s, info)
                if info.kind in ("attn_k", "attn_v", "swa_k", "swa_v", "mla_kv"):
                    assert sum(b - a for a, b in runs) == info.shape[0], (vector, info.name, runs)
                    assert all(0 <= a < b <= s.state_position for a, b in runs)
                else:
                    assert runs == []


# ---------------------------------------------------------------------------- v: the proof of hsnap verify


@pytest.mark.parametrize("name,lines,proofs", [
    ("chain-delta-2.hsnap", ["chain: 3 links ok"], 1),
    ("chain-tp2-delta-2", ["rank 0 chain: 3 links ok", "rank 1 chain: 3 links ok"], 2),
    ("paged-a.hsnap", ["pages: 2 ok"], 1),
    ("paged-b.hsnap", ["pages: 3 ok"], 1),
])
async def test_v_proves_every_link_and_page_through_the_library_proof(name, lines, proofs, monkeypatch):
    """``v`` makes Chain.proof_failures (what hsnap verify, a restore and hsnap compact make),
    once per rank, and says so link by link; the tree marks every link."""
    made = []
    proof_failures = Chain.proof_failures

    def counted(self, **kw):
        made.append((len(self.links), kw))
        return proof_failures(self, **kw)

    monkeypatch.setattr(Chain, "proof_failures", counted)
    app = make_app(os.path.join(VEC, name), verify_on_open=False)
    async with app.run_test(size=LARGE) as pilot:
        await pilot.pause()
        assert "pending" in summary(app)
        await pilot.press("v")
        await settle(app, pilot)
        text = summary(app)
        for line in lines:
            assert line in text, text
        assert "FAILED" not in text and "pending" not in text.split("\n", 1)[1]
        assert len(made) == proofs and all(kw == {} for _, kw in made)  # the whole proof: every byte, every page
        tree = visible(app.screen.query_one(SectionTree))
        assert "✗" not in tree and tree.count("✓ link") == 3 * (len(lines) if "chain" in name else 0)
        assert not [n for n in app._notifications if n.title == "Chain FAILED"]


async def test_a_damaged_base_link_is_named_and_the_others_pass(tmp_path):
    copy_vectors(CHAIN_FILES, tmp_path)
    flip_byte(str(tmp_path / "chain-base.hsnap"), "attn.1.k", 1)
    app = make_app(str(tmp_path / "chain-delta-2.hsnap"))
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        text = summary(app)
        assert re.search(r"chain: link 1 of 3 \(chain-base\.hsnap\) FAILED: DigestMismatchError: chain-base\.hsnap: "
                         r"sections\['attn\.1\.k'\]\.digest", text), text
        assert "chain: links 2, 3 of 3 ok" in text and str(tmp_path) not in text
        assert set(app.document.status.values()) == {"ok"}  # the head itself is intact
        tree = visible(app.screen.query_one(SectionTree))
        assert "✗ link 1 · rows 0..2" in tree and "✓ link 2 · rows 3..4" in tree and "✓ link 3 · rows 5..7" in tree
        failed = [n for n in app._notifications if n.title == "Chain FAILED"]
        assert failed and "link 1 of 3 (chain-base.hsnap)" in failed[0].message


async def test_a_damaged_link_of_one_rank_names_that_rank(tmp_path):
    copy_vectors(CHAIN_SETS, tmp_path)
    flip_byte(str(tmp_path / "chain-tp2-delta-1" / "rank-1.hsnap"), "attn.1.k", 1)
    app = make_app(str(tmp_path / "chain-tp2-delta-2"))
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        text = summary(app)
        assert "rank 0 chain: 3 links ok" in text
        assert "rank 1 chain: link 2 of 3 (chain-tp2-delta-1/) FAILED: DigestMismatchError: rank-1.hsnap" in text, text
        assert "rank 1 chain: links 1, 3 of 3 ok" in text


async def test_a_damaged_page_is_reported_as_the_pages_failing(tmp_path):
    copy_vectors(("paged-a.hsnap", "pages"), tmp_path)
    with open_chain(str(tmp_path / "paged-a.hsnap")) as chain:
        page_path = chain.page_refs()[0].path
    page = open_page(page_path)
    at = page.sections[0].offset
    page.close()
    with open(page_path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    app = make_app(str(tmp_path / "paged-a.hsnap"))
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        assert "pages: FAILED: DigestMismatchError: " + os.path.basename(page_path) in summary(app)
        assert "✗ 2 pages" in visible(app.screen.query_one(SectionTree))


async def test_a_chain_that_does_not_open_is_said_not_a_traceback(tmp_path):
    """A delta copied without its base: the file opens, and the title, the tree and the
    Digests tab say its chain does not (the typed error, as hsnap verify reports it)."""
    copy_vectors(("chain-delta-2.hsnap",), tmp_path)
    app = make_app(str(tmp_path / "chain-delta-2.hsnap"))
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        assert app.error is None and isinstance(app.screen, MainScreen)
        assert "chain does not open" in visible(app.screen.query_one("#title"))
        assert "chain does not open: ChainError" in visible(app.screen.query_one(SectionTree))
        text = summary(app)
        assert "chain does not open: ChainError: chain-delta-2.hsnap: base.name" in text and "Traceback" not in text


# ---------------------------------------------------------------------------- token text


async def test_request_tab_says_how_to_get_token_text():
    app = make_app(os.path.join(VEC, "chain-delta-2.hsnap"), verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("5")
        await pilot.pause()
        panel = app.screen.query_one(RequestPanel)
        head = panel.query_one("#request-summary", Static)
        lines = visible(head).splitlines()
        row = next(i for i, line in enumerate(lines) if "token text" in line)
        hint = " ".join(" ".join(lines[row:row + 3]).split())
        assert "none: give --tokenizer" in hint and "tiny/hybrid-chain" in hint
        assert head.region.y + row < SMALL[1] - 1  # on screen at 80x24, above the footer
        assert [c.label.plain for c in panel.query_one("#tokens", DataTable).columns.values()][:4] == ["pos", "part", "token id", "logprob"]


def _write_with_model(path, model_id: str) -> np.ndarray:
    geom = Geometry(attention=AttentionGeometry(kind="mha", layers=(0,), heads=1, k_head_dim=4, v_head_dim=4,
                                                dtype="bfloat16", storage_dtype="bfloat16"), num_layers=1)
    rec = ref.record(state_position=12, outputs=4, seed=1)
    ident = ref.identity(snapshot_id="fixture")
    ident = type(ident)(**{**ident.__dict__, "tp_size": 1, "model_id": model_id})
    write_snapshot(path, identity=ident, geometry=geom, record=rec, state=dict(ref.state_arrays(geom, rec.state_position)))
    return np.concatenate([rec.prompt_ids, rec.output_ids])


async def test_request_tab_uses_the_tokenizer_of_the_recorded_model_path(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    model = tmp_path / "my-model"
    model.mkdir()
    ids = _write_with_model(str(tmp_path / "m.hsnap"), str(model))
    vocab = {f"tok{int(i)}": int(i) for i in ids} | {"[UNK]": int(ids.max()) + 1}
    tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]")).save(str(model / "tokenizer.json"))
    app = make_app(str(tmp_path / "m.hsnap"), verify_on_open=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await pilot.pause()
        panel = app.screen.query_one(RequestPanel)
        table = panel.query_one("#tokens", DataTable)
        assert table.get_row_at(0)[3].plain == repr(f"tok{int(ids[0])}")
        assert "from the model path this snapshot records" in plain(panel.query_one("#request-summary", Static))


# ---------------------------------------------------------------------------- fit at 80x24 and 160x48


@pytest.mark.parametrize("keys", ["g", "c", "d", "slash", "5 g", "e"])
async def test_prompts_are_whole_at_80x24(keys):
    """Every question of a prompt is shown in full inside its box (it ran past the border
    and was cut at 80 columns: ``... or name[``)."""
    app = make_app(os.path.join(VEC, "chain-delta-2.hsnap"), verify_on_open=False)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        if keys == "e":
            app.screen.select_section("0:attn.1.k")
            await settle(app, pilot)
        for key in keys.split():
            await pilot.press(key)
            await pilot.pause()
        prompt = app.screen
        assert isinstance(prompt, PathPrompt)
        label = prompt.query_one(Label)
        box = prompt.query_one("#prompt")
        assert box.region.right <= SMALL[0] and box.content_region.contains_region(label.region)
        shown = " ".join(visible(label).split())
        assert shown == " ".join(prompt.question.split()), (shown, prompt.question)
        await pilot.press("escape")


def _title_lines(app) -> list[str]:
    return [line.strip() for line in visible(app.screen.query_one("#title")).splitlines() if line.strip()]


LONG_MODEL = "an-org/a-model-whose-name-alone-is-longer-than-the-terminal-is-wide-" + "x" * 100


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x48"])
@pytest.mark.parametrize("name", ["chain-delta-2.hsnap", "chain-tp2-delta-2", "paged-b.hsnap", "long-model.hsnap"])
async def test_the_title_breaks_between_its_parts_only(name, size, tmp_path):
    """Each line of the title is whole parts (``11 sections``, ``link 3 of 3``...), every part
    is shown, and one wider than the screen is cut with an ellipsis; a chain's title is one
    line at 160 columns."""
    path = os.path.join(VEC, name)
    if name == "long-model.hsnap":
        path = str(tmp_path / name)
        _write_with_model(path, LONG_MODEL)
    app = make_app(path, verify_on_open=False)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        parts = [p.plain for p in title_parts(app.document)]
        lines = _title_lines(app)
        shown = [piece for line in lines for piece in line.split(" · ")]
        assert len(shown) == len(parts)
        for piece, part in zip(shown, parts):
            assert piece == part or (piece.endswith("…") and part.startswith(piece[:-1]) and len(part) > size[0] - 2), (piece, part)
        if name == "chain-delta-2.hsnap" and size == LARGE:
            assert len(lines) == 1
