"""Restore one request from a snapshot into fresh slots of (other) SGLang pools.

Order of work, so that a refusal leaves the pools untouched:
  1. open (preamble, header, trailer), pick this rank's file — once: the record, every
     check and every uploaded byte come through that one open (:class:`OpenSource`);
  2. compare identity and per-request geometry with the target — every differing
     field is named; pool capacity is not part of identity, nor is the page size
     (sections are per token, spec 5.2: any target page size takes them), nor a
     storage type that is only the byte view of the same element format;
  3. check capacity in the target's own pages (rows, token slots, SWA slots, mamba
     slots, context length);
  4. with ``verify=True``: the padding and the request record (and, for an engine that
     does not read files — CUDA, from the map — every digest); a plain snapshot up to
     ONE_READ_BYTES: every byte, read once into a staging buffer the upload copies from;
  --- nothing above touches the pools ---
  5. allocate as SGLang does for a new request (whole pages of the target), remembering
     the allocators' state; 6. upload section by section, each state section hashed as
     it lands in the slots (``verify=True``); on any failure — a digest mismatch
     included — the allocations are put back (and, with ``exact_rollback``, what each
     touched slot held) and a typed error names the section.
  Steps 5-6 hold :func:`pool_lock` (one per pool set): SGLang's allocators are not
  thread-safe, and the rollback restores the allocators' whole earlier state.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from hsnap_format import (
    CapacityError,
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    Identity,
    IncompatibleSnapshotError,
    RequestRecord,
    Snapshot,
    SnapshotSet,
    TruncatedError,
    geometry_differences,
    identity_differences,
    numerics_differences,
)
from hsnap_format.chain import Chain, Piece, chain_below
from hsnap_format.pages import open_checked
from hsnap_format.errors import Phrase, UnsupportedFeatureError, require_type
from hsnap_format.records import Sharding
from hsnap_format.spec import DTYPES, HEADER_OFFSET, TRAILER
from hsnap_format.storage import store_for

from .adapters import PoolView, view_pools
from .export import RequestSlots
from .statecheck import PoolCheckpoint, RollbackError
from .transfer import DEFAULT_STAGING_BYTES, FileRange, _pread_into, engine_for


class NumericsWarning(UserWarning):
    """The snapshot was written in another numerics environment: bit-exactness is not expected."""


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


def _open_rank(path, rank: int | None, storage_options=None) -> tuple[Snapshot, SnapshotSet | None]:
    """This rank's file: the file itself, or rank ``rank`` (0 by default) of a set — a
    directory or an object-store prefix, whose manifest refuses a rank it does not have."""
    p = os.fspath(path)
    s = store_for(p, storage_options).open(p, ranks=[0 if rank is None else rank])
    return (next(iter(s.ranks.values())), s) if isinstance(s, SnapshotSet) else (s, None)


# Geometry fields a restore does not compare as plain values: the page size is the
# pool's allocation unit (sections are per token, spec 5.2), and the storage type is
# compared by _storage_differs.
_NOT_COMPARED = ("geometry.num_layers", "geometry.attention.page_size", "geometry.attention.storage_dtype")


def _storage_differs(target, snap) -> bool:
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
    diffs += geometry_differences(view.geometry, snap.geometry, ignore=_NOT_COMPARED)
    target, found = view.geometry.attention, snap.geometry.attention
    if _storage_differs(target, found):
        diffs.append(("geometry.attention.storage_dtype", target.storage_dtype, found.storage_dtype))
    if diffs:
        raise IncompatibleSnapshotError(snap.path, diffs)
    return [] if expected is None else numerics_differences(expected, snap.identity)


def _target_page(view: PoolView) -> int:
    return view.geometry.attention.page_size if view.geometry.attention is not None else 1


def check_capacity(snap: Snapshot, view: PoolView) -> None:
    pos, page = snap.state_position, _target_page(view)  # pages of the target, whatever the snapshot's
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
    for what, want, have in need:
        if have < want:
            short.append(f"{what}: need {want}, free {have}")
    if short:
        raise CapacityError(snap.path, "target pools", detail="does not fit: " + "; ".join(short))


def _alloc_token_slots(alloc, pos: int, page: int):
    """``pos`` fresh token slots, handed out as SGLang hands them to a new request: page
    1 ``alloc(pos)``; paged, a prefill without prefix (``alloc_extend``): whole pages,
    token i at ``page_i * page + i % page`` — the layout SGLang's paged kernels assume,
    and the only paged path of its SWA allocator (``alloc`` asserts page 1 there)."""
    if page == 1:
        return alloc.alloc(pos)
    dev = getattr(alloc, "device", "cpu")
    zero, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([pos], dtype=torch.int64)
    last_loc = torch.full((1,), -1, dtype=torch.int64, device=dev)
    return alloc.alloc_extend(zero.to(dev), zero, seq.to(dev), seq, last_loc, pos)


def _allocate(view: PoolView, pos: int, swa_start: int, path, checkpoint: PoolCheckpoint) -> tuple[int, RequestSlots, int]:
    """Request row, token slots (and SWA slots), mamba slot; returns the SWA evict floor too.

    Every index space a binding uses gets a tensor, empty when ``pos`` is 0: a request
    with no committed position still has (empty) attention and SWA sections."""
    held = _HELD_CHECKPOINTS.get()
    if held is not None:  # restore_opened(bind=...): the rollback stays open past the upload
        held.append(checkpoint)
    rtp, alloc = view.req_to_token_pool, view.allocator
    page = _target_page(view)
    rows = rtp.alloc_rows(1)
    if not rows:
        raise CapacityError(path, "req_to_token_pool rows", 1, 0)
    row = rows[0]
    att = view.geometry.attention
    token = torch.empty(0, dtype=torch.int64)
    swa = torch.empty(0, dtype=torch.int64) if att is not None and att.swa_layers else None
    floor = 0
    if att is not None and pos:
        got = _alloc_token_slots(alloc, pos, page)
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


def restore_request(
    path: str | os.PathLike[str],
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    rank: int | None = None,
    verify: bool | str = True,
    exact_rollback: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    sharding=None,
    tp_size: int | None = None,
    storage_options=None,
) -> RestoredRequest:
    """Load a snapshot into fresh slots. ``identity`` is the target's own identity (the
    strict fields must match); ``None`` skips the identity check (geometry is always checked).

    Raises a typed :class:`HsnapError` on any refusal. Identity, geometry and capacity
    are checked before anything is allocated. ``verify`` decides how digests are checked:

    * ``True`` (default): every refusal leaves the pools exactly as they were, byte for
      byte. A plain snapshot whose body is at most :data:`ONE_READ_BYTES` is read once,
      into a reused staging buffer, every section hashed and the padding checked as it
      lands, before anything is allocated, and uploaded from that buffer (what was
      hashed is what was uploaded, whatever the file does afterwards). Otherwise a
      file is verified whole before anything is allocated, and each state section is
      hashed again as it lands in the slots (a file changed between the check and the
      upload is caught and rolled back — allocations exactly, the written free slots'
      old bytes only with ``exact_rollback``); an object there can only be checked
      while it is read: it gets ``exact_rollback`` automatically, so a digest refusal
      is byte-exact there too.
    * ``"during"``: read once — padding and record first, each state section hashed as
      it lands in the slots. Faster (bench/RESULTS.md); a digest mismatch then gives
      back every allocation (free lists, mappings, request row) exactly, but the bytes
      of the free slots it wrote come back only with ``exact_rollback=True``.
    * ``False``: no digest is checked.

    Any other failure *during* the upload gives back every allocation exactly; the freed
    slots' bytes, which nothing reads before writing them, are put back only with
    ``exact_rollback=True``, which costs a copy of the whole payload. (An engine that
    uploads from the map — CUDA — always verifies every digest first.)

    Across TP sizes: ``sharding`` is the target rank's own description
    (:func:`hsnap_io.reshard.describe` of its model at its TP size). Given it, a snapshot
    directory written at another TP size is re-sharded (:mod:`hsnap_io.reshard`): this
    rank reads each source section it depends on whole (its digest covers every byte), in
    2 MiB pieces hashed as they land, and copies only its heads/channels into the slots,
    after verifying every such section; all the guarantees above hold. The
    target TP size is ``identity.tp_size`` (``tp_size`` when ``identity`` is None).

    The file (or set) is opened once: everything checked, hashed and uploaded comes
    through that one open (:func:`open_source`, :func:`restore_opened`).
    """
    require_type(path, "identity", identity, Identity, optional=True)  # typed refusals, not AttributeError, for a dict
    require_type(path, "sharding", sharding, Sharding, optional=True)
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    with open_source(path, rank=rank, identity=identity, sharding=sharding, tp_size=tp_size, storage_options=storage_options) as source:
        return _restore_view(source, view, identity, verify, exact_rollback, staging_bytes, None)


# verify= argument -> how digests are checked (restore_request's docstring)
_VERIFY_MODES = {True: "before", "before": "before", "during": "during", False: None}

# what open_source takes of restore_request's keywords (the rest is restore_opened's)
OPEN_KEYWORDS = ("sharding", "tp_size", "storage_options")


@dataclass
class OpenSource:
    """One open of a snapshot for one restore: the record, every check and every uploaded
    byte come through it, so a file renamed over the path meanwhile is never mixed in
    (one open, one proof). ``snap`` is the rank file whose record the request continues —
    this rank's file, or rank 0 of a set that is re-sharded (``resharded``)."""

    path: str
    snap: Snapshot
    snapset: SnapshotSet | None
    rank: int | None
    resharded: bool = False
    sharding: Any = None
    target_tp: int | None = None
    # ``snap`` and the links below it when it is a delta (spec 7.5), opened and checked
    # with it; a plain snapshot is a chain of one link
    chain: Chain | None = None

    def __post_init__(self) -> None:
        if self.chain is None:
            self.chain = Chain.single(self.snap)

    def close(self) -> None:
        self.chain.close()
        (self.snapset or self.snap).close()

    def __enter__(self) -> "OpenSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_source(path, *, rank: int | None = None, identity: Identity | None = None, sharding=None,
                tp_size: int | None = None, storage_options=None) -> OpenSource:
    """Open ``path`` once for :func:`restore_opened`. ``rank`` defaults to
    ``identity.tp_rank``. With ``sharding`` (this rank's description), a snapshot directory
    written at another TP size than the target's (``identity.tp_size``, else ``tp_size``) is
    opened whole — manifest and every rank, once — for re-sharding."""
    if rank is None and identity is not None:
        rank = identity.tp_rank
    target_tp = identity.tp_size if identity is not None else tp_size
    p = os.fspath(path)
    store = store_for(p, storage_options)
    if sharding is None or not (store.local and os.path.isdir(p)):  # re-sharding reads a local set's rank files
        snap, snapset = _open_rank(p, rank, storage_options)
        return _with_chain(OpenSource(p, snap, snapset, rank), store)
    snapset = store.open(p)  # the manifest and every rank file: the one open of this restore
    try:
        source_tp = snapset.manifest.tp_size
        if target_tp is not None and source_tp != target_tp:
            if rank is None or not 0 <= rank < target_tp:
                raise IncompatibleSnapshotError(p, [("identity.tp_rank", f"0..{target_tp - 1}", rank)])
            delta = next((s for s in snapset.ranks.values() if s.base is not None), None)
            if delta is not None:  # each rank's chain would have to be re-sharded link by link
                raise UnsupportedFeatureError(delta.path, "re-sharding a snapshot chain", Phrase("a plain set (hsnap compact it first)"),
                                              Phrase(f"a delta of {delta.base.name!r}"))
            paged = next((s for s in snapset.ranks.values() if s.pages is not None), None)
            if paged is not None:  # its rows are split between the file and its page objects
                raise UnsupportedFeatureError(paged.path, "re-sharding a set that references pages",
                                              Phrase("a self-contained set (hsnap compact it first)"), Phrase(f"pages in {paged.pages.store!r}"))
            return OpenSource(p, snapset.ranks[0], snapset, rank, resharded=True, sharding=sharding, target_tp=target_tp)
        r = 0 if rank is None else rank
        if r >= source_tp:
            raise IncompatibleSnapshotError(p, [("identity.tp_rank", f"< tp_size {source_tp}", r)])
        return _with_chain(OpenSource(p, snapset.ranks[r], snapset, r), store)
    except BaseException:
        snapset.close()
        raise


