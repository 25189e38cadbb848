"""``python -m hsnap_sglang.serve`` (SGLang's own ``sglang.launch_server`` on hsnap's CPU platform) as a subprocess
on a free loopback port, serving the tiny random-weight Qwen3-Next in float32:

* its log-probabilities equal those of transformers' own pure-torch Qwen3-Next on the same weights, for every
  prompt position (prefill) and every generated position (decode), within 1e-5 (measured: ~8e-7; float32 rounding
  of different but equivalent summation orders: SGLang's SDPA attention and fused MoE against transformers' eager
  code).  ``SGLANG_MAMBA_CONV_DTYPE=float32``: SGLang keeps the conv state in bfloat16 by default, which alone
  puts ~4e-4 into every decode step;
* greedy decoding is deterministic (batched with other requests: the same tokens, float32 rounding apart);
* /generate streams the same tokens as it returns unstreamed;
* SIGTERM stops it, its child processes included.
"""

from __future__ import annotations

import threading

import pytest

from engine_support import PROMPT_IDS, Server, full_distribution, reference_logprobs

pytestmark = pytest.mark.engine

TOLERANCE_FP32 = 1e-5
NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = Server(tiny_model_dir, tmp_path_factory.mktemp("server") / "server.log", "--dtype", "float32",
                 env={"SGLANG_MAMBA_CONV_DTYPE": "float32"})
    srv.start()
    print(f"\nlaunch_server: launch -> ready {srv.ready_after_s:.1f} s")
    yield srv
    srv.stop()


def _generate(server, ids, **extra):
    return server.post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, **extra})


def _tokens(out):
    return [p[1] for p in out["meta_info"]["output_token_logprobs"]], [p[0] for p in out["meta_info"]["output_token_logprobs"]]


def test_server_logits_match_transformers_prefill_and_decode(server, tiny_model_dir):
    import torch

    out = _generate(server, PROMPT_IDS, top_logprobs_num=512, logprob_start_len=0)
    meta = out["meta_info"]
    ids = [p[1] for p in meta["output_token_logprobs"]]
    prefill, decode = reference_logprobs(tiny_model_dir, PROMPT_IDS, ids, "float32")
    # input_top_logprobs[i] (i >= 1) is the distribution that predicted prompt token i: transformers' row i - 1
    sg_prefill = torch.tensor([full_distribution(top) for top in meta["input_top_logprobs"][1:]], dtype=torch.float64)
    sg_decode = torch.tensor([full_distribution(top) for top in meta["output_top_logprobs"]], dtype=torch.float64)
    assert not torch.isnan(sg_prefill).any() and not torch.isnan(sg_decode).any()
    d_prefill = (sg_prefill - prefill[:-1]).abs().max().item()
    d_decode = (sg_decode - decode).abs().max().item()
    print(f"\nmax |dlogprob| vs transformers float32: prefill {d_prefill:.2e} ({len(PROMPT_IDS) - 1} positions), "
          f"decode {d_decode:.2e} ({NEW} steps)")
    assert d_prefill <= TOLERANCE_FP32 and d_decode <= TOLERANCE_FP32
    assert ids == decode.argmax(-1).tolist()  # greedy picks the same tokens


def test_server_greedy_is_deterministic(server):
    alone = _tokens(_generate(server, PROMPT_IDS))
    assert _tokens(_generate(server, PROMPT_IDS)) == alone
    results = {}

    def run(key, ids):
        results[key] = _tokens(_generate(server, ids))

    threads = [threading.Thread(target=run, args=(k, ids)) for k, ids in
               (("target", PROMPT_IDS), ("other1", PROMPT_IDS[::-1]), ("other2", PROMPT_IDS[3:17]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    # Batched with others, the same tokens; in float32 the logprobs may move by float32 rounding only: CPU float32
    # matmuls are batch-size dependent (one row takes a GEMV path, several a GEMM path).  bfloat16 is exactly batch
    # invariant here (test_engine.py).
    assert results["target"][0] == alone[0]
    assert max(abs(a - b) for a, b in zip(results["target"][1], alone[1])) <= TOLERANCE_FP32


def test_server_streams_the_same_tokens_as_unstreamed(server):
    whole = server.post("/generate", {"input_ids": PROMPT_IDS, "sampling_params": GREEDY})
    events = server.stream("/generate", {"input_ids": PROMPT_IDS, "sampling_params": GREEDY})
    assert len(events) >= 2
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each chunk extends the previous one
    assert texts[-1] == whole["text"]
    assert events[-1]["meta_info"]["completion_tokens"] == NEW
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_server_stops_cleanly_on_sigterm_leaving_no_child(server):
    assert server.descendants, "the server should run child processes (scheduler, detokenizer)"
    code = server.stop()
    assert code is not None, f"the server did not exit after SIGTERM; log: {server.log_tail()}"
    assert server.living_descendants() == []
