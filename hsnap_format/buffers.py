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
import threading

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


class KeptBuffers:
    """Host buffers kept between uses, up to ``keep_bytes`` in all: fresh memory costs more
    than the copy into it (its faults; on some VMs far more), so a buffer used once per
    restore or export is handed to the next one.  :meth:`take` gives the smallest kept
    buffer that holds ``nbytes`` (else a new :func:`host_empty` one); :meth:`give` keeps a
    buffer no longer used, dropping the smallest kept ones over the bound.  A buffer
    larger than the bound is never kept.  Thread-safe."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._kept: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._kept) if b.nbytes >= nbytes]
            if fits:
                return self._kept.pop(min(fits, key=lambda i: self._kept[i].nbytes))
        return host_empty(max(nbytes, 1))

    def give(self, buf: np.ndarray) -> None:
        if buf.nbytes > self.keep_bytes:
            return
        with self._lock:
            if any(b is buf for b in self._kept):
                return
            self._kept.append(buf)
            self._kept.sort(key=lambda b: b.nbytes, reverse=True)
            while sum(b.nbytes for b in self._kept) > self.keep_bytes:
                self._kept.pop()

    @property
    def buffers(self) -> tuple[np.ndarray, ...]:
        """The buffers kept now, largest first."""
        with self._lock:
            return tuple(self._kept)


__all__ = ["HUGE_PAGE_REQUEST_BYTES", "host_empty", "KeptBuffers"]
