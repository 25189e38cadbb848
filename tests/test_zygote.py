"""The test kit's zygote: children forked from one process that imported torch and SGLang's pools behave as
``python ...`` children do (argv, working directory, environment, output, exit status, signals), and share no
state with the test process; one whose environment must reach its imports gets a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hsnap_testing import zygote  # noqa: E402

_PROBE = "import json, os, sys; print(json.dumps([sys.argv, os.getcwd(), os.environ.get('ZYGOTE_PROBE'), os.getpid()])); " \
         "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))"


def test_a_child_gets_its_argv_cwd_env_and_exit_status_and_its_output_is_captured(tmp_path):
    import json

    r = zygote.run([sys.executable, "-c", _PROBE, "3", "x"], cwd=tmp_path, env=dict(os.environ, ZYGOTE_PROBE="yes"), text=True)
    argv, cwd, probe, pid = json.loads(r.stdout)
    assert (r.returncode, argv, cwd, probe, r.stderr) == (3, ["-c", "3", "x"], str(tmp_path), "yes", "to stderr\n")
    assert pid != os.getpid()


def test_a_script_runs_as_main_beside_its_own_directory(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "main.py").write_text("import sys, helper\nif __name__ == '__main__':\n    sys.exit(helper.VALUE)\n")
    assert zygote.run([sys.executable, str(tmp_path / "main.py")]).returncode == 7


def test_a_killed_child_reports_the_signal_as_popen_does():
    child = zygote.popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL


def test_an_environment_that_must_reach_the_imports_gets_a_fresh_interpreter():
    parent = "import os; print(os.getppid())"  # a fork's parent is the zygote, a fresh interpreter's this process
    forked = zygote.run([sys.executable, "-c", parent], text=True)
    fresh = zygote.popen([sys.executable, "-c", parent], env=dict(os.environ, PYTHONPATH="/nonexistent-zygote-probe"), text=True)
    assert isinstance(fresh, subprocess.Popen)
    out, _ = fresh.communicate(timeout=60)
    assert int(out) == os.getpid() != int(forked.stdout) and fresh.returncode == 0
