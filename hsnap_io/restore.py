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
  4. with ``verify=True``: the padding and the request record; with ``verify="before"``
     (what :func:`prove_opened` does with ``verify=True``) every digest too — a plain
     snapshot up to ONE_READ_BYTES: every byte, read once into a staging buffer the upload
     copies from;
  --- nothing above touches the pools: :func:`prove_opened` does steps 2 and 4 alone, for a
      caller that makes room (evicts a radix cache) only for a snapshot that passed them ---
  5. capacity again, under the pool lock; allocate as SGLang does for a new request (whole pages of the target), remembering
     the allocators' state; 6. upload section by section, each state section hashed as
     it lands in the slots (``verify=True``); on any failure — a digest mismatch
     included — the allocations are put back, the slots written zeroed (with
     ``exact_rollback``, what each held put back instead), and a typed error names the section.
  Steps 5-6 hold :func:`hsnap_io.slots.pool_lock` (one per pool set): SGLang's allocators are not
  thread-safe, and the rollback restores the allocators' whole earlier state.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsnap_format import HsnapIOError, Identity, IncompatibleSnapshotError, RequestRecord, Snapshot, SnapshotSet
from hsnap_format.chain import Chain, Piece, chain_below
from hsnap_format.buffers import KeptBuffers
from hsnap_format.pages import open_checked
from hsnap_format.errors import Phrase, UnsupportedFeatureError, require_type
from hsnap_format.records import Sharding
from hsnap_format.spec import HEADER_OFFSET, TRAILER
from hsnap_format.stores import store_for

from .adapters import PoolView, view_pools
from .checks import NumericsWarning, check_compatible, verify_mode
from .helper import JobFailure, on_two_threads, share_jobs
from .pieces import HASH_PIECE, upload_piece
from .reshard import prove_resharded, upload_resharded
from .slots import RestoredRequest, allocate, check_capacity, holding_checkpoints, pool_lock, raise_upload_failure
from .statecheck import PoolCheckpoint, RollbackError
from .transfer import DEFAULT_STAGING_BYTES, engine_for, host_copy


def _open_rank(path, rank: int | None, storage_options=None) -> tuple[Snapshot, SnapshotSet | None]:
    """This rank's file: the file itself, or rank ``rank`` (0 by default) of a set — a
    directory or an object-store prefix, whose manifest refuses a rank it does not have."""
    p = os.fspath(path)
    s = store_for(p, storage_options).open(p, ranks=[0 if rank is None else rank])
    return (next(iter(s.ranks.values())), s) if isinstance(s, SnapshotSet) else (s, None)


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

    * ``True`` (default): read once. Identity, geometry, capacity, the padding and the
      record are refused before anything is allocated (the pools untouched); each state
      section is hashed as its bytes land in the fresh slots (on two threads for a body
      of :data:`PARALLEL_STAGE_BYTES` or more; an object's GETs run ahead, straight into
      the slots — but an object's body within :data:`ONE_READ_BYTES` is staged and proved
      first, as ``"before"``: faster there). A digest mismatch then gives back every allocation exactly (free lists,
      mappings, request row) and zeroes the slots it wrote — no byte of the refused
      snapshot stays; their old bytes, which no request owned, come back only with
      ``exact_rollback=True``. (CUDA pools alike: the bytes are hashed in the pinned
      staging they are uploaded from.)
    * ``"before"``: every refusal leaves the pools exactly as they were, byte for byte —
      what a caller that makes room (evicts) for the snapshot needs; :func:`prove_opened`
      proves this way with ``verify=True``. A plain snapshot whose body is at most
      :data:`ONE_READ_BYTES` is read once, into a reused staging buffer, every section
      hashed and the padding checked as it lands, before anything is allocated, and
      uploaded from that buffer (what was hashed is what was uploaded, whatever the file
      does afterwards). Otherwise a file is verified whole before anything is allocated,
      and each state section is hashed again as it lands in the slots (a file changed
      between the check and the upload is caught and rolled back — allocations exactly,
      the written slots zeroed, their old bytes only with ``exact_rollback``); an object
      there can only be checked while it is read: it gets ``exact_rollback`` automatically.
    * ``"during"``: ``True``'s one read, for :func:`prove_opened` too (which then proves the
      padding and record only).
    * ``False``: no digest is checked.

    Any other failure *during* the upload gives back every allocation exactly and zeroes
    the slots written; their old bytes are put back only with ``exact_rollback=True``,
    which costs a copy of the whole payload.

    Across TP sizes: ``sharding`` is the target rank's own description
    (:func:`hsnap_io.reshard.describe` of its model at its TP size). Given it, a snapshot
    directory (or a TP 1 file: a set of one rank) written at another TP size is re-sharded (:mod:`hsnap_io.reshard`): this
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
    t = time.perf_counter()
    with open_source(path, rank=rank, identity=identity, sharding=sharding, tp_size=tp_size, storage_options=storage_options) as source:
        opened = time.perf_counter() - t
        restored = _restore_view(source, view, identity, verify, exact_rollback, staging_bytes, None)
    restored.timings["open_s"] = opened
    return restored


