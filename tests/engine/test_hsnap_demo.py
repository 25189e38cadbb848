"""``hsnap demo``: the command ``make demo`` runs, end to end, on two real SGLang servers.

One run of ``hsnap demo --json`` (its defaults: N=128, k=10) serves the report tests: every check of the report is
read back from what the run left on disk too (the snapshot, the server pids).  Its servers run with SGLang's own
strict checks on (a leaked slot or a broken radix tree kills the scheduler), so this one run is also the suite's
proof of the single-request path — export mid-decode beside other requests, the source server gone, a fresh
server with other capacities and another request running resumes it exactly, decode inputs only, the stream
continuous, the negative clients (test_hsnap_server.py goes on from there: drain, checkpoints, busy refusals).
A second run is interrupted with SIGINT (Ctrl-C) once its source server has started its child processes: the demo
stops them all, by pid, and exits 130, leaving its output directory in place.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hsnap_support import PLUGIN_ENV

from hsnap_testing.terminal import sigint_as_at_a_terminal

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DEMO_TIMEOUT_S = 1200


def _demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsnap_format.tools.cli", "demo", *args]


@pytest.fixture(scope="module")
def demo(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hsnap-demo") / "run"
    strict = {k: v for k, v in PLUGIN_ENV.items() if k != "HSNAP_SGLANG_PLUGIN"}  # the demo turns the plug-in on itself
    proc = subprocess.run(_demo_cmd("--json", "--out", str(out), "--model-dir", str(tiny_model_dir)), capture_output=True,
                          text=True, timeout=DEMO_TIMEOUT_S, env=dict(os.environ, **strict))
    assert proc.stdout.strip(), proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    return {"rc": proc.returncode, "report": report, "out": out, "stderr": proc.stderr}


def test_demo_succeeds_with_every_check(demo):
    r = demo["report"]
    assert demo["rc"] == 0 and r["ok"], ({k: v for k, v in r.get("checks", {}).items() if not v}, demo["stderr"][-3000:])
    assert all(r["checks"].values()) and len(r["checks"]) >= 14


def test_resumed_request_equals_the_uninterrupted_reference(demo):
    res = demo["report"]["resume"]
    assert res["n"] == 128 and res["tokens_matching"] == 128
    assert res["max_abs_logprob_diff"] == 0.0
    assert res["finish_reason"]["type"] == "length"


def test_target_forwards_are_decode_only_counted_from_completed_forwards(demo):
    r = demo["report"]
    k = r["export"]["output_tokens"]
    assert r["export"]["streamed_before_pause"] >= 10 and k >= 10  # exported at the next committed boundary after k
    assert r["resume"]["target_forwards"] == {"decode": 128 - k, "extend": 0}
    assert r["resume"]["history_positions_recomputed"] == 0
    # the source prefilled x once and decoded it k - 1 times (the first output comes from the prefill)
    assert r["export"]["source_forwards"] == {"decode": k - 1, "extend": 1}
    assert r["export"]["committed_positions"] == r["export"]["prompt_tokens"] + k - 1


def test_export_releases_the_slots_and_leaves_both_servers_consistent(demo):
    # SGLang's own idle checks in both servers (pool accounting, request rows, the radix tree), strict in this run
    assert demo["report"]["checks"]["pools_consistent"] is True
    assert demo["report"]["checks"]["exported_at_committed_boundary"] is True


def test_resume_reports_what_it_checked_and_uploaded(demo):
    r = demo["report"]
    assert r["resume"]["bytes_uploaded"] > 0 and r["resume"]["numerics_differences"] == []
    assert r["checks"]["same_numerics"] is True and r["snapshot"]["snapshot_id"]
    assert r["snapshot"]["state_position"] == r["export"]["committed_positions"]


def test_stream_continues_without_repeated_or_missing_chunk(demo):
    st = demo["report"]["stream"]
    assert st["continuous"] and st["client_chunks_are_the_new_parts"]
    assert st["repeated"] == {"text_chars": 0, "output_ids": 0} and st["missing"] == {"text_chars": 0, "output_ids": 0}
    assert st["resume_started_at"] == st["source_stream_ended_at"]
    assert st["chunks_before_pause"] >= 1 and st["chunks_after_resume"] >= 1 and st["common_boundaries"] >= 64


def test_source_pauses_x_while_the_others_decode_beside_it(demo):
    # SGLang caps the running requests by the Mamba slots (3 per request here): the source has room for all three
    assert {"x", "other-1", "other-2"} <= set(demo["report"]["export"]["running_beside_x"])
    assert demo["report"]["checks"]["others_decoding_beside_x"] is True


def test_source_exits_before_a_fresh_target_with_other_capacities(demo):
    src, dst = demo["report"]["servers"]
    assert (src["role"], dst["role"]) == ("source", "target") and src["pid"] != dst["pid"]
    assert src["exit_code"] is not None and src["processes_left"] == [] and src["killed"] == []
    assert src["descendants"], "the server runs child processes (scheduler, detokenizer)"
    for pid in [src["pid"], dst["pid"], *src["descendants"], *dst["descendants"]]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert src["capacity"] != dst["capacity"]
    assert set(dst["capacity"]) == {"max-total-tokens", "max-mamba-cache-size", "max-running-requests"}
    others = demo["report"]["others"]
    assert [o["server"] for o in others].count("target") == 1 and all(o["equal"] for o in others)
    assert next(o for o in others if o["server"] == "target")["running_when_x_resumed"] is True


@pytest.mark.parametrize("case,expected", [("version", "UnsupportedVersionError"), ("layout", "IncompatibleSnapshotError"),
                                           ("binding", "IncompatibleSnapshotError"), ("manifest", "MalformedManifestError"),
                                           ("digest", "DigestMismatchError")])
def test_negative_client_http_error_before_output_state_unchanged(demo, case, expected):
    n = next(n for n in demo["report"]["negative"] if n["case"] == case)
    assert n["error"] == expected and 400 <= n["status"] < 500
    assert n["outputs"] == 0 and n["state_unchanged"] and n["ok"]
    assert os.path.exists(n["path"])  # kept, for a look with hsnap info / hsnap-view


def test_snapshot_and_every_output_stay_in_the_new_directory(demo):
    import hsnap_format as hf

    r, out = demo["report"], demo["out"]
    s = r["snapshot"]
    assert s["path"] == str(out / "x.hsnap") and r["config"]["out"] == str(out)
    with hf.open(s["path"]) as snap:
        snap.verify()
        assert snap.root_digest == s["root_digest"] and snap.state_position == r["export"]["committed_positions"]
        assert snap.record().rid == "x"
    assert {"x.hsnap", "source.log", "target.log", "servers.json", "negative"} <= set(os.listdir(out))
    assert any(cmd.startswith("hsnap-view ") and cmd.endswith("x.hsnap") for cmd in r["open_with"])


def test_demo_refuses_an_existing_output_directory(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    proc = subprocess.run(_demo_cmd("--out", str(keep)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert os.listdir(keep) == ["notes.txt"] and (keep / "notes.txt").read_text() == "mine"


def test_ctrl_c_stops_every_server_process(tiny_model_dir, tmp_path):
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(_demo_cmd("--out", str(out), "--model-dir", str(tiny_model_dir)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_at_a_terminal)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # the source server is up far enough to have started its children
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                pid = json.loads((out / "servers.json").read_text())[0]["pid"]
                children = psutil.Process(pid).children(recursive=True)
            except (OSError, ValueError, IndexError, psutil.Error):
                children = []
            if len(children) >= 2:
                seen = {pid, *(c.pid for c in children)}
                break
            time.sleep(0.2)
        assert seen, "the source server never started its child processes"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        for p in left:  # a failed test leaves nothing running either (each process by its pid)
            try:
                psutil.Process(p).kill()
            except psutil.Error:
                pass
    assert rc == 130, proc.stderr.read()[-3000:]
    assert left == []
    assert (out / "source.log").exists() and (out / "servers.json").exists()  # the run's own files are kept
