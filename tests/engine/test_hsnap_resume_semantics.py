"""What a resume means, and that no hsnap call stops the server's loops: one server (radix cache on, the plug-in
on, SGLang's strict idle memory check and tree sanity check on) serves every proof of this module.

* a request exported and resumed in the same server at once is not cut by the delayed abort SGLang attaches to the
  exported request's stream (2 s after it ends, on the same rid); a resumed stream that does end aborted makes
  ``hsnap resume`` exit non-zero;
* a snapshot is resumed at most once: a second resume is refused (409, naming who claimed it and when) unless asked
  for again; a refused resume takes its claim back; each snapshot of a directory is claimed on its own;
* a resume refused for capacity leaves the radix cache as it was (fit decided from free + evictable slots first), and\n  so does one refused for its bytes (every digest proved before the cache gives up an entry);
* against an object store that accepts connections and never answers (a loopback "black hole"), an export and a
  resume end in a typed error after the store's read timeout, while the other requests keep decoding and
  ``/health`` answers.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from hsnap_support import Stream, flush_cache, generate, hsnap_server, paced, payload, prompt, stats, tokens, wait_idle

from hsnap_format.tools.cli import main as hsnap_cli
from hsnap_sglang import client
from hsnap_testing.terminal import sigint_as_at_a_terminal

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STORE_TIMEOUT_S = 4.0  # HSNAP_S3_TIMEOUT of the server: one attempt (HSNAP_S3_RETRIES=0) waits this long for a byte
# an observer (this test process) that did not run for this long could not watch the server meanwhile: that attempt is
# blind, not a failure of the server (a fresh-clone run once saw this process's own loop stop for seconds under load)
OBSERVER_STALL_S = 1.0
TOTAL_TOKENS = 2500


class BlackHole:
    """A loopback TCP endpoint that accepts every connection and never sends a byte (a store in a brown-out)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture(scope="module")
def hole():
    h = BlackHole()
    yield h
    h.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir, work, hole):
    root = work / "root"
    root.mkdir()
    env = {"HSNAP_ROOT": str(root), "HSNAP_ALLOWED_URLS": "s3://blackhole", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{hole.port}",
           "AWS_ACCESS_KEY_ID": "hsnaptest", "AWS_SECRET_ACCESS_KEY": "hsnaptest-secret", "AWS_REGION": "us-east-1",
           "HSNAP_S3_TIMEOUT": str(STORE_TIMEOUT_S), "HSNAP_S3_CONNECT_TIMEOUT": "2", "HSNAP_S3_RETRIES": "0",
           "HSNAP_DRAIN_ON_SIGTERM": "sigterm-drained"}  # the module's last test: SIGTERM drains every request there
    # 3 Mamba slots per running request (SGLang caps --max-running-requests by them): 4 requests at once
    s = hsnap_server(tiny_model_dir, work / "server.log", "--max-total-tokens", str(TOTAL_TOKENS), "--max-mamba-cache-size", "12",
                     "--max-running-requests", "4", "--log-level", "info", "--log-level-http", "warning", "--enable-metrics", env=env)  # hsnap's lines, /metrics
    s.start()
    s.root = root
    yield s
    s.retire()


def _paused(url: str, rid: str, path: Path, ids: list[int], n: int, after: int) -> tuple[Stream, dict]:
    """``rid`` streamed, exported to ``path`` after ``after`` output tokens; its stream ended by the export (paced: the
    pause lands while it decodes)."""
    st = Stream(url, payload(rid, ids, n))
    with paced(url):
        st.start()
        st.wait_tokens(after)
        out = client.pause(url, rid, str(path))
    st.finish()
    assert st.final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    return st, out


def _refusal(call, *args, **kw) -> client.ServerError:
    with pytest.raises(client.ServerError) as e:
        call(*args, **kw)
    return e.value


