"""Export one request from SGLang's pools into a snapshot file (or one rank's file)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch

from hsnap_format import CommitInfo, HsnapError, Identity, MalformedHeaderError, RequestRecord, Snapshot, SnapshotSet, SnapshotWriter
from hsnap_format.buffers import KeptBuffers
from hsnap_format.chain import LinkFacts, base_ref, check_link
from hsnap_format.errors import ChainError, PageError, Phrase, require_type
from hsnap_format.layout import inline_runs
from hsnap_format.pages import PageStore
from hsnap_format.spec import RANK_FILE_RE
from hsnap_format.records import BaseRef, Sharding
from hsnap_format.spec import MAX_CHAIN_DEPTH
from hsnap_format.stores import store_for

from .adapters import PoolView, view_pools
from .pagestore import page_rows, page_store
from .transfer import DEFAULT_STAGING_BYTES, bytes_per_row, engine_for


@dataclass(frozen=True)
class RequestSlots:
    """Where one request's state lives in the pools (row indices per index space)."""

    token: torch.Tensor  # full-attention token slots, position order, int64
    swa: torch.Tensor | None  # SWA slots for positions swa_start.., int64
    mamba: torch.Tensor | None  # [1] mamba slot, int64

    def rows(self, space: str) -> torch.Tensor:
        return {"token": self.token, "swa": self.swa, "mamba": self.mamba}[space]


def request_slots(view: PoolView, req_pool_idx: int, state_position: int, swa_start: int = 0, path=None) -> RequestSlots:
    """Read the request's slots from the scheduler's own tables (never modifies them)."""
    rtp = view.req_to_token_pool
    token = rtp.req_to_token[req_pool_idx, :state_position].to(torch.int64)
    if state_position > rtp.req_to_token.shape[1]:
        raise MalformedHeaderError(path, "state_position", f"<= max_context_len {rtp.req_to_token.shape[1]}", state_position)
    if state_position and int(token.min()) <= 0:
        raise HsnapError(path, "req_to_token", "allocated slots (> 0) for every committed position", "slot 0 (padding) present")
    swa = None
    if any(b.space == "swa" for b in view.bindings):
        swa = view.kv_pool.translate_loc_from_full_to_swa(token[swa_start:]).to(torch.int64)
        if len(swa) and int(swa.min()) <= 0:
            raise HsnapError(path, "full_to_swa_index_mapping", f"SWA slots for positions {swa_start}..{state_position - 1}", "unmapped positions (pass swa_start)")
    mamba = None
    if view.mamba_pool is not None:
        idx = int(rtp.req_index_to_mamba_index_mapping[req_pool_idx])
        if idx <= 0:
            raise HsnapError(path, "req_index_to_mamba_index_mapping", "a mamba slot (> 0)", idx)
        mamba = torch.tensor([idx], dtype=torch.int64, device=token.device)
    return RequestSlots(token, swa, mamba)


