"""``hsnap export`` as an attacker or a careless user would drive it:
``--all`` is all or nothing, never follows a symlink inside the output directory,
never replaces or writes into the input snapshot (``--force`` or not), refuses an
output name of another kind, and public parameters that take record classes refuse a
dict typed instead of failing with ``AttributeError``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import hsnap_format as hf
from hsnap_format import open_snapshot
from hsnap_format import reference as ref
from hsnap_format.tools.cli import main as hsnap
from hsnap_format.tools.export_npy import load_npy_as

ROOT = Path(__file__).resolve().parents[1]
VEC = ROOT / "spec" / "vectors"


def _flip(path, section: str) -> None:
    with open_snapshot(path) as snap:
        offset = snap.section(section).offset + 3
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _tree(root) -> dict[str, object]:
    """Every entry under ``root`` (symlinks not followed): its kind and bytes or target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", Path(p).read_bytes())
    return out


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


def test_export_all_failure_leaves_nothing(tmp_path, capsys):
    """A section failing its digest after four good ones: no .npy, no directory, no
    staging directory is left; an existing output directory is exactly as it was."""
    bad = tmp_path / "src" / "bad.hsnap"
    bad.parent.mkdir()
    shutil.copy(VEC / "hybrid.hsnap", bad)
    _flip(bad, "mamba.2.temporal")  # the fifth section: four were exported before it
    work = tmp_path / "work"
    work.mkdir()
    assert hsnap(["export", str(bad), "--all", "-o", str(work / "out")]) == 1
    assert "DigestMismatchError" in _err(capsys)
    assert _tree(work) == {}
    # into an existing directory, with --force: nothing of the export, nothing replaced
    (work / "out").mkdir()
    (work / "out" / "attn.1.k.npy").write_bytes(b"mine")
    (work / "out" / "notes.txt").write_bytes(b"keep")
    before = _tree(work)
    assert hsnap(["export", str(bad), "--all", "--force", "-o", str(work / "out")]) == 1
    assert "DigestMismatchError" in _err(capsys)
    assert _tree(work) == before
    # the same into a .safetensors file
    assert hsnap(["export", str(bad), "--all", "-o", str(work / "all.safetensors")]) == 1
    assert "DigestMismatchError" in _err(capsys)
    assert _tree(work) == before


def test_export_all_into_an_existing_directory(tmp_path, capsys):
    """An existing directory takes the export beside what it holds; a name it would
    replace is refused before anything is written, unless --force."""
    src = str(VEC / "two-rank")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_bytes(b"keep")
    assert hsnap(["export", src, "--all", "-o", str(out)]) == 0
    index = json.loads((out / "index.json").read_text())
    assert (out / "notes.txt").read_bytes() == b"keep"
    assert sorted(os.listdir(out)) == ["index.json", "notes.txt", "rank-0", "rank-1"]  # no staging left
    with open_snapshot(src) as snap:
        for e in index["sections"]:
            want = snap.ranks[e["rank"]].read(e["name"])
            assert load_npy_as(str(out / e["file"]), e["dtype"]).tobytes() == np.ascontiguousarray(want).tobytes()
    capsys.readouterr()
    before = _tree(tmp_path)
    assert hsnap(["export", src, "--all", "-o", str(out)]) == 1  # every name taken
    assert "SnapshotExistsError" in _err(capsys)
    assert _tree(tmp_path) == before
    (out / "rank-1" / "attn.1.k.npy").write_bytes(b"stale")
    assert hsnap(["export", src, "--all", "--force", "-o", str(out)]) == 0
    assert _tree(tmp_path) == before  # replaced with the same bytes again


