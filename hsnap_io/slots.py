"""Fresh slots for a restored request, handed out as SGLang hands them, and given back when
its upload fails: whether they fit (:func:`check_capacity`), the allocation
(:func:`allocate`), the lock the allocate / upload / rollback step holds per pool set
(:func:`pool_lock`), and the rollback that raises the failure typed
(:func:`raise_upload_failure`). Shared by the plain restore, the re-sharded one and live
migration; :class:`RestoredRequest` is what they hand back."""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

from hsnap_format import CapacityError, HsnapError, HsnapIOError, RequestRecord, Snapshot

from .adapters import PoolView
from .export import RequestSlots
from .statecheck import PoolCheckpoint, RollbackError


class UploadError(HsnapError):
    """The upload failed after allocation (not an I/O error: that is HsnapIOError);
    every allocation was given back. ``field`` names the section being uploaded."""


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
    # SWA pools: positions below this own no SWA slot (SGLang's req.kv.swa_evict_floor).
    # It is the snapshot's swa_start rounded down to the target's page: positions
    # swa_evict_floor..swa_start-1 hold SWA slots whose bytes are not the snapshot's
    # (they left the window before the snapshot; attention never reads them).
    swa_evict_floor: int = 0
    # re-sharded restores (TP N -> TP M): bytes read from the source files to assemble the
    # shard (digest verification not counted), and which source ranks supplied them
    source_bytes_read: int = 0
    source_ranks: tuple[int, ...] = ()
    # where the restore's time went, in seconds (a plain snapshot's path; absent phases were not timed):
    # open_s (restore_request's open), prove_s (identity, geometry, capacity, and the bytes checked before
    # allocating), allocate_s, plan_s (pieces, rollback plan), upload_s (read, hash and copy into the slots)
    timings: dict[str, float] = field(default_factory=dict)


def target_page(view: PoolView) -> int:
    """The target pools' page size: the unit slots are allocated in."""
    return view.geometry.attention.page_size if view.geometry.attention is not None else 1


class Room(Protocol):
    """Slots a caller can free for a restore or a migration link — a radix cache's unreferenced entries, evicted as
    SGLang's admission evicts them. Counted as free by the capacity checks (:meth:`spare`, touching nothing); freed
    (:meth:`make`) only after every other check passed, right before the allocation, under :func:`pool_lock`: a
    snapshot or link refused for anything never costs the cache."""

    def spare(self) -> dict[str, int]:
        """What could be freed now, by kind: ``"token slots"``, ``"mamba slots"``."""
        ...

    def make(self, token_slots: int, mamba_slots: int) -> None:
        """Free entries until that many slots of each kind are free (what is free already counts)."""
        ...


def slots_needed(snap: Snapshot, view: PoolView) -> tuple[int, int]:
    """Token slots (whole pages of the target, whatever the snapshot's) and Mamba slots a restore of ``snap``
    allocates in ``view``."""
    tokens = math.ceil(snap.state_position / target_page(view)) * target_page(view) if view.geometry.attention is not None else 0
    return tokens, 1 if view.mamba_pool is not None else 0


def check_capacity(snap: Snapshot, view: PoolView, spare: dict[str, int] | None = None) -> None:
    """Refuse ``snap`` when its slots do not fit ``view`` — free slots, plus ``spare`` (:meth:`Room.spare`: what a
    caller could free) — naming every kind that is short."""
    pos = snap.state_position
    rtp, alloc = view.req_to_token_pool, view.allocator
    tokens, mamba = slots_needed(snap, view)
    spare = spare or {}
    history = snap.request["prompt_tokens"] + snap.request["output_tokens"]
    need = [
        ("req_to_token_pool rows", 1, rtp.available_size()),
        ("req_to_token_pool.max_context_len (committed positions)", pos, rtp.req_to_token.shape[1]),
        # refuse a record the target could never continue, before reading (verifying) it all
        ("req_to_token_pool.max_context_len (prompt + output - 1)", history - 1, rtp.req_to_token.shape[1]),
    ]
    if view.geometry.attention is not None:
        full_avail = alloc.full_available_size() if hasattr(alloc, "full_available_size") else alloc.available_size()
        need.append(("token slots", tokens, full_avail))
        if view.geometry.attention.swa_layers:
            need.append(("swa token slots", tokens, alloc.swa_available_size()))
    if mamba:
        need.append(("mamba slots", mamba, rtp.mamba_allocator.available_size()))
    short = [f"{what}: need {want}, free {have}" + (f" + {spare[what]} evictable" if spare.get(what) else "")
             for what, want, have in need if have + spare.get(what, 0) < want]
    if short:
        raise CapacityError(snap.path, "target pools", detail="does not fit: " + "; ".join(short))


