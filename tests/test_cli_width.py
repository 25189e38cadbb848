"""What ``hsnap`` prints fits 80 columns by default — for every golden vector, a drain's and a checkpointer's
directory, a diff, gc's leftovers and page store — even below a long path; ``--wide`` prints every column, whole
paths and whole digests; and ``--json`` has the same keys for every kind of snapshot (a rank file, a delta, a paged
file, a TP set, a directory), the ones README.md documents."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chain_cases as cc  # noqa: E402

from hsnap_format import localfs, open_snapshot  # noqa: E402
from hsnap_format.manifest import SnapshotSet  # noqa: E402
from hsnap_format.tools import cli  # noqa: E402
from hsnap_format.tools.fit import Column, elide_middle, render_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VEC = ROOT / "spec" / "vectors"
VECTORS = sorted(p.name for p in VEC.iterdir() if p.suffix == ".hsnap" or (p / "manifest.json").exists())
LONG = "a-directory-with-the-long-name-a-deployment-gives-its-drains"  # what the paths printed lie below
LINKS = ("req-1.ck000001.hsnap", "req-1.ck000002.hsnap", "req-1.ck000003.hsnap")


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > 80]


@pytest.fixture(scope="module")
def vectors(tmp_path_factory) -> Path:
    """The golden vectors (chains, page store and all) below a long path."""
    d = tmp_path_factory.mktemp("width") / LONG / "vectors"
    shutil.copytree(VEC, d)
    return d


@pytest.fixture(scope="module")
def drained(tmp_path_factory) -> Path:
    """A drain's directory below a long path: a snapshot, a TP set, a request's checkpoint chain, a page store, a
    writer's leftover and an entry that does not open."""
    d = tmp_path_factory.mktemp("width") / LONG / "drained"
    d.mkdir(parents=True)
    shutil.copyfile(VEC / "hybrid.hsnap", d / "req-7.hsnap")
    shutil.copytree(VEC / "two-rank", d / "req-9")
    ps, req = cc.source("hybrid_linear")
    cc.export_chain(ps, req, "hybrid_linear", d, names=LINKS)
    shutil.copytree(VEC / "pages", d / "pages")
    (d / "broken.hsnap").write_bytes((VEC / "hybrid.hsnap").read_bytes()[:-1])
    (d / ".req-7.hsnap.hsnap-tmp-1234-0a1b2c3d").write_bytes(b"half written")
    return d


@pytest.fixture(scope="module")
def checkpoints(drained, tmp_path_factory) -> Path:
    """A checkpointer's directory: one request's links, the newest damaged (passed over)."""
    d = tmp_path_factory.mktemp("width") / LONG / "checkpoints"
    d.mkdir(parents=True)
    for name in LINKS:
        shutil.copyfile(drained / name, d / name)
    newest = d / LINKS[-1]
    data = bytearray(newest.read_bytes())
    with open_snapshot(str(newest)) as snap:
        data[snap.sections[0].offset] ^= 1
    newest.write_bytes(bytes(data))
    return d


def rank_files(path: Path) -> list:
    with open_snapshot(str(path)) as snap:
        ranks = list(snap.ranks.values()) if isinstance(snap, SnapshotSet) else [snap]
        return [(r.path, r.root_digest, [s.digest for s in r.sections]) for r in ranks]


# ---------------------------------------------------------------------------- 80 columns, and --wide in full


@pytest.mark.parametrize("name", VECTORS)
def test_info_and_verify_of_every_vector_fit_80_columns_and_wide_has_every_path_and_digest(vectors, name):
    path = vectors / name
    for command in ("info", "verify"):
        code, out, err = run(command, path)
        assert code == 0, err
        assert not too_wide(out), out
    code, out, _ = run("info", "--wide", path)
    assert code == 0
    for rank_path, root, digests in rank_files(path):
        assert rank_path in out and root in out and all(d in out for d in digests)
    code, short, _ = run("info", path)
    assert rank_files(path)[0][1][:12] + "…" in short and rank_files(path)[0][1] not in short


@pytest.mark.parametrize("name", ["chain-delta-2.hsnap", "chain-tp2-delta-2", "paged-b.hsnap"])
def test_a_chains_links_are_named_below_the_snapshots_directory_and_whole_with_wide(vectors, name):
    code, out, err = run("info", vectors / name)
    assert code == 0, err
    _, wide, _ = run("info", "--wide", vectors / name)
    with open_snapshot(str(vectors / name)) as snap:
        chains = cli._chains(snap, str(vectors / name))
        links = [(link.path, link.root_digest) for _, chain in chains for link in chain.links]
        for _, chain in chains:
            chain.close()
    assert len(links) >= len(chains) >= 1
    for path, root in links:
        below = os.path.relpath(path, vectors)
        assert re.search(rf"^ +\d+  {re.escape(below)} ", out, re.M), out  # short enough here: not elided
        assert path in wide and root in wide and root[:12] + "…" in out
    assert wide.rstrip().endswith("head") and not out.rstrip().endswith("head")


