"""Compare two snapshots section by section, in the spirit of ``h5diff``.

Sections are paired by (rank, name); a single rank file counts as the rank its
identity names, so a rank file can be compared with a snapshot directory.
Values are compared chunk by chunk (memory stays bounded whatever the section
size), float kinds in float64. Two elements are *close* when they are equal,
both NaN, or ``|a - b| <= atol + rtol * max(|a|, |b|)`` (symmetric in A and B).

The report also lists header differences: identity (binding fields), geometry
and request fields count towards "differ"; informational identity fields
(snapshot id, creation time, device, numerics) are listed but do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np

from ..manifest import SnapshotSet
from ..reader import SectionInfo, Snapshot
from ..spec import DTYPES
from ..records import geometry_differences, identity_differences, numerics_differences
from ..errors import DigestMismatchError
from .stats import CHUNK_ELEMENTS, Cancelled, as_float64, is_float, iter_chunks

EQUAL = "equal"
DIFFER = "differ"
ONLY_A = "only-in-A"
ONLY_B = "only-in-B"
SHAPE_MISMATCH = "shape-mismatch"
CORRUPT = "digest-mismatch"  # a side fails its own digest: its bytes are not what was written
STATUSES = (EQUAL, DIFFER, ONLY_A, ONLY_B, SHAPE_MISMATCH, CORRUPT)

_INFO_FIELDS = ("snapshot_id", "created_at", "device", "hsnap_version")


# ---------------------------------------------------------------------------- arrays


@dataclass(frozen=True)
class ArrayDiff:
    count_differ: int
    max_abs_diff: float  # over pairs not both NaN; inf when one side is inf
    max_rel_diff: float  # |a - b| / max(|a|, |b|)
    first_index: int | None  # flat (C order) index of the first differing element
    first_a: Any = None
    first_b: Any = None


def compare_arrays(
    a: np.ndarray,
    b: np.ndarray,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    chunk_elements: int = CHUNK_ELEMENTS,
    stop_at_first: bool = False,
    cancelled: Callable[[], bool] | None = None,
) -> ArrayDiff:
    """Element-wise comparison of two arrays of the same size (dtypes may differ)."""
    if a.size != b.size:
        raise ValueError(f"sizes differ: {a.size} vs {b.size}")
    return compare_chunks(iter_chunks(a, chunk_elements, cancelled), iter_chunks(b, chunk_elements), a.dtype, b.dtype,
                          atol=atol, rtol=rtol, stop_at_first=stop_at_first, cancelled=cancelled)


def compare_chunks(chunks_a, chunks_b, dtype_a, dtype_b, *, atol: float = 0.0, rtol: float = 0.0,
                   stop_at_first: bool = False, cancelled: Callable[[], bool] | None = None) -> ArrayDiff:
    """Compare two streams of ``(start, 1-D chunk)`` cut at the same element boundaries.

    Both streams are always consumed to their end, also with ``stop_at_first`` (then
    without comparing further): a stream that verifies digests as it reads raises its
    verdict only after its last chunk, and a diff must never skip it.
    """
    exact_ints = not (is_float(dtype_a) or is_float(dtype_b))
    count, max_abs, max_rel, first = 0, 0.0, 0.0, None
    first_a = first_b = None
    comparing = True
    for start, ca in chunks_a:
        if cancelled is not None and cancelled():
            raise Cancelled()
        nxt = next(chunks_b, None)
        if nxt is None:  # B stopped early: cancelled between two chunks
            break
        cb = nxt[1]
        if not comparing:
            continue
        xa, xb = as_float64(ca), as_float64(cb)
        if exact_ints:  # int64 beyond 2**53 is not exact in float64
            equal = ca == cb
        else:
            with np.errstate(invalid="ignore"):
                equal = (xa == xb) | (np.isnan(xa) & np.isnan(xb))
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            d = np.abs(xa - xb)
            d[equal] = 0.0
            scale = np.maximum(np.abs(xa), np.abs(xb))
            close = equal | (np.isfinite(d) & (d <= atol + rtol * scale)) if (atol or rtol) else equal
            differ = ~close
            n = int(np.count_nonzero(differ))
            if not n:
                continue
            dd, sc = d[differ], scale[differ]
            dd, sc = dd[~np.isnan(dd)], sc[~np.isnan(dd)]  # one side NaN: counted, no magnitude
            if dd.size:
                max_abs = max(max_abs, float(dd.max()))
                rel = np.where(np.isinf(dd), np.inf, dd / sc)  # sc > 0: both zero would be equal
                max_rel = max(max_rel, float(rel.max()))
        count += n
        if first is None:
            i = int(np.argmax(differ))
            first = start + i
            first_a, first_b = _scalar(ca[i]), _scalar(cb[i])
        if stop_at_first:
            comparing = False
    for _ in chunks_b:  # runs B's end-of-stream digest check
        pass
    if cancelled is not None and cancelled():
        raise Cancelled()
    return ArrayDiff(count, max_abs, max_rel, first, first_a, first_b)


def _scalar(v):
    return float(v) if is_float(np.asarray(v).dtype) else np.asarray(v).item()


# ---------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class SectionPair:
    rank: int
    name: str
    a: SectionInfo | None
    b: SectionInfo | None
    snap_a: Snapshot | None = field(default=None, repr=False, compare=False)
    snap_b: Snapshot | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class SectionDiff:
    rank: int
    name: str
    status: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    elements: int = 0
    count_differ: int = 0
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    first_diff: tuple[int, ...] | None = None  # multi-index of the first differing element
    first_a: Any = None
    first_b: Any = None
    corrupt: str | None = None  # "A", "B" or "A+B": the side(s) failing their own digests

    @property
    def same(self) -> bool:
        return self.status == EQUAL

    @property
    def dtype_mismatch(self) -> bool:
        return None not in (self.dtype_a, self.dtype_b) and self.dtype_a != self.dtype_b

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "name": self.name,
            "status": self.status,
            "dtype": [self.dtype_a, self.dtype_b],
            "shape": [None if self.shape_a is None else list(self.shape_a), None if self.shape_b is None else list(self.shape_b)],
            "elements": self.elements,
            "count_differ": self.count_differ,
            "max_abs_diff": _json_num(self.max_abs_diff),
            "max_rel_diff": _json_num(self.max_rel_diff),
            "first_diff": None if self.first_diff is None else list(self.first_diff),
            "first_values": None if self.first_diff is None else [_json_num(self.first_a), _json_num(self.first_b)],
            "corrupt": self.corrupt,
        }


def _json_num(v):
    """JSON has no NaN/Infinity: write them as strings."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def rank_map(snap: Snapshot | SnapshotSet) -> dict[int, Snapshot]:
    """Rank -> Snapshot; a single rank file is the rank its identity names."""
    if isinstance(snap, SnapshotSet):
        return dict(snap.ranks)
    return {snap.identity.tp_rank: snap}