# what open_source takes of restore_request's keywords (the rest is restore_opened's)
OPEN_KEYWORDS = ("sharding", "tp_size", "storage_options")
# what prove_opened takes of restore_opened's
PROVE_KEYWORDS = ("verify", "staging_bytes")


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
    # what prove_opened accepted, for this source's restore_opened
    proof: "_Proof | None" = None

    def __post_init__(self) -> None:
        if self.chain is None:
            self.chain = Chain.single(self.snap)

    def close(self) -> None:
        proof, self.proof = self.proof, None
        if proof is not None:
            proof.release()
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
    opened whole — manifest and every rank, once — for re-sharding; so is a TP 1 file, as the
    one-rank set it is (:meth:`SnapshotSet.of_whole_file`)."""
    if rank is None and identity is not None:
        rank = identity.tp_rank
    target_tp = identity.tp_size if identity is not None else tp_size
    p = os.fspath(path)
    store = store_for(p, storage_options)
    if sharding is None or not store.local:  # re-sharding reads local rank files
        snap, snapset = _open_rank(p, rank, storage_options)
        return _with_chain(OpenSource(p, snap, snapset, rank), store)
    if not os.path.isdir(p):  # one file: a TP 1 snapshot re-shards as the one-rank set it is
        snap, _ = _open_rank(p, rank, storage_options)
        if target_tp is None or target_tp == 1 or snap.identity.tp_size != 1:
            return _with_chain(OpenSource(p, snap, None, rank), store)
        snapset = SnapshotSet.of_whole_file(snap)
    else:
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


def check_target(source: OpenSource, view: PoolView, identity: Identity | None, spare: dict[str, int] | None = None, *,
                 capacity: bool = True) -> None:
    """The cheap refusals of :func:`restore_opened` (identity, geometry, capacity: the header
    only), for a caller that has more to check before it restores. ``spare``: slots a caller
    could free (:meth:`hsnap_io.slots.Room.spare`), counted as free; ``capacity=False``: the
    pools' free room is left to the restore (checked under the pool lock; a caller that waits
    for room rather than refuse). A re-sharded source's identity and geometry are checked by its
    proof (:func:`prove_opened`)."""
    if not source.resharded:
        check_compatible(source.snap, view, identity)
    if capacity:
        check_capacity(source.snap, view, spare)


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
    and the error is raised typed (:class:`hsnap_io.slots.UploadError` naming ``bind`` for an untyped one).
    A source :func:`prove_opened` proved is not read again before allocating (its ``verify``
    must be this call's)."""
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    return _restore_view(source, view, identity, verify, exact_rollback, staging_bytes, bind)


