"""Exact rollback for a restore that fails after it started allocating.

``PoolCheckpoint`` remembers (1) the allocators' free lists and mappings — every
tensor, list and scalar attribute of the request pool, the token allocator (and
its sub-allocators) and the mamba slot allocator — and (2) for every slot row a
restore is about to overwrite, either its previous bytes — whole rows before the
upload, or (:class:`RunUndo`) a run of slots piece by piece, just before each piece is
written — or, for rows the restore has just allocated (free before it, so nothing
reads their old bytes), only that they are to be zeroed (:meth:`scrub_rows`: costs
nothing unless the restore fails). ``rollback()`` puts all of it back: every
allocation exactly, every remembered row byte-identical, every scrubbed row zero —
no byte of a refused snapshot stays in the pools.

The rollback cannot stop halfway: it puts back the allocator state first (plain
attribute and same-shape integer copies), then every remembered row, each step
guarded, and rows move as raw words (:func:`~hsnap_io.transfer.raw_rows`), so no
element type lacks the kernel. A step that still fails does not stop the others;
:class:`RollbackError` then names every part that could not be put back.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hsnap_format import HsnapError
from hsnap_format.buffers import host_empty

from .adapters import PoolView
from .transfer import raw_rows

_SCALARS = (int, float, bool, str, type(None))


class RollbackError(HsnapError):
    """A failed restore could not put every part of the pools back (named in ``found``);
    everything else was put back. The pools need attention before further use."""


def _is_allocator(value) -> bool:
    return hasattr(value, "alloc") and hasattr(value, "free") and hasattr(value, "available_size")


def _all_zero(a: np.ndarray) -> bool:
    if a.ctypes.data % 8:
        return not a.any()
    whole = len(a) // 8 * 8  # compared 8 bytes at a time, the tail byte by byte
    return not a[:whole].view(np.uint64).any() and not a[whole:].any()


class RunUndo:
    """The old bytes of one run of slots (``dest``: their bytes, one contiguous array),
    saved piece by piece by :meth:`save` just before each piece is overwritten — from any
    thread (the GETs that land in the run) — and put back, only where saved, by the rollback.
    A piece that held only zeros (slots no request has used since the pool was made) is
    remembered as zeros, not copied: the undo log of a fresh server's slots costs a read."""

    def __init__(self, what: str, dest: np.ndarray, saved: np.ndarray) -> None:
        self.what, self.dest, self._saved = what, dest, saved
        self._ranges: list[tuple[int, int, bool]] = []  # (start, stop, saved as zeros)
        self._lock = threading.Lock()

    def save(self, a: int, b: int) -> None:
        zero = _all_zero(self.dest[a:b])
        if not zero:
            np.copyto(self._saved[a:b], self.dest[a:b])  # (releases the GIL: GETs save in parallel)
        with self._lock:
            self._ranges.append((a, b, zero))

    def rollback(self) -> None:
        for a, b, zero in self._ranges:
            if zero:
                self.dest[a:b] = 0
            else:
                np.copyto(self.dest[a:b], self._saved[a:b])