def _with_chain(source: OpenSource, store) -> OpenSource:
    """``source`` with the chain below its rank file when that is a delta — every link
    opened once, here, and checked against the one above (spec 7.5) — and with where it
    lies, so that its page store is found (spec 5.10), before anything else of the restore.
    A refusal closes what was opened."""
    snap = source.snap
    if snap.base is None and snap.pages is None:
        return source
    try:
        if source.snapset is not None:
            rank = next(r for r, s in source.snapset.ranks.items() if s is snap)
            source.chain = chain_below(snap, location=source.snapset.path, rank=rank, store=store)
        else:
            source.chain = chain_below(snap, location=source.path, store=store)
    except BaseException:
        source.close()
        raise
    return source


def check_target(source: OpenSource, view: PoolView, identity: Identity | None) -> None:
    """The cheap refusals of :func:`restore_opened` (identity, geometry, capacity: the header
    only), for a caller that has more to check before it restores. A re-sharded source is
    checked by :mod:`hsnap_io.reshard` when it restores."""
    if not source.resharded:
        check_compatible(source.snap, view, identity)
        check_capacity(source.snap, view)


def restore_opened(
    source: OpenSource,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    verify: bool | str = True,
    exact_rollback: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bind=None,
) -> RestoredRequest:
    """:func:`restore_request` from an :class:`OpenSource` the caller opened (and read the
    record from). ``bind(restored)``, when given, runs under :func:`pool_lock` right after
    the upload and inside its rollback: if it raises, every allocation of the restore (and
    whatever ``bind`` allocated from the same pools) is given back, as for a failed upload,
    and the error is raised typed (:class:`UploadError` naming ``bind`` for an untyped one)."""
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    return _restore_view(source, view, identity, verify, exact_rollback, staging_bytes, bind)


