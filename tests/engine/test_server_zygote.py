"""The test servers' fork server (hsnap_testing.server_zygote): a forked ``hsnap_sglang.serve`` gets the server's own
environment and log, and its exit reaches the test as a Popen's would (the engine modules' servers cover the rest:
SIGTERM, SIGKILL to the process group, -N on signal N)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from engine_support import engine_env
from hsnap_testing import server_zygote

pytestmark = pytest.mark.engine

SERVE = [sys.executable, "-m", "hsnap_sglang.serve"]


@pytest.fixture
def forked(monkeypatch):
    monkeypatch.delenv(server_zygote.ENABLE_ENV, raising=False)


def test_help_runs_as_python_dash_m_with_its_output_in_the_log(tmp_path, forked):
    log = tmp_path / "help.log"
    proc = server_zygote.popen([*SERVE, "--help"], env=engine_env(), log_path=log)
    assert isinstance(proc, server_zygote.ForkedServer)
    assert proc.wait(timeout=120) == 0
    text = log.read_text()
    assert text.startswith("usage: python -m hsnap_sglang.serve") and "SGLang's own options" in text
    assert "found in sys.modules" not in text  # run as __main__ by runpy, not imported before


def test_the_servers_environment_reaches_it_and_a_refusal_is_exit_1_with_its_message(tmp_path, forked):
    log = tmp_path / "refused.log"
    proc = server_zygote.popen([*SERVE, "--model-path", str(tmp_path)], env=engine_env(HSNAP_SGLANG_START_METHOD="thread"),
                               log_path=log)
    assert proc.wait(timeout=120) == 1
    assert "HSNAP_SGLANG_START_METHOD='thread': expected one of fork, spawn" in log.read_text()


def test_a_server_in_a_new_session_killed_by_signal_is_minus_n(tmp_path, forked):
    # a server that waits: its model path is a FIFO nobody writes (SGLang reads the config from it)
    fifo = tmp_path / "model"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    proc = server_zygote.popen([*SERVE, "--model-path", str(fifo)], env=engine_env(), log_path=tmp_path / "wait.log")
    try:
        assert proc.poll() is None and os.getpgid(proc.pid) == proc.pid  # its own process group, as start_new_session
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
