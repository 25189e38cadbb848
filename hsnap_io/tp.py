"""Tensor parallelism: every rank exports its own shard into one snapshot directory.

Protocol (torch.distributed; tensors only, no pickled objects):
  1. rank 0 creates the staging directory ``.<name>.hsnap-staging-<snapshot_id>``
     next to the final path; all ranks learn whether that worked;
  2. each rank writes ``rank-<r>.hsnap`` into it (fsynced, renamed in place);
  3. all ranks agree (all_reduce MIN) that every rank succeeded;
  4. rank 0 writes the manifest and renames the directory to its final name;
  5. all ranks learn the outcome. Until step 4 nothing exists under the final
     name, so the snapshot is committed only when every rank file and the
     manifest are durable. If any rank fails, rank 0 removes the staging
     directory (its own files one by one, the marker last) and every rank raises.
A rank that dies outright makes the collective fail on the others (gloo fails
fast; otherwise the process group's timeout applies): they raise
``RankFailedError`` and rank 0 removes the staging directory. If rank 0 died,
``hsnap gc --older-than`` removes what it proves unfinished (dead ranks' temporaries;
the marker and the directory once nothing else is left); rank files that were complete
start with the magic and are listed and kept (spec 8.1): remove the directory by hand
if they are not wanted.
The final path is refused (``ReservedNameError``) inside a staging directory or when
``.<name>.hsnap-staging-<snapshot_id>`` would not fit in NAME_MAX.
Under an ``s3://`` prefix the same steps go through the store's set writer: rank 0 puts the
prefix's pending marker (step 1), each rank uploads ``rank-<r>.hsnap`` (2), rank 0 puts
``manifest.json`` (4: the commit) and removes the marker; what a failure leaves lies beside
the marker, for ``hsnap gc``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hsnap_format import CommitInfo, HsnapError, Identity, Manifest, RequestRecord, SetWriter, SnapshotExistsError
from hsnap_format.errors import Phrase, require_type
from hsnap_format import localfs
from hsnap_format.spec import NAME_RE, STAGING_DIR_MARK, rank_file_name
from hsnap_format.stores import store_for

from .export import export_request
from .restore import restore_request
from .slots import RestoredRequest


class RankFailedError(HsnapError):
    """Another rank of the TP group failed or died; nothing was committed."""


def _agree(ok: bool, group, path: str, cleanup=None) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as e:  # a peer died: gloo/NCCL fail the collective
        if cleanup is not None:
            cleanup()
        raise RankFailedError(path, "tp group", "every rank alive", Phrase(f"collective failed: {str(e).splitlines()[0][:200]}")) from None
    return bool(flag.item())


def staging_dir(path: str, snapshot_id: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}{STAGING_DIR_MARK}{snapshot_id}")


def export_request_tp(path, *, identity: Identity, record: RequestRecord, group=None, **kw) -> Manifest | None:
    """Collective: call on every rank with that rank's pools. Returns the manifest on rank 0.

    ``base=SET`` (format 1.2, spec 10.4): write a set of deltas — each rank's file a delta
    of rank ``identity.tp_rank`` of the set ``SET``, which lies beside ``path``; a refusal
    on any rank (:class:`~hsnap_format.ChainError`) commits nothing, as any other failure."""
    return export_rank_tp(path, identity=identity, record=record, group=group, **kw)[0]


def export_rank_tp(path, *, identity: Identity, record: RequestRecord, group=None, **kw) -> tuple[Manifest | None, CommitInfo]:
    """:func:`export_request_tp`, returning this rank's commit info too (its file in the
    committed set) beside the manifest (rank 0; None elsewhere)."""
    require_type(path, "identity", identity, Identity)
    require_type(path, "record", record, RequestRecord)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (identity.tp_rank, identity.tp_size) != (rank, world):
        raise HsnapError(path, "identity.tp_rank/tp_size", (rank, world), (identity.tp_rank, identity.tp_size))
    store = store_for(os.fspath(path), kw.get("storage_options"))
    if not store.local:  # an object store: its set writer, no staging directory
        return _export_rank_tp_store(store, os.fspath(path).rstrip("/"), identity=identity, record=record, group=group, rank=rank,
                                     world=world, **kw)
    if not NAME_RE.match(identity.snapshot_id):
        raise HsnapError(path, "identity.snapshot_id", "[A-Za-z0-9._-]{1,128} (names the staging directory)", identity.snapshot_id)
    final = os.path.abspath(os.fspath(path))
    staging = staging_dir(final, identity.snapshot_id)
    error: BaseException | None = None
    if rank == 0:
        try:
            localfs.check_final_path(final, tag_bytes=len(identity.snapshot_id))  # the staging name must fit too
            if os.path.lexists(final):
                raise SnapshotExistsError(final, "path", "no file or directory", Phrase("one exists"))
            localfs.make_staging_dir(staging, 0o700)  # with the marker hsnap gc checks
        except BaseException as e:  # noqa: BLE001 - reported after the collective
            error = e
    # Only what this rank 0 created is ever removed: a staging directory that already
    # existed (another export with the same snapshot id) is someone else's.
    drop_staging = (lambda: localfs.remove_own_staging(staging)) if rank == 0 and error is None else None
    if not _agree(error is None, group, final, drop_staging):
        raise error or RankFailedError(final, "staging directory", "created by rank 0", Phrase("rank 0 failed"))
    info = None
    try:
        info = export_request(os.path.join(staging, rank_file_name(rank)), identity=identity, record=record, **kw)
    except BaseException as e:  # noqa: BLE001
        error = e
    all_ok = _agree(error is None, group, final, drop_staging)
    manifest = None
    if rank == 0:
        if all_ok:
            try:
                manifest = SetWriter(final, staging=staging).commit(tp_size=world)
            except BaseException as e:  # noqa: BLE001
                error = e
        if error is not None or not all_ok:
            localfs.remove_own_staging(staging)
    committed = _agree(error is None and all_ok, group, final)
    if not committed:
        raise error or RankFailedError(final, "export", "every rank written", Phrase("another rank failed; nothing committed"))
    return manifest, CommitInfo(os.path.join(final, rank_file_name(rank)), info.file_length, info.payload_bytes, info.root_digest, info.digests)


def _export_rank_tp_store(store, url: str, *, identity: Identity, record: RequestRecord, group, rank: int, world: int,
                          **kw) -> tuple[Manifest | None, CommitInfo]:
    """The same protocol under an ``s3://`` prefix (the store's set writer): rank 0 puts the set's pending marker,
    every rank uploads its own rank object, all agree, rank 0 puts the manifest (the commit; the marker goes).  A
    failure after the marker commits nothing and leaves what was uploaded beside the marker, as a set writer killed
    mid-write does: ``hsnap gc`` proves each object unfinished before it removes it."""
    writer, error = None, None
    if rank == 0:
        try:
            writer = store.set_writer(url)
        except BaseException as e:  # noqa: BLE001 - reported after the collective
            error = e
    if not _agree(error is None, group, url):
        raise error or RankFailedError(url, "pending marker", "put by rank 0", Phrase("rank 0 failed"))
    info = None
    try:
        info = export_request(store.join(url, rank_file_name(rank)), identity=identity, record=record, **kw)
    except BaseException as e:  # noqa: BLE001
        error = e
    all_ok = _agree(error is None, group, url)
    manifest = None
    if rank == 0 and all_ok:
        try:
            manifest = writer.commit(tp_size=world)  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001
            error = e
    if not _agree(error is None and all_ok, group, url):
        raise error or RankFailedError(url, "export", "every rank written", Phrase("another rank failed; nothing committed"))
    return manifest, info  # already under its final name: an object store has no staging directory


def restore_request_tp(path, *, identity: Identity, group=None, **kw) -> RestoredRequest:
    """Each rank loads its own file of a snapshot directory; with ``sharding=`` (this rank's
    :func:`hsnap_io.reshard.describe`) a set written at another TP size is re-sharded."""
    require_type(path, "identity", identity, Identity)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (identity.tp_rank, identity.tp_size) != (rank, world):
        raise HsnapError(path, "identity.tp_rank/tp_size", (rank, world), (identity.tp_rank, identity.tp_size))
    return restore_request(path, identity=identity, rank=rank, **kw)
