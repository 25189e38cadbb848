"""Whether a snapshot fits the target pools, from its header alone — identity and geometry
(:func:`check_compatible`) — and how its digests are to be checked (:func:`verify_mode`).
Shared by the plain restore, the re-sharded one and live migration; nothing here touches
the pools."""

from __future__ import annotations

from typing import Any

from hsnap_format import Identity, IncompatibleSnapshotError, Snapshot, geometry_differences, identity_differences, numerics_differences
from hsnap_format.spec import DTYPES

from .adapters import PoolView


class NumericsWarning(UserWarning):
    """The snapshot was written in another numerics environment: bit-exactness is not expected."""


# Geometry fields a restore does not compare as plain values: the page size is the
# pool's allocation unit (sections are per token, spec 5.2), and the storage type is
# compared by storage_differs.
GEOMETRY_NOT_COMPARED = ("geometry.num_layers", "geometry.attention.page_size", "geometry.attention.storage_dtype")


def storage_differs(target, snap) -> bool:
    """True when the attention storage types really differ. Same element format
    (``dtype``, compared separately), storage either that format itself or its byte
    view (``uint8`` for a 1-byte format, as SGLang stores fp8): the section bytes are
    the same either way and are copied as raw bytes."""
    if target is None or snap is None or target.storage_dtype == snap.storage_dtype:
        return False
    same_bytes = {target.dtype, "uint8"} if DTYPES[target.dtype].itemsize == 1 else {target.dtype}
    return target.dtype != snap.dtype or not {target.storage_dtype, snap.storage_dtype} <= same_bytes


def check_compatible(snap: Snapshot, view: PoolView, expected: Identity | None) -> list[tuple[str, Any, Any]]:
    diffs = [] if expected is None else identity_differences(expected, snap.identity)
    diffs += geometry_differences(view.geometry, snap.geometry, ignore=GEOMETRY_NOT_COMPARED)
    target, found = view.geometry.attention, snap.geometry.attention
    if storage_differs(target, found):
        diffs.append(("geometry.attention.storage_dtype", target.storage_dtype, found.storage_dtype))
    if diffs:
        raise IncompatibleSnapshotError(snap.path, diffs)
    return [] if expected is None else numerics_differences(expected, snap.identity)


# verify= argument -> how digests are checked (restore_request's docstring)
_VERIFY_MODES = {True: "before", "before": "before", "during": "during", False: None}


def verify_mode(verify) -> str | None:
    """``verify=`` as a mode: ``"before"``, ``"during"``, or None (no digest checked)."""
    if verify not in _VERIFY_MODES:
        raise ValueError(f"verify must be True, 'before', 'during' or False, not {verify!r}")
    return _VERIFY_MODES[verify]
