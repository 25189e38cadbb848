"""hsnap inside SGLang's real server: drain, checkpoints, refusals, and the server as it
runs in production (radix cache, overlap scheduler, chunked prefill, an object store).

The single-request path (export mid-decode beside other requests, the source server gone, a fresh server with other
capacities and another request running resumes it exactly with decode inputs only, the stream continuous, the four
negative clients on an idle server) is proved by the ``hsnap demo`` run of test_hsnap_demo.py, whose servers run
with the same strict checks.  This module goes on from there with one set of real servers (``python -m
hsnap_sglang.serve`` with the plug-in on; bfloat16, chunked prefill, SGLang's strict idle memory check and tree
sanity check on), all started at once, each serving several proofs:

* S2 (radix cache on): a request sharing the tree's prefix pages with another is exported while the other decodes
  on; a checkpoint (keep_running) of a request is resumed in S3 while S2 continues it; then S2 drains 3
  requests into a directory and stops (process gone);
* O (the overlap scheduler on, radix cache off: the one combination SGLang's CPU platform runs): a request live-migrated
  to S3 while another decodes beside it (pre-copy rounds, then the tail), a migration no target
  follows (given up: the request decodes on), a follow nobody feeds (refused, S3 unchanged); a request exported
  while its last forward is in flight (at a boundary no batch in flight has passed); a checkpoint into an object
  store (s3://, a real SeaweedFS); O stops;
* S3 (radix cache on, other capacities: Mamba slots, token slots, running requests): resumes everything above, with
  another request running; then the four negative clients on a busy server, an unknown rid, an existing target, a
  request still prefilling.

Generation lengths are what each proof needs (a request running across the export, the resume, the drain); the
uninterrupted references of several requests run together (bfloat16: batch-invariant), in the time of the longest.

Exactness (tokens and logprobs bit-identical) holds because, in bfloat16 on this platform, a request's numbers do
not depend on the other requests of its batches (hsnap_sglang/README.md), and the thread count is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from engine_support import retire
from hsnap_support import (Stream, assert_continues, deltas, error_of, flush_cache, generate, hsnap_server, linkgate_env, paced, payload, prompt,
                           references, start_together, stats, tokens, wait_idle)

from hsnap_sglang import client
from hsnap_sglang.jobs import PROOF_HERE_BYTES_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import craft  # noqa: E402  (tests/craft.py: re-signing hand-made files)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

OTHERS = {"o4": (prompt(4, 25), 40), "o5": (prompt(5, 33), 40)}
DRAINED = {"d1": (prompt(11, 20), 40), "d2": (prompt(12, 47), 48), "d3": (prompt(13, 31), 36)}  # drained after 4 outputs
# a request paused after k outputs runs long enough that the client's view (which lags the server on a loaded
# machine) is still well before its end when the pause arrives
CK_IDS, CK_N = prompt(41, 28), 50
PREFIX = prompt(51, 600)
TAIL_A, TAIL_B, TAIL_P = prompt(52, 9), prompt(53, 11), prompt(54, 5)
RADIX_N = 48
OV_X, OV_N, OV_OTHER, OV_CK = prompt(61, 30), 80, (prompt(62, 20), 60), (prompt(63, 26), 60)
OV_RL = (prompt(64, 20), 90)  # relayed from S3 while O stops
# long enough that none finishes before its migration does (a request that finishes first is given up: another test)
MG = {"mg": (prompt(91, 30), 100), "mg-other": (prompt(92, 20), 40), "mg-lone": (prompt(93, 26), 4000), "mg-s3": (prompt(94, 24), 600),  # mg-s3: room for an upload under load
      "mg-held": (prompt(95, 22), 600)}  # mg-held: decoding on in O (paced) however long its first link is held in S3
MG_TAIL, MG_ROUNDS = 2, 4


def _other(url, rid):
    ids, n = OTHERS[rid]
    return Stream(url, payload(rid, ids, n))


def _reference_streams(url: str, runs: dict[str, tuple[list[int], int]]) -> dict[str, Stream]:
    """Uninterrupted streamed runs of ``runs`` ({rid: (prompt ids, output tokens)}) side by side (bfloat16: a request's
    numbers do not depend on its batch), finished."""
    streams = {rid: Stream(url, payload(f"{rid}-ref", ids, n)) for rid, (ids, n) in runs.items()}
    for st in streams.values():
        st.start()
    return {rid: st.finish() for rid, st in streams.items()}


def _ref(url, rid, ids, n):
    return tokens(generate(url, payload(f"{rid}-ref", ids, n)))


@pytest.fixture(scope="module")
def servers(tiny_model_dir, work, store):
    """S2, O and S3 (see the module's docstring), started side by side."""
    env = store["env"]
    # 3 Mamba slots per running request (SGLang caps --max-running-requests by them): S2 runs the 3 drained at once
    s2 = hsnap_server(tiny_model_dir, work / "s2.log", "--max-mamba-cache-size", "12", env=env)
    # S3 proves every resume and followed link off its scheduler thread; the test gate can hold a proof
    (work / "gate-s3").mkdir()
    s3 = hsnap_server(tiny_model_dir, work / "s3.log", "--max-mamba-cache-size", "13", "--max-total-tokens", "3500",
                      "--max-running-requests", "6", env={**env, **linkgate_env(work / "gate-s3"), PROOF_HERE_BYTES_ENV: "0"})
    # O may relay migrations to S3 and S2 (the servers it may call for a client: its operator's list)
    ov = hsnap_server(tiny_model_dir, work / "overlap.log", radix=False, overlap=True,
                      env={**env, "HSNAP_ALLOWED_PEERS": f"{s3.url},{s2.url}"})
    start_together(s2, ov, s3)
    yield {"s2": s2, "overlap": ov, "s3": s3}
    retire(s2, ov, s3)


# ----------------------------------------------------------------------------- radix cache (S2 -> S3)


@pytest.fixture(scope="module")
def radix(servers, work):
    """P puts the prefix into S2's tree; A and B then share it; A is exported while B decodes; A resumes in S3."""
    src, dst = servers["s2"].url, servers["s3"].url

    def scenario(export: bool):
        flush_cache(src)
        generate(src, payload("p", PREFIX + TAIL_P, 4))  # the prefix goes into the tree
        a = Stream(src, payload("a" if export else "a-ref", PREFIX + TAIL_A, RADIX_N))
        b = Stream(src, payload("b" if export else "b-ref", PREFIX + TAIL_B, RADIX_N))  # decodes on after A's export
        with paced(src) if export else contextlib.nullcontext():
            a.start()
            a.wait_tokens(1)  # A's prefill alone in both runs: prefilled in one batch with B's, its logits differ in the last bits
            b.start()
            a.wait_tokens(6)
            b.wait_tokens(2)
            out = client.pause(src, "a", str(work / "a.hsnap")) if export else None
        a.finish()
        b.finish()
        return a, b, out

    a_ref, b_ref, _ = scenario(export=False)
    a, b, out = scenario(export=True)
    idle = wait_idle(src)
    run = client.resume(dst, str(work / "a.hsnap"))
    forwards = stats(dst, "a")["forwards"]
    dst_idle = wait_idle(dst)
    return {"a": a, "b": b, "a_ref": a_ref, "b_ref": b_ref, "out": out, "idle": idle, "run": run, "forwards": forwards,
            "dst_idle": dst_idle}


def test_radix_shared_prefix_export_keeps_the_tree_and_the_other_request(radix):
    assert radix["a"].final["meta_info"]["cached_tokens"] >= 512  # A really shared the tree's prefix pages
    assert radix["b"].final["meta_info"]["cached_tokens"] >= 512
    assert radix["a"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    assert tokens(radix["b"].final) == tokens(radix["b_ref"].final)  # B decoded on, over the shared pages, unchanged
    checks = radix["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True and checks["tree_sanity"] == "ok", checks


def test_radix_exported_request_resumes_exactly(radix):
    assert tokens(radix["run"].final) == tokens(radix["a_ref"].final)
    assert radix["forwards"] == {"decode": RADIX_N - radix["out"]["output_tokens"], "extend": 0}
    checks = radix["dst_idle"]["checks"]
    assert checks["pool_leak"] is False and checks["tree_sanity"] == "ok", checks


# ----------------------------------------------------------------------------- live migration (O -> S3)


@pytest.fixture(scope="module")
def migrated(servers, work, store):
    """mg is live-migrated from O (overlap scheduler) to S3 (radix cache) while mg-other decodes beside it in O; then
    a follow that no source feeds (S3 refuses after its timeout, unchanged) and a migration no target follows (O gives
    it up, mg-lone decodes on); uninterrupted references in O.  Runs before O stops (the overlap fixture needs it)."""
    src, dst = servers["overlap"].url, servers["s3"].url
    out: dict = {}
    try:
        other = Stream(src, payload("mg-other", *MG["mg-other"]))
        other.start()
        m = Stream(src, payload("mg", *MG["mg"]))
        m.start()
        m.wait_tokens(6)
        dst_before = stats(dst)["pools"]
        with paced(src, 0.02):  # the 94 tokens left take 1.9 s at least: the migration ends while mg decodes, on any load
            out["mig"] = client.move(src, dst, "mg", str(work / "mig"), tail=MG_TAIL, max_rounds=MG_ROUNDS, timeout_s=120,
                                     last_source_event_at=m.last_token_at)
        out["m"], out["other"] = m.finish(), other.finish()
        out["forwards"] = stats(dst, "mg")["forwards"]
        out["dst_idle"], out["src_idle"] = wait_idle(dst), wait_idle(src)
        out["dst_before"] = dst_before
        out["files"] = sorted(os.listdir(work / "mig"))
        out["final_again"] = error_of(client.resume, dst, str(work / "mig" / "final.hsnap"))  # handed off once: claimed
        # the same through the object store (a real SeaweedFS): the servers of two hosts would share nothing else
        s3m = Stream(src, payload("mg-s3", *MG["mg-s3"]))
        with paced(src, 0.02):  # its 596 tokens left take 12 s at least: the uploads end first, however loaded the machine
            s3m.start()
            s3m.wait_tokens(4)
            out["mig_s3"] = client.move(src, dst, "mg-s3", f"s3://{store['bucket']}/mig-s3", tail=64, timeout_s=120)
        out["s3m"] = s3m.finish()
        # a follow nobody feeds: refused after its timeout, S3's pools as they were
        try:
            client.follow(dst, str(work / "nobody"), rid="nobody", timeout_s=1)
        except client.ServerError as e:
            out["unfed"] = e
        out["unfed_pools"] = (out["dst_idle"]["pools"], wait_idle(dst)["pools"])
        # a migration the source refuses (no such request): the target, already following, hears it at once
        try:
            client.move(src, dst, "no-such-rid", str(work / "refused"), timeout_s=120)
        except client.ServerError as e:
            out["refused"] = (e, wait_idle(dst)["pools"])
        # a migration no target follows: given up after its timeout, the request decodes on in O (it runs long
        # enough never to finish first; aborted once it has decoded on, compared with a reference of that length)
        lone = Stream(src, payload("mg-lone", *MG["mg-lone"]))
        lone.start()
        lone.wait_tokens(4)
        # containers a migration used already (a directory: looked at by the scheduler; a prefix: by the HTTP process)
        out["used"] = [error_of(client.migrate, src, "mg-lone", c, timeout_s=120) for c in (str(work / "mig"), f"s3://{store['bucket']}/mig-s3")]
        out["used_files"] = sorted(os.listdir(work / "mig"))
        # first a target that refuses it (it expects another request): it says so in refused.json, the source stops
        # pre-copying at once (not after its 120 s timeout) and the request decodes on
        said: dict = {}
        follower = threading.Thread(target=lambda: said.update(follow=error_of(client.follow, dst, str(work / "wrong"), rid="another",
                                                                                  timeout_s=120)), daemon=True)
        follower.start()
        out["wrong_error"] = error_of(client.migrate, src, "mg-lone", str(work / "wrong"), timeout_s=120)
        follower.join(180)
        out["wrong_follow"] = said.get("follow")
        out["wrong_pools"] = wait_idle(dst)["pools"]
        try:
            client.migrate(src, "mg-lone", str(work / "lone"), timeout_s=1)
        except client.ServerError as e:
            out["lone_error"] = e
        out["lone_at_error"] = lone.tokens_so_far()
        lone.wait_tokens(out["lone_at_error"] + 8)
        urllib.request.urlopen(urllib.request.Request(src + "/abort_request", data=json.dumps({"rid": "mg-lone"}).encode(),
                                                      headers={"Content-Type": "application/json"}), timeout=60).read()
        lone.join(120)
        out["lone"] = lone
        out["lone_files"] = sorted(os.listdir(work / "lone"))
        out["lone_abandoned"] = json.loads(_written(work / "lone" / "abandoned.json").read_text())
        out["lone_idle"] = wait_idle(src)
        out["held"] = _follow_while_its_first_link_is_held(src, dst, work)
        lengths = dict({rid: n for rid, (_, n) in MG.items()}, **{"mg-lone": len(lone.events[-1]["output_ids"])})
        out["ref_streams"] = _reference_streams(src, {rid: (ids, lengths[rid]) for rid, (ids, _) in MG.items()})
        out["refs"] = {rid: tokens(st.final) for rid, st in out["ref_streams"].items()}
    except BaseException as e:  # noqa: BLE001 - the migration tests fail on it; the overlap fixture goes on
        out["error"] = e
    return out


def _written(path: Path, timeout: float = 30.0) -> Path:
    """``path`` once it exists (a marker the server writes off its scheduler thread, after answering), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path


def _follow_while_its_first_link_is_held(src: str, dst: str, work: Path) -> dict:
    """mg-held migrated from O to S3 while S3's proof of its first link (read and hashed off the scheduler thread) is
    held by the test gate, a bystander decoding in S3; then let go."""
    gate = work / "gate-s3"
    hold = gate / "link-0000.hsnap.prove.hold"
    bystander = Stream(dst, payload("mg-by", prompt(96, 20), 2000))
    bystander.start()
    bystander.wait_tokens(2)
    out: dict = {}
    # paced: on a loaded machine mg-held must not reach its end before the migration does (its source would give it up)
    with paced(src, 0.02):
        moved = Stream(src, payload("mg-held", *MG["mg-held"]))
        moved.start()
        moved.wait_tokens(4)
        hold.touch()
        mover = threading.Thread(target=lambda: out.update(mig=client.move(src, dst, "mg-held", str(work / "mig-held"), tail=8, timeout_s=120)),
                                 daemon=True)
        mover.start()
        deadline = time.monotonic() + 120
        while not (gate / "link-0000.hsnap.prove.held").exists() and mover.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        out["listed"] = stats(dst)["follows"] if (gate / "link-0000.hsnap.prove.held").exists() else None
        out["during"] = bystander.decoded_meanwhile(10)
        out["still_held"] = hold.exists() and mover.is_alive()
        hold.unlink()
        mover.join(180)
        out["moved"] = moved.finish()
    urllib.request.urlopen(urllib.request.Request(dst + "/abort_request", data=json.dumps({"rid": "mg-by"}).encode(),
                                                  headers={"Content-Type": "application/json"}), timeout=60).read()
    bystander.finish()
    return out


def _succeeded(fixture: dict) -> dict:
    """A scenario fixture's outcome, or the error that stopped it (raised in each of its tests)."""
    if "error" in fixture:
        raise fixture["error"]
    return fixture


def test_live_migration_between_two_servers_continues_exactly(migrated):
    """Tokens and logprobs of the migrated request equal its uninterrupted run, bit for bit; the request beside it
    in the source is unaffected; on the target it only decoded (no forward recomputed its history)."""
    mg = _succeeded(migrated)
    run, src = mg["mig"].run, mg["mig"].source
    assert tokens(run.final) == mg["refs"]["mg"]
    assert tokens(mg["other"].final) == mg["refs"]["mg-other"]
    assert mg["m"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    assert mg["m"].final["meta_info"]["finish_reason"]["migration"] == str(Path(src["dir"]))
    n = MG["mg"][1]
    assert mg["forwards"] == {"decode": n - src["output_tokens"], "extend": 0}
    assert run.final["meta_info"]["finish_reason"]["type"] == "length"


def test_live_migration_precopies_while_decoding_and_stops_for_the_tail(migrated):
    """The source wrote link-0000 (the plain snapshot) and deltas while the request decoded, each after the target had
    applied the one before (.applied markers), and stopped it only for the rows decoded since the last round (at
    most ``tail``, unless the round budget ran out); the target applied every link in order."""
    mg = _succeeded(migrated)
    src, info = mg["mig"].source, mg["mig"].run.info
    rounds = src["rounds"]
    assert 1 <= len(rounds) <= MG_ROUNDS
    positions = [r["committed_positions"] for r in rounds] + [src["committed_positions"]]
    assert positions == sorted(positions) and rounds[0]["output_tokens"] >= 6
    assert src["final_rows"] == positions[-1] - positions[-2]
    # stopped once at most tail rows were left (or the round budget ran out); reaching the committed boundary adds the
    # step in flight (the overlap scheduler) and nothing more
    assert src["rows_left_at_stop"] <= MG_TAIL or len(rounds) == MG_ROUNDS
    assert src["rows_left_at_stop"] <= src["final_rows"] <= src["rows_left_at_stop"] + 2
    # the decode went on during the pre-copy: the request committed more positions than link-0000 holds
    assert src["committed_positions"] > rounds[0]["committed_positions"]
    names = [f"link-{i:04d}.hsnap" for i in range(len(rounds))]
    assert mg["files"] == sorted(names + [f + ".applied" for f in names] + ["final.hsnap", "final.hsnap.claimed"])
    applied = info["links"]
    assert [os.path.basename(a["link"]) for a in applied] == names + ["final.hsnap"]
    assert [a["committed_positions"] for a in applied] == positions
    assert applied[-1]["rows"] == src["final_rows"]  # the downtime path uploads the tail only
    assert sum(a["rows"] for a in applied) == src["committed_positions"]


def test_a_migrated_request_is_handed_off_once(migrated):
    """The target claimed the final link as it admitted the request (``final.hsnap.claimed``, as a resume claims its
    snapshot): resuming it again elsewhere is refused by name, not a second copy of the request."""
    mg = _succeeded(migrated)
    e = mg["final_again"]
    assert e is not None and e.error_type == "SnapshotClaimedError" and e.status == 409, e
    assert mg["mig"].run.info["claimed"].endswith("final.hsnap.claimed")


def test_live_migration_through_an_object_store(migrated):
    mg = _succeeded(migrated)
    mig = mg["mig_s3"]
    assert tokens(mig.run.final) == mg["refs"]["mg-s3"]
    assert mig.source["final"].startswith("s3://") and mg["s3m"].final["meta_info"]["finish_reason"]["migration"].startswith("s3://")
    assert [a["committed_positions"] for a in mig.run.info["links"]] == [r["committed_positions"] for r in mig.source["rounds"]] + [
        mig.source["committed_positions"]]


def test_a_followed_link_still_being_read_holds_up_no_other_request(migrated):
    """The target reads and hashes each link off its scheduler thread (held here by the test gate, standing for a slow
    disk or object store): the request beside it decodes on; let go, the migration ends and the request continues
    exactly."""
    mg = _succeeded(migrated)
    h = mg["held"]
    assert h["still_held"] and h["during"] >= 10, h["during"]
    assert [(f["rid"], f["applied"], f["proving"]) for f in h["listed"]] == [("mg-held", 0, True)], h["listed"]  # an operator sees it
    mig = h["mig"]
    assert tokens(mig.run.final) == mg["refs"]["mg-held"]
    first = mig.run.info["links"][0]
    assert first["prove_s"] >= 0.05 and abs(first["prove_s"] + first["upload_s"] - first["apply_s"]) < 1e-6, first


def test_live_migration_stream_continues_without_repeated_or_missing_text(migrated):
    mg = _succeeded(migrated)
    run = mg["mig"].run
    had = run.info["client_had"]
    assert had["output_ids"] == mg["mig"].source["output_tokens"]
    assert_continues(mg["m"].events, run.events, mg["ref_streams"]["mg"].events, (had["text_chars"], had["output_ids"]))
    # the client's gap; two connections read by two threads, so a target faster than the source's last event can
    # make it a little negative (-0.5 ms seen), never the length of a round
    assert mg["mig"].downtime_s is not None and -1.0 < mg["mig"].downtime_s < 10.0


def test_live_migration_leaves_both_servers_consistent(migrated):
    """SGLang's own pool accounting agrees on both sides: the source released exactly the request's slots; the
    target held the applied links as session-held until admission, then as a running request, then freed them."""
    mg = _succeeded(migrated)
    for idle in (mg["src_idle"], mg["dst_idle"], mg["lone_idle"]):
        assert idle["checks"]["pool_leak"] is False and idle["checks"]["req_rows_ok"] is True
    assert mg["dst_idle"]["requests"]["running"] == [] and mg["dst_idle"]["follows"] == [] and mg["dst_idle"]["arrived"] == []


def test_follow_that_no_source_feeds_is_refused_and_changes_nothing(migrated):
    mg = _succeeded(migrated)
    e = mg.get("unfed")
    assert e is not None and e.error_type == "MigrationError" and e.status == 504, e
    assert "link-0000.hsnap" in str(e)
    before, after = mg["unfed_pools"]
    assert before == after


def test_a_container_a_migration_used_is_refused_and_left_as_it_was(migrated):
    mg = _succeeded(migrated)
    for e in mg["used"]:
        assert e is not None and e.error_type == "SnapshotExistsError" and e.status == 409, e
        assert "link-0000.hsnap" in str(e)
    assert mg["used_files"] == mg["files"]  # no abandoned.json put into another migration's container


def test_migration_the_source_refuses_ends_the_follow_at_once(migrated):
    mg = _succeeded(migrated)
    e, pools = mg["refused"]
    assert e.error_type == "UnknownRequestError" and e.status == 404
    follow = e.follow_error  # not its 120 s timeout: the source's reason, from abandoned.json
    assert isinstance(follow, client.ServerError) and follow.error_type == "MigrationError", follow
    assert "abandoned by the source" in str(follow) and "UnknownRequestError" in str(follow)
    assert pools == mg["unfed_pools"][1]


def test_migration_the_target_refuses_ends_the_source_at_once(migrated):
    """The target refuses the first link (it was told to expect another request): no slot taken, refused.json says
    why; the source stops pre-copying on that (its reason names the target's refusal, not its own timeout) and the
    request decodes on there (compared with its reference below)."""
    mg = _succeeded(migrated)
    follow, src = mg["wrong_follow"], mg["wrong_error"]
    assert follow is not None and follow.error_type == "IncompatibleSnapshotError" and "request.rid" in str(follow), follow
    assert src is not None and src.error_type == "MigrationError" and "refused by the target" in str(src), src
    assert "IncompatibleSnapshotError" in str(src)
    assert mg["wrong_pools"] == mg["unfed_pools"][1]


def test_migration_no_target_follows_is_given_up_and_the_request_decodes_on(migrated):
    mg = _succeeded(migrated)
    e = mg.get("lone_error")
    assert e is not None and e.error_type == "MigrationError" and e.status == 504, e
    lone = mg["lone"].events[-1]
    assert lone["output_ids"] == mg["refs"]["mg-lone"][0]  # it decoded on, unchanged, until aborted
    assert len(lone["output_ids"]) >= mg["lone_at_error"] + 8 and lone["meta_info"]["finish_reason"]["type"] == "abort"
    assert mg["lone_files"] == ["abandoned.json", "link-0000.hsnap"]  # a target arriving late learns why, by name
    assert "applied within" in mg["lone_abandoned"]["reason"] and mg["lone_abandoned"]["links"] == 1


# ----------------------------------------------------------------------------- a relayed migration (O -> S3)


# long enough, paced, that each is still decoding when its migrate call lands on a loaded machine (rl-whole migrates
# after rl; S2's rl-busy must still run when O asks S2 to follow it)
RL = {"rl": (prompt(95, 28), 200), "rl-whole": (prompt(96, 22), 400), "rl-busy": (prompt(97, 24), 200)}
RL_PACE_S = 0.03  # O's forwards while the relayed migrations run: each request decodes for seconds after its migrate call


def _until_running(url: str, rid: str) -> None:
    deadline = time.monotonic() + 120
    while rid not in stats(url)["requests"]["running"]:
        assert time.monotonic() < deadline, f"{rid} never ran"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def relayed(servers, work, migrated):
    """Relayed migrations out of O (the source relays the target's stream into the request's own): ``rl`` streamed
    and ``rl-whole`` not streamed, both to S3; a target the operator did not allow; a target that refuses the follow
    (S2, running a request of that rid).  Uninterrupted references in O.  (Before O stops.)"""
    src, dst, other = servers["overlap"].url, servers["s3"].url, servers["s2"].url
    out: dict = {"dst": dst}
    try:
        rl = Stream(src, payload("rl", *RL["rl"]))
        whole: dict = {}
        body = payload("rl-whole", *RL["rl-whole"])
        whole_thread = threading.Thread(target=lambda: whole.update(final=generate(src, body)), daemon=True)
        busy_here, busy_there = Stream(src, payload("rl-busy", *RL["rl-busy"])), Stream(other, payload("rl-busy", *RL["rl-busy"]))
        with paced(src, RL_PACE_S), paced(other, 0.05):
            rl.start()
            whole_thread.start()
            busy_here.start()
            busy_there.start()
            rl.wait_tokens(6)
            busy_there.wait_tokens(1)
            _until_running(src, "rl-whole")
            out["not_allowed"] = error_of(client.migrate, src, "rl", str(work / "rl-no"), relay_to="http://127.0.0.1:9", timeout_s=120)
            out["refused"] = error_of(client.migrate, src, "rl-busy", str(work / "rl-busy"), relay_to=other, timeout_s=120)
            out["report"] = client.migrate(src, "rl", str(work / "rl"), relay_to=dst, tail=2, max_rounds=4, timeout_s=120)
            out["whole_report"] = client.migrate(src, "rl-whole", str(work / "rl-whole"), relay_to=dst, tail=2, timeout_s=120)
        out["rl"], out["busy_here"], out["busy_there"] = rl.finish(), busy_here.finish(), busy_there.finish()
        whole_thread.join(300)
        out["whole"] = whole["final"]
        out["forwards"] = stats(dst, "rl")["forwards"]
        out["idle"] = (wait_idle(src), wait_idle(dst))
        out["dirs"] = {name: sorted(os.listdir(work / name)) if (work / name).exists() else None for name in ("rl-no", "rl-busy", "rl")}
        out["refs"] = {rid: st.final for rid, st in _reference_streams(src, RL).items()}
    except BaseException as e:  # noqa: BLE001 - the relay tests fail on it; the overlap fixture goes on
        out["error"] = e
    return out


def test_relayed_migration_continues_the_clients_own_stream_to_the_finish(relayed):
    """The client's /generate stream on O goes on through the hand-off to the request's finish on S3: the same rid
    in every event, no finish reason before the last, no text or id taken back, repeated or missing, and the whole
    run (tokens, logprobs, text, finish) the uninterrupted run's; on S3 it only decoded."""
    r = _succeeded(relayed)
    report, events = r["report"], r["rl"].events
    assert report["relay"] == {"target": r["dst"]}
    assert {e["meta_info"]["id"] for e in events} == {"rl"}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    final, ref = events[-1], r["refs"]["rl"]
    assert final["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"] and final["meta_info"]["finish_reason"]["type"] == "length"
    assert tokens(final) == tokens(ref)
    assert final["text"] == ref["text"]
    assert "".join(text for text, _ in deltas(events)) == ref["text"]  # deltas asserts nothing was taken back
    assert [i for _, ids in deltas(events) for i in ids] == ref["output_ids"]
    assert r["forwards"] == {"decode": RL["rl"][1] - report["output_tokens"], "extend": 0}
    assert report["output_tokens"] >= 6 and len(report["rounds"]) >= 1


def test_relayed_migration_of_a_request_that_does_not_stream_answers_with_the_targets_final(relayed):
    r = _succeeded(relayed)
    got, ref = r["whole"], r["refs"]["rl-whole"]
    assert r["whole_report"]["relay"] == {"target": r["dst"]}
    assert got["meta_info"]["finish_reason"]["type"] == "length" and tokens(got) == tokens(ref) and got["text"] == ref["text"]


def test_relay_to_a_server_the_operator_did_not_allow_is_refused_before_anything(relayed):
    r = _succeeded(relayed)
    e = r["not_allowed"]
    assert e is not None and e.error_type == "ConfinementError" and e.status == 403 and "HSNAP_ALLOWED_PEERS" in str(e), e
    assert r["dirs"]["rl-no"] is None  # nothing written, the request went on (and migrated later)


def test_relay_to_a_target_that_refuses_the_follow_leaves_the_request_running_here(relayed):
    """S2 runs a request of that rid: it refuses the follow; the source refuses the migrate (502, the target's own
    refusal attached) before starting anything, and the request runs to its finish on O, as uninterrupted."""
    r = _succeeded(relayed)
    e = r["refused"]
    assert e is not None and e.error_type == "RelayError" and e.status == 502, e
    assert e.error.get("remote", {}).get("type") == "RequestBusyError", e.error
    assert r["dirs"]["rl-busy"] is None
    here = r["busy_here"].final
    assert here["meta_info"]["finish_reason"]["type"] == "length" and tokens(here) == tokens(r["refs"]["rl-busy"])
    assert r["busy_there"].final["meta_info"]["finish_reason"]["type"] == "length"


def test_relayed_migrations_leave_both_servers_consistent(relayed):
    r = _succeeded(relayed)
    for idle in r["idle"]:
        assert idle["checks"]["pool_leak"] is False and idle["checks"]["req_rows_ok"] is True, idle["checks"]
        assert idle["requests"]["running"] == [] and idle["follows"] == [] and idle["arrived"] == []


# ----------------------------------------------------------------------------- overlap scheduler (O -> S3)


@pytest.fixture(scope="module")
def overlap(servers, work, store, migrated, relayed):
    """Its rids are ov-*: S3 resumes requests of S2 too.  (After ``migrated``: this one stops O.)"""
    src, dst = servers["overlap"], servers["s3"].url
    ck_url = f"s3://{store['bucket']}/ck-overlap.hsnap"
    other = Stream(src.url, payload("ov-other", *OV_OTHER))  # running when x is exported
    with paced(src.url):
        other.start()
        x = Stream(src.url, payload("ov-x", OV_X, OV_N))
        x.start()
        x.wait_tokens(10)
        out = client.pause(src.url, "ov-x", str(work / "x-overlap.hsnap"))
    x.finish()
    ck_stream = Stream(src.url, payload("ov-ck", *OV_CK))
    ck_dir = f"s3://{store['bucket']}/ck-dir"
    with paced(src.url):  # both calls land while ov-ck decodes (unpaced, its 60 tokens can end before the second)
        ck_stream.start()
        ck_stream.wait_tokens(7)
        ck = client.pause(src.url, "ov-ck", ck_url, keep_running=True)  # a checkpoint into the object store
        cks = client.checkpoint(src.url, "ov-ck", ck_dir, every=8)  # ... and periodic checkpoints there (a chain of links)
    ck_stream.finish()
    other.finish()
    src_idle = wait_idle(src.url)
    refs = references(src.url, {"x": (OV_X, OV_N), "other": OV_OTHER, "ck": OV_CK, "rl": OV_RL})  # uninterrupted, in O itself
    # O stops (SIGTERM) while it relays a migrated request's stream from S3: it serves the relay to its end first
    rl = Stream(src.url, payload("ov-rl", *OV_RL))
    with paced(src.url, 0.06):  # the 86 tokens left take 5 s at least: the relayed migration lands while it decodes
        rl.start()
        rl.wait_tokens(4)
        # S3: the relayed rest (~80 tokens) takes 9.6 s at least, past SGLang's 5 s shutdown poll and its schedulers' exit
        with paced(dst, 0.12):
            client.migrate(src.url, "ov-rl", str(work / "ov-rl"), relay_to=dst, tail=2, timeout_s=120)
            sigterm_at = time.monotonic()
            stop_code = src.stop(timeout=120)
    rl.finish()
    run = client.resume(dst, str(work / "x-overlap.hsnap"))
    ck_run = client.resume(dst, ck_url)
    # the prefix: of its links, the newest (the chain below it checked) — the link just resumed, so again on purpose
    ck_dir_run = client.resume(dst, ck_dir, again=True)
    forwards = stats(dst, "ov-x")["forwards"]
    return {"cks": cks, "ck_dir_run": ck_dir_run, "x": x, "out": out, "run": run, "forwards": forwards, "refs": refs, "other": other, "ck": ck, "ck_stream": ck_stream,
            "ck_run": ck_run, "src_idle": src_idle, "rl": rl, "sigterm_at": sigterm_at, "stop_code": stop_code}


def test_a_source_stopped_by_sigterm_serves_its_relayed_stream_to_the_finish_first(overlap):
    """The relayed stream's request has left O, its client has not: O, SIGTERMed, serves it to its finish on S3
    (events for seconds after the SIGTERM; SGLang's graceful shutdown stops the schedulers, then the HTTP server,
    which waits for its open responses), then exits by itself."""
    rl, ref = overlap["rl"], overlap["refs"]["rl"]
    assert rl.final["meta_info"]["finish_reason"]["type"] == "length" and tokens(rl.final) == ref
    assert overlap["stop_code"] is not None  # exited by itself, not killed
    assert sum(t > overlap["sigterm_at"] for t in rl.times) >= 10  # relayed after the SIGTERM


def test_overlap_scheduler_export_waits_for_the_batch_in_flight(overlap):
    out = overlap["out"]
    assert out["committed_positions"] == len(OV_X) + out["output_tokens"] - 1  # a committed boundary: nothing in flight
    assert overlap["x"].final["meta_info"]["completion_tokens"] == out["output_tokens"]
    assert tokens(overlap["run"].final) == overlap["refs"]["x"]
    assert overlap["forwards"] == {"decode": OV_N - out["output_tokens"], "extend": 0}
    assert tokens(overlap["other"].final) == overlap["refs"]["other"]
    assert overlap["src_idle"]["checks"]["pool_leak"] is False


def test_overlap_scheduler_checkpoint_keeps_the_request_decoding(overlap, store):
    assert overlap["ck"]["keep_running"] is True and overlap["ck"]["path"] == f"s3://{store['bucket']}/ck-overlap.hsnap"
    assert overlap["ck_stream"].final["meta_info"]["finish_reason"]["type"] == "length"
    assert tokens(overlap["ck_stream"].final) == overlap["refs"]["ck"]  # parked for a step, given back, unchanged
    assert tokens(overlap["ck_run"].final) == overlap["refs"]["ck"]


def test_checkpoints_into_an_object_store_prefix_resume_from_the_newest_link(overlap, store):
    """Periodic checkpoints into an s3:// prefix; resuming the prefix takes the newest committed link (across
    hosts): the request continues from there to exactly its uninterrupted end."""
    first, run = overlap["cks"], overlap["ck_dir_run"]
    assert first["path"].startswith(f"s3://{store['bucket']}/ck-dir/") and first["link"] == 1
    assert isinstance(run.info, list) and len(run.info) == 1  # a prefix: one entry per request found there
    info = run.info[0]
    assert info["ok"] and ".ck0000" in info["path"] and info["path"] != first["path"]  # a later link than the first
    assert info["result"]["output_tokens"] > first["output_tokens"]
    assert tokens(run.final) == overlap["refs"]["ck"]


# ----------------------------------------------------------------------------- checkpoint and drain (S2 -> S3)


@pytest.fixture(scope="module")
def drained(servers, work, radix):
    s2, s3 = servers["s2"], servers["s3"]
    # a checkpoint of a request of S2, resumed in S3 while S2 continues it
    ck_stream = Stream(s2.url, payload("ck", CK_IDS, CK_N))
    with paced(s2.url):
        ck_stream.start()
        ck_stream.wait_tokens(8)
        ck = client.pause(s2.url, "ck", str(work / "ck.hsnap"), keep_running=True)
    ck_run = client.resume(s3.url, str(work / "ck.hsnap"))
    ck_stream.finish()
    ck_forwards = stats(s3.url, "ck")["forwards"]
    flush_cache(s2.url)
    ck_ref = _ref(s2.url, "ck", CK_IDS, CK_N)
    # S2 drains 3 requests and stops; S3 resumes them
    streams = [Stream(s2.url, payload(rid, ids, n)) for rid, (ids, n) in DRAINED.items()]
    with paced(s2.url):
        for s in streams:
            s.start()
        for s in streams:
            s.wait_tokens(4)
        out = client.drain(s2.url, str(work / "drain"))
    for s in streams:
        s.finish()
    code = s2.stop()
    alive = s2.living_descendants()
    o4 = _other(s3.url, "o4")
    o4.start()
    o4.wait_tokens(3)
    chunks = []
    with paced(s3.url, 0.02):  # a step at least 20 ms: one event per token, however loaded the machine (compared below)
        run = client.resume(s3.url, str(work / "drain"), on_chunk=lambda rid, text, ids, e: chunks.append((rid, text, list(ids))))
    o4.finish()
    forwards = {rid: stats(s3.url, rid)["forwards"] for rid in DRAINED}
    idle = wait_idle(s3.url)
    flush_cache(s3.url)
    refs = {rid: Stream(s3.url, payload(f"{rid}-ref", ids, n)) for rid, (ids, n) in DRAINED.items()}
    with paced(s3.url, 0.02):
        for r in refs.values():  # together: their streams are compared with the drained ones', event by event
            r.start()
        for r in refs.values():
            r.finish()
    o4_ref = _ref(s3.url, "o4", *OTHERS["o4"])
    return {"server": s3, "out": out, "streams": streams, "code": code, "alive": alive, "run": run, "chunks": chunks,
            "forwards": forwards, "idle": idle, "refs": refs, "o4": o4, "o4_ref": o4_ref,
            "ck": ck, "ck_run": ck_run, "ck_stream": ck_stream, "ck_forwards": ck_forwards, "ck_ref": ck_ref}


def test_drain_exports_every_request(drained, work):
    out = drained["out"]
    assert out["ok"] is True and sorted(i["rid"] for i in out["items"]) == sorted(DRAINED)
    for s, item in zip(drained["streams"], sorted(out["items"], key=lambda i: list(DRAINED).index(i["rid"]))):
        assert s.final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
        assert s.final["meta_info"]["finish_reason"]["path"] == item["path"] == str(work / "drain" / f"{item['rid']}.hsnap")
    assert drained["code"] is not None and drained["alive"] == []  # the drained server stopped, no process left


def test_drained_requests_resume_exactly_in_a_fresh_server(drained):
    assert sorted(drained["run"].finals) == sorted(DRAINED)
    for rid, (ids, n) in DRAINED.items():
        ref = drained["refs"][rid]
        assert tokens(drained["run"].finals[rid]) == tokens(ref.final), rid
        src = next(s for s in drained["streams"] if s.body["rid"] == rid)
        k = src.final["meta_info"]["completion_tokens"]
        assert drained["forwards"][rid] == {"decode": n - k, "extend": 0}, rid
        had = next(i["result"]["client_had"] for i in drained["run"].info if i["result"]["rid"] == rid)
        resumed = [e for e in drained["run"].events if e["meta_info"]["id"] == rid]
        assert_continues(src.events, resumed, ref.events, (had["text_chars"], had["output_ids"]))
        # what on_chunk reported: the new part of each event only
        assert [c[1:] for c in drained["chunks"] if c[0] == rid] == deltas(resumed, (had["text_chars"], had["output_ids"])), rid
    assert tokens(drained["o4"].final) == drained["o4_ref"]
    checks = drained["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks


# ----------------------------------------------------------------------------- phase 4: refusals in S3


def _negative_files(work: Path) -> dict[str, str]:
    """Four snapshots S3 must refuse, made from a real export (drain/d1.hsnap): each re-signed so that only the
    one property is wrong."""
    good = (work / "drain" / "d1.hsnap").read_bytes()
    d = work / "negative"
    d.mkdir(exist_ok=True)
    files = {}
    # version: a future major version, every digest and check recomputed
    files["version"] = craft.write(d / "future-major.hsnap", craft.rebuild(good, major=craft.split(good).major + 1))

    # layout: another GDN head layout than this model's (temporal state 2x32x32 instead of 4x32x16), consistently
    def other_layout(h):
        h["geometry"]["mamba"]["temporal_shape"] = [2, 32, 32]
        h["geometry"]["sharding"]["temporal"] = {"axis": 0, "global": 2, "parts": [[0, 2, 1]]}  # this rank: all 2 heads
        for s in h["sections"]:
            if s["kind"] == "temporal":
                s["shape"] = [2, 32, 32]

    files["layout"] = craft.write(d / "other-layout.hsnap", craft.mutate_header(good, other_layout))

    # source binding: bound to other weights (another weights hash), re-signed
    def other_weights(h):
        h["identity"]["weights_hash"] = "0" * 32

    files["binding"] = craft.write(d / "other-weights.hsnap", craft.mutate_header(good, other_weights))
    # manifest: a one-rank set whose manifest binds another file than the rank file it holds
    s = d / "set"
    s.mkdir(exist_ok=True)
    shutil.copyfile(work / "drain" / "d1.hsnap", s / "rank-0.hsnap")
    from hsnap_format import open_snapshot
    from hsnap_format.manifest import manifest_for

    with open_snapshot(str(s / "rank-0.hsnap")) as snap:
        manifest = manifest_for([snap]).encode()
    other = craft.split((work / "drain" / "d2.hsnap").read_bytes()).root_digest.hex()
    obj = json.loads(manifest.split(b"\n", 1)[0])
    obj["ranks"][0]["root_digest"] = other
    from hsnap_format import canonical

    (s / "manifest.json").write_bytes(craft.resign_manifest(canonical.dumps(obj) + b"\n" + manifest.split(b"\n", 1)[1]))
    files["manifest"] = str(s)
    return files


NEGATIVE = {"version": "UnsupportedVersionError", "layout": "IncompatibleSnapshotError", "binding": "IncompatibleSnapshotError",
            "manifest": "MalformedManifestError"}


@pytest.fixture(scope="module")
def refusals(drained, work):
    """Each negative client twice: with the server idle (its state compared whole, before and after), then with
    another request decoding (which must finish as if nothing happened)."""
    s3 = drained["server"]
    files = _negative_files(work)
    results, outputs = {}, []

    def attempt(case):
        try:
            client.resume(s3.url, files[case], on_chunk=lambda *a: outputs.append((case, a)))
            return None
        except client.ServerError as e:
            return e

    for case in files:
        before = wait_idle(s3.url)  # settled: a request that just returned may still sit in the batch for a step
        results[case] = attempt(case)
        results[f"{case}-state"] = (before, stats(s3.url))
    o5 = _other(s3.url, "o5")
    o5.start()
    o5.wait_tokens(2)
    busy = {case: attempt(case) for case in files}
    o5.finish()
    o5_ref = _ref(s3.url, "o5", *OTHERS["o5"])
    return {"files": files, "results": results, "busy": busy, "outputs": outputs, "o5": o5, "o5_ref": o5_ref}


def _state(s: dict) -> dict:
    return {"pools": s["pools"], "requests": s["requests"], "checks": {k: v for k, v in s["checks"].items() if k != "messages"}}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_negative_client_refused_before_any_output_without_side_effect(refusals, case):
    for e in (refusals["results"][case], refusals["busy"][case]):
        assert isinstance(e, client.ServerError), f"{case}: resumed"
        assert e.error_type == NEGATIVE[case] and 400 <= e.status < 500, e
    assert not [o for o in refusals["outputs"] if o[0] == case]  # no event at all
    before, after = refusals["results"][f"{case}-state"]
    assert _state(before) == _state(after)  # pools free counts, requests, SGLang's idle checks
    assert after["checks"]["idle"] is True and after["checks"]["pool_leak"] is False
    e = refusals["results"][case]
    if case == "binding":
        assert [d[0] for d in e.error["differences"]] == ["identity.weights_hash"]
    if case == "layout":
        assert [d[0] for d in e.error["differences"]] == ["geometry.mamba.temporal_shape"]


def test_negative_clients_leave_other_requests_unaffected(refusals):
    assert tokens(refusals["o5"].final) == refusals["o5_ref"]


def test_unknown_rid_is_refused_by_name(drained, work):
    with pytest.raises(client.ServerError) as e:
        client.pause(drained["server"].url, "no-such-request", str(work / "never-written.hsnap"))
    assert e.value.error_type == "UnknownRequestError" and e.value.status == 404 and e.value.found == "no-such-request"
    assert not os.path.exists(work / "never-written.hsnap")


def test_existing_target_path_is_refused_before_waiting(drained, work):
    s3 = drained["server"]
    st = Stream(s3.url, payload("busy", prompt(21, 20), 40))
    with paced(s3.url), pytest.raises(client.ServerError) as e:
        st.start()
        st.wait_tokens(1)
        client.pause(s3.url, "busy", str(work / "drain" / "d1.hsnap"))
    st.finish()
    assert e.value.error_type == "SnapshotExistsError" and e.value.status == 409
    assert st.final["meta_info"]["finish_reason"]["type"] == "length"  # the request went on


def test_request_still_prefilling_is_exported_at_its_first_decode_boundary(drained, work):
    s3 = drained["server"]
    long_prompt = prompt(31, 3000)  # 24 chunks of 128 tokens
    st = Stream(s3.url, payload("long", long_prompt, 12))
    st.start()
    deadline = time.monotonic() + 120
    while stats(s3.url, "long")["where"] not in ("prefilling", "waiting", "prefilled"):
        assert time.monotonic() < deadline and not st.done.is_set()
        time.sleep(0.01)
    out = client.pause(s3.url, "long", str(work / "long.hsnap"))
    st.finish()
    assert out["found_in"] in ("prefilling", "waiting", "prefilled")  # asked before its first decode boundary: waited for
    assert out["output_tokens"] >= 1 and out["committed_positions"] == len(long_prompt) + out["output_tokens"] - 1
    assert st.final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    run = client.resume(s3.url, str(work / "long.hsnap"))
    flush_cache(s3.url)
    assert tokens(run.final) == _ref(s3.url, "long", long_prompt, 12)


def test_checkpoint_resumed_elsewhere_while_the_source_continues(drained):
    # S2 took the checkpoint and went on; S3 (another process, started while S2 ran) resumed it
    st, run = drained["ck_stream"], drained["ck_run"]
    assert drained["ck"]["keep_running"] is True
    assert st.final["meta_info"]["finish_reason"]["type"] == "length"  # the source went on to the end
    assert tokens(run.final) == tokens(st.final)  # both continued identically
    assert tokens(st.final) == drained["ck_ref"]
    assert drained["ck_forwards"]["extend"] == 0
