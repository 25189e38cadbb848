"""SGLang's own request object as the unit of hand-off.

    from hsnap_sglang.req import snapshot_req, resume_req
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

import copy
import dataclasses
import json
import math
import os
import re
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from hsnap_format import CapacityError, CommitInfo, HsnapError, HsnapIOError, Identity, IncompatibleSnapshotError, MalformedHeaderError, RequestRecord

from hsnap_format.errors import Phrase, require_type

from hsnap_io._sglang_env import import_sglang
from hsnap_io.export import export_request

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
    codec: str | None = None  # carried: record | sampling | plain | ints | intset | json
    ok: Callable[[Any], bool] | None = None  # refused: the values that are accepted
    neutral: str = ""  # refused: the accepted value, in words (docs)
    # carried outside the typed record: the stored value (after the codec) -> the typed
    # value resume sets, or _Bad. The one place a record's extras are checked (decode_carried).
    value: Callable[[Any, "_Bounds"], Any] | None = None


def C(why: str, codec: str = "plain", value=None) -> Field:
    if codec not in ("record", "sampling") and value is None:  # sampling: SamplingParams' own types and verify()
        raise AssertionError(f"carried field without a value check: {why}")
    return Field(CARRIED, why, codec, value=value)


def D(why: str) -> Field:
    return Field(REDERIVED, why)


def R(why: str, ok=_is_none, neutral: str = "None") -> Field:
    return Field(REFUSED, why, ok=ok, neutral=neutral)


def I(why: str) -> Field:  # noqa: E743
    return Field(IRRELEVANT, why)


# ----------------------------------------------------------------------------- value checks
# Each carried value outside the typed record is checked, from what the file stores to the
# typed value resume sets, by one of these (Field.value): a type, a range (in terms of the
# record's own counts, _Bounds), a bounded JSON text. They raise _Bad; decode_carried names
# the file and the record field.

_MAX_PLAIN = 2**53 - 1  # a JSON number in the header (canonical JSON)
TOKEN_ID_LIMIT = 2**31  # token ids are stored as int32
_MAX_JSON_DEPTH = 32  # nesting of a JSON text carried in a string (kv_hints payloads, input logprobs)
_MAX_LIST = 1 << 20


class _Bad(Exception):
    def __init__(self, expected, found) -> None:
        super().__init__(expected)
        self.expected, self.found = expected, found


@dataclass(frozen=True)
class _Bounds:
    """What a carried value is checked against: the record's counts and the carried vocab."""

    prompt: int
    output: int
    position: int
    swa_start: int
    vocab: int | None

    @property
    def token_hi(self) -> int:  # ids are < this
        return self.vocab if self.vocab is not None and 0 < self.vocab <= TOKEN_ID_LIMIT else TOKEN_ID_LIMIT


def _limit(x, b: _Bounds) -> int:
    return x(b) if callable(x) else x


def _bool(v, b):
    if type(v) is bool:
        return v
    raise _Bad(Phrase("true or false"), v)


def _int(lo=0, hi=_MAX_PLAIN, none=False):
    def check(v, b):
        if v is None and none:
            return None
        lo_, hi_ = _limit(lo, b), _limit(hi, b)
        if type(v) is not int or not lo_ <= v <= hi_:
            raise _Bad(Phrase(f"an integer in {lo_}..{hi_}" + (" or null" if none else "")), v)
        return v

    return check


def _str(none=True):
    def check(v, b):
        if v is None and none or type(v) is str:
            return v
        raise _Bad(Phrase("a string" + (" or null" if none else "")), v)

    return check


def _choice(values: Callable[[], tuple]):
    def check(v, b):
        allowed = values()
        if type(v) is str and v in allowed:
            return v
        raise _Bad(Phrase(f"one of {list(allowed)}"), v)

    return check


def _ids(hi=lambda b: b.token_hi, max_len=_MAX_LIST, none=True):
    """A list of token ids in 0..hi-1 (at most ``max_len``)."""

    def check(v, b):
        if v is None and none:
            return None
        hi_, n = _limit(hi, b), _limit(max_len, b)
        if type(v) is not list or len(v) > n:
            raise _Bad(Phrase(f"a list of at most {n} token ids"), v if type(v) is not list else Phrase(f"{len(v)} entries"))
        for i, t in enumerate(v):
            if type(t) is not int or not 0 <= t < hi_:
                raise _Bad(Phrase(f"token ids in 0..{hi_ - 1} (entry {i})"), t)
        return list(v)

    return check


def _counts(v, b):
    """A histogram: non-negative integers."""
    if type(v) is not list or len(v) > _MAX_LIST or not all(type(x) is int and 0 <= x <= _MAX_PLAIN for x in v):
        raise _Bad(Phrase("a list of non-negative integers"), v)
    return list(v)


def _nested(depth: int, leaf: str):
    """Null, or a list whose entries are null, a ``leaf`` (``number``: int or float; ``int``)
    or, ``depth`` > 1, such a list one level down (SGLang's logprob lists)."""
    kinds = (int, float) if leaf == "number" else (int,)

    def ok(x, d) -> bool:
        if x is None or (type(x) in kinds):
            return True
        return d > 1 and type(x) is list and all(ok(y, d - 1) for y in x)

    def check(v, b):
        if v is None or type(v) is list and all(ok(x, depth) for x in v):
            return v
        raise _Bad(Phrase(f"null or lists (nested at most {depth} deep) of {leaf}s or nulls"), v)

    return check


def _component_type():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType


