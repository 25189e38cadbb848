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

from hsnap_format import CommitInfo, HsnapError, Identity

from ._sglang_env import import_sglang
from .sglang import _export_req, bind_restored, carried_kv


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

    info = _export_req(
        path, req, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        identity=identity, extra={"sglang.Req.retraction_count": int(req.retraction_count) + 1, "sglang.Req.retracted_stain": True},
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
    **restore_kwargs,
):
    """Give a request retracted by :func:`retract_to_disk` fresh slots holding its
    state again (the same ``Req`` object, same process). Returns ``req``.

    Refused before the pools are touched when the file is not this request's
    (rid, history) or the request is not retracted; then as
    :func:`hsnap_io.restore_request` refuses.
    """
    import_sglang()
    from .restore import _open_rank, restore_request

    rank = restore_kwargs.pop("rank", None)
    if rank is None and identity is not None:
        rank = identity.tp_rank
    snap, snapset = _open_rank(path, rank)
    try:
        record, fpath = snap.record(), snap.path
    finally:
        (snapset or snap).close()
    checks = [
        ("Req.is_retracted", True, req.is_retracted),
        ("request.rid", req.rid, record.rid),
        ("request.output_tokens", len(req.output_ids), len(record.output_ids)),
        ("request.prompt_tokens", len(req.origin_input_ids), len(record.prompt_ids)),
        ("ReqKvInfo.req_pool_idx", None, req.kv.req_pool_idx),
    ]
    for field, expected, found in checks:
        if expected != found:
            raise HsnapError(fpath, field, expected, found, detail="not the retracted request this file holds")
    if list(record.output_ids) != list(req.output_ids) or list(record.prompt_ids) != list(req.origin_input_ids):
        raise HsnapError(fpath, "request.output_ids", "the request's own token ids", "other ids")
    restored = restore_request(path, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator, identity=identity, rank=rank, **restore_kwargs)
    bind_restored(req, restored, carried_kv(record, fpath), tree_cache)
    req.is_retracted = False
    req.already_computed = 0
    return req


__all__ = ["retract_to_disk", "load_retracted"]
