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
staging buffers whatever the snapshot size. Restore copies mapped file bytes into
a pinned buffer, uploads them with cupy on the side stream (double-buffered), and
scatters into the slots on that stream.
"""

from __future__ import annotations

import errno
import os
import warnings
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

DEFAULT_STAGING_BYTES = 64 << 20
# CPU export chunk: gather -> digest -> pwrite while the chunk is still in cache.
# Measured on the reference geometry (bench/run.py): 2 MiB beats 64 MiB by ~25% CPU
# time at 1 GiB and avoids faulting in a fresh 64 MiB buffer per export.
HOST_CHUNK_BYTES = 2 << 20


def _row_chunks(n_rows: int, row_bytes: int, staging_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, staging_bytes // max(row_bytes, 1))
    for a in range(0, n_rows, step):
        yield a, min(n_rows, a + step)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _run_start(rows: torch.Tensor) -> int | None:
    """``a`` when ``rows`` is exactly a, a+1, ..., a+n-1 (n >= 1), else None."""
    n = len(rows)
    if n == 0:
        return None
    a = int(rows[0])
    if int(rows[-1]) - a != n - 1:
        return None
    if n > 2 and not bool(torch.equal(rows, torch.arange(a, a + n, dtype=rows.dtype, device=rows.device))):
        return None
    return a


@dataclass(frozen=True)
class FileRange:
    """A section's bytes in an open file: ``length`` bytes at ``offset`` of ``fd``."""

    fd: int
    offset: int
    length: int


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
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
    # restore hands this engine FileRange sources (pread straight into the slots)
    reads_files = True

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.staging_bytes = staging_bytes
        self.chunk_bytes = min(staging_bytes, HOST_CHUNK_BYTES)
        self._host = torch.empty(0, dtype=torch.uint8)
        self._runs: tuple[torch.Tensor, int | None] | None = None  # (rows, run start) of the last call

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._host.numel() < nbytes:
            self._host = torch.empty(nbytes, dtype=torch.uint8)
        return self._host[:nbytes]

    def _run_start(self, buffer: torch.Tensor, rows: torch.Tensor) -> int | None:
        """Start of the slot run ``rows`` when it lies inside ``buffer`` (else None: the
        index_select / index_copy_ path, which also raises for out-of-range rows)."""
        # every layer's section shares one rows tensor: check it once, not once per section
        if self._runs is None or self._runs[0] is not rows:
            self._runs = (rows, _run_start(rows))
        a = self._runs[1]
        if a is None or a < 0 or a + len(rows) > buffer.shape[0]:
            return None
        return a

    def export_section(self, buffer: torch.Tensor, rows: torch.Tensor, sink) -> None:
        """Gather ``buffer[rows]`` in chunks; ``sink(bytes, first, last)`` takes each chunk."""
        row_bytes = buffer[0].numel() * buffer.element_size()
        run = self._run_start(buffer, rows)
        chunks = list(_row_chunks(len(rows), row_bytes, self.chunk_bytes)) or [(0, 0)]
        direct = run is not None and buffer.is_contiguous()
        for i, (a, b) in enumerate(chunks):
            if direct:  # the slots are one run: hand the pool's own bytes over, no gather copy
                out = buffer[run + a : run + b]
            else:
                out = self._staging((b - a) * row_bytes).view(buffer.dtype).view(b - a, *buffer.shape[1:])
                torch.index_select(buffer, 0, rows[a:b], out=out)
            sink(out.reshape(-1).view(torch.uint8).numpy(), i == 0, i == len(chunks) - 1)

    def finish_export(self) -> None:
        pass

    def import_section(self, buffer: torch.Tensor, rows: torch.Tensor, src) -> None:
        """Scatter the section bytes ``src`` — a :class:`FileRange`, or a uint8 array such
        as a mapped view — into ``buffer[rows]``."""
        if isinstance(src, FileRange):
            return self._import_file(buffer, rows, src)
        with warnings.catch_warnings():  # the mapped view is read-only; we only read it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(src)
        data = data.view(buffer.dtype).view(len(rows), *buffer.shape[1:])
        run = self._run_start(buffer, rows)
        if run is not None:
            buffer[run : run + len(rows)].copy_(data)  # same bytes as index_copy_, one memcpy
        else:
            buffer.index_copy_(0, rows, data)

    def _import_file(self, buffer: torch.Tensor, rows: torch.Tensor, src: FileRange) -> None:
        row_bytes = buffer[0].numel() * buffer.element_size() if buffer.shape[0] else 0
        if len(rows) * row_bytes != src.length:
            raise ValueError(f"{len(rows)} rows of {row_bytes} bytes != section length {src.length}")
        run = self._run_start(buffer, rows)
        if run is not None and buffer.is_contiguous():  # the slots are one run: read straight into them
            _pread_into(src.fd, memoryview(buffer[run : run + len(rows)].reshape(-1).view(torch.uint8).numpy()), src.offset)
            return
        for a, b in _row_chunks(len(rows), row_bytes, self.chunk_bytes):
            chunk = self._staging((b - a) * row_bytes)
            _pread_into(src.fd, memoryview(chunk.numpy()), src.offset + a * row_bytes)
            buffer.index_copy_(0, rows[a:b], chunk.view(buffer.dtype).view(b - a, *buffer.shape[1:]))

    def finish_import(self) -> None:
        pass


