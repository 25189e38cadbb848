"""SGLang pool sets of one model at TP 1, 2 and 4, holding one request's global state
exactly as each TP rank holds it (for the re-sharding tests).

Each rank's pools are SGLang's own classes built with that rank's shapes: the family's
SGLang state shape at ``tp_world_size=tp`` (``reshard.state_shape``: ``Mamba2StateShape``,
``KimiLinearStateShape``) for the Mamba-pool slot, and the KV head count
``QKVParallelLinear`` gives rank r (``reshard.kv_head_map``). The global state (K/V
``[tokens, global heads, dim]``, conv ``[global channels, K-1]`` — KDA ``[K-1, global
channels]`` —, temporal ``[global heads, ...]``) is placed into rank r by the global ids
SGLang's own weight loaders give that rank (``reshard.kv_head_map`` / ``conv_channel_map``
/ ``temporal_head_map``), so a rank's bytes are what a TP engine computing that state
would hold. ``MODELS`` are the geometries the re-sharding suites run; ``FAMILIES`` the
other hybrid families (tests/test_families.py).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

import hsnap_format as hf
from hsnap_io import reshard
from hsnap_io.sglang_env import import_sglang

from . import pools

N_TOKENS = 5
HEAD_DIM = 4


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    tp: reshard.TPModel
    pool: str  # "mha" | "mla" | "hybrid" | "swa"
    attn_layers: tuple[int, ...]
    mamba_layers: tuple[int, ...] = ()
    swa_layers: tuple[int, ...] = ()


MODELS = {
    # Qwen3.5-35B-A3B per rank: 2 KV heads (replicated at TP 4), GDN 16 key / 32 value heads
    "qwen35": Model("qwen35", reshard.TPModel(kv_heads=2, mamba=reshard.GDNDims(16, 32, 2, 2)), "hybrid", (1, 3), (0, 2)),
    "gqa": Model("gqa", reshard.TPModel(kv_heads=4), "mha", (0, 1)),
    "mla": Model("mla", reshard.TPModel(mla=True), "mla", (0, 1)),
    # Mamba2 with n_groups 1 < tp (B and C replicated), beside MQA attention (1 KV head)
    "mamba2": Model("mamba2", reshard.TPModel(kv_heads=1, mamba=reshard.Mamba2Dims(8, 1, 4, 2, 2)), "hybrid", (1,), (0, 2)),
    # sliding-window layers 0 and 2 beside a full layer (SWAKVPool), 2 KV heads
    "swa": Model("swa", reshard.TPModel(kv_heads=2), "swa", (1,), swa_layers=(0, 2)),
}
# The other families SGLang keeps in a MambaPool slot, each beside MHA attention (2 KV heads);
# apart from MODELS, whose every geometry the re-sharding suites run at TP 1, 2 and 4.
FAMILIES = {
    # Mamba2 with n_groups 2: B and C split by group at TP 2; TP 4 is no split SGLang makes
    # (MambaMixer2: n_groups a multiple of tp, or 1)
    "mamba2-g2": Model("mamba2-g2", reshard.TPModel(kv_heads=2, mamba=reshard.Mamba2Dims(8, 2, 4, 2, 2)), "hybrid", (1,), (0, 2)),
    # Mamba-1 (Falcon-Mamba): conv over 8 intermediate channels, temporal (8 channels, 1, 2)
    "mamba1": Model("mamba1", reshard.TPModel(kv_heads=2, mamba=reshard.Mamba1Dims(8, 2)), "hybrid", (1,), (0, 2)),
    # Kimi-Linear KDA: conv slot (K-1, q|k|v) transposed (conv_slice_axis 1), temporal (heads, d, d)
    "kda": Model("kda", reshard.TPModel(kv_heads=2, mamba=reshard.KDADims(4, 2)), "hybrid", (1,), (0, 2)),
    # LFM2 short conv: conv over 8 hidden channels (K 3), a zero-element temporal (1, 8, 0)
    "lfm2": Model("lfm2", reshard.TPModel(kv_heads=2, mamba=reshard.ShortConvDims(8), conv_kernel=3), "hybrid", (1,), (0, 2)),
    # lightning (Bailing / MiniCPM seg_la): temporal (4 heads, 2, 2), a zero-element conv (0, 0)
    "lightning": Model("lightning", reshard.TPModel(kv_heads=2, mamba=reshard.LightningDims(4, 2)), "hybrid", (1,), (0, 2)),
}
MLA_RANK, MLA_ROPE = 4, 2
POOL_KINDS = {"mha": "mha", "mla": "mla", "hybrid": "hybrid_linear", "swa": "swa"}  # Model.pool -> pools.build kind


def _mamba_params(sg, m: Model, tp: int):
    """SGLang's cache params of the model's family at ``tp``: its own state-shape class
    (``reshard.state_shape``), and ``KimiLinearCacheParams`` for a KDA shape."""
    mu = sg.mamba_utils
    shape = reshard.state_shape(m.tp.mamba, tp, m.tp.conv_kernel)
    cls = mu.KimiLinearCacheParams if isinstance(shape, mu.KimiLinearStateShape) else mu.Mamba2CacheParams
    return cls(shape=shape, layers=list(m.mamba_layers), dtype=mu.Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))


def build(m: Model, tp: int, rank: int, *, size: int = 64, seed: int = 3) -> SimpleNamespace:
    """Fresh pools of rank ``rank`` of ``tp`` (every state byte seeded noise); ``.pools`` is the
    :class:`hsnap_testing.pools.PoolSet`, for its pool-state fingerprint."""
    geom: dict[str, Any] = dict(max_reqs=4, mamba_size=4, dtype=torch.bfloat16)
    if m.pool == "mla":
        geom.update(kv_lora_rank=MLA_RANK, qk_rope_head_dim=MLA_ROPE, layer_num=len(m.attn_layers))
    else:
        geom.update(head_num=len(reshard.kv_head_map(m.tp.kv_heads, tp, rank)[0]), head_dim=HEAD_DIM)
    geom.update({"mha": dict(layer_num=len(m.attn_layers)), "mla": {},
                 "swa": dict(full_attention_layer_ids=list(m.attn_layers), swa_attention_layer_ids=list(m.swa_layers)),
                 "hybrid": dict(full_attention_layer_ids=list(m.attn_layers), mamba_layer_ids=list(m.mamba_layers))}[m.pool])
    params = _mamba_params(import_sglang(), m, tp) if m.pool == "hybrid" else None
    ps = pools.build(POOL_KINDS[m.pool], size=size, seed=seed * 1000 + tp * 10 + rank, mamba_params=params, **geom)
    return SimpleNamespace(rtp=ps.req_to_token_pool, alloc=ps.token_to_kv_pool_allocator, kv=ps.kv_pool, tp=tp, rank=rank,
                           model=m, pools=ps)


def global_state(m: Model, seed: int = 11) -> dict[str, torch.Tensor]:
    """Section name -> the global (TP 1) tensor of one request, random bit patterns."""
    ps = build(m, 1, 0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    from hsnap_io.adapters import view_pools

    out = {}
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        shape = (N_TOKENS, *b.buffer.shape[1:]) if b.space in ("token", "swa") else tuple(b.buffer.shape[1:])
        bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32)
        if b.buffer.dtype == torch.float32:
            # finite floats only: any bit pattern copies exactly, but keep values printable
            out[b.name] = torch.randn(shape, generator=gen, dtype=torch.float32)
        else:
            out[b.name] = bits.to(torch.int16).view(b.buffer.dtype)
    return out


def shard_of(m: Model, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` holds of the global tensor ``full`` of section ``name``."""
    kind = name.split(".")[0]
    if kind in ("attn", "swa"):
        held, _ = reshard.kv_head_map(m.tp.kv_heads, tp, rank)
        return full[:, held]
    if kind == "mla":
        return full
    if name.endswith(".temporal"):
        heads, _ = reshard.temporal_head_map(m.tp.mamba, tp, rank, m.tp.conv_kernel)
        return full[heads]
    if not full.numel():  # a conv of no element (lightning): the same empty slot on every rank
        return full
    held, _ = reshard.conv_channel_map(m.tp.mamba, tp, rank, m.tp.conv_kernel)
    axis = reshard.conv_slice_axis(m.tp.mamba, m.tp.conv_kernel)
    return full.index_select(axis, torch.tensor(held, dtype=torch.int64))


