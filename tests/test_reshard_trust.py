"""Re-sharding holds like the plain restore: hostile sets refused before allocating, a
source changed in place between verify and upload, a rank of another model, errors that
name file and field, and the TP-set rules of spec 5.8.

Every hostile set here is written by the project's own writer (``export_request`` per rank
into a ``SetWriter``), so each rank file is self-consistent and signed and the manifest binds
it: the refusals come from the set rules, not from an integrity check. Real SGLang pools
(``hsnap_testing/tp_pools.py``); every refusal is checked against the pools' fingerprint
(``hsnap_testing.pools.pool_state_fingerprint``: free lists, mappings, every buffer byte).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import numpy as np
import pytest
import torch

import hsnap_format as hf
from hsnap_format.records import ShardAxis, Sharding
from hsnap_io import reshard, restore_request
from hsnap_io.adapters import view_pools

import craft
from hsnap_testing import tp_pools as rp
from hsnap_testing import pools as sp

SENTINEL = 0xA5


@pytest.fixture(scope="module")
def states():
    return {name: rp.global_state(m) for name, m in rp.MODELS.items()}


def _restore(path, m, tp, rank, ps=None, identity="target", **kw):
    ps = ps or rp.build(m, tp, rank, seed=77 + rank)
    ident = rp.identity(tp, rank) if identity == "target" else identity
    res = restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=ident, tp_size=tp,
                          rank=rank, sharding=kw.pop("sharding", None) or reshard.describe(m.tp, tp, rank), **kw)
    return ps, res


def _refused(path, m, tp, rank, exc, match, **kw):
    """The restore is refused with ``exc`` (typed), and the target pools are exactly as before."""
    ps = rp.build(m, tp, rank, seed=5)
    before = sp.pool_state_fingerprint(ps.pools)
    with pytest.raises(exc, match=match) as info:
        _restore(path, m, tp, rank, ps=ps, **kw)
    assert isinstance(info.value, hf.HsnapError)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps.pools)) == []
    return info.value


def _sentinel(ps) -> None:
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        b.buffer.view(-1).view(torch.uint8).fill_(SENTINEL)


# ----------------------------------------------------------------------------- hostile sets refused before allocating


def test_swa_rank_without_swa_rows_is_refused_before_allocation(tmp_path, states):
    """Rank 1 says swa_start == state_position (no SWA rows) while rank 0 holds rows: head 1
    of every swa.* row would have come from an uninitialised buffer. Refused typed, naming
    rank 1's file, the field, rank 0's value and rank 1's."""
    m = rp.MODELS["swa"]
    path = rp.export_set(m, 2, states["swa"], tmp_path / "swa", overrides={1: {"swa_start": rp.N_TOKENS}})
    with hf.open_snapshot(path) as s:  # the set itself opens: every file and the manifest are honest
        assert [s.ranks[r].swa_start for r in range(2)] == [0, rp.N_TOKENS]
        assert s.ranks[1].section("swa.0.k").shape[0] == 0
    err = _refused(path, m, 1, 0, reshard.InconsistentSetError, r"rank-1\.hsnap: request\.swa_start: expected 0 .*found 5")
    assert err.path.endswith("rank-1.hsnap") and err.field == "request.swa_start"
    assert "<memory>" not in str(err) and "None" not in str(err)


def test_records_that_disagree_across_ranks_are_refused(tmp_path, states):
    m = rp.MODELS["gqa"]
    other = dataclasses.replace(rp.record(), output_ids=np.array([7, 8, 10], dtype=np.int32))
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "rec", overrides={1: {"record": other}})
    _refused(path, m, 1, 0, reshard.InconsistentSetError, r"rank-1\.hsnap: sections\[request\.output_ids\]")
    budget = dataclasses.replace(rp.record(), max_new_tokens=17)  # a header field of the request
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "req", overrides={1: {"record": budget}})
    _refused(path, m, 4, 3, reshard.InconsistentSetError, r"rank-1\.hsnap: request\.stop\.max_new_tokens: expected 16 .*found 17")


def test_runs_that_do_not_tile_a_target_section_are_refused_before_allocation(sets_qwen35, monkeypatch):
    """The coverage proof stands on its own: a plan that leaves a gap (here: its last run
    dropped) is refused before anything is allocated, whatever produced it."""
    real = reshard.plan
    monkeypatch.setattr(reshard, "plan", lambda *a, **kw: real(*a, **kw)[:-1] or real(*a, **kw))
    m = rp.MODELS["qwen35"]
    _refused(sets_qwen35, m, 1, 0, reshard.ReshardError, r"geometry\.sharding\.\w+.* for sections\[.*expected runs tiling")


