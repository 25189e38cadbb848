"""Section statistics, computed chunk by chunk.

A section may be gigabytes of bf16 or fp8; its statistics are accumulated over
fixed-size chunks converted to float64 one at a time (Chan's parallel
mean/variance merge), so memory stays at a few chunk-sized buffers whatever the
section size, and no float64 copy of the whole section is ever made.

``min``, ``max``, ``mean`` and ``std`` are over the *finite* values; NaN and
+/-Inf are counted separately. Integer sections report exact ``min``/``max``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from ..spec import DTYPES

CHUNK_ELEMENTS = 1 << 20  # 8 MiB of float64 per temporary

_ML_FLOATS = frozenset(
    np.dtype(t)
    for t in (
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2fnuz,
    )
)


class Cancelled(Exception):
    """A chunked scan stopped because its ``cancelled()`` callable returned true."""


def is_float(dtype) -> bool:
    """Float kinds, ml_dtypes' bf16/fp8 included (numpy calls those kind 'V')."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt in _ML_FLOATS


def as_float64(chunk: np.ndarray) -> np.ndarray:
    """One chunk as float64 (bool via uint8: numpy refuses bool arithmetic)."""
    if chunk.dtype == np.bool_:
        chunk = chunk.view(np.uint8)
    return chunk.astype(np.float64)


def iter_chunks(arr: np.ndarray, chunk_elements: int = CHUNK_ELEMENTS, cancelled: Callable[[], bool] | None = None):
    """Yield (flat start index, 1-D chunk view) over ``arr`` in C order.

    A C-contiguous array (every section view is one) is flattened without a copy.
    """
    flat = arr.reshape(-1)
    for start in range(0, flat.size, max(1, chunk_elements)):
        if cancelled is not None and cancelled():
            raise Cancelled()
        yield start, flat[start : start + chunk_elements]


@dataclass(frozen=True)
class SectionStats:
    count: int  # elements
    finite: int
    nan: int
    posinf: int
    neginf: int
    zero: int
    min: float | int | None  # over finite values; None when there are none
    max: float | int | None
    mean: float | None
    std: float | None  # population standard deviation

    def to_dict(self) -> dict:
        return asdict(self)


class _Moments:
    """Running count / mean / M2 (sum of squared deviations), merged per chunk."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: np.ndarray) -> None:
        nb = int(x.size)
        if nb == 0:
            return
        mb = float(x.mean())
        m2b = float(np.square(x - mb).sum())
        n = self.n + nb
        delta = mb - self.mean
        self.mean += delta * nb / n
        self.m2 += m2b + delta * delta * self.n * nb / n
        self.n = n


def array_stats(
    arr: np.ndarray,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
    cancelled: Callable[[], bool] | None = None,
) -> SectionStats:
    """Statistics of any numeric array (bf16/fp8 included); raises :class:`Cancelled`."""
    return chunks_stats(iter_chunks(arr, chunk_elements, cancelled), int(arr.size), arr.dtype)


def chunks_stats(chunks, count: int, dtype, cancelled: Callable[[], bool] | None = None) -> SectionStats:
    """Statistics over ``(start, 1-D chunk)`` pairs of ``count`` elements of ``dtype``."""
    floating = is_float(dtype)
    moments = _Moments()
    nan = posinf = neginf = zero = 0
    lo = hi = None
    for _, chunk in chunks:
        if cancelled is not None and cancelled():
            raise Cancelled()
        x = as_float64(chunk)
        zero += int(np.count_nonzero(x == 0))
        if floating:
            finite_mask = np.isfinite(x)
            nan += int(np.count_nonzero(np.isnan(x)))
            posinf += int(np.count_nonzero(x == np.inf))
            neginf += int(np.count_nonzero(x == -np.inf))
            x = x[finite_mask]
            native = x
        else:
            native = chunk.view(np.uint8) if chunk.dtype == np.bool_ else chunk
        if x.size:
            cmin, cmax = native.min().item(), native.max().item()
            lo = cmin if lo is None else min(lo, cmin)
            hi = cmax if hi is None else max(hi, cmax)
        moments.add(x)
    if cancelled is not None and cancelled():
        raise Cancelled()
    n = moments.n
    return SectionStats(
        count=count,
        finite=n,
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        zero=zero,
        min=lo,
        max=hi,
        mean=moments.mean if n else None,
        std=math.sqrt(moments.m2 / n) if n else None,
    )


def section_stats(snap, section, *, chunk_elements: int = CHUNK_ELEMENTS, cancelled: Callable[[], bool] | None = None,
                  verify: bool = False) -> SectionStats:
    """Statistics of one section of an open :class:`~hsnap_format.Snapshot` (name or SectionInfo),
    read chunk by chunk with pread (bounded memory; a file truncated meanwhile gives a typed
    error, not SIGBUS). ``verify`` also checks the section's digest over the bytes used."""
    info = snap.section(section) if isinstance(section, str) else section
    chunks = snap.iter_chunks(info, chunk_elements, verify=verify, cancelled=cancelled)
    return chunks_stats(chunks, math.prod(info.shape), DTYPES[info.dtype], cancelled)


def sample(arr: np.ndarray, count: int = 64) -> list:
    """The first ``count`` elements in C order as Python numbers (floats for float kinds)."""
    head = arr.reshape(-1)[:count]
    return [float(v) for v in head.astype(np.float64)] if is_float(arr.dtype) else head.tolist()


__all__ = ["SectionStats", "Cancelled", "array_stats", "chunks_stats", "section_stats", "sample", "iter_chunks", "is_float", "CHUNK_ELEMENTS"]
