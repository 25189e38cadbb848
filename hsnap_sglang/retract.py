"""Retraction to disk: the durable counterpart of SGLang's in-memory retraction.

SGLang retracts a decoding request under memory pressure by copying its KV (and,
where the KV pool does not carry it, its Mamba state) into CPU tensors
(``Req.offload_kv_cache`` -> ``RetractionBackup``), releasing its slots
(``schedule_batch.release_req``) and later loading the copy into fresh slots
(``Req.load_kv_cache``). The copy dies with the process. Here the copy is an hsnap
file, so a retracted hybrid request survives a restart and needs no recompute:

    info = retract_to_disk("r.hsnap", req, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                           tree_cache=tree_cache, identity=identity)
    # req is retracted exactly as SGLang retracts it: slots freed, reset_for_retract()
    load_retracted("r.hsnap", req, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                   identity=identity)                      # same process: the same Req object
    req = resume_req("r.hsnap", ...)                       # a fresh process: a new Req

Mamba state travels once: the pool adapters take it from the KV pool when that pool
declares ``cpu_copy_carries_mamba`` and from the request pool's ``mamba_pool``
otherwise, the same rule as ``Req._mamba_pool_needing_backup``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hsnap_format import CommitInfo, HsnapError, Identity
from hsnap_format.errors import require_type

from hsnap_io.sglang_env import import_sglang

from .req import snapshot_req
from .req.bind import ProvenRestore, binder, mamba_tracking_slots
from .req.record import decode_carried, read_record


def retracted_extra(req) -> dict:
    """The record entries of ``req`` as it is once retracted (SGLang's ``reset_for_retract`` counts the retraction
    and stains the request), written over its own: a retraction's file reports the counters SGLang will."""
    return {"sglang.Req.retraction_count": int(req.retraction_count) + 1, "sglang.Req.retracted_stain": True}


def retract_to_disk(
    path: str | os.PathLike[str],
    req,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    tree_cache,
    identity: Identity,
    **export_kwargs,
) -> CommitInfo:
    """Write ``req`` to ``path``, then release its slots with SGLang's own
    ``release_req`` (``release_kv_cache(checkpoint=False)`` + ``reset_for_retract``).

    The file records the request as it will be after the retraction
    (``retraction_count + 1``, ``retracted_stain``), so a fresh process resumes the
    same counters SGLang would report. A refusal comes before anything is written
    or freed; the slots are freed only once the file is durable.
    """
    import_sglang()
    from sglang.srt.managers.schedule_batch import release_req

    info = snapshot_req(
        path, req, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        identity=identity, extra=retracted_extra(req),
        **export_kwargs,
    )
    # SGLang's retraction minus its in-memory backup (offload_kv=False): the file is the backup.
    release_req(
        req=req,
        remaing_req_count=0,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        tree_cache=tree_cache,
        hisparse_coordinator=None,
        offload_kv=False,
    )
    return info


def load_retracted(
    path: str | os.PathLike[str],
    req,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    tree_cache=None,
    room=None,
    **restore_kwargs,
):
    """Give a request retracted by :func:`retract_to_disk` fresh slots holding its
    state again (the same ``Req`` object, same process). Returns ``req``:
    :func:`prove_retracted`, then :func:`restore_retracted`.

    The file is opened once: the record it is checked against and the state uploaded
    come through that one open. Refused before the pools are touched when the request
    is not retracted, the file does not belong to the target, is not this request's
    (rid, history), or carries a malformed ReqKvInfo value; then as
    :func:`hsnap_io.restore_request` refuses. On a target with Mamba ping-pong track
    buffers the request gets fresh track slots, as SGLang's re-admission gives them. A
    failure after allocation gives every allocation back and leaves ``req`` retracted.
    ``room``: as for :func:`~hsnap_sglang.req.resume_req` (a radix cache frees what is missing,
    only once every check passed). ``req.hsnap_restored`` says what was uploaded.
    """
    proven = prove_retracted(path, req, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                             identity=identity, room=room, **restore_kwargs)
    return restore_retracted(proven, tree_cache=tree_cache, room=room)


