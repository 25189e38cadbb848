"""Snapshot chains at the format level (spec 5.9, 7.5, format 1.2): the
chain vectors, the compatibility policy (an older reader refuses a delta by name), the
header rules of ``base``, hostile chains — each refused with the same class and field by
``hsnap_format`` and by the independent reader written from the spec alone — the CLI,
and compaction."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import craft  # noqa: E402
import independent_reader as ir  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format.tools import cli  # noqa: E402
from hsnap_format.chain import compact, compact_path, open_chain  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VEC = ROOT / "spec" / "vectors"
SINGLE = ("chain-base.hsnap", "chain-delta-1.hsnap", "chain-delta-2.hsnap")
SETS = ("chain-tp2-base", "chain-tp2-delta-1", "chain-tp2-delta-2")
ONE_ONE_FEATURES = frozenset({"sampler-rng-state", "top-logprobs", "tp-sharding"})  # what a 1.1 reader knows (spec 9)


@pytest.fixture
def chain(tmp_path):
    """A copy of the single chain vectors (links side by side)."""
    for name in SINGLE:
        shutil.copy(VEC / name, tmp_path / name)
    return tmp_path


@pytest.fixture
def tp_chain(tmp_path):
    for name in SETS:
        shutil.copytree(VEC / name, tmp_path / name)
    return tmp_path


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- the vectors


def test_chain_vectors_read_as_one_snapshot_by_both_readers(tmp_path):
    """Both readers follow the links; the head's sections the independent reader assembles
    from the spec (7.5) are the sections of the reference's compaction."""
    cases = [(VEC / "chain-delta-2.hsnap", None)] + [(VEC / "chain-tp2-delta-2", r) for r in range(2)]
    for head, rank in cases:
        ind = ir.read_chain(head, rank=rank)
        assert len(ind.links) == 3
        with open_chain(head, rank=rank) as c:
            assert [s.root_digest for s in c.links] == [s.root_digest.hex() for s in ind.links]
            c.verify()
            out = tmp_path / f"compact-{rank}.hsnap"
            compact(c, out)
        plain = ir.read_snapshot(out)
        assert plain.header.get("base") is None and plain.minor == (1 if rank is not None else 0)
        assert [s["name"] for s in plain.sections] == list(ind.sections)
        for s in plain.sections:
            assert np.array_equal(s["values"], ind.sections[s["name"]]), s["name"]


def test_chain_vector_links_decode_to_their_descriptions_by_the_spec_alone():
    """Each link of chain.json / chain-tp2.json, read by the independent reader: header
    (``base`` included) and every section's values as described (spec 12)."""
    for name in ("chain", "chain-tp2"):
        for link in json.loads((VEC / f"{name}.json").read_text(encoding="utf-8"))["links"]:
            ranks = [(VEC / link["file"], link)] if "file" in link else [(VEC / link["directory"] / r["file"], r) for r in link["ranks"]]
            for path, desc in ranks:
                snap = ir.read_snapshot(path)
                keys = ("format", "features", "digest", "identity", "geometry", "request", "base")
                assert {k: snap.header[k] for k in keys if k in snap.header} == {k: desc[k] for k in keys if k in desc}, path
                assert ("base" in desc) == (snap.minor == 2)
                for s, d in zip(snap.sections, desc["sections"]):
                    assert s["name"] == d["name"] and s["values"].reshape(-1).astype(float).tolist() == d["values"], (path, d["name"])


def test_chain_vector_values_follow_the_described_timeline():
    """Global K of layer L at position t, dim d is L + t/2 + d/4: the chain's head holds
    positions 0..7 of layer 1 and, from swa_start 2 on, of window layer 3 (a base row skipped)."""
    ind = ir.read_chain(VEC / "chain-delta-2.hsnap")
    k1 = ind.sections["attn.1.k"].astype(np.float64).reshape(8, 2)
    assert k1.tolist() == [[1 + t / 2 + d / 4 for d in range(2)] for t in range(8)]
    k3 = ind.sections["swa.3.k"].astype(np.float64).reshape(6, 2)
    assert k3.tolist() == [[3 + t / 2 + d / 4 for d in range(2)] for t in range(2, 8)]
    assert ind.sections["mamba.2.temporal"].tolist() == [[[4.5]]]  # the head's (link 2): 0.5 + 2 + 2


