"""Typed records of a request snapshot: identity, geometry and the request record.

Each record converts to and from its header object (plain JSON values) and
validates what it reads, raising :class:`MalformedHeaderError` that names the
field. Bulk arrays of the request record (token ids, logprobs, RNG state) are
sections, not header text; :class:`RequestRecord` holds them as numpy arrays.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import IncompatibleSnapshotError, MalformedHeaderError, Phrase
from .spec import (
    DTYPES,
    MAX_BASE_NAME_BYTES,
    MAX_CHAIN_DEPTH,
    MAX_NDIM,
    MAX_PAGE_SIZE,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRING_LENGTH,
    PARALLEL_LAYERS_FEATURE,
)

_MAX_INT = 2**53 - 1
_MAX_LAYER = (1 << 16) - 1  # section tables hold layer ids < 2**16


class HeaderFields:
    """Typed access to one JSON object of the header; errors name the dotted field.

    A default is the JSON value the spec names for an absent key (``[]``, not ``()``: it
    passes the same type check as a value written in the file). With ``fill`` (the
    reader's own decoded header) an absent key is set to its default, so every consumer of
    ``Snapshot.header`` sees what the file means, never a KeyError (spec R-5-3)."""

    def __init__(self, obj: Any, where: str, path, fill: bool = False) -> None:
        if not isinstance(obj, dict):
            raise MalformedHeaderError(path, where, "an object", type(obj).__name__)
        self.obj, self.where, self.path, self.fill = obj, where, path, fill

    def _err(self, key, expected, found):
        return MalformedHeaderError(self.path, f"{self.where}.{key}", expected, found)

    def raw(self, key, default=dataclasses.MISSING):
        if key not in self.obj:
            if default is dataclasses.MISSING:
                raise self._err(key, "present", "missing")
            if self.fill:
                self.obj[key] = copy.deepcopy(default)
            return default
        return self.obj[key]

    def str(self, key, default=dataclasses.MISSING, max_len=MAX_STRING_LENGTH) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str) or len(v) > max_len:
            raise self._err(key, f"a string of at most {max_len} code points", v if not isinstance(v, str) else Phrase(f"{len(v)} code points"))
        return v

    def int(self, key, default=dataclasses.MISSING, lo=0, hi=_MAX_INT) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._err(key, f"an integer in [{lo}, {hi}]", v)
        return v

    def opt_int(self, key, lo=0, hi=_MAX_INT):
        return None if self.raw(key, None) is None else self.int(key, lo=lo, hi=hi)

    def num(self, key, default=dataclasses.MISSING) -> float:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._err(key, "a number", v)
        return float(v)

    def bool(self, key, default=dataclasses.MISSING) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self._err(key, "true or false", v)
        return v

    # `builtins.` in the annotations below: inside this class `int` and `str` name the methods above
    def ints(self, key, default=dataclasses.MISSING, lo=0, hi=_MAX_INT, max_len=1 << 16) -> tuple[builtins.int, ...]:
        v = self.raw(key, default)
        if (
            not isinstance(v, list)
            or len(v) > max_len
            or not all(isinstance(i, int) and not isinstance(i, bool) and lo <= i <= hi for i in v)
        ):
            raise self._err(key, f"a list of at most {max_len} integers in [{lo}, {hi}]", v)
        return tuple(v)

    def strs(self, key, default=dataclasses.MISSING, max_len=MAX_STOP_STRINGS, max_each=MAX_STOP_STRING_LENGTH) -> tuple[builtins.str, ...]:
        v = self.raw(key, default)
        if not isinstance(v, list) or len(v) > max_len:
            raise self._err(key, f"a list of at most {max_len} strings", v if not isinstance(v, list) else Phrase(f"{len(v)} entries"))
        for i, x in enumerate(v):  # the entry, by index: a 5,000-character string is no use in a message
            if not isinstance(x, str) or len(x) > max_each:
                raise self._err(f"{key}[{i}]", f"a string of at most {max_each} code points",
                                x if not isinstance(x, str) else Phrase(f"{len(x)} code points"))
        return tuple(v)

    def dtype(self, key) -> builtins.str:
        v = self.raw(key)
        if not isinstance(v, str) or v not in DTYPES:  # isinstance first: a list is unhashable
            raise self._err(key, f"one of {sorted(DTYPES)}", v)
        return v

    def shape(self, key) -> tuple[builtins.int, ...]:
        return self.ints(key, max_len=MAX_NDIM, hi=(1 << 40) - 1)  # as the section table's dims (spec 5.2, 5.5)

    def sub(self, key, default=dataclasses.MISSING) -> "HeaderFields":
        return HeaderFields(self.raw(key, default), f"{self.where}.{key}", self.path, self.fill)

    def scalar_map(self, key) -> dict:
        """A flat object of JSON scalars (strings, numbers, booleans, null, lists of those)."""
        v = self.raw(key, {})
        ok = isinstance(v, dict) and all(
            isinstance(x, (str, int, float, bool, type(None)))
            or (isinstance(x, list) and all(isinstance(y, (str, int, float, bool)) for y in x))
            for x in v.values()
        )
        if not ok:
            raise self._err(key, "an object of scalars or lists of scalars", v)
        return dict(v)


# ---------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class Engine:
    name: str = "sglang"
    version: str = ""
    commit: str = ""


@dataclass(frozen=True)
class Identity:
    """Who wrote the snapshot and for what. The strict part (:data:`STRICT_IDENTITY_FIELDS`)
    must equal the target's; ``numerics`` is advisory (bit-exactness), the rest informational."""

    model_id: str
    weights_version: str
    engine: Engine = Engine()
    tp_size: int = 1
    tp_rank: int = 0
    weights_hash: str = ""
    device: str = ""
    snapshot_id: str = ""
    created_at: str = ""  # RFC 3339, UTC
    hsnap_version: str = ""
    numerics: Mapping[str, Any] = field(default_factory=dict)  # torch version, threads, backend

    def to_header(self) -> dict:
        d = dataclasses.asdict(self)
        d["numerics"] = dict(self.numerics)
        return d

    @classmethod
    def from_header(cls, obj, path=None, *, fill_defaults: bool = False) -> "Identity":
        f = HeaderFields(obj, "identity", path, fill_defaults)
        e = f.sub("engine")
        identity = cls(
            model_id=f.str("model_id"),
            weights_version=f.str("weights_version"),
            weights_hash=f.str("weights_hash", ""),
            engine=Engine(e.str("name"), e.str("version"), e.str("commit")),
            tp_size=f.int("tp_size", lo=1, hi=1 << 16),
            tp_rank=f.int("tp_rank", hi=1 << 16),
            device=f.str("device", ""),
            snapshot_id=f.str("snapshot_id", ""),
            created_at=f.str("created_at", ""),
            hsnap_version=f.str("hsnap_version", ""),
            numerics=f.scalar_map("numerics"),
        )
        if identity.tp_rank >= identity.tp_size:
            raise MalformedHeaderError(path, "identity.tp_rank", f"< tp_size {identity.tp_size}", identity.tp_rank)
        return identity

    def binding(self) -> dict[str, Any]:
        """The fields a target must match exactly, flattened to dotted names."""
        return {
            "identity.model_id": self.model_id,
            "identity.weights_version": self.weights_version,
            "identity.weights_hash": self.weights_hash,
            "identity.engine.name": self.engine.name,
            "identity.engine.version": self.engine.version,
            "identity.engine.commit": self.engine.commit,
            "identity.tp_size": self.tp_size,
            "identity.tp_rank": self.tp_rank,
        }


def identity_differences(expected: Identity, found: Identity) -> list[tuple[str, Any, Any]]:
    exp, got = expected.binding(), found.binding()
    return [(k, exp[k], got[k]) for k in exp if exp[k] != got[k]]


def numerics_differences(expected: Identity, found: Identity) -> list[tuple[str, Any, Any]]:
    keys = sorted(set(expected.numerics) | set(found.numerics))
    return [
        (f"identity.numerics.{k}", expected.numerics.get(k), found.numerics.get(k))
        for k in keys
        if expected.numerics.get(k) != found.numerics.get(k)
    ]


# ---------------------------------------------------------------------------- geometry

ATTENTION_KINDS = ("mha", "mla", "swa")  # mha covers GQA/MQA; swa = sliding window + full layers


@dataclass(frozen=True)
class AttentionGeometry:
    kind: str
    layers: tuple[int, ...]  # global ids of full-attention layers
    heads: int  # KV heads on this rank (1 for MLA)
    k_head_dim: int  # MLA: kv_lora_rank + qk_rope_head_dim
    v_head_dim: int  # MLA: 0 (V is part of the latent)
    dtype: str  # logical element type
    storage_dtype: str  # how the pool stores it (fp8 as uint8)
    page_size: int = 1
    swa_layers: tuple[int, ...] = ()
    swa_window: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    def to_header(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_header(cls, obj, path=None, *, fill_defaults: bool = False) -> "AttentionGeometry":
        f = HeaderFields(obj, "geometry.attention", path, fill_defaults)
        kind = f.raw("kind")
        if kind not in ATTENTION_KINDS:
            raise MalformedHeaderError(path, "geometry.attention.kind", f"one of {ATTENTION_KINDS}", kind)
        g = cls(
            kind=kind,
            layers=f.ints("layers", hi=_MAX_LAYER),
            heads=f.int("heads", lo=1, hi=1 << 16),
            k_head_dim=f.int("k_head_dim", lo=1, hi=1 << 20),
            v_head_dim=f.int("v_head_dim", hi=1 << 20),
            dtype=f.dtype("dtype"),
            storage_dtype=f.dtype("storage_dtype"),
            page_size=f.int("page_size", lo=1, hi=1 << 20),
            swa_layers=f.ints("swa_layers", [], hi=_MAX_LAYER),  # absent: [] (spec 5.2, R-5-3)
            swa_window=f.opt_int("swa_window"),
            kv_lora_rank=f.opt_int("kv_lora_rank"),
            qk_rope_head_dim=f.opt_int("qk_rope_head_dim"),
        )
        # kind-specific rules (spec 5.2): table of (applies, field, expected, found)
        mla = (g.kv_lora_rank or 0) + (g.qk_rope_head_dim or 0)
        rules = [
            (kind == "mla", "heads", 1, g.heads),
            (kind == "mla", "v_head_dim", 0, g.v_head_dim),
            (kind == "mla", "k_head_dim", f"kv_lora_rank + qk_rope_head_dim = {mla}", g.k_head_dim if g.k_head_dim != mla else f"kv_lora_rank + qk_rope_head_dim = {mla}"),
            (kind != "mla", "kv_lora_rank", None, g.kv_lora_rank),
            (kind != "mla", "qk_rope_head_dim", None, g.qk_rope_head_dim),
            (kind != "swa", "swa_layers", [], list(g.swa_layers)),
            (kind != "swa", "swa_window", None, g.swa_window),
            (True, "storage_dtype", f"itemsize {DTYPES[g.dtype].itemsize}", f"itemsize {DTYPES[g.storage_dtype].itemsize}"),
        ]
        for applies, name, expected, found in rules:
            if applies and expected != found:
                raise MalformedHeaderError(path, f"geometry.attention.{name}", f"{expected} for kind {kind!r}", found)
        ids = g.layers + g.swa_layers  # spec 5.6 (a page's namespace copies these fields: checked there too)
        if len(ids) != len(set(ids)):
            raise MalformedHeaderError(path, "geometry.attention", "each layer id once", sorted(ids))
        return g


@dataclass(frozen=True)
class MambaGeometry:
    layers: tuple[int, ...]  # global ids of Mamba/GDN layers
    conv_shapes: tuple[tuple[int, ...], ...]  # one per conv component, per slot
    conv_dtype: str
    temporal_shape: tuple[int, ...]
    temporal_dtype: str
    conv_slice_axis: int = 0  # the axis that TP shards (1 for KDA's transposed conv)

    def to_header(self) -> dict:
        return {
            "layers": list(self.layers),
            "conv_shapes": [list(s) for s in self.conv_shapes],
            "conv_dtype": self.conv_dtype,
            "temporal_shape": list(self.temporal_shape),
            "temporal_dtype": self.temporal_dtype,
            "conv_slice_axis": self.conv_slice_axis,
        }

    @classmethod
    def from_header(cls, obj, path=None, *, fill_defaults: bool = False) -> "MambaGeometry":
        f = HeaderFields(obj, "geometry.mamba", path, fill_defaults)
        shapes = f.raw("conv_shapes")
        if not isinstance(shapes, list) or not 1 <= len(shapes) <= 8:
            raise MalformedHeaderError(path, "geometry.mamba.conv_shapes", "a list of 1 to 8 shapes", shapes)
        conv = tuple(HeaderFields({f"conv_shapes[{i}]": s}, "geometry.mamba", path).shape(f"conv_shapes[{i}]") for i, s in enumerate(shapes))
        return cls(
            layers=f.ints("layers", hi=_MAX_LAYER),
            conv_shapes=conv,
            conv_dtype=f.dtype("conv_dtype"),
            temporal_shape=f.shape("temporal_shape"),
            temporal_dtype=f.dtype("temporal_dtype"),
            conv_slice_axis=f.int("conv_slice_axis", 0, hi=MAX_NDIM - 1),
        )


_MAX_PARTS = 64  # a GDN conv has 3 parts, Mamba2 x|B|C 3; room for more, not for a flood


@dataclass(frozen=True)
class ShardAxis:
    """How one rank's sections of one state kind relate to the global tensor (format 1.1,
    spec 5.7): along ``axis`` of the section shape, the rank's extent is the concatenation
    of ``parts``, each ``(global_offset, length, replicas)`` — a run of the global axis
    (``global_size`` long) that ``replicas`` ranks of the TP group hold."""

    axis: int
    global_size: int
    parts: tuple[tuple[int, int, int], ...]

    @property
    def local_size(self) -> int:
        return sum(n for _, n, _ in self.parts)

    def to_header(self) -> dict:
        return {"axis": self.axis, "global": self.global_size, "parts": [list(p) for p in self.parts]}

    @classmethod
    def from_header(cls, obj, where: str, path=None) -> "ShardAxis":
        f = HeaderFields(obj, where, path)
        axis = f.int("axis", hi=MAX_NDIM - 1)
        size = f.int("global", lo=1, hi=1 << 40)
        raw = f.raw("parts")
        if not isinstance(raw, list) or not 1 <= len(raw) <= _MAX_PARTS:
            raise MalformedHeaderError(path, f"{where}.parts", f"a list of 1 to {_MAX_PARTS} [offset, length, replicas]", raw)
        parts, cursor = [], 0
        for i, p in enumerate(raw):
            ok = isinstance(p, list) and len(p) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
            if not ok or p[1] < 1 or not 1 <= p[2] <= 1 << 16 or p[0] < cursor or p[0] + p[1] > size:
                expected = f"[offset >= {cursor}, length >= 1, replicas 1..65536] with offset + length <= global {size}"
                raise MalformedHeaderError(path, f"{where}.parts[{i}]", expected, p)
            cursor = p[0] + p[1]  # ascending, not overlapping
            parts.append(tuple(p))
        return cls(axis, size, tuple(parts))


@dataclass(frozen=True)
class Sharding:
    """Format 1.1 ``geometry.sharding``: this rank's share of each state kind. ``None`` for a
    kind means "not described" (a re-sharding restore refuses that kind by name)."""

    attention: ShardAxis | None = None  # attn_*, swa_*, mla_kv: axis 1 (heads)
    conv: tuple[ShardAxis, ...] | None = None  # one per conv component: axis conv_slice_axis
    temporal: ShardAxis | None = None

    def to_header(self) -> dict:
        return {
            "attention": None if self.attention is None else self.attention.to_header(),
            "conv": None if self.conv is None else [c.to_header() for c in self.conv],
            "temporal": None if self.temporal is None else self.temporal.to_header(),
        }

    @classmethod
    def from_header(cls, obj, attention: "AttentionGeometry | None", mamba: "MambaGeometry | None", path=None) -> "Sharding":
        f = HeaderFields(obj, "geometry.sharding", path)
        att, conv, tem = f.raw("attention"), f.raw("conv"), f.raw("temporal")  # spec 5.7: present, AXIS or null
        w = "geometry.sharding"
        out = cls(
            attention=None if att is None else ShardAxis.from_header(att, f"{w}.attention", path),
            conv=None if conv is None else _conv_axes(conv, path),
            temporal=None if tem is None else ShardAxis.from_header(tem, f"{w}.temporal", path),
        )
        # each description agrees with the shapes it describes (table: field, present, axis rule, local extent)
        checks: list[tuple[str, ShardAxis, int, tuple[int, ...]]] = []
        if out.attention is not None:
            if attention is None:
                raise MalformedHeaderError(path, f"{w}.attention", "null (geometry.attention is null)", "present")
            checks.append((f"{w}.attention", out.attention, 1, (0, attention.heads, 0)))
        if out.conv is not None or out.temporal is not None:
            if mamba is None:
                raise MalformedHeaderError(path, f"{w}.conv/temporal", "null (geometry.mamba is null)", "present")
            if out.conv is not None:
                if len(out.conv) != len(mamba.conv_shapes):
                    raise MalformedHeaderError(path, f"{w}.conv", f"{len(mamba.conv_shapes)} entries (one per conv_shapes)", len(out.conv))
                for i, c in enumerate(out.conv):
                    checks.append((f"{w}.conv[{i}]", c, mamba.conv_slice_axis, mamba.conv_shapes[i]))
            if out.temporal is not None:
                checks.append((f"{w}.temporal", out.temporal, out.temporal.axis, mamba.temporal_shape))
        for where, ax, axis, shape in checks:
            if ax.axis != axis or axis >= len(shape):
                raise MalformedHeaderError(path, f"{where}.axis", f"{axis} (< ndim {len(shape)})", ax.axis)
            if ax.local_size != shape[axis]:
                raise MalformedHeaderError(path, f"{where}.parts", f"lengths summing to the section extent {shape[axis]}", ax.local_size)
        return out


def _conv_axes(conv, path) -> tuple[ShardAxis, ...]:
    if not isinstance(conv, list) or not 1 <= len(conv) <= 8:
        raise MalformedHeaderError(path, "geometry.sharding.conv", "null or a list of 1 to 8 descriptions", conv)
    return tuple(ShardAxis.from_header(c, f"geometry.sharding.conv[{i}]", path) for i, c in enumerate(conv))


@dataclass(frozen=True)
class Geometry:
    attention: AttentionGeometry | None
    mamba: MambaGeometry | None = None
    start_layer: int = 0
    num_layers: int = 0  # layers of the model on this rank (pipeline stage)
    sharding: Sharding | None = None  # format 1.1; written only when set (a 1.0 file has none)

    def to_header(self) -> dict:
        out = {
            "attention": None if self.attention is None else self.attention.to_header(),
            "mamba": None if self.mamba is None else self.mamba.to_header(),
            "start_layer": self.start_layer,
            "num_layers": self.num_layers,
        }
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_header()
        return out

    @property
    def parallel_layers(self) -> tuple[int, ...]:
        """Layer ids in an attention group and in ``mamba.layers`` (spec 5.2, format 1.4): layers whose attention
        and Mamba mixer run side by side (FalconH1)."""
        if self.attention is None or self.mamba is None:
            return ()
        return tuple(sorted(set(self.attention.layers + self.attention.swa_layers) & set(self.mamba.layers)))

    @classmethod
    def from_header(cls, obj, path=None, *, fill_defaults: bool = False, parallel_layers: bool | None = False) -> "Geometry":
        """``parallel_layers``: the file requires feature ``parallel-layers`` (1.4): then, and only then, some layer
        ids are in an attention group and in ``mamba.layers`` (R-5.2-2).  None: a geometry read without its file's
        features (a description to compare with): either is accepted."""
        f = HeaderFields(obj, "geometry", path, fill_defaults)
        att, mam = f.raw("attention", None), f.raw("mamba", None)
        g = cls(
            attention=None if att is None else AttentionGeometry.from_header(att, path, fill_defaults=fill_defaults),
            mamba=None if mam is None else MambaGeometry.from_header(mam, path, fill_defaults=fill_defaults),
            start_layer=f.int("start_layer", 0, hi=1 << 16),
            num_layers=f.int("num_layers", 0, hi=1 << 16),
        )
        sh = f.obj.get("sharding")  # 1.1; absent stays absent (a 1.0 file has no such key)
        if sh is not None:
            g = dataclasses.replace(g, sharding=Sharding.from_header(sh, g.attention, g.mamba, path))
        mamba = list(g.mamba.layers if g.mamba else ())  # (attention's: AttentionGeometry.from_header)
        if len(mamba) != len(set(mamba)):
            raise MalformedHeaderError(path, "geometry.mamba.layers", "each layer id once", sorted(mamba))
        shared = g.parallel_layers
        if parallel_layers is not None and bool(shared) != parallel_layers:
            raise MalformedHeaderError(path, "geometry", Phrase(
                f"a layer id in an attention group and in mamba.layers exactly when {PARALLEL_LAYERS_FEATURE!r} is a required feature"),
                Phrase(f"layers {list(shared)} in both, {PARALLEL_LAYERS_FEATURE!r} not required" if shared
                       else f"no layer in both, {PARALLEL_LAYERS_FEATURE!r} required"))
        return g

    def flat(self) -> dict[str, Any]:
        """Dotted field -> value, for field-by-field comparison."""
        out: dict[str, Any] = {"geometry.start_layer": self.start_layer, "geometry.num_layers": self.num_layers}
        # sharding (1.1) is not a per-rank shape: a restore compares it by its own rules
        for part, obj in (("attention", self.attention), ("mamba", self.mamba)):
            out[f"geometry.{part}"] = None if obj is None else "present"
            if obj is None:
                continue
            for k, v in obj.to_header().items():
                out[f"geometry.{part}.{k}"] = v
        return out


def geometry_differences(expected: Geometry, found: Geometry, ignore=()) -> list[tuple[str, Any, Any]]:
    if (expected.start_layer, expected.num_layers, expected.attention, expected.mamba) == \
            (found.start_layer, found.num_layers, found.attention, found.mamba):
        return []  # every field flat() lists is equal (the usual case: a restore's own model)
    exp, got = expected.flat(), found.flat()
    keys = [k for k in dict.fromkeys(list(exp) + list(got)) if k not in ignore]
    return [(k, exp.get(k), got.get(k)) for k in keys if exp.get(k) != got.get(k)]


# ---------------------------------------------------------------------------- request


_TOKEN_ID_MAX = (1 << 31) - 1  # ids are stored as int32


def _token_ids(value, name: str) -> np.ndarray:
    """Token ids as int32, refusing what int32 would change (wrap-around, fractions)."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise MalformedHeaderError(None, f"request.{name}", "integer token ids", Phrase(f"{type(value).__name__} ({e})")) from None
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise MalformedHeaderError(None, f"request.{name}", "integer token ids", str(arr.dtype))
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _TOKEN_ID_MAX:
        raise MalformedHeaderError(None, f"request.{name}", f"ids in 0..{_TOKEN_ID_MAX}", lo if lo < 0 else hi)
    return np.ascontiguousarray(arr, dtype=np.int32)


def _floats(value, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise MalformedHeaderError(None, f"request.{name}", "numbers", Phrase(f"{type(value).__name__} ({e})")) from None
    if arr.size and arr.dtype.kind not in "fiu":
        raise MalformedHeaderError(None, f"request.{name}", "numbers", str(arr.dtype))
    return np.ascontiguousarray(arr, dtype=np.float32)


@dataclass
class RequestRecord:
    """One request as the scheduler knows it, at a committed token boundary.

    ``state_position`` is the number of positions whose KV rows and recurrent
    state the snapshot holds (usually ``len(prompt) + len(output) - 1``: the last
    sampled token has not been through forward yet). Penalty state
    (frequency/presence/repetition) is rebuilt from ``prompt_ids``/``output_ids``.
    """

    rid: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    state_position: int
    output_logprobs: np.ndarray | None = None
    top_logprob_ids: np.ndarray | None = None
    top_logprob_values: np.ndarray | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # normalized SamplingParams
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    streamed_tokens: int = 0  # output tokens already returned to the client
    streamed_text_chars: int = 0
    reasoning_tokens: int = 0  # of the output, how many were reasoning
    reasoning_finished: bool = False
    rng_state: bytes | None = None  # sampler generator state, opaque bytes
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Converted with checks: a silent cast would store another request than the one given.
        self.prompt_ids = _token_ids(self.prompt_ids, "prompt_ids").reshape(-1)
        self.output_ids = _token_ids(self.output_ids, "output_ids").reshape(-1)
        if self.output_logprobs is not None:
            self.output_logprobs = _floats(self.output_logprobs, "output_logprobs").reshape(-1)
        if self.top_logprob_ids is not None:
            self.top_logprob_ids = _token_ids(self.top_logprob_ids, "top_logprob_ids")
        if self.top_logprob_values is not None:
            self.top_logprob_values = _floats(self.top_logprob_values, "top_logprob_values")
        if isinstance(self.stop_strings, (str, bytes)) or not all(isinstance(x, str) for x in self.stop_strings):
            raise MalformedHeaderError(None, "request.stop.stop_strings", "a list of strings", self.stop_strings)
        self.stop_strings = tuple(self.stop_strings)
        self.stop_token_ids = tuple(int(t) for t in _token_ids(list(self.stop_token_ids), "stop.stop_token_ids"))

    @property
    def remaining_budget(self) -> int | None:
        return None if self.max_new_tokens is None else self.max_new_tokens - len(self.output_ids)

    @property
    def top_logprobs_k(self) -> int:
        return 0 if self.top_logprob_ids is None else int(self.top_logprob_ids.shape[1])

    def bulk_arrays(self) -> dict[str, np.ndarray]:
        """Section kind -> array, for the arrays present."""
        arrays = {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids}
        for kind in ("output_logprobs", "top_logprob_ids", "top_logprob_values"):
            if getattr(self, kind) is not None:
                arrays[kind] = getattr(self, kind)
        if self.rng_state is not None:
            arrays["rng_state"] = np.frombuffer(bytes(self.rng_state), dtype=np.uint8)
        return arrays

    def to_header(self) -> dict:
        return {
            "rid": self.rid,
            "state_position": int(self.state_position),
            "prompt_tokens": len(self.prompt_ids),
            "output_tokens": len(self.output_ids),
            "has_logprobs": self.output_logprobs is not None,
            "top_logprobs_k": self.top_logprobs_k,
            "has_rng_state": self.rng_state is not None,
            "sampling": dict(self.sampling),
            "stop": {
                "max_new_tokens": self.max_new_tokens,
                "min_new_tokens": self.min_new_tokens,
                "stop_strings": list(self.stop_strings),
                "stop_token_ids": list(self.stop_token_ids),
                "ignore_eos": self.ignore_eos,
            },
            "remaining_budget": self.remaining_budget,
            "streamed": {
                "tokens": self.streamed_tokens,
                "text_chars": self.streamed_text_chars,
                "reasoning_tokens": self.reasoning_tokens,
                "reasoning_finished": self.reasoning_finished,
            },
            "extra": dict(self.extra),
        }

    def validate(self, path=None) -> None:
        """Cross-field rules of the record (spec: Request record)."""
        # The header's own rules first (types, ranges, scalar-only sampling/extra), so the
        # writer refuses exactly what the reader would refuse instead of writing it.
        request_header_fields(self.to_header(), path)
        check_request_counts(
            {
                "state_position": self.state_position,
                "streamed_tokens": self.streamed_tokens,
                "reasoning_tokens": self.reasoning_tokens,
                "max_new_tokens": self.max_new_tokens,
            },
            {"prompt_tokens": len(self.prompt_ids), "output_tokens": len(self.output_ids)},
            path,
        )
        n_out = len(self.output_ids)
        for name in ("output_logprobs", "top_logprob_ids", "top_logprob_values"):
            v = getattr(self, name)
            if v is not None and (v.shape[0] != n_out or v.ndim != (1 if name == "output_logprobs" else 2)):
                raise MalformedHeaderError(path, f"request.{name}", f"{n_out} rows", list(v.shape))
        if self.top_logprob_ids is not None and (
            self.top_logprob_values is None or self.top_logprob_values.shape != self.top_logprob_ids.shape
        ):
            raise MalformedHeaderError(path, "request.top_logprob_values", "same shape as top_logprob_ids", None)


def check_request_counts(fields: dict, counts: dict, path=None) -> None:
    n_out = counts["output_tokens"]
    total = counts["prompt_tokens"] + n_out
    mnt = fields["max_new_tokens"]
    checks = [
        ("request.state_position", f"<= prompt + output = {total}", fields["state_position"], 0 <= fields["state_position"] <= total),
        ("request.streamed.tokens", f"<= output tokens {n_out}", fields["streamed_tokens"], 0 <= fields["streamed_tokens"] <= n_out),
        ("request.streamed.reasoning_tokens", f"<= output tokens {n_out}", fields["reasoning_tokens"], 0 <= fields["reasoning_tokens"] <= n_out),
        ("request.stop.max_new_tokens", f">= output tokens {n_out}", mnt, mnt is None or mnt >= n_out),
    ]
    for fld, exp, found, ok in checks:
        if not ok:
            raise MalformedHeaderError(path, fld, exp, found)


def request_header_fields(obj, path=None, *, fill_defaults: bool = False) -> dict:
    """Validate the header's request object; returns the scalar fields of a RequestRecord.
    ``fill_defaults``: set every absent key that has a default to it, in ``obj`` (see HeaderFields)."""
    f = HeaderFields(obj, "request", path, fill_defaults)
    stop, streamed = f.sub("stop"), f.sub("streamed")
    sampling = f.scalar_map("sampling")
    fields = dict(
        rid=f.str("rid"),
        state_position=f.int("state_position"),
        sampling=sampling,
        max_new_tokens=stop.opt_int("max_new_tokens"),
        min_new_tokens=stop.int("min_new_tokens", 0),
        stop_strings=stop.strs("stop_strings", []),  # absent: [] (spec 5.3, R-5-3)
        stop_token_ids=stop.ints("stop_token_ids", [], hi=(1 << 31) - 1, max_len=MAX_STOP_TOKEN_IDS),
        ignore_eos=stop.bool("ignore_eos", False),
        streamed_tokens=streamed.int("tokens", 0),
        streamed_text_chars=streamed.int("text_chars", 0),
        reasoning_tokens=streamed.int("reasoning_tokens", 0),
        reasoning_finished=streamed.bool("reasoning_finished", False),
        extra=f.scalar_map("extra"),
    )
    counts = dict(
        prompt_tokens=f.int("prompt_tokens", hi=1 << 32),
        output_tokens=f.int("output_tokens", hi=1 << 32),
        has_logprobs=f.bool("has_logprobs"),
        top_logprobs_k=f.int("top_logprobs_k", 0, hi=1 << 12),
        has_rng_state=f.bool("has_rng_state", False),
    )
    budget = f.raw("remaining_budget", None)
    mnt = fields["max_new_tokens"]
    expected_budget = None if mnt is None else mnt - counts["output_tokens"]
    if budget != expected_budget or isinstance(budget, bool):
        raise MalformedHeaderError(path, "request.remaining_budget", expected_budget, budget)
    check_request_counts(fields, counts, path)
    return {"fields": fields, "counts": counts}


# ---------------------------------------------------------------------------- base (a delta's link)

_HEX32 = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class BaseRef:
    """What a delta names as its base (spec 5.9): the base's file or directory ``name``
    beside the delta, its trailer ``root_digest`` (what binds it), its ``snapshot_id`` and
    ``state_position`` (the delta's attention rows start there), and ``depth``, the number
    of links below the delta (1 when the base is a plain snapshot)."""

    name: str
    root_digest: str
    snapshot_id: str
    state_position: int
    depth: int = 1

    def to_header(self) -> dict:
        return {"depth": self.depth, "name": self.name, "root_digest": self.root_digest, "snapshot_id": self.snapshot_id,
                "state_position": self.state_position}

    @classmethod
    def from_header(cls, obj, path=None, *, state_position: int | None = None) -> "BaseRef":
        """Validate a header's ``base`` (R-5.9-2); ``state_position`` is the delta's own, which
        the base's may not exceed."""
        f = HeaderFields(obj, "base", path)
        name = check_store_name(f, "name")
        digest = f.raw("root_digest")
        if not isinstance(digest, str) or len(digest) != 32 or not set(digest) <= _HEX32:
            raise f._err("root_digest", "32 lowercase hex digits", digest)
        ref = cls(name=name, root_digest=digest, snapshot_id=f.str("snapshot_id"), state_position=f.int("state_position"),
                  depth=f.int("depth", lo=1, hi=MAX_CHAIN_DEPTH))
        if state_position is not None and ref.state_position > state_position:
            raise f._err("state_position", f"<= request.state_position {state_position}", ref.state_position)
        return ref


# ---------------------------------------------------------------------------- pages (stored once)

_HEX64 = 64


def _hex(v, n: int) -> bool:
    return isinstance(v, str) and len(v) == n and set(v) <= _HEX32


def check_store_name(f: "HeaderFields", key: str) -> str:
    """A name beside the file (spec 5.9 ``base.name``, 5.10 ``pages.store``): one file or
    directory name, never a path."""
    name = f.str(key)
    if not name or name in (".", "..") or "/" in name or "\0" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_BASE_NAME_BYTES:
        raise f._err(key, Phrase(f"one file or directory name: 1..{MAX_BASE_NAME_BYTES} bytes, no '/', not '.' or '..'"), name)
    return name


@dataclass(frozen=True)
class PagesRef:
    """What a snapshot that stores its full pages once names (spec 5.10, format 1.3): the page
    store beside it (``store``, a directory name), the ``page_size`` S its pages hold, the
    ``namespace_id`` of its identity, attention geometry and S (spec 5.10), and for each page
    of its range, in order, ``(key, root digest)``: the key is SGLang's page hash chain over
    the request's token ids, the root digest the page object's own (3.3)."""

    store: str
    page_size: int
    namespace_id: str
    refs: tuple[tuple[str, str], ...]

    @property
    def count(self) -> int:
        return len(self.refs)

    def to_header(self) -> dict:
        return {"namespace_id": self.namespace_id, "page_size": self.page_size, "refs": [list(r) for r in self.refs], "store": self.store}

    @classmethod
    def from_header(cls, obj, path=None) -> "PagesRef":
        """Validate a header's ``pages`` (R-5.10-2): every key present, in its type and range."""
        f = HeaderFields(obj, "pages", path)
        store = check_store_name(f, "store")
        page_size = f.int("page_size", lo=1, hi=MAX_PAGE_SIZE)  # every page object of it fits a header (spec 5.10)
        nid = f.raw("namespace_id")
        if not _hex(nid, _HEX64):
            raise f._err("namespace_id", "64 lowercase hex digits", nid)
        raw = f.raw("refs")
        if not isinstance(raw, list):
            raise f._err("refs", "a list of [key, root_digest]", raw)
        refs = []
        for i, r in enumerate(raw):
            if not (isinstance(r, list) and len(r) == 2 and _hex(r[0], _HEX64) and _hex(r[1], 32)):
                raise f._err(f"refs[{i}]", "[64 lowercase hex digits, 32 lowercase hex digits]", r)
            refs.append((r[0], r[1]))
        return cls(store=store, page_size=page_size, namespace_id=nid, refs=tuple(refs))


__all__ = [
    "PagesRef",
    "BaseRef",
    "Engine",
    "Identity",
    "AttentionGeometry",
    "MambaGeometry",
    "Geometry",
    "ShardAxis",
    "Sharding",
    "RequestRecord",
    "IncompatibleSnapshotError",
    "identity_differences",
    "geometry_differences",
    "numerics_differences",
]
