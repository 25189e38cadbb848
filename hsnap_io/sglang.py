"""SGLang's own request object as the unit of hand-off.

    from hsnap_io.sglang import snapshot_req, resume_req
    info = snapshot_req("req.hsnap", req, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                        identity=identity)
    # ... durable: release the source slots the SGLang way (release_kv_cache) ...
    req2 = resume_req("req.hsnap", req_to_token_pool=rtp2, token_to_kv_pool_allocator=alloc2,
                      identity=identity2)       # a live sglang Req, req2.kv on fresh slots

Every attribute of ``Req``, ``ReqKvInfo``, ``ReqLogprob`` and ``SamplingParams`` is
classified in :data:`FIELDS` (the single source: ``docs/sglang.md`` is generated from
it and a test fails when SGLang grows an attribute the table does not name):

* ``carried``    written into the snapshot's request record and set again on resume;
* ``rederived``  computed again in the target (fresh slots, grammar matcher, ...);
* ``refused``    a value other than the neutral one makes :func:`snapshot_req` refuse;
* ``irrelevant`` scheduler bookkeeping or observability that does not change future
  tokens nor what the client receives.

Carried values without a typed place in :class:`hsnap_format.RequestRecord` go into
the record's existing extensible maps (``sampling`` for ``SamplingParams``, ``extra``
for the rest, keys ``sglang.<Class>.<attr>``); the file format is unchanged.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from hsnap_format import CapacityError, CommitInfo, HsnapError, Identity, IncompatibleSnapshotError, RequestRecord

from ._sglang_env import import_sglang
from .export import export_request

FORMAT_KEY = "sglang.format"
FORMAT = "sglang-req/1"  # layout of the sglang.* keys below, not the file format
ENGINE_VERSION = "0.5.23"


class UnsupportedRequestError(HsnapError):
    """The request holds state hsnap cannot carry (refused before anything is written)."""


# ----------------------------------------------------------------------------- the table

CARRIED, REDERIVED, REFUSED, IRRELEVANT = "carried", "rederived", "refused", "irrelevant"


def _is_none(v) -> bool:
    return v is None


def _falsy(v) -> bool:
    return not v


@dataclass(frozen=True)
class Field:
    disposition: str
    why: str
    codec: str | None = None  # carried: record | plain | ints | intset | json
    ok: Callable[[Any], bool] | None = None  # refused: the values that are accepted
    neutral: str = ""  # refused: the accepted value, in words (docs)


def C(why: str, codec: str = "plain") -> Field:
    return Field(CARRIED, why, codec)


def D(why: str) -> Field:
    return Field(REDERIVED, why)


def R(why: str, ok=_is_none, neutral: str = "None") -> Field:
    return Field(REFUSED, why, ok=ok, neutral=neutral)


def I(why: str) -> Field:  # noqa: E743
    return Field(IRRELEVANT, why)


_SCHED = "scheduler bookkeeping of the current process; the target scheduler sets its own"
_CACHE = "prefix-cache (radix/HiCache) bookkeeping; the restored request owns all its slots and starts at the tree root"
_PD = "PD-disaggregation transport state; finished before a request decodes"
_STATS = "observability only"

REQ_FIELDS: dict[str, Field] = {
    # identity and history
    "rid": C("request id the client knows", "record"),
    "origin_input_ids": C("the prompt (record.prompt_ids)", "record"),
    "origin_input_ids_unpadded": D("equals origin_input_ids for text requests (multimodal padding is refused)"),
    "output_ids": C("generated tokens (record.output_ids)", "record"),
    "full_untruncated_fill_ids": D("origin_input_ids + output_ids (refresh_fill_ids)"),
    "extend_end": D("set to the committed length, as SGLang's PD decode admission does"),
    "sampling_params": C("normalized SamplingParams (record.sampling + record.stop)", "record"),
    "eos_token_ids": C("stop condition", "intset"),
    "vocab_size": C("stop condition (out-of-vocab ids finish the request)"),
    "priority": C("scheduling priority the client asked for"),
    "lora_id": C("adapter the request decodes with; resume refuses an adapter the target has not loaded"),
    "extra_key": C("cache namespace (includes the lora id)"),
    "cache_salt": C("cache namespace"),
    "routing_key": C("routing hint the client gave"),
    "stream": C("how the client receives output"),
    "return_logprob": C("logprob option"),
    "logprob_start_len": C("logprob option"),
    "logprob": C("the ReqLogprob object, field by field (see ReqLogprob)", "record"),
    "temp_scaled_logprobs": C("logprob option"),
    "top_p_normalized_logprobs": C("logprob option"),
    "sampling_logprobs_mode": C("logprob option"),
    "return_flat_raw_top_logprobs": C("logprob option"),
    "input_logprob_sent": C("whether input logprobs were already streamed"),
    # streaming / detokenizer progress
    "send_token_offset": C("output ids already sent (record.streamed.tokens)", "record"),
    "send_decode_id_offset": C("decode ids already sent to the detokenizer"),
    "send_output_token_logprobs_offset": C("logprobs already sent"),
    "surr_offset": C("incremental detokenizer offset"),
    "read_offset": C("incremental detokenizer offset"),
    "decoded_text": C("incremental detokenizer text"),
    "cur_decode_ids_len": C("incremental detokenizer progress (set by init_incremental_detokenize)"),
    "surr_and_decode_ids": D("origin_input_ids_unpadded[surr_offset:] + output_ids[:cur_decode_ids_len]"),
    # reasoning
    "require_reasoning": C("reasoning mode"),
    "_is_reasoning_over": C("reasoning finished (record.streamed.reasoning_finished)", "record"),
    "reasoning_tokens": C("reasoning token count (record.streamed.reasoning_tokens)", "record"),
    "_think_end_match_len": C("partial match of the think-end sequence"),
    "_think_start_match_len": C("partial match of the think-start sequence"),
    "_think_end_matcher": D("built lazily from the think-end ids on the next update"),
    # grammar
    "grammar": D("a fresh matcher of the target's grammar backend, fed every output id"),
    "grammar_key": D("(kind, spec) from the carried SamplingParams grammar field"),
    "grammar_wait_ct": I(_SCHED),
    # reported to the client in meta_info
    "cached_tokens": C("reported to the client (meta_info.cached_tokens)"),
    "cached_tokens_device": C("reported to the client"),
    "cached_tokens_host": C("reported to the client"),
    "cached_tokens_storage": C("reported to the client"),
    "_cache_breakdown_computed": C("guards the cached-token breakdown above"),
    "retraction_count": C("reported to the client"),
    "retracted_stain": C("the request was retracted once (reported, affects scheduling)"),
    "spec_verify_ct": C("reported to the client"),
    "spec_num_correct_drafts": C("reported to the client"),
    "spec_num_block_accept_tokens": C("reported to the client"),
    "spec_num_cap_tokens": C("reported to the client"),
    "spec_correct_drafts_histogram": C("reported to the client", "ints"),
    "spec_cap_lens_histogram": C("reported to the client", "ints"),
    "prefill_attempt_count": C("counts prefill attempts; preserved across retractions by SGLang too"),
    "already_computed": D("0: nothing of the restored request needs recomputing"),
    # the KV record
    "kv": C("the ReqKvInfo object, field by field (see ReqKvInfo)", "record"),
    # refused unless neutral
    "session": R("session-bound request: the session's history lives outside the request"),
    "session_id": R("session-bound request"),
    "_session_mm_items": R("session media", ok=_falsy, neutral="[]"),
    "session_generation": R("session-bound request"),
    "custom_logit_processor": R("a serialized callable with its own state; not carried"),
    "multimodal_inputs": R("multimodal embeddings are not in the snapshot"),
    "input_embeds": R("input embeddings are not in the snapshot"),
    "positional_embed_overrides": R("embedding overrides are not in the snapshot"),
    "token_type_ids": R("cross-encoder input, not a generation"),
    "return_hidden_states": R("hidden-state returns are per-position tensors not in the snapshot", ok=_falsy, neutral="False"),
    "hidden_states": R("hidden-state returns", ok=_falsy, neutral="[]"),
    "hidden_states_tensor": R("hidden-state returns"),
    "return_pooled_hidden_states": R("hidden-state returns", ok=_falsy, neutral="False"),
    "pooled_hidden_state": R("hidden-state returns"),
    "return_routed_experts": R("routed-expert returns are per-position tensors not in the snapshot", ok=_falsy, neutral="False"),
    "routed_experts": R("routed-expert returns"),
    "return_indexer_topk": R("indexer top-k returns are per-position tensors not in the snapshot", ok=_falsy, neutral="False"),
    "indexer_topk": R("indexer top-k returns"),
    "return_sampling_mask": R("sampling-mask returns are per-step tensors not in the snapshot", ok=_falsy, neutral="False"),
    "sampling_mask_rows": R("sampling-mask returns"),
    "output_topk_p": R("speculative draft state in flight (EAGLE/MTP)"),
    "output_topk_index": R("speculative draft state in flight (EAGLE/MTP)"),
    "output_dsa_topk_indices": R("DSA indexer state"),
    "customized_info": R("free-form per-token returns"),
    "embedding": R("an embedding request, not a generation"),
    "dimensions": R("an embedding request (Matryoshka dimensions)"),
    "multi_item_delimiter_indices": R("multi-item scoring request"),
    "token_indices_to_pool": R("pooling request"),
    "decision_layout": R("classification/decision request"),
    "beam_group": R("beam search: the group's rows are not one request"),
    "dllm_config": R("diffusion-LM request"),
    "finished_reason": R("a finished request has nothing to continue"),
    "finished_len": R("a finished request has nothing to continue"),
    "finished_output": R("a finished request has nothing to continue"),
    "to_finish": R("an abort is pending"),
    "discard_output_reason": R("an in-flight forward's output is being discarded"),
    "is_retracted": R("a retracted request holds no KV (retract.py handles retraction)", ok=_falsy, neutral="False"),
    "weight_version_events": R("weights changed mid-request; a snapshot binds one weights version", ok=_falsy, neutral="[]"),
    "pd_rebootstrap_forced_output_id": R("a PD re-bootstrap is pending"),
    "hisparse_staging": R("HiSparse staging in flight", ok=_falsy, neutral="False"),
    "inflight_middle_chunks": R("a chunked prefill is in flight", ok=_falsy, neutral="0"),
    "input_token_logprobs": R("prefill-time logprob scratch in flight"),
    "temp_input_top_logprobs_val": R("prefill-time logprob scratch in flight"),
    "temp_input_top_logprobs_idx": R("prefill-time logprob scratch in flight"),
    "temp_input_token_ids_logprobs_val": R("prefill-time logprob scratch in flight"),
    "temp_input_token_ids_logprobs_idx": R("prefill-time logprob scratch in flight"),
    # re-derived / irrelevant
    "tokenizer": D("the target's tokenizer (resume_req(tokenizer=...))"),
    "return_hidden_states_mode": D("derived from return_hidden_states (refused unless False)"),
    "cache_request_handle": D("CacheRequestHandle(rid, attempt 0), as the constructor builds it"),
    "hsnap_restored": I("set by resume_req: what the restore did (slots, bytes uploaded, snapshot id)"),
    "time_stats": I(_STATS),
    "has_log_time_stats": I(_STATS),
    "metrics_collector": I("the target's metrics collector (resume_req(**req_kwargs))"),
    "http_worker_ipc": I("process topology of the source; the target passes its own (resume_req(**req_kwargs))"),
    "extend_batch_idx": I(_SCHED),
    "decode_batch_idx": I(_SCHED),
    "arrival_processed_tokens": I(_SCHED),
    "retraction_mb_id": I(_SCHED),
    "mamba_lazy_checkpoint": I(_CACHE),
    "mamba_branching_seqlen": I(_CACHE),
    "swa_branching_seqlen": I(_CACHE),
    "prefix_len": D("0: the request owns its whole row from the root (as SGLang's PD decode admission binds it)"),
    "last_node": D("tree_cache.root_node_handle(extra_key) when resume_req gets a tree_cache, else None"),
    "last_host_node": D("as last_node"),
    "best_match_node": D("as last_node"),
    "lock": D("None: no tree lock is held (as SGLang's PD decode admission)"),
    "host_hit_length": I(_CACHE),
    "swa_host_hit_length": I(_CACHE),
    "mamba_host_hit_length": I(_CACHE),
    "num_matched_prefix_tokens": I(_CACHE),
    "storage_hit_length": I(_CACHE),
    "storage_hit_start": I(_CACHE),
    "host_loaded_length": I(_CACHE),
    "host_hit_is_storage": I(_CACHE),
    "storage_prefetch_retry_attempts": I(_CACHE),
    "staged_prefetch_plan": I(_CACHE),
    "storage_prefetch_last_match_len": I(_CACHE),
    "kv_rotation_base": I(_CACHE),
    "skip_radix_cache_insert": I(_CACHE),
    "kv_hints": I(_CACHE),
    "mm_image_tokens": I("multimodal counts (multimodal requests are refused)"),
    "mm_audio_tokens": I("multimodal counts (multimodal requests are refused)"),
    "mm_video_tokens": I("multimodal counts (multimodal requests are refused)"),
    "mm_token_counts_ready": I("multimodal counts (multimodal requests are refused)"),
    "bootstrap_host": I(_PD),
    "bootstrap_port": I(_PD),
    "bootstrap_room": I(_PD),
    "disagg_kv_sender": I(_PD),
    "routed_dp_rank": I(_PD),
    "disagg_prefill_dp_rank": I(_PD),
    "start_send_idx": I(_PD),
    "disagg_decode_prefix_len": I(_PD),
    "tmp_end_idx": I(_PD),
    "early_send_prefix_end": I(_PD),
    "metadata_buffer_index": I(_PD),
    "expected_kv_checksum": I(_PD),
    "pending_bootstrap": I(_PD),
    "routed_experts_start_len": I("used only with routed-expert returns (refused)"),
    "dllm_initialized": I("diffusion-LM only (refused)"),
    "dllm_block_offset": I("diffusion-LM only (refused)"),
    "dllm_incomplete_ids": I("diffusion-LM only (refused)"),
    "dllm_phase": I("diffusion-LM only (refused)"),
    "dllm_has_literal_mask": I("diffusion-LM only (refused)"),
    "dllm_algo_state": I("diffusion-LM only (refused)"),
}

KV_FIELDS: dict[str, Field] = {
    "req_pool_idx": D("a fresh row of the target's req_to_token_pool"),
    "cache_protected_len": D("0: the tree owns nothing of the restored row"),
    "cache_inserted_len": D("0: nothing of the restored row is in the target's tree"),
    "kv_committed_len": C("committed positions = record.state_position (must be seqlen - 1)", "record"),
    "kv_allocated_len": D("= kv_committed_len; snapshot refuses allocation past the committed boundary (draft tokens or a step in flight)"),
    "swa_evict_floor": C("prefill-aware SWA floor"),
    "component_evicted_seqlens": C("evicted cursors per component; the SWA cursor is the snapshot's swa_start", "json"),
    "retraction_backup": R("an in-memory retraction backup exists (the request holds no slots)"),
    "mamba_pool_idx": D("a fresh slot of the target's mamba allocator, 0-d int64 as HybridReqToTokenPool.alloc makes it"),
    "mamba_ping_pong_track_buffer": D("radix-tracking checkpoints, not the working state: fresh slots from SGLang's _alloc_ping_pong_buffer when the target has the extra buffer, else None"),
    "mamba_ping_pong_empty": D("set with the fresh track buffer (SGLang's _alloc_ping_pong_buffer)"),
    "mamba_next_track_idx": D("set with the fresh track buffer (SGLang's _alloc_ping_pong_buffer)"),
    "mamba_last_track_idx": D("set with the fresh track buffer (SGLang's _alloc_ping_pong_buffer)"),
    "mamba_last_track_seqlen": D("None: no tracked state, so nothing stale is inserted into a tree"),
    "mamba_prev_track_seqlen": D("None: no tracked state"),
    "mamba_untracked_decode_batch_idx": D("None: no tracked state"),
    "mamba_cow_src_index": R("a deferred copy-on-write is pending: the slot does not hold the state yet; resume leaves it None so no COW overwrites the restored state"),
    "mamba_needs_clear": R(
        "the slot was never written by a forward pass; resume leaves it False so the restored state is not zeroed (sglang#32995)",
        ok=_falsy,
        neutral="False",
    ),
}

LOGPROB_FIELDS: dict[str, Field] = {
    "top_logprobs_num": C("logprob option (record.top_logprobs_k when k > 0)"),
    "token_ids_logprob": C("logprob option", "ints"),
    "output_token_logprobs_val": C("selected-token logprobs (record.output_logprobs, float32)", "record"),
    "output_token_logprobs_idx": C("ids of the selected tokens", "ints"),
    "output_top_logprobs_val": C("top-k logprobs (record.top_logprob_values, float32)", "record"),
    "output_top_logprobs_idx": C("top-k ids (record.top_logprob_ids)", "record"),
    "output_token_ids_logprobs_val": C("token-ids logprobs", "json"),
    "output_token_ids_logprobs_idx": C("token-ids logprob ids", "json"),
    "input_token_logprobs_val": C("input logprobs (sent with the first output)", "json"),
    "input_token_logprobs_idx": C("input logprobs", "json"),
    "input_top_logprobs_val": C("input logprobs", "json"),
    "input_top_logprobs_idx": C("input logprobs", "json"),
    "input_token_ids_logprobs_val": C("input logprobs", "json"),
    "input_token_ids_logprobs_idx": C("input logprobs", "json"),
    "input_top_logprobs_val_flat": R("flat numpy input logprobs (prefill-only scoring)"),
    "input_top_logprobs_idx_flat": R("flat numpy input logprobs (prefill-only scoring)"),
    "input_top_logprobs_flat_null_prefix": R("flat numpy input logprobs (prefill-only scoring)"),
}

_GRAMMAR = "grammar spec; the matcher is re-derived at resume (xgrammar)"
SAMPLING_FIELDS: dict[str, Field] = {
    **{
        k: C("sampling parameter")
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
            "stream_interval",
            "logit_bias",
            "sampling_seed",
            "custom_params",
            "watermark",
            "stop_regex_strs",
            "stop_str_max_len",
            "stop_regex_max_len",
            "is_normalized",
            "stop",
            "stop_regex",
        )
    },
    "max_new_tokens": C("budget (record.stop.max_new_tokens)"),
    "min_new_tokens": C("budget (record.stop.min_new_tokens)"),
    "stop_strs": C("stop strings (record.stop.stop_strings)"),
    "stop_token_ids": C("stop token ids (record.stop.stop_token_ids)"),
    "ignore_eos": C("stop condition (record.stop.ignore_eos)"),
    "json_schema": C(_GRAMMAR),
    "regex": C(_GRAMMAR),
    "ebnf": C(_GRAMMAR),
    "structural_tag": C(_GRAMMAR),
    "ebnf_full_assistant": C(_GRAMMAR),
    "n": R("parallel sampling groups (n > 1)", ok=lambda v: v in (None, 1), neutral="1"),
    "beam_width": R("beam search"),
}

TABLES: dict[str, dict[str, Field]] = {
    "Req": REQ_FIELDS,
    "ReqKvInfo": KV_FIELDS,
    "ReqLogprob": LOGPROB_FIELDS,
    "SamplingParams": SAMPLING_FIELDS,
}


def sglang_attributes(req) -> dict[str, dict[str, Any]]:
    """Class -> {attribute: value} of everything the request object holds."""
    return {
        "Req": dict(vars(req)),
        "ReqKvInfo": {k: getattr(req.kv, k) for k in _slot_names(req.kv)},
        "ReqLogprob": {k: getattr(req.logprob, k) for k in _slot_names(req.logprob)},
        "SamplingParams": {f: getattr(req.sampling_params, f) for f in req.sampling_params.__struct_fields__},
    }


def _slot_names(obj) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(obj)]


def unclassified(req) -> list[str]:
    """``Class.attr`` of every attribute the table does not classify (an SGLang upgrade)."""
    return [f"{cls}.{k}" for cls, attrs in sglang_attributes(req).items() for k in attrs if k not in TABLES[cls]]


# ----------------------------------------------------------------------------- codecs


def _json_default(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, (array, tuple)):
        return list(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON data")


def _encode(codec: str, value, where: str, path=None):
    try:
        if codec == "plain":
            if not _plain_ok(value):
                raise TypeError(f"{type(value).__name__} {value!r} is not a JSON scalar")
            return value
        if codec == "ints":
            return None if value is None else [int(x) for x in value]
        if codec == "intset":
            return None if value is None else sorted(int(x) for x in value)
        if codec == "json":
            return json.dumps(value, default=_json_default, ensure_ascii=False, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise UnsupportedRequestError(path, where, f"a value hsnap can carry ({codec})", f"{e}") from None
    raise AssertionError(codec)


def _decode(codec: str, value):
    if codec == "plain":
        return value
    if codec == "ints":
        return None if value is None else [int(x) for x in value]
    if codec == "intset":
        return None if value is None else {int(x) for x in value}
    if codec == "json":
        return json.loads(value)
    raise AssertionError(codec)


def _plain_ok(v) -> bool:
    if v is None or isinstance(v, (bool, str)):
        return True
    if isinstance(v, int):
        return abs(v) <= 2**53 - 1
    if isinstance(v, float):
        return math.isfinite(v)
    return False


# ----------------------------------------------------------------------------- sampling params


def _sampling_to_record(sp, path=None) -> dict[str, Any]:
    """SamplingParams -> the record's flat ``sampling`` map. Values that are not JSON
    scalars (sets, dicts, structs, seeds past 2**53, infinities) are JSON strings of
    their msgspec builtins, named in ``__json__`` so decoding is unambiguous. (Not
    msgspec.json: it writes an infinite logit bias as null.)"""
    import msgspec

    out: dict[str, Any] = {}
    encoded = []
    for name in sp.__struct_fields__:
        v = getattr(sp, name)
        if _plain_ok(v) or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            out[name] = v
            continue
        try:
            out[name] = json.dumps(msgspec.to_builtins(v), allow_nan=True, ensure_ascii=False, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise UnsupportedRequestError(path, f"SamplingParams.{name}", "JSON data", f"{_short(v)} ({e})") from None
        encoded.append(name)
    out["__json__"] = encoded
    return out


def _sampling_from_record(d: Mapping[str, Any], path):
    import_sglang()
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    hints = _struct_types(SamplingParams)
    encoded = set(d.get("__json__", ()))
    kwargs = {}
    for name in SamplingParams.__struct_fields__:
        if name not in d:
            raise HsnapError(path, f"request.sampling.{name}", "present (written by snapshot_req)", "missing")
        v = d[name]
        try:
            kwargs[name] = msgspec.convert(json.loads(v) if name in encoded else v, hints[name])
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise HsnapError(path, f"request.sampling.{name}", str(hints[name]), f"{v!r} ({e})") from None
    # is_normalized=True makes __post_init__ keep the normalized values as they are
    return SamplingParams(**kwargs)


def _struct_types(cls) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


# ----------------------------------------------------------------------------- snapshot


def check_req(req, *, path=None) -> None:
    """Refuse a request hsnap cannot carry, naming the field. Reads only."""
    attrs = sglang_attributes(req)
    missing = unclassified(req)
    if missing:
        raise UnsupportedRequestError(path, missing[0], f"an attribute classified in hsnap_io.sglang.TABLES (SGLang {ENGINE_VERSION})", "unclassified")
    for cls, values in attrs.items():
        for name, f in TABLES[cls].items():
            if f.disposition == REFUSED and name in values and not f.ok(values[name]):
                raise UnsupportedRequestError(path, f"{cls}.{name}", f.neutral, _short(values[name]), detail=f.why)
    kv = req.kv
    n_out = len(req.output_ids)
    checks = [
        ("ReqKvInfo.req_pool_idx", "a req_to_token row (the request holds KV)", kv.req_pool_idx, kv.req_pool_idx is not None),
        ("Req.output_ids", "at least one output token (a decoding request)", n_out, n_out >= 1),
        ("ReqKvInfo.kv_committed_len", f"seqlen - 1 = {req.seqlen - 1} (a committed decode boundary)", kv.kv_committed_len, kv.kv_committed_len == req.seqlen - 1),
        (
            "ReqKvInfo.kv_allocated_len",
            f"kv_committed_len = {kv.kv_committed_len} (no speculative draft tokens or decode step in flight)",
            kv.kv_allocated_len,
            kv.kv_allocated_len == kv.kv_committed_len,
        ),
        ("Req.origin_input_ids_unpadded", "equal to origin_input_ids (no multimodal padding)", "different", list(req.origin_input_ids_unpadded) == list(req.origin_input_ids)),
        ("Req.extra_key", f"ending with lora_id {req.lora_id!r}", req.extra_key, req.lora_id is None or (req.extra_key or "").endswith(req.lora_id)),
    ]
    for fld, exp, found, ok in checks:
        if not ok:
            raise UnsupportedRequestError(path, fld, exp, found)
    lp = req.logprob
    if req.return_logprob:
        if lp.output_token_logprobs_val is None or len(lp.output_token_logprobs_val) != n_out:
            raise UnsupportedRequestError(path, "ReqLogprob.output_token_logprobs_val", f"{n_out} entries (one per output token)", None if lp.output_token_logprobs_val is None else len(lp.output_token_logprobs_val))
        k = lp.top_logprobs_num
        if k > 0:
            for name in ("output_top_logprobs_val", "output_top_logprobs_idx"):
                rows = getattr(lp, name)
                if rows is None or len(rows) != n_out or any(len(r) != k for r in rows):
                    raise UnsupportedRequestError(path, f"ReqLogprob.{name}", f"{n_out} rows of {k}", _short(rows))


def _short(v, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _f32(values, where: str, path) -> np.ndarray:
    """float values as float32, refusing any that float32 would round (SGLang's
    logprobs are float32 tensors turned into Python floats, so they never are)."""
    a64 = np.asarray(values, dtype=np.float64)
    a32 = a64.astype(np.float32)
    same = (a32.astype(np.float64) == a64) | (np.isnan(a64) & np.isnan(a32))
    if not same.all():
        i = np.unravel_index(int(np.argmin(same)), same.shape)
        raise UnsupportedRequestError(path, where, "float32 values (as SGLang computes logprobs)", f"{a64[i]!r} at {tuple(int(x) for x in i)}")
    return a32


def req_record(req, *, path=None) -> tuple[RequestRecord, int]:
    """The request record of ``req`` and its SWA start (positions without SWA rows)."""
    import_sglang()
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    check_req(req, path=path)
    attrs = sglang_attributes(req)
    sp, lp, kv = req.sampling_params, req.logprob, req.kv
    extra: dict[str, Any] = {FORMAT_KEY: FORMAT}
    for cls, values in attrs.items():
        if cls == "SamplingParams":
            continue
        for name, f in TABLES[cls].items():
            if f.disposition == CARRIED and f.codec != "record" and name in values:
                value = values[name]
                if name == "component_evicted_seqlens":
                    value = {ComponentType(c).name: int(n) for c, n in value.items()}
                extra[f"sglang.{cls}.{name}"] = _encode(f.codec, value, f"{cls}.{name}", path)
    outputs = {}
    if req.return_logprob:
        outputs["output_logprobs"] = _f32(lp.output_token_logprobs_val, "ReqLogprob.output_token_logprobs_val", path)
        if lp.top_logprobs_num > 0:
            outputs["top_logprob_values"] = _f32(lp.output_top_logprobs_val, "ReqLogprob.output_top_logprobs_val", path)
            outputs["top_logprob_ids"] = np.asarray(lp.output_top_logprobs_idx, dtype=np.int64).astype(np.int32)
    stop_strs = sp.stop_strs if isinstance(sp.stop_strs, list) else ([sp.stop_strs] if sp.stop_strs else [])
    record = RequestRecord(
        rid=req.rid,
        prompt_ids=np.asarray(req.origin_input_ids, dtype=np.int64).astype(np.int32),
        output_ids=np.asarray(req.output_ids, dtype=np.int64).astype(np.int32),
        state_position=int(kv.kv_committed_len),
        sampling=_sampling_to_record(sp, path),
        max_new_tokens=sp.max_new_tokens,
        min_new_tokens=int(sp.min_new_tokens or 0),
        stop_strings=tuple(stop_strs),
        stop_token_ids=tuple(sorted(sp.stop_token_ids or ())),
        ignore_eos=bool(sp.ignore_eos),
        streamed_tokens=int(req.send_token_offset),
        streamed_text_chars=len(req.decoded_text or ""),
        reasoning_tokens=int(req.reasoning_tokens),
        reasoning_finished=bool(req._is_reasoning_over),
        rng_state=None,  # SGLang 0.5.23 has no per-request generator (docs/sglang.md)
        extra=extra,
        **outputs,
    )
    if any(int(x) != int(y) for x, y in zip(record.prompt_ids, req.origin_input_ids)) or any(int(x) != int(y) for x, y in zip(record.output_ids, req.output_ids)):
        raise UnsupportedRequestError(path, "Req.origin_input_ids", "token ids < 2**31", "larger ids")
    swa_start = int(kv.get_evicted_seqlen(ComponentType.SWA))
    record.validate(path)
    return record, swa_start


def snapshot_req(
    path: str | os.PathLike[str],
    req,
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity,
    **export_kwargs,
) -> CommitInfo:
    """Write a live SGLang ``Req`` (its slots, from ``req.kv``, and its record) to ``path``.

    Every refusal (:class:`UnsupportedRequestError`, naming the field) comes before
    anything is written; the source pools and the request are only read. Free the
    source slots after this returns (the file is durable by then), never before.
    """
    return _export_req(path, req, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                       identity=identity, **export_kwargs)


def _export_req(path, req, *, req_to_token_pool, token_to_kv_pool_allocator, identity: Identity, extra=None,
                **export_kwargs) -> CommitInfo:
    """:func:`snapshot_req`, with ``extra`` record entries (the retraction's counters)."""
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

    key = grammar_backend.get_request_grammar_key(key, input_ids=input_ids, thinking_budget=None)
    value, _ = grammar_backend.get_cached_or_future_value(key, require_reasoning)
    if isinstance(value, Future):
        value = value.result()
        if not isinstance(value, InvalidGrammarObject):
            grammar_backend.set_cache(key, value.copy())
    if value is None or isinstance(value, InvalidGrammarObject):
        raise HsnapError(path, f"request.sampling.{_GRAMMAR_FIELD.get(key[0], key[0])}", "a grammar the target backend compiles", getattr(value, "error_message", None))
    for i, tok in enumerate(output_ids):
        try:
            value.accept_token(int(tok))
        except ValueError as e:
            raise HsnapError(path, f"request.output_ids[{i}]", "a token the grammar accepts", f"{int(tok)} ({str(e).splitlines()[0]})") from None
    return key, value


def _carried_extra(record: RequestRecord, cls: str, path) -> dict[str, Any]:
    out = {}
    for name, f in TABLES[cls].items():
        if f.disposition == CARRIED and f.codec != "record":
            key = f"sglang.{cls}.{name}"
            if key in record.extra:
                out[name] = _decode(f.codec, record.extra[key])
    return out


def _open_record(path, rank: int | None):
    from .restore import _open_rank

    snap, snapset = _open_rank(path, rank)
    try:
        return snap.record(), snap.path
    finally:
        (snapset or snap).close()


def resume_req(
    path: str | os.PathLike[str],
    *,
    req_to_token_pool,
    token_to_kv_pool_allocator,
    identity: Identity | None,
    tokenizer=None,
    grammar_backend=None,
    loaded_lora_ids: Iterable[str] | None = None,
    tree_cache=None,
    rank: int | None = None,
    req_kwargs: Mapping[str, Any] | None = None,
    **restore_kwargs,
):
    """Restore a snapshot written by :func:`snapshot_req` into fresh slots and return a
    live SGLang ``Req`` built by SGLang's constructor, ``req.kv`` on those slots.

    Refused before the pools are touched: a snapshot not written from a ``Req``, a
    ``lora_id`` not in ``loaded_lora_ids``, a grammar request without a
    ``grammar_backend`` (or whose output the grammar rejects), a target with Mamba
    ping-pong track buffers but no free slots for them, and everything
    :func:`hsnap_io.restore_request` refuses.
    """
    import_sglang()
    from sglang.srt.managers.schedule_batch import Req

    from .restore import pool_lock, restore_request

    if rank is None and identity is not None:
        rank = identity.tp_rank
    record, fpath = _open_record(path, rank)
    if record.extra.get(FORMAT_KEY) != FORMAT:
        raise IncompatibleSnapshotError(fpath, [(f"request.extra.{FORMAT_KEY}", FORMAT, record.extra.get(FORMAT_KEY))])
    rq = _carried_extra(record, "Req", fpath)
    kvx = _carried_extra(record, "ReqKvInfo", fpath)
    lpx = _carried_extra(record, "ReqLogprob", fpath)
    sp = _sampling_from_record(record.sampling, fpath)
    lora = rq.get("lora_id")
    if lora is not None and (loaded_lora_ids is None or lora not in set(loaded_lora_ids)):
        raise IncompatibleSnapshotError(fpath, [("request.extra.sglang.Req.lora_id", f"an adapter the target has loaded {sorted(loaded_lora_ids or ())}", lora)])
    tracking = int(req_to_token_pool.mamba_initial_tracking_slots) if getattr(req_to_token_pool, "enable_mamba_extra_buffer", False) else 0
    key = grammar_key(sp)
    grammar = None
    if key is not None:
        if grammar_backend is None:
            raise HsnapError(fpath, f"request.sampling.{_GRAMMAR_FIELD[key[0]]}", "a grammar_backend to re-derive the matcher", None)
        key, grammar = replay_grammar(grammar_backend, key, record.output_ids, require_reasoning=bool(rq.get("require_reasoning")), input_ids=array("q", record.prompt_ids.tolist()), path=fpath)

    # the Req is built before the pools are touched, so a failure building it leaves them as they were
    prompt = array("q", record.prompt_ids.tolist())
    req = Req(
        record.rid,
        "",  # origin_input_text: the constructor does not keep it
        prompt,
        sp,
        return_logprob=bool(rq.get("return_logprob")),
        top_logprobs_num=int(lpx.get("top_logprobs_num") or 0),
        token_ids_logprob=lpx.get("token_ids_logprob"),
        sampling_logprobs_mode=rq.get("sampling_logprobs_mode", "selected"),
        return_flat_raw_top_logprobs=bool(rq.get("return_flat_raw_top_logprobs")),
        stream=bool(rq.get("stream")),
        lora_id=lora,
        require_reasoning=bool(rq.get("require_reasoning")),
        eos_token_ids=rq.get("eos_token_ids"),
        vocab_size=rq.get("vocab_size"),
        priority=rq.get("priority"),
        routing_key=rq.get("routing_key"),
        cache_salt=rq.get("cache_salt"),
        **dict(req_kwargs or {}),
    )
    for name, value in rq.items():  # after the constructor: extra_key is stored, not re-concatenated
        setattr(req, name, value)
    req.output_ids = array("q", record.output_ids.tolist())
    req.send_token_offset = record.streamed_tokens
    req.reasoning_tokens = record.reasoning_tokens
    req._is_reasoning_over = record.reasoning_finished
    req.tokenizer = tokenizer
    for name, value in lpx.items():
        setattr(req.logprob, name, value)
    if req.return_logprob:
        req.logprob.output_token_logprobs_val = [float(x) for x in record.output_logprobs]
        if record.top_logprob_values is not None:
            req.logprob.output_top_logprobs_val = [[float(x) for x in row] for row in record.top_logprob_values]
            req.logprob.output_top_logprobs_idx = [[int(x) for x in row] for row in record.top_logprob_ids]
    if req.surr_offset is not None and "cur_decode_ids_len" in rq:
        req.surr_and_decode_ids = req.origin_input_ids_unpadded[req.surr_offset :] + req.output_ids[: rq["cur_decode_ids_len"]]
    with pool_lock(req_to_token_pool):  # capacity check, restore and track slots: one step for other allocators
        if tracking and req_to_token_pool.mamba_allocator.available_size() < 1 + tracking:
            free = req_to_token_pool.mamba_allocator.available_size()
            raise CapacityError(fpath, "target pools", detail=f"does not fit: mamba slots (working + {tracking} ping-pong track): need {1 + tracking}, free {free}")
        restored = restore_request(path, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator, identity=identity, rank=rank, **restore_kwargs)
        bind_restored(req, restored, kvx, tree_cache)
        if tracking:
            # fresh radix-tracking slots, as HybridReqToTokenPool.alloc gives a new request: no tracked
            # state yet (mamba_last_track_seqlen None), so nothing stale reaches a tree
            req_to_token_pool._alloc_ping_pong_buffer(req)
            req_to_token_pool.req_index_to_mamba_ping_pong_track_buffer_mapping[req.kv.req_pool_idx] = req.kv.mamba_ping_pong_track_buffer
    if grammar is not None:
        req.grammar_key, req.grammar = key, grammar
    req.hsnap_restored = restored  # bytes uploaded, snapshot id, numerics differences
    return req


def bind_restored(req, restored, kvx: Mapping[str, Any], tree_cache=None) -> None:
    """Point ``req.kv`` at the slots of ``restored`` (a :class:`RestoredRequest`) and
    leave nothing pending that would overwrite the restored state."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    kv = req.kv
    kv.req_pool_idx = restored.req_pool_idx
    kv.kv_committed_len = kv.kv_allocated_len = restored.state_position
    kv.cache_protected_len = kv.cache_inserted_len = 0
    kv.swa_evict_floor = int(kvx.get("swa_evict_floor", 0))
    kv.component_evicted_seqlens = {ComponentType[c]: int(n) for c, n in (kvx.get("component_evicted_seqlens") or {}).items()}
    kv.retraction_backup = None
    if restored.mamba_pool_idx is not None:
        kv.mamba_pool_idx = torch.tensor(restored.mamba_pool_idx, dtype=torch.int64)  # 0-d, as SGLang's alloc
    kv.mamba_needs_clear = False  # sglang#32995: a set flag zeroes the restored state
    kv.mamba_cow_src_index = None  # a pending COW would overwrite it with a tree copy
    req.refresh_fill_ids()
    req.extend_end = restored.state_position
    req.prefix_len = 0
    req.lock = None
    if tree_cache is not None:
        req.last_node = req.last_host_node = req.best_match_node = tree_cache.root_node_handle(req.extra_key)


def carried_kv(record: RequestRecord, path=None) -> dict[str, Any]:
    """The carried ``ReqKvInfo`` values of a record written by :func:`snapshot_req`."""
    return _carried_extra(record, "ReqKvInfo", path)


# ----------------------------------------------------------------------------- docs

DOC_BEGIN = "<!-- BEGIN FIELD TABLE (generated by `python -m hsnap_io.sglang --docs`; do not edit) -->"
DOC_END = "<!-- END FIELD TABLE -->"


def render_table() -> str:
    """The field table as Markdown, one section per class (docs/sglang.md)."""
    lines = [DOC_BEGIN]
    for cls, table in TABLES.items():
        counts = {d: sum(f.disposition == d for f in table.values()) for d in (CARRIED, REDERIVED, REFUSED, IRRELEVANT)}
        lines += ["", f"### `{cls}` ({', '.join(f'{n} {d}' for d, n in counts.items())})", "", "| attribute | disposition | why |", "|---|---|---|"]
        for name in sorted(table):
            f = table[name]
            disp = f.disposition
            if f.disposition == REFUSED:
                disp = f"refused unless `{f.neutral}`"
            elif f.disposition == CARRIED and f.codec != "record":
                disp = f"carried (`{'sampling' if cls == 'SamplingParams' else f'extra.sglang.{cls}.{name}'}`)"
            lines.append(f"| `{name}` | {disp} | {f.why.replace('|', '/')} |")
    lines.append(DOC_END)
    return "\n".join(lines) + "\n"


def write_docs(path: str) -> None:
    """Replace the generated part of ``path`` (between the markers) with :func:`render_table`."""
    text = open(path, encoding="utf-8").read()
    head, _, rest = text.partition(DOC_BEGIN)
    _, _, tail = rest.partition(DOC_END + "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + render_table() + tail)


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


__all__ = [
    "snapshot_req",
    "resume_req",
    "req_record",
    "check_req",
    "classified_view",
    "unclassified",
    "grammar_key",
    "replay_grammar",
    "UnsupportedRequestError",
    "TABLES",
    "FIELDS",
]

FIELDS = TABLES

if __name__ == "__main__":  # python -m hsnap_io.sglang --docs [docs/sglang.md]
    import sys

    if sys.argv[1:2] == ["--docs"]:
        write_docs(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "docs", "sglang.md"))
