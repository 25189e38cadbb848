"""Every hybrid family SGLang serves here, on hsnap's CPU platform: ``python -m hsnap_sglang.serve`` serving each tiny
random-weight model (``hsnap_sglang.tiny --arch ARCH``) gives the log-probabilities of transformers' own pure-torch
model on the same weights, for every prompt position (prefill) and every generated position (decode), within 1e-5
in float32 (``SGLANG_MAMBA_CONV_DTYPE=float32``: SGLang keeps the conv state in bfloat16 by default, which alone puts
~4e-4 into every decode step).  One server per family, all started side by side.

The prompt (72 tokens) is prefilled in chunks of 40 tokens (``--chunked-prefill-size 40``), so the second chunk starts
from the conv and recurrent states the first left in the pool (``has_initial_state``), off the SSD chunk grid (16).

* Qwen3-Next (the tiny model of the hsnap tests): within 1e-5 (measured: ~8e-7; float32 rounding of different but
  equivalent summation orders: SGLang's SDPA attention and fused MoE against transformers' eager code).  Its server
  also shows the serving basics: greedy decoding is deterministic (batched with other requests: the same tokens,
  float32 rounding apart), /generate streams the same tokens as it returns unstreamed, and SIGTERM stops it, its
  child processes included (the module's last test).
* Qwen3.5, dense and MoE (SGLang's ``qwen3_5`` models: the project's reference family, Qwen3.5-35B-A3B), beyond
  Qwen3-Next: the attention output gate (``fused_sigmoid_mul_cpu``), the per-head Gemma norms with the gate split out
  of q (``fused_qk_gemma_rmsnorm_with_gate_cpu``), the contiguous qkvz/ba split
  (``fused_qkvzba_split_reshape_cat_contiguous_cpu``), partial rotary embeddings, a dense MLP (qwen3_5).
* Mamba2 (SGLang's ``MambaMixer2``): NemotronH (Mamba2, attention, Mamba2, MLP), FalconH1 (attention and Mamba2 side
  by side in every layer, muP multipliers), GraniteMoeHybrid (Mamba2 and attention layers with MoE): the Mamba2 conv
  (``mamba.py``'s names the platform binds), the SSD scan and the decode step (the two Triton launchers it
  replaces), SGLang's own gated RMSNorm (``Mixer2RMSNormGated.forward_native``).
* LFM2 (short conv, attention, short conv, short conv; SGLang's ``ShortConvAttnBackend``): the gated depthwise conv
  through ``causal_conv1d.py``'s non-CUDA path (the Triton causal conv the platform replaces), whose conv state is
  the only per-request state (the pool's temporal state has no elements).
"""

from __future__ import annotations

import json

import pytest

from engine_support import PROMPT_IDS, Server, full_distribution, reference_logprobs, retire
from hsnap_support import start_together

pytestmark = pytest.mark.engine

TOLERANCE_FP32 = 1e-5
NEW = 12
PREFILL_CHUNK = 40

MAMBA2 = ("nemotron_h", "falcon_h1", "granitemoehybrid")
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", *MAMBA2, "lfm2")
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _generate(server, ids, **extra):
    return server.post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, **extra})


