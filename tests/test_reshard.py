"""Restore across TP sizes: the 1.1 sharding description derived from SGLang's
own sharding code matches SGLang's pools at TP 1, 2 and 4, and every pair of TP sizes
restores byte for byte into pools built the way SGLang holds each rank, on four
geometries (Qwen3.5-35B-A3B per rank, GQA kv >= tp, MLA, Mamba2 n_groups 1 < tp)."""

from __future__ import annotations


from pathlib import Path

import pytest

import hsnap_format as hf
from hsnap_format.records import Sharding
from hsnap_io import reshard, restore_request
from hsnap_io.adapters import view_pools

from hsnap_testing import tp_pools as rp

PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4)]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """(model, tp) -> a committed TP snapshot directory of that model's global state."""
    root = tmp_path_factory.mktemp("sets")
    states = {name: rp.global_state(m) for name, m in rp.MODELS.items()}
    out = {}

    def get(name, tp):
        if (name, tp) not in out:
            out[name, tp] = rp.export_set(rp.MODELS[name], tp, states[name], root / f"{name}-tp{tp}")
        return out[name, tp]

    get.states = states
    return get


def _fingerprint(ps) -> dict:
    v = view_pools(ps.rtp, ps.alloc)
    fp = {b.name: rp.as_bytes(b.buffer) for b in v.bindings}
    fp["free"] = rp.as_bytes(ps.alloc.free_pages.clone())
    fp["rows"] = list(ps.rtp.free_slots)
    fp["req_to_token"] = rp.as_bytes(ps.rtp.req_to_token)
    if hasattr(ps.rtp, "mamba_allocator"):
        fp["mamba_free"] = rp.as_bytes(ps.rtp.mamba_allocator.free_slots.clone())
    return fp


def _restore(path, m, tp, rank, **kw):
    ps = rp.build(m, tp, rank, seed=77 + rank)
    res = restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc,
                          identity=rp.identity(tp, rank), sharding=reshard.describe(m.tp, tp, rank), **kw)
    return ps, res


# ----------------------------------------------------------------------------- description


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(rp.MODELS))
def test_description_matches_sglang_pools(name, tp):
    """Each rank's description has the local extents of SGLang's own pools at that TP size,
    and over the group every global element is held by exactly ``replicas`` ranks."""
    m = rp.MODELS[name]
    held: dict[str, list[int]] = {}
    for r in range(tp):
        ps = rp.build(m, tp, r)
        geom = view_pools(ps.rtp, ps.alloc).geometry
        desc = reshard.describe(m.tp, tp, r)
        # the reader's own rule: every local extent equals the pool's (raises otherwise)
        Sharding.from_header(desc.to_header(), geom.attention, geom.mamba)
        for key, ax in (("attention", desc.attention), ("temporal", desc.temporal)) + tuple(("conv", c) for c in desc.conv or ()):
            if ax is None:
                continue
            for g, n, rep in ax.parts:
                held.setdefault(key, []).extend([(x, rep) for x in range(g, g + n)])
            held.setdefault(key + ".global", []).append(ax.global_size)
    for key in [k for k in held if not k.endswith(".global")]:
        glob = held[key + ".global"][0]
        counts = {}
        for x, rep in held[key]:
            counts.setdefault(x, []).append(rep)
        assert sorted(counts) == list(range(glob)), (key, "every global element held")
        for x, reps in counts.items():
            assert len(reps) == reps[0], (key, x, "held by exactly `replicas` ranks", reps)


def test_description_of_known_layouts():
    """Values worked out by hand from SGLang's rules (would fail on a flat split)."""
    q = rp.MODELS["qwen35"].tp
    # Qwen3.5-35B-A3B at TP 4: 2 KV heads, so head 1 lives on ranks 2 and 3
    assert reshard.describe(q, 4, 2).attention.parts == ((1, 1, 2),)
    # GDN conv at TP 2, rank 1: its halves of q (32 ch), k (32 ch) and v (64 ch) — not the
    # flat second half [64, 128) of the packed channels (vLLM #37638)
    assert reshard.describe(q, 2, 1).conv[0].parts == ((16, 16, 1), (48, 16, 1), (96, 32, 1))
    # value heads split the temporal state: 32 heads, rank 3 of 4 holds 24..31
    assert reshard.describe(q, 4, 3).temporal.parts == ((24, 8, 1),)
    # Mamba2 n_groups 1 at TP 4: x split, B and C (2 channels each) on every rank
    assert reshard.describe(rp.MODELS["mamba2"].tp, 4, 1).conv[0].parts == ((2, 2, 1), (8, 2, 4), (10, 2, 4))
    assert reshard.describe(rp.MODELS["mla"].tp, 2, 1).attention.parts == ((0, 1, 2),)


