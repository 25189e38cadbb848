"""Restore across tensor-parallel sizes (TP N -> TP M), and the 1.1 sharding description.

Two halves:

* **Describing** a rank's share of the global state (``geometry.sharding``, spec 5.7),
  derived by running SGLang's OWN sharding code, not a table: the attention KV heads a
  rank holds come out of ``QKVParallelLinear.weight_loader`` (its ``num_kv_head_replicas``
  rule: with fewer KV heads than ranks each head lives on ``tp / kv_heads`` ranks), the
  conv channels out of each family's own conv weight loader (``_CONV_LOADERS``:
  ``mamba_v2_sharded_weight_loader`` with the shard spec the model files use for GDN
  ``[q|k|v]`` and Mamba2 ``x|B|C`` with ``n_groups`` replicated when it is 1; Mamba-1's
  ``ColumnParallelLinear``; KDA's ``MergedColumnParallelLinear`` q|k|v; LFM2's
  ``sharded_weight_loader``), all fed ``arange(global)`` so the loaded "weight" is the
  global channel index, and the local extents and the conv axis TP slices out of the
  family's SGLang state shape (``_SHAPES``: ``Mamba2StateShape.create`` /
  ``create_full_rank``, ``KimiLinearStateShape.create``). :func:`describe`.

* **Re-sharding** a snapshot set written at TP N into pools of TP M: before allocating,
  the set must agree with itself and with the target (spec 5.8: identity, request record,
  ``swa_start``, unsharded geometry; descriptions holding every global element exactly
  ``replicas`` times), and target rank r plans, per state kind, which run of which
  source rank's section lands where in its own shard (each global element from exactly
  one source: the lowest rank holding it), proving that the runs tile every target
  section; with ``verify`` (the default) it verifies every source section it depends on.
  Then it allocates and assembles each target section from the source sections it
  depends on, each read whole, once, 2 MiB at a time (hashed but for ``verify=False``),
  the runs sliced out of each piece while it is in cache straight into the slots when
  they are one run — as the plain restore preads into them, with its guarantee: what
  is uploaded was hashed, a mismatch is rolled back — else into one scratch buffer,
  checked before it is uploaded. No host buffer of the shard's size: measured against
  staging the shard before allocating (read once) in bench/RESHARD.md.
  :func:`prove_resharded` then :func:`upload_resharded`, reached from :func:`hsnap_io.restore.restore_request` when
  the set's TP size differs from the target's.

* **Sets of deltas**, link by link (live migration across TP sizes,
  :class:`hsnap_io.migrate.MigrationTarget`): :func:`check_delta_set` (every rank a delta
  of the same rank of the set applied last, the set consistent, the runs of the delta's
  rows and the state proven), :func:`delta_set_record` (hashed before allocating),
  :func:`upload_delta_set` (into the slots the caller allocated after the request's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from hsnap_format import (DigestMismatchError, HsnapError, HsnapIOError, IncompatibleSnapshotError, geometry_differences,
                          identity_differences)
from hsnap_format.errors import Phrase
from hsnap_format.buffers import host_empty
from hsnap_format.records import Geometry, ShardAxis, Sharding
from hsnap_format.spec import DTYPES

from .checks import GEOMETRY_NOT_COMPARED, NumericsWarning, storage_differs, verify_mode
from .sglang_env import import_sglang
from .slots import RestoredRequest, allocate, check_capacity, pool_lock, raise_upload_failure
from .statecheck import PoolCheckpoint
from .transfer import engine_for


class ReshardError(IncompatibleSnapshotError):
    """The set cannot be re-sharded into the target (undescribed kind, non-divisible split,
    other global size, runs that do not tile a target section). Raised before anything is
    allocated — but for the byte count of an assembled section, checked during the upload
    and rolled back like any upload failure. One line: ``file: field: expected X, found Y``
    (the file is the rank file, the set, or for :func:`describe` the split asked for)."""

    def __init__(self, path, field, expected=None, found=None, detail=None):
        HsnapError.__init__(self, path, field, expected, found, detail=detail)
        self.differences = [(field, expected, found)]

    # the plain HsnapError line, not IncompatibleSnapshotError's "<field> differ: <detail>"
    _message = HsnapError._message
    __reduce__ = HsnapError.__reduce__


class InconsistentSetError(ReshardError):
    """The rank files of a TP set disagree where they must agree (spec 5.8): identity (but
    the rank), request fields, ``swa_start``, record sections, section shapes, or sharding
    descriptions that do not hold every global element exactly ``replicas`` times. Raised
    before anything is allocated; names the rank file, the field, rank 0's value (or the
    rule) and the value found. (A rank whose identity or geometry differs from the
    *target's* is an :class:`IncompatibleSnapshotError` naming that rank file.)"""


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
class Mamba1Dims:
    """Mamba-1 mixer dims (state-spaces Mamba, Falcon-Mamba), global: the conv over the
    ``intermediate`` channels only, a full-rank temporal ``(intermediate, 1, state_size)``
    (SGLang's ``Mamba2StateShape.create_full_rank``: every channel a head of dim 1)."""

    intermediate: int
    state_size: int


@dataclass(frozen=True)
class KDADims:
    """Kimi Delta Attention (Kimi-Linear) dims, global: the conv slot is stored transposed,
    ``(K-1, q | k | v)`` with ``num_heads * head_dim`` channels each, the temporal state
    ``(num_heads, head_dim, head_dim)`` (SGLang's ``KimiLinearStateShape``)."""

    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class ShortConvDims:
    """LFM2's gated short conv, global: a conv over the ``hidden`` channels, no SSM state
    (SGLang's slot holds a zero-element temporal ``(1, hidden, 0)`` on every rank)."""

    hidden: int


@dataclass(frozen=True)
class LightningDims:
    """Lightning attention (Bailing hybrid / MiniCPM ``seg_la``), global: the temporal state
    ``(num_heads, head_dim, head_dim)``, no conv (SGLang's slot holds a zero-element conv
    ``(0, 0)``: ``conv_kernel`` 1, whatever ``TPModel.conv_kernel`` says)."""

    num_heads: int
    head_dim: int


MambaDims = GDNDims | Mamba2Dims | Mamba1Dims | KDADims | ShortConvDims | LightningDims


@dataclass(frozen=True)
class TPModel:
    """What of a model's config decides how its state splits across TP ranks. The conv
    axis TP shards (``conv_slice_axis``: 1 for KDA's transposed conv) is the family's
    SGLang state shape's own, not a field here."""

    kv_heads: int | None = None  # MHA/GQA/SWA: global KV heads; None without such attention
    mla: bool = False  # MLA latent: replicated on every rank
    mamba: MambaDims | None = None
    conv_kernel: int = 4


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
    import_sglang()  # the import-time environment (torchvision placeholder, warnings)
    return importlib.import_module(name)


def _asked(tp: int, rank: int | None = None) -> str:
    """What a description-time refusal names in place of a file: the split asked for."""
    return f"sharding description (tp_size {tp}" + ("" if rank is None else f", rank {rank}") + ")"


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
        raise ReshardError(_asked(tp, rank), "attention kv heads", f"a split of {kv_heads} KV heads SGLang supports at tp_size {tp}", Phrase("not divisible"), detail=str(e) or None) from None


# SGLang's state shape of each family at ``tp``: its own classes, called with the arguments
# its model configs pass (configs/qwen3_next.py for GDN, models/mamba2.py, configs/kimi_linear.py,
# configs/mamba.py for Mamba-1, configs/lfm2.py, configs/bailing_hybrid.py and configs/minicpm.py for lightning)
_SHAPES = {
    GDNDims: lambda mu, m, tp, k: mu.Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=m.v_heads * m.v_dim, n_groups=m.k_heads, num_heads=m.v_heads, head_dim=m.v_dim,
        state_size=m.k_dim, conv_kernel=k, conv_shard_groups=[m.k_heads * m.k_dim, m.k_heads * m.k_dim, m.v_heads * m.v_dim]),
    Mamba2Dims: lambda mu, m, tp, k: mu.Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=m.intermediate, n_groups=m.n_groups, num_heads=m.num_heads, head_dim=m.head_dim,
        state_size=m.state_size, conv_kernel=k),
    Mamba1Dims: lambda mu, m, tp, k: mu.Mamba2StateShape.create_full_rank(
        tp_world_size=tp, intermediate_size=m.intermediate, state_size=m.state_size, conv_kernel=k),
    KDADims: lambda mu, m, tp, k: mu.KimiLinearStateShape.create(
        tp_world_size=tp, num_heads=m.num_heads, head_dim=m.head_dim, conv_kernel_size=k),
    # num_heads=tp: lfm2.py's "ensures divide works; temporal state is empty anyway"
    ShortConvDims: lambda mu, m, tp, k: mu.Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=m.hidden, n_groups=1, num_heads=tp, head_dim=m.hidden, state_size=0, conv_kernel=k),
    LightningDims: lambda mu, m, tp, k: mu.Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=0, n_groups=0, num_heads=m.num_heads, head_dim=m.head_dim, state_size=m.head_dim,
        conv_kernel=1),
}


