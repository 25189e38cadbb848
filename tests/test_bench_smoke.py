"""The benchmark runs end to end in its tiny mode and prints its tables (no timing
assertions: speed targets are held by `make bench`, never by tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from hsnap_io.sglang_env import sglang_available  # noqa: E402

pytestmark = pytest.mark.skipif(not sglang_available(), reason="SGLang pools not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_bench_quick_prints_the_tables(tmp_path):
    results = tmp_path / "RESULTS.md"
    p = _run("bench.run", "--quick", "--dir", str(tmp_path / "work"), "--results", str(results))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for heading in ("## Export — fsync", "## Export — no fsync", "## Restore into fresh slots", "## Open", "## Targets"):
        assert heading in out, heading
    for column in ("hsnap/best raw", "save_file/hsnap", "torch.save/hsnap", "verify/best limit", "exact_rollback", "2-core floor", "ceiling"):
        assert column in out, column
    assert "| 53 " in out  # the one size of --quick
    assert ("PASS" in out) or ("MISS" in out)
    text = results.read_text()
    assert "Machine:" in text and "Filesystem:" in text and "Versions:" in text and "Page cache: WARM" in text
    assert not os.listdir(tmp_path / "work")  # every file it wrote is gone


def test_two_core_floor_puts_the_phases_before_the_upload_on_one_thread():
    from bench.run import PHASES, Case, two_core_floor

    c = Case(53, None, 0, None)
    assert two_core_floor(c, "verify") is None  # no CPU time measured: no floor claimed
    # three runs: open, prove, allocate, plan, upload (ms), and each run's CPU time over both threads
    runs = [((1.0, 0.5, 0.25, 0.25, 3.0), 7.0), ((1.5, 0.5, 0.5, 0.5, 3.0), 6.0), ((1.0, 0.5, 0.25, 0.25, 3.0), 9.0)]
    for i, p in enumerate(PHASES):
        c.times[f"phase/verify/{p}"] = [phases[i] / 1e3 for phases, _ in runs]
    c.times["cpu/verify"] = [cpu / 1e3 for _, cpu in runs]
    # each run: its phases before the upload on one thread, the rest of its CPU on two cores at best; the median of those
    assert two_core_floor(c, "verify") == pytest.approx(sorted([2 + 5 / 2, 3 + 3 / 2, 2 + 7 / 2])[1] / 1e3)
    c.times["cpu/verify"] = [1e-3, 1e-3, 1e-3]  # less CPU than the phases' wall time (a wait): the phases alone bound it
    assert two_core_floor(c, "verify") == pytest.approx(2e-3)


def test_interleave_drops_what_contenders_recorded_in_the_warm_up_rounds():
    from bench.run import interleave

    sink = {"earlier": [1.0]}
    runs = []

    def contender() -> float:  # records its own figures too, as the restore contenders do (phases, CPU time)
        runs.append(len(runs))
        sink.setdefault("phase/x", []).append(runs[-1])
        sink["earlier"].append(runs[-1])
        return 0.5

    interleave({"c": contender}, 2, 3, sink)
    assert sink == {"earlier": [1.0, 2, 3, 4], "phase/x": [2, 3, 4], "c": [0.5, 0.5, 0.5]}


def test_gpu_check_imports_and_runs_its_cpu_parts(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run `python -m bench.gpu_check` itself")
    p = _run("bench.gpu_check", "--dir", str(tmp_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "CPU parts OK at 53 tokens" in p.stdout
    assert "SKIP: torch.cuda.is_available() is False" in p.stdout
    # step 6 (two real servers on the GPU) shows what it would start: SGLang's own server, the plug-in from the environment
    plan = p.stdout.split("SKIP: step 6 (two servers) needs one too", 1)[1].splitlines()[1:3]
    # ... with the snapshot root its paths lie in (the model's directory's parent)
    assert all(re.match(r"HSNAP_SGLANG_PLUGIN=1 HSNAP_ROOT=(\S+) python -m sglang\.launch_server --model-path \1/model ", line.strip())
               for line in plan), plan
    assert "--max-mamba-cache-size 8" in plan[0] and "--max-mamba-cache-size 12" in plan[1]