def export_request(
    path: str | os.PathLike[str],
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    req_pool_idx: int,
    record: RequestRecord,
    identity: Identity,
    swa_start: int = 0,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    fsync: bool = True,
    mode: int = 0o600,
    sharding=None,
    storage_options=None,
    base=None,
    pages=None,
) -> CommitInfo:
    """Write the request's KV rows, Mamba slot and record to ``path``; return the commit info.

    The source slots are only read. Free them after this returns (the file is
    durable under its final name by then), never before. ``sharding`` (format 1.1,
    :func:`hsnap_io.reshard.describe`) records this rank's share of the global state,
    which a restore at another TP size needs.

    ``base`` (format 1.2, spec 5.9): write a *delta* of an earlier snapshot of this request
    — its path (a rank file, or a set directory / prefix whose rank ``identity.tp_rank`` is
    taken), or an open ``Snapshot`` / ``SnapshotSet`` — which must lie beside ``path``
    (beside the set ``path`` is a rank of). Only the attention rows after the base's
    position are read from the pools and written; the recurrent state and the record are
    whole. The base must be this request's (rid, prompt, its output a prefix of this one),
    on this model, weights, engine, rank and geometry, at a position not beyond this one:
    else :class:`~hsnap_format.ChainError`, before anything is written.

    ``pages`` (format 1.3, spec 5.10): store the file's full pages of attention rows once,
    in a page store beside it — a :class:`~hsnap_format.pages.PageStore` (a session shared
    by many exports: a drain), or the name of a page directory beside ``path`` (beside the
    set directory for a ``rank-N.hsnap`` of a set). Each full page (``page_size`` positions,
    default the pool's) becomes one page object keyed by SGLang's page hash chain over the
    token ids, under its namespace; one that is already there with the same bytes is
    verified and reused, never rewritten. The file then holds only the rows around its
    pages, its sliding-window rows, the recurrent state and the record. Pages are durable
    before the file is committed, and protected from a concurrent ``hsnap gc --pages``
    (spec 8.2).
    """
    require_type(path, "identity", identity, Identity)  # typed refusals, not AttributeError, for a dict
    require_type(path, "record", record, RequestRecord)
    view = _described(view_pools(req_to_token_pool, token_to_kv_pool_allocator), sharding, path)
    slots = request_slots(view, req_pool_idx, record.state_position, swa_start, path)
    identity = complete_identity(identity)
    store = store_for(path, storage_options)
    with _DeltaBase.open(base, path, store, identity, view, record, swa_start) as delta, _pages_session(pages, path, storage_options) as session:
        ref = None if delta is None else delta.ref
        engine = engine_for(view.device, staging_bytes)
        base_position = 0 if ref is None else ref.state_position
        plan, full_token = None, slots.token
        if session is not None:  # which full pages: keys from the token ids (nothing put yet)
            plan = session.plan_pages(path=os.fspath(path), identity=identity, geometry=view.geometry, record=record,
                                      base_position=base_position, in_set=_is_set_rank(path))
        if delta is not None:  # only the rows after the base's position are read from the pools
            slots = delta.rows_after(slots, swa_start)
        if plan is not None:  # ... and of those, only the rows around the pages
            runs = inline_runs(base_position, record.state_position, plan.page_size)
            slots = RequestSlots(_rows(full_token, runs), slots.swa, slots.mamba)
        # a file to fsync writes back as it goes; an s3:// URL streams a multipart upload whose
        # completion is the commit (hsnap_format.stores.s3.upload). Created first: a name it refuses
        # is refused before any page is put.
        with store.writer(os.fspath(path), writeback=fsync, identity=identity, geometry=view.geometry, record=record,
                          swa_start=swa_start, mode=mode, base=ref, pages=None if plan is None else plan.placeholder()) as w:
            if plan is not None:  # the pages, durable (spec 8.2), then the file that references them
                w.set_pages(session.put_pages(plan, page_rows(view, full_token, engine)))
            planned = [s.name for s in w.pending_state_sections()]
            bound = [b.name for b in view.bindings]
            if planned != bound:  # adapters and layout disagree: a bug, never a silent file
                raise AssertionError(f"section plan {planned[:4]}... != pool bindings {bound[:4]}...")
            for b in view.bindings:
                engine.export_section(b.buffer, slots.rows(b.space), _sink(w, b.name), b.host_rows)
            engine.finish_export()
            return w.commit(fsync=fsync)


@dataclass
class CapturedRequest:
    """What a checkpoint link needs from the pools, copied to host memory at a committed boundary
    (:func:`capture_request`): later decode steps cannot change it, and the slots may be freed once
    this exists. :func:`write_captured` writes it (off the decode path: any thread)."""

    identity: Identity
    geometry: object
    record: RequestRecord
    swa_start: int
    base_position: int  # the rows held start there (0: a plain snapshot)
    sections: dict  # section name -> list of host uint8 chunks (own copies)
    backing: np.ndarray | None = None  # the one host buffer the chunks are views of (CAPTURE_BUFFERS)
    released: bool = False

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for chunks in self.sections.values() for c in chunks)

    def release(self) -> None:
        """Hand the host copies' memory to the next capture, once the last write of them is done: a released
        capture holds nothing and cannot be written (:func:`write_captured` refuses it)."""
        backing, self.backing, self.sections = self.backing, None, {}
        self.released = True
        if backing is not None:
            CAPTURE_BUFFERS.give(backing)