def state_shape(m: MambaDims, tp: int, kernel: int = 4):
    """SGLang's state shape (``Mamba2StateShape`` / ``KimiLinearStateShape``) of ``m`` at ``tp``."""
    mu = _sg("sglang.srt.configs.mamba_utils")
    try:
        return _SHAPES[type(m)](mu, m, tp, kernel)
    except (AssertionError, ValueError) as e:
        raise ReshardError(_asked(tp), "mamba heads", f"a split SGLang supports at tp_size {tp}", Phrase(f"not divisible ({m})"), detail=str(e) or None) from None


def conv_slice_axis(m: MambaDims, kernel: int = 4) -> int:
    """The conv axis TP shards, as SGLang's state shape of the family says (KDA: 1)."""
    return int(getattr(state_shape(m, 1, kernel), "conv_slice_axis", 0))


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
        raise ReshardError(_asked(tp), "mamba n_groups", f"a multiple of tp_size {tp}, or 1 (replicated)", m.n_groups)
    settings = (groups * m.state_size, (groups - m.n_groups) * m.state_size, m.n_groups == 1)
    return [(m.intermediate, 0, False), settings, settings]


def _load_mamba_v2(m: GDNDims | Mamba2Dims, tp: int, rank: int, local: int) -> tuple[torch.Tensor, list[int]]:
    """GDN / Mamba2: the model's conv1d loader (``mamba_v2_sharded_weight_loader``)."""
    mamba = _sg("sglang.srt.layers.attention.mamba.mamba")
    spec = _conv_shard_spec(m, tp)
    ids = torch.arange(sum(full - extra for full, extra, _ in spec), dtype=torch.float32).reshape(-1, 1)
    param = torch.full((local, 1), -1.0)
    mamba.mamba_v2_sharded_weight_loader(spec, tp, rank)(param, ids)
    return param, [full // tp for full, _, _ in spec]


def _load_mamba1(m: Mamba1Dims, tp: int, rank: int, local: int) -> tuple[torch.Tensor, list[int]]:
    """Mamba-1: mamba1.py's ``conv1d``, a ``ColumnParallelLinear`` over the intermediate channels."""
    linear = _sg("sglang.srt.layers.linear")
    with _logical_tp(linear, tp, rank):
        layer = linear.ColumnParallelLinear(input_size=1, output_size=m.intermediate, bias=False, params_dtype=torch.float32)
        layer.weight.data.fill_(-1)
        layer.weight_loader(layer.weight, torch.arange(m.intermediate, dtype=torch.float32).reshape(-1, 1))
    if layer.weight.shape[0] != local:
        raise ReshardError(_asked(tp, rank), "mamba conv channels", local, layer.weight.shape[0])
    return layer.weight.data, [local]


def _load_kda(m: KDADims, tp: int, rank: int, local: int) -> tuple[torch.Tensor, list[int]]:
    """KDA: kimi_linear.py's ``qkv_conv1d``, a ``MergedColumnParallelLinear`` of three
    outputs (q, k, v), each loaded as its own shard (``q_conv1d``, ``k_conv1d``, ``v_conv1d``)."""
    linear = _sg("sglang.srt.layers.linear")
    size = m.num_heads * m.head_dim
    with _logical_tp(linear, tp, rank):
        layer = linear.MergedColumnParallelLinear(input_size=1, output_sizes=[size] * 3, bias=False, params_dtype=torch.float32)
        layer.weight.data.fill_(-1)
        for shard in range(3):
            ids = torch.arange(shard * size, (shard + 1) * size, dtype=torch.float32).reshape(-1, 1)
            layer.weight_loader(layer.weight, ids, shard)
    if layer.weight.shape[0] != local:
        raise ReshardError(_asked(tp, rank), "mamba conv channels", local, layer.weight.shape[0])
    return layer.weight.data, [size // tp] * 3


def _load_short_conv(m: ShortConvDims, tp: int, rank: int, local: int) -> tuple[torch.Tensor, list[int]]:
    """LFM2: lfm2.py's ``conv_weight``, loaded by ``sharded_weight_loader(0, parallel_group="tp")``."""
    linear = _sg("sglang.srt.layers.linear")
    weights = _sg("sglang.srt.model_loader.weight_utils")
    param = torch.full((local, 1), -1.0)
    with _logical_tp(linear, tp, rank):
        loader = weights.sharded_weight_loader(0, parallel_group="tp")
    loader(param, torch.arange(m.hidden, dtype=torch.float32).reshape(-1, 1))
    return param, [local]


# family -> how its conv weight is loaded (None: the conv slot has no element to place)
_CONV_LOADERS = {GDNDims: _load_mamba_v2, Mamba2Dims: _load_mamba_v2, Mamba1Dims: _load_mamba1, KDADims: _load_kda,
                 ShortConvDims: _load_short_conv, LightningDims: None}


def conv_channel_map(m: MambaDims, tp: int, rank: int, kernel: int = 4) -> tuple[list[int], list[tuple[int, int]]]:
    """Global conv channel of every local channel of rank ``rank`` (along the family's
    ``conv_slice_axis``), and the local ``(start, length)`` of each sub-block the model
    loads apart (GDN q, k, v; Mamba2 x, B, C; KDA q, k, v): SGLang's conv weight loader
    loading a weight whose rows are the global channel ids. A conv of no element
    (Lightning) holds no channel: ``([], [])``."""
    shape = state_shape(m, tp, kernel)
    loader = _CONV_LOADERS[type(m)]
    if loader is None:
        return [], []
    local = shape.conv[0][int(getattr(shape, "conv_slice_axis", 0))]
    param, sizes = loader(m, tp, rank, local)
    held = [int(x) for x in param.reshape(local, -1)[:, 0]]
    if any(h < 0 for h in held):
        raise ReshardError(_asked(tp, rank), "mamba conv channels", f"every local channel loaded at tp_size {tp}", Phrase("some not (non-divisible split)"))
    bounds, at = [], 0
    for n in sizes:
        bounds.append((at, n))
        at += n
    return held, bounds


def temporal_head_map(m: MambaDims, tp: int, rank: int, kernel: int = 4) -> tuple[list[int], int]:
    """Global temporal heads (axis 0 of the slot) rank ``rank`` holds, and on how many
    ranks each lives: value heads (GDN) / heads (Mamba2, KDA, Lightning), contiguous by
    rank as ``A_log`` and ``dt_bias`` load (Mamba-1: channels); LFM2's one zero-element
    "head" on every rank."""
    local = state_shape(m, tp, kernel).temporal[0]
    if isinstance(m, ShortConvDims):
        return list(range(local)), tp
    return list(range(rank * local, (rank + 1) * local)), 1


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
    """This rank's ``geometry.sharding`` (spec 5.7), derived from SGLang's sharding code.
    A conv slot of no element (Lightning's ``(0, 0)``) has no AXIS to describe (``global``
    is at least 1): ``conv`` is null, and a re-sharding restore has nothing of it to place."""
    if not 0 <= rank < tp:
        raise ReshardError(_asked(tp, rank), "identity.tp_rank", f"0..{tp - 1}", rank)
    attention = None
    if model.mla:
        attention = ShardAxis(1, 1, ((0, 1, tp),))  # the latent: one "head", on every rank
    elif model.kv_heads is not None:
        maps, replicas = zip(*(kv_head_map(model.kv_heads, tp, r) for r in range(tp)))
        attention = _axis_from_maps(1, model.kv_heads, [list(m) for m in maps], rank)
    conv = temporal = None
    if model.mamba is not None:
        m, k = model.mamba, model.conv_kernel
        whole = state_shape(m, 1, k)
        if math.prod(whole.conv[0]):
            maps, bounds = [], None
            for r in range(tp):
                held, b = conv_channel_map(m, tp, r, k)
                maps.append(held)
                bounds = b if r == rank else bounds
            axis = int(getattr(whole, "conv_slice_axis", 0))
            conv = (_axis_from_maps(axis, whole.conv[0][axis], maps, rank, bounds),)
        heads = [temporal_head_map(m, tp, r, k)[0] for r in range(tp)]
        temporal = _axis_from_maps(0, whole.temporal[0], heads, rank)
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


def plan(target: ShardAxis, sources: Sequence[ShardAxis], where: str, *, paths: Sequence | None = None) -> list[Run]:
    """Runs that fill the target's extent from the sources, each element from exactly one
    source (the lowest rank holding it: replicas are identical, one read is enough).
    ``paths`` name the source rank files in a refusal."""
    name = (lambda k: paths[k]) if paths else (lambda k: f"source rank {k}")
    for k, s in enumerate(sources):
        if s.global_size != target.global_size or s.axis != target.axis:
            raise ReshardError(name(k), where, f"axis {target.axis}, global {target.global_size} (the target's)",
                               Phrase(f"axis {s.axis}, global {s.global_size}"))
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
                raise ReshardError(os.path.dirname(paths[0]) if paths else "source ranks", where, f"global element {g} held by some source rank", Phrase("held by none"))
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


# --------------------------------------------------------------------------- the set agrees (spec 5.8)

# request fields (RequestRecord names) -> where they live in the header's request object
_REQUEST_FIELD_PATH = {
    "max_new_tokens": "stop.max_new_tokens", "min_new_tokens": "stop.min_new_tokens", "stop_strings": "stop.stop_strings",
    "stop_token_ids": "stop.stop_token_ids", "ignore_eos": "stop.ignore_eos", "streamed_tokens": "streamed.tokens",
    "streamed_text_chars": "streamed.text_chars", "reasoning_tokens": "streamed.reasoning_tokens",
    "reasoning_finished": "streamed.reasoning_finished",
}
_TP_FIELDS = ("identity.tp_size", "identity.tp_rank")


def _sources(snapset) -> list:
    return [snapset.ranks[r] for r in range(snapset.manifest.tp_size)]


def _agreed_fields(snap) -> dict:
    """Field -> value of everything every rank of a set must hold identically: identity
    but the rank, the request (header fields as a reader parses them, ``swa_start``) and
    each record section (dtype, shape, digest: equal digests, equal bytes)."""
    from hsnap_format.records import request_header_fields

    out = {k: v for k, v in snap.identity.binding().items() if k != "identity.tp_rank"}
    out["identity.snapshot_id"] = snap.identity.snapshot_id
    req = request_header_fields(snap.request, snap.path)
    for k, v in {**req["counts"], **req["fields"]}.items():
        out[f"request.{_REQUEST_FIELD_PATH.get(k, k)}"] = v
    out["request.swa_start"] = snap.swa_start
    for sec in snap.sections:
        if not sec.is_state:
            out[f"sections[{sec.name}]"] = (sec.dtype, sec.shape, sec.digest)
    return out


def check_set(snapset, expected) -> list:
    """Identity of every rank against the target (``expected``; all binding fields but the
    TP size and rank) and every rank against rank 0 (identity, request, record): typed
    refusals before anything is read or allocated. Returns the advisory numerics
    differences of every rank, once each."""
    from hsnap_format.records import numerics_differences

    ranks = _sources(snapset)
    numerics: list = []
    for s in ranks:
        if expected is None:
            break
        diffs = [d for d in identity_differences(expected, s.identity) if d[0] not in _TP_FIELDS]
        if diffs:
            raise IncompatibleSnapshotError(s.path, diffs)
        numerics += [d for d in numerics_differences(expected, s.identity) if d not in numerics]
    first = _agreed_fields(ranks[0])
    for s in ranks[1:]:
        mine = _agreed_fields(s)
        for key in dict.fromkeys([*first, *mine]):
            if first.get(key) != mine.get(key):
                raise InconsistentSetError(s.path, key, Phrase(f"{first.get(key)!r} (as in {os.path.basename(ranks[0].path)})"), mine.get(key))
    return numerics


def _check_set_axis(axes: Sequence[ShardAxis], paths: Sequence, field: str, tp: int, set_path) -> None:
    """Across the set: every element of the global axis is held, by exactly as many ranks
    as each holder's part says (``replicas``), which is at most ``tp``. A sweep over the
    parts' ends: cost in parts, never in elements."""
    events = []
    for k, ax in enumerate(axes):
        for i, (g, n, rep) in enumerate(ax.parts):
            if rep > tp:
                raise InconsistentSetError(paths[k], f"{field}.parts[{i}].replicas", f"at most tp_size {tp}", rep)
            events += [(g, 1, k, i), (g + n, 0, k, i)]  # at one position ends sort before starts
    events.sort()
    active: dict[tuple[int, int], int] = {}  # (rank, part) -> replicas, of the parts holding the stretch
    by_replicas: dict[int, int] = {}  # replicas -> how many active parts say it

    def stretch(a: int, b: int) -> None:
        if not active:
            raise InconsistentSetError(set_path, field, f"every global element 0..{axes[0].global_size - 1} held by some rank",
                                       Phrase(f"elements {a}..{b - 1} held by none"))
        if len(by_replicas) != 1 or len(active) not in by_replicas:
            (k, i), rep = next((ki, r) for ki, r in active.items() if r != len(active))
            raise InconsistentSetError(paths[k], f"{field}.parts[{i}].replicas",
                                       f"{len(active)} (the ranks holding global elements {a}..{b - 1})", rep)

    cursor = 0
    for x, start, k, i in events:
        if x > cursor:
            stretch(cursor, x)
            cursor = x
        rep = axes[k].parts[i][2]
        if start:
            active[k, i] = rep
            by_replicas[rep] = by_replicas.get(rep, 0) + 1
        else:
            del active[k, i]
            by_replicas[rep] -= 1
            if not by_replicas[rep]:
                del by_replicas[rep]
    if cursor < axes[0].global_size:
        stretch(cursor, axes[0].global_size)


# --------------------------------------------------------------------------- restore


@dataclass
class _SectionPlan:
    name: str
    axis: int
    runs: list[Run]
    src_shapes: list[tuple[int, ...]]  # per source rank (only used ranks matter)
    dst_shape: tuple[int, ...]
    itemsize: int

    @functools.cached_property
    def sources(self) -> list[int]:
        return sorted({r.src for r in self.runs})

    @property
    def nbytes(self) -> int:
        return math.prod(self.dst_shape) * self.itemsize


def _prove_tiling(runs: Sequence[Run], extent: int, src_extents: Sequence[int], where: str, path) -> None:
    """The runs cover target elements 0..extent-1 once each (no gap, no overlap), each from
    inside its source's extent: every byte of the target buffer will be written."""
    cursor = 0
    for r in sorted(runs, key=lambda r: r.dst_start):
        if r.dst_start != cursor or r.count < 1 or r.src_start < 0 or r.src_start + r.count > src_extents[r.src]:
            raise ReshardError(path, where, f"runs tiling the target's {extent} elements", Phrase(f"{r} at target element {cursor}"))
        cursor += r.count
    if cursor != extent:
        raise ReshardError(path, where, f"runs tiling the target's {extent} elements", Phrase(f"runs covering {cursor}"))


def build_plans(snapset, view, target: Sharding, path, *, target_tp: int | None = None, base_position: int = 0) -> list[_SectionPlan]:
    """One plan per state binding of the target, after every check of spec 5.8 that needs
    no section bytes: geometry of every rank, every description across the set, and the
    proof that the runs of each target section tile it from source sections of the
    shape the target expects. ``base_position``: a set of deltas (spec 5.9) whose
    attention sections hold the rows after it."""
    from hsnap_format.layout import state_section_rows

    ranks = _sources(snapset)
    src0 = ranks[0]
    paths = [s.path for s in ranks]
    try:  # the caller's description must describe its own pools
        Sharding.from_header(target.to_header(), view.geometry.attention, view.geometry.mamba, "target pools")
    except HsnapError as e:
        raise ReshardError(path, "sharding (target)", "a description of the target pools", Phrase(str(e))) from None
    expected = expected_target_geometry(src0.geometry, target)
    for s in ranks:  # every source rank: same layers, dtypes, dims but for its own extents
        found = expected_target_geometry(s.geometry, target)
        diffs = geometry_differences(view.geometry, found, ignore=GEOMETRY_NOT_COMPARED) if s is src0 else \
            geometry_differences(expected, found, ignore=GEOMETRY_NOT_COMPARED)
        if storage_differs(view.geometry.attention, s.geometry.attention):
            diffs.append(("geometry.attention.storage_dtype", view.geometry.attention.storage_dtype, s.geometry.attention.storage_dtype))
        if diffs:
            raise IncompatibleSnapshotError(s.path, diffs)
    # the target's own sections (shape, dtype) at the set's position: check_set proved every rank agrees on it
    target_rows = {r[0]: r for r in state_section_rows(view.geometry, src0.state_position, src0.swa_start, base_position)}
    plans, cache = [], {}
    for b in view.bindings:
        key = KIND_AXIS.get(b.kind)
        if key is None:
            raise ReshardError(path, f"sections[{b.name}]", "a state kind with a sharding description", b.kind)
        component = int(b.name.rsplit(".", 1)[1]) if b.kind == "conv" else 0
        field = f"geometry.sharding.{key}" + (f"[{component}]" if key == "conv" else "")
        row = target_rows.get(b.name)
        if row is not None and row[1] == b.kind and not math.prod(row[4]) and _axis_of(target, key, component) is None:
            # an undescribed section of no element (Lightning's conv (0, 0): an AXIS cannot
            # describe an empty axis): nothing to place, so no description to ask for; every
            # source rank still holds it, with the target's shape
            for s in ranks:
                info = s.section(b.name) if b.name in s else None
                if info is None or (info.shape, info.dtype) != (row[4], row[3]):
                    raise InconsistentSetError(s.path, f"sections[{b.name}]", Phrase(f"{row[3]} {list(row[4])}"),
                                               None if info is None else Phrase(f"{info.dtype} {list(info.shape)}"))
            plans.append(_SectionPlan(b.name, 0, [], [row[4]] * len(ranks), row[4], DTYPES[row[3]].itemsize))
            continue
        if field not in cache:
            tgt = _axis_of(target, key, component)
            if tgt is None:
                raise ReshardError(path, f"{field} (target)", "described", Phrase(f"absent: cannot re-shard {b.name}"))
            for i, (_, _, rep) in enumerate(tgt.parts):
                if target_tp is not None and rep > target_tp:
                    raise ReshardError(path, f"{field}.parts[{i}].replicas (target)", f"at most tp_size {target_tp}", rep)
            srcs = []
            for s in ranks:
                ax = _axis_of(s.geometry.sharding, key, component)
                if ax is None:
                    raise ReshardError(s.path, field, "described (format 1.1, feature tp-sharding)", Phrase(f"absent: cannot re-shard {b.name}"))
                srcs.append(ax)
            runs = plan(tgt, srcs, field, paths=paths)  # same axis and global as the target, or refused
            _check_set_axis(srcs, paths, field, len(ranks), snapset.path)
            cache[field] = (tgt, srcs, runs)
        tgt, srcs, runs = cache[field]
        if row is None or row[1] != b.kind:
            raise ReshardError(path, f"sections[{b.name}]", "a section of the target's plan", Phrase("not planned"))
        dst_shape, dtype = row[4], row[3]
        # each source section: the target's rows and inner extent, its own extent on the sharded axis
        src_shapes = []
        for s, ax in zip(ranks, srcs):
            want = dst_shape[: tgt.axis] + (ax.local_size,) + dst_shape[tgt.axis + 1 :]
            info = s.section(b.name) if b.name in s else None
            if info is None or (info.shape, info.dtype) != (want, dtype):
                raise InconsistentSetError(s.path, f"sections[{b.name}]", Phrase(f"{dtype} {list(want)}"),
                                           None if info is None else Phrase(f"{info.dtype} {list(info.shape)}"))
            src_shapes.append(info.shape)
        _prove_tiling(runs, dst_shape[tgt.axis], [ax.local_size for ax in srcs], f"{field} for sections[{b.name}]", path)
        plans.append(_SectionPlan(b.name, tgt.axis, runs, src_shapes, dst_shape, DTYPES[dtype].itemsize))
    return plans


_PIECE = 2 << 20  # read and hash 2 MiB at a time, and slice each piece while it is in cache


def _read_runs(snap, p: _SectionPlan, src: int, runs: list[Run], out: np.ndarray, check: bool,
               buf: np.ndarray | None = None) -> tuple[int, int]:
    """Read source rank ``src``'s section ``p.name`` whole, in order, 2 MiB at a time
    (into ``buf``, reused while it stays in cache), hashing every byte (``check``), and
    copy its ``runs`` (row slices) into the target bytes ``out`` — the slots themselves,
    or a buffer uploaded only after this returns; with ``check`` the digest is compared
    once the last piece is in (what is uploaded was hashed). Returns (bytes read, bytes
    written into ``out``)."""
    info = snap.section(p.name)
    shape, axis = p.src_shapes[src], p.axis
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1 :]) * p.itemsize
    row = shape[axis] * inner  # bytes of one outer row (a token) of the source
    dst = out.reshape(outer, p.dst_shape[axis] * inner)
    cols = [(r.src_start * inner, (r.src_start + r.count) * inner, r.dst_start * inner) for r in runs]
    h = xxhash.xxh3_128() if check else None
    if buf is None:
        buf = np.empty(min(_PIECE, info.length), dtype=np.uint8)  # scratch: only bytes just read are used
    rows_per_piece = _PIECE // row if 0 < row <= _PIECE else 0  # 0: a row is longer than a piece
    at = written = 0
    while at < info.length:
        o, c = divmod(at, row)
        n_rows = min(rows_per_piece, outer - o)
        n = n_rows * row if rows_per_piece else min(_PIECE, row - c)
        piece = buf[:n]
        snap._read(info.offset + at, n, memoryview(piece))
        if h is not None:
            h.update(piece)
        if rows_per_piece:  # whole rows: one strided copy per run
            block = piece.reshape(n_rows, row)
            for a, b, d in cols:
                dst[o : o + n_rows, d : d + b - a] = block[:, a:b]
                written += n_rows * (b - a)
        else:  # bytes c..c+n of row o
            for a, b, d in cols:
                lo, hi = max(a, c), min(b, c + n)
                if lo < hi:
                    dst[o, d + lo - a : d + hi - a] = piece[lo - c : hi - c]
                    written += hi - lo
        at += n
    if h is not None and h.hexdigest() != info.digest:
        raise DigestMismatchError(snap.path, f"sections[{p.name!r}].digest", info.digest, h.hexdigest())
    return info.length, written


