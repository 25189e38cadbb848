"""The real-SGLang pool kit (hsnap_testing/pools.py) behaves as documented."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from hsnap_io.sglang_env import SGLangUnavailableError, import_sglang  # noqa: E402

try:
    import_sglang()
except SGLangUnavailableError as exc:  # pragma: no cover - depends on the venv
    pytest.skip(f"SGLang not importable: {exc}", allow_module_level=True)

from hsnap_testing import pools as sp  # noqa: E402

PAGES = (1, 16)
CASES = [(k, p) for k in sp.KINDS for p in PAGES] + [("mha", 64), ("hybrid_linear", 64)]
SIZE = 256


def _build(kind, page, seed=1, **kw):
    return sp.build(kind, size=SIZE if page < 64 else 512, page_size=page, seed=seed, **kw)


def _evict_kw(ps, n=20):
    return {"swa_evict": n} if ps.has_swa else {}


# --------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------


def test_import_sglang_is_idempotent_and_cpu_safe():
    sg = import_sglang()
    assert import_sglang() is sg
    assert os.environ.get("SGLANG_USE_CPU_ENGINE") in (None, "", "0")
    assert sg.memory_pool.MHATokenToKVPool.cpu_copy_carries_mamba is False
    assert sg.memory_pool.HybridLinearKVPool.cpu_copy_carries_mamba is True
    # sglang's own platform is the base one: no triton kernels on this path
    assert torch.__version__.startswith("2.13.0")


_FIRST_POOLS_PROBE = """
import gc, weakref
from hsnap_testing import pools as sp

def first():  # the first caller of import_sglang in this process, holding the pools in its frame
    ps = sp.build("hybrid_linear", size=64)
    return weakref.ref(ps.kv_pool), weakref.ref(ps.token_to_kv_pool_allocator)

refs = first()
gc.collect()
print("kept" if any(r() is not None for r in refs) else "freed")
"""


def test_the_first_pools_built_in_a_process_are_not_kept_by_sglangs_import():
    """SGLang's torch_memory_saver_adapter keeps its import-time ImportError; its traceback's frames chained back to the
    first caller of import_sglang, so that caller's locals (a pool set, a request) lived as long as the process. A fresh
    process (SGLang not yet imported): the first pool set is freed once its last reference goes."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _FIRST_POOLS_PROBE], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "freed"


def test_torchvision_placeholder_raises_on_use():
    from hsnap_io import sglang_env as env

    if not env.torchvision_placeholder_active():
        pytest.skip("a real torchvision is usable here")
    import torchvision.transforms as T

    assert getattr(T, "__hsnap_placeholder__", False)
    with pytest.raises(ImportError, match="torchvision"):
        T.Compose([])
    from transformers.utils.import_utils import is_torchvision_available

    assert is_torchvision_available() is False


