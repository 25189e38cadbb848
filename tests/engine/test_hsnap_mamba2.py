"""The hsnap server surface on Mamba2 hybrids (SGLang's ``MambaMixer2``): the tiny NemotronH, GraniteMoeHybrid and
FalconH1 of ``hsnap_sglang.tiny`` in SGLang's real server with the plug-in on (``python -m hsnap_sglang.serve``;
bfloat16, the radix cache on, chunked prefill, SGLang's strict idle memory check and tree sanity check on).

NemotronH, GraniteMoeHybrid (each layer either attention or Mamba2; Granite's Mamba2 with one SSM group, its layers
with MoE) and FalconH1 (every layer attention *and* Mamba2 side by side: format 1.4's ``parallel-layers``, spec 5.2),
each the same scenario in two servers of its own, A (the source) and B (the target, other capacities: token slots,
Mamba slots, running requests):

a. ``mg`` is live-migrated from A to B while both run (pre-copy rounds, then the tail);
b. on A, ``c`` streams with checkpoints (a chain: a plain link, then deltas) while ``p`` is exported mid-decode to a
   file; then A is SIGKILLed (its whole process group) with ``c`` still decoding;
c. B resumes ``p`` from its file and ``c`` from its chain's newest link;
and ``p``'s file, read back, gives the layers to the groups of the model's config (FalconH1: each layer to both), with
the SSM geometry of the config.

Every moved request asks for ``LONG`` tokens, decoded in a paced A (SGLang's ``/slow_down``), so none can end before
its pause, checkpoint or migration lands; once it has decoded ``MORE`` tokens in B it is aborted, and the tokens and
logprobs it produced (its whole output: those before the move and those after) are compared with an uninterrupted run
of that length in B, bit for bit, and its forwards in B with "decode only" (no extend forward: no history position
recomputed). The references run side by side, each prefilled alone, as the moved requests were (bfloat16 on this
platform: a request's numbers do not depend on the other requests of its decode batches — ``hsnap demo --arch
nemotron_h`` checks it for NemotronH). Not so FalconH1's: a request's log-probabilities move by up to ~5e-7 with its
batch (measured; the first difference came before the move, in A), so FalconH1's moved requests are compared token
for token and within 1e-5. FalconH1's B also refuses a NemotronH snapshot (another model, another layer layout) with
a typed 4xx before allocating, its pools, requests and checks unchanged.

A dedup drain of NemotronH's B (its scenario done): three requests decoding side by side, two sharing a two-page
prompt prefix through the radix cache, drained into one directory (the prefix's pages stored once) and resumed there
in the same server: each equal to its uninterrupted run bit for bit, decode only after the resume.

LFM2 (Liquid's short-conv hybrid: SGLang's ``ShortConvAttnBackend``, whose Mamba slot holds a conv state and a
zero-element temporal state) runs the same moves a–c in its own A and B (bit for bit, decode only); then a request
paused mid-decode to a file is resumed in B itself (the export freed its slots; SGLang's Mamba free list hands out the
oldest free slot first, so the restore gets another one) and compared with its uninterrupted run as above; the file
gives the conv layers to the Mamba group with the conv slot ``[hidden, conv_L_cache - 1]`` and the temporal state
``[1, hidden, 0]``.

Retraction to disk (``HSNAP_RETRACT_DIR``): one NemotronH server, R, under SGLang's own forced retraction
(``SGLANG_TEST_RETRACT``: every third forward retracts the decoding request with the fewest outputs, never the last
one of a batch).  Three requests side by side are retracted over and over; each time hsnap writes it to a file and
restores it into the running batch: every token and logprob equal to its uninterrupted run alone, one extend forward
(its first prefill) and decodes only, no file left.  SGLang's own retraction (the plug-in's off) re-prefilled the
youngest request 18 times in the same run and moved its logprobs by 1.5e-5 (measured).  A request aborted while held
(its file being written: the link writer's test gate holds it) ends aborted.  A retracted request's file is read and
hashed off the scheduler thread (R proves every one there): with that proof held by the test gate, the request beside
it decodes on and the held one comes back exactly once let go; one aborted meanwhile ends aborted.  With the directory replaced by a file,
every write fails and SGLang recomputes the requests (they finish; a near-tie token of a random-weight model may
differ after a re-prefill); the pools are clean after each.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request

import pytest

from engine_support import retire
from hsnap_support import (Stream, error_of, flush_cache, generate, hsnap_server, linkgate_env, paced, payload, prompt, start_together,
                           stats, tokens, wait_idle, wait_links)

from hsnap_format import open_chain
from hsnap_format.checkpoints import newest_links, parse_link
from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ARCHS = ("nemotron_h", "granitemoehybrid", "falcon_h1")
MOVED_ARCHS = (*ARCHS, "lfm2")  # the moves (migration, a SIGKILLed source, a chain) run for LFM2's short conv too
LONG = 1000  # max_new_tokens of every moved request: it never ends before the move lands (cut by an abort after)
MORE = 8  # tokens a moved request decodes in B before it is aborted
# each forward of B sleeps this long while a moved request runs there: its LONG tokens take 50 s at least, so the
# abort after MORE lands first on any load (unpaced, a loaded machine once streamed B's events late enough that the
# request reached its length before the cut was sent)
CUT_PACE_S = 0.05
# each forward of A sleeps this long while its requests are moved out: LONG tokens take 50 s at least there, so the
# migration, the checkpoints and the pause land while they decode, on any load (unpaced, a loaded machine once took
# longer to migrate mg than A took to decode its 1000 tokens: the migration was refused as finished)
SOURCE_PACE_S = 0.05
CK_EVERY = 4
MG_IDS, CK_IDS, P_IDS = prompt(81, 30), prompt(82, 26), prompt(83, 22)
# B: other capacities than A's (engine_support.Server's: 4096 tokens, 8 Mamba slots, 4 running)
B_CAPACITY = ("--max-total-tokens", "3500", "--max-mamba-cache-size", "13", "--max-running-requests", "6")


@pytest.fixture(scope="module")
def servers(tiny_arch_dir, work):
    started = {arch: {"a": hsnap_server(tiny_arch_dir(arch), work / f"{arch}-a.log"),
                      "b": hsnap_server(tiny_arch_dir(arch), work / f"{arch}-b.log", *B_CAPACITY)} for arch in MOVED_ARCHS}
    (work / "retract-gate").mkdir()
    started["retract"] = {"r": hsnap_server(tiny_arch_dir("nemotron_h"), work / "retract-r.log",
                                            env={"SGLANG_TEST_RETRACT": "1", "HSNAP_RETRACT_DIR": str(work / "retracted"),
                                                 # every retracted request's file proved off the scheduler thread
                                                 "HSNAP_PROOF_ON_SCHEDULER_BYTES": "0", **linkgate_env(work / "retract-gate")})}
    start_together(*(s for pair in started.values() for s in pair.values()))
    yield started
    retire(*(s for pair in started.values() for s in pair.values()))


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
        with paced(a.url, SOURCE_PACE_S):
            m = Stream(a.url, payload("mg", MG_IDS, LONG))
            m.start()
            m.wait_tokens(4)
            cut = _CutAfter(b.url, "mg")
            with paced(b.url, CUT_PACE_S):
                out["mig"] = client.move(a.url, b.url, "mg", str(d / "mig"), tail=2, max_rounds=2, timeout_s=120, on_chunk=cut,
                                         last_source_event_at=m.last_token_at)
        out["m"] = m.finish()
        out["mg_forwards"] = stats(b.url, "mg")["forwards"]
        out["mig_idle"] = (wait_idle(a.url), wait_idle(b.url))
        # b. on A: c checkpointed (a chain), p exported mid-decode to a file; then SIGKILL (inside the pace: A is gone)
        with paced(a.url, SOURCE_PACE_S):
            c = Stream(a.url, payload("c", CK_IDS, LONG))
            c.start()
            c.wait_tokens(2)
            out["ck_first"] = client.checkpoint(a.url, "c", str(d / "ck"), every=CK_EVERY)
            p = Stream(a.url, payload("p", P_IDS, LONG))
            p.start()
            p.wait_tokens(6)
            out["paused"] = client.pause(a.url, "p", str(d / "p.hsnap"))
            out["p"] = p.finish()
            wait_links(a.url, "c", 3, timeout=300, stream=c)
            out["alive"] = a.crash()
        c.join(60)
        out["c"] = c
        # c. in B: p from its file, c from its chain's newest link (the client giving what its cut stream had)
        with paced(b.url, CUT_PACE_S):
            out["p_run"] = client.resume(b.url, str(d / "p.hsnap"), on_chunk=_CutAfter(b.url, "p"))
        out["p_forwards"] = stats(b.url, "p")["forwards"]
        last = c.events[-1]
        out["c_had"] = (len(last.get("text") or ""), len(last.get("output_ids") or []))
        with paced(b.url, CUT_PACE_S):
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


# FalconH1's bfloat16 decode on this CPU platform is not batch-invariant: a request decoded beside others gets
# log-probabilities up to ~5e-7 away from the same request decoded in another batch (its tokens the same), so its
# moved requests, whose batches in A and B differ from their references', are compared token for token and within
# this bound; the other families' are bit-identical.
NOT_BATCH_INVARIANT_LOGPROB_TOL = {"falcon_h1": 1e-5}


def _assert_same_run(got: tuple[list[int], list[float]], ref: tuple[list[int], list[float]], arch: str) -> None:
    assert got[0] == ref[0]
    tol = NOT_BATCH_INVARIANT_LOGPROB_TOL.get(arch)
    if tol is None:
        assert got[1] == ref[1]
    else:
        assert len(got[1]) == len(ref[1]) and max(abs(a - b) for a, b in zip(got[1], ref[1])) <= tol


def _consistent(idle: dict) -> None:
    checks = idle["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True and checks.get("tree_sanity", "ok") == "ok", checks


@pytest.mark.parametrize("arch", MOVED_ARCHS)
def test_live_migration_continues_exactly_and_leaves_both_servers_consistent(scenarios, arch):
    s = scenarios(arch)
    mig = s["mig"]
    run, src = mig.run, mig.source
    assert s["m"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    assert run.final["meta_info"]["finish_reason"]["type"] == "abort"  # cut in B once it had decoded on there
    ids, lps = tokens(run.final)
    assert len(ids) >= src["output_tokens"] + MORE
    _assert_same_run((ids, lps), s["refs"]["mg"], arch)
    assert s["mg_forwards"]["extend"] == 0 and s["mg_forwards"]["decode"] >= MORE
    assert [a["committed_positions"] for a in run.info["links"]] == [r["committed_positions"] for r in src["rounds"]] + [
        src["committed_positions"]]
    for idle in s["mig_idle"]:
        _consistent(idle)
    assert s["mig_idle"][1]["requests"]["running"] == [] and s["mig_idle"][1]["follows"] == []


@pytest.mark.parametrize("arch", MOVED_ARCHS)
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
    _assert_same_run((ids, lps), s["refs"]["p"], arch)
    assert ids[:k] == s["p"].final["output_ids"][:k]
    assert s["p_forwards"]["extend"] == 0 and s["p_forwards"]["decode"] >= MORE  # decoded on: nothing recomputed


# arch -> the config's (SSM heads, head dim, state size, groups, conv kernel) attribute names
_SSM_FIELDS = {
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
}


def _layer_groups(cfg, arch: str) -> tuple[list[int], list[int]]:
    """(attention layers, Mamba2 layers) of the config: FalconH1 runs both mixers in every layer."""
    if arch == "falcon_h1":
        every = list(range(cfg.num_hidden_layers))
        return every, every
    kinds = list(cfg.layer_types)
    return [i for i, k in enumerate(kinds) if k == "full_attention"], [i for i, k in enumerate(kinds) if k == "linear_attention"]


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_file_gives_the_layers_to_their_groups_with_the_family_geometry(scenarios, tiny_arch_dir, work, arch):
    """The paused request's file, read back: the attention layers and the Mamba2 layers of the model's config (each
    id in one group, but FalconH1's in both: a format 1.4 file that requires ``parallel-layers``), and the Mamba2 slot
    of the config's SSM geometry (conv ``x|B|C`` = H·P + 2·G·N channels, K−1 taps; temporal [H, P, N]) — NemotronH
    and FalconH1 with G = 2, GraniteMoeHybrid with its one group (G = 1)."""
    from hsnap_format import open_snapshot
    from hsnap_sglang.tiny import load_reference_model

    scenarios(arch)
    cfg = load_reference_model(tiny_arch_dir(arch)).config
    heads, head_dim, state, groups, kernel = (getattr(cfg, name) for name in _SSM_FIELDS[arch])
    attention, mamba = _layer_groups(cfg, arch)
    with open_snapshot(str(work / arch / "p.hsnap")) as snap:
        g, version, required = snap.geometry, snap.version, snap.header["features"]["required"]
    assert g.attention is not None and g.mamba is not None
    assert list(g.attention.layers) == attention != [] and list(g.mamba.layers) == mamba != []
    parallel = arch == "falcon_h1"
    assert g.parallel_layers == (tuple(attention) if parallel else ())
    # 1.1: the server describes its rank's share of the state (geometry.sharding), so a server of another TP size
    # can re-shard the file; FalconH1's parallel layers need 1.4
    assert (version, required) == (((1, 4), ["parallel-layers"]) if parallel else ((1, 1), []))
    assert g.sharding is not None and g.sharding.temporal.global_size == heads
    assert g.attention.heads == cfg.num_key_value_heads and not g.attention.swa_layers
    assert [list(c) for c in g.mamba.conv_shapes] == [[heads * head_dim + 2 * groups * state, kernel - 1]]
    assert list(g.mamba.temporal_shape) == [heads, head_dim, state]
    assert groups == {"nemotron_h": 2, "granitemoehybrid": 1, "falcon_h1": 2}[arch]


@pytest.mark.parametrize("arch", MOVED_ARCHS)
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
    _assert_same_run((ids, lps), s["refs"]["c"], arch)
    assert s["c_forwards"]["extend"] == 0 and s["c_forwards"]["decode"] >= MORE
    for idle in (s["b_idle"], s["ref_idle"]):
        _consistent(idle)


# ----------------------------------------------------------------------------- a snapshot of another family


def test_snapshot_of_another_family_is_refused_before_allocating(scenarios, servers, work):
    scenarios("nemotron_h")
    foreign = work / "nemotron_h-p-into-falcon_h1.hsnap"
    shutil.copyfile(work / "nemotron_h" / "p.hsnap", foreign)  # a copy: not claimed by its own resume
    url = servers["falcon_h1"]["b"].url
    before = wait_idle(url)
    e = error_of(client.resume, url, str(foreign))
    after = wait_idle(url)
    assert e is not None and e.error_type == "IncompatibleSnapshotError" and 400 <= e.status < 500, e
    fields = {f for f, *_ in e.error["differences"]}
    assert "identity.weights_hash" in fields and "geometry.attention.layers" in fields, fields
    state = lambda st: {"pools": st["pools"], "requests": st["requests"], "checks": {k: v for k, v in st["checks"].items() if k != "messages"}}  # noqa: E731
    assert state(before) == state(after)


# ----------------------------------------------------------------------------- a dedup drain of a Mamba2 server

DRAIN_PAGE = 16  # positions per stored page
DRAIN_SHARED = prompt(87, 2 * DRAIN_PAGE)  # the prefix two drained requests share: 2 full pages stored once
DRAIN_N = 60  # tokens of each drained request; drained after 6, so it decodes on from its file
DRAINED = {"dr1": DRAIN_SHARED + prompt(88, 9), "dr2": DRAIN_SHARED + prompt(89, 14), "dr3": prompt(86, 27)}


@pytest.fixture(scope="module")
def mamba2_drain(scenarios, servers, work):
    """NemotronH's B (its scenario done): three requests, two sharing a 2-page prompt prefix (the radix cache gives
    the second the first's prefix, attention rows and Mamba2 state), drained with dedup while all three decode, then
    the directory resumed in the same server and each request compared with its uninterrupted run there (started the
    same way from an empty radix tree: one after the other's first token)."""
    scenarios("nemotron_h")
    url = servers["nemotron_h"]["b"].url
    out: dict = {}
    flush_cache(url)
    streams = {}
    with paced(url, CUT_PACE_S):  # 60 tokens take 3 s at least: the drain lands while all three decode
        for rid, ids in DRAINED.items():
            streams[rid] = Stream(url, payload(rid, ids, DRAIN_N))
            streams[rid].start()
            streams[rid].wait_tokens(1)
        for st in streams.values():
            st.wait_tokens(6)
        out["drained"] = client.drain(url, str(work / "mamba2-drain"), dedup=True, page_size=DRAIN_PAGE)
    out["streams"] = {rid: st.finish() for rid, st in streams.items()}
    out["drain_idle"] = wait_idle(url)
    out["forwards_before"] = {rid: stats(url, rid)["forwards"] for rid in DRAINED}  # counted across the export
    flush_cache(url)
    out["run"] = client.resume(url, str(work / "mamba2-drain"))
    out["forwards_after"] = {rid: stats(url, rid)["forwards"] for rid in DRAINED}
    out["idle"] = wait_idle(url)
    flush_cache(url)
    out["refs"] = _references(url, {rid: (ids, DRAIN_N) for rid, ids in DRAINED.items()})
    return out


def test_dedup_drain_of_a_mamba2_server_resumes_every_request_exactly(mamba2_drain, work):
    d, streams = mamba2_drain["drained"], mamba2_drain["streams"]
    assert d["ok"] is True and sorted(i["rid"] for i in d["items"]) == sorted(DRAINED), d
    for rid, st in streams.items():
        assert st.final["meta_info"]["finish_reason"]["type"] == "hsnap_export", rid
    full_pages = {i["rid"]: i["result"]["committed_positions"] // DRAIN_PAGE for i in d["items"]}
    shared = len(DRAIN_SHARED) // DRAIN_PAGE
    sharing = [rid for rid, ids in DRAINED.items() if ids[:len(DRAIN_SHARED)] == DRAIN_SHARED]
    assert len(sharing) == 2 and all(full_pages[rid] > shared for rid in sharing), full_pages
    own = sum(full_pages[rid] - (shared if rid in sharing else 0) for rid in DRAINED)
    assert d["dedup"]["pages_put"] == shared + own, (d["dedup"], full_pages)
    assert d["dedup"]["pages_reused"] == shared, d["dedup"]  # the shared prefix's pages put once, referenced twice
    _consistent(mamba2_drain["drain_idle"])
    run = mamba2_drain["run"]
    assert all(item["ok"] for item in run.info) and sorted(run.finals) == sorted(DRAINED), run.info
    for rid in DRAINED:
        k = streams[rid].final["meta_info"]["completion_tokens"]
        assert tokens(run.finals[rid]) == mamba2_drain["refs"][rid], rid
        assert tokens(run.finals[rid])[0][:k] == streams[rid].final["output_ids"], rid
        before, after = mamba2_drain["forwards_before"][rid], mamba2_drain["forwards_after"][rid]
        resumed = {m: after.get(m, 0) - before.get(m, 0) for m in ("decode", "extend")}
        assert resumed == {"decode": DRAIN_N - k, "extend": 0}, (rid, before, after)  # decode only: nothing recomputed
    _consistent(mamba2_drain["idle"])


# ----------------------------------------------------------------------------- LFM2


@pytest.fixture(scope="module")
def lfm2(servers, work):
    url = servers["lfm2"]["b"].url  # B: its scenario's target (A is SIGKILLed there); other rids
    d = work / "lfm2-same-server"
    d.mkdir()
    out: dict = {}
    stream = Stream(url, payload("l", P_IDS, LONG))
    with paced(url):
        stream.start()
        stream.wait_tokens(6)
        out["paused"] = client.pause(url, "l", str(d / "l.hsnap"))
    out["l"] = stream.finish()
    out["forwards_before"] = stats(url, "l")["forwards"]  # a server counts a rid's forwards across its export
    with paced(url, CUT_PACE_S):
        out["run"] = client.resume(url, str(d / "l.hsnap"), on_chunk=_CutAfter(url, "l"))
    out["forwards_after"] = stats(url, "l")["forwards"]
    out["idle"] = wait_idle(url)
    out["ref"] = _references(url, {"l": (P_IDS, len(tokens(out["run"].final)[0]))})["l"]
    out["ref_idle"] = wait_idle(url)
    return out


def test_lfm2_request_paused_to_a_file_resumes_exactly_in_the_same_server(lfm2):
    assert lfm2["l"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    k = lfm2["paused"]["output_tokens"]
    assert lfm2["paused"]["committed_positions"] == len(P_IDS) + k - 1
    run = lfm2["run"]
    assert run.aborted and run.info["ok"], run.info
    ids, lps = tokens(run.final)
    assert len(ids) >= k + MORE
    assert (ids, lps) == lfm2["ref"]
    assert ids[:k] == lfm2["l"].final["output_ids"][:k]
    after_resume = {m: lfm2["forwards_after"].get(m, 0) - lfm2["forwards_before"].get(m, 0) for m in ("decode", "extend")}
    # decode only (no history position recomputed), at most one forward per token it produced after the resume
    assert after_resume["extend"] == 0 and MORE <= after_resume["decode"] <= len(ids) - k, after_resume
    for idle in (lfm2["idle"], lfm2["ref_idle"]):
        _consistent(idle)


def test_lfm2_file_gives_the_conv_layers_a_conv_only_mamba_slot(lfm2, tiny_arch_dir, work):
    from hsnap_format import open_snapshot
    from hsnap_sglang.tiny import load_reference_model

    cfg = load_reference_model(tiny_arch_dir("lfm2")).config
    kinds = list(cfg.layer_types)
    with open_snapshot(str(work / "lfm2-same-server" / "l.hsnap")) as snap:
        g = snap.geometry
    assert g.attention is not None and g.mamba is not None
    assert list(g.attention.layers) == [i for i, k in enumerate(kinds) if k == "full_attention"] != []
    assert list(g.mamba.layers) == [i for i, k in enumerate(kinds) if k == "conv"] != []
    assert [list(c) for c in g.mamba.conv_shapes] == [[cfg.hidden_size, cfg.conv_L_cache - 1]]
    assert list(g.mamba.temporal_shape) == [1, cfg.hidden_size, 0]


# ----------------------------------------------------------------------------- retraction to disk

RT_N = 40  # tokens of each request SGLang's forced retraction takes out and hsnap puts back
RT_PACE_S = 0.05  # each forward of R sleeps this long while requests run side by side: 40 tokens take 2 s at least
RT_IDS = {f"rt{i}": prompt(90 + i, 20 + 3 * i) for i in range(3)}


def _side_by_side(url: str, rids: list[str], tag: str = "") -> dict[str, dict]:
    """``rids`` (of RT_IDS; sent as ``rid + tag``) run side by side, each prefilled alone; their finals."""
    streams = {}
    for rid in rids:
        streams[rid] = Stream(url, payload(rid + tag, RT_IDS[rid], RT_N))
        streams[rid].start()
        streams[rid].wait_tokens(1)
    return {rid: st.finish().final for rid, st in streams.items()}


def _wait_for(done, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _retracted_beside(url: str, first_rid: str, rid: str, n: int, held, what: str) -> tuple:
    """``first_rid`` (rt0's prompt, LONG) decoding, then ``rid`` (rt1's prompt, ``n`` tokens) beside it — fewer outputs:
    SGLang's forced retraction takes it first — until the test gate says ``held``; (both streams)."""
    first = Stream(url, payload(first_rid, RT_IDS["rt0"], LONG))
    first.start()
    first.wait_tokens(1)
    retracted = Stream(url, payload(rid, RT_IDS["rt1"], n))
    retracted.start()
    _wait_for(held.exists, what)
    return first, retracted


def _files_left(d, timeout: float = 30.0) -> list[str]:
    """The files in ``d`` once none is left (a file written for a request gone meanwhile is removed when collected,
    at a scheduler iteration), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while os.listdir(d) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(os.listdir(d))


@pytest.fixture(scope="module")
def retraction(servers, work):
    url = servers["retract"]["r"].url
    d, gate = work / "retracted", work / "retract-gate"
    out: dict = {}
    # uninterrupted: each request alone (SGLang never retracts the last request of a batch)
    out["ref"] = {rid: tokens(generate(url, payload(f"{rid}-ref", ids, RT_N))) for rid, ids in RT_IDS.items()}
    out["before"] = stats(url)["retraction"]
    with paced(url, RT_PACE_S):  # each request still decodes when the next joins, on any load
        out["runs"] = _side_by_side(url, list(RT_IDS))
    out["forwards"] = {rid: stats(url, rid)["forwards"] for rid in RT_IDS}
    out["after"] = stats(url)["retraction"]
    out["files_after"] = sorted(os.listdir(d))  # removed as each was restored: none may be left
    out["idle"] = wait_idle(url)

    # an abort of a request held while its file is written (the test gate holds the write)
    hold = gate / "ab.retracted.hsnap.hold"
    hold.touch()
    with paced(url, RT_PACE_S):  # rt0 (LONG, cut below) still decodes when ab joins it and is retracted
        first, ab = _retracted_beside(url, "rt0", "ab", LONG, gate / "ab.retracted.hsnap.held", "ab was never retracted")
        out["held"] = stats(url)
        _abort(url, "ab")
        out["ab"] = ab.finish()
        hold.unlink()
        first.wait_tokens(RT_N)
        _abort(url, "rt0")
        out["first"] = first.finish().final
    out["idle_abort"] = wait_idle(url)
    out["files_abort"] = _files_left(d)

    # the proof of a retracted request's file held (the test gate stands for a slow disk): the others decode on
    prove_hold = gate / "pv.retracted.hsnap.prove.hold"
    prove_hold.touch()
    with paced(url, RT_PACE_S):
        first, pv = _retracted_beside(url, "rt0-p", "pv", RT_N, gate / "pv.retracted.hsnap.prove.held", "pv's file was never proved")
        out["proving"] = stats(url)["retraction"]
        out["during_proof"] = first.decoded_meanwhile(10)
        out["still_proving"] = prove_hold.exists() and pv.is_alive()
        prove_hold.unlink()
        out["pv"] = pv.finish().final
        _abort(url, "rt0-p")
        first.finish()
    out["idle_proof"] = wait_idle(url)
    out["files_proof"] = _files_left(d)

    # ... and a request aborted while its file is being proved ends aborted; the proof, once let go, is dropped
    prove_hold = gate / "ap.retracted.hsnap.prove.hold"
    prove_hold.touch()
    with paced(url, RT_PACE_S):
        first, ap = _retracted_beside(url, "rt0-a", "ap", LONG, gate / "ap.retracted.hsnap.prove.held", "ap's file was never proved")
        _abort(url, "ap")
        out["ap"] = ap.finish()
        out["ap_held"] = stats(url)["retraction"]["held"]
        prove_hold.unlink()
        _abort(url, "rt0-a")
        first.finish()
    out["idle_ap"] = wait_idle(url)
    out["files_ap"] = _files_left(d)

    # every write fails (the directory replaced by a file): SGLang recomputes the requests
    shutil.rmtree(d)
    d.write_text("not a directory")
    try:
        before = stats(url)["retraction"]
        with paced(url, RT_PACE_S):
            out["fault_runs"] = _side_by_side(url, ["rt0", "rt1"], tag="-f")
        out["fault"] = {k: stats(url)["retraction"][k] - before[k] for k in ("to_disk", "restored", "recomputed")}
        out["fault_forwards"] = stats(url, "rt1-f")["forwards"]
        out["idle_fault"] = wait_idle(url)
    finally:
        d.unlink()
        d.mkdir()
    return out


def test_retracted_requests_come_back_from_disk_exactly_without_recompute(retraction):
    r = retraction
    for rid in RT_IDS:
        assert tokens(r["runs"][rid]) == r["ref"][rid], rid  # every token and logprob, bit for bit
        assert r["forwards"][rid] == {"decode": RT_N - 1, "extend": 1}, (rid, r["forwards"][rid])  # no recompute
    moved = {k: r["after"][k] - r["before"][k] for k in ("to_disk", "restored", "recomputed")}
    assert moved["to_disk"] >= 3 and moved["restored"] == moved["to_disk"] and moved["recomputed"] == 0, moved
    assert r["after"]["held"] == {} and r["files_after"] == []
    last = r["after"]["last"]
    assert last["bytes"] > last["bytes_uploaded"] > 0 and last["committed_positions"] > 0
    _consistent(r["idle"])


def test_a_request_aborted_while_its_retraction_is_written_ends_aborted(retraction):
    r = retraction
    held = r["held"]
    assert held["retraction"]["held"] == {"ab": "being written"}, held["retraction"]
    assert {"rid": "ab", "state": "retracted"}.items() <= next(row for row in held["table"] if row["rid"] == "ab").items()
    assert r["ab"].final["meta_info"]["finish_reason"]["type"] == "abort"
    ids, lps = tokens(r["first"])  # cut after at least RT_N tokens: those equal its run alone
    assert len(ids) >= RT_N and (ids[:RT_N], lps[:RT_N]) == r["ref"]["rt0"]
    assert r["files_abort"] == []  # written after the abort, then removed
    _consistent(r["idle_abort"])


def test_a_retracted_request_whose_file_is_still_being_read_holds_up_no_other_request(retraction):
    """Its file is read and hashed off the scheduler thread (held here by the test gate): the request beside it decodes
    on; let go, the retracted request comes back exactly."""
    r = retraction
    assert r["proving"]["held"] == {"pv": "being proved"}, r["proving"]
    assert r["still_proving"] and r["during_proof"] >= 10, r["during_proof"]
    assert tokens(r["pv"]) == r["ref"]["rt1"]  # every token and logprob, bit for bit
    assert r["idle_proof"]["retraction"]["held"] == {} and r["files_proof"] == []
    last = r["idle_proof"]["retraction"]["last"]  # (pv, retracted and restored again after the held one)
    assert last["rid"] == "pv" and abs(last["prove_s"] + last["upload_s"] - last["restore_s"]) < 1e-6, last
    _consistent(r["idle_proof"])


def test_a_request_aborted_while_its_retraction_is_proved_ends_aborted(retraction):
    r = retraction
    assert r["ap"].final["meta_info"]["finish_reason"]["type"] == "abort"
    assert r["ap_held"] == {} and r["files_ap"] == [] and r["idle_ap"]["retraction"]["held"] == {}
    _consistent(r["idle_ap"])


def test_retraction_files_that_cannot_be_written_leave_the_requests_to_sglang(retraction):
    r = retraction
    assert r["fault"]["recomputed"] >= 1 and r["fault"]["restored"] == 0, r["fault"]
    assert r["fault_forwards"]["extend"] > 1  # SGLang prefilled it again
    for rid, final in r["fault_runs"].items():  # finished in full (recomputed: prefill numerics, not bit for bit)
        assert final["meta_info"]["finish_reason"]["type"] == "length" and len(tokens(final)[0]) == RT_N, rid
    _consistent(r["idle_fault"])
