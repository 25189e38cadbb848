"""Snapshot chains on SGLang's real pools: a request exported as a
plain snapshot and two deltas restores like one snapshot, compacts into the file a
direct export writes, and every hostile chain is refused typed with the target pools
untouched."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

import chain_cases as cc  # noqa: E402
import io_cases as ic  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format.chain import Chain, compact, open_chain  # noqa: E402
from hsnap_format.layout import ROW_KINDS  # noqa: E402
from hsnap_io import restore as restore_mod  # noqa: E402
from hsnap_io import restore_request  # noqa: E402
from hsnap_testing import zygote

KINDS = [("mha", 1), ("mha", 16), ("mla", 1), ("hybrid_linear", 1), ("swa", 1), ("swa_mamba", 1), ("mha_fp8", 1)]


def _restore(path, ps, **kw):
    return restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                           identity=kw.pop("identity", ic.identity()), **kw)


def _direct(ps, req, path, head_path):
    """A plain export of the same pools at the head's position, with the head's identity
    (snapshot id and time included), record and swa_start: what compaction must equal."""
    with hf.open(head_path) as head:
        ident, swa_start, pos = head.identity, head.swa_start, head.state_position
    return cc.export(ps, req, path, pos, snapshot_id="", ident=ident, swa_start=swa_start)


def _refused(path, ps, exc_type, **kw):
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(exc_type) as info:
        _restore(path, ps, **kw)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # nothing allocated, no byte written
    assert isinstance(info.value, hf.HsnapError)
    return info.value


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("kind,page", KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def test_chain_restores_and_compacts_like_a_direct_export(kind, page, tmp_path):
    ps, req = cc.source(kind, page)
    paths = cc.export_chain(ps, req, kind, tmp_path)
    direct = str(tmp_path / "direct.hsnap")
    _direct(ps, req, direct, paths[-1])
    with hf.open(paths[0]) as base, hf.open(paths[-1]) as head:  # deltas hold only what changed
        assert base.base is None and head.base.name == "link-1.hsnap" and head.base.depth == 2
        assert head.version == (1, 2) and base.version == (1, 0) and head.header["features"]["required"] == ["delta"]
        for s in head.sections:
            if s.kind in ("attn_k", "attn_v", "mla_kv"):
                assert s.shape[0] == cc.POSITIONS[2] - cc.POSITIONS[1]
    with open_chain(paths[-1]) as chain:
        assert [os.path.basename(s.path) for s in chain.links] == ["link-0.hsnap", "link-1.hsnap", "link-2.hsnap"]
        chain.verify()
        compact(chain, tmp_path / "compact.hsnap")
    assert (tmp_path / "compact.hsnap").read_bytes() == open(direct, "rb").read()  # byte for byte (spec R-7.5-3)
    t_chain, t_direct = ic.target(kind, page), ic.target(kind, page)
    a, b = _restore(paths[-1], t_chain), _restore(direct, t_direct)
    assert (a.state_position, a.snapshot_id, a.bytes_uploaded) == (b.state_position, b.snapshot_id, b.bytes_uploaded)
    assert a.record.output_ids.tolist() == cc.record(cc.POSITIONS[-1]).output_ids.tolist()
    assert cc.same_rows(cc.restored_rows(t_chain, a), cc.restored_rows(t_direct, b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("verify", [True, "during", False])
def test_chain_restore_every_verify_mode(verify, threads, tmp_path, monkeypatch):
    kind = "swa_mamba"  # full and window rows, a window row of the base skipped, the recurrent state from the head
    if threads == 2:  # the links' pieces uploaded on two threads, as a payload over the bound is
        monkeypatch.setattr(restore_mod, "PARALLEL_STAGE_BYTES", 0)
    ps, req = cc.source(kind)
    paths = cc.export_chain(ps, req, kind, tmp_path)
    direct = str(tmp_path / "direct.hsnap")
    _direct(ps, req, direct, paths[-1])
    t1, t2 = ic.target(kind, 1), ic.target(kind, 1)
    a, b = _restore(paths[-1], t1, verify=verify), _restore(direct, t2)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))


def test_delta_export_reads_and_writes_only_the_new_rows(tmp_path):
    ps, req = cc.source("hybrid_linear")
    full = cc.export(ps, req, tmp_path / "full.hsnap", cc.POSITIONS[1], snapshot_id="full")
    base = cc.export(ps, req, tmp_path / "base.hsnap", cc.POSITIONS[0], snapshot_id="b")
    delta = cc.export(ps, req, tmp_path / "delta.hsnap", cc.POSITIONS[1], snapshot_id="d", base=tmp_path / "base.hsnap")
    with hf.open(tmp_path / "delta.hsnap") as d, hf.open(tmp_path / "full.hsnap") as f:
        attn = [s for s in f.sections if s.kind.startswith("attn")]
        rows = cc.POSITIONS[1] - cc.POSITIONS[0]
        assert all(d.section(s.name).length * cc.POSITIONS[1] == s.length * rows for s in attn)
        assert all(d.section(s.name).digest == f.section(s.name).digest for s in f.sections if not s.kind.startswith("attn"))
    assert delta.payload_bytes < full.payload_bytes and base.payload_bytes < full.payload_bytes


def test_chain_over_an_object_store(s3server, tmp_path):
    """The chain's links found beside each other under one prefix, through the same seam."""
    opts = s3server.options()
    bucket = s3server.make_bucket()
    kind = "hybrid_linear"
    ps, req = cc.source(kind)
    paths = cc.export_chain(ps, req, kind, f"s3://{bucket}/run", storage_options=opts)
    local = cc.export_chain(*cc.source(kind), kind, tmp_path)
    with open_chain(paths[-1], storage_options=opts) as chain:
        assert len(chain) == 3
        chain.verify()
        compact(chain, tmp_path / "from-s3.hsnap")
    with open_chain(local[-1]) as chain:
        compact(chain, tmp_path / "from-disk.hsnap")
    assert (tmp_path / "from-s3.hsnap").read_bytes() == (tmp_path / "from-disk.hsnap").read_bytes()
    t1, t2 = ic.target(kind, 1), ic.target(kind, 1)
    a = _restore(paths[-1], t1, storage_options=opts)
    b = _restore(str(tmp_path / "from-disk.hsnap"), t2)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))


