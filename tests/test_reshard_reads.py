"""How a re-sharded restore reads and where it assembles.

Each source section a target section depends on is read whole (its digest covers every
byte) in 2 MiB pieces, the rows it needs sliced out of each piece straight into the
slots when they are one run — as the plain restore preads into them, hashed as it lands
— with no host buffer of a section's size; ``verify=True`` verifies every such section
before allocating first, as the plain path does. Real SGLang pools
(hsnap_testing/tp_pools.py); speed is measured by bench/reshard.py, never here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tracemalloc

import numpy as np
import pytest

import hsnap_format as hf
from hsnap_io import reshard, restore_request
from hsnap_io.adapters import view_pools

from hsnap_testing import tp_pools as rp
from hsnap_testing import pools as sp


@pytest.fixture(scope="module")
def states():
    return {name: rp.global_state(m) for name, m in rp.MODELS.items()}


@pytest.fixture(scope="module")
def sets(tmp_path_factory, states):
    root = tmp_path_factory.mktemp("sets")
    out = {}

    def get(name, tp):
        if (name, tp) not in out:
            out[name, tp] = rp.export_set(rp.MODELS[name], tp, states[name], root / f"{name}-tp{tp}")
        return out[name, tp]

    return get


def _restore(path, m, tp, rank, ps=None, **kw):
    ps = ps or rp.build(m, tp, rank, seed=77 + rank)
    res = restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(tp, rank),
                          sharding=reshard.describe(m.tp, tp, rank), **kw)
    return ps, res


def _assert_restored(ps, res, m, tp, rank, state):
    for sec, got in rp.restored_rows(ps, res).items():
        assert rp.as_bytes(got) == rp.as_bytes(rp.shard_of(m, tp, rank, sec, state[sec])), sec


@contextlib.contextmanager
def _state_reads(monkeypatch):
    """Bytes read through ``Snapshot._read`` per (rank file, state section)."""
    counts: dict[tuple[str, str], int] = {}
    real = hf.Snapshot._read

    def counting(self, offset, length, out=None):
        for s in self.sections:
            if s.is_state and s.offset <= offset < s.offset + max(s.length, 1):
                key = (os.path.basename(self.path), s.name)
                counts[key] = counts.get(key, 0) + length
        return real(self, offset, length, out)

    monkeypatch.setattr(hf.Snapshot, "_read", counting)
    yield counts


def _depended_on(path, m, tp, rank, ps) -> dict[tuple[str, str], int]:
    with hf.open_snapshot(path) as s:
        plans = reshard.build_plans(s, view_pools(ps.rtp, ps.alloc), reshard.describe(m.tp, tp, rank), path)
        return {(f"rank-{k}.hsnap", p.name): s.ranks[k].section(p.name).length for p in plans for k in p.sources}


@pytest.mark.parametrize("name,src,dst", [("qwen35", 2, 1), ("gqa", 1, 2), ("qwen35", 4, 2), ("mamba2", 1, 4)])
@pytest.mark.parametrize("verify,passes", [(True, 2), ("during", 1), (False, 1)])
def test_each_depended_on_source_section_is_read_whole_once_per_pass(sets, states, monkeypatch, name, src, dst, verify, passes):
    """Every source section a target section depends on is read whole — once while it is
    assembled, and once more before allocating with verify=True (as the plain path) —
    and no other state section is read; the bytes are right."""
    m = rp.MODELS[name]
    path = sets(name, src)
    ps = rp.build(m, dst, 0, seed=77)
    want = _depended_on(path, m, dst, 0, ps)
    with _state_reads(monkeypatch) as counts:
        _, res = _restore(path, m, dst, 0, ps=ps, verify=verify)
    assert counts == {k: passes * n for k, n in want.items()}
    assert res.source_bytes_read == sum(want.values())
    _assert_restored(ps, res, m, dst, 0, states[name])


@pytest.mark.parametrize("verify", [True, "during", False])
def test_sections_are_assembled_in_the_slots_without_a_section_sized_buffer(tmp_path, monkeypatch, verify):
    """1 -> 2 with attention sections of 10 MiB per target rank: the restore's host memory
    (numpy and bytes allocations, tracemalloc) stays under one target section — the rows
    go from each 2 MiB piece straight into the slots — and every byte is right."""
    monkeypatch.setattr(rp, "HEAD_DIM", 65536)  # 40 tokens x 4 heads x 65,536 x bf16: 20 MiB per global section
    monkeypatch.setattr(rp, "N_TOKENS", 40)
    real_record = rp.record
    monkeypatch.setattr(rp, "record", lambda: dataclasses.replace(real_record(), prompt_ids=np.arange(37, dtype=np.int32)))
    m = rp.MODELS["gqa"]
    state = rp.global_state(m)
    path = rp.export_set(m, 1, state, tmp_path / "big")
    ps = rp.build(m, 2, 1, seed=7)
    section = 40 * 2 * 65536 * 2  # one target section: heads 2..3
    tracemalloc.start()
    try:
        _, res = _restore(path, m, 2, 1, ps=ps, verify=verify)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < section, (peak, section)
    assert res.bytes_uploaded == 4 * section
    _assert_restored(ps, res, m, 2, 1, state)


def _fragment(ps) -> None:
    """Every other free token slot taken: the restore's slots are not one run."""
    taken = ps.alloc.alloc(ps.alloc.available_size())
    ps.alloc.free(taken[1::2])


@pytest.mark.parametrize("fragmented", [False, True], ids=["one-run", "fragmented"])
@pytest.mark.parametrize("verify", [True, "during", False])
@pytest.mark.parametrize("name,src,dst", [("qwen35", 2, 1), ("gqa", 1, 2), ("swa", 2, 4), ("mla", 2, 1), ("mamba2", 4, 2)])
def test_one_run_and_fragmented_slots_get_the_same_bytes(sets, states, name, src, dst, verify, fragmented):
    """Straight into the slots when they are one run, through one scratch buffer otherwise
    (checked before it is uploaded) — byte for byte the source shards either way."""
    m = rp.MODELS[name]
    for r in range(dst):
        ps = rp.build(m, dst, r, seed=77 + r)
        if fragmented:
            _fragment(ps)
        _, res = _restore(sets(name, src), m, dst, r, ps=ps, verify=verify)
        steps = (res.token_indices[1:] - res.token_indices[:-1]).tolist()
        assert (set(steps) != {1}) == fragmented  # the case is the one named
        _assert_restored(ps, res, m, dst, r, states[name])


def test_during_mismatch_in_the_slots_is_rolled_back(sets, tmp_path):
    """verify="during" hashes a section as it lands in the slots; a corrupt source section
    is refused and, with exact_rollback, the pools are byte-identical."""
    import shutil

    m = rp.MODELS["qwen35"]
    path = tmp_path / "bad"
    shutil.copytree(sets("qwen35", 2), path)
    f = path / "rank-1.hsnap"
    with hf.Snapshot(f) as s:
        off = s.section("attn.3.k").offset
    data = bytearray(f.read_bytes())
    data[off + 3] ^= 0x01
    f.write_bytes(bytes(data))
    ps = rp.build(m, 1, 0, seed=5)
    before = sp.pool_state_fingerprint(ps.pools)
    with pytest.raises(hf.DigestMismatchError, match=r"rank-1\.hsnap: sections\['attn\.3\.k'\]\.digest"):
        _restore(path, m, 1, 0, ps=ps, verify="during", exact_rollback=True)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps.pools)) == []