def section_pairs(a: Snapshot | SnapshotSet, b: Snapshot | SnapshotSet) -> list[SectionPair]:
    """Sections of A and B paired by (rank, name), in A's order then B's extras."""
    ra, rb = rank_map(a), rank_map(b)
    pairs = []
    for rank in sorted(set(ra) | set(rb)):
        sa, sb = ra.get(rank), rb.get(rank)
        by_a = {s.name: s for s in sa.sections} if sa else {}
        by_b = {s.name: s for s in sb.sections} if sb else {}
        for name in dict.fromkeys([*by_a, *by_b]):
            pairs.append(SectionPair(rank, name, by_a.get(name), by_b.get(name), sa, sb))
    return pairs


def compare_pair(pair: SectionPair, *, atol: float = 0.0, rtol: float = 0.0, **kw) -> SectionDiff:
    a, b = pair.a, pair.b
    if a is None or b is None:
        only = b if a is None else a
        assert only is not None  # a pair names a section of A, of B or of both
        return SectionDiff(pair.rank, pair.name, ONLY_B if a is None else ONLY_A,
                           dtype_a=None if a is None else a.dtype, dtype_b=None if b is None else b.dtype,
                           shape_a=None if a is None else a.shape, shape_b=None if b is None else b.shape,
                           elements=math.prod(only.shape))
    diff = partial(SectionDiff, pair.rank, pair.name, dtype_a=a.dtype, dtype_b=b.dtype, shape_a=a.shape, shape_b=b.shape,
                   elements=math.prod(a.shape))
    if a.shape != b.shape:
        return diff(SHAPE_MISMATCH)
    chunk_elements = kw.pop("chunk_elements", CHUNK_ELEMENTS)
    cancelled = kw.get("cancelled")
    # Read with pread and verify both sides while comparing: values of a file that fails
    # its own digests are not reported as "equal" (and a truncation is a typed error).
    corrupt = []

    def verified(snap, info, side):
        try:
            yield from snap.iter_chunks(info, chunk_elements, verify=True, cancelled=cancelled)
        except DigestMismatchError as e:
            corrupt.append((side, e))

    r = compare_chunks(verified(pair.snap_a, a, "A"), verified(pair.snap_b, b, "B"), DTYPES[a.dtype], DTYPES[b.dtype],
                       atol=atol, rtol=rtol, **kw)
    if corrupt:
        return diff(CORRUPT, corrupt="+".join(side for side, _ in corrupt))
    status = DIFFER if r.count_differ or a.dtype != b.dtype else EQUAL
    first = None if r.first_index is None else tuple(int(i) for i in np.unravel_index(r.first_index, a.shape))
    return diff(status, count_differ=r.count_differ, max_abs_diff=r.max_abs_diff, max_rel_diff=r.max_rel_diff,
                first_diff=first, first_a=r.first_a, first_b=r.first_b)


