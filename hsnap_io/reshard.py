"""Restore across tensor-parallel sizes (TP N -> TP M), and the 1.1 sharding description.

Two halves:

* **Describing** a rank's share of the global state (``geometry.sharding``, spec 5.7),
  derived by running SGLang's OWN sharding code, not a table: the attention KV heads a
  rank holds come out of ``QKVParallelLinear.weight_loader`` (its ``num_kv_head_replicas``
  rule: with fewer KV heads than ranks each head lives on ``tp / kv_heads`` ranks), the
  conv channels out of ``mamba_v2_sharded_weight_loader`` with the shard spec the model
  files use (GDN ``[q|k|v]``, Mamba2 ``x|B|C`` with ``n_groups`` replicated when it is 1),
  both fed ``arange(global)`` so the loaded "weight" is the global channel index, and the
  local extents out of ``Mamba2StateShape.create(tp_world_size=...)``. :func:`describe`.

* **Re-sharding** a snapshot set written at TP N into pools of TP M: target rank r plans,
  per state kind, which run of which source rank's section lands where in its own shard
  (each global element from exactly one source: the lowest rank holding it), verifies
  every source section it depends on, then preads only those runs (row slices) and
  uploads the assembled shard. :func:`restore_resharded`, reached from
  :func:`hsnap_io.restore.restore_request` when the set's TP size differs from the target's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hsnap_format import HsnapError, IncompatibleSnapshotError, geometry_differences, identity_differences
from hsnap_format.errors import Phrase
from hsnap_format.records import Geometry, ShardAxis, Sharding
from hsnap_format.spec import DTYPES


class ReshardError(IncompatibleSnapshotError):
    """The set cannot be re-sharded into the target (undescribed kind, non-divisible split,
    other global size). Raised before anything is allocated: the pools are untouched."""

    def __init__(self, path, field, expected=None, found=None, *, detail=None):
        HsnapError.__init__(self, path, field, expected, found, detail=detail)
        self.differences = [(field, expected, found)]


# --------------------------------------------------------------------------- model dims


@dataclass(frozen=True)
class GDNDims:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5) linear-attention dims, global (unsharded)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class Mamba2Dims:
    """Mamba2 mixer dims, global: conv channels are ``x (intermediate) | B | C (n_groups * state)``."""

    intermediate: int
    n_groups: int
    num_heads: int
    head_dim: int
    state_size: int


@dataclass(frozen=True)
class TPModel:
    """What of a model's config decides how its state splits across TP ranks."""

    kv_heads: int | None = None  # MHA/GQA/SWA: global KV heads; None without such attention
    mla: bool = False  # MLA latent: replicated on every rank
    mamba: GDNDims | Mamba2Dims | None = None
    conv_kernel: int = 4
    conv_slice_axis: int = 0  # 1 for a transposed (KDA) conv; SGLang's GDN/Mamba2 use 0


# --------------------------------------------------------------------------- SGLang's rules


@contextlib.contextmanager
def _logical_tp(linear_mod, tp: int, rank: int):
    """Run SGLang's linear layers as rank ``rank`` of ``tp`` without a process group: their
    ``_resolve_linear_group`` then builds a ``_LogicalGroup(rank, size)`` — SGLang's own
    "own a weight partition before distributed communication is initialized" path."""

    class _Parallel:
        tp_size = attn_tp_size = tp
        tp_rank = attn_tp_rank = rank

        @property
        def tp_group(self):
            raise RuntimeError("no process group")

        attn_tp_group = tp_group

    old = linear_mod.get_parallel
    linear_mod.get_parallel = lambda: _Parallel()
    try:
        yield
    finally:
        linear_mod.get_parallel = old


def _sg(name: str):
    from ._sglang_env import import_sglang

    import_sglang()  # the import-time environment (torchvision placeholder, warnings)
    return importlib.import_module(name)


def _refuse(field: str, expected, found, detail=None):
    return ReshardError(None, field, expected, found, detail=detail)