def _evicted(v, b):
    """``{ComponentType name: cursor}``: names SGLang's ComponentType knows, cursors within
    the committed positions, the SWA cursor the snapshot's own swa_start (what was written)."""
    ct = _component_type()
    if type(v) is not dict:
        raise _Bad(Phrase("an object {component name: evicted length}"), v)
    out = {}
    for name, n in v.items():
        if name not in ct.__members__:
            raise _Bad(Phrase(f"component names in {list(ct.__members__)}"), name)
        if type(n) is not int or not 0 <= n <= b.position:
            raise _Bad(Phrase(f"{name}: an evicted length in 0..{b.position}"), n)
        out[ct[name]] = n
    swa = out.get(ct.SWA, 0)
    if swa != b.swa_start:
        raise _Bad(Phrase(f"SWA = request.swa_start ({b.swa_start})"), swa)
    others = {c.name: n for c, n in out.items() if c != ct.SWA and n}
    if others:
        raise _Bad(Phrase("no evicted positions outside SWA (hsnap restores SWA eviction only)"), others)
    return out


def _kv_hints(v, b):
    """SGLang's own decoder of the envelope (decode_kv_hints_envelope)."""
    if v is None:
        return None
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    try:
        return decode_kv_hints_envelope(v)
    except (ValueError, TypeError) as e:
        raise _Bad(Phrase("a KvHintsEnvelope (protocol_version, message_id, actions)"), Phrase(_short(str(e), 160))) from None


def _sampling_logprobs_modes() -> tuple:
    import typing

    from sglang.srt.managers.schedule_batch import SamplingLogprobsMode

    return typing.get_args(SamplingLogprobsMode)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def _json_text(text, max_depth: int = _MAX_JSON_DEPTH):
    """A JSON text carried in a string, parsed with its nesting bounded first (the parser
    recurses: 400,000 nested brackets would be a RecursionError, not a refusal)."""
    if type(text) is not str:
        raise _Bad(Phrase("a JSON text (string)"), text)
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > max_depth:
            raise _Bad(Phrase(f"JSON nested at most {max_depth} deep"), Phrase(f"deeper than {max_depth}"))
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _Bad(Phrase("a JSON text"), Phrase(_short(f"{type(e).__name__}: {e}", 160))) from None


def _unpack(codec: str, stored):
    """The stored form of a carried extra -> the value its check takes."""
    if codec == "json":
        return _json_text(stored)
    if codec in ("ints", "intset") and stored is not None and type(stored) is not list:
        raise _Bad(Phrase("a list of integers or null"), stored)
    return stored


_ANY_INT = _int(-_MAX_PLAIN, _MAX_PLAIN, none=True)
_COUNT = _int(0, _MAX_PLAIN)
_OUT = _int(0, lambda b: b.output)  # an offset into the output ids
_OPT_PROMPT = _int(0, lambda b: b.prompt, none=True)  # an offset into the prompt, or unset

