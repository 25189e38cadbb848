"""SGLang's own request object as the unit of hand-off.

    from hsnap_sglang.req import snapshot_req, resume_req
    info = snapshot_req("req.hsnap", req, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                        identity=identity)
    # ... durable: release the source slots the SGLang way (release_kv_cache) ...
    req2 = resume_req("req.hsnap", req_to_token_pool=rtp2, token_to_kv_pool_allocator=alloc2,
                      identity=identity2)       # a live sglang Req, req2.kv on fresh slots

Every attribute of the request object is classified in the field table (:mod:`.fields`: carried, re-derived, refused
or irrelevant; each carried value outside the typed record checked by :mod:`.values`); :mod:`.record` turns a
``Req`` into its record and back; :mod:`.bind` binds a resumed ``Req`` to the slots the restore allocated.  This
module opens, writes and checks in that order.
"""

from __future__ import annotations

import math
import os
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from hsnap_format import CommitInfo, HsnapError, Identity, IncompatibleSnapshotError, RequestRecord
from hsnap_format.errors import Phrase, require_type

from hsnap_io.sglang_env import import_sglang
from hsnap_io.export import export_request

from .bind import ProvenRestore, binder, mamba_tracking_slots
from .fields import CARRIED, FORMAT, FORMAT_KEY, TABLES, sglang_attributes
from .record import check_resumed, check_stop_agrees, decode_carried, read_record, rebuild_req, req_record, sampling_from_record
from .values import short_repr


def snapshot_req(
    path: str | os.PathLike[str],
    req,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity,
    extra: Mapping[str, Any] | None = None,
    **export_kwargs,
) -> CommitInfo:
    """Write a live SGLang ``Req`` (its slots, from ``req.kv``, and its record) to ``path``.

    Every refusal (:class:`UnsupportedRequestError`, naming the field) comes before
    anything is written; the source pools and the request are only read. Free the
    source slots after this returns (the file is durable by then), never before.
    ``extra``: record entries written over the request's own (a retraction's counters).
    """
    record, swa_start = req_record(req, path=path)
    record.extra.update(extra or {})
    return export_request(
        path,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        req_pool_idx=int(req.kv.req_pool_idx),
        record=record,
        identity=identity,
        swa_start=swa_start,
        **export_kwargs,
    )


# ----------------------------------------------------------------------------- resume


_GRAMMAR_FIELD = {"json": "json_schema", "regex": "regex", "ebnf": "ebnf", "full_assistant_ebnf": "ebnf", "structural_tag": "structural_tag"}


