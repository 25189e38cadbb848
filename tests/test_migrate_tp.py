"""Live migration across TP sizes ("works across TP sizes: the re-sharding
path"): a source at TP N writes each link as a TP set (``MigrationSource(sharding=, group=)``),
every target rank at TP M != N follows the same container with its own ``MigrationTarget``
(``sharding=`` its description) and applies each link re-sharded — the first as a
re-sharded restore, each delta incrementally: this rank's heads of the new rows only, into
new slots after the request's, and its share of the whole recurrent state over the
request's Mamba slot. Real SGLang pools of each rank (hsnap_testing/tp_pools.py); the source
ranks are in-process TP sets (``tp_migrate_cases.write_set``), or two forked processes over
gloo writing through ``MigrationSource(group=)``."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import time

import pytest

pytest.importorskip("torch")

import numpy as np  # noqa: E402

import chain_cases as cc  # noqa: E402
import hsnap_format as hf  # noqa: E402
from hsnap_testing import tp_pools as rp  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
import tp_migrate_cases as tc  # noqa: E402
from hsnap_io import reshard, restore_request  # noqa: E402
from hsnap_io.migrate import FINAL_NAME, LINK_NAME, MigrationSource, MigrationTarget  # noqa: E402
from hsnap_io.reshard import InconsistentSetError  # noqa: E402

M = tc.MODEL


def _target(tp: int, rank: int, **kw):
    ps = tc.target(tp, rank)
    tgt = MigrationTarget(req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(tp, rank),
                          sharding=reshard.describe(M.tp, tp, rank), **kw)
    return ps, tgt


def _direct(path, tp: int, rank: int) -> dict[str, bytes]:
    """A direct re-sharded restore of the plain set ``path`` into fresh pools of target rank ``rank`` of ``tp``."""
    ps = tc.target(tp, rank, seed=90)
    res = restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(tp, rank),
                          sharding=reshard.describe(M.tp, tp, rank))
    return tc.request_bytes(ps, res)


def _fingerprint(ps):
    return sp.pool_state_fingerprint(ps.pools)


def _refused(tgt, ps, path, exc_type, **kw):
    before, at = _fingerprint(ps), tgt.request.state_position
    with pytest.raises(exc_type) as info:
        tgt.apply(path, **kw)
    assert isinstance(info.value, hf.HsnapError)
    assert sp.diff_fingerprints(before, _fingerprint(ps)) == []  # nothing allocated, no byte written
    assert tgt.request.state_position == at  # the migration is where it was
    return info.value


def _row_bytes(ps) -> int:
    from hsnap_io.adapters import view_pools

    return sum(b.buffer[0].numel() * b.buffer.element_size() for b in view_pools(ps.rtp, ps.alloc).bindings if b.space == "token")


def _state_bytes(ps) -> int:
    from hsnap_io.adapters import view_pools

    return sum(b.buffer[0].numel() * b.buffer.element_size() for b in view_pools(ps.rtp, ps.alloc).bindings if b.space == "mamba")


# ----------------------------------------------------------------------------- TP 1 -> TP 2


def test_tp1_to_tp2_live_migration_each_target_rank_equals_a_direct_reshard(tmp_path):
    """A TP 1 source pre-copies two rounds and stops; both ranks of a TP 2 target apply every
    link as it is committed. After the final link each rank's request slots hold exactly the
    bytes of a direct re-sharded restore of a plain TP 1 snapshot at the final position (and
    their shard of the global state); each delta uploaded only its new rows' heads and the
    rank's share of the recurrent state."""
    rows, states = tc.rounds()
    src_rank = tc.Rank(1, 0, rows)
    src = MigrationSource(tmp_path / "mig", req_to_token_pool=src_rank.ps.rtp, token_to_kv_pool_allocator=src_rank.ps.alloc,
                          identity=src_rank.identity(), sharding=src_rank.sharding(), fsync=False)
    targets = [_target(2, r) for r in range(2)]
    applied = {r: [] for r in range(2)}
    for i, pos in enumerate(tc.POSITIONS):
        src_rank.decode_to(pos, states[i])
        (src.stop if i == len(tc.POSITIONS) - 1 else src.precopy)(src_rank.row, tc.record(pos))
        for r, (_, tgt) in enumerate(targets):
            got = tgt.step(tmp_path / "mig")  # each rank follows the container on its own
            assert got is not None and got.state_position == pos
            applied[r].append(got)
    assert [os.path.basename(p) for p in src.links] == [LINK_NAME.format(0), LINK_NAME.format(1), FINAL_NAME]
    assert all(os.path.isdir(p) for p in src.links)  # each link a (one-rank) set: re-shardable
    direct = tc.write_set([src_rank], tmp_path / "direct", tc.POSITIONS[-1])
    for r, (ps, tgt) in enumerate(targets):
        got = tc.request_bytes(ps, tgt.request)
        assert got == _direct(direct, 2, r)  # byte-exact against a direct re-sharded restore
        assert got == tc.expected_bytes(M, 2, r, rows, states[-1], tc.POSITIONS[-1])  # and the independent oracle
        assert tgt.request.record.output_ids.tolist() == tc.record(tc.POSITIONS[-1]).output_ids.tolist()
        steps = np.diff((0,) + tc.POSITIONS).tolist()
        assert [a.rows for a in applied[r]] == steps and applied[r][-1].final
        # a delta uploads its new rows (this rank's one head of two) and the rank's recurrent state: nothing more
        for a, n in zip(applied[r][1:], steps[1:]):
            assert a.bytes_uploaded == n * _row_bytes(ps) + _state_bytes(ps)
    # the source's TP 1 pools hold both heads: a target rank's row is half of it
    assert _row_bytes(targets[0][0]) * 2 == _row_bytes(src_rank.ps)


