"""``hsnap info`` and ``hsnap verify`` of a directory of snapshots — what a drain, a checkpointer or a migration
writes — read it as the server's resume does (one listing, ``hsnap_format.stores.entries``): each snapshot and TP
set, each checkpoint chain's newest committed link (a damaged newer link passed over, saying why), the page store,
the leftovers; never "not a committed snapshot"."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chain_cases as cc  # noqa: E402

from hsnap_format import open_snapshot  # noqa: E402
from hsnap_format.stores.entries import list_directory, snapshot_entries  # noqa: E402
from hsnap_format.tools import cli  # noqa: E402

VEC = Path(__file__).resolve().parents[1] / "spec" / "vectors"
LINKS = ("c.ck000001.hsnap", "c.ck000002.hsnap", "c.ck000003.hsnap")


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A snapshot, a TP set, a checkpoint chain of three links, a page store and a writer's leftover."""
    d = tmp_path_factory.mktemp("built") / "drained"
    d.mkdir()
    shutil.copyfile(VEC / "hybrid.hsnap", d / "a.hsnap")
    shutil.copytree(VEC / "two-rank", d / "b")
    ps, req = cc.source("hybrid_linear")
    cc.export_chain(ps, req, "hybrid_linear", d, names=LINKS)
    shutil.copytree(VEC / "pages", d / "pages")
    (d / ".a.hsnap.tmp-1234").write_bytes(b"half written")
    return d


@pytest.fixture
def drained(built, tmp_path) -> Path:
    """A copy of ``built`` for one test to change."""
    return Path(shutil.copytree(built, tmp_path / "drained", symlinks=True))


def row(out: str, entry: str) -> list[str]:
    """The cells of the directory table's row of ``entry`` (split at runs of spaces: no cell here holds two)."""
    line = next(x for x in out.splitlines() if x.startswith(f"  {entry} "))
    return [c.strip() for c in line.strip().split("  ") if c.strip()]


def test_info_lists_each_request_the_chains_newest_link_the_pages_and_the_leftovers(drained):
    code, out, err = run("info", "--wide", drained)
    assert code == 0, err
    assert out.splitlines()[0] == f"directory {drained}: 2 snapshots, 1 checkpoint chain, page store pages/: 3 pages, " + out.splitlines()[0].rsplit(", ", 1)[1]
    assert row(out, str(drained / "a.hsnap"))[1:4] == ["vector-hybrid", "snapshot", "5"]
    code, out, err = run("info", drained)
    assert code == 0, err
    assert ["entry", "rid", "what", "positions", "size"] in [x.split() for x in out.splitlines()]
    assert row(out, "a.hsnap")[:4] == ["a.hsnap", "vector-hybrid", "snapshot", "5"]
    assert row(out, "b")[2] == "TP set of 2 ranks"
    assert row(out, "c.ck000003.hsnap")[:4] == ["c.ck000003.hsnap", "req-1", "chain of 3 links", str(cc.POSITIONS[-1])]
    assert ".a.hsnap.tmp-1234" in out and "`hsnap gc " in " ".join(out.split())
    code, out, _ = run("info", drained, "--json")
    report = json.loads(out)
    assert code == 0 and report["pages"]["count"] == 3 and report["leftovers"] == [str(drained / ".a.hsnap.tmp-1234")]
    by_name = {Path(e["path"]).name: e for e in report["entries"]}
    assert sorted(by_name) == ["a.hsnap", "b", "c.ck000003.hsnap"]
    assert by_name["c.ck000003.hsnap"]["checkpoints"]["links"] == 3 and by_name["c.ck000003.hsnap"]["delta"] is True