def kv_head_map(kv_heads: int, tp: int, rank: int) -> tuple[list[int], int]:
    """Global KV heads rank ``rank`` of ``tp`` holds, and on how many ranks each lives:
    SGLang's ``QKVParallelLinear`` loading a K projection whose rows are the head ids."""
    linear = _sg("sglang.srt.layers.linear")
    try:
        with _logical_tp(linear, tp, rank):
            layer = linear.QKVParallelLinear(
                hidden_size=1, head_size=1, total_num_heads=tp * kv_heads, total_num_kv_heads=kv_heads,
                bias=False, params_dtype=torch.float32,
            )
            q = layer.num_heads
            layer.weight.data.fill_(-1)
            ids = torch.arange(kv_heads, dtype=torch.float32).reshape(-1, 1)
            layer.weight_loader(layer.weight, ids, "k")
            held = [int(x) for x in layer.weight.data[q : q + layer.num_kv_heads, 0]]
            return held, int(layer.num_kv_head_replicas)
    except (AssertionError, ValueError) as e:  # divide(): heads not a multiple of ranks or v.v.
        raise _refuse("attention kv heads", f"a split of {kv_heads} KV heads SGLang supports at tp_size {tp}", Phrase("not divisible"), detail=str(e) or None) from None


def _mamba_shape(m: GDNDims | Mamba2Dims, tp: int, kernel: int):
    mu = _sg("sglang.srt.configs.mamba_utils")
    if isinstance(m, GDNDims):
        kw = dict(intermediate_size=m.v_heads * m.v_dim, n_groups=m.k_heads, num_heads=m.v_heads, head_dim=m.v_dim,
                  state_size=m.k_dim, conv_shard_groups=[m.k_heads * m.k_dim, m.k_heads * m.k_dim, m.v_heads * m.v_dim])
    else:
        kw = dict(intermediate_size=m.intermediate, n_groups=m.n_groups, num_heads=m.num_heads, head_dim=m.head_dim,
                  state_size=m.state_size)
    try:
        return mu.Mamba2StateShape.create(tp_world_size=tp, conv_kernel=kernel, **kw)
    except (AssertionError, ValueError) as e:
        raise _refuse("mamba heads", f"a split SGLang supports at tp_size {tp}", Phrase(f"not divisible ({kw})"), detail=str(e) or None) from None


def _conv_shard_spec(m: GDNDims | Mamba2Dims, tp: int) -> list[tuple[int, int, bool]]:
    """The ``shard_spec`` the model files give ``mamba_v2_sharded_weight_loader`` for conv1d
    (qwen3_next.py / qwen3_5.py for GDN, MambaMixer2 for Mamba2)."""
    if isinstance(m, GDNDims):
        key, value = m.k_heads * m.k_dim, m.v_heads * m.v_dim
        return [(key, 0, False), (key, 0, False), (value, 0, False)]
    mu = _sg("sglang.srt.configs.mamba_utils")
    groups = m.n_groups + mu.extra_groups_for_head_shards(m.n_groups, tp)
    if m.n_groups % tp and m.n_groups != 1:
        # MambaMixer2 asserts this for quantized models and loads garbage otherwise
        raise _refuse("mamba n_groups", f"a multiple of tp_size {tp}, or 1 (replicated)", m.n_groups)
    settings = (groups * m.state_size, (groups - m.n_groups) * m.state_size, m.n_groups == 1)
    return [(m.intermediate, 0, False), settings, settings]


def conv_channel_map(m: GDNDims | Mamba2Dims, tp: int, rank: int, kernel: int = 4) -> tuple[list[int], list[tuple[int, int]]]:
    """Global conv channel of every local channel of rank ``rank``, and the local
    ``(start, length)`` of each shard-spec part: SGLang's conv1d weight loader loading a
    weight whose rows are the global channel ids."""
    mamba = _sg("sglang.srt.layers.attention.mamba.mamba")
    spec = _conv_shard_spec(m, tp)
    local = _mamba_shape(m, tp, kernel).conv[0][0]
    global_rows = sum(full - extra for full, extra, _ in spec)
    ids = torch.arange(global_rows, dtype=torch.float32).reshape(-1, 1)
    param = torch.full((local, 1), -1.0)
    mamba.mamba_v2_sharded_weight_loader(spec, tp, rank)(param, ids)
    held = [int(x) for x in param[:, 0]]
    if any(h < 0 for h in held):
        raise _refuse("mamba conv channels", f"every local channel loaded at tp_size {tp}", Phrase("some not (non-divisible split)"))
    bounds, at = [], 0
    for full, _, _ in spec:
        n = full // tp
        bounds.append((at, n))
        at += n
    return held, bounds


def _runs(held: Sequence[int]) -> list[tuple[int, int]]:
    """``held`` (global ids in local order) as maximal ascending runs ``(global start, length)``."""
    out: list[list[int]] = []
    for g in held:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1][1] += 1
        else:
            out.append([g, 1])
    return [(a, n) for a, n in out]