def test_compaction_is_the_plain_write_at_the_head(tmp_path):
    """R-7.5-3: the compacted file is what the writer writes for the head's identity,
    geometry, record, swa_start and optional features with the assembled sections."""
    ind = ir.read_chain(VEC / "chain-delta-2.hsnap")
    with hf.open(VEC / "chain-delta-2.hsnap") as head:
        state = {s.name: ind.sections[s.name].astype(hf.spec.DTYPES[s.dtype]) for s in head.sections if s.is_state}
        hf.write_snapshot(tmp_path / "plain.hsnap", identity=head.identity, geometry=head.geometry, record=head.record(),
                          swa_start=head.swa_start, state=state)
    rc, out, err = _cli("compact", VEC / "chain-delta-2.hsnap", "-o", tmp_path / "c.hsnap")
    assert rc == 0 and "compacted 3 links" in out, err
    assert (tmp_path / "c.hsnap").read_bytes() == (tmp_path / "plain.hsnap").read_bytes()


def test_compaction_of_a_tp2_chain_is_a_plain_set(tmp_path):
    links, nbytes = compact_path(VEC / "chain-tp2-delta-2", tmp_path / "set")
    assert links == 3
    with hf.open(tmp_path / "set") as s:
        assert s.manifest.snapshot_id == "vector-chain-tp2-delta-2" and s.manifest.state_position == 5
        assert all(r.base is None and r.version == (1, 1) for r in s.ranks.values())
        s.verify()
        assert sum(r.file_length for r in s.ranks.values()) == nbytes
    for r in range(2):
        ind = ir.read_chain(VEC / "chain-tp2-delta-2", rank=r)
        got = ir.read_snapshot(tmp_path / "set" / f"rank-{r}.hsnap")
        assert all(np.array_equal(s["values"], ind.sections[s["name"]]) for s in got.sections)


def test_compaction_never_overwrites_and_leaves_nothing_on_a_bad_byte(chain, tmp_path):
    (chain / "taken.hsnap").write_bytes(b"mine")
    rc, _, err = _cli("compact", chain / "chain-delta-2.hsnap", "-o", chain / "taken.hsnap")
    assert rc == 1 and "SnapshotExistsError" in err and (chain / "taken.hsnap").read_bytes() == b"mine"
    with hf.open(chain / "chain-base.hsnap") as b:
        at = b.section("attn.1.k").offset
    data = bytearray((chain / "chain-base.hsnap").read_bytes())
    data[at] ^= 0x40
    (chain / "chain-base.hsnap").write_bytes(bytes(data))
    before = sorted(os.listdir(chain))
    rc, _, err = _cli("compact", chain / "chain-delta-2.hsnap", "-o", chain / "out.hsnap")
    assert rc == 1 and "DigestMismatchError" in err and "chain-base.hsnap" in err
    assert sorted(os.listdir(chain)) == before  # no output, no temporary


# ----------------------------------------------------------------------------- compatibility (spec 9)


@pytest.mark.parametrize("name", ["chain-delta-1.hsnap", "chain-delta-2.hsnap", "chain-tp2-delta-1/rank-0.hsnap", "chain-tp2-delta-2/rank-1.hsnap"])
def test_a_one_one_reader_refuses_a_delta_by_name(name, monkeypatch):
    """Spec 9: ``delta`` is a required feature of minor 2; a reader that knows only the 1.1
    features refuses a delta at open step 14 (UnsupportedFeatureError naming the field) —
    the reference with its feature table cut to 1.1's, and the spec-only reader likewise —
    and reads every plain link of the same chains."""
    from hsnap_format import reader

    monkeypatch.setattr(reader, "KNOWN_FEATURES", ONE_ONE_FEATURES)
    monkeypatch.setattr(ir, "KNOWN_FEATURES", set(ONE_ONE_FEATURES))
    with pytest.raises(hf.UnsupportedFeatureError) as e:
        hf.Snapshot(VEC / name)
    assert e.value.field == "header.features.required" and "delta" in str(e.value)
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_snapshot(VEC / name)
    assert e2.value.kind == "UnsupportedFeatureError"
    for plain in ("chain-base.hsnap", "chain-tp2-base/rank-0.hsnap", "chain-tp2-base/rank-1.hsnap"):
        with hf.Snapshot(VEC / plain) as s:
            s.verify()
        ir.read_snapshot(VEC / plain)


def test_chain_vectors_preamble_minor_and_features():
    for name in SINGLE:
        with hf.open(VEC / name) as s:
            assert s.version == ((1, 0) if name == "chain-base.hsnap" else (1, 2))
            assert s.header["features"]["required"] == ([] if s.base is None else ["delta"])
            assert ("base" in s.header) == (s.base is not None)
    with hf.open(VEC / "chain-tp2-delta-2") as s:
        assert {r.version for r in s.ranks.values()} == {(1, 2)}
        assert {r.base.name for r in s.ranks.values()} == {"chain-tp2-delta-1"}
        assert all(r.header["features"] == {"optional": ["tp-sharding"], "required": ["delta"]} for r in s.ranks.values())