def _assemble(sources, p: _SectionPlan, out: np.ndarray, check: bool, path, buf: np.ndarray) -> int:
    """Target section ``p`` into ``out`` from every source section it depends on, each read
    whole once (:func:`_read_runs`); refuses a byte count short of ``out`` (the second
    guard behind the tiling proof). Returns the source bytes read."""
    read = written = 0
    for k in p.sources:
        got, wrote = _read_runs(sources[k], p, k, [r for r in p.runs if r.src == k], out, check, buf)
        read += got
        written += wrote
    if written != out.nbytes:
        raise ReshardError(path, f"sections[{p.name}]", f"{out.nbytes} bytes assembled from the source ranks", Phrase(f"{written} bytes"))
    return read


def _checked_record(sources, plans: Sequence[_SectionPlan], mode, path):
    """The set's record, read hashed, after (``mode`` "before") every source section the
    plans depend on was verified — refusals before anything is allocated — and (any
    checking mode) the other ranks' record sections were hashed: :func:`check_set`
    compared them by their table digests only."""
    try:
        if mode == "before":
            for p in plans:
                for k in p.sources:
                    sources[k].verify_section(p.name)
        if mode is not None:
            for s in sources[1:]:
                for sec in s.sections:
                    if not sec.is_state:
                        s.verify_section(sec)
        # hashed as read (what is returned was hashed); check_set proved every rank's record has these digests
        return sources[0].record(verify=mode is not None)
    except OSError as e:
        raise HsnapIOError(path, "read", e) from None


