"""Real SGLang 0.5.23 memory pools on device='cpu', for tests and benchmarks.

Plain functions, no pytest fixtures: ``build`` a pool set with SGLang's OWN
classes, ``alloc_request`` one request into it (real allocators, seeded random
state), ``occupy`` it with other requests, ``pool_state_fingerprint`` every
allocator free list + every pool byte, and read back ``request_rows``.

Constructor calls used (device="cpu", enable_memory_saver=False everywhere):

  req rows   ReqToTokenPool(size=max_reqs, max_context_len=L, device, enable_memory_saver=False)
             HybridReqToTokenPool(size=max_reqs, mamba_size=M, mamba_spec_state_size=M,
                 max_context_len=L, device, enable_memory_saver=False,
                 cache_params=Mamba2CacheParams(shape=Mamba2StateShape.create(...),
                     layers=mamba_ids, dtype=Mamba2StateDType(conv=bf16, temporal=fp32)),
                 mamba_layer_ids=mamba_ids, enable_mamba_extra_buffer=False)
                 -> .mamba_pool (MambaPool), .mamba_allocator (MambaSlotAllocator)
  "mha"      MHATokenToKVPool(size, page_size, dtype, head_num, head_dim, layer_num, device,
                 enable_memory_saver=False, enable_alt_stream=False)
  "mha_fp8"  same with dtype=torch.float8_e4m3fn (buffers are stored as uint8)
  "mha_fp8_native"  "mha_fp8" with native float8_e4m3fn storage: SGLang 0.5.23's
             KVCache.__init__ stores every fp8 dtype as uint8, but pools that keep fp8
             natively exist (MHATokenToKVPoolMXFP8's main buffers; a CPU fp8 pool that
             keeps float8 storage). Built from the same SGLang pool: store_dtype set to
             the fp8 dtype and every k/v buffer viewed in place as it (same memory, same
             bytes). torch has no CPU index_copy_ for float8: the case hsnap must survive.
  "mla"      MLATokenToKVPool(size, page_size, dtype, kv_lora_rank, qk_rope_head_dim,
                 layer_num, device, enable_memory_saver=False)
  "swa"      SWAKVPool(size, size_swa, page_size, dtype, head_num, head_dim,
                 swa_attention_layer_ids, full_attention_layer_ids, device,
                 enable_alt_stream=False)                       (kwargs reach both MHA sub-pools)
             + allocator.swa.SWATokenToKVPoolAllocator(size, size_swa, page_size, dtype,
                 device, kvcache, need_sort, req_to_token_pool=None)
  "hybrid_linear"  HybridLinearKVPool(size, dtype, page_size, head_num, head_dim,
                 full_attention_layer_ids, device, mamba_pool=req_pool.mamba_pool)
  "swa_mamba" SWAKVPool (as "swa") beside a HybridReqToTokenPool (as above);
             SWATokenToKVPoolAllocator(..., req_to_token_pool=hybrid_req_pool)
  allocators  page 1: TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort)
             page>1: PagedTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, need_sort)

Pitfalls met (sglang 0.5.23):
  * HybridReqToTokenPool.alloc([req]) sets req.kv.mamba_pool_idx to a 0-d LongTensor
    (mid[0]); ``conv[:, idx0d]`` drops the slot axis -> always index with a 1-D tensor.
    The same slot is also recorded in req_index_to_mamba_index_mapping[row] (int32).
  * ReqToTokenPool.alloc_rows pops from the TAIL of free_slots (first row = size) and
    bumps req_generation[row]; row 0 is padding.  Mamba and token free lists pop from
    the HEAD (first slot = 1; slot/page 0 is padding).
  * Paged allocators hand out whole pages, pages 1..size//page_size; ``alloc(n)`` needs
    n % page_size == 0, so requests are allocated like a prefill with
    ``alloc_extend(prefix_lens=[0], seq_lens=[n], last_loc=[-1])``: ceil(n/page) pages,
    token i at page_i*page + i%page, tail of the last page unused.  Keep size a
    multiple of page_size (KV rows = size + page_size, page 0 is padding).
  * SWA: full and SWA token slots come from two independent allocators; the
    allocator owns ``full_to_swa_index_mapping`` (int64 [size+page+1], 0 = unmapped,
    trailing -1 so last_loc=-1 maps to -1) and registers it on the SWAKVPool.
    SWA layers are indexed by mapping[full_idx]; after window eviction
    (free_swa_segment) the leading tokens map to 0 and have NO SWA row.
  * fp8 KV: KVCache.store_dtype is torch.uint8 for float8 dtypes; k_buffer/v_buffer hold
    uint8, get_key_buffer() views them back as fp8.  Random fill avoids the e4m3fn NaN
    bytes 0x7F/0xFF.
  * MHA with equal K/V shapes allocates one [2, ceil_align(rows, page), H, D] tensor per
    layer: k_buffer[l] = buf[0, :rows], v_buffer[l] = buf[1, :rows] (views).
  * Buffer attribute names: MHA k_buffer/v_buffer (lists per layer, index = layer -
    start_layer); MLA kv_buffer; SWAKVPool .full_kv_pool/.swa_kv_pool (+ layers_mapping
    {global: (idx, is_swa)}); HybridLinearKVPool .full_kv_pool (dense over full layers,
    full_attention_layer_id_mapping {global: dense}); MambaPool .mamba_cache.conv (list)
    / .mamba_cache.temporal, each [n_mamba_layers, mamba_size+1, ...].
  * KV writes go straight into the buffers (buffer[l][idx] = ...): set_kv_buffer on CPU
    lazily imports model_executor.runner (slow, extra deps).
"""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from hsnap_io.sglang_env import import_sglang