# --------------------------------------------------------------------------
# allocation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind,page", CASES)
def test_alloc_request_uses_real_allocators(kind, page):
    ps = _build(kind, page)
    alloc = ps.token_to_kv_pool_allocator
    others = sp.occupy(ps, 2, [5, 37], seed=3)
    avail0 = alloc.full_available_size() if ps.has_swa else alloc.available_size()
    free_rows0 = ps.req_to_token_pool.available_size()

    n = 50
    rec = sp.alloc_request(ps, n, seed=7, **_evict_kw(ps))
    idx = rec.token_indices

    assert idx.dtype == torch.int64 and idx.shape == (n,)
    assert len(set(idx.tolist())) == n and int(idx.min()) >= page  # slot/page 0 is padding
    row = ps.req_to_token_pool.req_to_token[rec.req_pool_idx, :n]
    assert row.tolist() == idx.tolist()
    assert ps.req_to_token_pool.available_size() == free_rows0 - 1
    pages_used = -(-n // page)
    if ps.has_swa:
        assert alloc.full_available_size() == avail0 - pages_used * page
    else:
        assert alloc.available_size() == avail0 - pages_used * page
    if page > 1:
        # whole pages, token i at page_i*page + i%page, first token at a page start
        assert int(idx[0]) % page == 0
        assert (idx % page).tolist() == [i % page for i in range(n)]
    # disjoint from the other requests
    taken = set().union(*(set(o.token_indices.tolist()) for o in others))
    assert taken.isdisjoint(idx.tolist())

    if ps.has_mamba:
        m = rec.mamba_pool_idx
        assert isinstance(m, int) and m >= 1
        assert int(ps.req_to_token_pool.req_index_to_mamba_index_mapping[rec.req_pool_idx]) == m
        assert m not in {o.mamba_pool_idx for o in others}
        assert rec.req.kv.mamba_pool_idx.dim() == 0  # SGLang's 0-d slot index
    else:
        assert rec.mamba_pool_idx is None

    if ps.has_swa:
        mapping = ps.full_to_swa_index_mapping
        assert int(mapping[-1]) == -1
        ev = rec.swa_evicted
        assert ev == 20 // page * page
        assert (mapping[idx[:ev]] == 0).all()
        assert (mapping[idx[ev:]] > 0).all()
        swa_side = alloc.swa_attn_allocator.available_size()
        assert swa_side < alloc.swa_attn_allocator.size


@pytest.mark.parametrize("kind", sp.KINDS)
def test_free_request_returns_everything(kind):
    ps = _build(kind, 1)
    base = sp.pool_state_fingerprint(ps)
    rec = sp.alloc_request(ps, 33, seed=5, **_evict_kw(ps, 10))
    sp.free_request(ps, rec)
    after = sp.pool_state_fingerprint(ps)
    alloc = ps.token_to_kv_pool_allocator
    full_avail = alloc.full_available_size() if ps.has_swa else alloc.available_size()
    assert full_avail == ps.size
    assert ps.req_to_token_pool.available_size() == ps.geom["max_reqs"]
    if ps.has_mamba:
        assert ps.mamba_allocator.available_size() == ps.geom["mamba_size"]
    if ps.has_swa:
        assert alloc.swa_available_size() == ps.geom["size_swa"]
        assert (ps.full_to_swa_index_mapping[:-1] == 0).all()
    # free lists are back to the same sets (order may differ), data was written
    assert after["buffers"] != base["buffers"]


def test_exhaustion_raises_and_leaves_pools_untouched():
    ps = sp.build("hybrid_linear", size=64, page_size=16, seed=0, max_reqs=2, mamba_size=2)
    sp.alloc_request(ps, 40, seed=1)  # 3 pages of 4
    fp = sp.pool_state_fingerprint(ps)
    with pytest.raises(RuntimeError, match="token pool"):
        sp.alloc_request(ps, 17, seed=2)  # needs 2 pages, 1 left
    assert sp.pool_state_fingerprint(ps) == fp
    sp.alloc_request(ps, 16, seed=3)
    fp = sp.pool_state_fingerprint(ps)
    with pytest.raises(RuntimeError, match="exhausted"):
        sp.alloc_request(ps, 1, seed=4)
    assert sp.pool_state_fingerprint(ps) == fp


# --------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sp.KINDS)
def test_fingerprint_sees_every_byte_of_every_buffer(kind):
    ps = _build(kind, 16)
    rec = sp.alloc_request(ps, 20, seed=9, **_evict_kw(ps, 16))
    fp = sp.pool_state_fingerprint(ps)
    sp.request_rows(ps, rec)  # reading changes nothing
    assert sp.pool_state_fingerprint(ps) == fp

    bufs = sp.all_buffers(ps)
    expected = {"req_to_token", "req_generation"}
    if ps.has_mamba:
        expected |= {"req_index_to_mamba_index_mapping", "mamba.conv0", "mamba.temporal"}
    if ps.has_swa:
        expected |= {"full_to_swa_index_mapping"}
    assert expected <= set(bufs)
    assert set(fp["buffers"]) == set(bufs)

    for name, buf in bufs.items():
        raw = buf.view(-1).view(torch.uint8) if buf.is_contiguous() else None
        if raw is None:  # strided views (none expected today): flip via a 1-element slice
            pytest.fail(f"non-contiguous buffer {name}")
        pos = raw.numel() // 2 + 1  # one byte somewhere in the middle
        old = int(raw[pos])
        raw[pos] = old ^ 0x01
        changed = sp.diff_fingerprints(fp, sp.pool_state_fingerprint(ps))
        raw[pos] = old
        assert changed == [f"buffers.{name}"], (name, changed)
    assert sp.pool_state_fingerprint(ps) == fp


@pytest.mark.parametrize("kind", sp.KINDS)
def test_fingerprint_sees_allocator_state(kind):
    ps = _build(kind, 1, seed=None)
    fp = sp.pool_state_fingerprint(ps)
    rec = sp.alloc_request(ps, 4, seed=1)
    fp2 = sp.pool_state_fingerprint(ps)
    changed = set(sp.diff_fingerprints(fp, fp2))
    assert {"req_free_slots", "token_allocator", "buffers.req_to_token", "buffers.req_generation"} <= changed
    if ps.has_mamba:
        assert {"mamba_free_slots", "buffers.req_index_to_mamba_index_mapping"} <= changed
    if ps.has_swa:
        assert "buffers.full_to_swa_index_mapping" in changed
    sp.free_request(ps, rec)
    assert "token_allocator" in sp.diff_fingerprints(fp2, sp.pool_state_fingerprint(ps))


def test_build_is_deterministic():
    a = sp.build("swa_mamba", size=128, page_size=16, seed=4)
    b = sp.build("swa_mamba", size=128, page_size=16, seed=4)
    for ps in (a, b):
        sp.occupy(ps, 3, [7, 30, 16], seed=11, swa_evict=16)
    assert sp.pool_state_fingerprint(a) == sp.pool_state_fingerprint(b)
    c = sp.build("swa_mamba", size=128, page_size=16, seed=5)
    assert sp.pool_state_fingerprint(c)["buffers"] != sp.pool_state_fingerprint(a)["buffers"]


# --------------------------------------------------------------------------
# request_rows
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sp.KINDS)
def test_request_rows_shapes(kind):
    ps = _build(kind, 1)
    g = ps.geom
    n = 12
    rec = sp.alloc_request(ps, n, seed=2, **_evict_kw(ps, 5))
    rows = sp.request_rows(ps, rec)
    store = torch.uint8 if kind == "mha_fp8" else torch.bfloat16
    if kind in ("mha", "mha_fp8"):
        assert set(rows) == {f"{p}.L{i}" for p in "kv" for i in range(g["layer_num"])}
        for t in rows.values():
            assert t.shape == (n, g["head_num"], g["head_dim"]) and t.dtype == store
    elif kind == "mla":
        assert set(rows) == {f"kv.L{i}" for i in range(g["layer_num"])}
        for t in rows.values():
            assert t.shape == (n, 1, g["kv_lora_rank"] + g["qk_rope_head_dim"])
    else:
        for lid in g["full_attention_layer_ids"]:
            assert rows[f"k.L{lid}"].shape == (n, g["head_num"], g["head_dim"])
            assert rows[f"v.L{lid}"].shape == (n, g["head_num"], g["head_dim"])
    if ps.has_swa:
        assert rows["swa_mask"].tolist() == [False] * 5 + [True] * (n - 5)
        for lid in g["swa_attention_layer_ids"]:
            assert rows[f"k.L{lid}"].shape == (n - 5, g["head_num"], g["head_dim"])
    if ps.has_mamba:
        L = len(g["mamba_layer_ids"])
        kd, vd = g["gdn_k_heads"] * g["gdn_k_dim"], g["gdn_v_heads"] * g["gdn_v_dim"]
        assert rows["mamba.conv0"].shape == (L, 2 * kd + vd, g["gdn_conv_kernel"] - 1)
        assert rows["mamba.conv0"].dtype == torch.bfloat16
        assert rows["mamba.temporal"].shape == (L, g["gdn_v_heads"], g["gdn_v_dim"], g["gdn_k_dim"])
        assert rows["mamba.temporal"].dtype == torch.float32
    # rows are copies, not views into the pool
    before = sp.pool_state_fingerprint(ps)
    for t in rows.values():
        t.fill_(0)
    assert sp.pool_state_fingerprint(ps) == before


