"""Live migration of one request between two processes, through a store.

The source keeps decoding while it *pre-copies* its committed attention rows: a plain
snapshot first, then deltas (format 1.2, spec 5.9) of the rows committed since; when few
remain it stops the request and writes the last delta (the tail rows, the whole recurrent
state and the record). The target applies each link as it arrives into slots of its own
pools — an incremental restore: the first link into freshly allocated slots, each delta
into the same request, its rows into newly allocated slots after the ones already there,
its recurrent state over the request's Mamba slot — so the downtime (last token on the
source to first token on the target) only covers the last delta::

    src = MigrationSource("s3://bucket/mig/req-7", req_to_token_pool=..., token_to_kv_pool_allocator=..., identity=...)
    src.precopy(req_pool_idx, record)            # link-0000 (plain), link-0001 ... (deltas), while decoding,
    ...                                          # until src.caught_up(): the target applied every round
    src.stop(req_pool_idx, record)               # final.hsnap; the source's slots may now be freed

    tgt = MigrationTarget(req_to_token_pool=..., token_to_kv_pool_allocator=..., identity=...)
    for applied in tgt.follow("s3://bucket/mig/req-7", timeout_s=60):
        ...                                      # applied.final: decode on from tgt.request
    # or, from a loop that must not wait (a scheduler): tgt.step(container) applies the next link if committed

A source that gives up writes ``abandoned.json`` (:meth:`MigrationSource.abandon`): a following
target's :meth:`~MigrationTarget.step` raises :class:`MigrationError` saying why, and
:meth:`~MigrationTarget.release` gives back what it applied. SGLang servers with the hsnap plug-in
use these names (``/hsnap/migrate``, ``/hsnap/follow``: :mod:`hsnap_sglang.migration`), so a server
and a library process interoperate.

The transport is the storage seam (:mod:`hsnap_format.stores`): a local directory or an
``s3://`` prefix; a link is visible under its name only once committed.

Guarantees of :meth:`MigrationTarget.apply`, as for a restore: before anything is
allocated the link is opened and checked — a delta must name, by root digest, snapshot
id, position and depth, exactly the link applied last, be the same request of the same
model on the same rank with the same geometry, its output ids grown from the applied
link's — and (``verify=True``) every byte of it is read and hashed; every refusal is a
typed :class:`~hsnap_format.HsnapError` and leaves the pools byte-identical and the
migration where it was (a correct link may still be applied). The uploaded rows are
hashed again as they land; a failure during the upload gives back this link's
allocations and puts the request's Mamba slot back as it was. A target given a ``room``
(:class:`hsnap_io.slots.Room`: a radix cache whose entries it may evict) counts what the
room could free in its capacity checks and frees it only after every check of a link
(and ``accept``), right before allocating: a refused link never costs the cache.

Across TP sizes (the re-sharding path, spec 5.8 applied link by link): a source at TP N
writes every link as a TP set — ``sharding=`` its rank's description
(:func:`hsnap_io.reshard.describe`), and at N > 1 ``group=`` its process group: every
source rank calls each method, a link is committed by the group as
:func:`hsnap_io.tp.export_request_tp` commits a set, :meth:`MigrationSource.caught_up` is
collective. Each rank of a target at TP M runs its own :class:`MigrationTarget` with
``sharding=`` its description and follows the same container::

    src = MigrationSource(c, ..., identity=Identity(tp_size=2, tp_rank=r, ...), sharding=describe(tp, 2, r), group=pg)
    tgt = MigrationTarget(..., identity=Identity(tp_size=1, tp_rank=0, ...), sharding=describe(tp, 1, 0))

The first link is restored re-sharded (:func:`hsnap_io.reshard.upload_resharded`); each
later one is applied incrementally, as above: every rank file of the set of deltas must
name, by root digest, id, position and depth, the same rank of the set applied last and be
a delta of it; the set must agree with itself and the target
(:class:`~hsnap_io.reshard.InconsistentSetError`); the runs of every target section must
provably tile it; the source sections this rank reads are hashed — all before anything is
allocated. Then only this rank's heads of the new rows go into new slots after the
request's, and its share of the whole recurrent state over its Mamba slot, each target
section assembled from the source ranks holding it in one scratch buffer, hashed again as
read and checked before it is uploaded. The downtime path reads only the final link (of its
source ranks, the sections this rank needs). With several target ranks each puts the same
``.applied`` marker: the first to apply a round cues the source (the ranks of one engine
apply in step; the cue only decides when the source stops pre-copying).

Not covered: sliding-window pools and links that reference a page store (refused by name);
TP-set links under an ``s3://`` prefix (re-sharding reads local rank files).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from hsnap_format import CapacityError, CommitInfo, HsnapError, Identity, RequestRecord, Snapshot, SnapshotExistsError, SnapshotSet
from hsnap_format.chain import Chain, LinkFacts, check_link, check_ref
from hsnap_format.errors import ChainError, Phrase, UnsupportedFeatureError, require_type
from hsnap_format.migrations import ABANDONED_NAME, APPLIED_SUFFIX, FINAL_NAME, LINK_NAME, REFUSED_NAME, is_final_link
from hsnap_format.records import Sharding
from hsnap_format.stores import store_for

from .adapters import view_pools
from .export import export_request
from .reshard import check_delta_set, delta_set_record, source_ranks_of, upload_delta_set
from .checks import check_compatible
from .pieces import upload_piece
from .restore import check_target, open_source, prove_opened, restore_opened
from .slots import RestoredRequest, Room, alloc_token_slots, pool_lock, raise_upload_failure, slots_needed, target_page
from .statecheck import PoolCheckpoint
from .transfer import DEFAULT_STAGING_BYTES, engine_for



class MigrationError(HsnapError):
    """The migration cannot go on (a link not committed in time, a call out of order)."""


# --------------------------------------------------------------------------- source


class MigrationSource:
    """Writes one request's migration links into ``container`` (a directory or an ``s3://``
    prefix that holds nothing else of this migration). The request's slots are only read;
    free them after :meth:`stop` returns (the last link is committed by then; durable unless
    ``fsync=False``, which a migration on one host can afford: the target reads it at once).
    ``sharding`` (this rank's description) or a TP size above 1: each link is a TP set
    (a directory; at TP > 1 committed collectively over ``group``, every source rank
    calling every method) that targets at another TP size re-shard."""

    def __init__(self, container, *, req_to_token_pool, token_to_kv_pool_allocator, identity: Identity, storage_options=None,
                 fsync: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES, sharding=None, group=None) -> None:
        require_type(container, "identity", identity, Identity)
        require_type(container, "sharding", sharding, Sharding, optional=True)
        self.container = os.fspath(container).rstrip("/")
        self._store = store_for(self.container, storage_options)
        self._pools = dict(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        self._kw = dict(storage_options=storage_options, fsync=fsync, staging_bytes=staging_bytes, sharding=sharding)
        self.identity, self.group = identity, group
        # links as TP sets (directories): one rank file per source rank; re-shardable with a description
        self.sets = sharding is not None or identity.tp_size > 1
        if self.sets and not self._store.local:
            raise UnsupportedFeatureError(self.container, "migration links as TP sets in an object store", Phrase("a local directory"),
                                          Phrase(self.container))
        self.links: list[str] = []
        self.stopped = False
        if self._store.local:
            self._store.makedirs(self.container)

    def _write(self, name: str, req_pool_idx: int, record: RequestRecord) -> CommitInfo:
        if self.stopped:
            raise MigrationError(self.container, "source", Phrase("a migration not yet stopped"), Phrase(f"stopped after {len(self.links)} links"))
        path = self._store.join(self.container, name)
        # every link is its own snapshot: a fresh id and time (the chain checks ids link by link)
        ident = dataclasses.replace(self.identity, snapshot_id="", created_at="")
        kw = dict(**self._pools, req_pool_idx=req_pool_idx, record=record, base=self.links[-1] if self.links else None, **self._kw)
        if self.identity.tp_size > 1:  # collective: every source rank writes its file of the set, rank 0 commits it
            from .tp import export_rank_tp

            ident = dataclasses.replace(ident, snapshot_id=_agreed_id(self.group))
            info = export_rank_tp(path, identity=ident, group=self.group, **kw)[1]
        elif self.sets:
            info = _export_set1(path, ident, kw)
        else:
            info = export_request(path, identity=ident, **kw)
        self.links.append(path)
        return info

    def precopy(self, req_pool_idx: int, record: RequestRecord) -> CommitInfo:
        """One pre-copy round at ``record.state_position``: the plain snapshot first, then a
        delta of the rows committed since the last round (and the state and record)."""
        return self._write(LINK_NAME.format(len(self.links)), req_pool_idx, record)

    def caught_up(self) -> bool:
        """The target (:meth:`MigrationTarget.follow`) has applied every link written so far:
        stopping now leaves only the rows decoded since the last round on the downtime path.
        A source at TP > 1: collective (every source rank gets the same answer: all saw it).
        A target that refused (:meth:`MigrationTarget.refuse`) is a :class:`MigrationError` saying why."""
        refused = self._store.join(self.container, REFUSED_NAME)
        said_no = self._store.exists(refused)
        seen = bool(self.links) and self._store.exists(self.links[-1] + APPLIED_SUFFIX)
        if self.identity.tp_size > 1:  # every rank the same answers: refused if any saw it, caught up if all did
            import torch.distributed as dist

            flags = torch.tensor([int(said_no), int(not seen)], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            said_no, seen = bool(flags[0].item()), not bool(flags[1].item())
        if said_no:
            raise MigrationError(refused, "target", Phrase("a target applying the links"),
                                 Phrase(f"refused by the target: {marker_reason(self._store, refused)}"))
        return seen

    def abandon(self, reason: str) -> None:
        """Give the migration up (the request stays, or ended, on the source): a following
        target releases what it applied and raises :class:`MigrationError` saying ``reason``."""
        self._store.put_bytes(self._store.join(self.container, ABANDONED_NAME),
                              json.dumps({"type": "abandoned", "reason": str(reason)[:4000], "links": len(self.links)}).encode())
        self.stopped = True

    def stop(self, req_pool_idx: int, record: RequestRecord) -> CommitInfo:
        """The last link, once the request is stopped: the tail rows, the recurrent state and
        the record (a plain snapshot when no round was pre-copied: stop-and-copy)."""
        info = self._write(FINAL_NAME, req_pool_idx, record)
        self.stopped = True
        return info


def _agreed_id(group) -> str:
    """A fresh snapshot id every source rank of the TP group shares (rank 0's, broadcast):
    the rank files of one set carry one id (spec 5.8)."""
    import uuid

    import torch.distributed as dist

    ids = torch.tensor(list(uuid.uuid4().hex.encode()), dtype=torch.int32)
    dist.broadcast(ids, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return bytes(ids.tolist()).decode()


def _export_set1(path: str, ident: Identity, kw: dict) -> CommitInfo:
    """A link as a set of one rank (a TP 1 source whose links a TP M target re-shards)."""
    from hsnap_format import SetWriter
    from hsnap_format.spec import rank_file_name

    sw = SetWriter(path)
    try:
        info = export_request(sw.rank_path(0), identity=ident, **kw)
        sw.commit(tp_size=1, fsync=kw["fsync"])
    except BaseException:
        if os.path.isdir(sw.staging):
            sw.abort()
        raise
    return CommitInfo(os.path.join(path, rank_file_name(0)), info.file_length, info.payload_bytes, info.root_digest, info.digests)


# --------------------------------------------------------------------------- target


@dataclass(frozen=True)
class AppliedLink:
    """One link applied by :meth:`MigrationTarget.apply`."""

    path: str
    state_position: int  # the request's committed positions after this link
    rows: int  # attention positions this link added
    bytes_uploaded: int
    final: bool  # the source's last link (FINAL_NAME)


@dataclass
class ProvenLink:
    """A link :meth:`MigrationTarget.prove` checked and read, touching no pool: :meth:`MigrationTarget.apply_proven`
    uploads it; :meth:`close` gives it back (a link never applied)."""

    path: str
    snap: Snapshot  # the (rank) file whose record the request continues
    record: RequestRecord
    first: bool  # the first link: a restore into fresh slots (else a delta of the link applied last)
    upload: Any  # () -> AppliedLink, on the thread that owns the pools
    owner: Any  # what closes the link's files
    kept: Any  # what the next link is checked against once this one is applied (the file, or the set re-sharded)

    @property
    def final(self) -> bool:
        return is_final_link(self.path)

    def close(self) -> None:
        self.owner.close()


class MigrationTarget:
    """The migrating request in the target's pools: :meth:`apply` each link in order;
    :attr:`request` is where it lives (what a scheduler binds once the final link is
    applied); :meth:`release` gives every slot back (a migration abandoned)."""

    def __init__(self, *, req_to_token_pool, token_to_kv_pool_allocator, identity: Identity | None, verify: bool = True,
                 exact_rollback: bool = False, storage_options=None, staging_bytes: int = DEFAULT_STAGING_BYTES, sharding=None,
                 room: Room | None = None) -> None:
        require_type(None, "identity", identity, Identity, optional=True)
        require_type(None, "sharding", sharding, Sharding, optional=True)
        if verify not in (True, False):
            raise ValueError(f"verify must be True or False, not {verify!r}")
        self._pools = dict(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        self.view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
        att = self.view.geometry.attention
        if att is not None and att.swa_layers:  # a delta's window rows would need the window's eviction too
            raise UnsupportedFeatureError(None, "migration into sliding-window pools", Phrase("pools without SWA layers"),
                                          Phrase(f"{len(att.swa_layers)} SWA layers"))
        self.identity, self.verify, self.exact_rollback = identity, verify, exact_rollback
        self.storage_options, self.staging_bytes = storage_options, staging_bytes
        self.sharding = sharding  # this rank's description (hsnap_io.reshard.describe): links of another TP size are re-sharded
        self.room = room  # slots a caller can free (a radix cache): counted by the capacity checks, freed right before allocating
        self.request: RestoredRequest | None = None
        self.applied: list[AppliedLink] = []
        # the link applied last, kept open: the next delta is checked against it (the whole
        # source set when the links are re-sharded: each rank of a delta against its base rank)
        self._last: Snapshot | SnapshotSet | None = None
        self._resharded = False
        self._owned = None
        self._saved_state: dict = {}  # the Mamba slot's rows as before the delta in progress (a rollback's), reused link after link

    # -- the first link: a restore into fresh slots
    def _prove_first(self, path: str, accept) -> ProvenLink:
        # with a description, a set written at another TP size opens whole, to be re-sharded
        source = open_source(path, identity=self.identity, sharding=self.sharding, storage_options=self.storage_options)
        try:
            paged = next((link for link in source.chain.links if link.pages is not None), None)
            if paged is not None:  # its rows would come from the page store: pre-copy has nothing to gain there
                raise UnsupportedFeatureError(paged.path, "migrating a link that references pages", Phrase("a self-contained link"),
                                              Phrase(f"pages in {paged.pages.store!r}"))
            check_target(source, self.view, self.identity, spare=self._spare())  # the header's refusals first
            # every refusal before allocating (every digest: verify=True), then the caller's own (the request itself)
            record = prove_opened(source, **self._pools, identity=self.identity, verify=self.verify, staging_bytes=self.staging_bytes)
            if accept is not None:
                accept(source.snap, record)
        except BaseException:
            source.close()
            raise
        return ProvenLink(path, source.snap, record, True, lambda: self._upload_first(path, source), source,
                          source.snapset if source.resharded else source.snap)

    def _upload_first(self, path: str, source) -> AppliedLink:
        with pool_lock(self.view.req_to_token_pool):
            if self.room is not None:
                self.room.make(*slots_needed(source.snap, self.view))
            restored = restore_opened(source, **self._pools, identity=self.identity, verify=self.verify,
                                      exact_rollback=self.exact_rollback, staging_bytes=self.staging_bytes)
        self.request = restored
        self._resharded = source.resharded
        return AppliedLink(path, restored.state_position, restored.state_position, restored.bytes_uploaded, is_final_link(path))

    def _keep(self, snap: Snapshot, owner) -> None:
        if self._owned is not None:
            self._owned.close()
        self._last, self._owned = snap, owner

    # -- every later link: a delta of the one applied last, into the same request
    def apply(self, path, *, accept=None) -> AppliedLink:
        """Apply the next link (see the module's guarantees); returns what it added:
        :meth:`prove`, then :meth:`apply_proven`.  ``accept(snap, record)``, when given, runs
        after every check and before anything is allocated: what it raises refuses the link
        as the checks do (a scheduler checks there that the request can run on the target)."""
        return self.apply_proven(self.prove(path, accept=accept))

    def prove(self, path, *, accept=None) -> ProvenLink:
        """Every refusal of the next link, touching no pool: the link opened and checked (against the link applied
        last, the target, its capacity counting the room) and, with ``verify=True``, every byte read and hashed, then
        ``accept``.  What a server runs off its scheduler thread (for an ``s3://`` container: GETs); the link applied
        last does not change until :meth:`apply_proven` of this one."""
        p = os.fspath(path)
        return self._prove_first(p, accept) if self.request is None else self._prove_delta(p, accept)

    def apply_proven(self, proven: ProvenLink) -> AppliedLink:
        """Upload a link :meth:`prove` proved (the room made, slots allocated, rows and state filled, under the pool
        lock; any failure gives this link's allocations back); its files are kept (what the next link is checked
        against) or closed, whatever happens."""
        if proven.first != (self.request is None):
            proven.close()
            raise ValueError(f"{proven.path}: proved as {'the first link' if proven.first else 'a delta'}, not applicable now")
        try:
            applied = proven.upload()
        except BaseException:
            proven.close()
            raise
        self._keep(proven.kept, proven.owner)
        self.applied.append(applied)
        return applied

    def _open(self, p: str) -> tuple[Snapshot, object]:
        opened = store_for(p, self.storage_options).open(p, ranks=None if self.identity is None else [self.identity.tp_rank])
        if isinstance(opened, SnapshotSet):
            return next(iter(opened.ranks.values())), opened
        return opened, opened

    def _prove_delta(self, p: str, accept) -> ProvenLink:
        if self._resharded:
            return self._prove_resharded_delta(p, accept)
        snap, owner = self._open(p)
        try:
            record = self._check_delta(snap)
            if accept is not None:
                accept(snap, record)
        except BaseException:
            owner.close()
            raise
        return ProvenLink(p, snap, record, False, lambda: self._upload_delta(p, [snap], snap, record, self._plain_upload(snap)), owner, snap)

    def _prove_resharded_delta(self, p: str, accept) -> ProvenLink:
        """A set of deltas written at another TP size (:mod:`hsnap_io.reshard`): every rank
        file checked against the rank of the set applied last, the set against itself and
        the target, the runs of every target section proven, the sections this rank reads
        hashed — all before allocating; then (:meth:`apply_proven`) this rank's heads of the new rows into new slots
        after the request's, its channels and heads of the recurrent state over its Mamba slot."""
        opened = store_for(p, self.storage_options).open(p)
        try:
            last = self._last
            if not isinstance(opened, SnapshotSet):
                if len(last.ranks) != 1 or opened.identity.tp_size != 1:
                    raise ChainError(p, "manifest", Phrase(f"a set of deltas of the set applied last ({last.path})"), Phrase("a single snapshot file"))
                opened = SnapshotSet.of_whole_file(opened)  # a TP 1 source's delta, as the one-rank set it is (as its first link)
            plans = check_delta_set(opened, last, self.view, identity=self.identity, target=self.sharding, target_tp=self.identity.tp_size)
            head = opened.ranks[0]
            self._check_capacity(head)
            record = delta_set_record(opened, plans, self.verify)
            self._check_output_prefix(record, head.path, last.path)
            if accept is not None:
                accept(head, record)
        except BaseException:
            opened.close()
            raise

        def upload(engine, dests, at):
            return upload_delta_set(opened, plans, self.view, dests, engine, self.verify, at)[0]

        used = [opened.ranks[k] for k in source_ranks_of(plans)]
        return ProvenLink(p, head, record, False, lambda: self._upload_delta(p, used, head, record, upload), opened, opened)

    def _check_delta(self, snap: Snapshot) -> RequestRecord:
        """Everything that can refuse ``snap``, before anything is allocated."""
        last, where = self._last, snap.path
        if snap.base is None:
            raise ChainError(where, "base", Phrase(f"a delta of the link applied last ({last.path})"), Phrase("a plain snapshot"))
        if snap.pages is not None:
            raise UnsupportedFeatureError(where, "migrating a link that references pages", Phrase("a self-contained link"),
                                          Phrase(f"pages in {snap.pages.store!r}"))
        check_ref(snap.base, last, where)  # the base it names is the link applied: digest, id, position, depth
        check_link(LinkFacts.of_snapshot(last), LinkFacts.of_snapshot(snap), where)  # same request, model, rank, geometry
        numerics = check_compatible(snap, self.view, self.identity)  # and the target's own identity and pools
        del numerics  # warned once, by the first link's restore
        self._check_capacity(snap)
        if self.verify:
            snap.verify()  # every byte of the link, before allocating
        record = snap.record(verify=self.verify)
        self._check_output_prefix(record, where, last.path)
        return record

    def _check_output_prefix(self, record: RequestRecord, where, last_path) -> None:
        # the applied link's output ids (hashed when it was applied), in memory: the downtime
        # path reads nothing but the last link
        before, now = self.request.record.output_ids, record.output_ids
        if len(now) < len(before) or not np.array_equal(now[: len(before)], before):
            raise ChainError(where, "request.output_ids", Phrase(f"the applied link's {len(before)} output tokens first ({last_path})"),
                             Phrase("other tokens"))

    def _spare(self) -> dict[str, int] | None:
        return None if self.room is None else self.room.spare()

    def _new_token_slots(self, snap: Snapshot) -> int:
        """The token slots a delta up to ``snap`` allocates after the request's (whole pages of the target)."""
        old, new, page = self.request.state_position, snap.state_position, target_page(self.view)
        return (math.ceil(new / page) - math.ceil(old / page)) * page if self.view.geometry.attention is not None else 0

    def _check_capacity(self, snap: Snapshot) -> None:
        rtp, alloc = self.view.req_to_token_pool, self.view.allocator
        new = snap.state_position
        short = []
        if new > rtp.req_to_token.shape[1]:
            short.append(f"req_to_token_pool.max_context_len: need {new}, have {rtp.req_to_token.shape[1]}")
        need, spare = self._new_token_slots(snap), (self._spare() or {}).get("token slots", 0)
        if alloc.available_size() + spare < need:
            short.append(f"token slots: need {need}, free {alloc.available_size()}" + (f" + {spare} evictable" if spare else ""))
        if short:
            raise CapacityError(snap.path, "target pools", detail="does not fit: " + "; ".join(short))

    def _plain_upload(self, snap: Snapshot):
        """The upload of a delta at the target's TP size: each section's rows straight from the file."""
        chain = Chain.single(snap)  # the delta's own sections: its rows are positions old..new

        def upload(engine, dests, at) -> int:
            uploaded = 0
            for b in self.view.bindings:
                for piece in chain.pieces(b.name):
                    at[0] = f"sections[{b.name}]"
                    uploaded += upload_piece(engine, b, dests[b.space], piece, self.verify)
            return uploaded

        return upload

    def _upload_delta(self, path: str, opened: list[Snapshot], snap: Snapshot, record: RequestRecord, upload) -> AppliedLink:
        """Under the pool lock: new token slots for the delta's rows (``snap``: the rank file
        whose record the request continues), then ``upload(engine, dests, at)``; any failure
        gives this link's allocations back and the Mamba slot's bytes. ``path``: the link
        (a file or a set)."""
        view, req = self.view, self.request
        old, new = req.state_position, snap.state_position
        rtp = view.req_to_token_pool
        engine = engine_for(view.device, self.staging_bytes)
        with pool_lock(rtp):
            if self.room is not None:  # every check passed (and accept): room for the new rows only now
                self.room.make(self._new_token_slots(snap), 0)
            for s in opened:
                s.check_unchanged()
            checkpoint = PoolCheckpoint(view)
            at = ["allocation"]
            try:
                fresh = self._extend_slots(old, new, checkpoint, snap.path)
                dests = {"token": fresh, "mamba": None if req.mamba_pool_idx is None else torch.tensor([req.mamba_pool_idx])}
                for b in view.bindings:
                    if b.space == "mamba":  # the request's own state is overwritten: always put back (into memory kept)
                        checkpoint.remember_rows(b.buffer, dests[b.space], b.name, keep=self._saved_state)
                    elif self.exact_rollback:
                        checkpoint.remember_rows(b.buffer, dests[b.space], b.name)
                    else:  # the link's fresh slots: zeroed on a failure
                        checkpoint.scrub_rows(b.buffer, dests[b.space], b.name)
                uploaded = upload(engine, dests, at)
                at[0] = "finish upload"
                engine.finish_import()
            except BaseException as e:
                raise_upload_failure(engine, checkpoint, snap.path, e, at[0])
        token = torch.cat([req.token_indices, fresh])
        self.request = dataclasses.replace(req, token_indices=token, record=record, state_position=new,
                                           snapshot_id=snap.identity.snapshot_id, bytes_uploaded=req.bytes_uploaded + uploaded)
        return AppliedLink(path, new, new - old, uploaded, is_final_link(path))

    def _extend_slots(self, old: int, new: int, checkpoint: PoolCheckpoint, path) -> torch.Tensor:
        """Token slots for positions ``old..new`` of the request, allocated as SGLang extends a
        running request (page 1: ``alloc``; paged: ``alloc_extend`` after the last slot)."""
        view, req = self.view, self.request
        rtp, alloc = view.req_to_token_pool, view.allocator
        if view.geometry.attention is None or new == old:
            return torch.empty(0, dtype=torch.int64)
        last = int(req.token_indices[old - 1]) if old else -1
        got = alloc_token_slots(alloc, target_page(view), old, new, last)
        if got is None:
            raise CapacityError(path, "token slots", new - old, alloc.available_size())
        fresh = got[: new - old].to(torch.int64)
        checkpoint.remember_rows(rtp.req_to_token, torch.tensor([req.req_pool_idx]), "req_to_token_pool.req_to_token")
        rtp.req_to_token[req.req_pool_idx, old:new] = fresh.to(rtp.req_to_token.dtype)
        return fresh

    # -- following a container
    def next_names(self, container) -> tuple[str, str, str]:
        """Where the next link of ``container`` will appear: (next round, final link, abandoned marker)."""
        c = os.fspath(container).rstrip("/")
        store = store_for(c, self.storage_options)
        return (store.join(c, LINK_NAME.format(len(self.applied))), store.join(c, FINAL_NAME), store.join(c, ABANDONED_NAME))

    def step(self, container, *, accept=None) -> AppliedLink | None:
        """One look at ``container``, never waiting: apply the next link if it is committed
        (putting ``<link>.applied`` beside a round once applied: the source's cue to stop);
        None if it is not there yet. A link applied is returned even when its marker cannot be
        put (a ``RuntimeWarning`` says so; the source then pre-copies on until it stops): the
        pools hold it, so it is never reported as refused. A source that gave up (:meth:`MigrationSource.abandon`)
        is a :class:`MigrationError` (what was applied stays: :meth:`release` gives it back).
        :meth:`next_link`, :meth:`apply` and :meth:`mark_applied` in turn."""
        path = self.next_link(container)
        if path is None:
            return None
        applied = self.apply(path, accept=accept)
        self.mark_applied(applied)
        return applied

    def next_link(self, container) -> str | None:
        """The next link of ``container`` if it is committed (the next round, else the final link), else None; a
        source that gave up is a :class:`MigrationError`.  Looks only (a stat, or a HEAD per name)."""
        c = os.fspath(container).rstrip("/")
        store = store_for(c, self.storage_options)
        nxt, final, abandoned = self.next_names(c)
        # a final link exists only after every round: look for the next round again after seeing it
        if store.exists(nxt):
            return nxt
        if store.exists(final) and not store.exists(nxt):
            return final
        if store.exists(abandoned):
            raise MigrationError(c, ABANDONED_NAME, Phrase("a migration the source carries on"),
                                 Phrase(f"abandoned by the source: {marker_reason(store, abandoned)}"))
        return None

    def mark_applied(self, applied: AppliedLink) -> None:
        """``<link>.applied`` beside a round applied (the source's cue; nothing for the final link).  A marker that
        cannot be put is a ``RuntimeWarning``, never a refusal: the link is in the pools."""
        if applied.final:
            return
        path = applied.path
        try:
            store_for(path, self.storage_options).put_bytes(path + APPLIED_SUFFIX, b"%d\n" % applied.state_position)
        except SnapshotExistsError:  # another rank of a TP target put it first: the cue stands
            pass
        except HsnapError as e:  # the link is in the pools: never report it as refused; the marker is only the source's cue
            warnings.warn(f"{path}{APPLIED_SUFFIX}: not put ({e}); the link is applied, the source will not see it and "
                          "pre-copies on until it stops", RuntimeWarning, stacklevel=2)

    def follow(self, container, *, timeout_s: float = 60.0, poll_s: float = 0.001, accept=None) -> Iterator[AppliedLink]:
        """Apply the links of ``container`` as they are committed, in order, until the final
        one (:meth:`step` in a loop); a link not committed within ``timeout_s`` of the last is
        a :class:`MigrationError`."""
        c = os.fspath(container).rstrip("/")
        deadline = time.monotonic() + timeout_s
        while True:
            applied = self.step(c, accept=accept)
            if applied is None:
                if time.monotonic() > deadline:
                    raise MigrationError(c, LINK_NAME.format(len(self.applied)), Phrase(f"committed within {timeout_s} s"), Phrase("missing"))
                time.sleep(poll_s)
                continue
            yield applied
            if applied.final:
                return
            deadline = time.monotonic() + timeout_s

    def refuse(self, container, error: HsnapError | dict) -> None:
        """Tell the source this target gives up (``refused.json``, saying why): a source waiting for
        the next ``.applied`` marker stops pre-copying at once. Call :meth:`release` too."""
        c = os.fspath(container).rstrip("/")
        store = store_for(c, self.storage_options)
        said = error if isinstance(error, dict) else {"type": type(error).__name__, "message": str(error)}
        store.put_bytes(store.join(c, REFUSED_NAME), json.dumps({"type": said.get("type"), "reason": str(said.get("message", ""))[:4000],
                                                                 "applied": len(self.applied)}).encode())

    def release(self) -> None:
        """Give the request's slots back (an abandoned migration); the target is then empty."""
        req = self.request
        if req is None:
            return
        rtp, alloc = self.view.req_to_token_pool, self.view.allocator
        with pool_lock(rtp):
            if len(req.token_indices):
                alloc.free(req.token_indices)
            if req.mamba_pool_idx is not None:
                rtp.mamba_allocator.free(torch.tensor([req.mamba_pool_idx], dtype=torch.int64))
            rtp.free_rows([req.req_pool_idx])
        self.request = None
        self._saved_state.clear()
        self.close()

    def close(self) -> None:
        """Close the link kept open (the request stays where it is)."""
        if self._owned is not None:
            self._owned.close()
        self._last = self._owned = None

    def __enter__(self) -> "MigrationTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def marker_reason(store, path: str) -> str:
    """What ``abandoned.json`` / ``refused.json`` says, one line: ``<error type>: <reason>``."""
    from hsnap_format.controljson import read_control

    try:  # any writer of the container can put it: bounded (size, nesting, UTF-8), never an untyped error
        said = read_control(store, path, "marker", max_bytes=8192)
    except HsnapError as e:
        return f"(unreadable: {e.field}: expected {e.expected}, found {e.found})" if e.expected is not None else "(unreadable)"
    if isinstance(said, dict):
        return " ".join(f"{said.get('type') or 'given up'}: {said.get('reason', '')}".split())[:1000]
    return " ".join(str(said)[:1000].split())


__all__ = ["MigrationSource", "MigrationTarget", "AppliedLink", "ProvenLink", "MigrationError", "is_final_link", "LINK_NAME", "FINAL_NAME", "APPLIED_SUFFIX", "ABANDONED_NAME", "REFUSED_NAME"]