KINDS = ("mha", "mla", "swa", "hybrid_linear", "swa_mamba", "mha_fp8")
# Built on request only (not iterated by the pool-fixture tests): see "mha_fp8_native".
EXTRA_KINDS = ("mha_fp8_native",)

DEVICE = "cpu"

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)

# Default geometry per kind (small: a few layers, few heads, head_dim 8-32).
_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "mha": dict(layer_num=3, head_num=2, head_dim=16, dtype=torch.bfloat16),
    "mha_fp8": dict(layer_num=3, head_num=2, head_dim=16, dtype=torch.float8_e4m3fn),
    "mha_fp8_native": dict(layer_num=3, head_num=2, head_dim=16, dtype=torch.float8_e4m3fn),
    "mla": dict(layer_num=2, kv_lora_rank=32, qk_rope_head_dim=8, dtype=torch.bfloat16),
    "swa": dict(
        head_num=2,
        head_dim=16,
        dtype=torch.bfloat16,
        full_attention_layer_ids=[1, 3],
        swa_attention_layer_ids=[0, 2],
        size_swa=None,  # default: == size
    ),
    "hybrid_linear": dict(
        head_num=2,
        head_dim=16,
        dtype=torch.bfloat16,
        full_attention_layer_ids=[1, 3],
        mamba_layer_ids=[0, 2],
    ),
    "swa_mamba": dict(
        head_num=2,
        head_dim=16,
        dtype=torch.bfloat16,
        full_attention_layer_ids=[2],
        swa_attention_layer_ids=[0],
        mamba_layer_ids=[1, 3],
        size_swa=None,
    ),
}
# Shared by every kind: request rows, GDN (Qwen3-Next style) mamba geometry.
_COMMON: Dict[str, Any] = dict(
    max_reqs=8,
    max_context_len=None,  # default: == size
    need_sort=False,
    mamba_size=None,  # default: == max_reqs
    # GDN: k_heads/k_dim feed the q/k conv groups, v_heads/v_dim the values.
    gdn_k_heads=2,
    gdn_v_heads=4,
    gdn_k_dim=8,
    gdn_v_dim=8,
    gdn_conv_kernel=4,
    mamba_conv_dtype=torch.bfloat16,
    mamba_temporal_dtype=torch.float32,
)


@dataclasses.dataclass
class PoolSet:
    """One configuration of real SGLang pools (what a scheduler would hold)."""

    kind: str
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    kv_pool: Any  # == token_to_kv_pool_allocator.get_kvcache()
    page_size: int
    size: int
    geom: Dict[str, Any]
    device: str = DEVICE

    @property
    def mamba_pool(self):
        return getattr(self.req_to_token_pool, "mamba_pool", None)

    @property
    def mamba_allocator(self):
        return getattr(self.req_to_token_pool, "mamba_allocator", None)

    @property
    def has_mamba(self) -> bool:
        return self.mamba_pool is not None

    @property
    def has_swa(self) -> bool:
        return self.kind in ("swa", "swa_mamba")

    @property
    def full_to_swa_index_mapping(self) -> Optional[torch.Tensor]:
        return getattr(self.kv_pool, "full_to_swa_index_mapping", None)