# ----------------------------------------------------------------------------- delta export refusals


def _export_refused(tmp_path, exc_type, field, pos=cc.POSITIONS[1], **kw):
    ps, req = cc.source("hybrid_linear")
    cc.export(ps, req, tmp_path / "base.hsnap", cc.POSITIONS[0], snapshot_id="b")
    with pytest.raises(exc_type) as info:
        cc.export(ps, req, tmp_path / "delta.hsnap", pos, snapshot_id="d", **{"base": tmp_path / "base.hsnap", **kw})
    assert not os.path.lexists(tmp_path / "delta.hsnap") and sorted(os.listdir(tmp_path)) == ["base.hsnap"]  # nothing written
    assert field in info.value.field, info.value
    return info.value


def test_delta_export_refuses_a_base_of_another_identity(tmp_path):
    _export_refused(tmp_path, hf.ChainError, "identity.weights_version", ident=ic.identity(snapshot_id="d", weights_version="w2"))


def test_delta_export_refuses_a_base_beyond_its_position(tmp_path):
    _export_refused(tmp_path, hf.ChainError, "request.state_position", pos=cc.POSITIONS[0] - 1)


def test_delta_export_refuses_a_base_of_another_request(tmp_path):
    _export_refused(tmp_path, hf.ChainError, "request.rid", rec=cc.record(cc.POSITIONS[1], rid="req-2"))


def test_delta_export_refuses_another_prompt(tmp_path):
    _export_refused(tmp_path, hf.ChainError, "request.prompt", rec=cc.record(cc.POSITIONS[1], prompt=cc.PROMPT + 1))


def test_delta_export_refuses_another_output_prefix(tmp_path):
    rec = cc.record(cc.POSITIONS[1])
    rec.output_ids = rec.output_ids + 1  # same counts, other tokens
    _export_refused(tmp_path, hf.ChainError, "request.output_ids", rec=rec)