def _abort(url: str, rid: str) -> None:
    req = urllib.request.Request(url + "/abort_request", data=json.dumps({"rid": rid}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60):
        pass


def _answer_s(url: str) -> float:
    """Seconds the HTTP process takes to answer a route it serves alone (``/v1/models``). Not ``/health``: SGLang's
    sleeps a second and then waits for any output of the scheduler, so its time is the scheduler's and the
    detokenizer's as much as the HTTP process's (on a loaded machine one took 3.5 s while every request decoded)."""
    t0 = time.monotonic()
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        assert r.status == 200
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- the old stream's delayed abort


def test_resume_in_the_same_server_is_immune_to_the_exported_streams_delayed_abort(server, work):
    n = 100
    _, out = _paused(server.url, "imm", server.root / "imm.hsnap", prompt(71, 20), n, after=5)
    paused_at = time.monotonic()
    with paced(server.url, 0.05):  # 95 tokens take 4.75 s at least: past SGLang's 2 s delay on any machine
        run = client.resume(server.url, str(server.root / "imm.hsnap"))
    ended_at = time.monotonic()
    meta = run.final["meta_info"]
    assert meta["finish_reason"]["type"] == "length", (meta["finish_reason"], f"{ended_at - paused_at:.1f} s after the pause")
    assert meta["completion_tokens"] == n and len(run.output_ids) == n
    assert not run.aborted
    # the proof needs the resumed stream to outlive SGLang's 2 s delay (else the abort could not have hit it)
    assert ended_at - paused_at > 3.0, f"decoding too fast for this proof: {ended_at - paused_at:.1f} s"
    wait_idle(server.url)


def test_hsnap_resume_exits_nonzero_when_the_resumed_stream_ends_aborted(server, capsys):
    _paused(server.url, "cut", server.root / "cut.hsnap", prompt(72, 20), 3000, after=3)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(rc=client.resume_main([server.url, str(server.root / "cut.hsnap")])), daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while "cut" not in stats(server.url)["requests"]["running"]:
        assert time.monotonic() < deadline and t.is_alive(), "the resumed request never ran"
        time.sleep(0.1)
    _abort(server.url, "cut")
    t.join(120)
    assert not t.is_alive()
    err = " ".join(capsys.readouterr().err.split())  # wrapped at 80 columns: read as words
    assert got["rc"] != 0, err
    assert "ended aborted" in err and "cut" in err
    wait_idle(server.url)


# ----------------------------------------------------------------------------- the client going away


def _running(url: str) -> list:
    return list(stats(url)["requests"]["running"])


def _wait_running(url: str, rids: set, proc=None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not rids <= set(_running(url)):
        assert time.monotonic() < deadline, f"never all running: {rids} vs {_running(url)}"
        assert proc is None or proc.poll() is None, proc.communicate()
        time.sleep(0.1)


def _hsnap_resume(url: str, path: Path, *args: str) -> subprocess.Popen:
    """``hsnap resume`` as a user runs it, in its own process (Ctrl-C is a SIGINT to it)."""
    return subprocess.Popen([sys.executable, "-m", "hsnap_format.tools.cli", "resume", url, str(path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_at_a_terminal)


@pytest.mark.parametrize("many", [False, True], ids=["one-file", "a-directory"])
def test_ctrl_c_during_a_resume_pauses_each_request_back_beside_its_snapshot(server, many):
    d = server.root / f"ctrl-c-{'many' if many else 'one'}"
    d.mkdir()
    rids = {f"cc{int(many)}-a", f"cc{int(many)}-b"} if many else {"cc0-a"}
    first = {rid: _paused(server.url, rid, d / f"{rid}.hsnap", prompt(90 + i + 2 * many, 20), 400, after=3)[1]["committed_positions"]
             for i, rid in enumerate(sorted(rids))}
    with paced(server.url, 0.05):  # 400 tokens take 20 s at least: the interrupt lands while both decode
        proc = _hsnap_resume(server.url, d if many else d / "cc0-a.hsnap", "--wide")  # a line each, as the test reads them
        _wait_running(server.url, rids, proc)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    plan = err.splitlines()[0]  # the plan comes first
    assert re.fullmatch(f"resuming 2 of 2 snapshots in {re.escape(str(d))}:" if many else
                        rf"resuming cc0-a from {re.escape(str(d / 'cc0-a.hsnap'))}: \d+ committed positions", plan), err
    for rid in rids:
        back = d / f"{rid}.interrupted.hsnap"
        said = [line for line in err.splitlines() if line.startswith(f"interrupted: {rid} paused at ")]
        assert len(said) == 1 and said[0].endswith(f"-> {back}; continue it with: hsnap resume {server.url} {back}"), err
        assert back.exists()
    assert not set(_running(server.url)) & rids  # none left decoding without a client
    if many:  # whole lines, each labelled with its request
        assert all(line.startswith(("[cc1-a] ", "[cc1-b] ")) for line in out.splitlines() if line), out
    for rid in rids:  # the progress is kept: the rest follows from the paused-back snapshot, to the full length
        run = client.resume(server.url, str(d / f"{rid}.interrupted.hsnap"))
        meta = run.final["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 400, meta
        assert run.info["result"]["committed_positions"] > first[rid]  # further than the snapshot the interrupted run started from
    wait_idle(server.url)


@pytest.mark.parametrize("many", [False, True], ids=["one-file", "a-directory"])
def test_a_resume_stream_whose_client_goes_away_aborts_each_of_its_requests(server, many):
    """No pause asked for: the server ends what nobody reads, for one request as for several (as /generate does)."""
    d = server.root / f"gone-{'many' if many else 'one'}"
    d.mkdir()
    rids = {f"go{int(many)}-a", f"go{int(many)}-b"} if many else {"go0-a"}
    for i, rid in enumerate(sorted(rids)):
        _paused(server.url, rid, d / f"{rid}.hsnap", prompt(94 + i + 2 * many, 20), 400, after=3)
    with paced(server.url, 0.05):
        body = json.dumps({"path": str(d if many else d / "go0-a.hsnap"), "stream": True}).encode()
        req = urllib.request.Request(server.url + "/hsnap/resume", data=body, headers={"Content-Type": "application/json"})
        r = urllib.request.urlopen(req, timeout=120)
        _wait_running(server.url, rids)
        r.close()  # the client goes away
        deadline = time.monotonic() + 30
        while set(_running(server.url)) & rids:
            assert time.monotonic() < deadline, f"still decoding with no client: {_running(server.url)}"
            time.sleep(0.2)
    log = server.log_path.read_text(errors="replace")
    for rid in rids:
        assert f"hsnap: aborted resumed request {rid}: its stream's client went away" in log
    wait_idle(server.url)


def test_the_server_logs_the_plugin_and_one_line_per_export_resume_and_refusal(server):
    path = server.root / "logged.hsnap"
    _paused(server.url, "logged", path, prompt(98, 20), 40, after=3)
    client.resume(server.url, str(path))
    _refusal(client.resume, server.url, str(path))  # claimed: refused
    _refusal(client.pause, server.url, "no-such-request", str(server.root / "never.hsnap"))
    log = server.log_path.read_text(errors="replace")
    assert log.count("hsnap plug-in on: /hsnap routes added") == 1
    assert re.search(rf"hsnap export: rid=logged path={re.escape(str(path))} committed_positions=\d+ output_tokens=\d+ bytes=\d+ in "
                     r"[\d.]+ ms", log), log[-3000:]
    assert re.search(rf"hsnap resume: rid=logged path={re.escape(str(path))} committed_positions=\d+.* in [\d.]+ ms", log), log[-3000:]
    assert re.search(r"hsnap resume refused \(HTTP 409\): SnapshotClaimedError: ", log), log[-3000:]
    assert re.search(r"hsnap export refused \(HTTP 4\d\d\): UnknownRequestError: .*no-such-request", log), log[-3000:]
    wait_idle(server.url)


def _scrape(url: str) -> dict:
    """SGLang's /metrics as {(name, labels as a sorted tuple): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _grew(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_hsnap_ls_lists_the_requests_and_metrics_count_hsnaps_operations(server, capsys):
    before = _scrape(server.url)
    path, ck = server.root / "metered.hsnap", server.root / "metered-ck"
    st = Stream(server.url, payload("metered", prompt(99, 20), 400))
    with paced(server.url, 0.05):
        st.start()
        st.wait_tokens(3)
        client.checkpoint(server.url, "metered", str(ck), every=4)
        deadline = time.monotonic() + 60
        while client.stats(server.url)["checkpoints"].get("metered", {}).get("links", 0) < 2:  # a link written off the decode path
            assert time.monotonic() < deadline, client.stats(server.url)["checkpoints"]
            time.sleep(0.1)
        rows = {r["rid"]: r for r in client.requests(server.url)}
        assert client.ls_main([server.url]) == 0
        listed = capsys.readouterr().out.splitlines()
        client.pause(server.url, "metered", str(path))
    st.finish()
    row = rows["metered"]
    assert row["state"] == "running" and row["prompt_tokens"] == 20 and row["output_tokens"] >= 3
    assert row["committed_positions"] == row["prompt_tokens"] + row["output_tokens"] - 1
    assert row["checkpoint"]["dir"] == str(ck) and row["checkpoint"]["every"] == 4 and row["checkpoint"]["links"] >= 2
    assert listed[0].split() == ["RID", "STATE", "PROMPT", "OUTPUT", "COMMITTED", "HSNAP"] and all(len(line) <= 80 for line in listed)
    assert any(line.split()[:3] == ["metered", "running", "20"] for line in listed), listed
    run = client.resume(server.url, str(path))
    assert run.final["meta_info"]["finish_reason"]["type"] == "length"
    t = run.info["result"]["timings"]  # the resume's phases partition its time up to the answer (one monotonic clock)
    phases = [t[k] for k in ("read_s", "claim_s", "register_s", "queue_s", "restore_s", "admit_s", "answer_s")]
    assert min(phases) >= 0 and sum(phases) <= t["to_answer_s"] + 1e-3, t
    # proved ahead: the proof started when the route was called, before the resume's message (after the claim) came
    assert t["ahead_s"] > 0 and t["proof_s"] >= t["ahead_s"] and t["proof_s"] >= t["prove_s"], t
    inner = run.info["result"]["restore_phases"]  # hsnap's own phases, inside the scheduler's proof and upload
    assert set(inner) == {"prove_s", "allocate_s", "plan_s", "upload_s"} and min(inner.values()) >= 0, inner
    assert inner["prove_s"] <= t["proof_s"] + 1e-3 and inner["allocate_s"] + inner["plan_s"] + inner["upload_s"] <= t["upload_s"] + 1e-3, (inner, t)
    _refusal(client.resume, server.url, str(path))  # claimed
    after = _scrape(server.url)
    assert _grew(before, after, "hsnap_operations_total", op="export", outcome="ok") == 1
    assert _grew(before, after, "hsnap_operations_total", op="checkpoint", outcome="ok") == 1
    assert _grew(before, after, "hsnap_operations_total", op="resume", outcome="ok") == 1
    assert _grew(before, after, "hsnap_operations_total", op="resume", outcome="SnapshotClaimedError") == 1
    assert _grew(before, after, "hsnap_bytes_written_total", op="export") == os.path.getsize(path)
    assert _grew(before, after, "hsnap_bytes_read_total", op="resume") == run.info["result"]["bytes_uploaded"]
    assert _grew(before, after, "hsnap_pause_to_durable_seconds_count", op="export") == 1
    assert _grew(before, after, "hsnap_restore_seconds_count") == 1
    assert _grew(before, after, "hsnap_resume_to_first_token_seconds_count") == 1
    assert _grew(before, after, "hsnap_checkpoint_link_lag_seconds_count") >= 1  # observed in the scheduler process
    wait_idle(server.url)


# ----------------------------------------------------------------------------- at most once


@pytest.fixture(scope="module")
def once(server):
    """A snapshot resumed to its end once, then resumed again (refused), then again on purpose."""
    path = server.root / "once.hsnap"
    _paused(server.url, "once", path, prompt(73, 20), 40, after=4)
    first = client.resume(server.url, str(path))
    second = _refusal(client.resume, server.url, str(path))
    held_after_refusal = client.stats(server.url)["plugin"]["proofs_ahead"]  # the proof started ahead, given back
    marker = json.loads(Path(str(path) + ".claimed").read_text())
    again = client.resume(server.url, str(path), again=True)
    wait_idle(server.url)
    return {"first": first, "second": second, "marker": marker, "again": again, "held_after_refusal": held_after_refusal}


def test_second_resume_of_a_snapshot_is_refused_naming_who_claimed_it(once, server):
    e = once["second"]
    assert e.status == 409 and e.error_type == "SnapshotClaimedError", e.error
    port = server.url.rsplit(":", 1)[1]
    assert f":{port}" in e.error["message"] and "claimed by" in e.error["message"]
    assert once["marker"]["claimed_at"] in e.error["message"]
    assert once["marker"]["claimed_by"]["pid"] > 0 and once["marker"]["claimed_by"]["server"].endswith(f":{port}")
    assert once["first"].final["meta_info"]["finish_reason"]["type"] == "length"
    assert once["held_after_refusal"] == 0  # the scheduler's proof ahead of the refused resume was given back at once


def test_resume_again_on_purpose_continues_the_snapshot_once_more(once):
    first, again = once["first"].final, once["again"].final
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    assert again["output_ids"] == first["output_ids"]  # the same continuation, asked for explicitly


def test_each_snapshot_of_a_directory_is_claimed_on_its_own(server):
    d = server.root / "drained"
    d.mkdir()
    for rid, seed in (("dir-a", 74), ("dir-b", 75)):
        _paused(server.url, rid, d / f"{rid}.hsnap", prompt(seed, 20), 40, after=3)
    client.resume(server.url, str(d / "dir-a.hsnap"))  # one of them resumed alone first
    run = client.resume(server.url, str(d))
    items = {Path(i["path"]).name: i for i in run.info}
    assert items["dir-a.hsnap"]["ok"] is False and items["dir-a.hsnap"]["error"]["type"] == "SnapshotClaimedError"
    assert items["dir-b.hsnap"]["ok"] is True and set(run.finals) == {"dir-b"}
    assert (d / "dir-b.hsnap.claimed").exists()
    e = _refusal(client.resume, server.url, str(d))  # every entry claimed now: nothing resumes
    assert e.status == 409 and e.error_type == "SnapshotClaimedError"
    assert client.stats(server.url)["plugin"]["proofs_ahead"] == 0  # a directory is proved entry by entry: none kept
    wait_idle(server.url)


# ----------------------------------------------------------------------------- capacity: the cache is not evicted for a refusal


@pytest.fixture(scope="module")
def refused_for_capacity(server):
    """A 1,200-position snapshot; then the tree holds ~800 evictable tokens and a running request holds most of the
    rest, so that free + evictable < 1,200: the resume is refused."""
    url, path = server.url, server.root / "big.hsnap"
    _paused(url, "big", path, prompt(81, 1200), 40, after=2)
    got = _refused_beside_a_full_cache(url, path, "", 82)
    resumed = client.resume(url, str(path))  # room now: the refusal did not use up the claim
    claimed_after = Path(str(path) + ".claimed").exists()
    wait_idle(url)
    return {**got, "resumed": resumed, "claimed_after": claimed_after}


def _refused_beside_a_full_cache(url: str, path: Path, tag: str, seed: int) -> dict:
    """The resume of ``path``, refused while the tree holds ~800 evictable tokens (a finished request's prompt) and a
    running request holds most of the other slots; the pools before and after it, and whether that request ran
    throughout. The running request is aborted before this returns."""
    wait_idle(url)
    flush_cache(url)
    generate(url, payload(f"filler{tag}", prompt(seed, 800), 1))  # its prompt stays in the tree, evictable
    hog = Stream(url, payload(f"hog{tag}", prompt(seed + 1, 1350), 3000))
    hog.start()
    hog.wait_tokens(2)
    before = stats(url)["pools"]
    error = _refusal(client.resume, url, str(path))
    after = stats(url)["pools"]
    hog_running = f"hog{tag}" in stats(url)["requests"]["running"]
    marker_left = Path(str(path) + ".claimed").exists()
    _abort(url, f"hog{tag}")
    hog.join(120)
    wait_idle(url)
    return {"before": before, "after": after, "error": error, "hog_running": hog_running, "marker_left": marker_left}


def test_resume_refused_for_capacity_leaves_the_radix_cache_as_it_was(refused_for_capacity):
    r = refused_for_capacity
    assert r["error"].status == 409 and r["error"].error_type == "CapacityError", r["error"].error
    assert r["hog_running"], "the proof needs the running request to hold its slots throughout"
    assert r["after"]["token_slots_free"] <= r["before"]["token_slots_free"], (r["before"], r["after"])  # nothing evicted
    assert r["before"]["token_slots_evictable"] >= 500, r["before"]
    assert r["after"]["token_slots_evictable"] >= r["before"]["token_slots_evictable"], (r["before"], r["after"])
    assert "evictable" in r["error"].error["message"]  # the refusal counted what the cache could have given


def test_resume_refused_after_claiming_takes_its_claim_back(refused_for_capacity):
    r = refused_for_capacity
    assert not r["marker_left"]
    assert r["claimed_after"] and r["resumed"].info["result"]["claimed"] == str(r["resumed"].info["path"]) + ".claimed"
    assert r["resumed"].final["meta_info"]["finish_reason"]["type"] == "length"


@pytest.fixture(scope="module")
def refused_for_its_bytes(server):
    """A 600-position snapshot with one byte of a state section flipped (header, record and every other section
    intact); then the tree holds ~800 evictable tokens and a running request holds most of the rest, so that the
    snapshot fits only once the cache gives up entries: the resume is refused for its digest."""
    from hsnap_format import open_snapshot

    url, path = server.url, server.root / "flipped.hsnap"
    _paused(url, "flipped", path, prompt(84, 600), 40, after=2)
    with open_snapshot(str(path)) as snap:
        state = max((sec for sec in snap.sections if sec.is_state), key=lambda sec: sec.length)
        offset, positions = state.offset + state.length // 2, int(snap.state_position)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    return {**_refused_beside_a_full_cache(url, path, "-2", 85), "positions": positions}


def test_resume_refused_for_a_digest_leaves_the_radix_cache_as_it_was(refused_for_its_bytes):
    r = refused_for_its_bytes
    assert r["error"].status == 400 and r["error"].error_type == "DigestMismatchError", r["error"].error
    assert r["hog_running"], "the proof needs the running request to hold its slots throughout"
    # the proof needs a snapshot that fits only with the cache's help: a resume that evicted first would have
    assert r["before"]["token_slots_free"] < r["positions"] <= r["before"]["token_slots_free"] + r["before"]["token_slots_evictable"], r
    assert r["after"]["token_slots_evictable"] >= r["before"]["token_slots_evictable"], (r["before"], r["after"])
    assert r["after"]["token_slots_free"] <= r["before"]["token_slots_free"], (r["before"], r["after"])  # nothing evicted
    assert r["after"]["mamba_slots_free"] <= r["before"]["mamba_slots_free"], (r["before"], r["after"])  # no Mamba slot either


# ----------------------------------------------------------------------------- a store that never answers


def _during(call, url: str, watch: Stream | None) -> dict:
    """Run ``call`` in a thread; meanwhile time the HTTP process's answers (:func:`_answer_s`, every 0.1 s); the
    largest gap between ``watch``'s events while it ran. This process's garbage collector is off meanwhile: a full
    collection of its heap (torch and SGLang imported) stops every thread of it, the stream's reader too, for ~0.2 s
    on a quiet machine and seconds under load — a gap of the observer's own, which the sleeps below do not see when
    it falls in a call."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _observed(call, url, watch)
    finally:
        if enabled:
            gc.enable()


def _observed(call, url: str, watch: Stream | None) -> dict:
    got: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            got["result"] = call()
        except BaseException as e:  # noqa: BLE001 - examined by the test
            got["error"] = e
        got["span"] = (t0, time.monotonic())

    late: list[float] = []  # how much longer than asked each of this loop's sleeps took: time it could not watch

    def nap(s: float) -> None:
        t0 = time.monotonic()
        time.sleep(s)
        late.append(time.monotonic() - t0 - s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    health, answered = [], []
    nap(0.3)
    while t.is_alive():
        took = _answer_s(url)
        health.append(took)
        answered.append((time.monotonic(), took))
        nap(0.1)
    t.join()
    got["observer_gap_s"] = max(late)
    # what proves the HTTP process answered *during* the stall: the calls that ended before the call under test did
    # (one that ends after it also waited on the scheduler's own handling of the failure, seconds on a loaded machine)
    got["health_during_s"] = [took for end, took in answered if end <= got["span"][1]]
    if watch is not None:
        a, b = got["span"]
        times = [x for x in watch.times if a <= x <= b]
        got["max_gap_s"] = max((y - x for x, y in zip(times, times[1:])), default=None)
        got["events_during"] = len(times)
    got["health_s"] = health
    return got


def _watched(attempt) -> dict:
    """``attempt(n)``'s observation, repeated once when this process itself stalled through the first (blind)."""
    got = attempt(0)
    if got["observer_gap_s"] >= OBSERVER_STALL_S:
        got = attempt(1)
    assert got["observer_gap_s"] < OBSERVER_STALL_S, f"this test process stopped for {got['observer_gap_s']:.1f} s twice: nothing watched"
    return got


def test_export_to_a_store_that_never_answers_keeps_other_requests_decoding(server, hole):
    url = server.url

    def attempt(n: int) -> dict:
        wait_idle(url)
        flush_cache(url)
        # the victim first: SGLang admits a request only beside the decode budget the running ones may still need
        victim = Stream(url, payload(f"bh-victim-{n}", prompt(92, 20), 400))
        other = Stream(url, payload(f"bh-other-{n}", prompt(91, 20), 1500))
        victim.start()
        victim.wait_tokens(3)
        other.start()
        other.wait_tokens(3)
        got = _during(lambda: client.pause(url, f"bh-victim-{n}", f"s3://blackhole/victim-{n}.hsnap"), url, other)
        victim.finish()
        _abort(url, f"bh-other-{n}")
        other.join(120)
        return {**got, "victim": victim}

    got = _watched(attempt)
    victim = got["victim"]
    a, b = got["span"]
    e = got.get("error")
    assert isinstance(e, client.ServerError) and e.status in (502, 504), got
    assert "timeout" in e.error["type"].lower() or "timeout" in e.error["message"].lower(), e.error
    assert b - a >= STORE_TIMEOUT_S * 0.9, "the export ended before the store's bound: the proof needs the stall"
    assert got["events_during"] >= 10 and got["max_gap_s"] < STORE_TIMEOUT_S / 2, got  # the other request decoded on
    during = got["health_during_s"]
    assert len(during) >= 10 and max(during) < 2.0, got["health_s"]  # answered throughout the store's stall
    assert victim.final["meta_info"]["finish_reason"]["type"] == "length"  # given back: it decoded to its end
    assert victim.final["meta_info"]["completion_tokens"] == 400
    wait_idle(url)


def test_resume_from_a_store_that_never_answers_leaves_the_http_process_answering(server, hole):
    url = server.url
    accepted = hole.accepted
    got = _watched(lambda n: _during(lambda: client.resume(url, f"s3://blackhole/gone-{n}.hsnap"), url, None))
    a, b = got["span"]
    e = got.get("error")
    assert isinstance(e, client.ServerError) and e.status in (502, 504), got
    assert hole.accepted > accepted and b - a >= STORE_TIMEOUT_S * 0.9, "the store was not stalled on"
    during = got["health_during_s"]
    assert len(during) >= 10 and max(during) < 2.0, got["health_s"]  # answered throughout the store's stall
    assert stats(url)["checks"].get("error") is None


# ----------------------------------------------------------------------------- a rolling restart (last: it stops the server)


def test_generate_follows_a_drain_into_the_next_server_as_one_exact_stream(server):
    """client.generate: the stream a drain ends with the request's snapshot goes on from the server it is resumed in
    (here the same one), as one stream: the same tokens and text as an uninterrupted run, no chunk repeated."""
    ids, n = prompt(104, 20), 60
    flush_cache(server.url)
    reference = generate(server.url, payload("gen-ref", ids, n))
    flush_cache(server.url)  # the followed run prefills as the reference did
    d = server.root / "gen-drained"
    chunks: list = []
    got: dict = {}
    with paced(server.url, 0.05):  # 55 tokens take 2.75 s at least: the drain lands while it decodes
        t = threading.Thread(target=lambda: got.update(run=client.generate(server.url, payload("gen", ids, n), next_url=server.url,
                                                                          on_chunk=lambda *c: chunks.append(c))), daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while sum(len(c[2]) for c in chunks) < 5:
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.05)
        drained = client.drain(server.url, str(d))
        t.join(180)
    run = got["run"]
    assert drained["ok"] is True and [i["rid"] for i in drained["items"]] == ["gen"]
    assert run.hand_offs == [(server.url, str(d / "gen.hsnap"))], run.hand_offs
    assert run.finish_reason["type"] == "length"
    assert run.output_ids == reference["output_ids"] and tokens(run.final)[0] == tokens(reference)[0]
    assert run.text == reference["text"] == "".join(c[1] for c in chunks)  # each piece once, in order
    assert {c[0] for c in chunks} == {"gen"}
    wait_idle(server.url)


def test_sigterm_drains_every_request_before_the_server_exits(server):
    """--hsnap-drain-on-sigterm: SGLang's graceful shutdown waits for every request to finish; the plug-in drains
    them first, so each client's stream ends with its snapshot and the server exits at once, nothing lost."""
    d = server.root / "sigterm-drained"
    n, pace = 1200, 0.05  # two requests of 20 + 1,200 positions fit the server's 2,500 together
    streams = [Stream(server.url, payload(f"term-{i}", prompt(110 + i, 20), n)) for i in range(2)]
    req = urllib.request.Request(server.url + "/slow_down", data=json.dumps({"forward_sleep_time": pace}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60):  # paced: they are still decoding when the signal lands
        pass
    for st in streams:
        st.start()
    for st in streams:
        st.wait_tokens(3)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for st in streams:
        st.finish()
    assert server.proc.wait(timeout=120) is not None
    exited_s = time.monotonic() - t0
    for st in streams:
        finish = st.final["meta_info"]["finish_reason"]
        assert finish["type"] == "hsnap_export" and finish["path"] == str(d / f"{st.rid}.hsnap"), finish
        assert hsnap_cli(["verify", finish["path"]]) == 0
    assert exited_s < (n - 3) * pace, f"{exited_s:.1f} s: SGLang waited for the requests to finish instead"
    log = server.log_path.read_text(errors="replace")
    assert "hsnap: SIGTERM: draining every request into sigterm-drained" in log, log[-3000:]
    assert f"hsnap: SIGTERM: drained 2 of 2 requests into {d}" in log, log[-3000:]  # the scheduler's word, resolved path