def _restore_view(source: OpenSource, view: PoolView, identity, verify, exact_rollback, staging_bytes, bind) -> RestoredRequest:
    if bind is None:
        return _restore_source(source, view, identity, verify, exact_rollback, staging_bytes)
    with pool_lock(view.req_to_token_pool):  # nothing else allocates between the upload and bind
        held: list[PoolCheckpoint] = []
        token = _HELD_CHECKPOINTS.set(held)
        try:
            restored = _restore_source(source, view, identity, verify, exact_rollback, staging_bytes)
        finally:
            _HELD_CHECKPOINTS.reset(token)
        try:
            bind(restored)
        except BaseException as e:
            if not held:  # a restore path that allocates without _allocate: say so, loudly
                raise RollbackError(source.snap.path, "rollback", "the restore's allocation registered for bind", Phrase("none: not given back")) from e
            raise_upload_failure(None, held[-1], source.snap.path, e, "bind")
    return restored


# The checkpoint of the allocation in progress, kept past the upload for restore_opened's
# bind: _allocate (used by the plain and the re-sharded path) registers it here.
_HELD_CHECKPOINTS: "contextvars.ContextVar[list[PoolCheckpoint] | None]" = contextvars.ContextVar("hsnap_held_checkpoints", default=None)


def _restore_source(source: OpenSource, view: PoolView, identity, verify, exact_rollback, staging_bytes) -> RestoredRequest:
    if source.resharded:
        from .reshard import restore_resharded

        return restore_resharded(source.snapset, view, identity=identity, target=source.sharding, target_tp=source.target_tp,
                                 target_rank=source.rank, verify=verify, exact_rollback=exact_rollback, staging_bytes=staging_bytes)
    snap = source.snap
    numerics = check_compatible(snap, view, identity)
    if numerics:
        warnings.warn(
            NumericsWarning(
                f"{snap.path}: written under other numerics ("
                + "; ".join(f"{k}: {e!r} here, {f!r} in snapshot" for k, e, f in numerics)
                + "): the continuation is valid but bit-exactness with an uninterrupted run is not expected"
            ),
            stacklevel=4,
        )
    check_capacity(snap, view)
    engine = engine_for([b.buffer for b in view.bindings], staging_bytes)
    mode = _VERIFY_MODES.get(verify)
    if mode is None and verify not in _VERIFY_MODES:
        raise ValueError(f"verify must be True, 'during' or False, not {verify!r}")
    # Hashing while uploading (a file's preads 2 MiB at a time, hashed while in cache;
    # an object store's ranged GETs): what was hashed is exactly what is in the slots.
    # An engine that does not read files (CUDA: uploads from the map) verifies first.
    remote = getattr(snap, "verifies_while_reading", False)
    during = mode is not None and (remote or engine.reads_files)
    chain = source.chain  # every link of a delta was opened and checked with it (spec 7.5)
    staged = _Staged.take(chain) if mode == "before" and engine.reads_files else None
    try:
        return _restore_checked(source, view, chain, engine, mode, remote, during, numerics, exact_rollback, staged)
    finally:
        if staged is not None:
            staged.release()