@dataclass
class ProvenReshard:
    """What :func:`prove_resharded` checked of a set, before anything is allocated: what
    :func:`upload_resharded` allocates for and assembles."""

    snapset: Any
    sources: list
    plans: list
    record: Any
    numerics: list
    verify: Any


def prove_resharded(snapset, view, *, identity, target: Sharding, target_tp: int, verify, capacity: bool = True,
                    stacklevel: int = 3) -> ProvenReshard:
    """Every refusal of a re-sharded restore that comes before allocating (``capacity``
    False: but the pools' free room, which a caller may make before the upload): the set agrees (:func:`check_set`), every rank's geometry and description fit, the runs
    of every target section provably tile it (:func:`build_plans`), and — ``verify`` True —
    every source section it depends on is verified and the record is read hashed."""
    mode = verify_mode(verify)
    path = snapset.path
    numerics = check_set(snapset, identity)
    if numerics:
        warnings.warn(NumericsWarning(f"{path}: written under other numerics: bit-exactness is not expected"), stacklevel=stacklevel)
    plans = build_plans(snapset, view, target, path, target_tp=target_tp)
    sources = _sources(snapset)
    if capacity:
        check_capacity(sources[0], view)  # (the cheap refusal first; checked again right before allocating)
    record = _checked_record(sources, plans, mode, path)
    return ProvenReshard(snapset, sources, plans, record, numerics, verify)


