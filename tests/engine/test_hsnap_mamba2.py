"""The hsnap server surface on Mamba2 hybrids (SGLang's ``MambaMixer2``): the tiny NemotronH, GraniteMoeHybrid and
FalconH1 of ``hsnap_sglang.tiny`` in SGLang's real server with the plug-in on (``python -m hsnap_sglang.serve``;
bfloat16, the radix cache on, chunked prefill, SGLang's strict idle memory check and tree sanity check on).

NemotronH and GraniteMoeHybrid (each layer either attention or Mamba2; Granite's Mamba2 with one SSM group, its layers
with MoE), each the same scenario in two servers of its own, A (the source) and B (the target, other capacities:
token slots, Mamba slots, running requests):

a. ``mg`` is live-migrated from A to B while both run (pre-copy rounds, then the tail);
b. on A, ``c`` streams with checkpoints (a chain: a plain link, then deltas) while ``p`` is exported mid-decode to a
   file; then A is SIGKILLed (its whole process group) with ``c`` still decoding;
c. B resumes ``p`` from its file and ``c`` from its chain's newest link;
and ``p``'s file, read back, gives each layer id to one group, with the SSM geometry of the model's config.

Every moved request asks for ``LONG`` tokens, so none can end before its pause, checkpoint or migration lands; once
it has decoded ``MORE`` tokens in B it is aborted, and the tokens and logprobs it produced (its whole output: those
before the move and those after) are compared with an uninterrupted run of that length in B, bit for bit, and its
forwards in B with "decode only" (no extend forward: no history position recomputed).  The references run side by
side, each prefilled alone, as the moved requests were (bfloat16 on this platform: a request's numbers do not depend
on the other requests of its decode batches — ``hsnap demo --arch nemotron_h`` checks it for NemotronH).

FalconH1: one server, F.  Its every layer holds attention KV *and* Mamba state side by side, and format 1.x gives
each layer id to one group only (spec 5.2; ``hsnap_format.records.Geometry``): no FalconH1 snapshot can be written
today.  What is checked is that this is a typed refusal before anything happens to the request — a pause, a
checkpoint and a migration of a FalconH1 request are refused, the request decodes on unchanged (against its
uninterrupted run), no file is left, F's pools consistent — and that F refuses a NemotronH snapshot (another model,
another layer layout) with a typed 4xx before allocating, its pools, requests and checks unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request

import pytest

from hsnap_support import Stream, error_of, flush_cache, hsnap_server, payload, prompt, start_together, stats, tokens, wait_idle

from hsnap_format import open_chain
from hsnap_format.checkpoints import newest_links, parse_link
from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ARCHS = ("nemotron_h", "granitemoehybrid")  # the families whose requests move (FalconH1: refused, see the module's docstring)
LONG = 1000  # max_new_tokens of every moved request: it never ends before the move lands (cut by an abort after)
MORE = 8  # tokens a moved request decodes in B before it is aborted
CK_EVERY = 4
MG_IDS, CK_IDS, P_IDS = prompt(81, 30), prompt(82, 26), prompt(83, 22)
# B: other capacities than A's (engine_support.Server's: 4096 tokens, 8 Mamba slots, 4 running)
B_CAPACITY = ("--max-total-tokens", "3500", "--max-mamba-cache-size", "13", "--max-running-requests", "6")


@pytest.fixture(scope="module")
def servers(tiny_arch_dir, work):
    started = {arch: {"a": hsnap_server(tiny_arch_dir(arch), work / f"{arch}-a.log"),
                      "b": hsnap_server(tiny_arch_dir(arch), work / f"{arch}-b.log", *B_CAPACITY)} for arch in ARCHS}
    started["falcon_h1"] = {"f": hsnap_server(tiny_arch_dir("falcon_h1"), work / "falcon_h1-f.log")}
    start_together(*(s for pair in started.values() for s in pair.values()))
    yield started
    for pair in started.values():
        for s in pair.values():
            s.stop()


def _abort(url: str, rid: str) -> None:
    req = urllib.request.Request(url + "/abort_request", data=json.dumps({"rid": rid}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60):
        pass


class _CutAfter:
    """An ``on_chunk`` that aborts ``rid`` in the server at ``url`` once it decoded ``n`` tokens there: its events
    carry every output id so far, the first one the ids it had before the move and one new (in a thread: the stream
    is read on meanwhile)."""

    def __init__(self, url: str, rid: str, n: int = MORE) -> None:
        self.url, self.rid, self.n, self.first, self.thread = url, rid, n, None, None

    def __call__(self, rid, text, ids, event) -> None:
        have = len(event.get("output_ids") or [])
        if self.first is None:
            self.first = have
        if have >= self.first - 1 + self.n and self.thread is None:
            self.thread = threading.Thread(target=_abort, args=(self.url, self.rid), daemon=True)
            self.thread.start()


def _references(url: str, requests: dict[str, tuple[list[int], int]]) -> dict[str, tuple[list[int], list[float]]]:
    """Uninterrupted runs of ``requests`` ({rid: (prompt ids, output tokens)}) from an empty radix tree, side by side,
    each prefilled alone (the next starts once the one before has its first token)."""
    flush_cache(url)
    streams = {}
    for rid, (ids, n) in requests.items():
        streams[rid] = Stream(url, payload(f"{rid}-ref", ids, n))
        streams[rid].start()
        streams[rid].wait_tokens(1)
    return {rid: tokens(st.finish().final) for rid, st in streams.items()}


def _scenario(servers, work, arch: str) -> dict:
    a, b = servers[arch]["a"], servers[arch]["b"]
    d = work / arch
    d.mkdir()
    out: dict = {}
    try:
        # a. live migration A -> B while both run
        m = Stream(a.url, payload("mg", MG_IDS, LONG))
        m.start()
        m.wait_tokens(4)
        cut = _CutAfter(b.url, "mg")
        out["mig"] = client.move(a.url, b.url, "mg", str(d / "mig"), tail=2, max_rounds=2, timeout_s=120, on_chunk=cut,
                                 last_source_event_at=m.last_token_at)
        out["m"] = m.finish()
        out["mg_forwards"] = stats(b.url, "mg")["forwards"]
        out["mig_idle"] = (wait_idle(a.url), wait_idle(b.url))
        # b. on A: c checkpointed (a chain), p exported mid-decode to a file; then SIGKILL
        c = Stream(a.url, payload("c", CK_IDS, LONG))
        c.start()
        c.wait_tokens(2)
        out["ck_first"] = client.checkpoint(a.url, "c", str(d / "ck"), every=CK_EVERY)
        p = Stream(a.url, payload("p", P_IDS, LONG))
        p.start()
        p.wait_tokens(6)
        out["paused"] = client.pause(a.url, "p", str(d / "p.hsnap"))
        out["p"] = p.finish()
        deadline = time.monotonic() + 300
        while stats(a.url)["checkpoints"].get("c", {}).get("links", 0) < 3:
            assert time.monotonic() < deadline and not c.done.is_set(), stats(a.url)["checkpoints"]
            time.sleep(0.05)
        os.killpg(a.proc.pid, signal.SIGKILL)  # the server's own process group (started with a new session)
        a.proc.wait(timeout=60)
        c.join(60)
        deadline = time.monotonic() + 60  # the scheduler and detokenizer die with the group, a moment later
        while a.living_descendants() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["alive"] = a.living_descendants()
        out["c"] = c
        # c. in B: p from its file, c from its chain's newest link (the client giving what its cut stream had)
        out["p_run"] = client.resume(b.url, str(d / "p.hsnap"), on_chunk=_CutAfter(b.url, "p"))
        out["p_forwards"] = stats(b.url, "p")["forwards"]
        last = c.events[-1]
        out["c_had"] = (len(last.get("text") or ""), len(last.get("output_ids") or []))
        out["c_run"] = client.resume(b.url, str(d / "ck"), seen=out["c_had"], on_chunk=_CutAfter(b.url, "c"))
        out["c_forwards"] = stats(b.url, "c")["forwards"]
        out["b_idle"] = wait_idle(b.url)
        finals = {"mg": (MG_IDS, out["mig"].run.final), "p": (P_IDS, out["p_run"].final), "c": (CK_IDS, out["c_run"].final)}
        out["refs"] = _references(b.url, {rid: (ids, len(tokens(final)[0])) for rid, (ids, final) in finals.items()})
        out["ref_idle"] = wait_idle(b.url)
    except BaseException as e:  # noqa: BLE001 - the tests of this family fail on it; the other family goes on
        out["error"] = e
        out["logs"] = {"a": a.log_tail(), "b": b.log_tail()}
    return out


@pytest.fixture(scope="module")
def scenarios(servers, work):
    done: dict = {}

    def get(arch: str) -> dict:
        if arch not in done:
            done[arch] = _scenario(servers, work, arch)
        out = done[arch]
        if "error" in out:
            raise AssertionError(f"{arch}: {out['error']!r}; logs: {out['logs']}") from out["error"]
        return out

    return get


def _consistent(idle: dict) -> None:
    checks = idle["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True and checks.get("tree_sanity", "ok") == "ok", checks


@pytest.mark.parametrize("arch", ARCHS)
def test_live_migration_continues_exactly_and_leaves_both_servers_consistent(scenarios, arch):
    s = scenarios(arch)
    mig = s["mig"]
    run, src = mig.run, mig.source
    assert s["m"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    assert run.final["meta_info"]["finish_reason"]["type"] == "abort"  # cut in B once it had decoded on there
    ids, lps = tokens(run.final)
    assert len(ids) >= src["output_tokens"] + MORE
    assert (ids, lps) == s["refs"]["mg"]
    assert s["mg_forwards"]["extend"] == 0 and s["mg_forwards"]["decode"] >= MORE
    assert [a["committed_positions"] for a in run.info["links"]] == [r["committed_positions"] for r in src["rounds"]] + [
        src["committed_positions"]]
    for idle in s["mig_idle"]:
        _consistent(idle)
    assert s["mig_idle"][1]["requests"]["running"] == [] and s["mig_idle"][1]["follows"] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_request_resumes_exactly_after_the_source_was_killed(scenarios, arch):
    s = scenarios(arch)
    assert s["alive"] == []
    assert s["p"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    k = s["paused"]["output_tokens"]
    assert s["paused"]["committed_positions"] == len(P_IDS) + k - 1
    run = s["p_run"]
    assert run.aborted and run.info["ok"], run.info
    ids, lps = tokens(run.final)
    assert len(ids) >= k + MORE
    assert (ids, lps) == s["refs"]["p"]
    assert ids[:k] == s["p"].final["output_ids"][:k]
    assert s["p_forwards"]["extend"] == 0 and s["p_forwards"]["decode"] >= MORE  # decoded on: nothing recomputed


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_file_gives_each_layer_to_its_one_group_with_the_family_geometry(scenarios, tiny_arch_dir, work, arch):
    """The paused request's file, read back: the attention layers and the Mamba2 layers of the model's config, each
    id in one group, and the Mamba2 slot of the config's SSM geometry (conv ``x|B|C`` = H·P + 2·G·N channels, K−1
    taps; temporal [H, P, N]) — NemotronH with G = 2, GraniteMoeHybrid with its one group (G = 1)."""
    from hsnap_format import open_snapshot
    from hsnap_sglang.tiny import load_reference_model

    scenarios(arch)
    cfg = load_reference_model(tiny_arch_dir(arch)).config
    if arch == "nemotron_h":
        heads, head_dim, state, groups, kernel = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups, cfg.conv_kernel
    else:
        heads, head_dim, state, groups, kernel = (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups,
                                                  cfg.mamba_d_conv)
    kinds = list(cfg.layer_types)
    with open_snapshot(str(work / arch / "p.hsnap")) as snap:
        g = snap.geometry
    assert g.attention is not None and g.mamba is not None
    assert list(g.attention.layers) == [i for i, k in enumerate(kinds) if k == "full_attention"] != []
    assert list(g.mamba.layers) == [i for i, k in enumerate(kinds) if k == "linear_attention"] != []
    assert g.attention.heads == cfg.num_key_value_heads and not g.attention.swa_layers
    assert [list(c) for c in g.mamba.conv_shapes] == [[heads * head_dim + 2 * groups * state, kernel - 1]]
    assert list(g.mamba.temporal_shape) == [heads, head_dim, state]
    assert groups == {"nemotron_h": 2, "granitemoehybrid": 1}[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_chain_resumes_from_its_newest_link_exactly(scenarios, work, arch):
    s = scenarios(arch)
    c = s["c"]
    assert c.events[-1]["meta_info"]["finish_reason"] is None  # the stream was cut by the kill, mid-decode
    first = s["ck_first"]
    assert first["link"] == 1 and first["base"] is None and first["every"] == CK_EVERY
    ck = work / arch / "ck"
    newest = newest_links(str(ck))["c"]
    links = sorted(parse_link(n)[1] for n in os.listdir(ck) if parse_link(n))
    assert parse_link(os.path.basename(newest))[1] == links[-1] == len(links) >= 3
    with open_chain(newest) as chain:
        assert len(chain) == len(links) and chain.links[0].base is None and all(x.base is not None for x in chain.links[1:])
        chain.verify()
        at_link = chain.head.request["output_tokens"]
    info = s["c_run"].info[0]
    assert info["ok"] and info["path"] == newest and info["result"]["committed_positions"] == len(CK_IDS) + at_link - 1
    ids, lps = tokens(s["c_run"].final)
    assert len(ids) >= at_link + MORE
    assert (ids, lps) == s["refs"]["c"]
    assert s["c_forwards"]["extend"] == 0 and s["c_forwards"]["decode"] >= MORE
    for idle in (s["b_idle"], s["ref_idle"]):
        _consistent(idle)


# ----------------------------------------------------------------------------- FalconH1


@pytest.fixture(scope="module")
def falcon(servers, work):
    url = servers["falcon_h1"]["f"].url
    d = work / "falcon_h1"
    d.mkdir()
    f = Stream(url, payload("f", P_IDS, LONG))
    f.start()
    f.wait_tokens(4)
    out = {"pause": error_of(client.pause, url, "f", str(d / "f.hsnap")),
           "checkpoint": error_of(client.checkpoint, url, "f", str(d / "ck"), every=CK_EVERY),
           "migrate": error_of(client.migrate, url, "f", str(d / "mig"), timeout_s=30)}
    at = f.tokens_so_far()
    f.wait_tokens(at + MORE)  # it decodes on after the refusals
    _abort(url, "f")
    out["f"] = f.finish()
    out["idle"] = wait_idle(url)
    out["files"] = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    out["ref"] = _references(url, {"f": (P_IDS, len(tokens(out["f"].final)[0]))})["f"]
    out["at"] = at
    return out


def test_falcon_h1_snapshot_is_refused_typed_and_the_request_decodes_on(falcon):
    for what in ("pause", "checkpoint", "migrate"):
        e = falcon[what]
        assert isinstance(e, client.ServerError), f"{what}: not refused"
        # the writer's own check (it refuses what a reader would refuse), before the request is stopped
        assert e.error_type == "MalformedHeaderError" and 400 <= e.status < 500 and "each layer id in one group only" in str(e), e
    f = falcon["f"].final
    assert f["meta_info"]["finish_reason"]["type"] == "abort"  # not ended by an export: it decoded on until aborted
    ids, lps = tokens(f)
    assert len(ids) >= falcon["at"] + MORE
    assert (ids, lps) == falcon["ref"]
    assert not [p for p in falcon["files"] if p.endswith(".hsnap")], falcon["files"]  # no snapshot, no link
    _consistent(falcon["idle"])


def test_snapshot_of_another_family_is_refused_before_allocating(scenarios, servers, work):
    scenarios("nemotron_h")
    foreign = work / "nemotron_h-p-into-falcon_h1.hsnap"
    shutil.copyfile(work / "nemotron_h" / "p.hsnap", foreign)  # a copy: not claimed by its own resume
    url = servers["falcon_h1"]["f"].url
    before = wait_idle(url)
    e = error_of(client.resume, url, str(foreign))
    after = wait_idle(url)
    assert e is not None and e.error_type == "IncompatibleSnapshotError" and 400 <= e.status < 500, e
    fields = {f for f, *_ in e.error["differences"]}
    assert "identity.weights_hash" in fields and "geometry.attention.layers" in fields, fields
    state = lambda st: {"pools": st["pools"], "requests": st["requests"], "checks": {k: v for k, v in st["checks"].items() if k != "messages"}}  # noqa: E731
    assert state(before) == state(after)