def _tokens(out):
    return [p[1] for p in out["meta_info"]["output_token_logprobs"]], [p[0] for p in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def servers(tiny_arch_dir, tmp_path_factory):
    """One float32 server per family, started side by side (a start is mostly imports)."""
    started = {arch: (tiny_arch_dir(arch), Server(tiny_arch_dir(arch), tmp_path_factory.mktemp(f"server-{arch}") / "server.log",
                                                   "--dtype", "float32", "--chunked-prefill-size", str(PREFILL_CHUNK),
                                                   env={"SGLANG_MAMBA_CONV_DTYPE": "float32"}))
               for arch in ARCHS}
    start_together(*(srv for _, srv in started.values()))
    yield started
    retire(*(srv for _, srv in started.values()))


@pytest.fixture(scope="module", params=ARCHS)
def served(request, servers):
    model_dir, srv = servers[request.param]
    return request.param, model_dir, srv


def test_server_logits_match_transformers_prefill_and_decode(served):
    import torch

    arch, model_dir, server = served

    out = _generate(server, PROMPT_IDS, top_logprobs_num=512, logprob_start_len=0)
    meta = out["meta_info"]
    ids = [p[1] for p in meta["output_token_logprobs"]]
    prefill, decode = reference_logprobs(model_dir, PROMPT_IDS, ids, "float32")
    sg_prefill = torch.tensor([full_distribution(top) for top in meta["input_top_logprobs"][1:]], dtype=torch.float64)
    sg_decode = torch.tensor([full_distribution(top) for top in meta["output_top_logprobs"]], dtype=torch.float64)
    assert not torch.isnan(sg_prefill).any() and not torch.isnan(sg_decode).any()
    d_prefill = (sg_prefill - prefill[:-1]).abs().max().item()
    d_decode = (sg_decode - decode).abs().max().item()
    print(f"\n{arch} max |dlogprob| vs transformers float32: prefill {d_prefill:.2e} ({len(PROMPT_IDS) - 1} positions, "
          f"chunks of {PREFILL_CHUNK}), decode {d_decode:.2e} ({NEW} steps)")
    assert d_prefill <= TOLERANCE_FP32 and d_decode <= TOLERANCE_FP32
    assert ids == decode.argmax(-1).tolist()  # greedy picks the same tokens
    # the distributions are not flat: the comparison is about something (random weights, 512 tokens)
    assert (decode.max(-1).values - decode.min(-1).values).min().item() > 0.5


@pytest.fixture(scope="module")
def sglang_geometries(tiny_arch_dir):
    """arch -> the layers and Mamba2 state shapes SGLang's own config class gives each tiny Mamba2 model.  SGLang's
    config classes import SGLang's runtime: one child for the three, opted in (as a server process is)."""
    import os
    import subprocess
    import sys

    dirs = {arch: str(tiny_arch_dir(arch)) for arch in MAMBA2}
    probe = (
        "import json, sys\n"
        "from sglang.srt.runtime_context import get_parallel\n"
        "from sglang.srt.utils.hf_transformers_utils import get_config\n"
        "out = {}\n"
        "for arch, model_dir in json.loads(sys.argv[1]).items():\n"
        "    c = get_config(model_dir, trust_remote_code=False)\n"
        "    with get_parallel().override(attn_tp_size=1):\n"
        "        params = c.mamba2_cache_params\n"
        "    out[arch] = {'cls': type(c).__module__, 'mamba_layers': list(params.layers),"
        " 'conv': [list(s) for s in params.shape.conv], 'temporal': list(params.shape.temporal)}\n"
        # what the server's re-sharding reads of the config (hsnap_sglang.sharding) against SGLang's own shapes, per TP
        "    from hsnap_io.reshard import state_shape\n"
        "    from hsnap_sglang.sharding import tp_model\n"
        "    m = tp_model(c)\n"
        "    for tp in (1, 2):\n"
        "        with get_parallel().override(attn_tp_size=tp):\n"
        "            theirs = c.mamba2_cache_params.shape\n"
        "        ours = state_shape(m.mamba, tp, m.conv_kernel)\n"
        "        out[arch][f'tp{tp}'] = [[list(x) for x in theirs.conv], list(theirs.temporal), [list(x) for x in ours.conv], list(ours.temporal)]\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(dirs)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HSNAP_SGLANG_CPU="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", MAMBA2)
def test_tiny_mamba2_config_has_one_geometry_for_transformers_and_sglang(tiny_arch_dir, sglang_geometries, arch):
    """The config.json the tiny recipe writes gives SGLang's config class (what sizes its Mamba pool and layers) the
    same layers and SSM geometry as transformers' (what the reference computes with); and the server's re-sharding
    (hsnap_sglang.sharding) reads that config into SGLang's own state shapes at TP 1 and TP 2."""
    from hsnap_sglang.tiny import load_reference_model

    cfg = load_reference_model(tiny_arch_dir(arch)).config
    sg = sglang_geometries[arch]
    assert sg["cls"].startswith("sglang.srt.configs."), sg  # SGLang's own config class, not transformers'
    if arch == "nemotron_h":
        heads, head_dim, state, groups, kernel = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size,
                                                  cfg.n_groups, cfg.conv_kernel)
    else:
        heads, head_dim, state, groups, kernel = (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state,
                                                  cfg.mamba_n_groups, cfg.mamba_d_conv)
    assert groups < heads and groups in (1, 2)
    assert sg["temporal"] == [heads, head_dim, state]
    for tp in ("tp1", "tp2"):  # the server's re-sharding (hsnap_sglang.sharding) reads the config as SGLang does
        theirs_conv, theirs_temporal, ours_conv, ours_temporal = sg[tp]
        assert (ours_conv, ours_temporal) == (theirs_conv, theirs_temporal), (tp, sg[tp])
    assert sg["conv"] == [[heads * head_dim + 2 * groups * state, kernel - 1]]
    layer_kinds = getattr(cfg, "layers_block_type", None) or cfg.layer_types
    expected = ([i for i, kind in enumerate(layer_kinds) if kind in ("mamba", "linear_attention")]
                if arch != "falcon_h1" else list(range(cfg.num_hidden_layers)))
    assert sg["mamba_layers"] == expected


@pytest.fixture(scope="module")
def qwen3_next(servers):
    return servers["qwen3_next"][1]


def test_server_greedy_is_deterministic(qwen3_next):
    import threading

    server = qwen3_next
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


def test_server_streams_the_same_tokens_as_unstreamed(qwen3_next):
    server = qwen3_next
    whole = server.post("/generate", {"input_ids": PROMPT_IDS, "sampling_params": GREEDY})
    events = server.stream("/generate", {"input_ids": PROMPT_IDS, "sampling_params": GREEDY})
    assert len(events) >= 2
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each chunk extends the previous one
    assert texts[-1] == whole["text"]
    assert events[-1]["meta_info"]["completion_tokens"] == NEW
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_server_stops_cleanly_on_sigterm_leaving_no_child(qwen3_next):
    """The module's last test: it stops the Qwen3-Next server."""
    server = qwen3_next
    assert server.descendants, "the server should run child processes (scheduler, detokenizer)"
    code = server.stop()
    assert code is not None, f"the server did not exit after SIGTERM; log: {server.log_tail()}"
    assert server.living_descendants() == []
