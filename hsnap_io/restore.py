"""Restore one request from a snapshot into fresh slots of (other) SGLang pools.

Order of work, so that a refusal leaves the pools untouched:
  1. open (preamble, header, trailer), pick this rank's file;
  2. compare identity and per-request geometry with the target — every differing
     field is named; pool capacity is not part of identity;
  3. check capacity (rows, token slots or pages, SWA slots, mamba slots, context length);
  4. verify every digest and the padding (``verify=True``);
  --- nothing above touches the pools ---
  5. allocate, remembering the allocators' state; 6. upload section by section,
     remembering what each touched slot held; on any failure both are put back.
  Steps 5-6 hold :func:`pool_lock` (one per pool set): SGLang's allocators are not
  thread-safe, and the rollback restores the allocators' whole earlier state.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hsnap_format import (
    CapacityError,
    HsnapError,
    HsnapIOError,
    Identity,
    IncompatibleSnapshotError,
    RequestRecord,
    Snapshot,
    SnapshotSet,
    geometry_differences,
    identity_differences,
    numerics_differences,
    open_snapshot,
)

from .adapters import PoolView, view_pools
from .export import RequestSlots
from .statecheck import PoolCheckpoint
from .transfer import DEFAULT_STAGING_BYTES, FileRange, engine_for


class NumericsWarning(UserWarning):
    """The snapshot was written in another numerics environment: bit-exactness is not expected."""


@dataclass
class RestoredRequest:
    """What a scheduler needs to rebuild the request."""

    req_pool_idx: int
    token_indices: torch.Tensor  # slots of positions 0..state_position-1 (int64)
    mamba_pool_idx: int | None
    record: RequestRecord
    state_position: int
    snapshot_id: str
    bytes_uploaded: int
    numerics_differences: list[tuple[str, Any, Any]] = field(default_factory=list)


def _open_rank(path, rank: int | None) -> tuple[Snapshot, SnapshotSet | None]:
    p = os.fspath(path)
    if os.path.isdir(p):
        r = 0 if rank is None else rank
        s = open_snapshot(p, ranks=[r])
        if r >= s.manifest.tp_size:
            s.close()
            raise IncompatibleSnapshotError(p, [("identity.tp_rank", f"< tp_size {s.manifest.tp_size}", r)])
        return s.ranks[r], s
    return open_snapshot(p), None


def check_compatible(snap: Snapshot, view: PoolView, expected: Identity | None) -> list[tuple[str, Any, Any]]:
    diffs = [] if expected is None else identity_differences(expected, snap.identity)
    diffs += geometry_differences(view.geometry, snap.geometry, ignore=("geometry.num_layers",))
    if diffs:
        raise IncompatibleSnapshotError(snap.path, diffs)
    return [] if expected is None else numerics_differences(expected, snap.identity)


def check_capacity(snap: Snapshot, view: PoolView) -> None:
    pos, page = snap.state_position, snap.geometry.attention.page_size if snap.geometry.attention else 1
    rtp, alloc = view.req_to_token_pool, view.allocator
    short = []
    history = snap.request["prompt_tokens"] + snap.request["output_tokens"]
    need = [
        ("req_to_token_pool rows", 1, rtp.available_size()),
        ("req_to_token_pool.max_context_len (committed positions)", pos, rtp.req_to_token.shape[1]),
        # refuse a record the target could never continue, before reading (verifying) it all
        ("req_to_token_pool.max_context_len (prompt + output - 1)", history - 1, rtp.req_to_token.shape[1]),
    ]
    if view.geometry.attention is not None:
        full_avail = alloc.full_available_size() if hasattr(alloc, "full_available_size") else alloc.available_size()
        need.append(("token slots", math.ceil(pos / page) * page, full_avail))
        if view.geometry.attention.swa_layers:
            need.append(("swa token slots", math.ceil(pos / page) * page, alloc.swa_available_size()))
    if view.mamba_pool is not None:
        need.append(("mamba slots", 1, rtp.mamba_allocator.available_size()))
    if view.geometry.attention is not None and view.geometry.attention.swa_layers and page > 1:
        from .adapters import UnsupportedPoolError

        raise UnsupportedPoolError(snap.path, "geometry.attention.page_size", "1 for SWA pools (paged SWA restore is not implemented)", page)
    for what, want, have in need:
        if have < want:
            short.append(f"{what}: need {want}, free {have}")
    if short:
        raise CapacityError(snap.path, "target pools", detail="does not fit: " + "; ".join(short))


def _allocate(view: PoolView, pos: int, swa_start: int, page: int, path, checkpoint: PoolCheckpoint) -> tuple[int, RequestSlots]:
    rtp, alloc = view.req_to_token_pool, view.allocator
    rows = rtp.alloc_rows(1)
    if not rows:
        raise CapacityError(path, "req_to_token_pool rows", 1, 0)
    row = rows[0]
    token = torch.empty(0, dtype=torch.int64)
    swa = None
    if view.geometry.attention is not None and pos:
        got = alloc.alloc(math.ceil(pos / page) * page)
        if got is None:
            raise CapacityError(path, "token slots", math.ceil(pos / page) * page, alloc.available_size())
        token = got[:pos].to(torch.int64)
        if view.geometry.attention.swa_layers:
            if swa_start:
                alloc.free_swa(token[:swa_start])  # positions that slid out of the window own no SWA slot
            swa = view.kv_pool.translate_loc_from_full_to_swa(token[swa_start:]).to(torch.int64)
        checkpoint.remember_rows(rtp.req_to_token, torch.tensor([row]))
        rtp.req_to_token[row, :pos] = token.to(rtp.req_to_token.dtype)
    mamba = None
    if view.mamba_pool is not None:
        got = rtp.mamba_allocator.alloc(1)
        if got is None:
            raise CapacityError(path, "mamba slots", 1, 0)
        mamba = got.reshape(1).to(torch.int64)
        checkpoint.remember_rows(rtp.req_index_to_mamba_index_mapping, torch.tensor([row]))
        rtp.req_index_to_mamba_index_mapping[row] = int(mamba[0])
    return row, RequestSlots(token, swa, mamba)


def restore_request(
    path: str | os.PathLike[str],
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    rank: int | None = None,
    verify: bool = True,
    exact_rollback: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> RestoredRequest:
    """Load a snapshot into fresh slots. ``identity`` is the target's own identity (the
    strict fields must match); ``None`` skips the identity check (geometry is always checked).

    Raises a typed :class:`HsnapError` on any refusal. Every refusal that depends on
    the snapshot (identity, geometry, capacity, and with ``verify`` every digest) comes
    before anything is allocated, so the pools are then exactly as before, byte for
    byte. A failure *during* the upload (an exception after verification) gives back
    every allocation — free lists, mappings, the request row — exactly; the bytes of
    the freed slots, which nothing reads before writing them, are put back only with
    ``exact_rollback=True``, which costs a copy of the whole payload (bench/RESULTS.md).
    """
    if rank is None and identity is not None:
        rank = identity.tp_rank
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    snap, snapset = _open_rank(path, rank)
    try:
        numerics = check_compatible(snap, view, identity)
        if numerics:
            warnings.warn(
                NumericsWarning(
                    f"{snap.path}: written under other numerics ("
                    + "; ".join(f"{k}: {e!r} here, {f!r} in snapshot" for k, e, f in numerics)
                    + "): the continuation is valid but bit-exactness with an uninterrupted run is not expected"
                ),
                stacklevel=2,
            )
        check_capacity(snap, view)
        if verify:
            try:
                snap.verify()
            except OSError as e:
                raise HsnapIOError(snap.path, "read", e) from None
        record = snap.record(verify=False)  # covered by verify() when asked
        return _upload(snap, view, record, numerics, staging_bytes, exact_rollback)
    finally:
        (snapset or snap).close()


_POOL_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_POOL_LOCKS_BY_ID: dict[int, tuple[Any, threading.RLock]] = {}  # pools that refuse weak references
_POOL_LOCKS_GUARD = threading.Lock()


def pool_lock(req_to_token_pool) -> threading.RLock:
    """The lock hsnap holds (per pool set, keyed by its ``req_to_token_pool``) while a
    restore allocates, uploads and — on failure — rolls back.

    SGLang's allocators are not thread-safe (its scheduler serialises them), and a
    rollback puts back the allocators' whole state as it was before the restore
    allocated. So restores into one pool set run their allocate/upload/rollback
    step one at a time; opening, checking and verifying (the expensive read of every
    byte) run concurrently, and so does export (it only reads the request's own
    rows). Code that allocates or frees in the same pools from another thread while
    restores may run must hold this lock too (it is reentrant).
    """
    with _POOL_LOCKS_GUARD:
        try:
            lock = _POOL_LOCKS.get(req_to_token_pool)
            if lock is None:
                lock = _POOL_LOCKS[req_to_token_pool] = threading.RLock()
        except TypeError:  # not weak-referenceable or not hashable: keep it alive with its lock
            entry = _POOL_LOCKS_BY_ID.setdefault(id(req_to_token_pool), (req_to_token_pool, threading.RLock()))
            lock = entry[1]
    return lock


def _upload(snap: Snapshot, view: PoolView, record: RequestRecord, numerics, staging_bytes, exact_rollback: bool) -> RestoredRequest:
    with pool_lock(view.req_to_token_pool):
        return _upload_locked(snap, view, record, numerics, staging_bytes, exact_rollback)


def _upload_locked(snap: Snapshot, view: PoolView, record: RequestRecord, numerics, staging_bytes, exact_rollback: bool) -> RestoredRequest:
    pos = snap.state_position
    page = snap.geometry.attention.page_size if snap.geometry.attention else 1
    snap.check_unchanged()  # refuse a file resized since open (the CUDA upload reads through the map)
    checkpoint = PoolCheckpoint(view)
    engine = engine_for([b.buffer for b in view.bindings], staging_bytes)
    fd = snap.fileno()
    uploaded = 0
    try:
        row, slots = _allocate(view, pos, snap.swa_start, page, snap.path, checkpoint)
        for b in view.bindings:
            rows = slots.rows(b.space)
            info = snap.section(b.name)
            if exact_rollback:
                checkpoint.remember_rows(b.buffer, rows)
            if engine.reads_files:  # pread into the slots: nothing mapped, an I/O error is an OSError
                src = FileRange(fd, info.offset, info.length)
            else:
                src = np.frombuffer(snap.raw(info), dtype=np.uint8)
            engine.import_section(b.buffer, rows.to(b.buffer.device), src)
            uploaded += info.length
        engine.finish_import()
    except BaseException as e:
        try:
            engine.finish_import()
        finally:
            checkpoint.rollback()
        if isinstance(e, OSError):
            raise HsnapIOError(snap.path, "read", e) from None
        raise
    return RestoredRequest(
        req_pool_idx=row,
        token_indices=slots.token,
        mamba_pool_idx=None if slots.mamba is None else int(slots.mamba[0]),
        record=record,
        state_position=pos,
        snapshot_id=snap.identity.snapshot_id,
        bytes_uploaded=uploaded,
        numerics_differences=numerics,
    )


__all__ = ["restore_request", "RestoredRequest", "NumericsWarning", "HsnapError", "pool_lock"]