def prove_opened(
    source: OpenSource,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    verify: bool | str = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> RequestRecord:
    """Every refusal :func:`restore_opened` makes before it allocates — identity, geometry,
    and with ``verify=True`` every digest (a plain body up to :data:`ONE_READ_BYTES`: read
    once into the staging buffer the upload then copies from) — now, touching no pool, but
    the pools' free room: a caller that makes room (a radix cache evicting entries) between
    this proof and :func:`restore_opened` makes it only for a snapshot that passed every
    other check. Kept on ``source`` for its :func:`restore_opened` (capacity is checked
    there, under the pool lock); given back when the source closes. Returns the record, read
    hashed (what the restore hands back)."""
    if source.proof is not None:
        raise ValueError("this source is proved already")
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    t = time.perf_counter()
    source.proof = _prove(source, view, identity, verify, staging_bytes, capacity=False, stacklevel=3)
    source.proof.seconds = time.perf_counter() - t
    return source.proof.record


def _restore_view(source: OpenSource, view: PoolView, identity, verify, exact_rollback, staging_bytes, bind) -> RestoredRequest:
    if bind is None:
        return _restore_source(source, view, identity, verify, exact_rollback, staging_bytes)
    with pool_lock(view.req_to_token_pool):  # nothing else allocates between the upload and bind
        with holding_checkpoints() as held:
            restored = _restore_source(source, view, identity, verify, exact_rollback, staging_bytes)
        try:
            bind(restored)
        except BaseException as e:
            if not held:  # a restore path that allocates without slots.allocate: say so, loudly
                raise RollbackError(source.snap.path, "rollback", "the restore's allocation registered for bind", Phrase("none: not given back")) from e
            raise_upload_failure(None, held[-1], source.snap.path, e, "bind")
    return restored


def _restore_source(source: OpenSource, view: PoolView, identity, verify, exact_rollback, staging_bytes) -> RestoredRequest:
    proof, source.proof = source.proof, None
    if proof is None:  # nothing to refuse before the pools are touched: read once, hashed as it lands
        t = time.perf_counter()
        proof = _prove(source, view, identity, verify, staging_bytes, capacity=True, stacklevel=5, one_pass=True)
        proof.seconds = time.perf_counter() - t
    elif proof.verify != verify:
        proof.release()
        raise ValueError(f"the source was proved with verify={proof.verify!r}, not {verify!r}")
    try:
        restored = proof.upload(view, exact_rollback)
    finally:
        proof.release()
    restored.timings["prove_s"] = proof.seconds  # (here, or in prove_opened before)
    return restored


@dataclass
class _Proof:
    """What :func:`_prove` accepted: ``upload(view, exact_rollback)`` allocates (capacity checked
    first, under the pool lock) and fills the slots; ``release()`` gives back its staging buffer."""

    verify: bool | str
    record: RequestRecord
    upload: Any
    staged: "_Staged | None" = None
    seconds: float = 0.0  # what the proof took

    def release(self) -> None:
        if self.staged is not None:
            self.staged.release()


def _prove(source: OpenSource, view: PoolView, identity, verify, staging_bytes, *, capacity: bool, stacklevel: int,
           one_pass: bool = False) -> _Proof:
    """The refusals before allocation (``capacity``: the pools' free room too, else checked at upload only).
    ``one_pass``: a restore no caller proved first (nothing was evicted for it) takes ``verify=True`` as
    ``"during"`` (an object's body within the staging bound excepted) — every digest checked as its bytes land in
    fresh slots, a refusal giving back every allocation and zeroing what it wrote — rather than as
    ``"before"`` (every byte read and hashed before allocating, then uploaded by a second pass)."""
    if source.resharded:
        proven = prove_resharded(source.snapset, view, identity=identity, target=source.sharding, target_tp=source.target_tp,
                                 verify=verify, capacity=capacity, stacklevel=stacklevel + 1)
        return _Proof(verify, proven.record, lambda view, exact_rollback: upload_resharded(proven, view, exact_rollback=exact_rollback,
                                                                                         staging_bytes=staging_bytes))
    snap = source.snap
    numerics = check_compatible(snap, view, identity)
    if numerics:
        warnings.warn(
            NumericsWarning(
                f"{snap.path}: written under other numerics ("
                + "; ".join(f"{k}: {e!r} here, {f!r} in snapshot" for k, e, f in numerics)
                + "): the continuation is valid but bit-exactness with an uninterrupted run is not expected"
            ),
            stacklevel=stacklevel,
        )
    if capacity:
        check_capacity(snap, view)  # (the cheap refusal first; checked again right before allocating)
    engine = engine_for(view.device, staging_bytes)
    mode = verify_mode(verify)
    # Hashing while uploading (a file's preads hashed as they land in the slots or the engine's staging; an object
    # store's ranged GETs): what was hashed is exactly what reaches the slots, on every engine.
    remote = getattr(snap.source, "verifies_while_reading", False)
    chain = source.chain  # every link of a delta was opened and checked with it (spec 7.5)
    # (verify="before" asks for the proof first anyway; an object's body within the staging bound is proved first
    # too: its GETs, running ahead into one buffer, are faster there than landing in the slots — bench/REMOTE.md)
    if one_pass and verify is True and not (remote and _Staged.fits(chain)):
        mode = "during"
    staged = _Staged.take(chain) if mode == "before" else None
    try:
        record, exact = _proved_record(source, chain, mode, remote, staged)
    except BaseException:
        if staged is not None:
            staged.release()
        raise

    def upload(view: PoolView, exact_rollback: bool) -> RestoredRequest:
        with pool_lock(view.req_to_token_pool):
            check_capacity(snap, view)  # what a caller freed since the proof counts
            return _upload_locked(chain, view, record, numerics, engine, exact_rollback or exact, mode is not None and staged is None,
                                  staged=staged)

    return _Proof(verify, record, upload, staged)


def _proved_record(source: OpenSource, chain: Chain, mode, remote: bool, staged: "_Staged | None") -> tuple[RequestRecord, bool]:
    """The proof before allocation, by ``mode``; the record (read hashed) and whether the
    upload must keep an exact undo log (a digest refusal that can only come while landing)."""
    snap = source.snap
    try:
        if staged is not None:
            chain.check_unchanged()  # (an object: a HEAD; its GETs are pinned to the ETag of open as well)
            staged.verify()  # the one read: every byte hashed into the staging buffer, every refusal before allocation
        elif mode == "before" and not remote:
            chain.prove()  # every link and page, every byte: every refusal before allocation, pools byte-identical
        else:
            # the same proof (records, keys, every page reference) before anything is allocated,
            # the links' section bytes left to the upload: hashed as they land (or, verify=False, not)
            chain.prove(sections=False, page_sections=mode == "before", padding=mode is not None and not remote, hashed=mode is not None)
    except OSError as e:
        raise HsnapIOError(snap.path, "read", e) from None
    if staged is not None:  # uploaded from the buffer it hashed: nothing read after the check
        with staged.serving():  # the record too (an object: no GET more), hashed again on the way
            return snap.record(verify=True), False
    # checked only while read: a digest refusal must still be byte-exact
    exact = mode == "before" and remote
    return snap.record(verify=mode == "during" or mode is not None and remote), exact  # else prove() covered it


# The one-read verify (verify=True) stages a payload up to this many bytes: larger ones
# are verified, then read and hashed again as they land (a file), or land hashed with an
# undo log of the slots they overwrite (an object).
ONE_READ_BYTES = 128 << 20
PARALLEL_STAGE_BYTES = 4 << 20  # a staged body this large is read and hashed as two parts at once


class _Staged:
    """The body of a plain snapshot (every section and the padding between them) read
    once into a staging buffer, each section hashed and the padding checked as each
    piece lands (2 MiB preads of a file; ranged GETs of an object, ``parallel`` running
    ahead of the hashing) — before anything is allocated, so a refusal leaves the pools
    untouched — then uploaded from that buffer: what reaches the pools is what was hashed,
    whatever happens to the file meanwhile. One buffer is kept for the next restore
    (fresh memory is expensive: faulting it in costs more than the copy); restores
    running at once each take their own."""

    kept = KeptBuffers(ONE_READ_BYTES + HASH_PIECE)  # the buffers of bodies staged lately, up to one largest body

    def __init__(self, snap: Snapshot, start: int, stop: int, buf: np.ndarray) -> None:
        self.snap, self.start, self.stop, self.buf = snap, start, stop, buf

    @staticmethod
    def _body(snap: Snapshot) -> tuple[int, int]:
        """Where the body (every section and the padding between them) starts and stops."""
        return HEADER_OFFSET + snap.preamble.header_length, snap.file_length - TRAILER.size

    @classmethod
    def fits(cls, chain: Chain) -> bool:
        """Whether :meth:`take` stages ``chain``'s body: a plain snapshot of at most :data:`ONE_READ_BYTES`."""
        start, stop = cls._body(chain.head)
        return chain.plain and 0 <= stop - start <= ONE_READ_BYTES

    @classmethod
    def take(cls, chain: Chain) -> "_Staged | None":
        """A staging buffer for ``chain``'s body, or None where the one read does not apply:
        a chain of links or pages (their pieces are read link by link), or a body over
        :data:`ONE_READ_BYTES`."""
        if not cls.fits(chain):
            return None
        snap = chain.head
        start, stop = cls._body(snap)
        return cls(snap, start, stop, cls.kept.take(-(-max(stop - start, 1) // HASH_PIECE) * HASH_PIECE))  # plain pages

    def verify(self) -> None:
        """Read the body into the buffer, hashing as it lands; raise the first failure in
        spec 7.2's order (padding, then sections in table order). A local file's body of
        :data:`PARALLEL_STAGE_BYTES` or more is read and hashed as two parts at once (cut at
        the region boundary nearest its middle: preads and xxhash release the GIL); an
        object's ranged GETs already run ahead of the hashing."""
        from hsnap_format.reader import region_starts, stream

        window = getattr(self.snap.source, "stage_window", None)  # an object: bytes per ranged GET
        into = memoryview(self.buf)[: self.stop - self.start]
        cuts = [self.start, self.stop]
        if window is None and self.stop - self.start >= PARALLEL_STAGE_BYTES:
            middle = (self.start + self.stop) // 2
            inner = [o for o in region_starts(self.snap) if self.start < o < self.stop]
            if inner:
                cuts.insert(1, min(inner, key=lambda o: abs(o - middle)))

        def part(a: int, b: int) -> tuple:
            result: dict = {}
            failures = [e for _, e in stream(self.snap, window or HASH_PIECE, a, b, result=result, into=into[a - self.start : b - self.start])
                        if e is not None]
            return result.get("padding"), failures

        if len(cuts) == 2:
            parts = [part(self.start, self.stop)]
        else:
            parts = list(on_two_threads(lambda: part(cuts[0], cuts[1]), lambda: part(cuts[1], cuts[2]), "hsnap-stage"))
        padding = [p for p, _ in parts if p is not None]
        if padding:
            raise padding[0]
        failures = [e for _, fs in parts for e in fs]
        if failures:
            raise failures[0]

    def serving(self):
        """Reads of the snapshot served from the buffer where it can (an object's)."""
        serving = getattr(self.snap.source, "serving", None)
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
        if buf is not None:
            _Staged.kept.give(buf)


class _StagedRange:
    """Staged (hashed) bytes of one piece with :class:`hsnap_io.transfer.FileRange`'s call:
    the engine copies them straight into the slots (one memcpy for a run of slots)."""

    __slots__ = ("view", "length")

    def __init__(self, view: memoryview) -> None:
        self.view, self.length = view, len(view)

    def readinto(self, view: memoryview, at: int) -> None:
        # numpy's copy releases the GIL (a memoryview assignment holds it): two uploads at once copy on two cores
        np.copyto(np.frombuffer(view, dtype=np.uint8), np.frombuffer(self.view[at : at + len(view)], dtype=np.uint8))

    def readinto_spread(self, view: memoryview, at: int) -> None:
        """:meth:`readinto` on the copy threads (a CUDA engine's pinned chunk)."""
        host_copy(np.frombuffer(view, dtype=np.uint8), np.frombuffer(self.view[at : at + len(view)], dtype=np.uint8))


def _upload_locked(chain: Chain, view: PoolView, record: RequestRecord, numerics, engine, exact_rollback: bool,
                   check_digests: bool = False, *, staged: "_Staged | None" = None) -> RestoredRequest:
    """Allocate the head's position once, then fill each section from the pieces of the
    chain that make it up (a plain snapshot: one piece, the section itself): each link's
    attention rows into the slots of its positions, state and record from the head."""
    snap = chain.head
    pos = snap.state_position
    if staged is None:  # (a staged upload reads nothing more from the file)
        chain.check_unchanged()  # a file resized since open: refused before allocating, not by a short read mid-upload
    checkpoint = PoolCheckpoint(view)
    uploaded = 0
    where = "allocation"
    ahead = contextlib.ExitStack()  # an object's read-ahead: ended (its GETs waited for) on every way out
    t0 = time.perf_counter()
    try:
        pieces = chain.pieces_of([b.name for b in view.bindings])
        t1 = time.perf_counter()
        row, slots, floor = allocate(view, pos, snap.swa_start, snap.path, checkpoint)
        t2 = time.perf_counter()
        by_page: dict = {}  # page pieces, uploaded page by page: one page object open at a time
        plain = []  # (binding, rows, piece, where) uploaded from a link's own section
        space_rows = {}  # index space -> (its slots, how many): found once, not once per section
        for space in {b.space for b in view.bindings}:
            rows = slots.rows(space)
            space_rows[space] = (rows, None if rows is None else len(rows))
        one_link = chain.plain
        for b in view.bindings:
            dest, n = space_rows[b.space]
            for piece in pieces[b.name]:
                rows = dest if piece.start is None or (piece.start == 0 and piece.stop == n) else dest[piece.start : piece.stop]
                if piece.page is not None:
                    # by reference, not by object: two references to one object are each checked
                    by_page.setdefault((id(piece.page.link), piece.page.index), (piece.page, []))[1].append((b, rows))
                    continue
                plain.append((b, rows, piece, f"sections[{b.name}]" if one_link else f"sections[{b.name}] of {piece.link.path}"))
        # an object's read-ahead (a capability of its source; a local file has none)
        reads_ahead = staged is None and any(getattr(link.source, "read_ahead", None) is not None for link in chain.links)
        landings = _landings(plain, engine, checkpoint if exact_rollback else None) if reads_ahead else {}
        if exact_rollback:  # a binding whose every piece lands in its slots saves them piece by piece instead
            landed_only = {id(p[0]) for p in plain} - {id(p[0]) for p in plain if id(p[2]) not in landings} \
                - {id(b) for _, targets in by_page.values() for b, _ in targets}
            for b in view.bindings:
                if id(b) not in landed_only:
                    checkpoint.remember_rows(b.buffer, slots.rows(b.space), b.name)
        else:  # fresh slots: a failure zeroes them (nothing of the snapshot stays), no copy up front
            for b in view.bindings:
                checkpoint.scrub_rows(b.buffer, space_rows[b.space][0], b.name)
        if reads_ahead:
            _read_ahead(ahead, pieces, landings)  # the GETs start now: straight into the slots where they are one run
        t3 = time.perf_counter()
        # staged bytes, or a local file's (preads and hashing release the GIL): into the slots on two threads;
        # an object's GETs already run ahead of the upload
        local = not reads_ahead or all(getattr(p[2].link.source, "read_ahead", None) is None for p in plain)
        shared = (staged is not None or local) and getattr(engine, "forks", False) and len(plain) > 1 \
            and sum(p[2].length for p in plain) >= PARALLEL_STAGE_BYTES
        if shared:
            uploaded += _upload_shared(plain, engine, check_digests, staged)
            where = "finish upload"
        else:
            for b, rows, piece, where in plain:
                uploaded += upload_piece(engine, b, rows, piece, check_digests, staged)
        for ref, targets in by_page.values():
            where = f"pages.refs[{ref.index}] of {ref.link.path} ({ref.path})"
            # opened and checked again (what is uploaded is what this open reads, hashed)
            with open_checked(ref, chain.store) as page:
                for b, rows in targets:
                    where = f"sections[{b.name}] of {ref.path}"
                    info = page.section(b.name)
                    uploaded += upload_piece(engine, b, rows, Piece(page, info, 0, None, None), check_digests)
        where = "finish upload"
        engine.finish_import()
        t4 = time.perf_counter()
    except BaseException as e:
        if isinstance(e, JobFailure):  # a piece of the shared upload: the section it names
            where, e = plain[e.index][3], e.error
        ahead.close()  # first: no GET writes into the slots once they are rolled back
        raise_upload_failure(engine, checkpoint, snap.path, e, where)
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
        timings={"allocate_s": t2 - t1, "plan_s": (t1 - t0) + (t3 - t2), "upload_s": t4 - t3},
    )


def _upload_shared(plain: list, engine, check_digests: bool, staged) -> int:
    """Upload ``plain`` on this thread and the helper thread at once, each taking the next piece when it is free —
    the helper the largest left, this thread the smallest (:func:`share_jobs`) — the helper on a forked engine (its own
    staging); returns the bytes uploaded, or raises the failure of the first piece in ``plain``'s order that failed
    (:class:`JobFailure`: its index), once neither uploads."""
    order = sorted(range(len(plain)), key=lambda i: -plain[i][2].length)

    def run(job, eng) -> int:
        b, rows, piece, _ = job
        return upload_piece(eng, b, rows, piece, check_digests, staged)

    return share_jobs(plain, order, run, engine.fork, engine, "hsnap-upload")


def _landings(plain: list, engine, checkpoint: PoolCheckpoint | None) -> dict:
    """Where a read-ahead may fetch a piece straight into the slots (by ``id(piece)``): a
    whole section whose slots are one run of a contiguous buffer — the engine reads it there
    (``slots_view``), so the bytes are never copied out of a ring buffer. With ``checkpoint``
    (exact rollback) each GET saves the bytes it is about to overwrite first (a
    :class:`~hsnap_io.statecheck.RunUndo`: the undo log is written piece by piece, beside
    the download, not all before it)."""
    from hsnap_format.stores.s3.ranges import Landing

    slots_view = getattr(engine, "slots_view", None)
    runs: dict = {}
    for b, rows, piece, _ in plain:
        if slots_view is None or getattr(piece.link.source, "read_ahead", None) is None or piece.skip or piece.length != piece.info.length:
            continue
        dest = slots_view(b.buffer, rows, b.host_rows)
        if dest is not None and dest.nbytes == piece.length:
            runs[id(piece)] = (dest.reshape(-1), b.name)
    if checkpoint is None:
        return {k: Landing(memoryview(dest)) for k, (dest, _) in runs.items()}
    undos = checkpoint.remember_runs(list(runs.values())) if runs else []
    return {k: Landing(memoryview(dest), undo.save) for (k, (dest, _)), undo in zip(runs.items(), undos)}


def _read_ahead(stack: contextlib.ExitStack, pieces: dict, landings: dict) -> None:
    """Start each link's read-ahead (a capability of a snapshot read over the network —
    ``read_ahead``; a local file has none) over the sections the upload will read from it,
    in the order it reads them (a piece reads its whole section: its digest is over it),
    each landing where :func:`_landings` says."""
    plan: dict[int, tuple] = {}
    for name_pieces in pieces.values():
        for piece in name_pieces:
            if piece.link is not None and getattr(piece.link.source, "read_ahead", None) is not None:
                infos, lands = plan.setdefault(id(piece.link), (piece.link, [], []))[1:]
                infos.append(piece.info)
                lands.append(landings.get(id(piece)))
    for link, infos, lands in plan.values():
        stack.enter_context(link.source.read_ahead(infos, lands))


__all__ = ["restore_request", "open_source", "restore_opened", "prove_opened", "OPEN_KEYWORDS", "PROVE_KEYWORDS", "OpenSource", "check_target"]