# ----------------------------------------------------------------------------- TP 2 -> TP 1, in-process source ranks


def _tp2_migration(root, rows, states, name: str = "mig", seed: int = 30):
    """A TP 2 source's links: link-0000 (plain set), link-0001, final (sets of deltas)."""
    ranks = [tc.Rank(2, r, rows, seed=seed) for r in range(2)]
    links = []
    os.makedirs(root / name, exist_ok=True)
    for i, pos in enumerate(tc.POSITIONS):
        for k in ranks:
            k.decode_to(pos, states[i])
        link = root / name / (FINAL_NAME if i == len(tc.POSITIONS) - 1 else LINK_NAME.format(i))
        links.append(tc.write_set(ranks, link, pos, base=links[-1] if links else None))
    return ranks, links


def test_tp2_to_tp1_hostile_deltas_refused_and_the_final_link_reads_only_itself(tmp_path, monkeypatch):
    """Every refusal of a delta set comes before anything is allocated, typed, and leaves the
    pools byte-identical and the migration where it was: source ranks that disagree
    (InconsistentSetError), a source rank this target rank needs missing, a delta of another
    base, one changed byte of a source rank, an upload failure (its slots given back and the
    Mamba slot put back). The right links then apply; with every earlier link's bytes changed
    in place, the final link still applies — the downtime path reads only itself — and the
    request equals a direct re-sharded restore of a plain TP 2 set at the final position."""
    rows, states = tc.rounds()
    ranks, links = _tp2_migration(tmp_path, rows, states)
    ps, tgt = _target(1, 0, exact_rollback=True)
    seen = []

    def refuse(snap, record):  # a scheduler's own check, after every check of the link and before allocating
        seen.append((snap.identity.tp_size, record.state_position))
        raise hf.CapacityError(snap.path, "scheduler", detail="no room")

    before = _fingerprint(ps)
    with pytest.raises(hf.CapacityError):
        tgt.apply(links[0], accept=refuse)
    assert sp.diff_fingerprints(before, _fingerprint(ps)) == [] and tgt.request is None
    assert tgt.apply(links[0]).rows == tc.POSITIONS[0]
    _refused(tgt, ps, links[1], hf.CapacityError, accept=refuse)
    assert seen == [(2, tc.POSITIONS[0]), (2, tc.POSITIONS[1])]  # the source set's record, as each link would continue it
    first = tc.request_bytes(ps, tgt.request)
    assert first == tc.expected_bytes(M, 1, 0, rows, states[0], tc.POSITIONS[0])

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    base = str(tmp_path / "mig" / LINK_NAME.format(0))
    # the two source ranks disagree: rank 1's record has another last token
    bad = tc.record(tc.POSITIONS[1])
    bad = hf.RequestRecord(rid=bad.rid, prompt_ids=bad.prompt_ids, output_ids=np.concatenate([bad.output_ids[:-1], [7]]).astype(np.int32),
                           state_position=bad.state_position, max_new_tokens=bad.max_new_tokens)
    shutil.copytree(base, hostile / "base")
    e = _refused(tgt, ps, tc.write_set(ranks, hostile / "disagree", tc.POSITIONS[1], base=hostile / "base", overrides={1: {"record_": bad}}),
                 InconsistentSetError)
    assert "request.output_ids" in e.field and "rank-1" in str(e.path)
    # a source rank this target rank needs (it holds the other KV head) is missing
    missing = tc.write_set(ranks, hostile / "missing", tc.POSITIONS[1], base=hostile / "base")
    os.remove(os.path.join(missing, "rank-1.hsnap"))
    e = _refused(tgt, ps, missing, hf.MalformedManifestError)
    assert e.field == "ranks[1].file" and "rank-1" in str(e)
    # a delta of another base: another migration of the same request (other bytes, same names and ids)
    _, other = _tp2_migration(tmp_path, *tc.rounds(seed=9), name="other")
    e = _refused(tgt, ps, other[1], hf.DigestMismatchError)
    assert e.field == "base.root_digest"
    e = _refused(tgt, ps, links[2], hf.DigestMismatchError)  # skips link-0001
    assert e.field == "base.root_digest"
    e = _refused(tgt, ps, links[0], hf.ChainError)  # a plain set is no next link
    assert e.field == "base"
    # one changed byte in a KV section of source rank 1: hashed before anything is allocated
    flipped = shutil.copytree(links[1], hostile / "flipped")
    with hf.open(os.path.join(flipped, "rank-1.hsnap")) as s:
        sec = next(x for x in s.sections if x.kind == "attn_k")
    with open(os.path.join(flipped, "rank-1.hsnap"), "r+b") as f:
        f.seek(sec.offset + 1)
        b = f.read(1)
        f.seek(sec.offset + 1)
        f.write(bytes([b[0] ^ 0x20]))
    e = _refused(tgt, ps, flipped, hf.DigestMismatchError)
    assert sec.name in e.field
    # an upload that fails at the last section: the link's slots go back, the Mamba slot's bytes too
    assemble = reshard._assemble

    def fail_last(sources, p, out, check, path, buf):
        if p.name == tgt.view.bindings[-1].name:
            raise RuntimeError("device lost")
        return assemble(sources, p, out, check, path, buf)

    monkeypatch.setattr(reshard, "_assemble", fail_last)
    e = _refused(tgt, ps, links[1], hf.HsnapError)
    assert "device lost" in str(e)
    monkeypatch.undo()
    assert tc.request_bytes(ps, tgt.request) == first

    assert tgt.apply(links[1]).rows == tc.POSITIONS[1] - tc.POSITIONS[0]
    second = tc.request_bytes(ps, tgt.request)
    monkeypatch.setattr(reshard, "_assemble", fail_last)  # the final link fails once too: the state after link-0001 comes back
    _refused(tgt, ps, links[2], hf.HsnapError)
    monkeypatch.undo()
    assert tc.request_bytes(ps, tgt.request) == second
    for link in links[:2]:  # every section of every earlier link changed in place
        for r in range(2):
            cc.flip_every_section(os.path.join(link, f"rank-{r}.hsnap"))
    final = tgt.apply(links[2])
    assert final.final and final.rows == tc.POSITIONS[2] - tc.POSITIONS[1]
    assert final.bytes_uploaded == final.rows * _row_bytes(ps) + _state_bytes(ps)
    direct = tc.write_set(ranks, tmp_path / "direct", tc.POSITIONS[-1])
    got = tc.request_bytes(ps, tgt.request)
    assert got == _direct(direct, 1, 0)
    assert got == tc.expected_bytes(M, 1, 0, rows, states[-1], tc.POSITIONS[-1])
    free = ps.alloc.available_size()
    tgt.release()
    assert ps.alloc.available_size() == free + tc.POSITIONS[-1]