def _axis_from_maps(axis: int, global_size: int, maps: list[list[int]], rank: int, bounds=None) -> ShardAxis:
    """A ShardAxis for ``rank`` from every rank's global-id map: one part per run inside each
    shard-spec bound (so GDN's q, k and v stay separate parts even where they touch), its
    replicas counted over the ranks that hold its first element."""
    held = maps[rank]
    pieces = [(a, a + n) for a, n in (bounds or [(0, len(held))])]
    parts = []
    for a, b in pieces:
        for g, n in _runs(held[a:b]):
            replicas = sum(1 for m in maps if g in m)
            parts.append((g, n, replicas))
    return ShardAxis(axis, global_size, tuple(parts))


def describe(model: TPModel, tp: int, rank: int) -> Sharding:
    """This rank's ``geometry.sharding`` (spec 5.7), derived from SGLang's sharding code."""
    if not 0 <= rank < tp:
        raise _refuse("identity.tp_rank", f"0..{tp - 1}", rank)
    attention = None
    if model.mla:
        attention = ShardAxis(1, 1, ((0, 1, tp),))  # the latent: one "head", on every rank
    elif model.kv_heads is not None:
        maps, replicas = zip(*(kv_head_map(model.kv_heads, tp, r) for r in range(tp)))
        attention = _axis_from_maps(1, model.kv_heads, [list(m) for m in maps], rank)
    conv = temporal = None
    if model.mamba is not None:
        m = model.mamba
        maps, bounds = [], None
        for r in range(tp):
            held, b = conv_channel_map(m, tp, r, model.conv_kernel)
            maps.append(held)
            bounds = b if r == rank else bounds
        glob = _mamba_shape(m, 1, model.conv_kernel).conv[0][0]
        conv = (_axis_from_maps(model.conv_slice_axis, glob, maps, rank, bounds),)
        shape = _mamba_shape(m, tp, model.conv_kernel)
        heads_local, heads = shape.temporal[0], _mamba_shape(m, 1, model.conv_kernel).temporal[0]
        # temporal state: value heads (GDN) / heads (Mamba2), contiguous by rank (A_log, dt_bias)
        temporal = ShardAxis(0, heads, ((rank * heads_local, heads_local, 1),))
    return Sharding(attention=attention, conv=conv, temporal=temporal)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Run:
    """``count`` elements along the sharded axis: source rank ``src``'s local ``src_start``
    onwards land at the target's local ``dst_start`` onwards."""

    src: int
    src_start: int
    dst_start: int
    count: int


# state kind -> which description covers it (attention covers K, V, SWA and the MLA latent)
KIND_AXIS = {
    "attn_k": "attention",
    "attn_v": "attention",
    "swa_k": "attention",
    "swa_v": "attention",
    "mla_kv": "attention",
    "conv": "conv",
    "temporal": "temporal",
}


def _axis_of(sharding: Sharding | None, key: str, component: int) -> ShardAxis | None:
    if sharding is None:
        return None
    v = getattr(sharding, key)
    if key == "conv":
        return None if v is None or component >= len(v) else v[component]
    return v


def plan(target: ShardAxis, sources: Sequence[ShardAxis], where: str) -> list[Run]:
    """Runs that fill the target's extent from the sources, each element from exactly one
    source (the lowest rank holding it: replicas are identical, one read is enough)."""
    for k, s in enumerate(sources):
        if s.global_size != target.global_size or s.axis != target.axis:
            raise _refuse(f"{where} (rank-{k})", f"global {target.global_size} on axis {target.axis} (the target's)",
                          f"global {s.global_size} on axis {s.axis}")
    runs: list[Run] = []
    dst = 0
    for g0, n, _ in target.parts:
        g, end = g0, g0 + n
        while g < end:
            found = None
            for k, s in enumerate(sources):
                local = 0
                for a, m, _ in s.parts:
                    if a <= g < a + m:
                        found = (k, local + g - a, min(end, a + m) - g)
                        break
                    local += m
                if found:
                    break
            if found is None:
                raise _refuse(where, f"global element {g} held by some source rank", Phrase("held by none"))
            k, src_local, count = found
            if runs and runs[-1].src == k and runs[-1].src_start + runs[-1].count == src_local and runs[-1].dst_start + runs[-1].count == dst:
                last = runs[-1]
                runs[-1] = Run(k, last.src_start, last.dst_start, last.count + count)
            else:
                runs.append(Run(k, src_local, dst, count))
            g += count
            dst += count
    return runs


