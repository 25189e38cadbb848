"""The field table: every attribute of SGLang's ``Req``, ``ReqKvInfo``, ``ReqLogprob`` and ``SamplingParams``,
classified in :data:`TABLES` (the single source: ``docs/sglang.md`` is generated from it and a test fails when
SGLang grows an attribute the table does not name):

* ``carried``    written into the snapshot's request record and set again on resume;
* ``rederived``  computed again in the target (fresh slots, grammar matcher, ...);
* ``refused``    a value other than the neutral one makes ``snapshot_req`` refuse;
* ``irrelevant`` scheduler bookkeeping or observability that does not change future
  tokens nor what the client receives.

Carried values without a typed place in :class:`hsnap_format.RequestRecord` go into
the record's existing extensible maps (``sampling`` for ``SamplingParams``, ``extra``
for the rest, keys ``sglang.<Class>.<attr>``); the file format is unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .values import (MAX_PLAIN, TOKEN_ID_LIMIT, Bounds, boolean, evicted_lengths, histogram, integer, kv_hints_envelope, nested_lists, one_of,
                     sampling_logprobs_modes, string, token_ids)

FORMAT_KEY = "sglang.format"
FORMAT = "sglang-req/1"  # layout of the sglang.* keys below, not the file format
ENGINE_VERSION = "0.5.23"

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
    # value resume sets, or InvalidValue. The one place a record's extras are checked (decode_carried).
    value: Callable[[Any, "Bounds"], Any] | None = None


def carried(why: str, codec: str = "plain", value=None) -> Field:
    if codec not in ("record", "sampling") and value is None:  # sampling: SamplingParams' own types and verify()
        raise AssertionError(f"carried field without a value check: {why}")
    return Field(CARRIED, why, codec, value=value)


def rederived(why: str) -> Field:
    return Field(REDERIVED, why)


def refused(why: str, ok=_is_none, neutral: str = "None") -> Field:
    return Field(REFUSED, why, ok=ok, neutral=neutral)


def irrelevant(why: str) -> Field:
    return Field(IRRELEVANT, why)


_ANY_INT = integer(-MAX_PLAIN, MAX_PLAIN, none=True)
_COUNT = integer(0, MAX_PLAIN)
_OUT = integer(0, lambda b: b.output)  # an offset into the output ids
_OPT_PROMPT = integer(0, lambda b: b.prompt, none=True)  # an offset into the prompt, or unset

_SCRATCH = "prefill-time logprob scratch in flight"
_SCHED = "scheduler bookkeeping of the current process; the target scheduler sets its own"
_CACHE = "prefix-cache (radix/HiCache) bookkeeping; the restored request owns all its slots and starts at the tree root"
_PD = "PD-disaggregation transport state; finished before a request decodes"
_REBOOT = "PD disaggregation: the prefill server a retracted decoding request is re-bootstrapped from (Req.build_rebootstrap_payload)"
_STATS = "observability only"

REQ_FIELDS: dict[str, Field] = {
    # identity and history
    "rid": carried("request id the client knows", "record"),
    "origin_input_ids": carried("the prompt (record.prompt_ids)", "record"),
    "origin_input_ids_unpadded": rederived("equals origin_input_ids for text requests (multimodal padding is refused)"),
    "output_ids": carried("generated tokens (record.output_ids)", "record"),
    "full_untruncated_fill_ids": rederived("origin_input_ids + output_ids (refresh_fill_ids)"),
    "extend_end": rederived("set to the committed length, as SGLang's PD decode admission does"),
    "sampling_params": carried("normalized SamplingParams (record.sampling + record.stop)", "record"),
    "eos_token_ids": carried("stop condition", "intset", token_ids(hi=TOKEN_ID_LIMIT, max_len=4096)),
    "vocab_size": carried("stop condition (out-of-vocab ids finish the request); every carried token id is below it", value=integer(1, TOKEN_ID_LIMIT, none=True)),
    "priority": carried("scheduling priority the client asked for", value=_ANY_INT),
    "lora_id": carried("adapter the request decodes with; resume refuses an adapter the target has not loaded", value=string()),
    "extra_key": carried("cache namespace (includes the lora id)", value=string()),
    "cache_salt": carried("cache namespace the client gave", value=string()),
    "routing_key": carried("routing hint the client gave", value=string()),
    "stream": carried("how the client receives output", value=boolean),
    "return_logprob": carried("logprob option", value=boolean),
    "logprob_start_len": carried("logprob option (-1..prompt length, as the scheduler checks it)", value=integer(-1, lambda b: b.prompt)),
    "logprob": carried("the ReqLogprob object, field by field (see ReqLogprob)", "record"),
    "temp_scaled_logprobs": carried("logprob option", value=boolean),
    "top_p_normalized_logprobs": carried("logprob option", value=boolean),
    "sampling_logprobs_mode": carried("logprob option (a SamplingLogprobsMode)", value=one_of(sampling_logprobs_modes)),
    "return_flat_raw_top_logprobs": carried("logprob option", value=boolean),
    "input_logprob_sent": carried("whether input logprobs were already streamed", value=boolean),
    # streaming / detokenizer progress
    "send_token_offset": carried("output ids already sent (record.streamed.tokens)", "record"),
    # an offset into surr_and_decode_ids (prompt[surr_offset:] + output_ids[:cur_decode_ids_len]), not into the
    # output: up to INIT_INCREMENTAL_DETOKENIZATION_OFFSET prompt tokens more (decode_carried checks the exact bound)
    "send_decode_id_offset": carried("decode ids already sent to the detokenizer (an offset into surr_and_decode_ids)",
                               value=integer(0, lambda b: b.prompt + b.output)),
    "send_output_token_logprobs_offset": carried("logprobs already sent", value=_OUT),
    "surr_offset": carried("incremental detokenizer offset (into the prompt)", value=_OPT_PROMPT),
    "read_offset": carried("incremental detokenizer offset (into the prompt, >= surr_offset)", value=_OPT_PROMPT),
    "decoded_text": carried("incremental detokenizer text", value=string(none=False)),
    "cur_decode_ids_len": carried("incremental detokenizer progress (set by init_incremental_detokenize)", value=_OUT),
    "surr_and_decode_ids": rederived("origin_input_ids_unpadded[surr_offset:] + output_ids[:cur_decode_ids_len]"),
    # reasoning
    "require_reasoning": carried("reasoning mode", value=boolean),
    "_is_reasoning_over": carried("reasoning finished (record.streamed.reasoning_finished)", "record"),
    "reasoning_tokens": carried("reasoning token count (record.streamed.reasoning_tokens)", "record"),
    "_think_end_match_len": carried("partial match of the think-end sequence", value=integer(0, 1 << 16)),
    "_think_start_match_len": carried("partial match of the think-start sequence", value=integer(0, 1 << 16)),
    "_think_end_matcher": rederived("built lazily from the think-end ids on the next update"),
    # grammar
    "grammar": rederived("a fresh matcher of the target's grammar backend, fed every output id"),
    "grammar_key": rederived("(kind, spec) from the carried SamplingParams grammar field"),
    "grammar_wait_ct": irrelevant(_SCHED),
    # reported to the client in meta_info
    "cached_tokens": carried("reported to the client (meta_info.cached_tokens)", value=_COUNT),
    "cached_tokens_device": carried("reported to the client", value=_COUNT),
    "cached_tokens_host": carried("reported to the client", value=_COUNT),
    "cached_tokens_storage": carried("reported to the client", value=_COUNT),
    "_cache_breakdown_computed": carried("guards the cached-token breakdown above", value=boolean),
    "retraction_count": carried("reported to the client", value=_COUNT),
    "retracted_stain": carried("the request was retracted once (reported, affects scheduling)", value=boolean),
    "spec_verify_ct": carried("reported to the client", value=_COUNT),
    "spec_num_correct_drafts": carried("reported to the client", value=_COUNT),
    "spec_num_block_accept_tokens": carried("reported to the client", value=_COUNT),
    "spec_num_cap_tokens": carried("reported to the client", value=_COUNT),
    "spec_correct_drafts_histogram": carried("reported to the client", "ints", histogram),
    "spec_cap_lens_histogram": carried("reported to the client", "ints", histogram),
    "prefill_attempt_count": carried("counts prefill attempts; preserved across retractions by SGLang too", value=_COUNT),
    "already_computed": rederived("0: nothing of the restored request needs recomputing"),
    # the KV record
    "kv": carried("the ReqKvInfo object, field by field (see ReqKvInfo)", "record"),
    # refused unless neutral
    "session": refused("session-bound request: the session's history lives outside the request"),
    "session_id": refused("session-bound request"),
    "_session_mm_items": refused("session media", ok=_falsy, neutral="[]"),
    "session_generation": refused("session-bound request"),
    "custom_logit_processor": refused("a serialized callable with its own state; not carried"),
    "multimodal_inputs": refused("multimodal embeddings are not in the snapshot"),
    "input_embeds": refused("input embeddings are not in the snapshot"),
    "positional_embed_overrides": refused("embedding overrides are not in the snapshot"),
    "token_type_ids": refused("cross-encoder input, not a generation"),
    "return_hidden_states": refused("hidden-state returns are per-position tensors not in the snapshot", ok=_falsy, neutral="False"),
    "hidden_states": refused("hidden-state returns", ok=_falsy, neutral="[]"),
    "hidden_states_tensor": refused("hidden-state returns"),
    "return_pooled_hidden_states": refused("hidden-state returns", ok=_falsy, neutral="False"),
    "pooled_hidden_state": refused("hidden-state returns"),
    "return_routed_experts": refused("routed-expert returns are per-position tensors not in the snapshot", ok=_falsy, neutral="False"),
    "routed_experts": refused("routed-expert returns"),
    "return_indexer_topk": refused("indexer top-k returns are per-position tensors not in the snapshot", ok=_falsy, neutral="False"),
    "indexer_topk": refused("indexer top-k returns"),
    "return_sampling_mask": refused("sampling-mask returns are per-step tensors not in the snapshot", ok=_falsy, neutral="False"),
    "sampling_mask_rows": refused("sampling-mask returns"),
    "output_topk_p": refused("speculative draft state in flight (EAGLE/MTP)"),
    "output_topk_index": refused("speculative draft state in flight (EAGLE/MTP)"),
    "output_dsa_topk_indices": refused("DSA indexer state"),
    "customized_info": refused("free-form per-token returns"),
    "embedding": refused("an embedding request, not a generation"),
    "dimensions": refused("an embedding request (Matryoshka dimensions)"),
    "multi_item_delimiter_indices": refused("multi-item scoring request"),
    "token_indices_to_pool": refused("pooling request"),
    "decision_layout": refused("classification/decision request"),
    "beam_group": refused("beam search: the group's rows are not one request"),
    "dllm_config": refused("diffusion-LM request"),
    "finished_reason": refused("a finished request has nothing to continue"),
    "finished_len": refused("a finished request has nothing to continue"),
    "finished_output": refused("a finished request has nothing to continue"),
    "to_finish": refused("an abort is pending"),
    "discard_output_reason": refused("an in-flight forward's output is being discarded"),
    "is_retracted": refused("a retracted request holds no KV (retract.py handles retraction)", ok=_falsy, neutral="False"),
    "weight_version_events": refused("weights changed mid-request; a snapshot binds one weights version", ok=_falsy, neutral="[]"),
    "pd_rebootstrap_forced_output_id": refused("a PD re-bootstrap is pending"),
    "hisparse_staging": refused("HiSparse staging in flight", ok=_falsy, neutral="False"),
    "inflight_middle_chunks": refused("a chunked prefill is in flight", ok=_falsy, neutral="0"),
    # SGLang leaves these empty, not None, once it re-prefilled a retracted request whose input logprobs were sent
    "input_token_logprobs": refused(_SCRATCH, ok=_falsy, neutral="None or []"),
    "temp_input_top_logprobs_val": refused(_SCRATCH, ok=_falsy, neutral="None or []"),
    "temp_input_top_logprobs_idx": refused(_SCRATCH, ok=_falsy, neutral="None or []"),
    "temp_input_token_ids_logprobs_val": refused(_SCRATCH, ok=_falsy, neutral="None or []"),
    "temp_input_token_ids_logprobs_idx": refused(_SCRATCH, ok=_falsy, neutral="None or []"),
    # re-derived / irrelevant
    "tokenizer": rederived("the target's tokenizer (resume_req(tokenizer=...))"),
    "return_hidden_states_mode": rederived("derived from return_hidden_states (refused unless False)"),
    "cache_request_handle": rederived("CacheRequestHandle(rid, attempt 0), as the constructor builds it"),
    "hsnap_restored": irrelevant("set by resume_req: what the restore did (slots, bytes uploaded, snapshot id)"),
    "time_stats": irrelevant(_STATS),
    "has_log_time_stats": irrelevant(_STATS),
    "metrics_collector": irrelevant("the target's metrics collector (resume_req(**req_kwargs))"),
    "http_worker_ipc": rederived("the target's own tokenizer worker, given to resume_req(http_worker_ipc=...): with several tokenizer workers SGLang routes the stream by it, so resume refuses to guess (the source's names a socket of the source server)"),
    "extend_batch_idx": irrelevant(_SCHED),
    "decode_batch_idx": irrelevant(_SCHED),
    "arrival_processed_tokens": irrelevant(_SCHED),
    "retraction_mb_id": irrelevant(_SCHED),
    "mamba_lazy_checkpoint": irrelevant(_CACHE),
    "mamba_branching_seqlen": irrelevant(_CACHE),
    "swa_branching_seqlen": irrelevant(_CACHE),
    "prefix_len": rederived("0: the request owns its whole row from the root (as SGLang's PD decode admission binds it)"),
    "last_node": rederived("tree_cache.root_node_handle(extra_key) when resume_req gets a tree_cache, else None"),
    "last_host_node": rederived("as last_node"),
    "best_match_node": rederived("as last_node"),
    "lock": rederived("None: no tree lock is held (as SGLang's PD decode admission)"),
    "host_hit_length": irrelevant(_CACHE),
    "swa_host_hit_length": irrelevant(_CACHE),
    "mamba_host_hit_length": irrelevant(_CACHE),
    "num_matched_prefix_tokens": irrelevant(_CACHE),
    "storage_hit_length": irrelevant(_CACHE),
    "storage_hit_start": irrelevant(_CACHE),
    "host_loaded_length": irrelevant(_CACHE),
    "host_hit_is_storage": irrelevant(_CACHE),
    "storage_prefetch_retry_attempts": irrelevant(_CACHE),
    "staged_prefetch_plan": irrelevant(_CACHE),
    "storage_prefetch_last_match_len": irrelevant(_CACHE),
    "kv_rotation_base": irrelevant(_CACHE),
    "skip_radix_cache_insert": irrelevant(_CACHE),
    "kv_hints": carried("KV hints the client (orchestrator) gave, like routing_key and cache_salt; SGLang's own envelope decoder checks them", "json", kv_hints_envelope),
    "mm_image_tokens": irrelevant("multimodal counts (multimodal requests are refused)"),
    "mm_audio_tokens": irrelevant("multimodal counts (multimodal requests are refused)"),
    "mm_video_tokens": irrelevant("multimodal counts (multimodal requests are refused)"),
    "mm_token_counts_ready": irrelevant("multimodal counts (multimodal requests are refused)"),
    "bootstrap_host": carried(_REBOOT, value=string()),
    "bootstrap_port": carried(_REBOOT, value=integer(0, 65535, none=True)),
    "bootstrap_room": carried(_REBOOT + " (a 64-bit id: a JSON text)", "json", integer(0, 2**64 - 1, none=True)),
    "disagg_kv_sender": irrelevant(_PD),
    "routed_dp_rank": irrelevant(_PD),
    "disagg_prefill_dp_rank": carried(_REBOOT, value=integer(0, 1 << 20, none=True)),
    "start_send_idx": irrelevant(_PD),
    "disagg_decode_prefix_len": irrelevant(_PD),
    "tmp_end_idx": irrelevant(_PD),
    "early_send_prefix_end": irrelevant(_PD),
    "metadata_buffer_index": irrelevant(_PD),
    "expected_kv_checksum": irrelevant(_PD),
    "pending_bootstrap": irrelevant(_PD),
    "routed_experts_start_len": irrelevant("used only with routed-expert returns (refused)"),
    "dllm_initialized": irrelevant("diffusion-LM only (refused)"),
    "dllm_block_offset": irrelevant("diffusion-LM only (refused)"),
    "dllm_incomplete_ids": irrelevant("diffusion-LM only (refused)"),
    "dllm_phase": irrelevant("diffusion-LM only (refused)"),
    "dllm_has_literal_mask": irrelevant("diffusion-LM only (refused)"),
    "dllm_algo_state": irrelevant("diffusion-LM only (refused)"),
}

KV_FIELDS: dict[str, Field] = {
    "req_pool_idx": rederived("a fresh row of the target's req_to_token_pool"),
    "cache_protected_len": rederived("0: the tree owns nothing of the restored row"),
    "cache_inserted_len": rederived("0: nothing of the restored row is in the target's tree"),
    "kv_committed_len": carried("committed positions = record.state_position (must be seqlen - 1)", "record"),
    "kv_allocated_len": rederived("= kv_committed_len; snapshot refuses allocation past the committed boundary (draft tokens or a step in flight)"),
    "swa_evict_floor": carried("prefill-aware SWA floor (0..committed positions); 0 after a restore that freed SWA slots below swa_start, whose rows the snapshot does not hold", value=integer(0, lambda b: b.position)),
    "component_evicted_seqlens": carried("evicted cursors per component (ComponentType names); the SWA cursor is the snapshot's swa_start, set to the SWA slots the restore freed (swa_start in whole target pages)", "json", evicted_lengths),
    "retraction_backup": refused("an in-memory retraction backup exists (the request holds no slots)"),
    "mamba_pool_idx": rederived("a fresh slot of the target's mamba allocator, 0-d int64 as HybridReqToTokenPool.alloc makes it"),
    "mamba_ping_pong_track_buffer": rederived("radix-tracking checkpoints, not the working state: fresh slots from SGLang's _alloc_ping_pong_buffer when the target has the extra buffer, else None"),
    "mamba_ping_pong_empty": rederived("set with the fresh track buffer (SGLang's _alloc_ping_pong_buffer)"),
    "mamba_next_track_idx": rederived("set with the fresh track buffer (SGLang's _alloc_ping_pong_buffer)"),
    "mamba_last_track_idx": rederived("set with the fresh track buffer (SGLang's _alloc_ping_pong_buffer)"),
    "mamba_last_track_seqlen": rederived("None: no tracked state, so nothing stale is inserted into a tree"),
    "mamba_prev_track_seqlen": rederived("None: no tracked state"),
    "mamba_untracked_decode_batch_idx": rederived("None: no tracked state"),
    "mamba_cow_src_index": refused("a deferred copy-on-write is pending: the slot does not hold the state yet; resume leaves it None so no COW overwrites the restored state"),
    "mamba_needs_clear": refused(
        "the slot was never written by a forward pass; resume leaves it False so the restored state is not zeroed (sglang#32995)",
        ok=_falsy,
        neutral="False",
    ),
}

LOGPROB_FIELDS: dict[str, Field] = {
    "top_logprobs_num": carried("logprob option (record.top_logprobs_k when k > 0)", value=integer(0, lambda b: b.token_hi)),
    "token_ids_logprob": carried("logprob option (ids below vocab_size)", "ints", token_ids()),
    "output_token_logprobs_val": carried("selected-token logprobs (record.output_logprobs, float32)", "record"),
    "output_token_logprobs_idx": carried("ids of the selected tokens (below vocab_size)", "ints", token_ids(max_len=lambda b: b.output)),
    "output_top_logprobs_val": carried("top-k logprobs (record.top_logprob_values, float32)", "record"),
    "output_top_logprobs_idx": carried("top-k ids (record.top_logprob_ids)", "record"),
    "output_token_ids_logprobs_val": carried("token-ids logprobs", "json", nested_lists(2, "number")),
    "output_token_ids_logprobs_idx": carried("token-ids logprob ids", "json", nested_lists(2, "int")),
    "input_token_logprobs_val": carried("input logprobs (sent with the first output)", "json", nested_lists(1, "number")),
    "input_token_logprobs_idx": carried("input logprobs", "json", nested_lists(1, "int")),
    "input_top_logprobs_val": carried("input logprobs", "json", nested_lists(2, "number")),
    "input_top_logprobs_idx": carried("input logprobs", "json", nested_lists(2, "int")),
    "input_token_ids_logprobs_val": carried("input logprobs", "json", nested_lists(2, "number")),
    "input_token_ids_logprobs_idx": carried("input logprobs", "json", nested_lists(2, "int")),
    "input_top_logprobs_val_flat": refused("flat numpy input logprobs (prefill-only scoring)"),
    "input_top_logprobs_idx_flat": refused("flat numpy input logprobs (prefill-only scoring)"),
    "input_top_logprobs_flat_null_prefix": refused("flat numpy input logprobs (prefill-only scoring)"),
}

_GRAMMAR = "grammar spec; the matcher is re-derived at resume (xgrammar)"
SAMPLING_FIELDS: dict[str, Field] = {
    **{
        k: carried("sampling parameter", "sampling")
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
    "max_new_tokens": carried("budget (record.stop.max_new_tokens)", "sampling"),
    "min_new_tokens": carried("budget (record.stop.min_new_tokens)", "sampling"),
    "stop_strs": carried("stop strings (record.stop.stop_strings)", "sampling"),
    "stop_token_ids": carried("stop token ids (record.stop.stop_token_ids)", "sampling"),
    "ignore_eos": carried("stop condition (record.stop.ignore_eos)", "sampling"),
    "json_schema": carried(_GRAMMAR, "sampling"),
    "regex": carried(_GRAMMAR, "sampling"),
    "ebnf": carried(_GRAMMAR, "sampling"),
    "structural_tag": carried(_GRAMMAR, "sampling"),
    "ebnf_full_assistant": carried(_GRAMMAR, "sampling"),
    "n": refused("parallel sampling groups (n > 1)", ok=lambda v: v in (None, 1), neutral="1"),
    "beam_width": refused("beam search"),
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
    return [f.name for f in dataclasses.fields(obj)]


def unclassified(req) -> list[str]:
    """``Class.attr`` of every attribute the table does not classify (an SGLang upgrade)."""
    return [f"{cls}.{k}" for cls, attrs in sglang_attributes(req).items() for k in attrs if k not in TABLES[cls]]


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