def test_export_all_never_follows_a_symlink_in_the_output(tmp_path, capsys):
    """A ``rank-N`` symlink planted in the output directory is refused (--force too) and
    nothing is written where it points; with --force a file symlink is replaced as a
    name, never written through."""
    src = str(VEC / "two-rank")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "rank-1")
    before = _tree(tmp_path)
    for force in ([], ["--force"]):
        assert hsnap(["export", src, "--all", "-o", str(out), *force]) == 1
        err = _err(capsys)
        assert "ExportTargetError" in err and "rank-1" in err and "symlink" in err
        assert _tree(tmp_path) == before
    # one rank: the files go straight into the directory; a planted file symlink
    victim = elsewhere / "victim"
    victim.write_bytes(b"precious")
    single = tmp_path / "single"
    single.mkdir()
    os.symlink(victim, single / "attn.1.k.npy")
    hybrid = str(VEC / "hybrid.hsnap")
    assert hsnap(["export", hybrid, "--all", "-o", str(single)]) == 1
    assert "SnapshotExistsError" in _err(capsys)
    assert hsnap(["export", hybrid, "--all", "--force", "-o", str(single)]) == 0
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(single / "attn.1.k.npy")
    with open_snapshot(hybrid) as snap:
        assert load_npy_as(str(single / "attn.1.k.npy"), "bfloat16").tobytes() == snap.read("attn.1.k").tobytes()


def test_force_never_replaces_or_writes_into_the_input(tmp_path, capsys):
    """The input snapshot (a file or a directory, named directly or through a symlink) and
    anything inside it are never an output, with --force or without."""
    one = tmp_path / "snap.npy"  # a snapshot file whose name an export could take
    shutil.copy(VEC / "hybrid.hsnap", one)
    os.symlink(one, tmp_path / "link.npy")
    rank_set = tmp_path / "set"
    shutil.copytree(VEC / "two-rank", rank_set)
    os.symlink(rank_set, tmp_path / "setlink")
    before = _tree(tmp_path)
    cases = [
        [str(one), "attn.1.k", "-o", str(one)],
        [str(one), "attn.1.k", "-o", str(tmp_path / "link.npy")],
        [str(rank_set), "--all", "-o", str(rank_set)],
        [str(rank_set), "--all", "-o", str(rank_set / "sub")],
        [str(rank_set), "--all", "-o", str(tmp_path / "setlink" / "sub")],
        [str(rank_set), "--all", "-o", str(rank_set / "all.safetensors")],
        [str(rank_set), "rank1/attn.1.k", "-o", str(rank_set / "k.npy")],
    ]
    for args in cases:
        for force in ([], ["--force"]):
            assert hsnap(["export", *args, *force]) == 1, args
            err = _err(capsys)
            assert "ExportTargetError" in err and "input" in err, (args, err)
            assert _tree(tmp_path) == before, args
    # a snapshot file named like what the export writes, in the output directory
    named = tmp_path / "n"
    named.mkdir()
    shutil.copy(VEC / "hybrid.hsnap", named / "index.json")
    assert hsnap(["export", str(named / "index.json"), "--all", "--force", "-o", str(named)]) == 1
    assert "ExportTargetError" in _err(capsys)
    assert os.listdir(named) == ["index.json"] and (named / "index.json").read_bytes() == (VEC / "hybrid.hsnap").read_bytes()
    # a snapshot directory named rank-1: a two-rank export into its parent would write into it
    parent = tmp_path / "p"
    shutil.copytree(VEC / "two-rank", parent / "rank-1")  # a snapshot directory named rank-1
    assert hsnap(["export", str(parent / "rank-1"), "--all", "--force", "-o", str(parent)]) == 1
    assert "ExportTargetError" in _err(capsys)  # its rank-1/ would be the input itself
    assert sorted(os.listdir(parent)) == ["rank-1"]


def test_output_name_of_another_kind_is_refused_typed(tmp_path, capsys, monkeypatch):
    """``-o out.pt`` makes no directory: one section goes to .npy; --all to a directory
    (no extension, or a trailing /) or a .safetensors file."""
    monkeypatch.chdir(tmp_path)
    hybrid = str(VEC / "hybrid.hsnap")
    for args, expected in [
        (["--all", "-o", "out.pt"], "a directory"),
        (["--all", "-o", "out.npy"], "a directory"),
        (["attn.1.k", "-o", "out.pt"], ".npy"),
        (["attn.1.k", "-o", "out.safetensors"], ".npy"),
    ]:
        assert hsnap(["export", hybrid, *args]) == 1, args
        err = _err(capsys)
        assert "ExportTargetError" in err and expected in err and "'out." in err, err
    assert os.listdir(tmp_path) == []
    assert hsnap(["export", hybrid, "--all", "-o", "out.v2/"]) == 0  # a trailing / says directory
    assert (tmp_path / "out.v2" / "index.json").is_file()
    dotted = tmp_path / "a.b.hsnap"
    shutil.copy(VEC / "hybrid.hsnap", dotted)
    assert hsnap(["export", str(dotted), "--all"]) == 0  # the default name is always a directory
    assert (tmp_path / "a.b-npy" / "index.json").is_file()