def expected_target_geometry(source: Geometry, target: Sharding) -> Geometry:
    """The source rank's geometry with each sharded extent replaced by the target's."""
    att, mam = source.attention, source.mamba
    if att is not None and target.attention is not None and att.kind != "mla":
        att = dataclasses.replace(att, heads=target.attention.local_size)
    if mam is not None:
        conv = list(mam.conv_shapes)
        for i, c in enumerate(target.conv or ()):
            if i < len(conv) and c.axis < len(conv[i]):
                shape = list(conv[i])
                shape[c.axis] = c.local_size
                conv[i] = tuple(shape)
        tshape = list(mam.temporal_shape)
        if target.temporal is not None and target.temporal.axis < len(tshape):
            tshape[target.temporal.axis] = target.temporal.local_size
        mam = dataclasses.replace(mam, conv_shapes=tuple(conv), temporal_shape=tuple(tshape))
    return dataclasses.replace(source, attention=att, mamba=mam, sharding=None)


# --------------------------------------------------------------------------- restore


@dataclass
class _SectionPlan:
    name: str
    axis: int
    runs: list[Run]
    src_shapes: list[tuple[int, ...]]  # per source rank (only used ranks matter)
    dst_shape: tuple[int, ...]
    itemsize: int


def _sources(snapset) -> list:
    return [snapset.ranks[r] for r in range(snapset.manifest.tp_size)]


def _check_identity(snapset, expected, target_tp: int, path) -> list:
    """Binding identity fields except the TP size and rank (that is the point), plus what
    the set must agree on across ranks."""
    from hsnap_format.records import numerics_differences

    src = snapset.ranks[0].identity
    diffs = [] if expected is None else [
        d for d in identity_differences(expected, src) if d[0] not in ("identity.tp_size", "identity.tp_rank")
    ]
    if diffs:
        raise IncompatibleSnapshotError(path, diffs)
    return [] if expected is None else numerics_differences(expected, src)


def build_plans(snapset, view, target: Sharding, path) -> list[_SectionPlan]:
    """One plan per state binding of the target, checking geometry first (no I/O beyond the
    headers already read)."""
    from .restore import _NOT_COMPARED, _storage_differs

    ranks = _sources(snapset)
    src0 = ranks[0]
    try:  # the caller's description must describe its own pools
        Sharding.from_header(target.to_header(), view.geometry.attention, view.geometry.mamba, "target pools")
    except HsnapError as e:
        raise _refuse("target sharding", "a description of the target pools", Phrase(str(e))) from None
    expected = expected_target_geometry(src0.geometry, target)
    diffs = geometry_differences(view.geometry, expected, ignore=_NOT_COMPARED)
    if _storage_differs(view.geometry.attention, src0.geometry.attention):
        diffs.append(("geometry.attention.storage_dtype", view.geometry.attention.storage_dtype, src0.geometry.attention.storage_dtype))
    if diffs:
        raise IncompatibleSnapshotError(path, diffs)
    for s in ranks[1:]:  # every source rank: same layers, dtypes, dims but for its own extents
        d = geometry_differences(expected_target_geometry(s.geometry, target), expected, ignore=_NOT_COMPARED)
        if d:
            raise IncompatibleSnapshotError(s.path, d)
    plans, cache = [], {}
    for b in view.bindings:
        key = KIND_AXIS.get(b.kind)
        component = int(b.name.rsplit(".", 1)[1]) if b.kind == "conv" else 0
        field = f"geometry.sharding.{key}" + (f"[{component}]" if key == "conv" else "")
        if key is None:
            raise _refuse(f"sections[{b.name}]", "a state kind with a sharding description", b.kind)
        tgt = _axis_of(target, key, component)
        if tgt is None:
            raise _refuse(f"{field} (target)", "described", Phrase(f"absent: cannot re-shard {b.name}"))
        srcs = []
        for s in ranks:
            ax = _axis_of(s.geometry.sharding, key, component)
            if ax is None:
                raise _refuse(f"{field} ({os.path.basename(s.path)})", "described (format 1.1, feature tp-sharding)",
                              Phrase(f"absent: cannot re-shard {b.name}"))
            srcs.append(ax)
        if field not in cache:
            cache[field] = plan(tgt, srcs, field)
        infos = [s.section(b.name) for s in ranks]
        dst_shape = list(infos[0].shape)
        dst_shape[tgt.axis] = tgt.local_size
        plans.append(_SectionPlan(b.name, tgt.axis, cache[field], [i.shape for i in infos], tuple(dst_shape), DTYPES[infos[0].dtype].itemsize))
    return plans


