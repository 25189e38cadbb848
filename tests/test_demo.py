"""``hsnap demo --library`` (the library-level demo; ``hsnap demo`` itself runs two real servers:
tests/engine/test_hsnap_demo.py) end to end, small: greedy and sampled continuation in a fresh process are bit-identical to an
uninterrupted run with no history position recomputed, and the negative client's bad snapshots are refused with
their typed errors, target pools untouched.

One ``hsnap demo --library --all --json`` run (four child processes) serves most tests; one more fresh process resumes the same
snapshot with another thread count to show the numerics warning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hsnap_format as hf  # noqa: E402
from hsnap_io._sglang_env import sglang_available  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sglang_available(), reason="sglang is not installed")]

N, K = 16, 4


def _demo(*args, timeout=300):
    cmd = [sys.executable, "-m", "hsnap_format.tools.cli", "demo", "--library", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    out = str(d / "out" / "request.hsnap")
    proc = _demo("--all", "--n", str(N), "--k", str(K), "--json", "--out", out)
    assert proc.returncode in (0, 1), proc.stderr[-4000:] + proc.stdout[-4000:]
    report = json.loads(proc.stdout)
    return {"rc": proc.returncode, "report": report, "out": out, "stderr": proc.stderr}


def _check_exact(v):
    assert v["tokens_equal"] and v["tokens_matching"] == N
    assert v["reference_token_ids"] == v["resumed_token_ids"]
    assert v["max_abs_logprob_diff"] == 0.0
    assert v["positions_recomputed"] == 0
    # what went through forward in the fresh process: exactly N-k single positions, starting at the state position
    assert v["positions_forwarded"] == N - K and v["forward_calls"] == N - K
    assert v["first_position_fed"] == v["state_position"]
    assert v["reference_positions_forwarded"] == v["state_position"] + N - K
    assert v["numerics_warnings"] == []
    assert v["ok"], v["checks"]


def test_demo_succeeds(demo):
    r = demo["report"]
    assert demo["rc"] == 0 and r["ok"]
    roles = [p["role"] for p in r["processes"]]
    assert roles == ["reference", "export", "resume", "negative"]
    pids = {p["pid"] for p in r["processes"]}
    assert len(pids) == 4 and os.getpid() not in pids
    assert all(p["threads"] == 1 for p in r["processes"])
    # the resuming process forwarded nothing but the continuations: (N-k) per variant
    assert r["resume_process"] == {"positions_forwarded": 2 * (N - K), "expected": 2 * (N - K)}
    assert r["open_with"][0] == f"hsnap info {os.path.relpath(demo['out'])}" or demo["out"] in r["open_with"][0]


def test_greedy_continuation_is_exact(demo):
    v = demo["report"]["variants"]["greedy"]
    _check_exact(v)
    # on SGLang's own Req: the client's stream continues at the offset it stopped at, the
    # reasoning state (mid-reasoning at the pause) carries, the restored Mamba slot is kept
    assert v["api"] == "sglang.Req"
    st = v["stream"]
    assert st["continuous"] and st["repeated"] == st["missing"] == 0 and st["first_resumed_chunk_starts_at"] == K
    rs = v["reasoning"]
    assert v["checks"]["reasoning_state_carried"] and not rs["at_pause"]["reasoning_over"]
    assert rs["final"] == rs["reference_final"]
    assert v["checks"]["restored_state_not_cleared"]
    # restored at other slots of pools of another capacity
    e, s = v["export"]["slots"], v["restore"]["slots"]
    assert s["pool_token_capacity"] != e["pool_token_capacity"]
    assert (s["req_pool_idx"], s["mamba_idx"], s["first_token_slot"]) != (e["req_pool_idx"], e["mamba_idx"], e["first_token_slot"])


def test_sampled_continuation_is_exact(demo):
    v = demo["report"]["variants"]["sampled"]
    _check_exact(v)
    assert v["temperature"] > 0 and v["checks"]["sampler_state_equal"]
    assert v["snapshot"]["request"]["has_rng_state"]


def test_snapshot_left_on_disk_with_record_and_identity(demo):
    r = demo["report"]
    v = r["variants"]["greedy"]
    with hf.open(demo["out"]) as snap:
        snap.verify()
        rec = snap.record()
        assert snap.root_digest == v["snapshot"]["root_digest"]
        assert [s.digest for s in snap.sections] == [s["digest"] for s in v["snapshot"]["sections"]]
        assert [s.length for s in snap.sections] == [s["bytes"] for s in v["snapshot"]["sections"]]
        ident = snap.identity
    assert list(rec.prompt_ids) == r["config"]["prompt_ids"]
    assert list(rec.output_ids) == v["reference_token_ids"][:K]
    assert rec.state_position == len(rec.prompt_ids) + K - 1 == v["state_position"]
    assert rec.max_new_tokens == N and rec.streamed_tokens == K and rec.remaining_budget == N - K
    assert rec.output_logprobs is not None and len(rec.output_logprobs) == K
    # a live SGLang Req: greedy in SGLang's normal form (temperature 1.0, top_k 1), no per-request generator
    assert rec.rng_state is None and rec.sampling["top_k"] == 1 and rec.extra["sglang.format"] == "sglang-req/1"
    assert ident.model_id == "hsnap-demo/tiny-qwen3_5"
    assert ident.weights_version == r["model"]["weights_version"] and ident.weights_version.startswith("sha256:")
    assert ident.engine.name == "sglang" and ident.engine.version == "0.5.23"
    assert ident.numerics["num_threads"] == 1 and ident.numerics["device"] == "cpu"
    assert "torch" in ident.numerics
    kinds = {s["kind"] for s in v["snapshot"]["sections"]}
    assert {"attn_k", "attn_v", "conv", "temporal", "prompt_ids", "output_ids", "output_logprobs"} <= kinds
    sampled = r["variants"]["sampled"]["snapshot"]["path"]
    with hf.open(sampled) as snap:
        rec = snap.record()
    assert rec.rng_state is not None and rec.sampling["temperature"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    "case,expected",
    [
        ("wrong weights version", "IncompatibleSnapshotError"),
        ("wrong layout", "IncompatibleSnapshotError"),
        ("missing rank file", "MalformedManifestError"),
        ("corrupted section", "DigestMismatchError"),
    ],
)
def test_negative_client_refuses_and_leaves_pools_untouched(demo, case, expected):
    neg = demo["report"]["negative"]
    c = next(c for c in neg["cases"] if c["case"] == case)
    assert c["error"] == expected == c["expected_error"]
    assert c["pools_untouched"] and c["changed"] == []
    assert c["fingerprint"]["before"] == c["fingerprint"]["after"] and c["fingerprint"]["entries"] > 50
    assert c["ok"]
    if case == "wrong weights version":
        assert "identity.weights_version" in c["message"]
    elif case == "wrong layout":
        assert "geometry.attention.heads" in c["message"]
    elif case == "missing rank file":
        assert "rank-1.hsnap" in c["message"]
    else:
        assert "temporal" in c["message"] and "digest" in c["message"]


def test_negative_client_other_numerics_warns(demo):
    a = demo["report"]["negative"]["advisory"]
    assert a["ok"] and a["warning"] == "NumericsWarning"
    assert "num_threads" in a["message"] and "bit-exactness" in a["message"]


def test_resume_under_other_numerics_says_so(demo, tmp_path):
    """A second fresh process resumes the same file with 2 threads: the restore warns that exactness is not
    expected; the continuation is still N-k positions, nothing recomputed."""
    snap = str(tmp_path / "copy.hsnap")
    shutil.copyfile(demo["out"], snap)
    result = str(tmp_path / "resume.json")
    cmd = [sys.executable, "-m", "hsnap_io.demo.run", "--child", "resume", "--result", result,
           "--threads", "2", "--snapshot", "greedy", snap]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="2", TRANSFORMERS_VERBOSITY="error"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(result) as f:
        res = json.load(f)["variants"]["greedy"]
    assert any("num_threads" in w and "bit-exactness" in w for w in res["numerics_warnings"])
    assert ["identity.numerics.num_threads", 2, 1] in res["numerics_differences"]
    assert res["positions_forwarded"] == N - K and res["history_positions_recomputed"] == 0
    ref = demo["report"]["variants"]["greedy"]["reference_token_ids"]
    assert res["token_ids"][:K] == ref[:K]  # what came from the file; the rest may differ under other numerics


def test_output_path_that_is_not_a_snapshot_is_not_replaced(tmp_path, capsys):
    from hsnap_io.demo.run import main

    p = tmp_path / "notes.txt"
    p.write_text("mine")
    assert main(["--out", str(p)]) == 2
    assert p.read_text() == "mine"
    assert "exists: the demo never replaces a file" in capsys.readouterr().err
    assert main(["--n", "4", "--k", "4", "--out", str(tmp_path / "x.hsnap")]) == 2


def test_item5_library_demo_never_replaces_a_previous_snapshot(demo, tmp_path, capsys):
    """The demo used to delete "the previous demo snapshot" at --out; it writes only new files now (a snapshot
    path, a --workdir, the reshard set: each refused when it exists, left byte for byte as it was)."""
    from hsnap_io.demo.run import main

    p = tmp_path / "old.hsnap"
    shutil.copyfile(demo["out"], p)
    before = p.read_bytes()
    assert main(["--out", str(p)]) == 2
    assert p.read_bytes() == before and "never replaces" in capsys.readouterr().err
    work = tmp_path / "work"
    work.mkdir()
    (work / "reference.json").write_text("mine")
    assert main(["--negative", "--workdir", str(work)]) == 2
    assert os.listdir(work) == ["reference.json"] and (work / "reference.json").read_text() == "mine"
    assert "exists" in capsys.readouterr().err
    tp2 = tmp_path / "tp2" / "request.tp2"
    tp2.mkdir(parents=True)
    (tp2 / "manifest.json").write_text("mine")
    assert main(["--reshard", "2:1", "--out", str(tmp_path / "tp2" / "x.hsnap")]) == 2
    assert (tp2 / "manifest.json").read_text() == "mine"


def test_item5_library_demo_default_output_is_a_new_directory(tmp_path, monkeypatch):
    from hsnap_io.demo.run import _default_out

    monkeypatch.chdir(tmp_path)
    first, second = _default_out(), _default_out()
    assert first != second and os.path.dirname(first).startswith("hsnap-demo-library-")
    assert all(os.path.isdir(os.path.dirname(p)) and not os.path.exists(p) for p in (first, second))


def test_item5_hsnap_demo_dispatches_library_lazily():
    """``hsnap demo --library`` reaches the library demo without importing SGLang's server or torch first."""
    code = ("import sys\nfrom hsnap_sglang.demo import main\n"
            "rc = main(['--library', '--n', '4', '--k', '4'])\n"
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "2 []", proc.stdout + proc.stderr[-2000:]
    assert "need 1 <= k < N" in proc.stderr


_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(600)
"""


def test_item5_demo_stops_a_server_that_ignores_sigterm_and_its_children(tmp_path):
    """The demo's servers are always stopped: SIGTERM to the server's pid, then, after the bound, SIGKILL to it and to
    every descendant still running (each by its pid) — here a real process tree that ignores SIGTERM."""
    psutil = pytest.importorskip("psutil")
    from hsnap_sglang.demo import DemoServer

    srv = DemoServer("stubborn", tmp_path, tmp_path / "stubborn.log", [], dict(os.environ), launcher=("-c", _STUBBORN)).spawn()
    try:
        deadline = time.monotonic() + 60
        while b"child" not in (tmp_path / "stubborn.log").read_bytes():
            assert time.monotonic() < deadline and srv.proc.poll() is None
            time.sleep(0.05)
        child = int((tmp_path / "stubborn.log").read_text().split()[1])
        t0 = time.monotonic()
        out = srv.stop(grace=1.0)
        assert time.monotonic() - t0 < 30
        assert out["left"] == [] and sorted(out["killed"]) == sorted([srv.pid, child]) and out["exit_code"] is None
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert srv.proc.poll() is not None
    finally:
        for pid in srv.living():
            psutil.Process(pid).kill()