class PoolCheckpoint:
    def __init__(self, view: PoolView) -> None:
        self._attrs: list[tuple[object, str, object, object]] = []
        self._rows: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (what, raw rows, rows, saved)
        self._runs: list[RunUndo] = []
        self._scrub: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (what, buffer, rows): zeroed on rollback
        rtp = view.req_to_token_pool
        self._capture(rtp, skip={"req_to_token", "req_index_to_mamba_index_mapping", "mamba_pool", "mamba_allocator"})
        self._capture(view.allocator, skip={"_kvcache"}, recurse=True)
        mamba_alloc = getattr(rtp, "mamba_allocator", None)
        if view.mamba_pool is not None and mamba_alloc is not None:
            self._capture(mamba_alloc)

    def _capture(self, obj, skip=frozenset(), recurse=False, depth=0) -> None:
        for name, value in list(vars(obj).items()):
            if name in skip:
                continue
            if isinstance(value, torch.Tensor):
                self._attrs.append((obj, name, value, value.clone()))
            elif isinstance(value, list):
                self._attrs.append((obj, name, value, list(value)))
            elif isinstance(value, _SCALARS):
                self._attrs.append((obj, name, value, value))
            elif recurse and depth < 2 and _is_allocator(value):
                self._capture(value, skip={"_kvcache"}, recurse=True, depth=depth + 1)

    def remember_rows(self, buffer: torch.Tensor, rows: torch.Tensor, what: str = "rows", keep: dict | None = None) -> None:
        """Call before overwriting ``buffer[rows]``; ``what`` names it in a RollbackError.
        ``keep``: where the saved rows go, ``keep[what]`` reused when it has their shape
        (a caller that saves the same rows again and again — a migration's Mamba slot, once
        per link — allocates, and faults in, that memory once)."""
        raw = raw_rows(buffer)
        rows = rows.to(buffer.device)
        if keep is None:
            saved = raw.index_select(0, rows)
        else:
            saved = keep.get(what)
            shape = (len(rows), *raw.shape[1:])
            if saved is None or saved.shape != shape or saved.dtype != raw.dtype or saved.device != raw.device:
                saved = keep[what] = torch.empty(shape, dtype=raw.dtype, device=raw.device)
            torch.index_select(raw, 0, rows, out=saved)
        self._rows.append((what, raw, rows, saved))

    def scrub_rows(self, buffer: torch.Tensor, rows: torch.Tensor, what: str = "rows") -> None:
        """Rows just allocated (free before the restore) that it is about to write: the rollback
        zeroes them rather than putting back their old bytes, which no request owned — so a
        refusal costs no copy up front and leaves none of the refused snapshot's bytes behind."""
        self._scrub.append((what, buffer, rows))  # (nothing computed until a rollback needs it: a restore's hot path)

    def remember_runs(self, runs: list[tuple[np.ndarray, str]]) -> list[RunUndo]:
        """Call before anything writes into the runs (``(dest, what)``: the bytes of one run of
        slots each); whoever writes a piece of a run calls its undo's ``save(a, b)`` first.
        Their undo log is one allocation (made here, in this thread), touched only where saved."""
        memory = host_empty(sum(len(d) for d, _ in runs))  # faulted in only where saved
        undos, at = [], 0
        for dest, what in runs:
            undos.append(RunUndo(what, dest, memory[at : at + len(dest)]))
            at += len(dest)
        self._runs.extend(undos)
        return undos

    def rollback(self, path=None) -> None:
        """Put everything back; raise :class:`RollbackError` naming what could not be."""
        failed: list[str] = []
        first: BaseException | None = None
        # allocator state first: these steps cannot hit a missing kernel or a shape change
        for obj, name, original, saved in self._attrs:
            try:
                if isinstance(original, torch.Tensor):
                    original.copy_(saved)  # in place: other holders (e.g. the KV pool's mapping) share it
                    setattr(obj, name, original)
                elif isinstance(original, list):
                    original[:] = saved
                    setattr(obj, name, original)
                else:
                    setattr(obj, name, saved)
            except Exception as e:  # noqa: BLE001 - keep putting the rest back
                failed.append(f"{type(obj).__name__}.{name}")
                first = first or e
        for what, raw, rows, saved in reversed(self._rows):
            try:
                raw.index_copy_(0, rows, saved)
            except Exception as e:  # noqa: BLE001
                failed.append(what)
                first = first or e
        for undo in reversed(self._runs):
            try:
                undo.rollback()
            except Exception as e:  # noqa: BLE001
                failed.append(undo.what)
                first = first or e
        for what, buffer, rows in self._scrub:
            try:
                raw_rows(buffer).index_fill_(0, rows.to(buffer.device), 0)
            except Exception as e:  # noqa: BLE001
                failed.append(what)
                first = first or e
        self._scrub.clear()
        self._rows.clear()
        self._runs.clear()
        self._attrs.clear()
        if failed:
            raise RollbackError(path, "rollback", "every allocation and remembered row put back, every scrubbed row zeroed", "not put back: " + ", ".join(failed)) from first