def test_delta_export_refuses_a_base_not_beside_it(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    ps, req = cc.source("hybrid_linear")
    cc.export(ps, req, tmp_path / "elsewhere" / "base.hsnap", cc.POSITIONS[0], snapshot_id="b")
    with pytest.raises(hf.ChainError, match="beside the delta"):
        cc.export(ps, req, tmp_path / "delta.hsnap", cc.POSITIONS[1], snapshot_id="d", base=tmp_path / "elsewhere" / "base.hsnap")
    assert not os.path.lexists(tmp_path / "delta.hsnap")


# ----------------------------------------------------------------------------- hostile chains: typed, nothing allocated


@pytest.fixture
def chain3(tmp_path):
    kind = "swa_mamba"
    ps, req = cc.source(kind)
    return ps, req, cc.export_chain(ps, req, kind, tmp_path), tmp_path


def test_the_pieces_of_every_section_at_once_are_each_sections_pieces(chain3):
    """Chain.pieces_of (a restore's plan: a plain snapshot's pieces made at once) gives what Chain.pieces gives for
    each section, for a chain of deltas and for its bottom link alone (each section whole, rows 0.. of a row kind)."""
    _, _, paths, _ = chain3
    with open_chain(paths[-1]) as chain:
        names = [s.name for s in chain.head.sections]
        assert chain.pieces_of(names) == {n: chain.pieces(n) for n in names}
    with hf.open(paths[0]) as snap:
        chain = Chain.single(snap)
        got = chain.pieces_of([s.name for s in snap.sections])
        assert got == {s.name: chain.pieces(s.name) for s in snap.sections}
        for s in snap.sections:
            (piece,) = got[s.name]
            rows = s.shape[0] if s.kind in ROW_KINDS else None
            assert (piece.link, piece.info, piece.skip, piece.start, piece.stop, piece.take, piece.page, piece.length) == (
                snap, s, 0, None if rows is None else 0, rows, None, None, s.length)


def test_hostile_chain_missing_link(chain3):
    ps, req, paths, _ = chain3
    os.unlink(paths[0])
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.ChainError)
    assert err.field == "base.name" and "missing" in str(err) and "link-0.hsnap" in str(err) and err.path == paths[1]


def test_hostile_chain_base_that_does_not_match_its_digest(chain3):
    ps, req, paths, tmp = chain3
    os.unlink(paths[0])  # another snapshot of the same request (other bytes in its rows) under the base's name
    ps2, req2 = cc.source("swa_mamba", seed=2)
    cc.export(ps2, req2, paths[0], cc.POSITIONS[0], snapshot_id="link-0", swa_start=cc.SWA_STARTS[0])
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.DigestMismatchError)
    assert err.field == "base.root_digest" and err.path == paths[1]


def _write_link(path, base_snap_path, *, pos, base=None, ident=None, swa_start=0, rec=None):
    """A rank file written directly (the reference writer, not export): a delta that names
    ``base`` (or the one ``base_snap_path`` is), with the plan of its own header."""
    from hsnap_format.chain import base_ref
    from hsnap_format.layout import state_sections
    from hsnap_format.spec import DTYPES

    with hf.open(base_snap_path) as b:
        geom = b.geometry
        ref = base or base_ref(b, os.path.basename(base_snap_path))
        ident = ident or b.identity
    state = {s.name: np.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in state_sections(geom, pos, swa_start, ref.state_position)}
    hf.write_snapshot(path, identity=ident, geometry=geom, record=rec or cc.record(pos), state=state, swa_start=swa_start, base=ref)


def test_hostile_chain_base_of_another_request(chain3):
    ps, req, paths, tmp = chain3
    os.unlink(paths[-1])
    _write_link(paths[-1], paths[1], pos=cc.POSITIONS[2], rec=cc.record(cc.POSITIONS[2], rid="someone-else"), swa_start=cc.SWA_STARTS[2])
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.ChainError)
    assert err.field.startswith("request.rid") and "someone-else" in str(err)