def test_bytes_assembled_short_of_a_section_are_refused_and_rolled_back(sets_qwen35, monkeypatch):
    """The second guard: with the tiling proof switched off and a run dropped, the byte count
    of the assembled section disagrees; refused before that section is uploaded, every
    allocation given back (and, exact_rollback, every byte)."""
    real = reshard.plan
    monkeypatch.setattr(reshard, "plan", lambda *a, **kw: real(*a, **kw)[:-1] or real(*a, **kw))
    monkeypatch.setattr(reshard, "_prove_tiling", lambda *a, **kw: None)
    m = rp.MODELS["qwen35"]
    _refused(sets_qwen35, m, 1, 0, reshard.ReshardError, r"bytes assembled from the source ranks", exact_rollback=True)


@pytest.mark.parametrize("name,src,dst", [("swa", 2, 1), ("swa", 1, 2), ("qwen35", 2, 1), ("qwen35", 4, 2),
                                          ("mamba2", 1, 4), ("mamba2", 4, 1), ("mla", 2, 1), ("gqa", 2, 4)])
def test_sentinel_every_uploaded_byte_came_from_a_source_section(tmp_path, states, name, src, dst):
    """Target pools filled with a sentinel byte; after the re-sharded restore every restored
    row is the source bytes it came from (no byte from nowhere), and every other row still
    holds the sentinel (nothing written beside the request's slots)."""
    m, swa_start = rp.MODELS[name], 2 if name == "swa" else 0
    path = rp.export_set(m, src, states[name], tmp_path / f"{name}{src}", swa_start=swa_start)
    for r in range(dst):
        ps = rp.build(m, dst, r)
        _sentinel(ps)
        _, res = _restore(path, m, dst, r, ps=ps)
        rows = rp.restored_rows(ps, res, swa_start)
        for sec, got in rows.items():
            want = rp.shard_of(m, dst, r, sec, states[name][sec])
            want = want[swa_start:] if sec.startswith("swa.") else want
            assert rp.as_bytes(got) == rp.as_bytes(want), (name, src, dst, r, sec)
        for b in view_pools(ps.rtp, ps.alloc).bindings:
            if b.space == "token":
                written = res.token_indices
            elif b.space == "swa":
                written = ps.kv.translate_loc_from_full_to_swa(res.token_indices[swa_start:])
            else:
                written = torch.tensor([res.mamba_pool_idx])
            keep = torch.ones(b.buffer.shape[0], dtype=torch.bool)
            keep[written] = False
            raw = b.buffer[keep].contiguous().view(-1).view(torch.uint8)
            assert bool((raw == SENTINEL).all()), (name, r, b.name, "a byte written outside the request's slots")


# ----------------------------------------------------------------------------- a source changed between verify and upload


@pytest.fixture
def sets_qwen35(tmp_path, states):
    return rp.export_set(rp.MODELS["qwen35"], 2, states["qwen35"], tmp_path / "q2")


def _rewrite_in_place(path, section, rank_file="rank-1.hsnap"):
    """Change a section's bytes in place, same length, and put the mtime back: what an
    in-place writer racing the restore leaves (size and mtime_ns as at open)."""
    f = os.path.join(path, rank_file)
    with hf.Snapshot(f) as s:
        info = s.section(section)
    st = os.stat(f)
    with open(f, "r+b") as fh:
        fh.seek(info.offset)
        data = bytearray(fh.read(info.length))
        for i in range(0, len(data), 7):
            data[i] ^= 0x5A
        fh.seek(info.offset)
        fh.write(data)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def _race_at_lock(monkeypatch, path, section, rank_file="rank-1.hsnap"):
    """Rewrite ``section`` when the restore takes the pool lock: after every check and
    verification, before anything is allocated or uploaded."""
    real = reshard.pool_lock
    done = []

    @contextlib.contextmanager
    def racing(pool):
        if not done:
            _rewrite_in_place(path, section, rank_file)
            done.append(section)
        with real(pool):
            yield

    monkeypatch.setattr(reshard, "pool_lock", racing)
    return done


