"""Pool adapters: what state each SGLang pool kind carries, declared in one place.

An adapter turns a pool object into *bindings*: one per snapshot section, each a
``[slots, ...]`` tensor in the pool's storage dtype plus the index space its rows
live in (``token``, ``swa`` or ``mamba``). Export gathers rows of every binding;
restore scatters them back. No call site asks "is this an SWAKVPool?": an adapter
is found by walking the pool's class MRO through :data:`KV_ADAPTERS`, and it
declares whether the KV pool carries Mamba state (SGLang's own
``cpu_copy_carries_mamba``). Mamba state is then taken from the KV pool when it
carries it, else from the request pool's ``mamba_pool`` — exactly once either way
(the retraction bug of sglang#35957 was the "neither" case).
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hsnap_format import AttentionGeometry, Geometry, HsnapError, MambaGeometry
from hsnap_format.layout import section_name

TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


class UnsupportedPoolError(HsnapError):
    """A pool kind (or pool feature) hsnap cannot snapshot without losing state."""


def dtype_name(dtype: torch.dtype, where: str) -> str:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise UnsupportedPoolError(None, where, sorted(TORCH_DTYPES.values()), str(dtype)) from None


@dataclass(frozen=True)
class Binding:
    """One section's home in the pools: ``buffer[rows]`` are its rows."""

    name: str
    kind: str
    layer: int
    buffer: torch.Tensor  # [slots, ...], storage dtype
    space: str  # "token" | "swa" | "mamba"

    @property
    def host_rows(self) -> np.ndarray | None:
        """The buffer's bytes as ``[slots, row_bytes]`` uint8 over its own memory, for a host engine (``host=``):
        made once per binding, as a view lives as long as its pools — a torch view made per section cost ~10 µs,
        80 sections a restore. None for a buffer not in host memory or not contiguous."""
        ptr = self.buffer.data_ptr()
        known = self.__dict__.get("_host_rows")
        if known is None or known[0] != ptr:  # (made again for storage that moved: set_ or resize_ on the buffer)
            b = self.buffer
            rows = b.reshape(b.shape[0], math.prod(b.shape[1:])).view(torch.uint8).numpy() \
                if b.device.type == "cpu" and b.is_contiguous() and b.dim() else None
            known = self.__dict__["_host_rows"] = (ptr, rows)
        return known[1]


@dataclass(frozen=True)
class KVView:
    """What one KV pool exposes: attention geometry, bindings, and whether it carries mamba."""

    attention: AttentionGeometry | None
    bindings: list[Binding]
    carries_mamba: bool
    mamba_pool: object | None = None  # when carries_mamba


# ------------------------------------------------------------------ attention pools


def _mha_bindings(pool, layer_ids, prefix: str, space: str) -> list[Binding]:
    if str(getattr(pool, "kv_cache_layout", None) or "nhd").lower() != "nhd" or not isinstance(pool.k_buffer, list):
        raise UnsupportedPoolError(None, f"{type(pool).__name__}.layout", "NHD per-layer buffers", getattr(pool, "kv_cache_layout", None))
    out = []
    for i, L in enumerate(layer_ids):
        out.append(Binding(section_name(f"{prefix}_k", L), f"{prefix}_k", L, pool.k_buffer[i], space))
        out.append(Binding(section_name(f"{prefix}_v", L), f"{prefix}_v", L, pool.v_buffer[i], space))
    return out


def _mha_attention(pool, layers, kind="mha", swa_layers=()) -> AttentionGeometry:
    return AttentionGeometry(
        kind=kind,
        layers=tuple(layers),
        swa_layers=tuple(swa_layers),
        heads=int(pool.head_num),
        k_head_dim=int(pool.head_dim),
        v_head_dim=int(getattr(pool, "v_head_dim", None) or pool.head_dim),
        dtype=dtype_name(pool.dtype, "attention.dtype"),
        storage_dtype=dtype_name(pool.store_dtype, "attention.storage_dtype"),
        page_size=int(pool.page_size),
    )


