"""bench.reshard and bench.scaling run end to end in their quick modes and print their
tables (no timing assertions: the figures belong to bench/RESHARD.md and bench/SCALING.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hsnap_io.sglang_env import sglang_available  # noqa: E402

pytestmark = pytest.mark.skipif(not sglang_available(), reason="SGLang pools not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_reshard_bench_quick_prints_the_comparison(tmp_path):
    p = _run("bench.reshard", "--quick", "--dir", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for text in ("plain verify=True", "re-sharded verify=True", "re-sharded verify=during", "re-sharded verify=False",
                 "| gqa | 4,096 | 2->1 |", "| gqa | 4,096 | 1->2 |", "verify pass", "staging (lower bound)", "one pread per run",
                 "## Targets", "Load average", "Machine:"):
        assert text in out, text
    assert ("PASS" in out) or ("MISS" in out)
    assert not os.listdir(tmp_path)  # every set it wrote is gone


def test_scaling_bench_quick_prints_the_fits(tmp_path):
    p = _run("bench.scaling", "--quick", "--dir", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for text in ("## With committed tokens", "## With the number of sections", "## Predicting", "fixed (ms)", "R^2",
                 "| export |", "| open |", "| restore verify |", "| restore no-verify |", "| restore re-sharded 1->2 |",
                 "| 53 | 4,096 |", "| 1 layers | 100 layers |", "Load average", "left out (--no-url)"):
        assert text in out, text
    assert not os.listdir(tmp_path)