@pytest.mark.parametrize("section,exact", [("mamba.0.conv.0", False), ("attn.3.v", True), ("mamba.2.temporal", True)])
def test_source_changed_in_place_between_verify_and_upload_is_refused(sets_qwen35, monkeypatch, section, exact):
    """2 -> 1: a section of rank 1 changes after it was verified. What is uploaded is hashed
    again on its way: DigestMismatchError naming the file and section, every allocation
    given back. As on the plain path, the section is hashed as it lands in the slots: with
    exact_rollback the pools are byte-identical; without it only the
    written free slots' bytes may differ — free lists and mappings are exactly as before."""
    done = _race_at_lock(monkeypatch, sets_qwen35, section)
    match = rf"rank-1\.hsnap: sections\['{section}'\]\.digest"
    if exact:
        _refused(sets_qwen35, rp.MODELS["qwen35"], 1, 0, hf.DigestMismatchError, match, exact_rollback=True)
    else:
        m = rp.MODELS["qwen35"]
        ps = rp.build(m, 1, 0, seed=5)
        before = sp.pool_state_fingerprint(ps.pools)
        with pytest.raises(hf.DigestMismatchError, match=match):
            _restore(sets_qwen35, m, 1, 0, ps=ps)
        assert all(d.startswith("buffers.") for d in sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps.pools)))
    assert done == [section]


@pytest.mark.parametrize("verify", [True, "during"])
def test_one_to_two_source_changed_in_place_is_refused(tmp_path, states, monkeypatch, verify):
    """1 -> 2: target rank 1 needs only the second half of rank 0's heads; the change is
    in the half it does not upload, and is still refused (the digest covers the section)."""
    m = rp.MODELS["gqa"]
    path = rp.export_set(m, 1, states["gqa"], tmp_path / "g1")
    _race_at_lock(monkeypatch, path, "attn.1.k", "rank-0.hsnap")
    _refused(path, m, 2, 1, hf.DigestMismatchError, r"rank-0\.hsnap: sections\['attn\.1\.k'\]\.digest", verify=verify,
             exact_rollback=True)


def test_record_changed_after_verify_is_refused(sets_qwen35, monkeypatch):
    """The record returned is the record hashed: a change of rank 0's output ids just before
    the record is read is refused, before anything is allocated."""
    real = hf.Snapshot.record

    def racing(self, *a, **kw):
        if os.path.basename(self.path) == "rank-0.hsnap":
            _rewrite_in_place(os.path.dirname(self.path), "request.output_ids", "rank-0.hsnap")
        return real(self, *a, **kw)

    monkeypatch.setattr(hf.Snapshot, "record", racing)
    _refused(sets_qwen35, rp.MODELS["qwen35"], 1, 0, hf.DigestMismatchError, r"rank-0\.hsnap: sections\['request\.output_ids'\]")


def test_restore_without_a_race_is_unchanged(sets_qwen35, states):
    m = rp.MODELS["qwen35"]
    ps, res = _restore(sets_qwen35, m, 1, 0)
    for sec, got in rp.restored_rows(ps, res).items():
        assert rp.as_bytes(got) == rp.as_bytes(states["qwen35"][sec]), sec


# ----------------------------------------------------------------------------- a rank of another model


@pytest.mark.parametrize("field,other", [("model_id", "other/model"), ("weights_version", "w2")])
def test_rank_of_another_model_or_weights_is_refused(tmp_path, states, field, other):
    m = rp.MODELS["gqa"]
    stranger = dataclasses.replace(rp.identity(2, 1), **{field: other})
    path = rp.export_set(m, 2, states["gqa"], tmp_path / field, overrides={1: {"identity": stranger}})
    # against the target's identity: rank 1 is named, like rank 0 would be
    err = _refused(path, m, 1, 0, hf.IncompatibleSnapshotError, rf"rank-1\.hsnap: .*identity\.{field}: expected .*found '{other}'")
    assert not isinstance(err, reshard.InconsistentSetError)
    # without a target identity: rank 1 still disagrees with rank 0
    _refused(path, m, 1, 0, reshard.InconsistentSetError, rf"rank-1\.hsnap: identity\.{field}: expected .*found '{other}'", identity=None)


# ----------------------------------------------------------------------------- errors name file, field, expected, found