class CudaEngine:
    """Pinned staging, a side stream, cupy uploads. Needs CUDA pools and cupy."""

    name = "cuda"
    reads_files = False  # uploads from the mapped file through pinned staging

    def __init__(self, device: torch.device, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        import cupy  # hsnap[gpu]

        self.cupy = cupy
        self.device = device
        self.staging_bytes = staging_bytes
        self.stream = torch.cuda.Stream(device=device)
        self.pinned = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.ready = [torch.cuda.Event() for _ in range(2)]  # D2H done / H2D consumed
        self.in_use = [False, False]
        self._slot = 0
        self._pending: list[tuple[int, int, object, bool, bool]] = []  # (slot, nbytes, sink, first, last)
        self._dev = [torch.empty(staging_bytes, dtype=torch.uint8, device=device) for _ in range(2)]

    # ---- export: device -> pinned host, overlapped with the writer
    def _drain_one(self) -> None:
        slot, nbytes, sink, first, last = self._pending.pop(0)
        self.ready[slot].synchronize()
        sink(self.pinned[slot][:nbytes].numpy(), first, last)
        self.in_use[slot] = False

    def export_section(self, buffer: torch.Tensor, rows: torch.Tensor, sink) -> None:
        row_bytes = buffer[0].numel() * buffer.element_size()
        rows = rows.to(buffer.device, non_blocking=True)
        self.stream.wait_stream(torch.cuda.current_stream(buffer.device))
        chunks = list(_row_chunks(len(rows), row_bytes, self.staging_bytes)) or [(0, 0)]
        for i, (a, b) in enumerate(chunks):
            slot = self._slot
            if self.in_use[slot]:
                self._drain_one()  # writes the older chunk while the newer one copies
            nbytes = (b - a) * row_bytes
            with torch.cuda.stream(self.stream):
                gathered = buffer.index_select(0, rows[a:b])
                self.pinned[slot][:nbytes].copy_(_as_bytes(gathered), non_blocking=True)
                self.ready[slot].record(self.stream)
            self.in_use[slot] = True
            self._pending.append((slot, nbytes, sink, i == 0, i == len(chunks) - 1))
            self._slot ^= 1
        # keep the last chunk in flight; the next section (or finish) drains it

    def finish_export(self) -> None:
        while self._pending:
            self._drain_one()

    # ---- restore: mapped file -> pinned -> device (cupy) -> scatter into slots
    def import_section(self, buffer: torch.Tensor, rows: torch.Tensor, src: np.ndarray) -> None:
        cp = self.cupy
        row_bytes = buffer[0].numel() * buffer.element_size()
        rows = rows.to(buffer.device, non_blocking=True)
        self.stream.wait_stream(torch.cuda.current_stream(buffer.device))
        for a, b in _row_chunks(len(rows), row_bytes, self.staging_bytes):
            slot = self._slot
            if self.in_use[slot]:
                self.ready[slot].synchronize()  # the upload that used this pinned buffer is done
            nbytes = (b - a) * row_bytes
            host = self.pinned[slot][:nbytes].numpy()
            np.copyto(host, src[a * row_bytes : b * row_bytes])  # page-cache -> pinned
            dev = self._dev[slot]
            cp.cuda.runtime.memcpyAsync(
                dev.data_ptr(), host.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice, self.stream.cuda_stream
            )
            with torch.cuda.stream(self.stream):
                data = dev[:nbytes].view(buffer.dtype).view(b - a, *buffer.shape[1:])
                buffer.index_copy_(0, rows[a:b], data)
                self.ready[slot].record(self.stream)
            self.in_use[slot] = True
            self._slot ^= 1

    def finish_import(self) -> None:
        self.stream.synchronize()
        self.in_use = [False, False]
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def engine_for(buffers: list[torch.Tensor], staging_bytes: int = DEFAULT_STAGING_BYTES):
    devices = {b.device.type for b in buffers}
    if devices <= {"cpu"}:
        return HostEngine(staging_bytes)
    if devices == {"cuda"}:
        return CudaEngine(buffers[0].device, staging_bytes)
    raise ValueError(f"pools on unsupported devices: {sorted(devices)}")
