"""Live SGLang 0.5.23 ``Req`` objects on CPU, built with SGLang's own constructor,
``SamplingParams.normalize`` and pool allocators, in a decode state.

``tokenizer()`` is a real byte-level BPE tokenizer (``tokenizers``, trained in memory
on a few lines, wrapped in transformers' ``PreTrainedTokenizerFast``): normalize()
and stop-string matching use it, and xgrammar builds its TokenizerInfo from it.
``decode_req(ps, case)`` allocates a request the way a scheduler would have after a
prefill and ``case["n_out"]`` decode steps, with seeded random KV and Mamba state.
"""

from __future__ import annotations

import functools
import json
import random
from array import array

import numpy as np
import torch

from hsnap_io.sglang_env import import_sglang

from . import pools as sp

POOL_KINDS = [("mha", 1), ("mla", 1), ("swa_mamba", 1), ("hybrid_linear", 1), ("mha", 16)]
SPECIALS = ["<|endoftext|>", "<think>", "</think>"]
CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    "The quick brown fox jumps over the lazy dog. Ünïcödé — ストップ 停止 ✓",
    "<think>let me reason about it</think> answer: 42",
    "0123456789 [] {} , : true false null",
]


@functools.lru_cache(maxsize=None)
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def vocab_size() -> int:
    return len(tokenizer())


def sampling_params(**kw):
    import_sglang()
    from sglang.srt.sampling.sampling_params import SamplingParams

    p = SamplingParams(**kw)
    p.normalize(tokenizer())
    return p


def new_req(rid="req-1", prompt=(5, 6, 7, 8), params=None, **kw):
    import_sglang()  # first: makes sglang importable on CPU (torchvision placeholder)
    from sglang.srt.managers.schedule_batch import Req

    params = params or sampling_params(max_new_tokens=32)
    return Req(rid, "prompt text", array("q", prompt), params, vocab_size=vocab_size(), **kw)


def f32(x) -> float:
    return float(np.float32(x))


def random_case(seed: int) -> dict:
    """A randomized request state (JSON data, so a child process can rebuild it)."""
    r = random.Random(seed)
    V = vocab_size()
    n_prompt, n_out = r.randint(3, 30), r.randint(1, 12)
    stops = r.sample(["ü", "停止", "ストップ ✓", "</answer>", "\n\n", "—"], r.randint(0, 3))
    params = dict(
        max_new_tokens=n_out + r.randint(0, 40),
        min_new_tokens=r.randint(0, n_out),
        temperature=r.choice([0.0, 0.5, 1.0, 1.3]),
        top_p=r.choice([1.0, 0.9, 0.5]),
        top_k=r.choice([-1, 1, 20]),
        min_p=r.choice([0.0, 0.05]),
        frequency_penalty=r.choice([0.0, 0.5, -1.25]),
        presence_penalty=r.choice([0.0, 0.25]),
        repetition_penalty=r.choice([1.0, 1.1, 0.8]),
        sampling_seed=r.choice([None, 7, 2**62 + 3, -5]),
        stop=stops or None,
        stop_token_ids=r.choice([None, [V - 1, 3]]),
        ignore_eos=r.random() < 0.3,
        skip_special_tokens=r.random() < 0.7,
        logit_bias=r.choice([None, {"3": -100.0, "17": 2.5}, {"5": float("-inf")}]),
        custom_params=r.choice([None, {"k": "v", "n": [1, 2]}]),
        stream_interval=r.choice([None, 4]),
    )
    k = r.choice([0, 0, 1, 3])
    return dict(
        seed=seed,
        rid=f"req-{seed}-ü",
        prompt=[r.randrange(V) for _ in range(n_prompt)],
        output=[r.randrange(V) for _ in range(n_out)],
        params=params,
        return_logprob=r.random() < 0.7,
        top_logprobs_num=k,
        token_ids_logprob=r.choice([None, [1, 2]]),
        logprob_start_len=r.choice([-1, 0, 2]),
        stream=r.random() < 0.5,
        require_reasoning=r.random() < 0.5,
        reasoning=r.choice(["none", "started", "finished"]),
        streamed=r.randint(0, n_out),
        priority=r.choice([None, 0, 5]),
        eos_token_ids=r.choice([None, [0]]),
        detok=r.random() < 0.7,
        cached_tokens=r.randint(0, n_prompt),
    )