def grammar_key(sp) -> tuple[str, str] | None:
    """The grammar cache key SGLang's GrammarManager builds from the sampling params."""
    for kind, attr in (("json", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf"), ("structural_tag", "structural_tag")):
        spec = getattr(sp, attr)
        if spec is not None:
            if kind == "ebnf" and sp.ebnf_full_assistant:
                kind = "full_assistant_ebnf"
            return (kind, spec)
    return None


def replay_grammar(grammar_backend, key, output_ids: Iterable[int], *, require_reasoning: bool, input_ids=(), path=None):
    """A fresh matcher of ``grammar_backend`` advanced over ``output_ids`` (no KV work)."""
    from concurrent.futures import Future

    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    field = f"request.sampling.{_GRAMMAR_FIELD.get(key[0], key[0])}"
    try:  # the backend compiles text from the file: whatever it raises is a refusal of that text
        key = grammar_backend.get_request_grammar_key(key, input_ids=input_ids, thinking_budget=None)
        value, _ = grammar_backend.get_cached_or_future_value(key, require_reasoning)
        if isinstance(value, Future):
            value = value.result()
            if not isinstance(value, InvalidGrammarObject):
                grammar_backend.set_cache(key, value.copy())
    except Exception as e:  # noqa: BLE001 - a library boundary, hostile input
        raise HsnapError(path, field, "a grammar the target backend compiles", Phrase(short_repr(f"{type(e).__name__}: {e}", 160))) from None
    if value is None or isinstance(value, InvalidGrammarObject):
        raise HsnapError(path, field, "a grammar the target backend compiles", getattr(value, "error_message", None))
    for i, tok in enumerate(output_ids):
        try:
            value.accept_token(int(tok))
        except Exception as e:  # noqa: BLE001 - ValueError: not accepted; anything else from the matcher alike
            raise HsnapError(path, f"request.output_ids[{i}]", "a token the grammar accepts", f"{int(tok)} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return key, value


def _tokenizer_workers() -> int | None:
    """How many tokenizer workers this server runs, from SGLang's published server config
    (None when no config is published in this process)."""
    try:
        from sglang.srt.runtime_context import get_context, get_serving

        if not get_context().is_config_namespace_published("serving"):
            return None
        return int(get_serving().tokenizer_worker_num)
    except (ImportError, AttributeError, ValueError, TypeError):
        return None


def target_worker_ipc(path, given, req_kwargs: dict):
    """The target's tokenizer worker that streams the resumed request (losing it
    silently stops the client's stream). Required where SGLang routes by it."""
    ipc = given if given is not None else req_kwargs.pop("http_worker_ipc", None)
    req_kwargs.pop("http_worker_ipc", None)
    require_type(path, "http_worker_ipc", ipc, str, optional=True)
    workers = _tokenizer_workers()
    if ipc is None and workers is not None and workers > 1:
        raise HsnapError(path, "Req.http_worker_ipc", Phrase("the target's tokenizer worker: resume_req(http_worker_ipc=...)"), None,
                         detail=f"this server runs {workers} tokenizer workers and routes each stream by it")
    return ipc



def resume_req(path: str | os.PathLike[str], *, tree_cache=None, commit: Callable[[], None] | None = None, room=None, **kwargs):
    """Restore a snapshot written by :func:`snapshot_req` into fresh slots and return a
    live SGLang ``Req`` built by SGLang's constructor, ``req.kv`` on those slots:
    :func:`prove_resume` (its keywords: the pools, ``identity``, ``tokenizer``, ...), then
    :func:`restore_proven`.  ``tree_cache``: the requests' radix tree (its root handle for ``req``).

    ``vocab_size``: the target model's vocabulary size (SGLang's scheduler builds every ``Req``
    with ``model_config.vocab_size``): a record carrying another is refused before allocating.
    ``expect_rid``: refuse (before allocating) a record of another request — a caller that
    read the rid from the path earlier learns that the file was replaced meanwhile.
    ``commit()``: called last, after the ``Req`` is bound to its slots, under the pool lock
    and inside the restore's rollback; if it raises, every allocation is given back (a TP
    server has every rank agree here, so that either all ranks hold the request or none).
    ``room``: a target that can free slots (:class:`hsnap_io.slots.Room`, a radix cache): the
    header's capacity check counts what it could free (``room.spare()``, changing nothing), and
    ``room.make(...)`` frees what is missing under the pool lock, after every other check —
    every digest included (:func:`hsnap_io.restore.prove_opened`) — right before the
    allocation: a snapshot refused for anything never costs the cache.

    The file is opened once; the record, every check and every uploaded byte come
    through that open. Refused before the pools are touched: a snapshot that does not
    belong to the target (identity, geometry, capacity), a record not written from a
    ``Req`` or holding a value a fresh request would be refused for (every carried
    value checked by its table row; SGLang's ``SamplingParams.normalize`` and
    ``verify(vocab_size)``; token ids below ``vocab_size``), a ``lora_id`` not in
    ``loaded_lora_ids``, a grammar request without a ``grammar_backend`` (or whose output
    the grammar rejects), stop strings without a ``tokenizer``, no ``http_worker_ipc``
    on a server with several tokenizer workers, a target with Mamba ping-pong track
    buffers but no free slots for them, and everything :func:`hsnap_io.restore_request`
    refuses. A failure after allocation gives every allocation back.
    """
    return restore_proven(prove_resume(path, room=room, **kwargs), tree_cache=tree_cache, room=room, commit=commit)


@dataclass
class ProvenResume(ProvenRestore):
    """What :func:`prove_resume` proved touching no pool: the snapshot opened once, every digest proved (with
    ``verify=True`` its bytes read and hashed, kept for the upload), the ``Req`` rebuilt and checked but bound to no
    slot.  :func:`restore_proven` binds it; :meth:`close` gives everything back (a proof never restored)."""

    prepared: PreparedReq | None = None


def prove_resume(
    path: str | os.PathLike[str],
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    tokenizer=None,
    grammar_backend=None,
    loaded_lora_ids: Iterable[str] | None = None,
    rank: int | None = None,
    http_worker_ipc: str | None = None,
    req_kwargs: Mapping[str, Any] | None = None,
    expect_rid: str | None = None,
    vocab_size: int | None = None,
    room=None,
    **restore_kwargs,
) -> ProvenResume:
    """Every refusal of :func:`resume_req` that needs no slot, touching no pool (the pools' free room and
    ``room.spare()`` are read, nothing else): the snapshot opened, checked against the target (header, capacity
    counting the room), its request rebuilt and checked as a fresh one, and every digest proved
    (:func:`hsnap_io.restore.prove_opened`).  What a server can do off its scheduler thread: it reads the snapshot
    (for an ``s3://`` one, over the network).  The pools' free room may change before :func:`restore_proven`, which
    checks it again under the pool lock."""
    import_sglang()
    from hsnap_io.adapters import view_pools
    from hsnap_io.restore import OPEN_KEYWORDS, PROVE_KEYWORDS, check_target, open_source, prove_opened

    require_type(path, "identity", identity, Identity, optional=True)
    open_kwargs = {k: restore_kwargs.pop(k) for k in OPEN_KEYWORDS if k in restore_kwargs}
    kwargs = dict(req_kwargs or {})
    ipc = target_worker_ipc(path, http_worker_ipc, kwargs)
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    source = open_source(path, rank=rank, identity=identity, **open_kwargs)
    try:
        fpath = source.snap.path
        # the file belongs here (header only), counting what the room could free (nothing freed yet)
        check_target(source, view, identity, spare=None if room is None else room.spare())
        record = read_record(source.snap, fpath)
        prepared = prepare_req(record, fpath, swa_start=source.snap.swa_start, tokenizer=tokenizer, grammar_backend=grammar_backend,
                               loaded_lora_ids=loaded_lora_ids, vocab_size=vocab_size, http_worker_ipc=ipc, req_kwargs=kwargs,
                               expect_rid=expect_rid)
        prove_opened(source, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                     identity=identity, **{k: restore_kwargs[k] for k in PROVE_KEYWORDS if k in restore_kwargs})
    except BaseException:
        source.close()
        raise
    return ProvenResume(source, view, identity, mamba_tracking_slots(req_to_token_pool), restore_kwargs, prepared)


def restore_proven(proven: ProvenResume, *, tree_cache=None, room=None, commit: Callable[[], None] | None = None):
    """The second half of :func:`resume_req`: the room made and the slots allocated, filled and bound to the proved
    ``Req`` (under the pool lock, its capacity checked again), ``commit()`` last; returns the live ``Req``.  Closes
    ``proven`` whatever happens; a failure gives every allocation back."""
    prepared = proven.prepared
    req = prepared.req
    restored = proven.restore(room=room, bind=binder(req, prepared.carried["ReqKvInfo"], tree_cache, proven.view.req_to_token_pool,
                                                     proven.tracking, commit))
    if prepared.grammar is not None:
        req.grammar_key, req.grammar = prepared.grammar_key, prepared.grammar
    req.hsnap_restored = restored  # bytes uploaded, snapshot id, numerics differences
    return req


@dataclass
class PreparedReq:
    """A ``Req`` rebuilt from a record and checked as a fresh request would be, not yet bound
    to any slot (:func:`prepare_req`)."""

    req: Any
    carried: dict
    grammar_key: Any
    grammar: Any


def prepare_req(record: RequestRecord, fpath, *, swa_start: int, tokenizer=None, grammar_backend=None, loaded_lora_ids=None,
                vocab_size: int | None = None, http_worker_ipc: str | None = None, req_kwargs: Mapping[str, Any] | None = None,
                expect_rid: str | None = None) -> PreparedReq:
    """Everything :func:`resume_req` refuses about the request itself, before any slot is
    touched: the record written from a ``Req`` (of ``expect_rid``), every carried value,
    the vocabulary, the sampling parameters and stop strings, the LoRA adapter, the grammar
    (its matcher re-derived by replaying the output ids). Returns the rebuilt ``Req``."""
    if record.extra.get(FORMAT_KEY) != FORMAT:
        raise IncompatibleSnapshotError(fpath, [(f"request.extra.{FORMAT_KEY}", FORMAT, record.extra.get(FORMAT_KEY))])
    if expect_rid is not None and record.rid != expect_rid:
        raise IncompatibleSnapshotError(fpath, [("request.rid", expect_rid, record.rid)])
    kwargs = dict(req_kwargs or {})
    carried = decode_carried(record, fpath, swa_start=swa_start)
    if vocab_size is not None and carried["Req"].get("vocab_size", vocab_size) != vocab_size:
        raise IncompatibleSnapshotError(fpath, [("request.extra.sglang.Req.vocab_size", vocab_size, carried["Req"]["vocab_size"])])
    sp = sampling_from_record(record.sampling, fpath)
    check_stop_agrees(record, sp, fpath)
    lora = carried["Req"].get("lora_id")
    if lora is not None and (loaded_lora_ids is None or lora not in set(loaded_lora_ids)):
        raise IncompatibleSnapshotError(fpath, [("request.extra.sglang.Req.lora_id", f"an adapter the target has loaded {sorted(loaded_lora_ids or ())}", lora)])
    # the Req is built and checked before the pools are touched: a failure here leaves them as they were
    req = rebuild_req(record, carried, sp, tokenizer=tokenizer, http_worker_ipc=http_worker_ipc, req_kwargs=kwargs)
    check_resumed(req, tokenizer, fpath)
    key, grammar = grammar_key(sp), None
    if key is not None:
        if grammar_backend is None:
            raise HsnapError(fpath, f"request.sampling.{_GRAMMAR_FIELD[key[0]]}", "a grammar_backend to re-derive the matcher", None)
        key, grammar = replay_grammar(grammar_backend, key, record.output_ids, require_reasoning=bool(req.require_reasoning),
                                      input_ids=array("q", record.prompt_ids.tolist()), path=fpath)
    return PreparedReq(req, carried, key, grammar)


# ----------------------------------------------------------------------------- comparison


def classified_view(req) -> dict[str, Any]:
    """``Class.attr`` -> comparable value of every carried and re-derived-from-carried
    field: two requests whose views are equal continue identically."""
    attrs = sglang_attributes(req)
    out: dict[str, Any] = {}
    for cls, values in attrs.items():
        for name, f in TABLES[cls].items():
            if f.disposition == CARRIED and name in values and name not in ("kv", "logprob", "sampling_params"):
                out[f"{cls}.{name}"] = _comparable(values[name])
    out["Req.full_untruncated_fill_ids"] = list(req.origin_input_ids) + list(req.output_ids)
    if getattr(req, "surr_and_decode_ids", None) is not None:
        out["Req.surr_and_decode_ids"] = list(req.surr_and_decode_ids)
    out["Req.grammar_key"] = grammar_key(req.sampling_params)
    return out


def _comparable(v):
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, (array, tuple, list)):
        return [_comparable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    if isinstance(v, dict):
        return {str(k): _comparable(x) for k, x in v.items()}
    if hasattr(v, "__struct_fields__"):
        return {f: _comparable(getattr(v, f)) for f in v.__struct_fields__}
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return v


__all__ = ["snapshot_req", "resume_req", "prove_resume", "restore_proven", "ProvenResume", "prepare_req", "PreparedReq", "classified_view", "grammar_key", "replay_grammar", "target_worker_ipc"]