# Captures copy into one host buffer each, taken from (and given back to) these: a server's
# exports, checkpoint links and migration rounds reuse the memory instead of faulting in fresh
# pages on the scheduler thread for every capture.
CAPTURE_KEEP_BYTES = 128 << 20
CAPTURE_BUFFERS = KeptBuffers(CAPTURE_KEEP_BYTES)


def _described(view, sharding, path):
    """``view`` whose geometry carries ``sharding`` (format 1.1: this rank's share of the global state,
    :func:`hsnap_io.reshard.describe`), so that a target of another TP size can re-shard what is written."""
    require_type(path, "sharding", sharding, Sharding, optional=True)
    if sharding is None:
        return view
    return dataclasses.replace(view, geometry=dataclasses.replace(view.geometry, sharding=sharding))


def capture_request(
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    req_pool_idx: int,
    record: RequestRecord,
    identity: Identity,
    swa_start: int = 0,
    base_position: int = 0,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    sharding=None,
) -> CapturedRequest:
    """The synchronous half of a (delta) export: the attention rows after ``base_position`` (every
    row when 0), the whole recurrent state of the Mamba slot and the record, as host copies.
    ``base_position`` is the state position of the base the delta will name
    (:func:`write_captured` checks it against the base it opens); ``sharding`` as for
    :func:`export_request`."""
    require_type(None, "identity", identity, Identity)
    require_type(None, "record", record, RequestRecord)
    view = _described(view_pools(req_to_token_pool, token_to_kv_pool_allocator), sharding, None)
    slots = request_slots(view, req_pool_idx, record.state_position, swa_start)
    if base_position:
        if not 0 < base_position <= record.state_position:
            raise ChainError(None, "base.state_position", Phrase(f"<= the request's position {record.state_position}"), base_position)
        swa = None if slots.swa is None else slots.swa[max(base_position, swa_start) - swa_start :]
        slots = RequestSlots(slots.token[base_position:], swa, slots.mamba)
    engine = engine_for(view.device, staging_bytes)
    plan = [(b, slots.rows(b.space)) for b in view.bindings]
    sizes = [len(rows) * bytes_per_row(b.buffer) for b, rows in plan]
    backing = CAPTURE_BUFFERS.take(sum(sizes))
    sections: dict = {}
    at = 0
    try:
        for (b, rows), n in zip(plan, sizes):
            dest = backing[at : at + n]
            at += n
            sections[b.name] = [dest]
            if getattr(engine, "exports_into", False):
                engine.export_into(b.buffer, rows, dest, b.host_rows)
            else:
                engine.export_section(b.buffer, rows, _filling(dest), b.host_rows)
        engine.finish_export()
    except BaseException:
        CAPTURE_BUFFERS.give(backing)  # nothing refers to it: the next capture may take it
        raise
    return CapturedRequest(complete_identity(identity), view.geometry, record, swa_start, base_position, sections, backing)


def _filling(dest: np.ndarray):
    """An export sink that copies each chunk into ``dest`` in order (an engine that stages: pinned chunks)."""
    at = 0

    def sink(data, first: bool, last: bool) -> None:
        nonlocal at
        chunk = np.asarray(data, dtype=np.uint8).reshape(-1)
        np.copyto(dest[at : at + len(chunk)], chunk)
        at += len(chunk)
        if last and at != len(dest):
            raise AssertionError(f"export chunks of {at} bytes for a section of {len(dest)}")

    return sink


@dataclass(frozen=True)
class WrittenLink:
    """A snapshot :func:`write_captured` committed, as the next delta of it needs it: the chain
    facts of its header, what a delta names (its root digest, id, position, depth) and its output
    ids — so a checkpointer that wrote it names it as a base without re-opening the file (the
    same checks as for an opened base; a resume still verifies the whole chain)."""

    path: str
    info: CommitInfo
    facts: LinkFacts
    ref: BaseRef  # what a delta of this link writes as its base
    output_ids: np.ndarray