def mha_view(pool) -> KVView:
    layers = list(range(pool.start_layer, pool.start_layer + pool.layer_num))
    return KVView(_mha_attention(pool, layers), _mha_bindings(pool, layers, "attn", "token"), False)


def mla_view(pool) -> KVView:
    layers = list(range(pool.start_layer, pool.start_layer + pool.layer_num))
    if getattr(pool, "use_dsa", False):
        raise UnsupportedPoolError(None, "MLATokenToKVPool.use_dsa", False, True)
    att = AttentionGeometry(
        kind="mla",
        layers=tuple(layers),
        heads=1,
        k_head_dim=int(pool.kv_lora_rank + pool.qk_rope_head_dim),
        v_head_dim=0,
        dtype=dtype_name(pool.dtype, "attention.dtype"),
        storage_dtype=dtype_name(pool.store_dtype, "attention.storage_dtype"),
        page_size=int(pool.page_size),
        kv_lora_rank=int(pool.kv_lora_rank),
        qk_rope_head_dim=int(pool.qk_rope_head_dim),
    )
    bindings = [Binding(section_name("mla_kv", L), "mla_kv", L, pool.kv_buffer[i], "token") for i, L in enumerate(layers)]
    return KVView(att, bindings, False)


def swa_view(pool) -> KVView:
    # SWA rows are found through full_to_swa_index_mapping; a per-request ring or
    # window rows (no mapping) would export the wrong rows: refuse before writing
    for attr in ("swa_req_ring_size", "request_window"):
        if getattr(pool, attr, None) is not None:
            raise UnsupportedPoolError(None, f"SWAKVPool.{attr}", "None (paged SWA slots through full_to_swa_index_mapping)", "set (per-request SWA rows)")
    full = sorted(g for g, (_, is_swa) in pool.layers_mapping.items() if not is_swa)
    swa = sorted(g for g, (_, is_swa) in pool.layers_mapping.items() if is_swa)
    full_dense = [g for g, _ in sorted(((g, pool.layers_mapping[g][0]) for g in full), key=lambda t: t[1])]
    swa_dense = [g for g, _ in sorted(((g, pool.layers_mapping[g][0]) for g in swa), key=lambda t: t[1])]
    bindings = _mha_bindings(pool.full_kv_pool, full_dense, "attn", "token") + _mha_bindings(pool.swa_kv_pool, swa_dense, "swa", "swa")
    return KVView(_mha_attention(pool.full_kv_pool, full, "swa", swa), bindings, False)


def hybrid_linear_view(pool) -> KVView:
    mapping = pool.full_attention_layer_id_mapping  # global id -> dense index
    dense = [g for g, _ in sorted(mapping.items(), key=lambda t: t[1])]
    inner = adapter_for(pool.full_kv_pool, KV_ADAPTERS, "full_kv_pool")(pool.full_kv_pool)
    # the dense inner pool numbers layers 0..n-1: rename its bindings to global ids
    bindings = []
    for b in inner.bindings:
        g = dense[b.layer - pool.full_kv_pool.start_layer]
        bindings.append(Binding(section_name(b.kind, g), b.kind, g, b.buffer, b.space))
    att = inner.attention
    att = AttentionGeometry(**{**att.__dict__, "layers": tuple(sorted(dense))})
    return KVView(att, bindings, carries_mamba=True, mamba_pool=pool.mamba_pool)


# Keyed by class name along the MRO, so subclasses inherit their parent's adapter and
# importing SGLang is not needed to build the table. Order of lookup: the class first.
KV_ADAPTERS: dict[str, Callable[[object], KVView]] = {
    "MHATokenToKVPool": mha_view,
    "MLATokenToKVPool": mla_view,
    "SWAKVPool": swa_view,
    "HybridLinearKVPool": hybrid_linear_view,
}
# Subclasses whose storage differs from their parent's: refuse rather than guess.
REFUSED_POOLS = {
    "MHATokenToKVPoolFP4": "fp4 KV with scales",
    "MHATokenToKVPoolMXFP8": "mxfp8 KV with scales",
    "PageMajorMHATokenToKVPool": "page-major layout",
    "NoOpMHATokenToKVPool": "a pool without storage",
    "MLATokenToKVPoolFP4": "fp4 KV with scales",
    "DSATokenToKVPool": "DSA indexer state",
}