def test_exported_rank_files_carry_the_description(sets):
    path = sets("qwen35", 2)
    with hf.open_snapshot(path) as s:
        r1 = s.ranks[1]
        assert r1.version == (1, 1)
        assert "tp-sharding" in r1.header["features"]["optional"]
        assert r1.geometry.sharding == reshard.describe(rp.MODELS["qwen35"].tp, 2, 1)


# ----------------------------------------------------------------------------- byte level


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("name", sorted(rp.MODELS))
def test_every_pair_byte_for_byte(sets, name, src, dst):
    m = rp.MODELS[name]
    state = sets.states[name]
    path = sets(name, src)
    for r in range(dst):
        ps, res = _restore(path, m, dst, r)
        got = rp.restored_rows(ps, res)
        for sec, t in got.items():
            want = rp.shard_of(m, dst, r, sec, state[sec])
            assert rp.as_bytes(t) == rp.as_bytes(want), (name, src, dst, r, sec)
        assert res.state_position == rp.N_TOKENS and list(res.record.output_ids) == [7, 8, 9]
        # every source section a target section depends on is read once, whole
        # (hashed); replicas are read from one source only
        with hf.open_snapshot(path) as s:
            plans = reshard.build_plans(s, view_pools(ps.rtp, ps.alloc), reshard.describe(m.tp, dst, r), path)
            assert res.source_bytes_read == sum(s.ranks[k].section(p.name).length for p in plans for k in p.sources)
        assert res.source_bytes_read >= res.bytes_uploaded
        if src > dst:
            assert len(res.source_ranks) >= 1
        if name == "gqa" and src == 2 and dst == 4:
            assert res.source_ranks == (r // 2,)  # the one source rank holding this head


def test_replicated_heads_come_from_one_source(sets):
    """4 -> 2 on Qwen3.5: head 0 lives on source ranks 0 and 1; target rank 0 reads it from
    rank 0 only, and both GDN halves from ranks 0 and 1."""
    m = rp.MODELS["qwen35"]
    ps, res = _restore(sets("qwen35", 4), m, 2, 0)
    assert res.source_ranks == (0, 1)
    plans = reshard.build_plans(hf.open_snapshot(sets("qwen35", 4)), view_pools(ps.rtp, ps.alloc),
                                reshard.describe(m.tp, 2, 1), "x")
    attn = [p for p in plans if p.name.startswith("attn")][0]
    assert [(r.src, r.count) for r in attn.runs] == [(2, 1)]  # head 1: ranks 2 and 3 hold it, 2 serves


# ----------------------------------------------------------------------------- refusals


def test_non_divisible_split_refused_by_name():
    with pytest.raises(reshard.ReshardError, match="attention kv heads"):
        reshard.describe(reshard.TPModel(kv_heads=3), 2, 0)
    with pytest.raises(reshard.ReshardError, match="mamba n_groups"):
        reshard.describe(reshard.TPModel(mamba=reshard.Mamba2Dims(8, 2, 4, 2, 2)), 4, 0)
    with pytest.raises(reshard.ReshardError, match="mamba heads"):
        reshard.describe(reshard.TPModel(mamba=reshard.GDNDims(2, 6, 2, 2)), 4, 0)


def _refused(path, m, tp, rank, exc, match, sharding=None, identity=None):
    ps = rp.build(m, tp, rank, seed=5)
    before = _fingerprint(ps)
    with pytest.raises(exc, match=match):
        restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc,
                        identity=identity or rp.identity(tp, rank), sharding=sharding or reshard.describe(m.tp, tp, rank))
    assert _fingerprint(ps) == before  # a refusal leaves the target pools byte-identical


def test_undescribed_set_refused_by_name(tmp_path):
    """A TP 2 set of 1.0 files (no geometry.sharding) cannot be re-sharded: refused naming
    the kind, before anything is allocated."""
    m = rp.MODELS["qwen35"]
    state = rp.global_state(m)
    sw = hf.SetWriter(tmp_path / "v10")
    from hsnap_io import export_request

    for r in range(2):
        ps = rp.build(m, 2, r)
        row, _, _ = rp.place(ps, state)
        export_request(sw.rank_path(r), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, req_pool_idx=row,
                       record=rp.record(), identity=rp.identity(2, r), fsync=False)
    sw.commit(tp_size=2, fsync=False)
    with hf.open_snapshot(tmp_path / "v10") as s:
        assert s.ranks[0].version == (1, 0)  # no 1.1 content: a 1.0 file
    _refused(tmp_path / "v10", m, 1, 0, reshard.ReshardError, r"rank-0\.hsnap: geometry\.sharding\.conv\[0\]: expected described")


