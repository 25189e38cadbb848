"""Export one request from SGLang's pools into a snapshot file (or one rank's file)."""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from hsnap_format import CommitInfo, HsnapError, Identity, MalformedHeaderError, RequestRecord, SnapshotWriter
from hsnap_format.errors import require_type
from hsnap_format.records import Sharding
from hsnap_format.remote import is_url, snapshot_writer

from .adapters import PoolView, view_pools
from .transfer import DEFAULT_STAGING_BYTES, engine_for


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
) -> CommitInfo:
    """Write the request's KV rows, Mamba slot and record to ``path``; return the commit info.

    The source slots are only read. Free them after this returns (the file is
    durable under its final name by then), never before. ``sharding`` (format 1.1,
    :func:`hsnap_io.reshard.describe`) records this rank's share of the global state,
    which a restore at another TP size needs.
    """
    require_type(path, "identity", identity, Identity)  # typed refusals, not AttributeError, for a dict
    require_type(path, "record", record, RequestRecord)
    require_type(path, "sharding", sharding, Sharding, optional=True)
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    if sharding is not None:  # format 1.1: this rank's share of the global state (hsnap_io.reshard.describe)
        view = dataclasses.replace(view, geometry=dataclasses.replace(view.geometry, sharding=sharding))
    slots = request_slots(view, req_pool_idx, record.state_position, swa_start, path)
    identity = complete_identity(identity)
    engine = engine_for([b.buffer for b in view.bindings], staging_bytes)
    # an s3:// URL streams a multipart upload whose completion is the commit (hsnap_format.remote)
    extra = {"writeback": fsync} if not is_url(os.fspath(path)) else {}  # a file to fsync: write back as it goes
    with snapshot_writer(path, storage_options=storage_options, identity=identity, geometry=view.geometry, record=record,
                         swa_start=swa_start, mode=mode, **extra) as w:
        planned = [s.name for s in w.pending_state_sections()]
        bound = [b.name for b in view.bindings]
        if planned != bound:  # adapters and layout disagree: a bug, never a silent file
            raise AssertionError(f"section plan {planned[:4]}... != pool bindings {bound[:4]}...")
        for b in view.bindings:
            engine.export_section(b.buffer, slots.rows(b.space), _sink(w, b.name))
        engine.finish_export()
        return w.commit(fsync=fsync)


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