def write_captured(path, cap: CapturedRequest, *, base=None, fsync: bool = True, mode: int = 0o600, storage_options=None) -> WrittenLink:
    """The asynchronous half: write ``cap`` to ``path`` (a delta of ``base`` when given — a path or
    open snapshot as for :func:`export_request`, or the :class:`WrittenLink` an earlier call
    returned, not re-opened: the same chain checks — whose position must be ``cap.base_position``),
    committed atomically (temporary, fsync, rename). Touches no pool."""
    if cap.released:
        raise ValueError(f"{path}: a capture released after its write cannot be written again")
    store = store_for(path, storage_options)
    view = _GeometryOnly(cap.geometry)
    if (base is None) != (cap.base_position == 0):
        raise ChainError(path, "base", Phrase("a base exactly when the capture holds the rows after one"), base)
    opener = _HeldBase.check if isinstance(base, WrittenLink) else _DeltaBase.open
    with opener(base, path, store, cap.identity, view, cap.record, cap.swa_start) as delta:
        ref = None if delta is None else delta.ref
        if ref is not None and ref.state_position != cap.base_position:
            raise ChainError(path, "base.state_position", Phrase(f"{cap.base_position} (the rows captured start there)"), ref.state_position)
        with store.writer(os.fspath(path), writeback=fsync, identity=cap.identity, geometry=cap.geometry, record=cap.record,
                          swa_start=cap.swa_start, mode=mode, base=ref, pages=None) as w:
            planned = [s.name for s in w.pending_state_sections()]
            if planned != list(cap.sections):
                raise AssertionError(f"section plan {planned[:4]}... != captured sections {list(cap.sections)[:4]}...")
            for name, chunks in cap.sections.items():
                sink = _sink(w, name)
                for i, c in enumerate(chunks):
                    sink(c, i == 0, i == len(chunks) - 1)
            info = w.commit(fsync=fsync)
    own_depth = 0 if ref is None else ref.depth
    return WrittenLink(os.fspath(path), info, LinkFacts.of_export(path, cap.identity, cap.geometry, cap.record, cap.swa_start),
                       BaseRef(name=store.split(os.fspath(path))[1], root_digest=info.root_digest, snapshot_id=cap.identity.snapshot_id,
                               state_position=cap.record.state_position, depth=own_depth + 1),
                       np.asarray(cap.record.output_ids))


class _HeldBase:
    """A :class:`WrittenLink` as a delta's base: :class:`_DeltaBase`'s checks on the facts held."""

    def __init__(self, ref: BaseRef) -> None:
        self.ref = ref

    @classmethod
    @contextlib.contextmanager
    def check(cls, base: WrittenLink, path, store, identity: Identity, view, record: RequestRecord, swa_start: int):
        container = store.split(os.fspath(path))[0]
        if _where(store, store.split(base.path)[0]) != _where(store, container):
            raise ChainError(path, "base", Phrase(f"a snapshot beside the delta (in {container})"), base.path)
        if base.ref.depth - 1 >= MAX_CHAIN_DEPTH:
            raise ChainError(path, "base.depth", Phrase(f"<= {MAX_CHAIN_DEPTH} links (compact the chain first: hsnap compact)"), base.ref.depth)
        check_link(base.facts, LinkFacts.of_export(path, identity, view.geometry, record, swa_start), path)
        prefix = base.output_ids
        if not np.array_equal(record.output_ids[: len(prefix)], prefix):
            raise ChainError(path, "request.output_ids", Phrase(f"the base's {len(prefix)} output tokens first ({base.path})"), Phrase("other tokens"))
        yield cls(base.ref)


@dataclass(frozen=True)
class _GeometryOnly:
    geometry: object


def _rows(token: torch.Tensor, runs) -> torch.Tensor:
    return torch.cat([token[a:b] for a, b in runs]) if runs else token[:0]


def _is_set_rank(path) -> bool:
    """A ``rank-N.hsnap`` is written as a rank of a set: its page store lies beside the set."""
    return RANK_FILE_RE.match(os.path.basename(os.fspath(path).rstrip("/"))) is not None