# ----------------------------------------------------------------------------- header rules of base (R-5.9-1, R-5.9-2)


def _both_open(data: bytes, tmp_path) -> tuple[tuple, tuple]:
    p = tmp_path / "x.hsnap"
    p.write_bytes(data)
    ref = ind = (None, None)
    try:
        hf.Snapshot(p).close()
    except hf.HsnapError as e:
        ref = (type(e).__name__, e.field)
    try:
        ir.read_snapshot(p)
    except ir.HsnapSpecError as e:
        ind = (e.kind, e.field)
    return ref, ind


def _set(path, value):
    def fn(h):
        obj = h
        for k in path[:-1]:
            obj = obj[k]
        if value is KeyError:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return fn


BASE_RULES = [
    ("delta required without base", _set(("base",), KeyError), "base"),
    ("base null with delta required", _set(("base",), None), "base"),
    ("base without delta required", _set(("features", "required"), []), "base"),
    ("base not an object", _set(("base",), [1]), "base"),
    ("name missing", _set(("base", "name"), KeyError), "base.name"),
    ("name with a slash", _set(("base", "name"), "../chain-delta-1.hsnap"), "base.name"),
    ("name '..'", _set(("base", "name"), ".."), "base.name"),
    ("name empty", _set(("base", "name"), ""), "base.name"),
    ("name of 256 bytes", _set(("base", "name"), "\u00e9" * 128), "base.name"),
    ("root digest uppercase", _set(("base", "root_digest"), "A" * 32), "base.root_digest"),
    ("root digest a number", _set(("base", "root_digest"), 7), "base.root_digest"),
    ("snapshot id not a string", _set(("base", "snapshot_id"), 5), "base.snapshot_id"),
    ("state position beyond the file's", _set(("base", "state_position"), 9), "base.state_position"),
    ("state position negative", _set(("base", "state_position"), -1), "base.state_position"),
    ("depth 0", _set(("base", "depth"), 0), "base.depth"),
    ("depth 1025", _set(("base", "depth"), 1025), "base.depth"),
    ("depth a bool", _set(("base", "depth"), True), "base.depth"),
]


@pytest.mark.parametrize("label,edit,field", BASE_RULES, ids=[r[0] for r in BASE_RULES])
def test_both_readers_refuse_a_malformed_base(label, edit, field, tmp_path):
    data = craft.mutate_header((VEC / "chain-delta-2.hsnap").read_bytes(), edit)
    ref, ind = _both_open(data, tmp_path)
    assert ref == ("MalformedHeaderError", field), (label, ref)
    assert ind[0] == "MalformedHeaderError" and ind[1] == field, (label, ind)


def test_both_readers_accept_unknown_keys_inside_base_and_a_depth_at_the_limit(tmp_path):
    data = craft.mutate_header((VEC / "chain-delta-2.hsnap").read_bytes(), lambda h: h["base"].update(zz=1, depth=1024))
    assert _both_open(data, tmp_path) == ((None, None), (None, None))


def test_a_delta_whose_rows_do_not_follow_its_base_position_is_refused_at_open(tmp_path):
    """Spec 5.4 with B: the table must hold the rows after base.state_position (step 20)."""
    data = craft.mutate_header((VEC / "chain-delta-2.hsnap").read_bytes(), _set(("base", "state_position"), 4))
    ref, ind = _both_open(data, tmp_path)
    assert ref[0] == ind[0] == "MalformedHeaderError" and ref[1].startswith("sections")


# ----------------------------------------------------------------------------- hostile chains (spec 7.5)


def _both_chain(head, rank=None) -> tuple[tuple, tuple]:
    ref = ind = (None, None)
    try:
        with open_chain(head, rank=rank) as c:
            c.verify()
    except hf.HsnapError as e:
        ref = (type(e).__name__, e.field)
    try:
        ir.read_chain(head, rank=rank)
    except ir.HsnapSpecError as e:
        ind = (e.kind, e.field)
    return ref, ind


def _edit(path: Path, fn) -> None:
    path.write_bytes(craft.mutate_header(path.read_bytes(), fn))


