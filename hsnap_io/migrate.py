"""Live migration of one request between two processes (issue 20 item 4), through a store.

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

The transport is the storage seam (:mod:`hsnap_format.storage`): a local directory or an
``s3://`` prefix; a link is visible under its name only once committed.

Guarantees of :meth:`MigrationTarget.apply`, as for a restore: before anything is
allocated the link is opened and checked — a delta must name, by root digest, snapshot
id, position and depth, exactly the link applied last, be the same request of the same
model on the same rank with the same geometry, its output ids grown from the applied
link's — and (``verify=True``) every byte of it is read and hashed; every refusal is a
typed :class:`~hsnap_format.HsnapError` and leaves the pools byte-identical and the
migration where it was (a correct link may still be applied). The uploaded rows are
hashed again as they land; a failure during the upload gives back this link's
allocations and puts the request's Mamba slot back as it was.

Not covered: sliding-window pools and links that reference a page store (refused by name);
a target at another TP size (a re-sharded chain is refused by :func:`hsnap_io.restore`:
compact first — which puts the whole history on the downtime path).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from hsnap_format import CapacityError, CommitInfo, HsnapError, Identity, RequestRecord, Snapshot, SnapshotSet
from hsnap_format.chain import Chain, LinkFacts, check_link, check_ref
from hsnap_format.errors import ChainError, Phrase, UnsupportedFeatureError, require_type
from hsnap_format.storage import store_for

from .adapters import view_pools
from .export import export_request
from .restore import (
    RestoredRequest,
    _target_page,
    _upload_piece,
    check_compatible,
    open_source,
    pool_lock,
    raise_upload_failure,
    restore_opened,
)
from .statecheck import PoolCheckpoint
from .transfer import DEFAULT_STAGING_BYTES, engine_for

LINK_NAME = "link-{:04d}.hsnap"  # the pre-copy rounds, in order: link-0000 plain, the others deltas
FINAL_NAME = "final.hsnap"  # the last delta, written after the source stopped the request
APPLIED_SUFFIX = ".applied"  # put by a following target beside each round it applied: the source stops once it sees it
ABANDONED_NAME = "abandoned.json"  # put by a source that gives the migration up (the request finished, was refused...)


class MigrationError(HsnapError):
    """The migration cannot go on (a link not committed in time, a call out of order)."""


# --------------------------------------------------------------------------- source


class MigrationSource:
    """Writes one request's migration links into ``container`` (a directory or an ``s3://``
    prefix that holds nothing else of this migration). The request's slots are only read;
    free them after :meth:`stop` returns (the last link is committed by then; durable unless
    ``fsync=False``, which a migration on one host can afford: the target reads it at once)."""

    def __init__(self, container, *, req_to_token_pool, token_to_kv_pool_allocator, identity: Identity, storage_options=None,
                 fsync: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        require_type(container, "identity", identity, Identity)
        self.container = os.fspath(container).rstrip("/")
        self._store = store_for(self.container, storage_options)
        self._pools = dict(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        self._kw = dict(storage_options=storage_options, fsync=fsync, staging_bytes=staging_bytes)
        self.identity = identity
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
        info = export_request(path, **self._pools, req_pool_idx=req_pool_idx, record=record, identity=ident,
                              base=self.links[-1] if self.links else None, **self._kw)
        self.links.append(path)
        return info

    def precopy(self, req_pool_idx: int, record: RequestRecord) -> CommitInfo:
        """One pre-copy round at ``record.state_position``: the plain snapshot first, then a
        delta of the rows committed since the last round (and the state and record)."""
        return self._write(LINK_NAME.format(len(self.links)), req_pool_idx, record)

    def caught_up(self) -> bool:
        """The target (:meth:`MigrationTarget.follow`) has applied every link written so far:
        stopping now leaves only the rows decoded since the last round on the downtime path."""
        return bool(self.links) and self._store.exists(self.links[-1] + APPLIED_SUFFIX)

    def abandon(self, reason: str) -> None:
        """Give the migration up (the request stays, or ended, on the source): a following
        target releases what it applied and raises :class:`MigrationError` saying ``reason``."""
        self._store.put_bytes(self._store.join(self.container, ABANDONED_NAME),
                              json.dumps({"reason": str(reason)[:4000], "links": len(self.links)}).encode())
        self.stopped = True

    def stop(self, req_pool_idx: int, record: RequestRecord) -> CommitInfo:
        """The last link, once the request is stopped: the tail rows, the recurrent state and
        the record (a plain snapshot when no round was pre-copied: stop-and-copy)."""
        info = self._write(FINAL_NAME, req_pool_idx, record)
        self.stopped = True
        return info


# --------------------------------------------------------------------------- target


@dataclass(frozen=True)
class AppliedLink:
    """One link applied by :meth:`MigrationTarget.apply`."""

    path: str
    state_position: int  # the request's committed positions after this link
    rows: int  # attention positions this link added
    bytes_uploaded: int
    final: bool  # the source's last link (FINAL_NAME)


class MigrationTarget:
    """The migrating request in the target's pools: :meth:`apply` each link in order;
    :attr:`request` is where it lives (what a scheduler binds once the final link is
    applied); :meth:`release` gives every slot back (a migration abandoned)."""

    def __init__(self, *, req_to_token_pool, token_to_kv_pool_allocator, identity: Identity | None, verify: bool = True,
                 exact_rollback: bool = False, storage_options=None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        require_type(None, "identity", identity, Identity, optional=True)
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
        self.request: RestoredRequest | None = None
        self.applied: list[AppliedLink] = []
        self._last: Snapshot | None = None  # the link applied last, kept open: the next delta is checked against it
        self._owned = None

    # -- the first link: a restore into fresh slots
    def _apply_first(self, path: str, accept) -> AppliedLink:
        source = open_source(path, identity=self.identity, storage_options=self.storage_options)
        try:
            paged = next((link for link in source.chain.links if link.pages is not None), None)
            if paged is not None:  # its rows would come from the page store: pre-copy has nothing to gain there
                raise UnsupportedFeatureError(paged.path, "migrating a link that references pages", Phrase("a self-contained link"),
                                              Phrase(f"pages in {paged.pages.store!r}"))
            if accept is not None:  # the caller's own refusals (the request itself), before allocating
                check_compatible(source.snap, self.view, self.identity)
                accept(source.snap, source.snap.record(verify=self.verify))
            restored = restore_opened(source, **self._pools, identity=self.identity, verify=self.verify,
                                      exact_rollback=self.exact_rollback, staging_bytes=self.staging_bytes)
        except BaseException:
            source.close()
            raise
        self.request = restored
        self._keep(source.snap, source)
        return AppliedLink(path, restored.state_position, restored.state_position, restored.bytes_uploaded, _is_final(path))

    def _keep(self, snap: Snapshot, owner) -> None:
        if self._owned is not None:
            self._owned.close()
        self._last, self._owned = snap, owner

    # -- every later link: a delta of the one applied last, into the same request
    def apply(self, path, *, accept=None) -> AppliedLink:
        """Apply the next link (see the module's guarantees); returns what it added.
        ``accept(snap, record)``, when given, runs after every check and before anything is
        allocated: what it raises refuses the link as the checks do (a scheduler checks there
        that the request can run on the target)."""
        p = os.fspath(path)
        if self.request is None:
            applied = self._apply_first(p, accept)
        else:
            applied = self._apply_delta(p, accept)
        self.applied.append(applied)
        return applied

    def _open(self, p: str) -> tuple[Snapshot, object]:
        opened = store_for(p, self.storage_options).open(p, ranks=None if self.identity is None else [self.identity.tp_rank])
        if isinstance(opened, SnapshotSet):
            return next(iter(opened.ranks.values())), opened
        return opened, opened

    def _apply_delta(self, p: str, accept) -> AppliedLink:
        snap, owner = self._open(p)
        try:
            record = self._check_delta(snap)
            if accept is not None:
                accept(snap, record)
            applied = self._upload_delta(snap, record)
        except BaseException:
            owner.close()
            raise
        self._keep(snap, owner)
        return applied

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
        # the applied link's output ids (hashed when it was applied), in memory: the downtime
        # path reads nothing but the last link
        before, now = self.request.record.output_ids, record.output_ids
        if len(now) < len(before) or not np.array_equal(now[: len(before)], before):
            raise ChainError(where, "request.output_ids", Phrase(f"the applied link's {len(before)} output tokens first ({last.path})"),
                             Phrase("other tokens"))
        return record

    def _check_capacity(self, snap: Snapshot) -> None:
        rtp, alloc = self.view.req_to_token_pool, self.view.allocator
        old, new, page = self.request.state_position, snap.state_position, _target_page(self.view)
        short = []
        if new > rtp.req_to_token.shape[1]:
            short.append(f"req_to_token_pool.max_context_len: need {new}, have {rtp.req_to_token.shape[1]}")
        if self.view.geometry.attention is not None:
            need = (math.ceil(new / page) - math.ceil(old / page)) * page
            if alloc.available_size() < need:
                short.append(f"token slots: need {need}, free {alloc.available_size()}")
        if short:
            raise CapacityError(snap.path, "target pools", detail="does not fit: " + "; ".join(short))

    def _upload_delta(self, snap: Snapshot, record: RequestRecord) -> AppliedLink:
        view, req = self.view, self.request
        old, new = req.state_position, snap.state_position
        rtp = view.req_to_token_pool
        engine = engine_for([b.buffer for b in view.bindings], self.staging_bytes)
        chain = Chain.single(snap)  # the delta's own sections: its rows are positions old..new
        with pool_lock(rtp):
            snap.check_unchanged()
            checkpoint = PoolCheckpoint(view)
            uploaded, where = 0, "allocation"
            try:
                fresh = self._extend_slots(old, new, checkpoint, snap.path)
                dests = {"token": fresh, "mamba": None if req.mamba_pool_idx is None else torch.tensor([req.mamba_pool_idx])}
                for b in view.bindings:
                    dest = dests[b.space]
                    if b.space == "mamba" or self.exact_rollback:  # the request's own state is overwritten: always put back
                        checkpoint.remember_rows(b.buffer, dest, b.name)
                    for piece in chain.pieces(b.name):
                        where = f"sections[{b.name}]"
                        uploaded += _upload_piece(engine, b, dest, piece, self.verify)
                where = "finish upload"
                engine.finish_import()
            except BaseException as e:
                raise_upload_failure(engine, checkpoint, snap.path, e, where)
        token = torch.cat([req.token_indices, fresh])
        self.request = dataclasses.replace(req, token_indices=token, record=record, state_position=new,
                                           snapshot_id=snap.identity.snapshot_id, bytes_uploaded=req.bytes_uploaded + uploaded)
        return AppliedLink(snap.path, new, new - old, uploaded, _is_final(snap.path))

    def _extend_slots(self, old: int, new: int, checkpoint: PoolCheckpoint, path) -> torch.Tensor:
        """Token slots for positions ``old..new`` of the request, allocated as SGLang extends a
        running request (page 1: ``alloc``; paged: ``alloc_extend`` after the last slot)."""
        view, req = self.view, self.request
        rtp, alloc = view.req_to_token_pool, view.allocator
        if view.geometry.attention is None or new == old:
            return torch.empty(0, dtype=torch.int64)
        page = _target_page(view)
        if page == 1:
            got = alloc.alloc(new - old)
        else:
            dev = getattr(alloc, "device", "cpu")
            prefix, seq = torch.tensor([old], dtype=torch.int64), torch.tensor([new], dtype=torch.int64)
            last = int(req.token_indices[old - 1]) if old else -1
            got = alloc.alloc_extend(prefix.to(dev), prefix, seq.to(dev), seq, torch.tensor([last], dtype=torch.int64, device=dev), new - old)
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
        is a :class:`MigrationError` (what was applied stays: :meth:`release` gives it back)."""
        c = os.fspath(container).rstrip("/")
        store = store_for(c, self.storage_options)
        nxt, final, abandoned = self.next_names(c)
        # a final link exists only after every round: look for the next round again after seeing it
        if store.exists(nxt):
            path = nxt
        elif store.exists(final) and not store.exists(nxt):
            path = final
        elif store.exists(abandoned):
            try:
                raw = store.read_bytes(abandoned, 8192)[0]
            except HsnapError:
                raw = b"(unreadable)"
            raise MigrationError(c, ABANDONED_NAME, Phrase("a migration the source carries on"),
                                 Phrase(f"abandoned by the source: {raw[:4000].decode('utf-8', 'replace').strip()}"))
        else:
            return None
        applied = self.apply(path, accept=accept)
        if not applied.final:
            try:
                store.put_bytes(path + APPLIED_SUFFIX, b"%d\n" % applied.state_position)
            except HsnapError as e:  # the link is in the pools: never report it as refused; the marker is only the source's cue
                warnings.warn(f"{path}{APPLIED_SUFFIX}: not put ({e}); the link is applied, the source will not see it and "
                              "pre-copies on until it stops", RuntimeWarning, stacklevel=2)
        return applied

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


def _is_final(path: str) -> bool:
    return os.path.basename(path.rstrip("/")) == FINAL_NAME


__all__ = ["MigrationSource", "MigrationTarget", "AppliedLink", "MigrationError", "LINK_NAME", "FINAL_NAME", "APPLIED_SUFFIX", "ABANDONED_NAME"]