def test_fp8_rows_are_valid_e4m3fn():
    ps = _build("mha_fp8", 1)
    assert ps.kv_pool.store_dtype == torch.uint8 and ps.kv_pool.dtype == torch.float8_e4m3fn
    rec = sp.alloc_request(ps, 64, seed=3)
    for name, t in sp.request_rows(ps, rec).items():
        assert not ((t & 0x7F) == 0x7F).any(), name
        assert not torch.isnan(t.view(torch.float8_e4m3fn).float()).any()
    k = ps.kv_pool.get_key_buffer(0)
    assert k.dtype == torch.float8_e4m3fn
    assert torch.equal(k[rec.token_indices].view(torch.uint8), sp.request_rows(ps, rec)["k.L0"])


def test_different_seeds_give_different_rows():
    ps = _build("hybrid_linear", 1)
    a = sp.request_rows(ps, sp.alloc_request(ps, 8, seed=1))
    b = sp.request_rows(ps, sp.alloc_request(ps, 8, seed=2))
    for name in a:
        assert not torch.equal(a[name], b[name]), name


# --------------------------------------------------------------------------
# cross-check with SGLang's own retraction copy (get_cpu_copy/load_cpu_copy)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind,page", CASES)
def test_request_rows_match_sglang_cpu_copy_roundtrip(kind, page):
    src = _build(kind, page, seed=1)
    sp.occupy(src, 1, 9, seed=2)
    rec = sp.alloc_request(src, 45, seed=3, **_evict_kw(src, 17))

    dst = _build(kind, page, seed=99)
    sp.occupy(dst, 2, [3, 20], seed=4, **_evict_kw(dst, 0))
    # a fresh request of the same shape in the target (its rows get overwritten)
    new = sp.alloc_request(dst, 45, seed=5, **_evict_kw(dst, 17))

    a_src, a_dst = src.token_to_kv_pool_allocator, dst.token_to_kv_pool_allocator
    m_src = m_dst = None
    if src.has_mamba:
        m_src = torch.tensor([rec.mamba_pool_idx])
        m_dst = torch.tensor([new.mamba_pool_idx])
    # MLA's cpu copy asks the runtime context for the DCP width/rank (unset outside
    # a server: "derived parallel width 'attn_dcp_size' is not available").
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        cpu = a_src.get_cpu_copy(rec.token_indices, mamba_indices=m_src, req_pool_index=rec.req_pool_idx)
        a_dst.load_cpu_copy(cpu, new.token_indices, mamba_indices=m_dst, req_pool_index=new.req_pool_idx)
    if src.has_mamba and not src.kv_pool.cpu_copy_carries_mamba:
        # swa_mamba: the KV pool ignores mamba indices; move the slot separately
        dst.mamba_pool.load_cpu_copy(src.mamba_pool.get_cpu_copy(m_src), m_dst)

    rs, rd = sp.request_rows(src, rec), sp.request_rows(dst, new)
    assert rs.keys() == rd.keys()
    for name in rs:
        assert rs[name].dtype == rd[name].dtype, name
        assert torch.equal(_bytes(rs[name]), _bytes(rd[name])), name