def adapter_for(pool, table, where: str):
    for cls in type(pool).__mro__:
        if cls.__name__ in REFUSED_POOLS:
            raise UnsupportedPoolError(None, where, "a supported pool kind", f"{cls.__name__} ({REFUSED_POOLS[cls.__name__]})")
        if cls.__name__ in table:
            return table[cls.__name__]
    raise UnsupportedPoolError(None, where, sorted(table), type(pool).__name__)


# ------------------------------------------------------------------ mamba


def mamba_bindings(mamba_pool) -> tuple[MambaGeometry, list[Binding]]:
    cache = mamba_pool.mamba_cache
    for field, why in (("_slot_siblings", "side states (PLE)"),):
        if getattr(mamba_pool, field, None):
            raise UnsupportedPoolError(None, f"MambaPool.{field}", "none", why)
    if getattr(mamba_pool, "replayssm_write_pos", None) is not None:
        # the temporal state is stale until the ReplaySSM ring is flushed
        raise UnsupportedPoolError(None, "MambaPool.replayssm", "disabled (temporal state is stale until flushed)", "enabled")
    layer_ids = list(mamba_pool.mamba_layer_ids)
    geom = MambaGeometry(
        layers=tuple(layer_ids),
        conv_shapes=tuple(tuple(int(d) for d in c.shape[2:]) for c in cache.conv),
        conv_dtype=dtype_name(cache.conv[0].dtype, "mamba.conv_dtype"),
        temporal_shape=tuple(int(d) for d in cache.temporal.shape[2:]),
        temporal_dtype=dtype_name(cache.temporal.dtype, "mamba.temporal_dtype"),
        conv_slice_axis=int(getattr(mamba_pool, "conv_slice_axis", 0)),
    )
    out = []
    convs = [conv.unbind(0) for conv in cache.conv]  # every layer's view in one call, not one index each
    temporal = cache.temporal.unbind(0)
    for i, L in enumerate(layer_ids):
        for c, conv in enumerate(convs):
            out.append(Binding(section_name("conv", L, c), "conv", L, conv[i], "mamba"))
        out.append(Binding(section_name("temporal", L), "temporal", L, temporal[i], "mamba"))
    return geom, out


@dataclass(frozen=True)
class PoolView:
    """Everything hsnap needs from a scheduler's pools."""

    geometry: Geometry
    bindings: tuple[Binding, ...]  # in file order
    mamba_pool: object | None
    req_to_token_pool: object
    allocator_ref: Callable[[], object]  # weak: a view kept by view_pools' cache must not keep its pools alive
    kv_pool: object

    @property
    def allocator(self):
        return self.allocator_ref()

    @functools.cached_property
    def device(self) -> torch.device:
        """The one device of every buffer (CPU for a view without any); buffers on several are refused."""
        return pool_device(b.buffer.device for b in self.bindings) if self.bindings else torch.device("cpu")


def pool_device(devices) -> torch.device:
    """The one device every pool buffer is on. Buffers on several devices (``cuda:0``
    and ``cuda:1``, or CPU and CUDA) are refused: one engine copies on one device."""
    found = list(dict.fromkeys(torch.device(d) for d in devices))
    if len(found) != 1:
        raise UnsupportedPoolError(None, "pool devices", "every pool buffer on one device", sorted(str(d) for d in found))
    return found[0]