@dataclasses.dataclass
class RequestRecord:
    """One request allocated by ``alloc_request``."""

    req_pool_idx: int
    token_indices: torch.Tensor  # int64 [n_tokens], full-pool token slots in token order
    mamba_pool_idx: Optional[int]
    n_tokens: int
    seed: int
    swa_evicted: int = 0  # leading tokens whose SWA slot was freed (window eviction)
    req: Any = None  # SimpleNamespace(kv=ReqKvInfo()) as SGLang's pools saw it


# ---------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------


def geometry(kind: str, size: int, overrides: Dict[str, Any]) -> Dict[str, Any]:
    if kind not in _DEFAULTS:
        raise ValueError(f"unknown pool kind {kind!r}; expected one of {KINDS + EXTRA_KINDS}")
    g = {**_COMMON, **_DEFAULTS[kind]}
    unknown = set(overrides) - set(g)
    if unknown:
        raise TypeError(f"unknown geometry for {kind!r}: {sorted(unknown)}")
    g.update(overrides)
    if g["max_context_len"] is None:
        g["max_context_len"] = size
    if g["mamba_size"] is None:
        g["mamba_size"] = g["max_reqs"]
    if "size_swa" in g and g["size_swa"] is None:
        g["size_swa"] = size
    return g


def cache_params(sg, g, mamba_layer_ids):
    mu = sg.mamba_utils
    kh, vh, kd, vd = g["gdn_k_heads"], g["gdn_v_heads"], g["gdn_k_dim"], g["gdn_v_dim"]
    shape = mu.Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=vh * vd,
        n_groups=kh,
        num_heads=vh,
        head_dim=vd,
        state_size=kd,
        conv_kernel=g["gdn_conv_kernel"],
        conv_shard_groups=[kh * kd, kh * kd, vh * vd],
    )
    return mu.Mamba2CacheParams(
        shape=shape,
        layers=list(mamba_layer_ids),
        dtype=mu.Mamba2StateDType(conv=g["mamba_conv_dtype"], temporal=g["mamba_temporal_dtype"]),
    )


def _hybrid_req_pool(sg, g, params):
    m = g["mamba_size"]
    return sg.memory_pool.HybridReqToTokenPool(
        size=g["max_reqs"],
        mamba_size=m,
        mamba_spec_state_size=m,
        max_context_len=g["max_context_len"],
        device=DEVICE,
        enable_memory_saver=False,
        cache_params=params or cache_params(sg, g, g["mamba_layer_ids"]),
        mamba_layer_ids=list(g["mamba_layer_ids"]),
        enable_mamba_extra_buffer=False,
    )


def _token_allocator(sg, size, page_size, dtype, kvcache, need_sort):
    if page_size == 1:
        return sg.allocator.TokenToKVPoolAllocator(size, dtype, DEVICE, kvcache, need_sort)
    return sg.allocator.PagedTokenToKVPoolAllocator(size, page_size, dtype, DEVICE, kvcache, need_sort)