def _restore_checked(source: OpenSource, view: PoolView, chain: Chain, engine, mode, remote: bool, during: bool, numerics,
                     exact_rollback: bool, staged: "_Staged | None") -> RestoredRequest:
    snap = source.snap
    try:
        if staged is not None:
            chain.check_unchanged()  # (an object: a HEAD; its GETs are pinned to the ETag of open as well)
            staged.verify()  # the one read: every byte hashed into the staging buffer, every refusal before allocation
        elif mode == "before" and not remote or mode is not None and not during:
            chain.prove()  # every link and page, every byte: every refusal before allocation, pools byte-identical
        else:
            # the same proof (records, keys, every page reference) before anything is allocated,
            # the links' section bytes left to the upload: hashed as they land (or, verify=False, not)
            chain.prove(sections=False, page_sections=mode == "before", padding=mode is not None and not remote, hashed=mode is not None)
    except OSError as e:
        raise HsnapIOError(snap.path, "read", e) from None
    if staged is not None:  # uploaded from the buffer it hashed: nothing read after the check
        with staged.serving():  # the record too (an object: no GET more), hashed again on the way
            record = snap.record(verify=True)
        return _upload(chain, view, record, numerics, engine, exact_rollback, False, staged=staged)
    if mode == "before" and remote:
        exact_rollback = True  # checked only while read: a digest refusal must still be byte-exact
    record = snap.record(verify=during and (mode == "during" or remote))  # else verify() covered it
    return _upload(chain, view, record, numerics, engine, exact_rollback, during)