def upload_resharded(proven: ProvenReshard, view, *, exact_rollback: bool, staging_bytes: int):
    """A set :func:`prove_resharded` accepted, into this target rank. Under the pool lock:
    capacity (what a caller freed meanwhile counts); allocate; assemble each target section
    from its source sections, each read whole once and hashed (but for ``verify=False``;
    :func:`_assemble`), straight into the slots when they are one run of a CPU pool (as the
    plain path preads into them: a digest or byte-count mismatch is found after the bytes
    landed and rolled back) or else into one scratch buffer, checked before it is uploaded;
    any failure gives every allocation back, the written slots' old bytes with
    ``exact_rollback`` (:func:`hsnap_io.slots.raise_upload_failure`)."""
    sources, plans, path = proven.sources, proven.plans, proven.snapset.path
    mode = verify_mode(proven.verify)
    src0 = sources[0]
    used = source_ranks_of(plans)
    piece = np.empty(_PIECE, dtype=np.uint8)  # every source byte passes through it, 2 MiB at a time
    scratch = None
    read = uploaded = 0
    with pool_lock(view.req_to_token_pool):
        check_capacity(src0, view)
        for k in used:
            sources[k].check_unchanged()
        checkpoint = PoolCheckpoint(view)
        engine = engine_for(view.device, staging_bytes)
        # capability of the engine: the slots as one writable host array (CPU pools, one run)
        slots_view = getattr(engine, "slots_view", None)
        where = "allocation"
        try:
            row, slots, floor = allocate(view, src0.state_position, src0.swa_start, path, checkpoint)
            for b, p in zip(view.bindings, plans):
                where = f"sections[{p.name}]"
                rows = slots.rows(b.space).to(b.buffer.device)
                if exact_rollback:
                    checkpoint.remember_rows(b.buffer, rows, b.name)
                else:  # fresh slots: zeroed on a failure
                    checkpoint.scrub_rows(b.buffer, rows, b.name)
                # like the plain path: straight into the slots when they are one run (hashed as it
                # lands; a mismatch rolled back), else through one scratch buffer (checked first)
                out = slots_view(b.buffer, rows, b.host_rows) if slots_view is not None else None
                direct = out is not None and out.nbytes == p.nbytes
                if not direct:
                    if scratch is None:
                        scratch = host_empty(max(q.nbytes for q in plans))
                    out = scratch[: p.nbytes]
                read += _assemble(sources, p, out, mode is not None, path, piece)
                if not direct:
                    engine.import_section(b.buffer, rows, out)
                uploaded += p.nbytes
            where = "finish upload"
            engine.finish_import()
        except BaseException as e:
            raise_upload_failure(engine, checkpoint, path, e, where)
    return RestoredRequest(
        req_pool_idx=row,
        token_indices=slots.token,
        mamba_pool_idx=None if slots.mamba is None else int(slots.mamba[0]),
        record=proven.record,
        state_position=src0.state_position,
        snapshot_id=src0.identity.snapshot_id,
        bytes_uploaded=uploaded,
        numerics_differences=proven.numerics,
        swa_evict_floor=floor,
        source_bytes_read=read,
        source_ranks=tuple(used),
    )