def decode_req(ps, case: dict, *, pool_seed: int = 3):
    """A Req in ``ps`` after prefill and len(output) decode steps (see module doc)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    r = random.Random(case["seed"])
    params = sampling_params(**case["params"])
    req = new_req(
        case["rid"],
        case["prompt"],
        params,
        return_logprob=case["return_logprob"],
        top_logprobs_num=case["top_logprobs_num"],
        token_ids_logprob=case["token_ids_logprob"],
        stream=case["stream"],
        require_reasoning=case["require_reasoning"],
        priority=case["priority"],
        eos_token_ids=None if case["eos_token_ids"] is None else set(case["eos_token_ids"]),
    )
    req.tokenizer = tokenizer()
    req.logprob_start_len = case["logprob_start_len"]
    n = len(case["prompt"]) + len(case["output"]) - 1  # committed positions
    rp = ps.req_to_token_pool
    rp.alloc([req])  # SGLang's own: binds req.kv.req_pool_idx (+ a mamba slot, needs_clear=True)
    idx = sp.alloc_tokens(ps, n).to(torch.int64)
    rp.write((req.kv.req_pool_idx, slice(0, n)), idx.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    evicted = 0
    if ps.has_swa and n > 12:
        evicted = 6
        ps.token_to_kv_pool_allocator.free_swa_segment(idx[:evicted], start_pos=0)
        req.kv.set_evicted_seqlen(ComponentType.SWA, evicted)
    mamba = None if req.kv.mamba_pool_idx is None else int(req.kv.mamba_pool_idx)
    rec = sp.RequestRecord(req.kv.req_pool_idx, idx, mamba, n, pool_seed, evicted, req)
    sp.fill_request(ps, rec)
    req.kv.mamba_needs_clear = False  # the prefill forward wrote the slot (and cleared the flag)
    for t in case["output"]:
        req.output_ids.append(t)
    if req.return_logprob:
        lp = req.logprob
        for t in case["output"]:
            lp.output_token_logprobs_val.append(f32(-r.random() * 5))
            lp.output_token_logprobs_idx.append(t)
            if lp.top_logprobs_num:
                lp.output_top_logprobs_val.append([f32(-r.random() * 6) for _ in range(lp.top_logprobs_num)])
                lp.output_top_logprobs_idx.append([r.randrange(vocab_size()) for _ in range(lp.top_logprobs_num)])
            if lp.token_ids_logprob is not None:
                lp.output_token_ids_logprobs_val.append([f32(-r.random()) for _ in lp.token_ids_logprob])
                lp.output_token_ids_logprobs_idx.append(list(lp.token_ids_logprob))
        lp.input_token_logprobs_val, lp.input_token_logprobs_idx = [], []
    req.input_logprob_sent = True
    req.send_token_offset = req.send_output_token_logprobs_offset = case["streamed"]
    if case["detok"]:
        req.init_incremental_detokenize()
        req.decoded_text = tokenizer().decode(case["output"][: case["streamed"]])
        req.send_decode_id_offset = case["streamed"]
    if case["reasoning"] != "none":
        req.reasoning_tokens = len(case["output"]) if case["reasoning"] == "started" else max(1, len(case["output"]) // 2)
        req._is_reasoning_over = case["reasoning"] == "finished"
        req._think_end_match_len = 1 if case["reasoning"] == "started" else 0
    req.cached_tokens = case["cached_tokens"]
    req.spec_correct_drafts_histogram = [1, 2]
    return req, rec


def req_rows(ps, req):
    """The request's rows (raw store dtype) as the pools see them through req.kv."""
    m = None if req.kv.mamba_pool_idx is None else int(req.kv.mamba_pool_idx)
    view = sp.RequestRecord(req.kv.req_pool_idx, None, m, req.kv.kv_committed_len, 0)
    return sp.request_rows(ps, view)


def jsonable_view(req) -> dict:
    from hsnap_sglang.req import classified_view

    return json.loads(json.dumps(classified_view(req), default=str))
