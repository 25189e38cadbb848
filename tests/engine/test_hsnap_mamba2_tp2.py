"""A Mamba2 hybrid at TP 2 in the real server, and its state re-sharded between a TP 2 and a TP 1 server.

The tiny NemotronH has 8 SSM heads in 2 groups: at TP 2 each rank holds 4 heads and one group (the temporal state of
its heads, and of the conv state the x part of its heads and the B and C of its group).  Two servers with the plug-in
on, in float32 (conv state too), side by side: A at TP 2 (two scheduler ranks on gloo), B at TP 1.

* ``x`` is paused mid-decode in A into a set of two rank files, and B resumes it: re-sharded 2 -> 1 (the heads and
  groups of both ranks put side by side in each of x, B and C);
* ``y`` is paused mid-decode in B into one file, and A resumes it: re-sharded 1 -> 2 (each rank its heads and group).

Each request's whole output (before the pause in one server, after it in the other) is compared with transformers'
own float32 model run on the same weights over the same tokens: every greedy choice, and each chosen token's
log-probability within ``TOL`` (measured: 2.8e-7 for 2 -> 1, 3.4e-7 for 1 -> 2, over 24 tokens, 7 before the
pause).  The resumed request recomputes nothing: its forwards in the target are decode steps only.

Not here: one SSM group at TP 2 (GraniteMoeHybrid, Granite 4.0-H's geometry, where SGLang replicates the group on
every rank).  SGLang 0.5.23 cannot load it on CPU: ``mamba_v2_sharded_weight_loader`` (layers/attention/mamba/
mamba.py) pads a checkpoint tensor shorter than the replicated size as Qwen3-Next's q/k/v under ``is_cpu()``, and
the conv bias, one-dimensional, fails there (``loaded_weight.size(1)``: IndexError).  The replicated layout's
re-sharding is proven on SGLang's own pools in tests/test_reshard.py.
"""

from __future__ import annotations

import os

import pytest

from engine_support import reference_logprobs, retire
from hsnap_support import Stream, hsnap_server, paced, payload, prompt, start_together, stats, tokens, wait_idle

import hsnap_format as hf
from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ARCH = "nemotron_h"
N = 24  # output tokens of each moved request
K = 6  # of them decoded before its pause
# max |logprob - transformers'| of a chosen token: float32 TP 1 serves within 1e-5 (test_server_families), and so do
# both re-sharded continuations (TP 2's all-reduces sum the row-parallel products in another order)
TOL = 1e-5
FLOAT32 = ("--dtype", "float32")
FLOAT32_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


@pytest.fixture(scope="module")
def moved(tiny_arch_dir, tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP 2 on CPU needs two cores (one per rank)")
    model_dir = tiny_arch_dir(ARCH)
    work = tmp_path_factory.mktemp("hsnap-mamba2-tp2")
    a = hsnap_server(model_dir, work / "a.log", *FLOAT32, "--tp", "2", env=FLOAT32_ENV)
    b = hsnap_server(model_dir, work / "b.log", *FLOAT32, env=FLOAT32_ENV)
    start_together(a, b)
    try:
        paused = {}
        for server, rid, seed, path in ((a, "x", 81, work / "x-set"), (b, "y", 82, work / "y.hsnap")):
            ids = prompt(seed, 37)
            stream = Stream(server.url, payload(rid, ids, N))
            with paced(server.url):
                stream.start()
                stream.wait_tokens(K)
                report = client.pause(server.url, rid, str(path))
            stream.finish()
            paused[rid] = (ids, report, path, stream)
        runs = {"x": client.resume(b.url, str(paused["x"][2])), "y": client.resume(a.url, str(paused["y"][2]))}
        forwards = {"x": stats(b.url, "x")["forwards"], "y": stats(a.url, "y")["forwards"]}
        idle = {"a": wait_idle(a.url), "b": wait_idle(b.url)}
    finally:
        retire(a, b)
    return {"model_dir": model_dir, "paused": paused, "runs": runs, "forwards": forwards, "idle": idle}


def test_tp2_pause_writes_two_rank_files_each_with_half_the_heads_and_one_group(moved):
    ids, report, path, _ = moved["paused"]["x"]
    assert report["tp_size"] == 2
    with hf.open(str(path)) as snap:
        assert sorted(snap.ranks) == [0, 1]
        for rank in snap.ranks.values():
            rank.verify()
            temporal = [s for s in rank.sections if s.kind == "temporal"]
            conv = [s for s in rank.sections if s.kind == "conv"]
            assert temporal and conv
            # 8 heads of 16 channels, state 32, 2 groups: 4 heads a rank; conv = x (4 x 16) + B and C of one group (2 x 32)
            assert all(tuple(s.shape)[-3:] == (4, 16, 32) for s in temporal), [s.shape for s in temporal]
            assert all(tuple(s.shape)[-2] == 4 * 16 + 2 * 32 for s in conv), [s.shape for s in conv]


@pytest.mark.parametrize("rid, direction", [("x", "2 -> 1"), ("y", "1 -> 2")])
def test_resharded_resume_continues_as_transformers_does_decoding_only(moved, rid, direction):
    ids, report, _, stream = moved["paused"][rid]
    run = moved["runs"][rid]
    out_ids, out_lp = tokens(run.final)
    assert len(out_ids) == N and run.final["meta_info"]["finish_reason"]["type"] == "length"
    assert out_ids[:K] == tokens(stream.final)[0][:K]  # the outputs before the pause, carried over
    _, decode = reference_logprobs(moved["model_dir"], ids, out_ids, "float32")
    ref = decode.argmax(-1).tolist()
    d = max(abs(lp - decode[j, t].item()) for j, (t, lp) in enumerate(zip(out_ids, out_lp)))
    print(f"\n{direction}: max |dlogprob| vs transformers float32 over {N} tokens ({report['output_tokens']} before "
          f"the pause): {d:.2e}")
    assert out_ids == ref
    assert d <= TOL
    assert moved["forwards"][rid] == {"decode": N - report["output_tokens"], "extend": 0}


def test_both_servers_idle_with_no_leak_after_the_moves(moved):
    for idle in moved["idle"].values():
        assert idle["checks"]["pool_leak"] is False