def place(ps, state: dict[str, torch.Tensor]):
    """Allocate one request through SGLang's allocators and write this rank's shard of
    ``state`` into its slots; returns (req_pool_idx, token slots, mamba slot)."""
    sg = import_sglang()
    from hsnap_io.adapters import view_pools

    req = SimpleNamespace(kv=sg.schedule_batch.ReqKvInfo())
    row = int(ps.rtp.alloc([req])[0])
    ps.alloc.alloc(3)  # another request's slots first: the request's slots are not 1..n
    tok = ps.alloc.alloc(N_TOKENS).to(torch.int64)
    ps.rtp.write((row, slice(0, N_TOKENS)), tok.to(torch.int32))
    mslot = int(req.kv.mamba_pool_idx) if hasattr(ps.rtp, "mamba_pool") else None
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        data = shard_of(ps.model, ps.tp, ps.rank, b.name, state[b.name])
        if b.space == "token":
            b.buffer[tok] = data
        elif b.space == "swa":  # every position still in the window: export's swa_start picks the rows
            b.buffer[ps.kv.translate_loc_from_full_to_swa(tok)] = data
        else:
            b.buffer[mslot] = data
    return row, tok, mslot


def identity(tp: int, rank: int, sid: str = "reshard-test") -> hf.Identity:
    return hf.Identity(model_id="tiny/reshard", weights_version="w1", engine=hf.Engine("sglang", "0.5.23", "test"),
                       tp_size=tp, tp_rank=rank, snapshot_id=sid, created_at="2026-12-01T00:00:00Z")