HOSTILE = [
    # (label, what to do to a copy of the chain, error class, field)
    ("missing link", lambda d: os.unlink(d / "chain-base.hsnap"), "ChainError", "base.name"),
    ("a cycle: a link naming itself", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("base", "name"), "chain-delta-2.hsnap")),
     "ChainError", "base.name"),
    ("a base that is not the one named", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("base", "root_digest"), "0" * 32)),
     "DigestMismatchError", "base.root_digest"),
    ("the base's snapshot id", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("base", "snapshot_id"), "another")),
     "ChainError", "base.snapshot_id"),
    ("the base's depth", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("base", "depth"), 3)), "ChainError", "base.depth"),
    ("a directory where a rank file is named", lambda d: (shutil.copytree(VEC / "chain-tp2-base", d / "setdir"),
                                                          _edit(d / "chain-delta-2.hsnap", _set(("base", "name"), "setdir"))),
     "ChainError", "base.name"),
    ("another model", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("identity", "model_id"), "other/model")),
     "ChainError", "identity.model_id"),
    ("another rank", lambda d: _edit(d / "chain-delta-2.hsnap", lambda h: h["identity"].update(tp_size=2, tp_rank=1)),
     "ChainError", "identity.tp_size"),
    ("another geometry", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("geometry", "attention", "swa_window"), 8)),
     "ChainError", "geometry"),
    ("another request", lambda d: _edit(d / "chain-delta-2.hsnap", _set(("request", "rid"), "someone-else")),
     "ChainError", "request.rid"),
    ("a window that slid back", lambda d: _edit(d / "chain-delta-2.hsnap", lambda h: h["request"].update(swa_start=1)),
     "ChainError", "request.swa_start"),  # a valid file alone (its rows start at B = 5 either way)
]