def test_verify_checks_every_entry_and_each_chain_below_its_newest_link(drained):
    code, out, err = run("verify", drained)
    assert code == 0, err
    assert "OK c.ck000003.hsnap: 33 sections verified (with 2 links of its chain)" in out
    code, out, err = run("verify", "--wide", drained)
    assert f"OK {drained / 'c.ck000003.hsnap'}" in out and "(with 2 links of its chain)" in out
    assert out.rstrip().endswith(f"OK {drained}: 3 entries verified")
    data = bytearray((drained / "a.hsnap").read_bytes())
    with open_snapshot(str(drained / "a.hsnap")) as snap:
        data[snap.sections[0].offset] ^= 1
    (drained / "a.hsnap").write_bytes(bytes(data))
    code, out, err = run("verify", drained, "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert [Path(e["path"]).name for e in report["entries"] if not e["ok"]] == ["a.hsnap"]


def test_a_damaged_newest_link_is_passed_over_as_the_servers_resume_does(drained):
    newest = drained / LINKS[-1]
    data = bytearray(newest.read_bytes())
    with open_snapshot(str(newest)) as snap:
        data[snap.sections[0].offset] ^= 1
    newest.write_bytes(bytes(data))
    assert str(drained / LINKS[1]) in snapshot_entries(str(drained))  # what a resume of the directory takes
    code, out, err = run("info", drained)
    assert code == 0 and row(out, "c.ck000002.hsnap")[:3] == ["c.ck000002.hsnap", "req-1", "chain of 3 links"], out
    assert "\n      1 passed over: c.ck000003.hsnap\n" in out, out
    code, out, err = run("verify", drained)
    assert code == 0 and f"passed over {newest}" in err, err
    assert list_directory(str(drained)).chains["c"].path == str(drained / LINKS[1])


def test_one_snapshot_and_a_set_are_still_read_as_one(drained):
    assert snapshot_entries(str(drained / "b")) == [str(drained / "b")]
    code, out, _ = run("info", drained / "b")
    assert code == 0 and out.startswith("snapshot directory ")


def test_export_refuses_a_delta_or_paged_files_partial_kv_unless_asked_for(built, tmp_path):
    head, plain = built / LINKS[-1], built / LINKS[0]
    code, _, err = run("export", head, "--all", "-o", tmp_path / "all/")
    assert code == 2 and "is a delta of c.ck000002.hsnap" in err and "hsnap compact" in err and not (tmp_path / "all").exists()
    code, _, err = run("export", VEC / "paged-a.hsnap", "--all", "-o", tmp_path / "paged/")
    assert code == 2 and "rows of its pages" in err
    with open_snapshot(str(head)) as snap:
        attn = next(s.name for s in snap.sections if s.kind == "attn_k")
        conv = next(s.name for s in snap.sections if s.kind == "conv")
    assert run("export", head, attn, "-o", tmp_path / "k.npy")[0] == 2
    assert run("export", head, conv, "-o", tmp_path / "conv.npy")[0] == 0  # recurrent state: whole in every link
    assert run("export", head, "--all", "--link-only", "-o", tmp_path / "link/")[0] == 0
    assert run("export", plain, "--all", "-o", tmp_path / "plain/")[0] == 0


def test_diff_compares_the_states_a_chain_stands_for_unless_asked_for_bytes(built, tmp_path):
    head = built / LINKS[-1]
    assert run("compact", head, "-o", tmp_path / "full.hsnap")[0] == 0
    code, out, err = run("diff", "--wide", tmp_path / "full.hsnap", head)
    assert code == 0 and "snapshots same" in out, out
    assert f"B ({head}): compared as the state its chain of 3 links stands for" in err
    code, out, _ = run("diff", built / LINKS[1], head)  # two positions of one request: the state moved on
    assert code == 1 and "attn.1.k" in out
    code, out, _ = run("diff", "--bytes", tmp_path / "full.hsnap", head)  # the files as they are: 45 rows against 12
    assert code == 1 and "shape-mismatch" in out


def test_a_live_migrations_container_is_one_entry_its_final_link_with_the_rounds_below(tmp_path):
    """A migration's container (link-0000, link-0001 deltas, final.hsnap): one request, not three snapshots — a resume
    of the directory resumes the hand-off alone (never an earlier round beside it: a second copy of the request);
    ``hsnap info`` says what it is and how it ended, ``hsnap verify`` proves the final link with its rounds."""
    d = tmp_path / "mig"
    d.mkdir()
    ps, req = cc.source("hybrid_linear")
    cc.export_chain(ps, req, "hybrid_linear", d, names=("link-0000.hsnap", "link-0001.hsnap", "final.hsnap"))
    (d / "link-0000.hsnap.applied").write_bytes(b"")
    (d / "link-0001.hsnap.applied").write_bytes(b"")
    assert snapshot_entries(str(d)) == [str(d / "final.hsnap")]
    (d / "final.hsnap.claimed").write_text(json.dumps({"claimed_by": {"server": "10.0.0.2:30000", "host": "node-b", "pid": 4242},
                                                       "claimed_at": "2026-12-04T20:00:00Z", "claimed_at_unix": 1.0}))
    code, out, err = run("info", "--wide", d)
    assert code == 0, err
    assert out.splitlines()[0] == f"directory {d}: 0 snapshots, 0 checkpoint chains, 1 live migration"
    assert row(out, str(d / "final.hsnap"))[1:3] == ["req-1", "migration, 2 rounds + final: handed off"]
    assert "resumed by 10.0.0.2:30000 (host node-b) at 2026-12-04T20:00:00Z" in out  # the target that admitted it
    code, out, _ = run("info", d, "--json")
    assert json.loads(out)["entries"][0]["claimed"] == {"server": "10.0.0.2:30000", "host": "node-b", "pid": 4242, "at": "2026-12-04T20:00:00Z"}
    (d / "final.hsnap.claimed").write_bytes(b"\x00secret bytes \xff" * 10)  # not a claim: said so, its bytes never shown
    code, out, _ = run("info", d)
    assert code == 0 and "claimed (its marker is not readable as a claim)" in out and "secret" not in out
    code, out, err = run("verify", d)
    assert code == 0 and "with 2 links of its chain" in out, out + err
    from hsnap_format.tools.viewmodel import directory_entries
    from hsnap_view.listing import listing_rows, listing_summary

    listing, entries = directory_entries(str(d))
    assert listing_summary(listing, entries)[-1] == "1 live migration"  # the viewer counts as hsnap info does
    assert "a live migration's final link (2 pre-copy rounds below it), handed off" in listing_rows(str(d), listing, entries)[0].detail
    # given up before its final link (the request decoded on at the source): the newest round is the entry
    (d / "final.hsnap").unlink()
    (d / "abandoned.json").write_text('{"reason": "the round applied within 60 s: not applied", "links": 2}')
    assert snapshot_entries(str(d)) == [str(d / "link-0001.hsnap")]
    code, out, _ = run("info", d, "--json")
    assert code == 0 and json.loads(out)["entries"][0]["migration"] == {"rounds": 2, "final": False, "outcome": "abandoned"}
    # a drain of requests named "final" and "link-0001" (no link-0000): snapshots, as they were
    (d / "link-0000.hsnap").unlink()
    assert sorted(Path(p).name for p in snapshot_entries(str(d))) == ["link-0001.hsnap"]
    assert list_directory(str(d)).migration is None
