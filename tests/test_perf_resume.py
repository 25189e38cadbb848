"""bench.resume runs end to end (tiny model): resume and recompute give the same next
token (the bench asserts it) and the table is written. No timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hsnap_io.sglang_env import sglang_available  # noqa: E402

pytestmark = pytest.mark.skipif(not sglang_available(), reason="SGLang pools not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resume_bench_tiny(tmp_path):
    out = tmp_path / "RESUME.md"
    p = subprocess.run([sys.executable, "-m", "bench.resume", "--tiny", "--sizes", "16,64", "--rounds", "1", "--results", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = out.read_text()
    assert "| 16 " in text and "| 64 " in text and "recompute/resume" in text and "Crossover:" in text
    assert "skipped" not in text
