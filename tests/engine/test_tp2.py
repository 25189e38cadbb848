"""TP 2 on CPU: ``python -m hsnap_sglang.serve --tp 2`` runs two scheduler ranks (gloo all-reduce; one core range per
rank through SGLANG_CPU_OMP_THREADS_BIND, which the wrapper sets) over the tiny Qwen3-Next, and serves greedy
requests deterministically, within bfloat16 rounding of transformers' float32 model (tolerance: see test_engine.py;
the TP-sharded reductions add their own rounding)."""

from __future__ import annotations

import os

import pytest

from engine_support import PROMPT_IDS, Server, full_distribution, reference_logprobs

pytestmark = pytest.mark.engine

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tp2_server(tiny_model_dir, tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP 2 on CPU needs two cores (one per rank)")
    srv = Server(tiny_model_dir, tmp_path_factory.mktemp("tp2") / "server.log", "--tp", "2", "--dtype", "bfloat16")
    srv.start()
    print(f"\nlaunch_server --tp 2: launch -> ready {srv.ready_after_s:.1f} s")
    yield srv
    srv.stop()


def test_item6_tp2_serves_greedy_deterministically_close_to_transformers(tp2_server, tiny_model_dir):
    import torch

    payload = {"input_ids": PROMPT_IDS, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 512}
    first, second = tp2_server.post("/generate", payload), tp2_server.post("/generate", payload)
    assert first["meta_info"]["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"]
    ids = [p[1] for p in first["meta_info"]["output_token_logprobs"]]
    _, decode = reference_logprobs(tiny_model_dir, PROMPT_IDS, ids, "float32")
    rows = torch.tensor([full_distribution(t) for t in first["meta_info"]["output_top_logprobs"]], dtype=torch.float64)
    assert (rows - decode).abs().max().item() <= 0.25
    assert tp2_server.stop() is not None and tp2_server.living_descendants() == []