# --------------------------------------------------------------------------- a set of deltas, re-sharded (live migration)


def check_delta_set(deltaset, baseset, view, *, identity, target: Sharding, target_tp: int) -> list[_SectionPlan]:
    """The refusals of a TP N set of deltas (spec 5.9) applied over ``baseset`` — the set
    this target rank applied last, kept open — that need no section bytes, before anything
    is allocated: the set agrees with itself and the target (:func:`check_set`:
    :class:`InconsistentSetError` where its ranks disagree); it has the base's TP size and
    each rank file names, by root digest, snapshot id, position and depth, the same rank
    of ``baseset`` and is a delta of it (same request, model, rank, geometry); no page
    store; and the runs of every target section — the delta's rows after the base's
    position, the whole recurrent state — tile it (:func:`build_plans`). Returns the plans."""
    from hsnap_format.chain import LinkFacts, check_link, check_ref
    from hsnap_format.errors import ChainError, UnsupportedFeatureError

    path = deltaset.path
    if deltaset.manifest.tp_size != baseset.manifest.tp_size:
        raise ChainError(path, "manifest.tp_size", Phrase(f"{baseset.manifest.tp_size} (the set applied last, {baseset.path})"),
                         deltaset.manifest.tp_size)
    check_set(deltaset, identity)  # numerics: warned once, by the first link's restore
    for d, b in zip(_sources(deltaset), _sources(baseset)):
        if d.base is None:
            raise ChainError(d.path, "base", Phrase(f"a delta of the link applied last ({b.path})"), Phrase("a plain snapshot"))
        if d.pages is not None:
            raise UnsupportedFeatureError(d.path, "migrating a link that references pages", Phrase("a self-contained link"),
                                          Phrase(f"pages in {d.pages.store!r}"))
        check_ref(d.base, b, d.path)
        check_link(LinkFacts.of_snapshot(b), LinkFacts.of_snapshot(d), d.path)
    return build_plans(deltaset, view, target, path, target_tp=target_tp, base_position=baseset.ranks[0].state_position)