@pytest.mark.parametrize("which", ["drained", "checkpoints"])
def test_a_directory_of_snapshots_fits_80_columns_and_wide_names_every_entry_whole(request, which):
    d = request.getfixturevalue(which)
    for command in ("info", "verify"):
        code, out, err = run(command, d)
        assert not too_wide(out), out
    code, out, _ = run("info", "--wide", d)
    for entry in cli.list_directory(str(d)).entries():
        assert f"  {entry}  " in out
    assert str(d) in out.splitlines()[0]


def test_a_directory_row_says_what_each_entry_is(drained, checkpoints):
    code, out, _ = run("info", drained)
    assert code == 1  # broken.hsnap does not open
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert rows["req-1.ck000003.hsnap"].split()[1:6] == ["req-1", "chain", "of", "3", "links"]
    assert rows["req-9"].split()[1:7] == ["vector-two-rank", "TP", "set", "of", "2", "ranks"]
    assert rows["broken.hsnap"].split()[1:3] == ["-", "TruncatedError"]
    assert "\n      TruncatedError: " in out  # why, under its row
    code, out, _ = run("info", checkpoints)
    assert "req-1.ck000002.hsnap  req-1  chain of 3 links" in out and "\n      1 passed over: req-1.ck000003.hsnap\n" in out


@pytest.mark.parametrize("a, b, flags", [("chain-base.hsnap", "chain-delta-2.hsnap", ()), ("two-rank", "two-rank", ("-v",)),
                                         ("hybrid.hsnap", "parallel.hsnap", ())])
def test_diff_fits_80_columns_and_wide_puts_the_first_difference_in_its_row(vectors, a, b, flags):
    code, out, err = run("diff", *flags, vectors / a, vectors / b)
    assert code in (0, 1), err
    assert not too_wide(out) and not too_wide(err), out + err
    code, wide, werr = run("diff", "--wide", *flags, vectors / a, vectors / b)
    if "compared as the state" in werr:
        assert str(vectors / b) in werr
    header = next(x for x in wide.splitlines() if x.startswith("section "))
    assert header.split()[-2:] == ["first", "difference"] and "first difference" not in out


def test_gc_fits_80_columns_and_wide_names_every_file_whole(tmp_path):
    d = tmp_path / LONG / "run"
    d.mkdir(parents=True)
    shutil.copyfile(VEC / "hybrid.hsnap", d / f".req-{'7' * 40}.hsnap.hsnap-tmp-{os.getpid()}-0a1b2c3d")  # committed, never renamed
    staging = d / ".set.hsnap-staging-1-0a1b2c3d"
    localfs.make_staging_dir(str(staging))
    with open(staging / "rank-0.hsnap", "wb") as f:
        f.write(localfs.pending_preamble("test") + bytes(100))
    code, out, err = run("gc", d)
    assert code == 0, err
    assert not too_wide(out), out
    code, wide, _ = run("gc", "--wide", d)
    items = cli.store_for(str(d)).collect(str(d))
    paths = [i.path for i in items] + [f.path for i in items for f in i.files]
    assert len(paths) >= 3 and all(p in wide for p in paths) and not any(p in out for p in paths)
    assert all(i.reason in wide for i in items)


def test_gc_pages_fits_80_columns(vectors):
    code, out, err = run("gc", vectors, "--pages")
    assert code == 0, err
    assert not too_wide(out), out
    assert "… and " in out  # more files beside the store than are named by default
    code, verbose, _ = run("gc", vectors, "--pages", "--verbose")
    assert not too_wide(verbose) and verbose.count("skipped: ") > out.count("skipped: ")
    code, wide, _ = run("gc", vectors, "--pages", "--wide")
    assert all(str(p) in wide for p in (vectors / "pages").iterdir())


def test_the_table_gives_up_characters_from_the_columns_that_may_shorten():
    cols = (Column("path", elide="middle", min_width=10), Column("n", ">"), Column("note", wide_only=True))
    rows = [("/a/very/long/path/" + "x" * 60 + "/file.hsnap", 12345, "n")]
    narrow = render_table(cols[:2], [r[:2] for r in rows], 40)
    assert all(len(x) <= 40 for x in narrow) and narrow[1].endswith("file.hsnap  12345")
    assert render_table(cols[:2], [r[:2] for r in rows], None)[1].startswith(rows[0][0])
    assert elide_middle("abcdefghij", 5) == "a…hij" and elide_middle("abc", 5) == "abc"