# ------------------------------------------------------------- record classes as dicts


def _small_geometry() -> hf.Geometry:
    return hf.Geometry(
        attention=hf.AttentionGeometry(kind="mha", layers=(0,), heads=1, k_head_dim=4, v_head_dim=4, dtype="bfloat16",
                                       storage_dtype="bfloat16"),
        num_layers=1,
    )


def test_writer_refuses_record_classes_given_as_dicts(tmp_path):
    geom = _small_geometry()
    ident = ref.identity(snapshot_id="dict")
    rec = ref.record(state_position=4, outputs=1, seed=1)
    state = dict(ref.state_arrays(geom, rec.state_position))
    sharding_dict = {"attention": {"axis": 1, "global": 2, "parts": [[0, 1, 1]]}, "conv": None, "temporal": None}
    for field, kw in [
        ("identity", dict(identity=ident.__dict__)),
        ("geometry", dict(geometry={"attention": None})),
        ("record", dict(record={"state_position": 4})),
        ("geometry.sharding", dict(geometry=hf.Geometry(attention=geom.attention, num_layers=1, sharding=sharding_dict))),
    ]:
        args = dict(identity=ident, geometry=geom, record=rec, state=state)
        args.update(kw)
        with pytest.raises(hf.WrongTypeError, match=rf"{field}: expected hsnap_format\.records\.\w+.*found dict"):
            hf.write_snapshot(tmp_path / "x.hsnap", **args)
    assert os.listdir(tmp_path) == []


def test_sharding_given_as_a_dict_is_refused_typed(tmp_path):
    """``export_request``/``restore_request(sharding=dict)`` (the header form): a typed
    refusal naming the parameter and hsnap_format.records.Sharding; pools untouched."""
    pytest.importorskip("sglang")
    from hsnap_testing import tp_pools as rp
    from hsnap_io import export_request, reshard, restore_request

    m = rp.MODELS[sorted(rp.MODELS)[0]]
    state = rp.global_state(m)
    ps = rp.build(m, 1, 0, seed=20)
    row, _, _ = rp.place(ps, state)
    header = reshard.describe(m.tp, 1, 0).to_header()
    common = dict(req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, req_pool_idx=row, fsync=False)
    for field, kw in [
        ("sharding", dict(sharding=header, record=rp.record(), identity=rp.identity(1, 0))),
        ("identity", dict(identity=rp.identity(1, 0).__dict__, record=rp.record())),
        ("record", dict(record=rp.record().__dict__, identity=rp.identity(1, 0))),
    ]:
        with pytest.raises(hf.WrongTypeError, match=rf"{field}: expected hsnap_format\.records\.\w+.*found dict"):
            export_request(tmp_path / f"{field}.hsnap", **common, **kw)
    assert os.listdir(tmp_path) == []
    good = rp.export_set(m, 2, state, tmp_path / "set")
    target = rp.build(m, 1, 0, seed=5)
    free_before = target.alloc.free_pages.clone(), list(target.rtp.free_slots)
    for field, kw in [("sharding", dict(sharding=header, identity=rp.identity(1, 0))),
                      ("identity", dict(identity=rp.identity(1, 0).__dict__))]:
        with pytest.raises(hf.WrongTypeError, match=rf"{field}: expected hsnap_format\.records\.\w+ or None, found dict"):
            restore_request(good, req_to_token_pool=target.rtp, token_to_kv_pool_allocator=target.alloc, **kw)
    assert target.alloc.free_pages.equal(free_before[0]) and list(target.rtp.free_slots) == free_before[1]