# A server's pools live as long as it does, and every export, proof and restore views them (a resume did three times):
# the last views, by allocator (weakly: they go with their pools), reused while what they were built from is unchanged
_VIEWS: "weakref.WeakKeyDictionary[object, tuple[tuple, PoolView]]" = weakref.WeakKeyDictionary()
_VIEWS_LOCK = threading.Lock()
# the objects whose attributes a view is built from, found from the KV pool and the request pool
_NESTED_POOLS = ("full_kv_pool", "swa_kv_pool", "mamba_pool")


def _sources(req_to_token_pool, kv_pool) -> list:
    """What :func:`view_pools` reads, as the objects themselves: the request pool, the KV pool, the pools nested in it
    (and the request pool's mamba pool, with its cache), and every attribute value of each of them but the request
    pool's (its free list changes with every request). A view stays valid while each is the same object: an attribute
    rebound (a buffer list replaced, a refused feature switched on) makes a new view."""
    pools = [kv_pool] + [getattr(kv_pool, a, None) for a in _NESTED_POOLS] + [getattr(req_to_token_pool, "mamba_pool", None)]
    pools += [getattr(p, "mamba_cache", None) for p in pools[-2:] if p is not None]
    out = [req_to_token_pool]
    for p in pools:
        out.append(p)
        if p is not None and hasattr(p, "__dict__"):
            out.extend(vars(p).values())
    return out


def view_pools(req_to_token_pool, token_to_kv_pool_allocator) -> PoolView:
    """The bindings and geometry of these pools (:class:`PoolView`); the same view as the last call's while the
    pools are the same objects with the same attributes (:func:`_sources`)."""
    kv_pool = token_to_kv_pool_allocator.get_kvcache()
    sources = _sources(req_to_token_pool, kv_pool)
    try:
        with _VIEWS_LOCK:
            cached = _VIEWS.get(token_to_kv_pool_allocator)
    except TypeError:  # an allocator that takes no weak reference: built every time
        return _build_view(req_to_token_pool, token_to_kv_pool_allocator, kv_pool, lambda: token_to_kv_pool_allocator)
    if cached is not None and len(cached[0]) == len(sources) and all(map(operator.is_, cached[0], sources)):
        return cached[1]
    view = _build_view(req_to_token_pool, token_to_kv_pool_allocator, kv_pool, weakref.ref(token_to_kv_pool_allocator))
    with _VIEWS_LOCK:
        _VIEWS[token_to_kv_pool_allocator] = (tuple(sources), view)
    return view


def _build_view(req_to_token_pool, token_to_kv_pool_allocator, kv_pool, allocator_ref) -> PoolView:
    kv = adapter_for(kv_pool, KV_ADAPTERS, "token_to_kv_pool_allocator.get_kvcache()")(kv_pool)
    # Mamba state: from the KV pool if it declares it carries it, else from the
    # request pool's own mamba_pool (SWAKVPool beside HybridReqToTokenPool). Once.
    mamba_pool = kv.mamba_pool if kv.carries_mamba else getattr(req_to_token_pool, "mamba_pool", None)
    mamba_geom, m_bindings = (None, []) if mamba_pool is None else mamba_bindings(mamba_pool)
    if mamba_pool is not None and not hasattr(req_to_token_pool, "req_index_to_mamba_index_mapping"):
        raise UnsupportedPoolError(None, "req_to_token_pool", "HybridReqToTokenPool (mamba slot mapping)", type(req_to_token_pool).__name__)
    layers = [b.layer for b in kv.bindings + m_bindings]
    start = getattr(kv_pool, "start_layer", 0) or 0
    geom = Geometry(
        attention=kv.attention,
        mamba=mamba_geom,
        start_layer=int(start),
        num_layers=len(set(layers)),
    )
    by_layer: dict[int, list[Binding]] = {}
    for b in kv.bindings + m_bindings:
        by_layer.setdefault(b.layer, []).append(b)
    ordered = [b for L in sorted(by_layer) for b in by_layer[L]]
    return PoolView(geom, tuple(ordered), mamba_pool, req_to_token_pool, allocator_ref, kv_pool)
