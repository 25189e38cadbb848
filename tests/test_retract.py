"""Retraction to disk (hsnap_sglang.retract) beside SGLang's own in-memory retraction.

Two identical pool sets hold the same decoding request. One is retracted by SGLang
(Req.offload_kv_cache -> RetractionBackup, schedule_batch.release_req, later
Req.load_kv_cache into fresh slots), the other by retract_to_disk / load_retracted.
Between retraction and reload other requests take the freed slots. Both paths must
free the same slots, give back the same bytes, and move the Mamba state once.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import io_cases  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_testing import reqs as sr  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_io.sglang_env import import_sglang  # noqa: E402
from hsnap_testing import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ["mha", "mla", "swa_mamba", "hybrid_linear"]


@pytest.fixture(scope="module", autouse=True)
def scheduler_context():
    """release_req reads the scheduler's published config: a scoped one, as SGLang's
    own unit fixtures build it (ServerArgs(model_path="dummy"))."""
    import_sglang()
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 64
    with use_context(create_context(args, role="scheduler")):
        yield


def tree_cache(ps):
    """SGLang's tree cache for these pools, radix disabled (what --disable-radix-cache builds)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    comps = [ComponentType.FULL] + [ComponentType.SWA] * ps.has_swa + [ComponentType.MAMBA] * ps.has_mamba
    params = CacheInitParams(
        disable=True,
        req_to_token_pool=ps.req_to_token_pool,
        token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
        page_size=ps.page_size,
        tree_components=tuple(comps),
        sliding_window_size=8 if ps.has_swa else None,
    )
    return UnifiedRadixCache(params)


def _pool_and_req(kind, seed=21):
    ps = sp.build(kind, size=512)
    sp.occupy(ps, 2, 37, seed=5)
    req, _ = sr.decode_req(ps, sr.random_case(seed))
    return ps, req, tree_cache(ps)


def _allocator_state(ps):
    fp = sp.pool_state_fingerprint(ps)
    return {k: fp[k] for k in ("req_free_slots", "token_allocator", "mamba_free_slots") if k in fp}


def _readmit_like_sglang(ps, req):
    """SGLang's re-admission of a retracted request (PD decode _pre_alloc): a row and a
    Mamba slot from req_to_token_pool.alloc, seqlen-1 token slots; then load_kv_cache."""
    n = req.seqlen - 1
    ps.req_to_token_pool.alloc([req])
    idx = sp.alloc_tokens(ps, n).to(torch.int64)
    ps.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), idx.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    req.is_retracted = False
    req.load_kv_cache(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)


def _rows(ps, req, swa_start):
    """Request rows; SWA layers only for positions >= swa_start (the window the
    snapshot keeps; SGLang's copy also holds the evicted positions' stale rows)."""
    rows = sr.req_rows(ps, req)
    mask = rows.pop("swa_mask", None)
    if mask is not None:
        keep = int(mask.sum()) - (len(mask) - swa_start)  # mapped rows before swa_start
        for k in [k for k in rows if k.split(".")[-1] in _swa_layer_names(ps)]:
            rows[k] = rows[k][keep:]
    return rows


def _swa_layer_names(ps):
    return {f"L{g}" for g in ps.geom.get("swa_attention_layer_ids", ())}


@pytest.mark.parametrize("kind", KINDS)
def test_retract_to_disk_beside_sglang_in_memory_retraction(tmp_path, kind):
    from sglang.srt.managers.schedule_batch import release_req
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from hsnap_sglang.retract import load_retracted, retract_to_disk

    mem_ps, mem_req, mem_tc = _pool_and_req(kind)
    disk_ps, disk_req, disk_tc = _pool_and_req(kind)
    assert sp.pool_state_fingerprint(mem_ps) == sp.pool_state_fingerprint(disk_ps)
    swa_start = mem_req.kv.get_evicted_seqlen(ComponentType.SWA)
    before = _rows(mem_ps, mem_req, swa_start)

    # SGLang's in-memory retraction (backup_kv_cache "cpu_tensor" + release_req)
    mem_req.offload_kv_cache(mem_ps.req_to_token_pool, mem_ps.token_to_kv_pool_allocator)
    backup = mem_req.kv.retraction_backup
    release_req(
        req=mem_req, remaing_req_count=0, req_to_token_pool=mem_ps.req_to_token_pool,
        token_to_kv_pool_allocator=mem_ps.token_to_kv_pool_allocator, tree_cache=mem_tc,
        hisparse_coordinator=None, offload_kv=False,
    )
    # hsnap's retraction to disk
    path = tmp_path / "retracted.hsnap"
    retract_to_disk(path, disk_req, req_to_token_pool=disk_ps.req_to_token_pool, token_to_kv_pool_allocator=disk_ps.token_to_kv_pool_allocator, tree_cache=disk_tc, identity=io_cases.identity())

    # the same slots were released the same way, the request is retracted the same way
    assert _allocator_state(disk_ps) == _allocator_state(mem_ps)
    assert (disk_req.is_retracted, disk_req.retraction_count, disk_req.kv.req_pool_idx, disk_req.kv.mamba_pool_idx) == (True, 1, None, None)
    assert (mem_req.is_retracted, mem_req.retraction_count) == (True, 1)

    # Mamba state moves exactly once on each path
    kv_pool = mem_ps.kv_pool
    if mem_ps.has_mamba:
        assert (backup.mamba_cpu is None) == kv_pool.cpu_copy_carries_mamba
        with hf.open(path) as snap:
            mamba = [s for s in snap if s.kind in ("conv", "temporal")]
            n_layers, n_conv = len(mem_ps.geom["mamba_layer_ids"]), len(mem_ps.mamba_pool.mamba_cache.conv)
            assert sorted({(s.kind, s.layer) for s in mamba}) == sorted((s.kind, s.layer) for s in mamba)  # no duplicates
            assert len(mamba) == n_layers * (n_conv + 1)
            one_slot = sum(buf[:, :1].numel() * buf.element_size() for _, buf in sp.mamba_buffers(mem_ps))
            assert sum(s.length for s in mamba) == one_slot
            assert snap.record().extra["sglang.Req.retraction_count"] == 1

    # memory pressure: other requests take the freed slots and write their own state
    sp.occupy(mem_ps, 1, 30, seed=77)
    sp.occupy(disk_ps, 1, 30, seed=77)

    _readmit_like_sglang(mem_ps, mem_req)
    load_retracted(path, disk_req, req_to_token_pool=disk_ps.req_to_token_pool, token_to_kv_pool_allocator=disk_ps.token_to_kv_pool_allocator, identity=io_cases.identity())
    got_mem, got_disk = _rows(mem_ps, mem_req, swa_start), _rows(disk_ps, disk_req, swa_start)
    assert sorted(got_mem) == sorted(got_disk) == sorted(before)
    for k in before:
        assert torch.equal(got_disk[k], before[k]), k
        assert torch.equal(got_mem[k], before[k]), k
    assert disk_req.kv.kv_committed_len == mem_req.kv.kv_committed_len == disk_req.seqlen - 1
    assert disk_req.kv.mamba_needs_clear is False