def delta_set_record(deltaset, plans: Sequence[_SectionPlan], verify: bool):
    """The set's record, after (``verify``) every source section the plans depend on was
    hashed and the other ranks' record sections too: still before anything is allocated."""
    return _checked_record(_sources(deltaset), plans, "before" if verify else None, deltaset.path)


def source_ranks_of(plans: Sequence[_SectionPlan]) -> list[int]:
    """The source ranks whose sections the plans read."""
    return sorted({k for p in plans for k in p.sources})


def upload_delta_set(deltaset, plans: Sequence[_SectionPlan], view, dests: dict, engine, check: bool, at: list) -> tuple[int, int]:
    """Each target section of the set of deltas into ``dests[space]`` (the delta's fresh
    token slots, the request's Mamba slot), assembled from the source sections it depends
    on — each read whole once, 2 MiB at a time, hashed with ``check`` (:func:`_assemble`) —
    as :func:`upload_resharded` assembles: straight into the slots when they are one run of
    a CPU pool (the Mamba slot always is; a digest or byte-count mismatch found after the
    bytes landed is the caller's to roll back), else into one scratch buffer checked before
    it is uploaded. ``at[0]`` names the section in progress (for the caller's rollback
    message). Returns (bytes uploaded, source bytes read)."""
    sources = _sources(deltaset)
    piece = np.empty(_PIECE, dtype=np.uint8)
    slots_view = getattr(engine, "slots_view", None)
    scratch = None
    read = uploaded = 0
    for b, p in zip(view.bindings, plans):
        at[0] = f"sections[{p.name}]"
        rows = dests[b.space].to(b.buffer.device)
        out = slots_view(b.buffer, rows, b.host_rows) if slots_view is not None and p.nbytes else None
        direct = out is not None and out.nbytes == p.nbytes
        if not direct:
            if scratch is None:
                scratch = host_empty(max(q.nbytes for q in plans))
            out = scratch[: p.nbytes]
        read += _assemble(sources, p, out, check, deltaset.path, piece)
        if not direct and p.nbytes:
            engine.import_section(b.buffer, rows, out)
        uploaded += p.nbytes
    return uploaded, read


__all__ = ["TPModel", "GDNDims", "Mamba2Dims", "Mamba1Dims", "KDADims", "ShortConvDims", "LightningDims", "MambaDims", "describe", "plan", "Run", "ReshardError", "InconsistentSetError",
           "prove_resharded", "upload_resharded", "ProvenReshard", "kv_head_map", "conv_channel_map", "temporal_head_map", "conv_slice_axis", "state_shape", "check_delta_set", "delta_set_record", "source_ranks_of",
           "upload_delta_set"]
