"""Mamba2 hybrids at TP 2 in the real server, and their state re-sharded between a TP 2 and a TP 1 server.

Two layouts.  The tiny NemotronH has 8 SSM heads in 2 groups: at TP 2 each rank holds 4 heads and one group (the
temporal state of its heads; of the conv state the x part of its heads and the B and C of its group).  The tiny
GraniteMoeHybrid has one group for its 8 heads (Granite 4.0-H's geometry): at TP 2 each rank holds 4 heads and the
one group whole (SGLang replicates it on every rank; on CPU it loads through hsnap's
``hsnap_sglang.cpu.fill_in.replicated_groups_loader``: SGLang 0.5.23's own CPU branch of
``mamba_v2_sharded_weight_loader`` cannot load it).  Per model, two servers with the plug-in on, in float32 (conv
state too), side by side: A at TP 2 (two scheduler ranks on gloo), B at TP 1.

* ``x`` is paused mid-decode in A into a set of two rank files, and B resumes it: re-sharded 2 -> 1 (the heads of
  both ranks side by side; groups side by side, or a replicated group read from one rank);
* ``y`` is paused mid-decode in B into one file, and A resumes it: re-sharded 1 -> 2 (each rank its heads, and its
  group or a copy of the one group);
* ``xm`` is live-migrated A -> B and ``ym`` B -> A while they decode: every link (pre-copy rounds, the final one)
  re-sharded by the target as it is applied.

Each request's whole output (before the pause in one server, after it in the other) is compared with transformers'
own float32 model run on the same weights over the same tokens: every greedy choice, and each chosen token's
log-probability within ``TOL`` (measured, 2 -> 1 and 1 -> 2 over 24 tokens, 7 before the pause: NemotronH 2.8e-7 and
3.4e-7, GraniteMoeHybrid 3.2e-7 and 2.6e-7).  The resumed request recomputes nothing: its forwards in the target are decode steps only.
"""

from __future__ import annotations

import os

import pytest

from engine_support import reference_logprobs, retire
from hsnap_support import Stream, hsnap_server, paced, payload, prompt, start_together, stats, tokens, wait_idle

import hsnap_format as hf
from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ARCHS = ("nemotron_h", "granitemoehybrid")
N = 24  # output tokens of each moved request
K = 6  # of them decoded before its pause (or its live migration's start)
NM = 64  # output tokens of each live-migrated request
# max |logprob - transformers'| of a chosen token: float32 TP 1 serves within 1e-5 (test_server_families), and so do
# both re-sharded continuations (TP 2's all-reduces sum the row-parallel products in another order)
TOL = 1e-5
FLOAT32 = ("--dtype", "float32")
FLOAT32_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


@pytest.fixture(scope="module", params=ARCHS)
def moved(request, tiny_arch_dir, tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP 2 on CPU needs two cores (one per rank)")
    model_dir = tiny_arch_dir(request.param)
    work = tmp_path_factory.mktemp(f"hsnap-mamba2-tp2-{request.param}")
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
        # live migrations across TP sizes: xm A -> B (each link a set of two rank files, re-sharded 2 -> 1 by B as it
        # applies it), ym B -> A (each link one file, re-sharded 1 -> 2 by each rank of A)
        migrated = {}
        for source, target, rid, seed in ((a, b, "xm", 83), (b, a, "ym", 84)):
            ids = prompt(seed, 37)
            stream = Stream(source.url, payload(rid, ids, NM))
            with paced(source.url):  # the NM - K tokens after the move's start take 5.8 s at least: it ends while the request decodes
                stream.start()
                stream.wait_tokens(K)
                move = client.move(source.url, target.url, rid, str(work / f"{rid}-mig"), tail=2, max_rounds=2, timeout_s=120)
            stream.finish()
            migrated[rid] = (ids, move, stream)
            forwards[rid] = stats(target.url, rid)["forwards"]
        idle = {"a": wait_idle(a.url), "b": wait_idle(b.url)}
    finally:
        retire(a, b)
    return {"arch": request.param, "model_dir": model_dir, "paused": paused, "runs": runs, "forwards": forwards, "idle": idle,
            "migrated": migrated}


def test_tp2_pause_writes_two_rank_files_each_with_half_the_heads_and_one_group(moved):
    """NemotronH: one of its two groups a rank; GraniteMoeHybrid: its one group on both ranks (the same bytes)."""
    ids, report, path, _ = moved["paused"]["x"]
    assert report["tp_size"] == 2
    with hf.open(str(path)) as snap:
        assert sorted(snap.ranks) == [0, 1]
        for rank in snap.ranks.values():
            rank.verify()
            temporal = [s for s in rank.sections if s.kind == "temporal"]
            conv = [s for s in rank.sections if s.kind == "conv"]
            assert temporal and conv
            # 8 heads of 16 channels, state 32: 4 heads a rank; conv = x (4 x 16) + B and C of one group (2 x 32)
            assert all(tuple(s.shape)[-3:] == (4, 16, 32) for s in temporal), [s.shape for s in temporal]
            assert all(tuple(s.shape)[-2] == 4 * 16 + 2 * 32 for s in conv), [s.shape for s in conv]
        # the group part of each conv state (B and C, the channels after x): one group replicated is the same bytes on
        # both ranks; two groups split are two groups (other bytes)
        groups = [[snap.ranks[r].array(s, verify=True)[..., 4 * 16:, :].tobytes() for s in snap.ranks[r].sections if s.kind == "conv"]
                  for r in (0, 1)]
        assert (groups[0] == groups[1]) == (moved["arch"] == "granitemoehybrid")


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
    print(f"\n{moved['arch']} {direction}: max |dlogprob| vs transformers float32 over {N} tokens ({report['output_tokens']} before "
          f"the pause): {d:.2e}")
    assert out_ids == ref
    assert d <= TOL
    assert moved["forwards"][rid] == {"decode": N - report["output_tokens"], "extend": 0}


@pytest.mark.parametrize("rid, direction", [("xm", "2 -> 1"), ("ym", "1 -> 2")])
def test_live_migration_across_tp_sizes_continues_as_transformers_does_decoding_only(moved, rid, direction):
    """Pre-copy rounds and the final link written at the source's TP size, each re-sharded by the target as it is
    applied (rank by rank at TP 2, in step): every greedy choice of the whole output is transformers' and each
    log-probability within TOL; the target only decoded."""
    ids, move, stream = moved["migrated"][rid]
    src, run = move.source, move.run
    assert stream.final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    assert src["tp_size"] == (2 if rid == "xm" else 1) and len(src["rounds"]) >= 1
    out_ids, out_lp = tokens(run.final)
    assert len(out_ids) == NM and run.final["meta_info"]["finish_reason"]["type"] == "length"
    _, decode = reference_logprobs(moved["model_dir"], ids, out_ids, "float32")
    d = max(abs(lp - decode[j, t].item()) for j, (t, lp) in enumerate(zip(out_ids, out_lp)))
    print(f"\n{moved['arch']} live {direction}: max |dlogprob| vs transformers float32 over {NM} tokens ({src['output_tokens']} "
          f"before the stop, {len(src['rounds'])} rounds): {d:.2e}")
    assert out_ids == decode.argmax(-1).tolist()
    assert d <= TOL
    assert moved["forwards"][rid] == {"decode": NM - src["output_tokens"], "extend": 0}


def test_both_servers_idle_with_no_leak_after_the_moves(moved):
    for idle in moved["idle"].values():
        assert idle["checks"]["pool_leak"] is False