def test_hostile_chain_base_of_another_identity(chain3):
    import dataclasses

    ps, req, paths, tmp = chain3
    with hf.open(paths[1]) as b:
        other = dataclasses.replace(b.identity, weights_version="w9")
    os.unlink(paths[-1])
    _write_link(paths[-1], paths[1], pos=cc.POSITIONS[2], swa_start=cc.SWA_STARTS[2], ident=other)
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.ChainError, identity=None)
    assert err.field.startswith("identity.weights_version")


def test_hostile_chain_cycle(chain3):
    ps, req, paths, tmp = chain3
    a, b = str(tmp / "a.hsnap"), str(tmp / "b.hsnap")
    # b names a.hsnap (a digest made up: a does not exist yet), a binds b: following a leads back to a
    _write_link(b, paths[0], pos=cc.POSITIONS[1], swa_start=cc.SWA_STARTS[1],
                base=hf.BaseRef("a.hsnap", "0" * 32, "link-0", cc.POSITIONS[0], 1))
    _write_link(a, b, pos=cc.POSITIONS[2], swa_start=cc.SWA_STARTS[2])
    err = _refused(a, ic.target("swa_mamba", 1), hf.ChainError)
    assert err.field == "base.name" and "cycle" in str(err) and err.path == b
    # and a link naming itself
    _write_link(str(tmp / "self.hsnap"), paths[0], pos=cc.POSITIONS[1], swa_start=cc.SWA_STARTS[1],
                base=hf.BaseRef("self.hsnap", "0" * 32, "link-0", cc.POSITIONS[0], 1))
    err = _refused(str(tmp / "self.hsnap"), ic.target("swa_mamba", 1), hf.ChainError)
    assert "cycle" in str(err)


@pytest.mark.parametrize("shift,label", [(-2, "overlapping rows"), (2, "short rows: a gap")])
def test_hostile_chain_rows_that_do_not_follow_the_base(chain3, shift, label):
    """A delta whose rows start before (overlap) or after (gap) its base's position: a
    valid file alone, refused when the chain is read (the base's position is not the one named)."""
    ps, req, paths, tmp = chain3
    with hf.open(paths[1]) as b:
        from hsnap_format.chain import base_ref

        ref = base_ref(b, "link-1.hsnap")
    import dataclasses

    os.unlink(paths[-1])
    _write_link(paths[-1], paths[1], pos=cc.POSITIONS[2], swa_start=cc.SWA_STARTS[2],
                base=dataclasses.replace(ref, state_position=ref.state_position + shift))
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.ChainError)
    assert err.field == "base.state_position" and err.found == cc.POSITIONS[1], label


def test_hostile_chain_deeper_than_the_limit(chain3, tmp_path):
    from hsnap_format.chain import chain_below

    ps, req, paths, tmp = chain3
    with hf.open(paths[-1]) as head, pytest.raises(hf.ChainError, match="base.depth"):
        chain_below(head, location=paths[-1], max_depth=1)
    import craft

    deep = tmp / "deep.hsnap"
    deep.write_bytes(craft.mutate_header(open(paths[-1], "rb").read(), lambda h: h["base"].update(depth=1025)))
    err = _refused(str(deep), ic.target("swa_mamba", 1), hf.MalformedHeaderError)  # refused at open (R-5.9-2)
    assert err.field == "base.depth"


def test_hostile_chain_base_position_beyond_its_own(chain3):
    import craft

    ps, req, paths, tmp = chain3
    bad = tmp / "beyond.hsnap"
    bad.write_bytes(craft.mutate_header(open(paths[1], "rb").read(), lambda h: h["base"].update(state_position=cc.POSITIONS[1] + 1)))
    err = _refused(str(bad), ic.target("swa_mamba", 1), hf.MalformedHeaderError)
    assert err.field == "base.state_position"