def record() -> hf.RequestRecord:
    import numpy as np

    return hf.RequestRecord(rid="r-reshard", prompt_ids=np.arange(3, dtype=np.int32), output_ids=np.array([7, 8, 9], dtype=np.int32),
                            state_position=N_TOKENS, max_new_tokens=16)


def export_set(m: Model, tp: int, state, path, *, swa_start: int = 0, overrides: dict | None = None) -> str:
    """A TP ``tp`` snapshot directory of ``state``: every rank's pools as SGLang holds them.
    ``overrides`` (rank -> export_request keywords: identity, record, swa_start, sharding)
    make one rank disagree with the others, written by the project's own writer (every
    file self-consistent and signed; the manifest binds them)."""
    from hsnap_io import export_request

    sw = hf.SetWriter(path)
    try:
        for r in range(tp):
            ps = build(m, tp, r, seed=20 + r)
            row, _, _ = place(ps, state)
            kw = dict(record=record(), identity=identity(tp, r), sharding=reshard.describe(m.tp, tp, r), swa_start=swa_start)
            kw.update((overrides or {}).get(r, {}))
            export_request(sw.rank_path(r), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, req_pool_idx=row,
                           fsync=False, **kw)
        sw.commit(tp_size=tp, fsync=False)
    except BaseException:
        sw.abort()
        raise
    return str(path)


def restored_rows(ps, restored, swa_start: int = 0) -> dict[str, torch.Tensor]:
    """Section name -> the restored rows (SWA sections: positions ``swa_start`` onwards)."""
    from hsnap_io.adapters import view_pools

    out = {}
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        if b.space == "token":
            out[b.name] = b.buffer[restored.token_indices].clone()
        elif b.space == "swa":
            out[b.name] = b.buffer[ps.kv.translate_loc_from_full_to_swa(restored.token_indices[swa_start:])].clone()
        else:
            out[b.name] = b.buffer[restored.mamba_pool_idx].clone()
    return out


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


__all__ = ["MODELS", "FAMILIES", "build", "global_state", "shard_of", "place", "export_set", "restored_rows", "identity", "as_bytes"]
