"""Copy engines between pool buffers and host memory.

``HostEngine`` (CPU pools): hand the writer chunks of at most ``HOST_CHUNK_BYTES``
(cache-sized: the digest pulls a chunk into cache, pwrite copies it from there) —
slices of the pool itself when the slots are one ascending run (the Mamba slot
always is), else rows gathered into a reusable host buffer; the writer digests and
writes each chunk before the next is produced. On restore from a :class:`FileRange`
(what restore_request passes), pread the section straight into the slots when they
are one run, else through a reusable chunk buffer and ``index_copy_``: nothing of the
file is mapped, so the restore's resident memory stays at that one chunk buffer and
a file failing under it gives an ``OSError``, not a SIGBUS. A numpy ``src`` (a mapped
view) is copied in directly (one slice copy for a run, else ``index_copy_``).

``CudaEngine`` (CUDA pools): export gathers on the device and copies into two
pinned host staging buffers on a side stream, so the device-to-host copy of
chunk i+1 overlaps the digest and write of chunk i; host memory stays at two
staging buffers whatever the snapshot size. Restore reads the section's source (a
:class:`FileRange`, the same range hashed as it lands, staged bytes, an object's GETs)
into a pinned buffer — preads on a few threads where the source allows
(:func:`read_spread`), so a verified restore hashes the very bytes that go on to the
device —, uploads them with cupy on the side stream (double-buffered), and scatters
into the slots on that stream, every call under the pools' device.

Both engines gather and scatter rows as raw integer words (:func:`raw_rows`), never
in the pool's element type: byte-exact for every dtype, and no dtype without a
kernel (float8 ``index_copy_`` on CPU) can fail a restore or its rollback.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .adapters import UnsupportedPoolError

DEFAULT_STAGING_BYTES = 64 << 20
# CPU export chunk: gather -> digest -> pwrite while the chunk is still in cache.
# Measured on the reference geometry (bench/run.py): 2 MiB beats 64 MiB by ~25% CPU
# time at 1 GiB and avoids faulting in a fresh 64 MiB buffer per export.
HOST_CHUNK_BYTES = 2 << 20
# CUDA restore's host reads (file or memory -> pinned staging) in pieces on a few threads (preads and numpy's copy
# release the GIL): one core's memcpy, ~7 GB/s on an H200 machine, held that restore at 0.13x of the host-to-device
# bandwidth (bench/gpu_check.py, the engine-alone row).
COPY_PIECE_BYTES = 8 << 20
COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
_copiers: ThreadPoolExecutor | None = None
_copiers_lock = threading.Lock()


def _spread(fill, n: int) -> None:
    """``fill(a, b)`` over ``[0, n)``: in pieces on up to ``COPY_THREADS`` threads when large, else one call here."""
    global _copiers
    pieces = min(COPY_THREADS, n // COPY_PIECE_BYTES)
    if pieces < 2:
        fill(0, n)
        return
    with _copiers_lock:
        if _copiers is None:
            _copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="hsnap-copy")
    step = -(-n // pieces)
    futures = [_copiers.submit(fill, a, min(n, a + step)) for a in range(0, n, step)]
    wait(futures)  # every piece ended before this returns or raises: none writes into the caller's buffer after
    for f in futures:
        f.result()


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for two 1-D byte arrays of one length, split over up to ``COPY_THREADS`` threads when large."""
    _spread(lambda a, b: np.copyto(dst[a:b], src[a:b]), len(dst))


def spread_preads(fd: int, view: memoryview, offset: int) -> None:
    """:func:`pread_into` of ``view`` from ``offset``, in pieces on the copy threads when large."""
    _spread(lambda a, b: pread_into(fd, view[a:b], offset + a), len(view))


def read_spread(src, view: memoryview, at: int) -> None:
    """``src.readinto(view, at)``, through the source's ``readinto_spread`` where it has one (its reads on the copy
    threads: a file range, staged bytes), else its plain call (an object's GETs already run ahead)."""
    getattr(src, "readinto_spread", src.readinto)(view, at)


