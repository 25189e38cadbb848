"""Compatibility of a snapshot with a reference, field by field (no Textual).

The reference is another snapshot (file or directory) or a JSON file holding an
identity: a bare identity object, ``{"identity": ..., "geometry": ...}``, or the
output of ``hsnap info --json`` (its first rank).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from hsnap_format import Geometry, Identity, MalformedHeaderError, open_snapshot
from hsnap_format.tools.diff import rank_map

from .model import display_name

MAX_JSON_BYTES = 4 << 20
INFO_FIELDS = ("snapshot_id", "created_at", "device", "hsnap_version")

# how a differing field counts: strict fields break compatibility
STRICT, ADVISORY, INFO = "strict", "advisory", "info"


@dataclass(frozen=True)
class Reference:
    label: str
    identity: Identity
    geometry: Geometry | None


@dataclass(frozen=True)
class CompatRow:
    field: str
    this: Any
    other: Any
    level: str

    @property
    def same(self) -> bool:
        return self.this == self.other

    @property
    def verdict(self) -> str:
        if self.same:
            return "same"
        return {STRICT: "DIFFERS", ADVISORY: "differs (advisory)", INFO: "differs (info)"}[self.level]


def load_reference(path, rank: int = 0) -> Reference:
    """Read a reference; raises :class:`HsnapError` (a JSON error included)."""
    path = os.fspath(path)
    if os.path.isdir(path) or not path.endswith(".json"):
        with open_snapshot(path) as snap:
            ranks = rank_map(snap)
            s = ranks.get(rank, ranks[min(ranks)])
            return Reference(display_name(path), s.identity, s.geometry)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise MalformedHeaderError(path, "identity file", detail=f"{type(e).__name__}: {e.strerror or e}") from None
    if len(data) > MAX_JSON_BYTES:
        raise MalformedHeaderError(path, "identity file", f"<= {MAX_JSON_BYTES} bytes", len(data))
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise MalformedHeaderError(path, "identity file", detail=f"not JSON: {e}") from None
    if isinstance(obj, dict) and isinstance(obj.get("ranks"), list) and obj["ranks"]:
        obj = obj["ranks"][0]  # hsnap info --json
    if isinstance(obj, dict) and "identity" in obj:
        geom = obj.get("geometry")
        return Reference(display_name(path), Identity.from_header(obj["identity"], path),
                         None if geom is None else Geometry.from_header(geom, path, parallel_layers=None))  # no file's features here
    return Reference(display_name(path), Identity.from_header(obj, path), None)


def compat_rows(identity: Identity, geometry: Geometry, ref: Reference) -> list[CompatRow]:
    """Every compared field, strict ones first."""
    rows = []
    this, other = identity.binding(), ref.identity.binding()
    rows += [CompatRow(k, this[k], other[k], STRICT) for k in this]
    if ref.geometry is not None:
        this_g, other_g = geometry.flat(), ref.geometry.flat()
        rows += [CompatRow(k, this_g.get(k), other_g.get(k), STRICT) for k in dict.fromkeys([*this_g, *other_g])]
    for k in sorted(set(identity.numerics) | set(ref.identity.numerics)):
        rows.append(CompatRow(f"identity.numerics.{k}", identity.numerics.get(k), ref.identity.numerics.get(k), ADVISORY))
    rows += [CompatRow(f"identity.{k}", getattr(identity, k), getattr(ref.identity, k), INFO) for k in INFO_FIELDS]
    return rows


def is_compatible(rows: list[CompatRow]) -> bool:
    return all(r.same for r in rows if r.level == STRICT)


__all__ = ["Reference", "CompatRow", "load_reference", "compat_rows", "is_compatible"]
