"""``hsnap demo``'s process handling (the demo itself, two real servers, runs in tests/engine/test_hsnap_demo.py)."""

from __future__ import annotations

import os
import time

import pytest

pytestmark = pytest.mark.slow

_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(600)
"""


def test_demo_stops_a_server_that_ignores_sigterm_and_its_children(tmp_path):
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