def _row_chunks(n_rows: int, row_bytes: int, staging_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, staging_bytes // max(row_bytes, 1))
    for a in range(0, n_rows, step):
        yield a, min(n_rows, a + step)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# Widest first: on CPU an int64 index_copy_ of 1 KiB rows runs ~6x faster than uint8.
_WORDS = (torch.int64, torch.int32, torch.int16)


def raw_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as raw integer words over the same memory: ``[rows, ..., words]``.

    Every gather and scatter of pool rows (both engines, the rollback) goes through
    this view, never through the pool's own dtype: torch lacks ``index_copy_`` for
    some element types (every float8 on CPU), integer kernels exist on every device,
    and copying words is byte-exact whatever the element format. The widest word the
    row layout allows is used; uint8 when nothing wider divides it.
    """
    b = t.unsqueeze(-1).view(torch.uint8)  # [rows, ..., itemsize]: never widens the row axis away
    if b.dim() > 2:
        try:
            b = b.view(b.shape[0], -1)  # one byte row per slot when a row's bytes are contiguous
        except RuntimeError:
            pass
    for w in _WORDS:
        if b.shape[-1] % w.itemsize == 0:
            try:
                return b.view(w)
            except RuntimeError:  # storage offset or strides not a multiple of the word
                continue
    return b


def rows_of(raw: torch.Tensor, data: torch.Tensor, n: int) -> torch.Tensor:
    """Contiguous section bytes ``data`` as ``n`` rows shaped like :func:`raw_rows` ``raw``."""
    return data.reshape(-1).view(torch.uint8).view(raw.dtype).view(n, *raw.shape[1:])


def bytes_per_row(buffer: torch.Tensor) -> int:
    """Bytes of one row (one slot) of a pool buffer."""
    return math.prod(buffer.shape[1:]) * buffer.element_size()


def _run_start(rows: torch.Tensor) -> int | None:
    """``a`` when ``rows`` is exactly a, a+1, ..., a+n-1 (n >= 1), else None."""
    n = len(rows)
    if n == 0:
        return None
    a = int(rows[0])
    if int(rows[-1]) - a != n - 1:
        return None
    # n strictly increasing integers from a to a + n - 1 are exactly a, a+1, ...: one compare, no arange
    if n > 2 and not bool((rows[1:] > rows[:-1]).all()):
        return None
    return a


@dataclass(frozen=True)
class FileRange:
    """A section's bytes in an open file: ``length`` bytes at ``offset`` of ``fd``."""

    fd: int
    offset: int
    length: int

    def readinto(self, view: memoryview, at: int) -> None:
        """Bytes [at, at+len(view)) of the range (hsnap_format.stores.s3.ranges.SectionRange has the same call)."""
        pread_into(self.fd, view, self.offset + at)

    def readinto_spread(self, view: memoryview, at: int) -> None:
        """:meth:`readinto` on the copy threads (:func:`read_spread`)."""
        spread_preads(self.fd, view, self.offset + at)


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a file shorter than that is an OSError."""
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(errno.EIO, f"file ended {n - done} bytes early (read {done} of {n} at byte {offset})")
        done += got


class HostEngine:
    """Plain CPU copies (no pinning: CPU-only torch cannot pin)."""

    name = "cpu"
    forks = True  # fork(): an engine of its own for a second thread (a restore's staged pieces, copied on two threads)
    exports_into = True  # export_into(): a capture's rows straight into the caller's host buffer, no staging

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.staging_bytes = staging_bytes
        self.chunk_bytes = min(staging_bytes, HOST_CHUNK_BYTES)
        self._host = torch.empty(0, dtype=torch.uint8)
        self._runs: dict[int, tuple[torch.Tensor, int | None, int]] = {}  # id(rows) -> (rows, run start, row count)

    def fork(self) -> "HostEngine":
        """A second engine with its own staging, for another thread of the same restore (the slot runs it found
        shared: both threads fill the same slots)."""
        other = HostEngine(self.staging_bytes)
        other._runs = self._runs
        return other

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._host.numel() < nbytes:
            self._host = torch.empty(nbytes, dtype=torch.uint8)
        return self._host[:nbytes]

    def _run(self, rows: torch.Tensor) -> tuple[int | None, int]:
        """(start of the slot run ``rows``, or None; how many rows)."""
        # every layer's section shares its space's rows tensor: check each once, not once per section
        known = self._runs.get(id(rows))
        if known is None or known[0] is not rows:
            if len(self._runs) >= 8:
                self._runs.clear()
            known = self._runs[id(rows)] = (rows, _run_start(rows), len(rows))
        return known[1], known[2]

    def _run_start(self, buffer: torch.Tensor, rows: torch.Tensor) -> int | None:
        """Start of the slot run ``rows`` when it lies inside ``buffer`` (else None: the
        index_select / index_copy_ path, which also raises for out-of-range rows)."""
        a, n = self._run(rows)
        if a is None or a < 0 or a + n > buffer.shape[0]:
            return None
        return a

    def slots_view(self, buffer: torch.Tensor, rows: torch.Tensor, host: np.ndarray | None = None) -> np.ndarray | None:
        """The bytes of ``buffer[rows]`` as one writable array when the slots are one run of
        a contiguous buffer (a re-sharded section is assembled straight into them), else None.
        ``host``: ``buffer``'s bytes as ``[slots, row_bytes]`` (:attr:`hsnap_io.adapters.Binding.host_rows`),
        sliced instead of viewing the tensor anew (a torch view per call costs ~10 µs; restores call this per section)."""
        if host is not None:
            a, n = self._run(rows)
            # (numpy clamps a slice: rows outside the buffer take the index path, which refuses them)
            return host[a : a + n].reshape(-1) if a is not None and 0 <= a and a + n <= host.shape[0] else None
        a = self._run_start(buffer, rows)
        if a is None or not buffer.is_contiguous():
            return None
        return _as_bytes(buffer[a : a + len(rows)]).numpy()

    def export_section(self, buffer: torch.Tensor, rows: torch.Tensor, sink, host: np.ndarray | None = None) -> None:
        """Gather ``buffer[rows]`` in chunks; ``sink(bytes, first, last)`` takes each chunk. ``host``: as for
        :meth:`slots_view`."""
        row_bytes = bytes_per_row(buffer) if host is None else host.shape[1]
        whole = self.slots_view(buffer, rows, host)  # the slots are one run: hand the pool's own bytes over, no gather copy
        n = self._run(rows)[1]
        chunks = list(_row_chunks(n, row_bytes, self.chunk_bytes)) or [(0, 0)]
        raw = None if whole is not None else raw_rows(buffer)
        for i, (a, b) in enumerate(chunks):
            if whole is not None:
                out = whole[a * row_bytes : b * row_bytes]
            else:
                staged = self._staging((b - a) * row_bytes)
                torch.index_select(raw, 0, rows[a:b], out=rows_of(raw, staged, b - a))
                out = staged.numpy()
            sink(out, i == 0, i == len(chunks) - 1)

    def export_into(self, buffer: torch.Tensor, rows: torch.Tensor, dest: np.ndarray, host: np.ndarray | None = None) -> None:
        """Gather ``buffer[rows]`` into ``dest`` (``len(rows)`` rows' bytes, host memory): one memcpy for a run of
        slots, else one index_select written in place (numpy and torch release the GIL for both). ``host``: as for
        :meth:`slots_view`."""
        n = self._run(rows)[1]
        if n == 0:
            return
        whole = self.slots_view(buffer, rows, host)
        if whole is not None:  # one run of a contiguous buffer
            np.copyto(dest.reshape(-1), whole)
            return
        raw = raw_rows(buffer)
        out = rows_of(raw, torch.from_numpy(dest), n)
        run = self._run_start(buffer, rows)
        if run is not None:
            out.copy_(raw[run : run + n])
        else:
            torch.index_select(raw, 0, rows, out=out)

    def finish_export(self) -> None:
        pass

    def import_section(self, buffer: torch.Tensor, rows: torch.Tensor, src, host: np.ndarray | None = None) -> None:
        """Scatter the section bytes ``src`` — a :class:`FileRange`, or a uint8 array such
        as a mapped view — into ``buffer[rows]``. ``host``: as for :meth:`slots_view`."""
        if hasattr(src, "readinto"):  # a FileRange, or ranged GETs of an object
            return self._import_file(buffer, rows, src, host)
        with warnings.catch_warnings():  # the mapped view is read-only; we only read it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(src)
        raw = raw_rows(buffer)
        data = rows_of(raw, data, len(rows))
        run = self._run_start(buffer, rows)
        if run is not None:
            raw[run : run + len(rows)].copy_(data)  # same bytes as index_copy_, one memcpy
        else:
            raw.index_copy_(0, rows, data)

    def _import_file(self, buffer: torch.Tensor, rows: torch.Tensor, src: FileRange, host: np.ndarray | None) -> None:
        row_bytes = bytes_per_row(buffer) if host is None else host.shape[1]
        if self._run(rows)[1] * row_bytes != src.length:
            raise ValueError(f"{len(rows)} rows of {row_bytes} bytes != section length {src.length}")
        into = self.slots_view(buffer, rows, host)
        if into is not None:  # the slots are one run: read straight into them
            src.readinto(memoryview(into), 0)
            return
        raw = raw_rows(buffer)
        for a, b in _row_chunks(len(rows), row_bytes, self.chunk_bytes):
            chunk = self._staging((b - a) * row_bytes)
            src.readinto(memoryview(chunk.numpy()), a * row_bytes)
            raw.index_copy_(0, rows[a:b], rows_of(raw, chunk, b - a))

    def finish_import(self) -> None:
        pass


def cuda_device_index(device: torch.device | str, current: int) -> int:
    """The CUDA ordinal that pools on ``device`` live on: its index, or ``current``
    (torch's current device) for a bare ``cuda``. Every cupy call of :class:`CudaEngine`
    runs under this device — cupy's own current device is not the pools' on a TP rank
    other than 0 (pools on ``cuda:1``), and a copy issued on another device's stream
    is wrong."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return int(current) if device.index is None else int(device.index)


class CudaEngine:
    """Pinned staging, a side stream, cupy uploads. Needs CUDA pools and cupy.

    Every call runs under the pools' device (torch and cupy alike: see
    :func:`cuda_device_index`). Rows move as raw words (:func:`raw_rows`), so no
    element type can miss a gather or scatter kernel.
    """

    name = "cuda"

    def __init__(self, device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        import cupy  # hsnap[gpu]

        self.cupy = cupy
        self.index = cuda_device_index(device, torch.cuda.current_device())
        self.device = torch.device("cuda", self.index)
        self.staging_bytes = staging_bytes
        with self._on_device():
            self.stream = torch.cuda.Stream(device=self.device)
            self.pinned = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.ready = [torch.cuda.Event() for _ in range(2)]  # D2H done / H2D consumed
            self._dev = [torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.in_use = [False, False]
        self._slot = 0
        self._pending: list[tuple[int, int, object, bool, bool]] = []  # (slot, nbytes, sink, first, last)

    def _on_device(self) -> ExitStack:
        """torch's and cupy's current device set to the pools' device for the block."""
        stack = ExitStack()
        stack.enter_context(torch.cuda.device(self.index))
        stack.enter_context(self.cupy.cuda.Device(self.index))
        return stack

    # ---- export: device -> pinned host, overlapped with the writer
    def _drain_one(self) -> None:
        slot, nbytes, sink, first, last = self._pending.pop(0)
        self.ready[slot].synchronize()
        sink(self.pinned[slot][:nbytes].numpy(), first, last)
        self.in_use[slot] = False

    def export_section(self, buffer: torch.Tensor, rows: torch.Tensor, sink, host: np.ndarray | None = None) -> None:
        """(``host``, a host buffer's byte rows, is None for device pools.)"""
        with self._on_device():
            self._export_section(buffer, rows, sink)

    def _export_section(self, buffer: torch.Tensor, rows: torch.Tensor, sink) -> None:
        row_bytes = bytes_per_row(buffer)
        raw = raw_rows(buffer)
        rows = rows.to(buffer.device, non_blocking=True)
        self.stream.wait_stream(torch.cuda.current_stream(buffer.device))
        chunks = list(_row_chunks(len(rows), row_bytes, self.staging_bytes)) or [(0, 0)]
        for i, (a, b) in enumerate(chunks):
            slot = self._slot
            if self.in_use[slot]:
                self._drain_one()  # writes the older chunk while the newer one copies
            nbytes = (b - a) * row_bytes
            with torch.cuda.stream(self.stream):
                gathered = raw.index_select(0, rows[a:b])
                self.pinned[slot][:nbytes].copy_(_as_bytes(gathered), non_blocking=True)
                self.ready[slot].record(self.stream)
            self.in_use[slot] = True
            self._pending.append((slot, nbytes, sink, i == 0, i == len(chunks) - 1))
            self._slot ^= 1
        # keep the last chunk in flight; the next section (or finish) drains it

    def finish_export(self) -> None:
        while self._pending:
            self._drain_one()

    # ---- restore: its source (file, staged bytes, GETs) -> pinned -> device (cupy) -> scatter into slots
    def import_section(self, buffer: torch.Tensor, rows: torch.Tensor, src, host: np.ndarray | None = None) -> None:
        """Scatter the section bytes ``src`` — a :class:`FileRange` or another source with its call (read into the
        pinned staging: :func:`read_spread`), or a uint8 array — into ``buffer[rows]``. (``host``, a host
        buffer's byte rows, is None for device pools.)"""
        with self._on_device():
            self._import_section(buffer, rows, src)

    def _import_section(self, buffer: torch.Tensor, rows: torch.Tensor, src) -> None:
        cp = self.cupy
        row_bytes = bytes_per_row(buffer)
        reads = hasattr(src, "readinto")
        if reads and len(rows) * row_bytes != src.length:
            raise ValueError(f"{len(rows)} rows of {row_bytes} bytes != section length {src.length}")
        raw = raw_rows(buffer)
        rows = rows.to(buffer.device, non_blocking=True)
        self.stream.wait_stream(torch.cuda.current_stream(buffer.device))
        for a, b in _row_chunks(len(rows), row_bytes, self.staging_bytes):
            slot = self._slot
            if self.in_use[slot]:
                self.ready[slot].synchronize()  # the upload that used this pinned buffer is done
            nbytes = (b - a) * row_bytes
            host = self.pinned[slot][:nbytes].numpy()
            if reads:  # (a verified source hashes what lands here: the bytes that go on to the device)
                read_spread(src, memoryview(host), a * row_bytes)
            else:
                host_copy(host, src[a * row_bytes : b * row_bytes])
            dev = self._dev[slot]
            cp.cuda.runtime.memcpyAsync(
                dev.data_ptr(), host.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice, self.stream.cuda_stream
            )
            with torch.cuda.stream(self.stream):
                raw.index_copy_(0, rows[a:b], rows_of(raw, dev[:nbytes], b - a))
                self.ready[slot].record(self.stream)
            self.in_use[slot] = True
            self._slot ^= 1

    def finish_import(self) -> None:
        with self._on_device():
            self.stream.synchronize()
            self.in_use = [False, False]
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def engine_for(device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES):
    """The copy engine for pools on ``device`` (:attr:`hsnap_io.adapters.PoolView.device`)."""
    if device.type == "cpu":
        return HostEngine(staging_bytes)
    if device.type == "cuda":
        return CudaEngine(device, staging_bytes)
    raise UnsupportedPoolError(None, "pool devices", "cpu or cuda", str(device))