@pytest.mark.parametrize("label,damage,kind,field", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_chains_are_refused_alike_by_both_readers(label, damage, kind, field, chain):
    damage(chain)
    ref, ind = _both_chain(chain / "chain-delta-2.hsnap")
    assert ref[0] == ind[0] == kind, (label, ref, ind)
    assert ref[1].startswith(field) and ind[1].startswith(field.split(" ")[0]), (label, ref, ind)


def test_a_two_link_cycle_is_refused_before_it_loops(chain):
    """delta-1 names delta-2 (made up digest), delta-2 binds that delta-1: from delta-2 the
    walk comes back to delta-2's own name (step 2), not round and round."""
    _edit(chain / "chain-delta-1.hsnap", _set(("base", "name"), "chain-delta-2.hsnap"))
    from hsnap_format.chain import base_ref

    with hf.open(chain / "chain-delta-1.hsnap") as d1:
        ref = base_ref(d1, "chain-delta-1.hsnap").to_header()
    _edit(chain / "chain-delta-2.hsnap", _set(("base",), ref))
    ref_err, ind_err = _both_chain(chain / "chain-delta-2.hsnap")
    assert ref_err == ("ChainError", "base.name") and ind_err == ("ChainError", "base.name")


def test_a_chain_deeper_than_the_readers_limit(chain):
    from hsnap_format.chain import chain_below

    with hf.open(chain / "chain-delta-2.hsnap") as head, pytest.raises(hf.ChainError) as e:
        chain_below(head, location=str(chain / "chain-delta-2.hsnap"), max_depth=1)
    assert e.value.field == "base.depth"
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_chain(chain / "chain-delta-2.hsnap", max_depth=1)
    assert e2.value.kind == "ChainError" and e2.value.field == "base.depth"


def test_hostile_tp2_chain_missing_rank_of_the_base_set(tp_chain):
    os.unlink(tp_chain / "chain-tp2-delta-1" / "rank-1.hsnap")
    ref, ind = _both_chain(tp_chain / "chain-tp2-delta-2", rank=1)
    assert ref[0] == ind[0] == "MalformedManifestError"  # the base set's manifest names it (10.2)
    with open_chain(tp_chain / "chain-tp2-delta-2", rank=0) as c:  # the reference opens each rank's own files only,
        c.verify()  # as a plain set's restore does


# ----------------------------------------------------------------------------- the CLI


def test_cli_info_and_verify_show_the_links(chain):
    rc, out, err = _cli("info", chain / "chain-delta-2.hsnap")
    assert rc == 0, err
    assert "delta of chain-delta-1.hsnap at position 5" in " ".join(out.split()) and "chain: 3 links to position 8" in out
    assert re.findall(r"^ +(\d+)  (\S+) +(plain|delta) ", out, re.M) == [(str(i), name, "delta" if i else "plain") for i, name in enumerate(SINGLE)]
    rc, out, _ = _cli("info", "--json", chain / "chain-delta-2.hsnap")
    doc = json.loads(out)
    assert doc["ranks"][0]["base"]["name"] == "chain-delta-1.hsnap"
    assert [os.path.basename(x["path"]) for x in doc["chains"][0]["links"]] == list(SINGLE)
    rc, out, _ = _cli("verify", "--json", chain / "chain-delta-2.hsnap")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and [os.path.basename(p) for p in doc["links"]] == ["chain-delta-1.hsnap", "chain-base.hsnap"]
    rc, out, _ = _cli("verify", chain / "chain-delta-2.hsnap")
    assert rc == 0 and "with 2 links of its chain" in out


def test_cli_verify_fails_a_broken_chain_the_file_alone_would_pass(chain):
    os.unlink(chain / "chain-base.hsnap")
    with hf.open(chain / "chain-delta-2.hsnap") as head:
        head.verify()  # the file itself is intact
    rc, out, err = _cli("verify", "--json", chain / "chain-delta-2.hsnap")
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"] and doc["error"] == "ChainError" and doc["field"] == "base.name"
    rc, out, err = _cli("info", chain / "chain-delta-2.hsnap")
    assert rc == 1 and "ChainError" in err and "missing" in err and "delta of chain-delta-1.hsnap" in out


def test_cli_info_of_a_tp2_chain(tp_chain):
    rc, out, err = _cli("info", tp_chain / "chain-tp2-delta-2")
    assert rc == 0, err
    assert "chain (rank 0): 3 links to position 5" in out and "chain (rank 1): 3 links to position 5" in out
    rc, out, err = _cli("verify", tp_chain / "chain-tp2-delta-2")
    assert rc == 0 and "with 2 links of its chain, each of 2 ranks" in out, err


@pytest.mark.parametrize("what", ["an empty directory", "a snapshot directory's shape without a manifest"])
def test_a_directory_in_place_of_a_base_file_is_a_chain_error_naming_base_name(chain, what):
    """Spec 7.5 step 4: a directory where a rank file is expected is ``ChainError`` (``base.name``) — from the
    reference reader as from the reader written from the spec alone — not the directory reader's complaint."""
    (chain / "chain-delta-1.hsnap").unlink()
    (chain / "chain-delta-1.hsnap").mkdir()
    if what != "an empty directory":
        shutil.copy(VEC / "chain-base.hsnap", chain / "chain-delta-1.hsnap" / "rank-0.hsnap")
    with pytest.raises(hf.ChainError) as e:
        open_chain(chain / "chain-delta-2.hsnap")
    assert e.value.field == "base.name" and "directory" in str(e.value)
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_chain(chain / "chain-delta-2.hsnap")
    assert (e2.value.kind, e2.value.field) == ("ChainError", "base.name")


def test_a_symbolic_link_in_place_of_a_base_is_not_followed_by_either_reader(chain, tmp_path):
    """Spec 7.5 step 4 with 7.1 step 1: a base found by name is opened as any path a reader is given — a symbolic
    link there, even to the very base, is refused (``HsnapIOError``, ``open``), by both readers."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (chain / "chain-delta-1.hsnap").rename(elsewhere / "chain-delta-1.hsnap")
    (chain / "chain-delta-1.hsnap").symlink_to(elsewhere / "chain-delta-1.hsnap")
    with pytest.raises(hf.HsnapIOError) as e:
        open_chain(chain / "chain-delta-2.hsnap")
    assert e.value.field == "open"
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_chain(chain / "chain-delta-2.hsnap")
    assert (e2.value.kind, e2.value.field) == ("HsnapIOError", "open")


def test_a_chain_is_verified_link_checks_first_then_bytes_by_both_readers(chain):
    """Spec 7.5: a verifier makes every link check (steps 1-8) before it reads any section byte: with a flipped
    section byte in the head and a base of another digest below it, both readers report the base's digest first."""
    data = bytearray((chain / "chain-delta-2.hsnap").read_bytes())
    data[-70] ^= 1  # the head's last section
    (chain / "chain-delta-2.hsnap").write_bytes(bytes(data))
    shutil.copy(chain / "chain-base.hsnap", chain / "chain-delta-1.hsnap")  # another file under the base's name
    with pytest.raises(hf.HsnapError) as e:
        with open_chain(chain / "chain-delta-2.hsnap") as c:
            c.verify()
    assert (type(e.value).__name__, e.value.field) == ("DigestMismatchError", "base.root_digest")
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_chain(chain / "chain-delta-2.hsnap")
    assert (e2.value.kind, e2.value.field) == ("DigestMismatchError", "base.root_digest")