def _bytes(t):
    return t if t.dtype == torch.bool else t.contiguous().view(torch.uint8)


# --------------------------------------------------------------------------
# the pools' view (hsnap_io.adapters.view_pools)
# --------------------------------------------------------------------------


def test_a_view_is_reused_while_the_pools_are_unchanged_and_rebuilt_when_an_attribute_is_rebound():
    from hsnap_io.adapters import UnsupportedPoolError, view_pools

    ps = _build("swa", 1)
    first = view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)
    sp.alloc_request(ps, 8, seed=2, **_evict_kw(ps, 4))  # free lists change with every request: the view does not
    assert view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator) is first
    other = _build("swa", 1)  # other pools: their own view
    assert view_pools(other.req_to_token_pool, other.token_to_kv_pool_allocator).allocator is other.token_to_kv_pool_allocator
    full = ps.kv_pool.full_kv_pool
    full.k_buffer = [b.clone() for b in full.k_buffer]  # a nested pool's buffers replaced: the view follows
    again = view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)
    assert again is not first and all(b.buffer is k for b, k in zip([b for b in again.bindings if b.kind == "attn_k"], full.k_buffer))
    ps.kv_pool.swa_req_ring_size = 64  # a feature hsnap refuses, switched on in the same pools: refused, not a stale view
    with pytest.raises(UnsupportedPoolError, match="swa_req_ring_size"):
        view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)


def test_a_kept_view_does_not_keep_its_pools_alive():
    import gc
    import weakref

    from hsnap_io.adapters import view_pools

    def make():
        ps = _build("hybrid_linear", 1)
        view = view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)
        assert view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator) is view
        return weakref.ref(ps.token_to_kv_pool_allocator), weakref.ref(ps.kv_pool)

    allocator, kv_pool = make()
    gc.collect()
    assert allocator() is None and kv_pool() is None