# The one-read verify (verify=True) stages a payload up to this many bytes: larger ones
# are verified, then read and hashed again as they land (a file), or land hashed with an
# undo log of the slots they overwrite (an object).
ONE_READ_BYTES = 128 << 20


class _Staged:
    """The body of a plain snapshot (every section and the padding between them) read
    once into a staging buffer, each section hashed and the padding checked as each
    piece lands (2 MiB preads of a file; ranged GETs of an object, ``parallel`` running
    ahead of the hashing) — before anything is allocated, so a refusal leaves the pools
    untouched — then uploaded from that buffer: what reaches the pools is what was hashed,
    whatever happens to the file meanwhile. One buffer is kept for the next restore
    (fresh memory is expensive: faulting it in costs more than the copy); restores
    running at once each take their own."""

    _lock = threading.Lock()
    _kept: np.ndarray | None = None

    def __init__(self, snap: Snapshot, start: int, stop: int, buf: np.ndarray) -> None:
        self.snap, self.start, self.stop, self.buf = snap, start, stop, buf

    @classmethod
    def take(cls, chain: Chain) -> "_Staged | None":
        """A staging buffer for ``chain``'s body, or None where the one read does not apply:
        a chain of links or pages (their pieces are read link by link), or a body over
        :data:`ONE_READ_BYTES`."""
        snap = chain.head
        if chain.is_delta or chain.paged:
            return None
        start, stop = HEADER_OFFSET + snap.preamble.header_length, snap.file_length - TRAILER.size
        if not 0 <= stop - start <= ONE_READ_BYTES:
            return None
        with cls._lock:
            buf, cls._kept = (cls._kept, None) if cls._kept is not None and cls._kept.size >= stop - start else (None, cls._kept)
        if buf is None:
            buf = np.empty(-(-max(stop - start, 1) // _HASH_PIECE) * _HASH_PIECE, dtype=np.uint8)
        return cls(snap, start, stop, buf)

    def verify(self) -> None:
        """Read the body into the buffer, hashing as it lands; raise the first failure in
        spec 7.2's order (padding, then sections in table order)."""
        from hsnap_format.remote import stream

        window = getattr(self.snap, "stage_window", _HASH_PIECE)  # an object: bytes per ranged GET
        result: dict = {}
        into = memoryview(self.buf)[: self.stop - self.start]
        failures = [e for _, e in stream(self.snap, window, self.start, self.stop, result=result, into=into) if e is not None]
        if result.get("padding") is not None:
            raise result["padding"]
        if failures:
            raise failures[0]

    def serving(self):
        """Reads of the snapshot served from the buffer where it can (an object's)."""
        serving = getattr(self.snap, "serving", None)
        return serving(self) if serving is not None else contextlib.nullcontext()

    def serve(self, view: memoryview, offset: int) -> int:
        """Copy the staged bytes at ``offset`` into ``view``; how many (0: not staged there)."""
        if not self.start <= offset < self.stop:
            return 0
        k = min(len(view), self.stop - offset)
        view[:k] = memoryview(self.buf)[offset - self.start : offset - self.start + k]
        return k

    def section(self, info, skip: int, length: int) -> "_StagedRange":
        return _StagedRange(memoryview(self.buf)[info.offset - self.start + skip :][:length])

    def release(self) -> None:
        buf, self.buf = self.buf, None
        with _Staged._lock:
            if buf is not None and (_Staged._kept is None or _Staged._kept.size < buf.size):
                _Staged._kept = buf


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


_HASH_PIECE = 2 << 20  # hashed right after it lands, while still in cache


class VerifiedFileRange:
    """One section of an open snapshot file for a file-reading engine (``HostEngine``):
    ``readinto(view, at)`` preads the section's bytes from ``at`` — in order — 2 MiB at a
    time and hashes each piece right after it lands in ``view`` (the slots, or the
    engine's staging chunk on its way to them); :meth:`finish` compares the digest.
    The same call as :class:`hsnap_io.transfer.FileRange` and
    ``hsnap_format.remote.SectionRange``."""

    __slots__ = ("fd", "offset", "length", "info", "path", "_h", "_next")

    def __init__(self, fd: int, info, path) -> None:
        self.fd, self.offset, self.length, self.info, self.path = fd, info.offset, info.length, info, path
        self._h = xxhash.xxh3_128()
        self._next = 0

    def readinto(self, view: memoryview, at: int) -> None:
        if at != self._next:  # the digest is over the section in order
            raise HsnapError(self.path, f"sections[{self.info.name!r}]", f"a read at byte {self._next}", at, detail="out of order")
        for a in range(0, len(view), _HASH_PIECE):
            piece = view[a : a + _HASH_PIECE]
            _pread_into(self.fd, piece, self.offset + at + a)
            self._h.update(piece)
        self._next = at + len(view)

    def finish(self) -> None:
        if self._next != self.length:
            raise TruncatedError(self.path, f"sections[{self.info.name!r}]", self.length, self._next)
        got = self._h.hexdigest()
        if got != self.info.digest:
            raise DigestMismatchError(self.path, f"sections[{self.info.name!r}].digest", self.info.digest, got)


class _StagedRange:
    """Staged (hashed) bytes of one piece with :class:`hsnap_io.transfer.FileRange`'s call:
    the engine copies them straight into the slots (one memcpy for a run of slots)."""

    __slots__ = ("view", "length")

    def __init__(self, view: memoryview) -> None:
        self.view, self.length = view, len(view)

    def readinto(self, view: memoryview, at: int) -> None:
        view[:] = self.view[at : at + len(view)]


class _Window:
    """A section source of which only ``take`` bytes after the first ``skip`` are handed on
    — a link's sliding-window rows that left the window before the head's position (spec
    7.5), or the inline rows on one side of a link's pages (spec 7.6) — while the whole
    section is read and hashed in order (its digest is over all of it): :meth:`finish`
    reads the rest before the source's own check."""

    __slots__ = ("src", "skip", "length", "_done", "_total")

    def __init__(self, src, skip: int, take: int | None = None) -> None:
        self.src, self.skip, self._total = src, skip, src.length
        self.length = src.length - skip if take is None else take
        self._done = 0

    def _pass(self, start: int, stop: int) -> None:
        scratch = memoryview(bytearray(min(max(stop - start, 1), _HASH_PIECE)))
        for a in range(start, stop, len(scratch)):
            n = min(len(scratch), stop - a)
            self.src.readinto(scratch[:n], a)

    def readinto(self, view: memoryview, at: int) -> None:
        if self._done == 0 and self.skip:
            self._pass(0, self.skip)
        self.src.readinto(view, self.skip + at)
        self._done = max(self._done, at + len(view))

    def finish(self) -> None:
        if self.skip and self._done == 0:
            self._pass(0, self.skip)
        end = self.skip + self.length
        if end < self._total:
            self._pass(end, self._total)
        self.src.finish()


def _piece_source(piece, engine, check_digests: bool, staged: "_Staged | None" = None):
    """What the engine reads one piece of a link's (or page object's) section from (see
    :func:`_upload_locked`)."""
    snap, info = piece.link, piece.info
    if staged is not None and snap is staged.snap:  # hashed in the staging buffer (verify=True, one read)
        return staged.section(info, piece.skip, piece.length)
    if not engine.reads_files:  # (an object's raw() is a verified copy of the section)
        return np.frombuffer(snap.raw(info), dtype=np.uint8)[piece.skip : piece.skip + piece.length]
    ranged = getattr(snap, "section_range", None)  # an object: ranged GETs, hashed on the way in
    if ranged:
        src = ranged(info)
    elif check_digests:
        src = VerifiedFileRange(snap.fileno(), info, snap.path)
    else:  # pread into the slots: nothing mapped, an I/O error is an OSError
        return FileRange(snap.fileno(), info.offset + piece.skip, piece.length)
    return _Window(src, piece.skip, piece.take) if piece.skip or piece.length != info.length else src


def _upload(chain: Chain, view: PoolView, record: RequestRecord, numerics, engine, exact_rollback: bool,
            check_digests: bool = False, *, staged: "_Staged | None" = None) -> RestoredRequest:
    with pool_lock(view.req_to_token_pool):
        return _upload_locked(chain, view, record, numerics, engine, exact_rollback, check_digests, staged=staged)


def _upload_locked(chain: Chain, view: PoolView, record: RequestRecord, numerics, engine, exact_rollback: bool,
                   check_digests: bool = False, *, staged: "_Staged | None" = None) -> RestoredRequest:
    """Allocate the head's position once, then fill each section from the pieces of the
    chain that make it up (a plain snapshot: one piece, the section itself): each link's
    attention rows into the slots of its positions, state and record from the head."""
    snap = chain.head
    pos = snap.state_position
    if staged is None:  # (a staged upload reads nothing more from the file)
        chain.check_unchanged()  # refuse a file resized since open (the CUDA upload reads through the map)
    checkpoint = PoolCheckpoint(view)
    uploaded = 0
    where = "allocation"
    ahead = contextlib.ExitStack()  # an object's read-ahead: ended (its GETs waited for) on every way out
    try:
        pieces = {b.name: chain.pieces(b.name) for b in view.bindings}
        if staged is None:
            _read_ahead(ahead, pieces)  # the GETs start now, overlapping the allocation and the undo log
        row, slots, floor = _allocate(view, pos, snap.swa_start, snap.path, checkpoint)
        by_page: dict = {}  # page pieces, uploaded page by page: one page object open at a time
        for b in view.bindings:
            dest = slots.rows(b.space)
            if exact_rollback:
                checkpoint.remember_rows(b.buffer, dest, b.name)
            for piece in pieces[b.name]:
                rows = dest if piece.start is None else dest[piece.start : piece.stop]
                if piece.page is not None:
                    # by reference, not by object: two references to one object are each checked
                    by_page.setdefault((id(piece.page.link), piece.page.index), (piece.page, []))[1].append((b, rows))
                    continue
                where = f"sections[{b.name}]" + (f" of {piece.link.path}" if chain.is_delta or chain.paged else "")
                uploaded += _upload_piece(engine, b, rows, piece, check_digests, staged)
        for ref, targets in by_page.values():
            where = f"pages.refs[{ref.index}] of {ref.link.path} ({ref.path})"
            # opened and checked again (what is uploaded is what this open reads, hashed)
            with open_checked(ref, chain.store) as page:
                for b, rows in targets:
                    where = f"sections[{b.name}] of {ref.path}"
                    info = page.section(b.name)
                    uploaded += _upload_piece(engine, b, rows, Piece(page, info, 0, None, None), check_digests)
        where = "finish upload"
        engine.finish_import()
    except BaseException as e:
        try:
            raise_upload_failure(engine, checkpoint, snap.path, e, where)
        finally:
            ahead.close()
    ahead.close()
    return RestoredRequest(
        req_pool_idx=row,
        token_indices=slots.token,
        mamba_pool_idx=None if slots.mamba is None else int(slots.mamba[0]),
        record=record,
        state_position=pos,
        snapshot_id=snap.identity.snapshot_id,
        bytes_uploaded=uploaded,
        numerics_differences=numerics,
        swa_evict_floor=floor,
    )


def _read_ahead(stack: contextlib.ExitStack, pieces: dict) -> None:
    """Start each link's read-ahead (a capability of a snapshot read over the network —
    ``read_ahead``; a local file has none) over the sections the upload will read from it,
    in the order it reads them (a piece reads its whole section: its digest is over it)."""
    plan: dict[int, tuple] = {}
    for name_pieces in pieces.values():
        for piece in name_pieces:
            if piece.link is not None and getattr(piece.link, "read_ahead", None) is not None:
                plan.setdefault(id(piece.link), (piece.link, []))[1].append(piece.info)
    for link, infos in plan.values():
        stack.enter_context(link.read_ahead(infos))


def _upload_piece(engine, b, rows, piece, check_digests: bool, staged: "_Staged | None" = None) -> int:
    src = _piece_source(piece, engine, check_digests, staged)
    engine.import_section(b.buffer, rows.to(b.buffer.device), src)
    if check_digests and engine.reads_files:
        src.finish()  # DigestMismatchError: rolled back by the caller
    return piece.length


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


__all__ = ["restore_request", "RestoredRequest", "NumericsWarning", "UploadError", "RollbackError", "HsnapError", "pool_lock",
           "open_source", "restore_opened", "OpenSource"]