# ----------------------------------------------------------------------------- TP 2 -> TP 1, two source processes over gloo


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_tp2_to_tp1_live_migration_from_two_source_processes(tmp_path):
    """Two source processes (a TP 2 gloo group, forked) migrate their shards with
    ``MigrationSource(group=)``: each link one TP set, committed by the group. A TP 1 target
    follows the container while they write and applies each link re-sharded; after the
    final link its request equals a direct re-sharded restore of the plain TP 2 set the
    group wrote at the final position, byte for byte."""
    port, world = _free_port(), 2
    rows, states = tc.rounds()  # SGLang imported and its sharding code run here once: the forked ranks start warm
    reshard.describe(M.tp, world, 0)
    ctx = multiprocessing.get_context("fork")  # the test process already imported SGLang: the ranks start at once
    procs = [ctx.Process(target=tc.source_rank, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        ps, tgt = _target(1, 0)
        applied = []
        while not (applied and applied[-1].final):  # follow, failing fast if a source rank died
            got = tgt.step(tmp_path / "mig")
            if got is None:
                assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
                assert not all(p.exitcode == 0 for p in procs) or os.path.exists(tmp_path / "mig" / FINAL_NAME), "no final link"
                time.sleep(0.005)
            else:
                applied.append(got)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert [os.path.basename(a.path) for a in applied] == [LINK_NAME.format(0), LINK_NAME.format(1), FINAL_NAME]
    assert [a.state_position for a in applied] == list(tc.POSITIONS)
    with hf.open(applied[-1].path) as final:  # a TP 2 set of deltas: each rank's file names its own rank of link-0001
        assert final.manifest.tp_size == 2
        assert {s.base.name for s in final.ranks.values()} == {LINK_NAME.format(1)}
        assert all(x.shape[0] == tc.POSITIONS[2] - tc.POSITIONS[1] for s in final.ranks.values() for x in s.sections if x.kind == "attn_k")
    got = tc.request_bytes(ps, tgt.request)
    assert got == _direct(tmp_path / "direct", 1, 0)
    assert got == tc.expected_bytes(M, 1, 0, rows, states[-1], tc.POSITIONS[-1])


# ----------------------------------------------------------------------------- TP 2 -> TP 2: set links at the same TP size


def test_tp2_set_links_followed_by_each_rank_of_a_tp2_target_end_at_the_final_set(tmp_path):
    """Links written as TP sets at the target's own TP size: each target rank applies its own
    rank file of every set as is (no description needed), and ``follow`` ends at the final
    set (an applied link names the set, not its rank file)."""
    rows, states = tc.rounds()
    _, links = _tp2_migration(tmp_path, rows, states)
    for r in range(2):
        ps = tc.target(2, r)
        tgt = MigrationTarget(req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(2, r))
        applied = list(tgt.follow(tmp_path / "mig", timeout_s=2))
        assert [a.path for a in applied] == links and applied[-1].final
        assert tc.request_bytes(ps, tgt.request) == tc.expected_bytes(M, 2, r, rows, states[-1], tc.POSITIONS[-1])