def alloc_token_slots(alloc, page: int, start: int, stop: int, last_loc: int = -1):
    """Token slots for positions ``start..stop`` of a request, handed out as SGLang hands
    them: page 1 ``alloc``; paged ``alloc_extend`` after ``last_loc``, the slot of position
    ``start - 1`` (-1: a new request, a prefill without prefix) — whole pages, token i at
    ``page_i * page + i % page``, the layout SGLang's paged kernels assume and the only
    paged path of its SWA allocator (``alloc`` asserts page 1 there)."""
    if page == 1:
        return alloc.alloc(stop - start)
    dev = getattr(alloc, "device", "cpu")
    prefix, seq = torch.tensor([start], dtype=torch.int64), torch.tensor([stop], dtype=torch.int64)
    last = torch.tensor([last_loc], dtype=torch.int64, device=dev)
    return alloc.alloc_extend(prefix.to(dev), prefix, seq.to(dev), seq, last, stop - start)


# The checkpoints of the allocations in progress, kept past the upload for restore_opened's
# bind: allocate (used by the plain and the re-sharded path) registers each here.
_HELD_CHECKPOINTS: "contextvars.ContextVar[list[PoolCheckpoint] | None]" = contextvars.ContextVar("hsnap_held_checkpoints", default=None)


@contextlib.contextmanager
def holding_checkpoints() -> Iterator[list[PoolCheckpoint]]:
    """Collect the checkpoint of every :func:`allocate` made inside: the caller can still
    roll an allocation back after its upload finished."""
    held: list[PoolCheckpoint] = []
    token = _HELD_CHECKPOINTS.set(held)
    try:
        yield held
    finally:
        _HELD_CHECKPOINTS.reset(token)


def allocate(view: PoolView, pos: int, swa_start: int, path, checkpoint: PoolCheckpoint) -> tuple[int, RequestSlots, int]:
    """Request row, token slots (and SWA slots), mamba slot; returns the SWA evict floor too.

    Every index space a binding uses gets a tensor, empty when ``pos`` is 0: a request
    with no committed position still has (empty) attention and SWA sections."""
    held = _HELD_CHECKPOINTS.get()
    if held is not None:  # inside holding_checkpoints: the rollback stays open past the upload
        held.append(checkpoint)
    rtp, alloc = view.req_to_token_pool, view.allocator
    page = target_page(view)
    rows = rtp.alloc_rows(1)
    if not rows:
        raise CapacityError(path, "req_to_token_pool rows", 1, 0)
    row = rows[0]
    att = view.geometry.attention
    token = torch.empty(0, dtype=torch.int64)
    swa = torch.empty(0, dtype=torch.int64) if att is not None and att.swa_layers else None
    floor = 0
    if att is not None and pos:
        got = alloc_token_slots(alloc, page, 0, pos)
        if got is None:
            raise CapacityError(path, "token slots", math.ceil(pos / page) * page, alloc.available_size())
        token = got[:pos].to(torch.int64)
        if swa is not None:
            # positions that slid out of the window own no SWA slot; SGLang frees SWA
            # slots in whole pages, so the partial page below swa_start keeps them
            floor = swa_start // page * page
            if floor:
                alloc.free_swa_segment(token[:floor], start_pos=0)
            swa = view.kv_pool.translate_loc_from_full_to_swa(token[swa_start:]).to(torch.int64)
        checkpoint.remember_rows(rtp.req_to_token, torch.tensor([row]), "req_to_token_pool.req_to_token")
        rtp.req_to_token[row, :pos] = token.to(rtp.req_to_token.dtype)
    mamba = None
    if view.mamba_pool is not None:
        got = rtp.mamba_allocator.alloc(1)
        if got is None:
            raise CapacityError(path, "mamba slots", 1, 0)
        mamba = got.reshape(1).to(torch.int64)
        checkpoint.remember_rows(rtp.req_index_to_mamba_index_mapping, torch.tensor([row]), "req_to_token_pool.req_index_to_mamba_index_mapping")
        rtp.req_index_to_mamba_index_mapping[row] = int(mamba[0])
    return row, RequestSlots(token, swa, mamba), floor


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


def raise_upload_failure(engine, checkpoint: PoolCheckpoint, path, cause: BaseException, where: str):
    """Give every allocation back (:func:`_give_back`), then raise ``cause`` typed: an
    OSError as HsnapIOError, anything untyped (a torch kernel, an allocator assertion)
    as UploadError naming ``where``; HsnapErrors and BaseExceptions as they are."""
    _give_back(engine, checkpoint, path, cause)
    if isinstance(cause, OSError):
        raise HsnapIOError(path, "read", cause) from None
    if isinstance(cause, Exception) and not isinstance(cause, HsnapError):
        raise UploadError(path, where, detail=f"{type(cause).__name__}: {cause}; every allocation was given back") from cause
    raise cause


def _give_back(engine, checkpoint: PoolCheckpoint, path, cause: BaseException) -> None:
    """Drain the engine, then roll back — the rollback runs even when draining fails.
    A rollback that cannot put everything back wins over ``cause`` (chained to it):
    the caller must learn that the pools are not as they were. ``engine`` None: the
    upload had finished (a failure in restore_opened's bind)."""
    try:
        if engine is not None:
            engine.finish_import()
    except Exception:  # noqa: BLE001 - the rollback below matters more; cause is re-raised
        pass
    try:
        checkpoint.rollback(path)
    except RollbackError as r:
        raise r from cause