def test_load_retracted_refuses_another_request_pools_unchanged(tmp_path):
    from hsnap_sglang.retract import load_retracted, retract_to_disk

    ps, req, tc = _pool_and_req("hybrid_linear")
    path = tmp_path / "r.hsnap"
    retract_to_disk(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, tree_cache=tc, identity=io_cases.identity())
    other, _ = sr.decode_req(sp.build("hybrid_linear", size=512), sr.random_case(22))
    other.is_retracted, other.kv.req_pool_idx = True, None
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(hf.HsnapError) as e:
        load_retracted(path, other, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=io_cases.identity())
    assert e.value.field == "request.rid"
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []


def test_retracted_requests_resume_in_a_fresh_process(tmp_path):
    """A restart between retraction and reload: one fresh process loads every kind."""
    from hsnap_sglang.retract import retract_to_disk

    items, expected = [], {}
    for kind in KINDS:
        ps, req, tc = _pool_and_req(kind)
        rows = io_cases.rows_as_bytes(sr.req_rows(ps, req))
        path = str(tmp_path / f"{kind}.hsnap")
        retract_to_disk(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, tree_cache=tc, identity=io_cases.identity())
        expected[path] = {k: v.tobytes().hex() for k, v in rows.items()}
        items.append({"kind": kind, "page": 1, "path": path})
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"items": items, "out": str(out)}))
    zygote.run([sys.executable, os.path.join(ROOT, "tests", "io_cases.py"), "resume", str(spec)], check=True, timeout=300)
    got = json.loads(out.read_text())
    for path, rows in expected.items():
        assert got[path]["pid"] != os.getpid()
        assert got[path]["rows"] == rows, path
        assert got[path]["view"]["Req.retraction_count"] == 1 and got[path]["view"]["Req.retracted_stain"] is True


def test_a_refused_retraction_writes_nothing_and_frees_nothing(tmp_path):
    from hsnap_sglang.retract import retract_to_disk
    from hsnap_sglang.req.record import UnsupportedRequestError

    ps, req, tc = _pool_and_req("swa_mamba")
    req.custom_logit_processor = '{"callable": "x"}'
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(UnsupportedRequestError) as e:
        retract_to_disk(tmp_path / "r.hsnap", req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, tree_cache=tc, identity=io_cases.identity())
    assert e.value.field == "Req.custom_logit_processor"
    assert os.listdir(tmp_path) == []
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    assert not req.is_retracted and req.kv.req_pool_idx is not None


def test_a_proof_touches_no_pool_and_leaves_the_room_to_the_restore(tmp_path):
    """prove_retracted (what a server runs off its scheduler thread) reads the file and checks it against the request,
    allocating nothing; with capacity=False it proves a file the pools have no room for now (a request admitted
    meanwhile), and restore_retracted refuses it under the pool lock, every allocation as it was, the request still
    retracted; once room is back the same file restores."""
    from hsnap_format import CapacityError
    from hsnap_sglang.retract import prove_retracted, restore_retracted, retract_to_disk

    ps, req, tc = _pool_and_req("hybrid_linear")
    pools = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)
    path = tmp_path / "r.hsnap"
    retract_to_disk(path, req, **pools, tree_cache=tc, identity=io_cases.identity())
    taken = sp.alloc_tokens(ps, ps.token_to_kv_pool_allocator.available_size())  # every token slot in use
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(CapacityError):  # the proof in place counts the room
        prove_retracted(path, req, **pools, identity=io_cases.identity())
    proven = prove_retracted(path, req, **pools, identity=io_cases.identity(), capacity=False)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == [] and req.is_retracted
    with pytest.raises(CapacityError):
        restore_retracted(proven, tree_cache=tc)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    assert req.is_retracted and req.kv.req_pool_idx is None
    ps.token_to_kv_pool_allocator.free(taken)
    restored = restore_retracted(prove_retracted(path, req, **pools, identity=io_cases.identity(), capacity=False), tree_cache=tc)
    assert restored is req and not req.is_retracted and req.kv.req_pool_idx is not None
    assert req.hsnap_restored.bytes_uploaded > 0
