"""Large host buffers without a huge-page request.

numpy asks the kernel for transparent huge pages on every array of 4 MiB or more
(``madvise(MADV_HUGEPAGE)``). Where the kernel compacts memory for such a request at
fault time — ``/sys/kernel/mm/transparent_hugepage/defrag`` set to ``madvise``, a
common default — the first touch of that array can stall on compaction: measured on
this project's machines at 60 MB/s (3.9 s for 256 MiB) against 2.4 GB/s for the same
bytes in plain pages. A restore's staging buffer and undo log, a section read whole,
are touched once and often freshly allocated, so they take plain anonymous pages:
slower than huge pages once those exist, never a multi-second stall."""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE_REQUEST_BYTES = 4 << 20  # numpy's threshold for its huge-page request


def host_empty(count: int, dtype=np.uint8) -> np.ndarray:
    """An uninitialized 1-D array of ``count`` elements: numpy's own below
    :data:`HUGE_PAGE_REQUEST_BYTES`, else a private anonymous mapping (plain pages,
    faulted in only where written, unmapped when the array is collected)."""
    dt = np.dtype(dtype)
    nbytes = count * dt.itemsize
    if nbytes < HUGE_PAGE_REQUEST_BYTES:
        return np.empty(count, dtype=dt)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=dt)


__all__ = ["HUGE_PAGE_REQUEST_BYTES", "host_empty"]
