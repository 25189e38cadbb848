"""Qwen3.5 (SGLang's ``qwen3_5`` models: the project's reference family, Qwen3.5-35B-A3B) on hsnap's CPU platform:
``python -m hsnap_sglang.serve`` serving the tiny random-weight Qwen3.5, dense and MoE (``hsnap_sglang.tiny --arch
qwen3_5`` / ``qwen3_5_moe``), whose log-probabilities equal those of transformers' own pure-torch Qwen3.5 /
Qwen3.5-MoE on the same weights, for every prompt position (prefill) and every generated position (decode), within
1e-5 in float32 (``SGLANG_MAMBA_CONV_DTYPE=float32``, as for Qwen3-Next: test_server.py).  What it exercises beyond
Qwen3-Next: the attention output gate (``fused_sigmoid_mul_cpu``), the per-head Gemma norms with the gate split out
of q (``fused_qk_gemma_rmsnorm_with_gate_cpu``), the contiguous qkvz/ba split
(``fused_qkvzba_split_reshape_cat_contiguous_cpu``), partial rotary embeddings, a dense MLP (qwen3_5).
"""

from __future__ import annotations

import pytest

from engine_support import PROMPT_IDS, Server, full_distribution, reference_logprobs
from hsnap_support import start_together

pytestmark = pytest.mark.engine

TOLERANCE_FP32 = 1e-5
NEW = 12


ARCHS = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module")
def servers(tiny_arch_dir, tmp_path_factory):
    """One float32 server per variant, started side by side (a start is mostly imports)."""
    started = {arch: (tiny_arch_dir(arch), Server(tiny_arch_dir(arch), tmp_path_factory.mktemp(f"server-{arch}") / "server.log",
                                                   "--dtype", "float32", env={"SGLANG_MAMBA_CONV_DTYPE": "float32"}))
               for arch in ARCHS}
    start_together(*(srv for _, srv in started.values()))
    yield started
    for _, srv in started.values():
        srv.stop()


@pytest.fixture(scope="module", params=ARCHS)
def served(request, servers):
    model_dir, srv = servers[request.param]
    return request.param, model_dir, srv


def test_qwen3_5_server_logits_match_transformers_prefill_and_decode(served):
    import torch

    arch, model_dir, server = served

    out = server.post("/generate", {"input_ids": PROMPT_IDS, "return_logprob": True, "top_logprobs_num": 512,
                                    "logprob_start_len": 0,
                                    "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    meta = out["meta_info"]
    ids = [p[1] for p in meta["output_token_logprobs"]]
    prefill, decode = reference_logprobs(model_dir, PROMPT_IDS, ids, "float32")
    sg_prefill = torch.tensor([full_distribution(top) for top in meta["input_top_logprobs"][1:]], dtype=torch.float64)
    sg_decode = torch.tensor([full_distribution(top) for top in meta["output_top_logprobs"]], dtype=torch.float64)
    assert not torch.isnan(sg_prefill).any() and not torch.isnan(sg_decode).any()
    d_prefill = (sg_prefill - prefill[:-1]).abs().max().item()
    d_decode = (sg_decode - decode).abs().max().item()
    print(f"\n{arch} max |dlogprob| vs transformers float32: prefill {d_prefill:.2e} ({len(PROMPT_IDS) - 1} positions), "
          f"decode {d_decode:.2e} ({NEW} steps)")
    assert d_prefill <= TOLERANCE_FP32 and d_decode <= TOLERANCE_FP32
    assert ids == decode.argmax(-1).tolist()  # greedy picks the same tokens
    # the distributions are not flat: the comparison is about something (random weights, 512 tokens)
    assert (decode.max(-1).values - decode.min(-1).values).min().item() > 0.5