def iter_section_diffs(a, b, *, atol: float = 0.0, rtol: float = 0.0, **kw) -> Iterator[SectionDiff]:
    for pair in section_pairs(a, b):
        yield compare_pair(pair, atol=atol, rtol=rtol, **kw)


# ---------------------------------------------------------------------------- headers


def _flatten(obj, prefix: str) -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    return {prefix: obj}


def _differences(fa: dict, fb: dict) -> list[tuple[str, Any, Any]]:
    keys = dict.fromkeys([*fa, *fb])
    return [(k, fa.get(k), fb.get(k)) for k in keys if fa.get(k) != fb.get(k)]


@dataclass(frozen=True)
class HeaderDiff:
    """Differences between the headers of two rank files, each ``(field, A, B)``."""

    identity: list[tuple[str, Any, Any]]  # binding fields: a target must match these
    geometry: list[tuple[str, Any, Any]]
    request: list[tuple[str, Any, Any]]
    info: list[tuple[str, Any, Any]]  # informational; never makes snapshots "differ"

    @property
    def same(self) -> bool:
        return not (self.identity or self.geometry or self.request)


def header_differences(a: Snapshot, b: Snapshot) -> HeaderDiff:
    info = [(f"identity.{k}", getattr(a.identity, k), getattr(b.identity, k)) for k in _INFO_FIELDS]
    info = [d for d in info if d[1] != d[2]] + numerics_differences(a.identity, b.identity)
    return HeaderDiff(
        identity=identity_differences(a.identity, b.identity),
        geometry=geometry_differences(a.geometry, b.geometry),
        request=_differences(_flatten(a.request, "request"), _flatten(b.request, "request")),
        info=info,
    )


# ---------------------------------------------------------------------------- report


@dataclass
class DiffReport:
    sections: list[SectionDiff]
    headers: dict[int, HeaderDiff]  # per rank present on both sides
    ranks_a: tuple[int, ...] = ()
    ranks_b: tuple[int, ...] = ()
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def same(self) -> bool:
        return self.ranks_a == self.ranks_b and all(s.same for s in self.sections) and all(h.same for h in self.headers.values())

    @property
    def differing(self) -> list[SectionDiff]:
        return [s for s in self.sections if not s.same]

    @property
    def corrupt(self) -> list[SectionDiff]:
        """Sections where A or B fails its own digest (a diff of unverified bytes means nothing)."""
        return [s for s in self.sections if s.status == CORRUPT]

    @property
    def multi_rank(self) -> bool:
        return len(set(self.ranks_a) | set(self.ranks_b)) > 1

    def label(self, d: SectionDiff) -> str:
        return f"rank{d.rank}/{d.name}" if self.multi_rank else d.name

    def to_dict(self) -> dict:
        def rows(ds):
            return [{"field": f, "a": _json_num(x), "b": _json_num(y)} for f, x, y in ds]

        return {
            "same": self.same,
            "atol": self.atol,
            "rtol": self.rtol,
            "ranks": {"a": list(self.ranks_a), "b": list(self.ranks_b)},
            "headers": {
                str(r): {"identity": rows(h.identity), "geometry": rows(h.geometry), "request": rows(h.request), "info": rows(h.info)}
                for r, h in self.headers.items()
            },
            "sections": [s.to_dict() for s in self.sections],
            "summary": {status: sum(s.status == status for s in self.sections) for status in STATUSES},
        }


def diff_snapshots(
    a: Snapshot | SnapshotSet,
    b: Snapshot | SnapshotSet,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    stop_at_first: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    cancelled: Callable[[], bool] | None = None,
) -> DiffReport:
    """Compare every section and every header field of two open snapshots.

    ``stop_at_first`` stops comparing each section at its first differing chunk (enough
    to know *whether* it differs; counts and maxima then cover that chunk only); every
    byte of both sides is still read and checked against its digest, and a section
    failing its own digest on either side gets the status ``digest-mismatch``.
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ValueError("atol and rtol must be non-negative numbers")
    ra, rb = rank_map(a), rank_map(b)
    headers = {r: header_differences(ra[r], rb[r]) for r in sorted(set(ra) & set(rb))}
    sections = list(
        iter_section_diffs(a, b, atol=atol, rtol=rtol, stop_at_first=stop_at_first, chunk_elements=chunk_elements, cancelled=cancelled)
    )
    return DiffReport(sections, headers, tuple(sorted(ra)), tuple(sorted(rb)), atol, rtol)


__all__ = [
    "EQUAL", "DIFFER", "ONLY_A", "ONLY_B", "SHAPE_MISMATCH", "CORRUPT", "STATUSES",
    "ArrayDiff", "SectionPair", "SectionDiff", "HeaderDiff", "DiffReport",
    "compare_arrays", "compare_chunks", "section_pairs", "compare_pair", "iter_section_diffs",
    "header_differences", "diff_snapshots", "rank_map",
]