def test_hostile_chain_flipped_byte_in_a_link_below(chain3):
    """verify="before" checks every link before allocating: a damaged base row is refused with
    the pools untouched; the default (one pass) and verify='during' catch it while uploading
    and give back every allocation, the slots they wrote zeroed — or, with exact_rollback,
    their old bytes."""
    ps, req, paths, tmp = chain3
    with hf.open(paths[0]) as b:
        at = b.section("attn.0.k").offset if "attn.0.k" in b else next(s for s in b.sections if s.kind == "attn_k").offset
    data = bytearray(open(paths[0], "rb").read())
    data[at] ^= 0xFF
    open(paths[0], "wb").write(bytes(data))
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.DigestMismatchError, verify="before")
    assert err.path == paths[0]
    t = ic.target("swa_mamba", 1)
    before, copied = sp.pool_state_fingerprint(t), sp.pool_state_copy(t)
    with pytest.raises(hf.DigestMismatchError) as e:
        _restore(paths[-1], t)
    assert e.value.path == paths[0] and sp.refusal_changes(copied, t) == []
    t = ic.target("swa_mamba", 1)
    before = sp.pool_state_fingerprint(t)
    with pytest.raises(hf.DigestMismatchError):
        _restore(paths[-1], t, verify="during", exact_rollback=True)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []
    with pytest.MonkeyPatch.context() as m:  # the same on two upload threads: the other share ends, then all is undone
        m.setattr(restore_mod, "PARALLEL_STAGE_BYTES", 0)
        with pytest.raises(hf.DigestMismatchError):
            _restore(paths[-1], t, verify="during", exact_rollback=True)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []


def test_hostile_chain_output_that_is_not_its_base_continuation(chain3):
    """Caught when the chain is verified (the output ids are section bytes), before allocating."""
    ps, req, paths, tmp = chain3
    rec = cc.record(cc.POSITIONS[2])
    rec.output_ids = rec.output_ids + 7
    os.unlink(paths[-1])
    _write_link(paths[-1], paths[1], pos=cc.POSITIONS[2], swa_start=cc.SWA_STARTS[2], rec=rec)
    err = _refused(paths[-1], ic.target("swa_mamba", 1), hf.ChainError)
    assert err.field == "request.output_ids"


def test_resharding_a_chain_is_refused_typed(tmp_path):
    """Re-sharding reads a set's rank files as plain snapshots: a chain is refused by name
    (compact it first), the pools untouched."""
    from hsnap_io import reshard

    set_dir = tmp_path / "chain-tp2-delta-2"
    vec = os.path.join(os.path.dirname(__file__), "..", "spec", "vectors")
    for name in ("chain-tp2-base", "chain-tp2-delta-1", "chain-tp2-delta-2"):
        shutil.copytree(os.path.join(vec, name), tmp_path / name)
    ps = ic.target("hybrid_linear", 1)
    before = sp.pool_state_fingerprint(ps)
    model = reshard.TPModel(kv_heads=2, mamba=reshard.GDNDims(k_heads=1, v_heads=2, k_dim=1, v_dim=1))
    with pytest.raises(hf.UnsupportedFeatureError, match="re-sharding a snapshot chain"):
        restore_request(str(set_dir), req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                        identity=None, tp_size=1, rank=0, sharding=reshard.describe(model, tp=1, rank=0))
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []


# ----------------------------------------------------------------------------- TP 2 over gloo


def test_tp2_chain_export_restore_and_compact(tmp_path):
    """Two ranks export a plain set and two delta sets (each rank's delta binding its base
    set's rank file), restore the head on two fresh ranks, and compact it: the rows equal a
    direct restore and the compacted set is byte-identical to a direct export."""
    import json
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    here = os.path.dirname(os.path.abspath(__file__))
    outs = [str(tmp_path / f"rank-{r}.json") for r in range(2)]
    procs = [zygote.popen([sys.executable, os.path.join(here, "chain_tp_child.py"), str(r), "2", port, str(tmp_path / "run"), outs[r]],
                          text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    results = [json.load(open(o)) for o in outs]
    for r in results:
        assert r["same_rows"] and r["links"] == 3, r
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["direct", "link-0", "link-1", "link-2"]
    from hsnap_format.chain import compact_path

    links, _ = compact_path(run / "link-2", tmp_path / "compacted")
    assert links == 3
    for name in os.listdir(run / "direct"):
        assert (tmp_path / "compacted" / name).read_bytes() == (run / "direct" / name).read_bytes(), name