def test_target_with_other_dims_refused(sets):
    m = rp.MODELS["gqa"]
    other = reshard.TPModel(kv_heads=8)  # another global head count
    with pytest.raises(hf.IncompatibleSnapshotError):
        ps = rp.build(rp.MODELS["gqa"], 2, 0)
        restore_request(sets("gqa", 1), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc,
                        identity=rp.identity(2, 0), sharding=reshard.describe(other, 4, 0))
    _refused(sets("gqa", 1), m, 2, 0, hf.IncompatibleSnapshotError, "model_id",
             identity=hf.Identity(model_id="other", weights_version="w1", engine=hf.Engine("sglang", "0.5.23", "test"), tp_size=2, tp_rank=0))


def test_corrupt_source_refused_before_allocation(sets, tmp_path):
    import shutil

    m = rp.MODELS["qwen35"]
    path = tmp_path / "bad"
    shutil.copytree(sets("qwen35", 2), path)
    f = path / "rank-1.hsnap"
    with hf.Snapshot(f) as s:
        off = s.section("mamba.2.conv.0").offset
    data = bytearray(f.read_bytes())
    data[off] ^= 0x01
    f.write_bytes(bytes(data))
    _refused(path, m, 1, 0, hf.DigestMismatchError, r"rank-1\.hsnap.*mamba\.2\.conv\.0")


def test_failed_upload_rolls_back(sets, monkeypatch):
    m = rp.MODELS["qwen35"]
    ps = rp.build(m, 1, 0, seed=5)
    before = _fingerprint(ps)
    calls = []
    real = reshard._read_runs

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(5, "injected read failure")
        return real(*a, **kw)

    monkeypatch.setattr(reshard, "_read_runs", failing)
    with pytest.raises(hf.HsnapIOError, match="injected"):
        restore_request(sets("qwen35", 2), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc,
                        identity=rp.identity(1, 0), sharding=reshard.describe(m.tp, 1, 0), exact_rollback=True)
    assert _fingerprint(ps) == before


def test_same_tp_takes_the_plain_path(sets):
    """With the set's own TP size the sharding argument changes nothing (rank file as is)."""
    m = rp.MODELS["gqa"]
    ps, res = _restore(sets("gqa", 2), m, 2, 1)
    assert res.source_bytes_read == 0 and res.source_ranks == ()
    got = rp.restored_rows(ps, res)
    for sec, t in got.items():
        assert rp.as_bytes(t) == rp.as_bytes(rp.shard_of(m, 2, 1, sec, sets.states["gqa"][sec]))


@pytest.mark.parametrize("name", sorted(rp.MODELS))
def test_a_whole_tp1_file_reshards_as_its_one_rank_set(sets, name, tmp_path):
    """A TP 1 snapshot is a file, not a directory (what a TP 1 server writes): it re-shards to TP 2 as the set of one
    rank it is, byte for byte, read through the one open of the file."""
    import shutil

    m = rp.MODELS[name]
    whole = tmp_path / "whole.hsnap"
    shutil.copyfile(Path(sets(name, 1)) / "rank-0.hsnap", whole)
    for r in range(2):
        ps, res = _restore(whole, m, 2, r)
        for sec, t in rp.restored_rows(ps, res).items():
            assert rp.as_bytes(t) == rp.as_bytes(rp.shard_of(m, 2, r, sec, sets.states[name][sec])), (name, r, sec)
        assert res.source_ranks == (0,) and res.source_bytes_read >= res.bytes_uploaded


def test_one_rank_file_of_a_set_is_not_a_whole_state(sets, tmp_path):
    """A rank file of a TP 2 set named alone holds half the state: refused typed, never re-sharded as if whole."""
    import shutil

    m = rp.MODELS["gqa"]
    half = tmp_path / "half.hsnap"
    shutil.copyfile(Path(sets("gqa", 2)) / "rank-0.hsnap", half)
    _refused(half, m, 4, 0, hf.IncompatibleSnapshotError, "tp_size")
    with hf.open(str(half)) as snap, pytest.raises(hf.MalformedManifestError, match="a whole state"):
        hf.SnapshotSet.of_whole_file(snap)
