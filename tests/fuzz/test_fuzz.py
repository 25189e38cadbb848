"""The atheris harness in CI: a bounded run (60 s; HSNAP_FUZZ_SECONDS to change it),
the seeds reaching past the integrity layer, and every saved regression replayed.

Longer runs on demand: see the docstring of tests/fuzz/fuzz_open.py.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fuzz_open  # noqa: E402

from hsnap_format import reader  # noqa: E402

REGRESSIONS = os.path.join(HERE, "regressions")


def _regressions():
    if not os.path.isdir(REGRESSIONS):
        return []
    return sorted(n for n in os.listdir(REGRESSIONS) if not n.startswith(".") and not n.endswith(".md"))


@pytest.mark.parametrize("name", _regressions() or [pytest.param(None, marks=pytest.mark.skip(reason="no regressions saved"))])
def test_regression_inputs_give_typed_errors_only(name):
    with open(os.path.join(REGRESSIONS, name), "rb") as f:
        fuzz_open.TestOneInput(f.read())


def test_seeds_open_and_verify():
    """The seeds are valid files in every file mode: mutations start deep, not at the magic."""
    seeds = fuzz_open.seeds()
    opened = 0
    for s in seeds:
        fuzz_open.TestOneInput(s)
        mode = s[0] & 0x7F
        if mode == fuzz_open.RAW:
            data = s[1:]
        elif mode == fuzz_open.REPACK:
            (h,) = struct.unpack("<I", s[1:5])
            data = fuzz_open.repack(s[5 : 5 + h], s[5 + h :], bool(s[0] & fuzz_open.FIX_DIGESTS))
        else:
            continue
        with open(fuzz_open._FILE, "wb") as f:
            f.write(data)
        with reader.Snapshot(fuzz_open._FILE) as snap:
            snap.verify()
            snap.record()
        opened += 1
    assert opened >= 12 and len(seeds) > opened


@pytest.mark.slow
def test_bounded_fuzz_run(tmp_path):
    pytest.importorskip("atheris", reason="atheris is not installed: pip install atheris")
    seconds = int(os.environ.get("HSNAP_FUZZ_SECONDS", "30"))
    corpus, crashes = tmp_path / "corpus", tmp_path / "crashes"
    corpus.mkdir()
    crashes.mkdir()
    cmd = [sys.executable, os.path.join(HERE, "fuzz_open.py"), str(corpus), f"-max_total_time={seconds}", "-timeout=10",
           "-rss_limit_mb=1536", f"-artifact_prefix={crashes}/", "-print_final_stats=1"]
    env = {**os.environ, "HSNAP_FUZZ_WORK": str(tmp_path / "work")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 240, env=env)
    log = proc.stdout + proc.stderr
    found = sorted(os.listdir(crashes))
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
    print(f"\nfuzz: {runs.group(1) if runs else '?'} inputs in {seconds} s, corpus {len(os.listdir(corpus))} files, crashes {found}")
    assert proc.returncode == 0 and not found, (
        f"fuzzer found {found} (copy them to tests/fuzz/regressions/):\n" + log[-6000:])
    assert runs and int(runs.group(1)) > 0
