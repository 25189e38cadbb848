"""Fresh child processes without fresh imports: ``python script.py`` / ``-m module`` / ``-c code`` forked from a
process that has already imported torch and SGLang's memory pools.

A test that proves something in *another process* (a restore in a process that never saw the export, two TP ranks
on gloo, a kill mid-write) needs that process to share no state with the test or with another child, not to import
torch and SGLang again: those imports are ~12 CPU-s of every such child here, most of its cost on two cores.  The
zygote is multiprocessing's forkserver with :data:`PRELOAD` imported once per test process; each child is a fork of
it that has run nothing but those imports, then runs its script as ``__main__`` with its own argv, working directory,
environment and output files.

Not for a child whose imports, memory or start-up a test measures.  A child whose environment must reach an import
and differs there from the zygote's (``HSNAP_SGLANG_CPU``, ``PYTHONPATH``, ``OMP_*``: a test that set one, or a
worker whose environment changed since the zygote started) gets a fresh interpreter instead (:class:`subprocess.Popen`,
the same calls).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref

__all__ = ["PRELOAD", "Child", "popen", "run"]

PRELOAD = ["hsnap_testing.zygote_preload"]
# read at interpreter start or at an import the zygote has already made: a child asking for another value than the
# zygote started with would not get it from a fork
_IMPORT_TIME_ENV = ("HSNAP_SGLANG_CPU", "PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")

_context_lock = threading.Lock()
_context = None
_zygote_env: dict[str, str | None] = {}


def _forkserver():
    """The forkserver context; the zygote itself starts at the first child, with this process's environment now."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _zygote_env.update({k: os.environ.get(k) for k in _IMPORT_TIME_ENV})
            _context = ctx
        return _context


def _child_main(argv: list[str], cwd: str | None, env: dict[str, str], where: str) -> None:
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            f = os.open(os.path.join(where, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # its Child was dropped unwaited (the directory went with it): nobody reads this
            f = os.open(os.devnull, os.O_WRONLY)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    flag, rest = argv[0], argv[1:]
    if flag == "-m":
        sys.argv = [rest[0], *rest[1:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif flag == "-c":
        sys.argv = ["-c", *rest[1:]]
        sys.path.insert(0, "")
        exec(compile(rest[0], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
    else:
        script = os.path.abspath(flag)
        sys.argv = [flag, *rest]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


class Child:
    """The handful of :class:`subprocess.Popen` members the tests use: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``communicate`` (the child's whole stdout and stderr, read from its files once it has ended), ``kill``,
    ``send_signal``.  A child killed by signal N has ``returncode`` -N, as with Popen."""

    def __init__(self, argv: list[str], process, where: str, text: bool) -> None:
        self.args, self._process, self._text = argv, process, text
        self._out, self._err = os.path.join(where, "stdout"), os.path.join(where, "stderr")
        self.pid: int = process.pid
        self.returncode: int | None = None
        weakref.finalize(self, shutil.rmtree, where, True)

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None):
        self.wait(timeout)
        out, err = (self._read(p) for p in (self._out, self._err))
        return out, err

    def _read(self, path: str):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # the child died before it opened its files: the zygote's own stderr says why
            data = b""
        return data.decode(errors="replace") if self._text else data

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.poll() is None:
            self._process.kill()


def popen(argv: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
          text: bool = False) -> "Child | subprocess.Popen":
    """Start ``argv`` (``[sys.executable, script | -m module | -c code, *args]``) as a fork of the zygote; its stdout
    and stderr go to files in a temporary directory of its own, removed with the :class:`Child`.  An environment
    that differs from the zygote's where imports read it: a fresh interpreter, stdout and stderr piped."""
    if not argv or argv[0] != sys.executable:
        raise ValueError(f"zygote: not a Python command of this interpreter: {argv[:2]!r}")
    env = dict(os.environ if env is None else env)
    ctx = _forkserver()
    if any(env.get(k) != _zygote_env.get(k) for k in _IMPORT_TIME_ENV):
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)
    where = tempfile.mkdtemp(prefix="zygote-")
    process = ctx.Process(target=_child_main, args=(argv[1:], None if cwd is None else str(cwd), env, where))
    process.start()
    return Child(argv, process, where, text)


def run(argv: list[str], *, cwd=None, env=None, text: bool = False, check: bool = False,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` through :func:`popen`, the output always captured; a timeout kills the child."""
    child = popen(argv, cwd=cwd, env=env, text=text)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    if check and child.returncode:
        raise subprocess.CalledProcessError(child.returncode, argv, out, err)
    return subprocess.CompletedProcess(argv, child.returncode, out, err)  # type: ignore[arg-type]