_SCHED = "scheduler bookkeeping of the current process; the target scheduler sets its own"
_CACHE = "prefix-cache (radix/HiCache) bookkeeping; the restored request owns all its slots and starts at the tree root"
_PD = "PD-disaggregation transport state; finished before a request decodes"
_REBOOT = "PD disaggregation: the prefill server a retracted decoding request is re-bootstrapped from (Req.build_rebootstrap_payload)"
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
    "eos_token_ids": C("stop condition", "intset", _ids(hi=TOKEN_ID_LIMIT, max_len=4096)),
    "vocab_size": C("stop condition (out-of-vocab ids finish the request); every carried token id is below it", value=_int(1, TOKEN_ID_LIMIT, none=True)),
    "priority": C("scheduling priority the client asked for", value=_ANY_INT),
    "lora_id": C("adapter the request decodes with; resume refuses an adapter the target has not loaded", value=_str()),
    "extra_key": C("cache namespace (includes the lora id)", value=_str()),
    "cache_salt": C("cache namespace the client gave", value=_str()),
    "routing_key": C("routing hint the client gave", value=_str()),
    "stream": C("how the client receives output", value=_bool),
    "return_logprob": C("logprob option", value=_bool),
    "logprob_start_len": C("logprob option (-1..prompt length, as the scheduler checks it)", value=_int(-1, lambda b: b.prompt)),
    "logprob": C("the ReqLogprob object, field by field (see ReqLogprob)", "record"),
    "temp_scaled_logprobs": C("logprob option", value=_bool),
    "top_p_normalized_logprobs": C("logprob option", value=_bool),
    "sampling_logprobs_mode": C("logprob option (a SamplingLogprobsMode)", value=_choice(_sampling_logprobs_modes)),
    "return_flat_raw_top_logprobs": C("logprob option", value=_bool),
    "input_logprob_sent": C("whether input logprobs were already streamed", value=_bool),
    # streaming / detokenizer progress
    "send_token_offset": C("output ids already sent (record.streamed.tokens)", "record"),
    # an offset into surr_and_decode_ids (prompt[surr_offset:] + output_ids[:cur_decode_ids_len]), not into the
    # output: up to INIT_INCREMENTAL_DETOKENIZATION_OFFSET prompt tokens more (decode_carried checks the exact bound)
    "send_decode_id_offset": C("decode ids already sent to the detokenizer (an offset into surr_and_decode_ids)",
                               value=_int(0, lambda b: b.prompt + b.output)),
    "send_output_token_logprobs_offset": C("logprobs already sent", value=_OUT),
    "surr_offset": C("incremental detokenizer offset (into the prompt)", value=_OPT_PROMPT),
    "read_offset": C("incremental detokenizer offset (into the prompt, >= surr_offset)", value=_OPT_PROMPT),
    "decoded_text": C("incremental detokenizer text", value=_str(none=False)),
    "cur_decode_ids_len": C("incremental detokenizer progress (set by init_incremental_detokenize)", value=_OUT),
    "surr_and_decode_ids": D("origin_input_ids_unpadded[surr_offset:] + output_ids[:cur_decode_ids_len]"),
    # reasoning
    "require_reasoning": C("reasoning mode", value=_bool),
    "_is_reasoning_over": C("reasoning finished (record.streamed.reasoning_finished)", "record"),
    "reasoning_tokens": C("reasoning token count (record.streamed.reasoning_tokens)", "record"),
    "_think_end_match_len": C("partial match of the think-end sequence", value=_int(0, 1 << 16)),
    "_think_start_match_len": C("partial match of the think-start sequence", value=_int(0, 1 << 16)),
    "_think_end_matcher": D("built lazily from the think-end ids on the next update"),
    # grammar
    "grammar": D("a fresh matcher of the target's grammar backend, fed every output id"),
    "grammar_key": D("(kind, spec) from the carried SamplingParams grammar field"),
    "grammar_wait_ct": I(_SCHED),
    # reported to the client in meta_info
    "cached_tokens": C("reported to the client (meta_info.cached_tokens)", value=_COUNT),
    "cached_tokens_device": C("reported to the client", value=_COUNT),
    "cached_tokens_host": C("reported to the client", value=_COUNT),
    "cached_tokens_storage": C("reported to the client", value=_COUNT),
    "_cache_breakdown_computed": C("guards the cached-token breakdown above", value=_bool),
    "retraction_count": C("reported to the client", value=_COUNT),
    "retracted_stain": C("the request was retracted once (reported, affects scheduling)", value=_bool),
    "spec_verify_ct": C("reported to the client", value=_COUNT),
    "spec_num_correct_drafts": C("reported to the client", value=_COUNT),
    "spec_num_block_accept_tokens": C("reported to the client", value=_COUNT),
    "spec_num_cap_tokens": C("reported to the client", value=_COUNT),
    "spec_correct_drafts_histogram": C("reported to the client", "ints", _counts),
    "spec_cap_lens_histogram": C("reported to the client", "ints", _counts),
    "prefill_attempt_count": C("counts prefill attempts; preserved across retractions by SGLang too", value=_COUNT),
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
    "http_worker_ipc": D("the target's own tokenizer worker, given to resume_req(http_worker_ipc=...): with several tokenizer workers SGLang routes the stream by it, so resume refuses to guess (the source's names a socket of the source server)"),
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
    "kv_hints": C("KV hints the client (orchestrator) gave, like routing_key and cache_salt; SGLang's own envelope decoder checks them", "json", _kv_hints),
    "mm_image_tokens": I("multimodal counts (multimodal requests are refused)"),
    "mm_audio_tokens": I("multimodal counts (multimodal requests are refused)"),
    "mm_video_tokens": I("multimodal counts (multimodal requests are refused)"),
    "mm_token_counts_ready": I("multimodal counts (multimodal requests are refused)"),
    "bootstrap_host": C(_REBOOT, value=_str()),
    "bootstrap_port": C(_REBOOT, value=_int(0, 65535, none=True)),
    "bootstrap_room": C(_REBOOT + " (a 64-bit id: a JSON text)", "json", _int(0, 2**64 - 1, none=True)),
    "disagg_kv_sender": I(_PD),
    "routed_dp_rank": I(_PD),
    "disagg_prefill_dp_rank": C(_REBOOT, value=_int(0, 1 << 20, none=True)),
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
    "swa_evict_floor": C("prefill-aware SWA floor (0..committed positions); 0 after a restore that freed SWA slots below swa_start, whose rows the snapshot does not hold", value=_int(0, lambda b: b.position)),
    "component_evicted_seqlens": C("evicted cursors per component (ComponentType names); the SWA cursor is the snapshot's swa_start, set to the SWA slots the restore freed (swa_start in whole target pages)", "json", _evicted),
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
    "top_logprobs_num": C("logprob option (record.top_logprobs_k when k > 0)", value=_int(0, lambda b: b.token_hi)),
    "token_ids_logprob": C("logprob option (ids below vocab_size)", "ints", _ids()),
    "output_token_logprobs_val": C("selected-token logprobs (record.output_logprobs, float32)", "record"),
    "output_token_logprobs_idx": C("ids of the selected tokens (below vocab_size)", "ints", _ids(max_len=lambda b: b.output)),
    "output_top_logprobs_val": C("top-k logprobs (record.top_logprob_values, float32)", "record"),
    "output_top_logprobs_idx": C("top-k ids (record.top_logprob_ids)", "record"),
    "output_token_ids_logprobs_val": C("token-ids logprobs", "json", _nested(2, "number")),
    "output_token_ids_logprobs_idx": C("token-ids logprob ids", "json", _nested(2, "int")),
    "input_token_logprobs_val": C("input logprobs (sent with the first output)", "json", _nested(1, "number")),
    "input_token_logprobs_idx": C("input logprobs", "json", _nested(1, "int")),
    "input_top_logprobs_val": C("input logprobs", "json", _nested(2, "number")),
    "input_top_logprobs_idx": C("input logprobs", "json", _nested(2, "int")),
    "input_token_ids_logprobs_val": C("input logprobs", "json", _nested(2, "number")),
    "input_token_ids_logprobs_idx": C("input logprobs", "json", _nested(2, "int")),
    "input_top_logprobs_val_flat": R("flat numpy input logprobs (prefill-only scoring)"),
    "input_top_logprobs_idx_flat": R("flat numpy input logprobs (prefill-only scoring)"),
    "input_top_logprobs_flat_null_prefix": R("flat numpy input logprobs (prefill-only scoring)"),
}