def build(kind: str, *, size: int, page_size: int = 1, seed: Optional[int] = 0, mamba_params=None, **geom) -> PoolSet:
    """Build pools of ``kind`` with SGLang's own classes on device='cpu'.

    ``size`` is the token capacity (of the full-attention side); it must be a
    multiple of ``page_size``.  Every pool byte (KV, mamba state; not the index
    tables) is filled with seeded noise unless ``seed`` is None (then zeros), so
    that a restore cannot pass by accident on an all-zero pool.
    Geometry keywords override the defaults in ``_DEFAULTS``/``_COMMON``;
    ``mamba_params`` (SGLang ``Mamba2CacheParams``) replaces the single-rank GDN
    state the geometry describes (a TP rank's shard, a Mamba2 model).
    """
    sg = import_sglang()
    if page_size < 1 or size % page_size:
        raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
    g = geometry(kind, size, geom)
    mp = sg.memory_pool
    dtype = g["dtype"]

    if kind in ("hybrid_linear", "swa_mamba"):
        req_pool = _hybrid_req_pool(sg, g, mamba_params)
    else:
        req_pool = mp.ReqToTokenPool(
            size=g["max_reqs"], max_context_len=g["max_context_len"], device=DEVICE, enable_memory_saver=False
        )

    if kind in ("mha", "mha_fp8", "mha_fp8_native"):
        kv = mp.MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            head_num=g["head_num"],
            head_dim=g["head_dim"],
            layer_num=g["layer_num"],
            device=DEVICE,
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        if kind == "mha_fp8_native":
            _store_natively(kv)
        alloc = _token_allocator(sg, size, page_size, dtype, kv, g["need_sort"])
    elif kind == "mla":
        kv = mp.MLATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            kv_lora_rank=g["kv_lora_rank"],
            qk_rope_head_dim=g["qk_rope_head_dim"],
            layer_num=g["layer_num"],
            device=DEVICE,
            enable_memory_saver=False,
        )
        alloc = _token_allocator(sg, size, page_size, dtype, kv, g["need_sort"])
    elif kind in ("swa", "swa_mamba"):
        size_swa = g["size_swa"]
        if size_swa % page_size:
            raise ValueError(f"size_swa ({size_swa}) must be a multiple of page_size ({page_size})")
        kv = sg.swa_memory_pool.SWAKVPool(
            size=size,
            size_swa=size_swa,
            page_size=page_size,
            dtype=dtype,
            head_num=g["head_num"],
            head_dim=g["head_dim"],
            swa_attention_layer_ids=list(g["swa_attention_layer_ids"]),
            full_attention_layer_ids=list(g["full_attention_layer_ids"]),
            device=DEVICE,
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        alloc = sg.allocator_swa.SWATokenToKVPoolAllocator(
            size,
            size_swa,
            page_size,
            dtype,
            DEVICE,
            kv,
            g["need_sort"],
            req_to_token_pool=req_pool if kind == "swa_mamba" else None,
        )
    elif kind == "hybrid_linear":
        kv = mp.HybridLinearKVPool(
            size=size,
            dtype=dtype,
            page_size=page_size,
            head_num=g["head_num"],
            head_dim=g["head_dim"],
            full_attention_layer_ids=list(g["full_attention_layer_ids"]),
            device=DEVICE,
            mamba_pool=req_pool.mamba_pool,
            enable_memory_saver=False,
        )
        alloc = _token_allocator(sg, size, page_size, dtype, kv, g["need_sort"])
    else:  # pragma: no cover - geometry already rejected it
        raise AssertionError(kind)

    assert alloc.get_kvcache() is kv
    ps = PoolSet(
        kind=kind,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=alloc,
        kv_pool=alloc.get_kvcache(),
        page_size=page_size,
        size=size,
        geom=g,
    )
    if seed is not None:
        gen = torch.Generator().manual_seed(_mix(seed, 0xB0117))
        for _, buf in _state_buffers(ps):
            _fill_random(buf, gen)
    return ps


def _store_natively(kv) -> None:
    """View an fp8 MHA pool's uint8 buffers in place as its fp8 dtype (see "mha_fp8_native")."""
    assert kv.store_dtype == torch.uint8 and kv.dtype in _FP8_DTYPES, (kv.store_dtype, kv.dtype)
    kv.store_dtype = kv.dtype
    kv.k_buffer = [b.view(kv.dtype) for b in kv.k_buffer]
    kv.v_buffer = [b.view(kv.dtype) for b in kv.v_buffer]


def fragment(ps: PoolSet, *, stride: int = 2) -> torch.Tensor:
    """Make the free token list fragmented, as on a live server: allocate every free
    token slot (whole pages, both sides of an SWA pool), then give back every
    ``stride``-th page. A request allocated afterwards gets slots that are no run, so
    restores take the scatter (index_copy_) path. Returns the slots kept allocated.
    The freed slots keep their (seeded random) bytes."""
    alloc = ps.token_to_kv_pool_allocator
    n = alloc.available_size()  # SWA: min of the full and SWA sides
    n -= n % ps.page_size
    if n < 2 * ps.page_size:
        raise RuntimeError(f"too few free slots to fragment: {n}")
    idx = alloc_tokens(ps, n).to(torch.int64).view(-1, ps.page_size)
    keep = torch.ones(len(idx), dtype=torch.bool)
    keep[::stride] = False
    alloc.free(idx[~keep].reshape(-1))
    return idx[keep].reshape(-1)


# ---------------------------------------------------------------------------
# buffers (name -> tensor) per kind
# ---------------------------------------------------------------------------


def _mha_layers(pool, global_ids: Sequence[int], prefix: str = ""):
    """(name, k, v) per layer of an MHA(-like) pool, raw store-dtype buffers."""
    for local, gid in enumerate(global_ids):
        yield f"{prefix}L{gid}", pool.k_buffer[local], pool.v_buffer[local]


def _kv_layer_buffers(ps: PoolSet):
    """List of (layer_name, side, [(part, buffer)]) for every attention layer.

    side is "full" (indexed by full token slots) or "swa" (indexed by
    full_to_swa_index_mapping[full slot]).
    """
    kv, g, out = ps.kv_pool, ps.geom, []
    if ps.kind in ("mha", "mha_fp8", "mha_fp8_native"):
        for name, k, v in _mha_layers(kv, range(kv.start_layer, kv.start_layer + kv.layer_num)):
            out.append((name, "full", [("k", k), ("v", v)]))
    elif ps.kind == "mla":
        for local in range(kv.layer_num):
            out.append((f"L{kv.start_layer + local}", "full", [("kv", kv.kv_buffer[local])]))
    elif ps.kind in ("swa", "swa_mamba"):
        for name, k, v in _mha_layers(kv.full_kv_pool, g["full_attention_layer_ids"]):
            out.append((name, "full", [("k", k), ("v", v)]))
        for name, k, v in _mha_layers(kv.swa_kv_pool, g["swa_attention_layer_ids"]):
            out.append((name, "swa", [("k", k), ("v", v)]))
    elif ps.kind == "hybrid_linear":
        ids = sorted(kv.full_attention_layer_id_mapping, key=kv.full_attention_layer_id_mapping.get)
        for name, k, v in _mha_layers(kv.full_kv_pool, ids):
            out.append((name, "full", [("k", k), ("v", v)]))
    out.sort(key=lambda t: int(t[0][1:]))
    return out


def mamba_buffers(ps: PoolSet):
    mp = ps.mamba_pool
    if mp is None:
        return []
    cache = mp.mamba_cache
    bufs = [(f"mamba.conv{i}", c) for i, c in enumerate(cache.conv)]
    bufs.append(("mamba.temporal", cache.temporal))
    return bufs


def _state_buffers(ps: PoolSet):
    """Every state byte: (name, tensor) for all KV buffers and mamba conv/temporal."""
    out = []
    for lname, side, parts in _kv_layer_buffers(ps):
        for part, buf in parts:
            out.append((f"{side}.{part}.{lname}", buf))
    out.extend(mamba_buffers(ps))
    return out


def _index_buffers(ps: PoolSet):
    rp = ps.req_to_token_pool
    out = [("req_to_token", rp.req_to_token), ("req_generation", rp.req_generation)]
    if hasattr(rp, "req_index_to_mamba_index_mapping"):
        out.append(("req_index_to_mamba_index_mapping", rp.req_index_to_mamba_index_mapping))
    if hasattr(rp, "req_index_to_mamba_ping_pong_track_buffer_mapping"):
        out.append(("req_index_to_mamba_ping_pong_track_buffer_mapping", rp.req_index_to_mamba_ping_pong_track_buffer_mapping))
    m = ps.full_to_swa_index_mapping
    if m is not None:
        out.append(("full_to_swa_index_mapping", m))
    return out


def all_buffers(ps: PoolSet) -> Dict[str, torch.Tensor]:
    """name -> live tensor for every pool buffer (state + index tables)."""
    return dict(_state_buffers(ps) + _index_buffers(ps))


# ---------------------------------------------------------------------------
# random data
# ---------------------------------------------------------------------------


def _mix(*parts: int) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def random_like(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8 or dtype in _FP8_DTYPES:
        # fp8 (stored as uint8 or natively): random bytes, minus the e4m3fn NaN encodings (0x7F, 0xFF).
        t = torch.randint(0, 256, shape, generator=gen, dtype=torch.int16)
        t = torch.where((t & 0x7F) == 0x7F, t - 1, t)
        return t.to(torch.uint8).view(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), shape, generator=gen, dtype=dtype)


def _fill_random(buf: torch.Tensor, gen: torch.Generator) -> None:
    buf.copy_(random_like(tuple(buf.shape), buf.dtype, gen))


# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------


def _new_req(sg):
    return SimpleNamespace(kv=sg.schedule_batch.ReqKvInfo())


def alloc_tokens(ps: PoolSet, n: int) -> Optional[torch.Tensor]:
    alloc = ps.token_to_kv_pool_allocator
    if ps.page_size == 1:
        return alloc.alloc(n)
    # Paged: a prefill of n tokens, no prefix -> ceil(n/page) whole pages.
    z = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([n], dtype=torch.int64)
    last = torch.tensor([-1], dtype=torch.int64)
    return alloc.alloc_extend(z, z.clone(), seq, seq.clone(), last, n)


def alloc_request(
    ps: PoolSet,
    n_tokens: int,
    *,
    seed: int,
    swa_evict: int = 0,
) -> RequestRecord:
    """Allocate one request through SGLang's allocators and fill its state.

    * a req_to_token row (``ReqToTokenPool.alloc`` / ``HybridReqToTokenPool.alloc`` on a
      ``SimpleNamespace(kv=ReqKvInfo())``; the hybrid pool also takes a mamba slot),
    * ``n_tokens`` token slots (page 1: ``alloc(n)``; paged: ``alloc_extend`` as a
      prefill), written into req_to_token[row, :n],
    * seeded random KV rows for every layer (K and V / MLA kv / SWA parts) and the
      mamba slot (every conv tensor + temporal).
    ``swa_evict`` (SWA kinds): free the SWA slots of the first ``swa_evict`` tokens
    (rounded down to whole pages) with ``free_swa_segment``, as sliding-window
    eviction does, leaving them unmapped (0) in full_to_swa_index_mapping.
    Raises RuntimeError when the pools are exhausted (checked before anything is
    allocated, so the pools are left untouched).
    """
    sg = import_sglang()
    if not 0 <= n_tokens <= ps.req_to_token_pool.max_context_len:
        raise ValueError(f"n_tokens={n_tokens} outside 0..max_context_len")
    rp = ps.req_to_token_pool
    # Check capacity first: a failed alloc would still have bumped req_generation.
    if rp.available_size() < 1:
        raise RuntimeError("req_to_token pool exhausted")
    if ps.has_mamba and rp.mamba_allocator.available_size() < 1:
        raise RuntimeError("mamba pool exhausted")
    need = -(-n_tokens // ps.page_size) * ps.page_size
    if ps.token_to_kv_pool_allocator.available_size() < need:
        raise RuntimeError(f"token pool exhausted allocating {n_tokens} tokens")
    req = _new_req(sg)
    rows = rp.alloc([req])
    if rows is None:
        raise RuntimeError("req_to_token pool exhausted")
    row = int(rows[0])
    # n_tokens 0: a request with a row (and mamba slot) but no committed position yet
    idx = alloc_tokens(ps, n_tokens) if n_tokens else torch.empty(0, dtype=torch.int64)
    if idx is None:
        _free_req_row(ps, req)
        raise RuntimeError(f"token pool exhausted allocating {n_tokens} tokens")
    idx = idx.to(torch.int64)
    rp.write((row, slice(0, n_tokens)), idx.to(torch.int32))
    req.kv.kv_allocated_len = n_tokens
    req.kv.kv_committed_len = n_tokens

    evicted = 0
    if swa_evict:
        if not ps.has_swa:
            raise ValueError("swa_evict needs an SWA pool kind")
        evicted = min(swa_evict, n_tokens) // ps.page_size * ps.page_size
        if evicted:
            ps.token_to_kv_pool_allocator.free_swa_segment(idx[:evicted], start_pos=0)
            req.kv.swa_evict_floor = evicted

    mamba_idx = None
    if ps.has_mamba:
        # 0-d LongTensor from MambaSlotAllocator.alloc(1)[0]
        mamba_idx = int(req.kv.mamba_pool_idx)
        assert int(rp.req_index_to_mamba_index_mapping[row]) == mamba_idx

    rec = RequestRecord(
        req_pool_idx=row,
        token_indices=idx,
        mamba_pool_idx=mamba_idx,
        n_tokens=n_tokens,
        seed=seed,
        swa_evicted=evicted,
        req=req,
    )
    fill_request(ps, rec)
    if ps.has_mamba:
        req.kv.mamba_needs_clear = False  # "the forward pass" has written the slot
    return rec


def fill_request(ps: PoolSet, rec: RequestRecord) -> None:
    gen = torch.Generator().manual_seed(_mix(rec.seed, 0x5EED))
    full_idx = rec.token_indices
    swa_idx = None
    if ps.has_swa:
        swa_idx = ps.full_to_swa_index_mapping[full_idx]
        swa_idx = swa_idx[swa_idx > 0]
    for _lname, side, parts in _kv_layer_buffers(ps):
        where = full_idx if side == "full" else swa_idx
        for _part, buf in parts:
            buf[where] = random_like((len(where), *buf.shape[1:]), buf.dtype, gen)
    if rec.mamba_pool_idx is not None:
        slot = torch.tensor([rec.mamba_pool_idx], dtype=torch.int64)
        for _name, buf in mamba_buffers(ps):
            buf[:, slot] = random_like((buf.shape[0], 1, *buf.shape[2:]), buf.dtype, gen)


def occupy(
    ps: PoolSet,
    n_requests: int,
    n_tokens: Union[int, Sequence[int]],
    seed: int,
    **kw,
) -> List[RequestRecord]:
    """Put ``n_requests`` OTHER requests into the pools (seeds derived from ``seed``)."""
    lens = [n_tokens] * n_requests if isinstance(n_tokens, int) else list(n_tokens)
    if len(lens) != n_requests:
        raise ValueError("len(n_tokens) != n_requests")
    return [alloc_request(ps, n, seed=_mix(seed, i), **kw) for i, n in enumerate(lens)]


def _free_req_row(ps: PoolSet, req) -> None:
    rp = ps.req_to_token_pool
    if ps.has_mamba and req.kv.mamba_pool_idx is not None:
        rp.free_mamba_cache(req)
    rp.free(req)


def free_request(ps: PoolSet, rec: RequestRecord) -> None:
    """Release a request allocated by ``alloc_request`` through SGLang's APIs."""
    alloc = ps.token_to_kv_pool_allocator
    idx = rec.token_indices
    if ps.has_swa and rec.swa_evicted:
        # evicted prefix has no SWA peer any more: free_full only
        alloc.free_full(idx[: rec.swa_evicted])
        alloc.free(idx[rec.swa_evicted :])
    else:
        alloc.free(idx)
    _free_req_row(ps, rec.req)


# ---------------------------------------------------------------------------
# fingerprint / request rows
# ---------------------------------------------------------------------------


def as_list(t) -> list:
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return [int(x) for x in t.reshape(-1).tolist()]
    return [int(x) for x in t]


def _token_allocator_state(a) -> Dict[str, Any]:
    st: Dict[str, Any] = {"type": type(a).__name__}
    if hasattr(a, "full_attn_allocator"):  # SWATokenToKVPoolAllocator
        st["full"] = _token_allocator_state(a.full_attn_allocator)
        st["swa"] = _token_allocator_state(a.swa_attn_allocator)
        return st
    st["free_pages"] = as_list(a.free_pages)
    st["release_pages"] = as_list(getattr(a, "release_pages", None))
    staged = getattr(a, "staged_pages", None)
    if staged is not None:
        st["staged_pages"] = [as_list(s) for s in staged]
        st["num_staged_pages"] = int(a.num_staged_pages)
    st["available_size"] = int(a.available_size())
    return st


def _digest(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # (a GPU run's pools: bench/gpu_check.py)
    h.update(b.numpy().tobytes())
    return h.hexdigest()


def pool_state_fingerprint(ps: PoolSet) -> Dict[str, Any]:
    """Every allocator free list and a digest of every pool buffer byte.

    Two fingerprints are equal iff (up to blake2b) nothing observable changed:
    req rows (free_slots order, req_generation), token/page allocator(s) incl. the
    SWA side, the mamba slot allocator, every KV buffer, mamba conv/temporal,
    req_to_token, req_index_to_mamba_index_mapping, full_to_swa_index_mapping.
    """
    rp = ps.req_to_token_pool
    fp: Dict[str, Any] = {
        "kind": ps.kind,
        "req_free_slots": list(rp.free_slots),
        "token_allocator": _token_allocator_state(ps.token_to_kv_pool_allocator),
    }
    if ps.has_mamba:
        ma = rp.mamba_allocator
        fp["mamba_free_slots"] = as_list(ma.free_slots)
        fp["mamba_alloc_group_open"] = ma._alloc_iter is not None
    fp["buffers"] = {name: _digest(t) for name, t in all_buffers(ps).items()}
    return fp


def pool_state_copy(ps: PoolSet) -> Dict[str, Any]:
    """:func:`pool_state_fingerprint` with every buffer copied, not digested: what
    :func:`refusal_changes` compares a refused restore's pools with."""
    fp = pool_state_fingerprint(ps)
    fp["buffers"] = {name: t.detach().clone() for name, t in all_buffers(ps).items()}
    return fp


def refusal_changes(before: Dict[str, Any], ps: PoolSet) -> List[str]:
    """What a refused restore changed, beyond what a refusal may change: ``[]`` when every
    allocator entry and index table is exactly as in ``before`` (:func:`pool_state_copy`) and
    every state buffer byte is either unchanged or zero — a refusal gives back the fresh slots
    it wrote zeroed, nothing of the snapshot left in them."""
    now = pool_state_copy(ps)
    out = [k for k in sorted(set(before) | set(now)) if k != "buffers" and before.get(k) != now.get(k)]
    state = {name for name, _ in _state_buffers(ps)}
    for name in sorted(set(before["buffers"]) | set(now["buffers"])):
        a, b = before["buffers"].get(name), now["buffers"].get(name)
        if a is None or b is None or a.shape != b.shape:
            out.append(f"buffers.{name}")
            continue
        ra, rb = _raw(a), _raw(b)
        changed = ra != rb
        if changed.any() and (name not in state or (rb[changed] != 0).any()):
            out.append(f"buffers.{name}")
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as integers of its element width, same shape (NaN != NaN compares equal)."""
    t = t.detach().contiguous()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(word)


def diff_fingerprints(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """Names of the top-level / buffer entries that differ (for assertion messages)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k == "buffers":
            ba, bb = a.get(k, {}), b.get(k, {})
            out += [f"buffers.{n}" for n in sorted(set(ba) | set(bb)) if ba.get(n) != bb.get(n)]
        elif a.get(k) != b.get(k):
            out.append(k)
    return out


def request_rows(ps: PoolSet, req) -> Dict[str, torch.Tensor]:
    """Exactly one request's state, as CPU copies (raw store dtype, e.g. uint8 for fp8).

    ``req`` is a RequestRecord or any object with ``req_pool_idx`` and ``n_tokens``
    (``mamba_pool_idx`` optional: read from req_index_to_mamba_index_mapping when
    absent).  Token slots are read from req_to_token[row, :n_tokens], so rows are in
    token order as the pool itself sees the request.

    Keys: ``k.L{g}``/``v.L{g}`` (MHA, full and SWA layers; SWA layers only have
    rows for mapped tokens), ``kv.L{g}`` (MLA), ``swa_mask`` (SWA kinds: bool [n],
    True where the token still has an SWA slot), ``mamba.conv{i}`` /
    ``mamba.temporal`` ([n_mamba_layers, ...] of the request's slot).
    """
    row = int(req.req_pool_idx)
    n = int(req.n_tokens)
    rp = ps.req_to_token_pool
    full_idx = rp.req_to_token[row, :n].to(torch.int64)
    out: Dict[str, torch.Tensor] = {}
    swa_idx = None
    if ps.has_swa:
        mapped = ps.full_to_swa_index_mapping[full_idx]
        out["swa_mask"] = (mapped > 0).clone()
        swa_idx = mapped[mapped > 0]
    for lname, side, parts in _kv_layer_buffers(ps):
        where = full_idx if side == "full" else swa_idx
        for part, buf in parts:
            out[f"{part}.{lname}"] = buf[where].clone()
    if ps.has_mamba:
        m = getattr(req, "mamba_pool_idx", None)
        if m is None:
            m = int(rp.req_index_to_mamba_index_mapping[row])
        slot = torch.tensor([int(m)], dtype=torch.int64)
        for name, buf in mamba_buffers(ps):
            out[name] = buf[:, slot][:, 0].clone()
    return out