def test_reshard_errors_name_file_field_expected_found(tmp_path, states):
    with pytest.raises(reshard.ReshardError) as info:
        reshard.describe(reshard.TPModel(kv_heads=3), 2, 0)
    text = str(info.value)
    assert text.startswith("sharding description (tp_size 2, rank 0): attention kv heads: ")
    assert "expected a split of 3 KV heads" in text and "found not divisible" in text
    assert "<memory>" not in text and "differ: None" not in text
    # restore time: the rank file, the field, expected and found
    m = rp.MODELS["gqa"]
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "g2")
    other = Sharding(attention=ShardAxis(1, 8, ((0, 4, 1),)))  # another global head count
    err = _refused(path, m, 1, 0, reshard.ReshardError, r"rank-0\.hsnap: geometry\.sharding\.attention: expected axis 1, global 8 .*found axis 1, global 4",
                   sharding=other)
    assert "<memory>" not in str(err) and "None" not in str(err)
    assert str(copy.copy(err)) == str(err)  # __reduce__ rebuilds the same error


# ----------------------------------------------------------------------------- TP-set rules (spec 5.8)


def _with_parts(desc: Sharding, parts) -> Sharding:
    a = desc.attention
    return dataclasses.replace(desc, attention=ShardAxis(a.axis, a.global_size, tuple(parts)))


def test_set_replicas_must_match_the_ranks_holding_each_element(tmp_path, states):
    m = rp.MODELS["gqa"]
    d1 = reshard.describe(m.tp, 2, 1)  # heads 2..3, replicas 1
    liar = {1: {"sharding": _with_parts(d1, [(2, 2, 2)])}}  # says 2 ranks hold heads 2..3: only it does
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "rep", overrides=liar)
    _refused(path, m, 1, 0, reshard.InconsistentSetError,
             r"rank-1\.hsnap: geometry\.sharding\.attention\.parts\[0\]\.replicas: expected 1 \(the ranks holding global elements 2\.\.3\), found 2")
    too_many = {1: {"sharding": _with_parts(d1, [(2, 2, 3)])}}
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "big", overrides=too_many)
    _refused(path, m, 1, 0, reshard.InconsistentSetError, r"rank-1\.hsnap: .*parts\[0\]\.replicas: expected at most tp_size 2, found 3")


def test_set_must_hold_every_global_element(tmp_path, states):
    """Global 5 heads, ranks hold 0..1 and 2..3: head 4 is nobody's. The target needs only
    heads 0..3 and still is refused: the set breaks the rule."""
    m = rp.MODELS["gqa"]
    five = {r: {"sharding": Sharding(attention=ShardAxis(1, 5, ((2 * r, 2, 1),)))} for r in range(2)}
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "gap", overrides=five)
    target = Sharding(attention=ShardAxis(1, 5, ((0, 4, 1),)))
    _refused(path, m, 1, 0, reshard.InconsistentSetError, r"gap: geometry\.sharding\.attention: .*found elements 4\.\.4 held by none",
             sharding=target)


def test_target_replicas_at_most_its_tp_size(tmp_path, states):
    m = rp.MODELS["gqa"]
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "t")
    target = Sharding(attention=ShardAxis(1, 4, ((0, 4, 2),)))
    _refused(path, m, 1, 0, reshard.ReshardError, r"parts\[0\]\.replicas \(target\): expected at most tp_size 1, found 2", sharding=target)


def test_four_entry_part_is_refused_typed_at_open(tmp_path, states):
    """Spec 5.7: a part is exactly ``[offset, length, replicas]``; a fourth entry is a
    MalformedHeaderError naming the part (the file is re-signed: only the rule refuses it)."""
    m = rp.MODELS["gqa"]
    path = rp.export_set(m, 2, states["gqa"], tmp_path / "four")
    f = os.path.join(path, "rank-1.hsnap")
    data = open(f, "rb").read()

    def four(h):
        h["geometry"]["sharding"]["attention"]["parts"][0].append(0)

    bad = craft.resign(craft.mutate_header(data, four))
    craft.write(f, bad)
    mpath = os.path.join(path, "manifest.json")
    craft.write(mpath, craft.manifest_for(open(mpath, "rb").read(), 1, bad))
    _refused(path, m, 1, 0, hf.MalformedHeaderError, r"rank-1\.hsnap: geometry\.sharding\.attention\.parts\[0\]: expected \[offset")


def test_agreeing_set_with_replicas_restores(tmp_path, states):
    """The rules accept what SGLang's own split writes: MLA (every rank holds the latent),
    Mamba2 n_groups 1 (B and C on every rank), GQA with fewer heads than ranks."""
    for name in ("mla", "mamba2", "qwen35"):
        m = rp.MODELS[name]
        path = rp.export_set(m, 4, states[name], tmp_path / name)
        ps, res = _restore(path, m, 1, 0)
        for sec, got in rp.restored_rows(ps, res).items():
            assert rp.as_bytes(got) == rp.as_bytes(states[name][sec]), (name, sec)