# ---------------------------------------------------------------------------- --json: one set of keys


def json_of(*argv) -> dict:
    code, out, err = run(*argv, "--json")
    assert code in (0, 1), err
    return json.loads(out)


def kinds(vectors, drained, checkpoints) -> dict:
    """A rank file, a delta, a paged file, a TP set, a TP set's delta, a drain's and a checkpointer's directories."""
    return {"plain": vectors / "hybrid.hsnap", "delta": vectors / "chain-delta-2.hsnap", "paged": vectors / "paged-a.hsnap",
            "TP set": vectors / "two-rank", "TP delta": vectors / "chain-tp2-delta-2", "drain": drained, "checkpoints": checkpoints}


def key_sets(docs) -> set:
    return {tuple(sorted(d)) for d in docs}


def test_info_json_has_the_same_keys_for_every_kind(vectors, drained, checkpoints):
    docs = {kind: json_of("info", path) for kind, path in kinds(vectors, drained, checkpoints).items()}
    assert key_sets(docs.values()) == {tuple(sorted(cli.INFO_KEYS))}
    assert key_sets(r for d in docs.values() for r in d["ranks"]) == {tuple(sorted(docs["plain"]["ranks"][0]))}
    chains = [c for d in docs.values() for c in d["chains"]]
    assert len(chains) == 1 + 1 + 2 and key_sets(chains) == {("error", "links", "rank", "state_position")}
    entries = [e for d in docs.values() for e in d["entries"]]
    assert {e["error"] is None for e in entries} == {True, False} and {e["checkpoints"] is None for e in entries} == {True, False}
    assert key_sets(entries) == {tuple(sorted(cli.ENTRY_KEYS))}
    assert docs["plain"]["chains"] == [] and docs["plain"]["entries"] == [] and docs["plain"]["directory"] is None
    assert docs["drain"]["manifest"] is None and docs["drain"]["ranks"] == [] and docs["drain"]["pages"]["count"] == 3
    assert [d["kind"] for d in docs.values()] == ["snapshot"] * 3 + ["TP set"] * 2 + ["directory"] * 2


def test_verify_json_has_the_same_keys_for_every_kind_failing_or_not(vectors, drained, checkpoints, tmp_path):
    bad = tmp_path / "bad.hsnap"
    bad.write_bytes((VEC / "hybrid.hsnap").read_bytes()[:-1])
    docs = {kind: json_of("verify", path) for kind, path in {**kinds(vectors, drained, checkpoints), "bad": bad}.items()}
    assert key_sets(docs.values()) == {tuple(sorted(cli.VERIFY_KEYS))}
    assert docs["plain"]["ok"] and docs["plain"]["error"] is None and docs["plain"]["links"] == [] and docs["plain"]["entries"] == []
    assert docs["delta"]["links"] and not docs["drain"]["ok"] and docs["drain"]["error"] == "TruncatedError"
    assert docs["drain"]["errors"] == [e for entry in docs["drain"]["entries"] for e in entry["errors"]]
    assert docs["bad"]["error"] == "TruncatedError" and docs["bad"]["errors"][0]["error"] == "TruncatedError"


def test_diff_compact_and_gc_json_have_the_same_keys_for_every_kind(vectors, drained, tmp_path):
    pairs = [("hybrid.hsnap", "hybrid.hsnap"), ("chain-base.hsnap", "chain-delta-2.hsnap"), ("paged-a.hsnap", "paged-b.hsnap"),
             ("two-rank", "two-rank"), ("chain-tp2-base", "chain-tp2-delta-2")]
    assert len(key_sets(json_of("diff", vectors / a, vectors / b) for a, b in pairs)) == 1
    outs = [json_of("compact", vectors / name, "-o", tmp_path / name) for name in ("chain-delta-2.hsnap", "chain-tp2-delta-2", "paged-b.hsnap")]
    assert len(key_sets(outs)) == 1
    pages = json_of("gc", vectors, "--pages")
    assert set(pages["totals"]) == set(cli.PAGE_TOTALS) and pages["totals"]["kept"] == {"count": 3, "bytes": 3 * 8264}


def test_readme_documents_every_json_key():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("JSON keys"):]
    for key in {*cli.INFO_KEYS, *cli.ENTRY_KEYS, *cli.VERIFY_KEYS, "state_position", "links", "totals"}:
        assert f"`{key}`" in table, key