@contextlib.contextmanager
def _pages_session(pages, path, storage_options):
    """The page store an export writes into (None: a plain file). A name gives a session of
    this export alone, closed (its markers dropped) once the file is committed or refused."""
    if pages is None:
        yield None
        return
    if not isinstance(pages, PageStore):
        container = os.fspath(path)
        s = store_for(container, storage_options)
        container = s.split(container)[0]
        if _is_set_rank(path):
            container = s.split(container)[0]
        if not (isinstance(pages, str) and pages and "/" not in pages):
            raise PageError(path, "pages", Phrase("a PageStore, or the name of a page directory beside the snapshot"), pages)
        with page_store(s.join(container, pages), storage_options=storage_options) as session:
            yield session
        return
    yield pages


class _DeltaBase:
    """The base of a delta export, opened (when given by path) and checked against what is
    about to be written (the chain rules of spec 7.5, :mod:`hsnap_format.chain`)."""

    def __init__(self, snap, ref: BaseRef, owned) -> None:
        self.snap, self.ref, self._owned = snap, ref, owned

    @classmethod
    def open(cls, base, path, store, identity: Identity, view, record: RequestRecord, swa_start: int):
        """The checked base as a context manager (closing what it opened); without ``base``
        one that gives None (a plain snapshot)."""
        if base is None:
            return contextlib.nullcontext()
        opened, owned = base, None
        if not isinstance(base, (Snapshot, SnapshotSet)):
            owned = opened = store.open(os.fspath(base), ranks=[identity.tp_rank])
        try:
            in_set = isinstance(opened, SnapshotSet)
            if in_set and identity.tp_rank not in opened.ranks:
                raise ChainError(path, "base", Phrase(f"a set holding rank {identity.tp_rank}"), Phrase(f"ranks {sorted(opened.ranks)} of {opened.path}"))
            snap = opened.ranks[identity.tp_rank] if in_set else opened
            # the delta's links are found beside it: a rank file's beside it, a set rank's beside its set
            container = store.split(store.split(os.fspath(path))[0])[0] if in_set else store.split(os.fspath(path))[0]
            base_container, name = store.split(opened.path)
            if _where(store, base_container) != _where(store, container):
                raise ChainError(path, "base", Phrase(f"a snapshot beside the delta (in {container})"), opened.path)
            if snap.base is not None and snap.base.depth >= MAX_CHAIN_DEPTH:
                raise ChainError(path, "base.depth", Phrase(f"<= {MAX_CHAIN_DEPTH} links (compact the chain first: hsnap compact)"),
                                 snap.base.depth + 1)
            check_link(LinkFacts.of_snapshot(snap), LinkFacts.of_export(path, identity, view.geometry, record, swa_start), path)
            prefix = snap.read("request.output_ids")  # read and hashed
            if not np.array_equal(record.output_ids[: len(prefix)], prefix):
                raise ChainError(path, "request.output_ids", Phrase(f"the base's {len(prefix)} output tokens first ({snap.path})"),
                                 Phrase("other tokens"))
            return cls(snap, base_ref(snap, name), owned)
        except BaseException:
            if owned is not None:
                owned.close()
            raise

    def rows_after(self, slots: RequestSlots, swa_start: int) -> RequestSlots:
        """The slots of the rows a delta holds: full attention after the base's position,
        sliding window from ``max(base position, swa_start)`` (spec 5.9)."""
        b = self.ref.state_position
        swa = None if slots.swa is None else slots.swa[max(b, swa_start) - swa_start :]
        return RequestSlots(slots.token[b:], swa, slots.mamba)

    def __enter__(self) -> "_DeltaBase":
        return self

    def __exit__(self, *exc) -> None:
        if self._owned is not None:
            self._owned.close()


def _where(store, container: str) -> str:
    """A container as compared: a local directory by its real path, a prefix by its URL."""
    return os.path.realpath(container or ".") if store.local else container.rstrip("/")


def complete_identity(identity: Identity) -> Identity:
    """Fill what the exporter knows and the caller left empty: hsnap version, time, id."""
    import hsnap_format

    return dataclasses.replace(
        identity,
        hsnap_version=identity.hsnap_version or hsnap_format.__version__,
        created_at=identity.created_at or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        snapshot_id=identity.snapshot_id or uuid.uuid4().hex,
    )


def _sink(writer: SnapshotWriter, name: str):
    def sink(data, first: bool, last: bool) -> None:
        if first:
            writer.begin_section(name)
        writer.write_chunk(data)
        if last:
            writer.end_section()

    return sink
