"""The demo's request as SGLang's own ``Req``: built by SGLang's constructor, admitted
into the pools through ``HybridReqToTokenPool.alloc``, advanced token by token the
way the scheduler advances it (output ids, selected-token logprobs, reasoning count
by ``Req.update_reasoning_tokens``, stream chunks sliced at ``send_token_offset`` /
``send_output_token_logprobs_offset`` like SGLang's output streamer), released with
SGLang's ``release_kv_cache``.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Any

import torch

# The sequence that ends reasoning (SGLang matches it token by token, Req._think_end_match_len).
# Chosen for the default run (seed-0 qwen3_5, greedy, k=10): the outputs are ...481 | 430...
# across the pause, so the request pauses mid-reasoning *between the two ids*, and the
# resumed process must carry the partial match to see reasoning end at the next token,
# exactly where the uninterrupted reference sees it.
THINK_END_IDS = [481, 430]
STREAM_INTERVAL = 1  # the client receives every token as it is produced


def _sg():
    from hsnap_io._sglang_env import import_sglang

    return import_sglang()


def new_req(name: str, prompt, n: int, vocab_size: int):
    """A greedy request of ``n`` outputs, with logprobs, streamed, reasoning."""
    _sg()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    params.normalize(None)  # SGLang's normal form of greedy: temperature 1.0, top_k 1
    return Req(f"demo-{name}", "", array("q", prompt), params, return_logprob=True, stream=True,
               require_reasoning=True, vocab_size=vocab_size)


def admit(pools, req, seq_len: int) -> torch.Tensor:
    """A req_to_token row and a Mamba slot from SGLang's ``HybridReqToTokenPool.alloc``, ``seq_len``
    token slots from the allocator, as the scheduler holds a decoding request."""
    rtp = pools.req_to_token_pool
    if rtp.alloc([req]) is None:
        raise RuntimeError("no free req_to_token row")
    n_alloc = -(-seq_len // pools.page_size) * pools.page_size
    tok = pools.allocator.alloc(n_alloc)
    if tok is None:
        raise RuntimeError(f"no room for {seq_len} tokens")
    tok = tok[:seq_len].to(torch.int64)
    rtp.write((req.kv.req_pool_idx, slice(0, seq_len)), tok.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = seq_len
    return tok


def advance(req, token_id: int, logprob: float) -> dict[str, Any] | None:
    """Commit one output token the way the scheduler does; return the stream chunk the
    client receives now (None when nothing is due)."""
    req.output_ids.append(int(token_id))
    req.logprob.output_token_logprobs_val.append(float(logprob))
    req.logprob.output_token_logprobs_idx.append(int(token_id))
    req.update_reasoning_tokens(int(token_id), THINK_END_IDS)
    if len(req.output_ids) % STREAM_INTERVAL and len(req.output_ids) < req.sampling_params.max_new_tokens:
        return None
    return stream(req)


def stream(req) -> dict[str, Any]:
    """What SGLang's output streamer sends: the ids and logprobs past the offsets, then advances them."""
    start, lp_start = req.send_token_offset, req.send_output_token_logprobs_offset
    end = len(req.output_ids)
    chunk = {
        "start": start,
        "token_ids": [int(t) for t in req.output_ids[start:end]],
        "logprob_start": lp_start,
        "logprobs": [float(x) for x in req.logprob.output_token_logprobs_val[lp_start:end]],
    }
    req.send_token_offset = req.send_output_token_logprobs_offset = end
    decode_ids, _ = req.init_incremental_detokenize()  # as SGLang's output streamer: an offset into these ids
    req.send_decode_id_offset = len(decode_ids)
    return chunk


def reasoning(req) -> dict[str, Any]:
    return {"require_reasoning": bool(req.require_reasoning), "reasoning_tokens": int(req.reasoning_tokens),
            "reasoning_over": bool(req._is_reasoning_over), "think_end_match_len": int(req._think_end_match_len)}


def reasoning_of(token_ids, vocab_size: int) -> dict[str, Any]:
    """The reasoning state SGLang's Req reaches after ``token_ids`` (for the reference)."""
    req = new_req("reference", [0], len(token_ids) + 1, vocab_size)
    for t in token_ids:
        req.update_reasoning_tokens(int(t), THINK_END_IDS)
    return reasoning(req)


@contextlib.contextmanager
def scheduler_context():
    """The scheduler config SGLang's release path reads, scoped (as SGLang's own unit fixtures build it)."""
    _sg()
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 64
    with use_context(create_context(args, role="scheduler")):
        yield


def release(pools, req) -> None:
    """Free the request's slots the SGLang way: ``release_kv_cache`` through the tree cache a
    server with a hybrid model builds (``UnifiedRadixCache``, radix disabled, FULL + MAMBA)."""
    _sg()
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    with scheduler_context():
        params = CacheInitParams(disable=True, req_to_token_pool=pools.req_to_token_pool,
                                 token_to_kv_pool_allocator=pools.allocator, page_size=pools.page_size,
                                 tree_components=(ComponentType.FULL, ComponentType.MAMBA))
        release_kv_cache(req, UnifiedRadixCache(params), checkpoint=False)