@dataclass
class ProvenRetracted(ProvenRestore):
    """What :func:`prove_retracted` proved touching no pool and no request: the file opened once, checked against the
    retracted ``req``, every digest proved.  :func:`restore_retracted` binds it; :meth:`close` gives it back."""

    req: Any = None
    carried_kv: dict | None = None  # the record's ReqKvInfo values


def prove_retracted(
    path: str | os.PathLike[str],
    req,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    room=None,
    capacity: bool = True,
    **restore_kwargs,
) -> ProvenRetracted:
    """Every refusal of :func:`load_retracted` that needs no slot, touching no pool and leaving ``req`` as it is (the
    pools' free room and ``room.spare()`` are read, nothing else): what a server does off its scheduler thread while
    the request is held out of every batch.  :func:`restore_retracted` checks the room again under the pool lock;
    ``capacity=False`` leaves the room to it alone (a server that waits for room while the others run, where a
    request admitted meanwhile would make a proof on another thread refuse a file that fits a moment later)."""
    import_sglang()
    from hsnap_io.adapters import view_pools
    from hsnap_io.restore import OPEN_KEYWORDS, PROVE_KEYWORDS, check_target, open_source, prove_opened

    require_type(path, "identity", identity, Identity, optional=True)
    rank = restore_kwargs.pop("rank", None)
    open_kwargs = {k: restore_kwargs.pop(k) for k in OPEN_KEYWORDS if k in restore_kwargs}
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    source = open_source(path, rank=rank, identity=identity, **open_kwargs)
    try:
        fpath = source.snap.path
        _check_retracted(req, fpath)
        # the file belongs here (header only), counting what the room could free (nothing freed yet)
        check_target(source, view, identity, spare=None if room is None or not capacity else room.spare(), capacity=capacity)
        record = read_record(source.snap, fpath)
        checks = [
            ("request.rid", req.rid, record.rid),
            ("request.output_tokens", len(req.output_ids), len(record.output_ids)),
            ("request.prompt_tokens", len(req.origin_input_ids), len(record.prompt_ids)),
        ]
        for field, expected, found in checks:
            if expected != found:
                raise HsnapError(fpath, field, expected, found, detail="not the retracted request this file holds")
        if list(record.output_ids) != list(req.output_ids) or list(record.prompt_ids) != list(req.origin_input_ids):
            raise HsnapError(fpath, "request.output_ids", "the request's own token ids", "other ids")
        kvx = decode_carried(record, fpath, swa_start=source.snap.swa_start)["ReqKvInfo"]
        prove_opened(source, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                     identity=identity, **{k: restore_kwargs[k] for k in PROVE_KEYWORDS if k in restore_kwargs})
    except BaseException:
        source.close()
        raise
    return ProvenRetracted(source, view, identity, mamba_tracking_slots(req_to_token_pool), restore_kwargs, req, kvx)


def _check_retracted(req, path) -> None:
    if not req.is_retracted or req.kv.req_pool_idx is not None:
        raise HsnapError(path, "Req.is_retracted", "a retracted request holding no slots", (req.is_retracted, req.kv.req_pool_idx))


def restore_retracted(proven: ProvenRetracted, *, tree_cache=None, room=None):
    """The second half of :func:`load_retracted`: the room made and the slots allocated, filled and bound to the
    proved request (under the pool lock, its capacity checked again); returns the request, no longer retracted.
    Closes ``proven`` whatever happens; a failure gives every allocation back and leaves the request retracted."""
    req = proven.req
    try:
        _check_retracted(req, proven.source.snap.path)  # (again: a request changed since the proof is not this file's to fill)
    except BaseException:
        proven.close()
        raise
    restored = proven.restore(room=room, bind=binder(req, proven.carried_kv, tree_cache, proven.view.req_to_token_pool, proven.tracking))
    req.is_retracted = False
    req.already_computed = 0
    req.hsnap_restored = restored
    return req


__all__ = ["retract_to_disk", "load_retracted", "prove_retracted", "restore_retracted", "ProvenRetracted", "retracted_extra"]