_GRAMMAR = "grammar spec; the matcher is re-derived at resume (xgrammar)"
SAMPLING_FIELDS: dict[str, Field] = {
    **{
        k: C("sampling parameter", "sampling")
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
    "max_new_tokens": C("budget (record.stop.max_new_tokens)", "sampling"),
    "min_new_tokens": C("budget (record.stop.min_new_tokens)", "sampling"),
    "stop_strs": C("stop strings (record.stop.stop_strings)", "sampling"),
    "stop_token_ids": C("stop token ids (record.stop.stop_token_ids)", "sampling"),
    "ignore_eos": C("stop condition (record.stop.ignore_eos)", "sampling"),
    "json_schema": C(_GRAMMAR, "sampling"),
    "regex": C(_GRAMMAR, "sampling"),
    "ebnf": C(_GRAMMAR, "sampling"),
    "structural_tag": C(_GRAMMAR, "sampling"),
    "ebnf_full_assistant": C(_GRAMMAR, "sampling"),
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
    if hasattr(o, "__struct_fields__"):  # a msgspec struct (kv_hints): its builtins
        import msgspec

        return msgspec.to_builtins(o)
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


def decode_carried(record: RequestRecord, path, *, swa_start: int) -> dict[str, dict[str, Any]]:
    """Class -> {attribute: typed value} of every carried extra in ``record`` (keys
    ``sglang.<Class>.<attr>``), each checked by its table row's ``value`` against the
    record's own counts — the one place where a record's extras are checked, before
    anything is built or allocated. Refusals are :class:`MalformedHeaderError` naming
    ``request.extra.<key>``. Absent keys are left out (SGLang's constructor defaults)."""
    extra = record.extra
    bounds = _Bounds(len(record.prompt_ids), len(record.output_ids), int(record.state_position), int(swa_start), None)
    vocab = _carried_value(extra, "Req", "vocab_size", bounds, path)  # the bound of every carried token id
    bounds = dataclasses.replace(bounds, vocab=vocab if vocab is not _ABSENT else None)
    out: dict[str, dict[str, Any]] = {}
    for cls in ("Req", "ReqKvInfo", "ReqLogprob"):
        values = out[cls] = {}
        for name, f in TABLES[cls].items():
            if f.disposition == CARRIED and f.codec != "record":
                v = _carried_value(extra, cls, name, bounds, path)
                if v is not _ABSENT:
                    values[name] = v
    rq = out["Req"]
    if rq.get("surr_offset") is not None and rq.get("read_offset") is not None and rq["read_offset"] < rq["surr_offset"]:
        raise MalformedHeaderError(path, "request.extra.sglang.Req.read_offset", Phrase(f">= surr_offset ({rq['surr_offset']})"), rq["read_offset"])
    sent = rq.get("send_decode_id_offset")
    if sent is not None:  # within surr_and_decode_ids as resume re-derives it
        decode_ids = (len(record.prompt_ids) - rq["surr_offset"] + rq.get("cur_decode_ids_len", 0)) if rq.get("surr_offset") is not None else 0
        if sent > decode_ids:
            raise MalformedHeaderError(path, "request.extra.sglang.Req.send_decode_id_offset",
                                       Phrase(f"<= len(prompt[surr_offset:]) + cur_decode_ids_len ({decode_ids})"), sent)
    return out


_ABSENT = object()


def _carried_value(extra: Mapping[str, Any], cls: str, name: str, bounds: _Bounds, path):
    key = f"sglang.{cls}.{name}"
    if key not in extra:
        return _ABSENT
    f = TABLES[cls][name]
    try:
        v = f.value(_unpack(f.codec, extra[key]), bounds)
    except _Bad as e:
        raise MalformedHeaderError(path, f"request.extra.{key}", e.expected, e.found) from None
    return set(v) if f.codec == "intset" and v is not None else v


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
    """The record's ``sampling`` map -> SamplingParams, each field converted to its declared
    type (JSON texts bounded first); the values are checked afterwards, on the rebuilt Req,
    by :func:`_check_request` (SGLang's own verify)."""
    import_sglang()
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    hints = _struct_types(SamplingParams)
    fields = SamplingParams.__struct_fields__
    encoded = d.get("__json__", [])
    if type(encoded) is not list or not all(type(n) is str and n in fields for n in encoded):
        raise MalformedHeaderError(path, "request.sampling.__json__", Phrase("a list of SamplingParams field names"), encoded)
    kwargs = {}
    for name in fields:
        if name not in d:
            raise MalformedHeaderError(path, f"request.sampling.{name}", "present (written by snapshot_req)", Phrase("missing"))
        v = d[name]
        try:
            kwargs[name] = msgspec.convert(_json_text(v) if name in encoded else v, hints[name])
        except _Bad as e:
            raise MalformedHeaderError(path, f"request.sampling.{name}", e.expected, e.found) from None
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise MalformedHeaderError(path, f"request.sampling.{name}", Phrase(_type_text(hints[name])), Phrase(f"{_short(v)} ({e})")) from None
    try:  # is_normalized=True makes __post_init__ keep the normalized values as they are
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:  # __post_init__ of a record that says it is not normalized
        raise MalformedHeaderError(path, "request.sampling", Phrase("SamplingParams SGLang builds"), Phrase(_short(str(e), 160))) from None


def _type_text(hint) -> str:
    return str(hint).replace("typing.", "")


def _struct_types(cls) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _check_stop_agrees(record: RequestRecord, sp, path) -> None:
    """The record's typed ``stop`` fields and the SamplingParams carried in ``sampling``
    describe the same budget and stop conditions (snapshot_req writes both from one object)."""
    stop_strs = sp.stop_strs if isinstance(sp.stop_strs, list) else ([sp.stop_strs] if sp.stop_strs else [])
    pairs = [
        ("max_new_tokens", record.max_new_tokens, sp.max_new_tokens),
        ("min_new_tokens", record.min_new_tokens, sp.min_new_tokens),
        ("ignore_eos", record.ignore_eos, sp.ignore_eos),
        ("stop_token_ids", sorted(record.stop_token_ids), sorted(sp.stop_token_ids or ())),
        ("stop_strings", list(record.stop_strings), list(stop_strs)),
    ]
    for name, typed, carried in pairs:
        if typed != carried:
            raise MalformedHeaderError(path, f"request.stop.{name}", Phrase(f"the value of request.sampling ({_short(carried)})"), typed)


# ----------------------------------------------------------------------------- checks shared by snapshot and resume


def _check_request(req, tokenizer, refuse) -> None:
    """What a request must pass to continue: hsnap's refusals of state it cannot carry (the
    table) and every check SGLang runs on a fresh request (SamplingParams.normalize and
    verify(vocab_size) as its tokenizer manager runs them, token ids below vocab_size, one
    selected logprob per output token). Runs on the source ``Req`` before a snapshot is
    written and on the rebuilt ``Req`` before a resume allocates. ``refuse(field,
    expected, found, detail=None)`` makes the exception; fields are ``Class.attr``."""
    attrs = sglang_attributes(req)
    for cls, values in attrs.items():
        for name, f in TABLES[cls].items():
            if f.disposition == REFUSED and name in values and not f.ok(values[name]):
                raise refuse(f"{cls}.{name}", f.neutral, _short(values[name]), detail=f.why)
    vocab = req.vocab_size
    if type(vocab) is not int or not 1 <= vocab <= TOKEN_ID_LIMIT:
        raise refuse("Req.vocab_size", Phrase(f"the model's vocabulary size, 1..{TOKEN_ID_LIMIT}"), vocab)
    n_out = len(req.output_ids)
    checks = [
        ("Req.output_ids", "at least one output token (a decoding request)", n_out, n_out >= 1),
        ("Req.origin_input_ids_unpadded", "equal to origin_input_ids (no multimodal padding)", "different", list(req.origin_input_ids_unpadded) == list(req.origin_input_ids)),
        ("Req.extra_key", f"ending with lora_id {req.lora_id!r}", req.extra_key, req.lora_id is None or (req.extra_key or "").endswith(req.lora_id)),
    ]
    for fld, exp, found, ok in checks:
        if not ok:
            raise refuse(fld, exp, found)
    _check_ids(req.origin_input_ids, "Req.origin_input_ids", vocab, refuse)
    _check_ids(req.output_ids, "Req.output_ids", vocab, refuse)
    _check_sampling(req.sampling_params, vocab, tokenizer, refuse)
    lp = req.logprob
    if req.return_logprob:
        if lp.output_token_logprobs_val is None or len(lp.output_token_logprobs_val) != n_out:
            raise refuse("ReqLogprob.output_token_logprobs_val", f"{n_out} entries (one per output token)", None if lp.output_token_logprobs_val is None else len(lp.output_token_logprobs_val))
        k = lp.top_logprobs_num
        if k > 0:
            for name in ("output_top_logprobs_val", "output_top_logprobs_idx"):
                rows = getattr(lp, name)
                if rows is None or len(rows) != n_out or any(len(r) != k for r in rows):
                    raise refuse(f"ReqLogprob.{name}", f"{n_out} rows of {k}", _short(rows))
            _check_ids(lp.output_top_logprobs_idx, "ReqLogprob.output_top_logprobs_idx", vocab, refuse)


def _check_ids(values, field: str, vocab: int, refuse) -> None:
    """Token ids in 0..vocab-1, checked before any cast (an id of 2**31 must be reported as
    itself, with its index, not as the int32 it would wrap to)."""
    expected = Phrase(f"token ids in 0..{vocab - 1} (vocab_size {vocab})")
    a = np.asarray(values)
    if a.size and a.dtype.kind in "iu":
        bad = np.flatnonzero((a < 0) | (a >= vocab))
        if bad.size:
            at = np.unravel_index(int(bad[0]), a.shape)
            raise refuse(field + "".join(f"[{int(i)}]" for i in at), expected, int(a[at]))
    elif a.size:  # ints past int64, floats, other objects: one by one
        for at in np.ndindex(a.shape):
            t = a[at]
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                found = (int(t) if int(t).bit_length() <= 256 else Phrase(f"an integer of {int(t).bit_length()} bits")) if isinstance(t, (int, np.integer)) else _short(t)
                raise refuse(field + "".join(f"[{int(i)}]" for i in at), expected, found)


_INT64 = (-(2**63), 2**63 - 1)


def _check_sampling(sp, vocab: int, tokenizer, refuse) -> None:
    """SamplingParams as SGLang's tokenizer manager admits a fresh request: normalized,
    ``normalize(tokenizer)`` raises nothing (stop counts and lengths, the tokenizer the
    stop conditions need), ``verify(vocab_size)`` raises nothing; every integer fits int64."""
    from sglang.srt.sampling.sampling_params import raise_if_tokenizer_required
    from sglang.srt.sampling.watermarking.core import normalize_watermark_request

    if sp.is_normalized is not True:
        raise refuse("SamplingParams.is_normalized", True, sp.is_normalized, detail="SamplingParams.normalize has run (SGLang's tokenizer manager runs it on every request)")
    for name in sp.__struct_fields__:
        v = getattr(sp, name)
        if type(v) is int and not _INT64[0] <= v <= _INT64[1]:
            raise refuse(f"SamplingParams.{name}", Phrase("an integer that fits int64"), v)
    if tokenizer is None:  # SGLang's own rule: these need tokenizer.decode / its eos id
        for name, args in (("stop_strs", (sp.stop_strs, None, 0)), ("stop_regex_strs", (None, sp.stop_regex_strs, 0)), ("min_new_tokens", (None, None, sp.min_new_tokens))):
            try:
                raise_if_tokenizer_required(None, *args)
            except ValueError:
                raise refuse("Req.tokenizer", Phrase(f"a tokenizer (SamplingParams.{name} needs one)"), None) from None
    for step, run in (("normalize", lambda p: p.normalize(tokenizer)), ("verify", lambda p: p.verify(vocab)),
                      ("watermark", lambda p: normalize_watermark_request(p.watermark))):
        probe = copy.copy(sp)  # normalize() rewrites fields: checked on a copy, the carried values stay
        try:
            run(probe)
        except (ValueError, TypeError, OverflowError) as e:
            raise refuse(_sampling_field(str(e)), Phrase(f"a value SGLang's SamplingParams.{step} accepts"), Phrase(_short(str(e), 160))) from None


# SGLang refusals that do not start with the field they are about
_SAMPLING_MESSAGES = {"reasoning end token": "custom_params", "stop strings are allowed": "stop_strs", "stop_regex": "stop_regex_strs",
                      "watermark": "watermark"}


def _sampling_field(message: str) -> str:
    """The SamplingParams field an SGLang refusal is about ("top_p must be in (0, 1]...")."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    first = re.match(r"[A-Za-z_]*", message).group()
    if first in SamplingParams.__struct_fields__:
        return f"SamplingParams.{first}"
    return next((f"SamplingParams.{name}" for text, name in _SAMPLING_MESSAGES.items() if text in message), "SamplingParams")


# ----------------------------------------------------------------------------- snapshot


def check_req(req, *, path=None) -> None:
    """Refuse a request hsnap cannot carry, naming the field. Reads only."""
    missing = unclassified(req)
    if missing:
        raise UnsupportedRequestError(path, missing[0], f"an attribute classified in hsnap_sglang.req.TABLES (SGLang {ENGINE_VERSION})", "unclassified")

    def refuse(field, expected, found, detail=None):
        return UnsupportedRequestError(path, field, expected, found, detail=detail)

    _check_request(req, req.tokenizer, refuse)
    kv = req.kv
    evicted_outside_swa = {_component_type()(c).name: n for c, n in kv.component_evicted_seqlens.items() if n and _component_type()(c) != _component_type().SWA}
    checks = [
        ("ReqKvInfo.req_pool_idx", "a req_to_token row (the request holds KV)", kv.req_pool_idx, kv.req_pool_idx is not None),
        ("ReqKvInfo.kv_committed_len", f"seqlen - 1 = {req.seqlen - 1} (a committed decode boundary)", kv.kv_committed_len, kv.kv_committed_len == req.seqlen - 1),
        (
            "ReqKvInfo.kv_allocated_len",
            f"kv_committed_len = {kv.kv_committed_len} (no speculative draft tokens or decode step in flight)",
            kv.kv_allocated_len,
            kv.kv_allocated_len == kv.kv_committed_len,
        ),
        ("ReqKvInfo.component_evicted_seqlens", "no evicted positions outside SWA (hsnap restores SWA eviction only)", evicted_outside_swa, not evicted_outside_swa),
    ]
    for fld, exp, found, ok in checks:
        if not ok:
            raise UnsupportedRequestError(path, fld, exp, found)


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

    check_req(req, path=path)  # token ids in 0..vocab_size-1 (<= 2**31) before the int32 casts below
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

    field = f"request.sampling.{_GRAMMAR_FIELD.get(key[0], key[0])}"
    try:  # the backend compiles text from the file: whatever it raises is a refusal of that text
        key = grammar_backend.get_request_grammar_key(key, input_ids=input_ids, thinking_budget=None)
        value, _ = grammar_backend.get_cached_or_future_value(key, require_reasoning)
        if isinstance(value, Future):
            value = value.result()
            if not isinstance(value, InvalidGrammarObject):
                grammar_backend.set_cache(key, value.copy())
    except Exception as e:  # noqa: BLE001 - a library boundary, hostile input
        raise HsnapError(path, field, "a grammar the target backend compiles", Phrase(_short(f"{type(e).__name__}: {e}", 160))) from None
    if value is None or isinstance(value, InvalidGrammarObject):
        raise HsnapError(path, field, "a grammar the target backend compiles", getattr(value, "error_message", None))
    for i, tok in enumerate(output_ids):
        try:
            value.accept_token(int(tok))
        except Exception as e:  # noqa: BLE001 - ValueError: not accepted; anything else from the matcher alike
            raise HsnapError(path, f"request.output_ids[{i}]", "a token the grammar accepts", f"{int(tok)} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return key, value


# Record fields of a Req attribute that is not carried in record.extra (refusal messages at resume)
_RECORD_FIELDS = {
    "Req.origin_input_ids": "request.prompt_ids",
    "Req.origin_input_ids_unpadded": "request.prompt_ids",
    "Req.output_ids": "request.output_ids",
    "ReqLogprob.output_token_logprobs_val": "request.output_logprobs",
    "ReqLogprob.output_top_logprobs_val": "request.top_logprob_values",
    "ReqLogprob.output_top_logprobs_idx": "request.top_logprob_ids",
    "SamplingParams": "request.sampling",
}


def _record_field(field: str) -> str:
    """``Class.attr[i]`` of the rebuilt Req -> where the record holds it."""
    base, bracket, rest = field.partition("[")
    cls, _, attr = base.partition(".")
    where = _RECORD_FIELDS.get(base) or (f"request.sampling.{attr}" if cls == "SamplingParams" else f"request.extra.sglang.{base}")
    return where + bracket + rest


def _read_record(snap, path) -> RequestRecord:
    """The record of the open file, every section hashed as it is read (what is returned is
    what was hashed), and its cross-field rules."""
    try:
        record = snap.record()
    except OSError as e:
        raise HsnapIOError(snap.path, "read", e) from None
    record.validate(snap.path)
    return record


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


def _target_worker_ipc(path, given, req_kwargs: dict):
    """The target's tokenizer worker that streams the resumed request (item: losing it
    silently stops the client's stream). Required where SGLang routes by it."""
    ipc = given if given is not None else req_kwargs.pop("http_worker_ipc", None)
    req_kwargs.pop("http_worker_ipc", None)
    require_type(path, "http_worker_ipc", ipc, str, optional=True)
    workers = _tokenizer_workers()
    if ipc is None and workers is not None and workers > 1:
        raise HsnapError(path, "Req.http_worker_ipc", Phrase("the target's tokenizer worker: resume_req(http_worker_ipc=...)"), None,
                         detail=f"this server runs {workers} tokenizer workers and routes each stream by it")
    return ipc


# Req constructor arguments resume passes from the carried values (the rest are set after it)
_CONSTRUCTOR_ARGS = ("return_logprob", "sampling_logprobs_mode", "return_flat_raw_top_logprobs", "stream", "lora_id", "require_reasoning",
                     "eos_token_ids", "vocab_size", "priority", "routing_key", "cache_salt", "bootstrap_host", "bootstrap_port",
                     "bootstrap_room", "disagg_prefill_dp_rank", "kv_hints")


def _rebuild_req(record: RequestRecord, carried, sp, *, tokenizer, http_worker_ipc, req_kwargs):
    """A Req from SGLang's constructor holding the record's request (no slots yet)."""
    from sglang.srt.managers.schedule_batch import Req

    rq, lpx = carried["Req"], carried["ReqLogprob"]
    req = Req(
        record.rid,
        "",  # origin_input_text: the constructor does not keep it
        array("q", record.prompt_ids.tolist()),
        sp,
        top_logprobs_num=lpx.get("top_logprobs_num", 0),
        token_ids_logprob=lpx.get("token_ids_logprob"),
        http_worker_ipc=http_worker_ipc,
        **{name: rq[name] for name in _CONSTRUCTOR_ARGS if name in rq},
        **req_kwargs,
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
    if req.return_logprob and record.output_logprobs is not None:  # absent: refused by _check_request
        req.logprob.output_token_logprobs_val = [float(x) for x in record.output_logprobs]
        if record.top_logprob_values is not None:
            req.logprob.output_top_logprobs_val = [[float(x) for x in row] for row in record.top_logprob_values]
            req.logprob.output_top_logprobs_idx = [[int(x) for x in row] for row in record.top_logprob_ids]
    if req.surr_offset is not None and "cur_decode_ids_len" in rq:
        req.surr_and_decode_ids = req.origin_input_ids_unpadded[req.surr_offset :] + req.output_ids[: rq["cur_decode_ids_len"]]
    return req


def _check_resumed(req, tokenizer, path) -> None:
    """:func:`_check_request` on the rebuilt Req, refusals naming the record field."""

    def refuse(field, expected, found, detail=None):
        if field == "Req.tokenizer":  # the target lacks what the request needs: not the file's fault
            return HsnapError(path, "resume_req(tokenizer=...)", expected, found, detail=detail)
        return MalformedHeaderError(path, _record_field(field), expected, found, detail=detail or "refused for a fresh request too")

    _check_request(req, tokenizer, refuse)


def _mamba_tracking_slots(req_to_token_pool) -> int:
    """Ping-pong radix-tracking slots SGLang gives every new request on this target (0 without the extra buffer)."""
    return int(req_to_token_pool.mamba_initial_tracking_slots) if getattr(req_to_token_pool, "enable_mamba_extra_buffer", False) else 0


def _check_tracking_capacity(req_to_token_pool, tracking: int, path) -> None:
    """Before the restore allocates (hold pool_lock): room for the working Mamba slot and the track slots."""
    if tracking and req_to_token_pool.mamba_allocator.available_size() < 1 + tracking:
        free = req_to_token_pool.mamba_allocator.available_size()
        raise CapacityError(path, "target pools", detail=f"does not fit: mamba slots (working + {tracking} ping-pong track): need {1 + tracking}, free {free}")


_TRACK_FIELDS = ("mamba_ping_pong_track_buffer", "mamba_ping_pong_empty", "mamba_prev_track_seqlen", "mamba_next_track_idx", "mamba_last_track_idx")


def _binder(req, kvx: Mapping[str, Any], root, req_to_token_pool, tracking: int, commit: Callable[[], None] | None = None):
    """restore_opened's ``bind``: fresh track slots first (what can fail: inside the
    restore's rollback, before ``req`` is touched), then ``req.kv`` onto the slots, then
    ``commit()`` (the caller's last word, e.g. every TP rank agreeing): whatever raises
    gives every allocation back and leaves ``req`` as it was."""

    def bind(restored) -> None:
        track = None
        if tracking:
            # fresh radix-tracking slots, as HybridReqToTokenPool.alloc gives a new request: no
            # tracked state yet (mamba_last_track_seqlen None), so nothing stale reaches a tree
            scratch = _Scratch(type(req.kv)())
            req_to_token_pool._alloc_ping_pong_buffer(scratch)
            track = {name: getattr(scratch.kv, name) for name in _TRACK_FIELDS}
            req_to_token_pool.req_index_to_mamba_ping_pong_track_buffer_mapping[restored.req_pool_idx] = track["mamba_ping_pong_track_buffer"]
        kv_before = {f.name: getattr(req.kv, f.name) for f in dataclasses.fields(req.kv)}
        req_before = {name: copy.copy(getattr(req, name)) for name in _BOUND_REQ_ATTRS if hasattr(req, name)}
        try:
            bind_restored(req, restored, kvx, root=root)
            for name, value in (track or {}).items():
                setattr(req.kv, name, value)
            if commit is not None:
                commit()
        except BaseException:  # the pools are rolled back by the caller: leave req as it was too
            for name, value in {**kv_before}.items():
                setattr(req.kv, name, value)
            for name, value in req_before.items():
                setattr(req, name, value)
            raise

    return bind


_BOUND_REQ_ATTRS = ("full_untruncated_fill_ids", "extend_end", "prefix_len", "lock", "last_node", "last_host_node", "best_match_node")


@dataclass
class _Scratch:  # what _alloc_ping_pong_buffer writes to (req.kv), before the real req is bound
    kv: Any


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
    http_worker_ipc: str | None = None,
    req_kwargs: Mapping[str, Any] | None = None,
    expect_rid: str | None = None,
    commit: Callable[[], None] | None = None,
    vocab_size: int | None = None,
    room=None,
    **restore_kwargs,
):
    """Restore a snapshot written by :func:`snapshot_req` into fresh slots and return a
    live SGLang ``Req`` built by SGLang's constructor, ``req.kv`` on those slots.

    ``vocab_size``: the target model's vocabulary size (SGLang's scheduler builds every ``Req``
    with ``model_config.vocab_size``): a record carrying another is refused before allocating.
    ``expect_rid``: refuse (before allocating) a record of another request — a caller that
    read the rid from the path earlier learns that the file was replaced meanwhile.
    ``commit()``: called last, after the ``Req`` is bound to its slots, under the pool lock
    and inside the restore's rollback; if it raises, every allocation is given back (a TP
    server has every rank agree here, so that either all ranks hold the request or none).
    ``room``: a target that can free slots (a radix cache): ``room.fits(source)`` replaces the
    header's capacity check (free plus what it could free; it changes nothing), and
    ``room.make(source)`` frees what is missing under the pool lock, after every other check
    and right before the allocation — a snapshot refused for anything never costs the cache.

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
    import_sglang()
    from hsnap_io.adapters import view_pools
    from hsnap_io.restore import OPEN_KEYWORDS, check_target, open_source, pool_lock, restore_opened

    require_type(path, "identity", identity, Identity, optional=True)
    open_kwargs = {k: restore_kwargs.pop(k) for k in OPEN_KEYWORDS if k in restore_kwargs}
    kwargs = dict(req_kwargs or {})
    ipc = _target_worker_ipc(path, http_worker_ipc, kwargs)
    view = view_pools(req_to_token_pool, token_to_kv_pool_allocator)
    with open_source(path, rank=rank, identity=identity, **open_kwargs) as source:
        fpath = source.snap.path
        if room is None:
            check_target(source, view, identity)  # the file belongs here (header only)
        else:
            room.fits(source)  # the same, counting what the cache could free (nothing freed yet)
        record = _read_record(source.snap, fpath)
        prepared = prepare_req(record, fpath, swa_start=source.snap.swa_start, tokenizer=tokenizer, grammar_backend=grammar_backend,
                               loaded_lora_ids=loaded_lora_ids, vocab_size=vocab_size, http_worker_ipc=ipc, req_kwargs=kwargs,
                               expect_rid=expect_rid)
        req, carried, key, grammar = prepared.req, prepared.carried, prepared.grammar_key, prepared.grammar
        root = tree_cache.root_node_handle(req.extra_key) if tree_cache is not None else None
        tracking = _mamba_tracking_slots(req_to_token_pool)
        with pool_lock(req_to_token_pool):  # capacity check, restore and track slots: one step for other allocators
            if room is not None:
                room.make(source)  # every check passed: free only what is missing
            _check_tracking_capacity(req_to_token_pool, tracking, fpath)
            restored = restore_opened(source, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                                      identity=identity, bind=_binder(req, carried["ReqKvInfo"], root, req_to_token_pool, tracking, commit),
                                      **restore_kwargs)
    if grammar is not None:
        req.grammar_key, req.grammar = key, grammar
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
    sp = _sampling_from_record(record.sampling, fpath)
    _check_stop_agrees(record, sp, fpath)
    lora = carried["Req"].get("lora_id")
    if lora is not None and (loaded_lora_ids is None or lora not in set(loaded_lora_ids)):
        raise IncompatibleSnapshotError(fpath, [("request.extra.sglang.Req.lora_id", f"an adapter the target has loaded {sorted(loaded_lora_ids or ())}", lora)])
    # the Req is built and checked before the pools are touched: a failure here leaves them as they were
    req = _rebuild_req(record, carried, sp, tokenizer=tokenizer, http_worker_ipc=http_worker_ipc, req_kwargs=kwargs)
    _check_resumed(req, tokenizer, fpath)
    key, grammar = grammar_key(sp), None
    if key is not None:
        if grammar_backend is None:
            raise HsnapError(fpath, f"request.sampling.{_GRAMMAR_FIELD[key[0]]}", "a grammar_backend to re-derive the matcher", None)
        key, grammar = replay_grammar(grammar_backend, key, record.output_ids, require_reasoning=bool(req.require_reasoning),
                                      input_ids=array("q", record.prompt_ids.tolist()), path=fpath)
    return PreparedReq(req, carried, key, grammar)


def bind_restored(req, restored, kvx: Mapping[str, Any], *, root=None) -> None:
    """Point ``req.kv`` at the slots of ``restored`` (a :class:`RestoredRequest`) and
    leave nothing pending that would overwrite the restored state. ``kvx``: the carried
    ReqKvInfo values (:func:`decode_carried`); ``root``: the tree root handle, if any.
    Sets attributes only: everything that can fail was checked before allocation."""
    ct = _component_type()
    kv = req.kv
    kv.req_pool_idx = restored.req_pool_idx
    kv.kv_committed_len = kv.kv_allocated_len = restored.state_position
    kv.cache_protected_len = kv.cache_inserted_len = 0
    seqlens = dict(kvx.get("component_evicted_seqlens") or {})
    freed = restored.swa_evict_floor  # SWA slots the restore freed: swa_start in whole target pages
    if ct.SWA in seqlens or freed:
        seqlens[ct.SWA] = freed
    kv.component_evicted_seqlens = seqlens
    # SGLang frees [swa_dead_lo, SWA cursor) full-side only and everything below swa_dead_lo
    # on both sides: a shield above 0 over positions whose SWA slots the restore already freed
    # would free them twice. The restored request holds no SWA rows below swa_start anyway.
    kv.swa_evict_floor = 0 if freed else int(kvx.get("swa_evict_floor", 0))
    kv.retraction_backup = None
    if restored.mamba_pool_idx is not None:
        kv.mamba_pool_idx = torch.tensor(restored.mamba_pool_idx, dtype=torch.int64)  # 0-d, as SGLang's alloc
    kv.mamba_needs_clear = False  # sglang#32995: a set flag zeroes the restored state
    kv.mamba_cow_src_index = None  # a pending COW would overwrite it with a tree copy
    req.refresh_fill_ids()
    req.extend_end = restored.state_position
    req.prefix_len = 0
    req.lock = None
    if root is not None:
        req.last_node = req.last_host_node = req.best_match_node = root


# ----------------------------------------------------------------------------- docs

DOC_BEGIN = "<!-- BEGIN FIELD TABLE (generated by `python -m hsnap_sglang.req --docs`; do not edit) -->"
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
    "prepare_req",
    "PreparedReq",
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

if __name__ == "__main__":  # python -m hsnap_sglang.req --docs [docs/sglang.md]
    import sys

    if sys.argv[1:2] == ["--docs"]:
        write_docs(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "docs", "sglang.md"))