def _read_runs(snap, name: str, p: _SectionPlan, src: int, runs: list[Run], out: np.ndarray) -> int:
    """pread source ``src``'s runs of section ``name`` into the target bytes ``out``; returns
    bytes read. A run spanning the whole source axis is one read per outer block of rows;
    otherwise one read per outer row (token) — only the row slices, never whole rows."""
    info = snap.section(name)
    shape, axis = p.src_shapes[src], p.axis
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1 :]) * p.itemsize
    s_ax, t_ax = shape[axis], p.dst_shape[axis]
    dst = out.reshape(outer, t_ax * inner) if outer else out
    got = 0
    for r in runs:
        n = r.count * inner
        if outer == 0 or n == 0:
            continue
        if r.count == s_ax:  # the whole source axis: one contiguous read, scattered per row
            buf = np.empty(outer * n, dtype=np.uint8)
            snap._read(info.offset, outer * n, memoryview(buf))
            dst[:, r.dst_start * inner : r.dst_start * inner + n] = buf.reshape(outer, n)
            got += outer * n
            continue
        row = np.empty(n, dtype=np.uint8)
        for o in range(outer):
            snap._read(info.offset + (o * s_ax + r.src_start) * inner, n, memoryview(row))
            dst[o, r.dst_start * inner : r.dst_start * inner + n] = row
            got += n
    return got


def restore_resharded(snapset, view, *, identity, target: Sharding, target_tp: int, target_rank: int,
                      verify: bool, exact_rollback: bool, staging_bytes: int):
    """Restore ``snapset`` (TP N) into this target rank (TP M): see the module docstring."""
    import warnings

    from .restore import NumericsWarning, _allocate, check_capacity, pool_lock, raise_upload_failure, RestoredRequest
    from .statecheck import PoolCheckpoint
    from .transfer import engine_for
    from hsnap_format import HsnapIOError

    path = snapset.path
    numerics = _check_identity(snapset, identity, target_tp, path)
    if numerics:
        warnings.warn(NumericsWarning(f"{path}: written under other numerics: bit-exactness is not expected"), stacklevel=3)
    plans = build_plans(snapset, view, target, path)
    sources = _sources(snapset)
    src0 = sources[0]
    check_capacity(src0, view)
    used = sorted({r.src for p in plans for r in p.runs})
    if verify:  # every source section this shard depends on, and the record of rank 0
        try:
            for k in used:
                for p in plans:
                    if any(r.src == k for r in p.runs):
                        sources[k].verify_section(p.name)
            for s in src0.sections:
                if not s.is_state:
                    src0.verify_section(s)
        except OSError as e:
            raise HsnapIOError(path, "read", e) from None
    record = src0.record(verify=False)  # verified above when asked
    pos = src0.state_position
    read = uploaded = 0
    with pool_lock(view.req_to_token_pool):
        for k in used:
            sources[k].check_unchanged()
        checkpoint = PoolCheckpoint(view)
        engine = engine_for([b.buffer for b in view.bindings], staging_bytes)
        where = "allocation"
        try:
            row, slots, floor = _allocate(view, pos, src0.swa_start, path, checkpoint)
            for b, p in zip(view.bindings, plans):
                where = f"sections[{p.name}]"
                rows = slots.rows(b.space)
                out = np.empty(math.prod(p.dst_shape) * p.itemsize, dtype=np.uint8)
                for k in used:
                    runs = [r for r in p.runs if r.src == k]
                    if runs:
                        read += _read_runs(sources[k], p.name, p, k, runs, out)
                if exact_rollback:
                    checkpoint.remember_rows(b.buffer, rows, b.name)
                engine.import_section(b.buffer, rows.to(b.buffer.device), out)
                uploaded += out.nbytes
            where = "finish upload"
            engine.finish_import()
        except BaseException as e:
            raise_upload_failure(engine, checkpoint, path, e, where)
    return RestoredRequest(
        req_pool_idx=row,
        token_indices=slots.token,
        mamba_pool_idx=None if slots.mamba is None else int(slots.mamba[0]),
        record=record,
        state_position=pos,
        snapshot_id=src0.identity.snapshot_id,
        bytes_uploaded=uploaded,
        numerics_differences=numerics,
        swa_evict_floor=floor,
        source_bytes_read=read,
        source_ranks=tuple(used),
    )


__all__ = ["TPModel", "GDNDims", "Mamba2Dims", "describe", "plan", "Run", "ReshardError", "restore_resharded",
           "kv_head_map", "conv_channel_map"]
