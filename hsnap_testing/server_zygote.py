"""Test servers without fresh imports: ``python -m hsnap_sglang.serve ...`` forked from a process that has already
imported SGLang's server on hsnap's CPU platform.

A server start here was ~20 CPU-s on two cores, ~18 of them the same imports every time (torch, transformers, SGLang's
HTTP server, scheduler, model runner and its registry of ~280 model classes).  The server zygote is a process of its own
(``python -m hsnap_testing.server_zygote``, one per test process and environment) that makes those imports once, then
forks a server per request: the fork starts a new session (its own process group, as ``start_new_session``), writes its
output to the server's log, takes the server's environment and working directory, and runs ``hsnap_sglang.serve`` as
``__main__``, exactly as ``python -m`` would; its scheduler and detokenizer start from it as from any server.  The
zygote reaps it and reports its exit status, so :class:`ForkedServer` answers as :class:`subprocess.Popen` does
(``-N`` for a server ended by signal N).

A zygote serves the servers whose environment equals the one it started with, except where only the server reads it
at run time (``HSNAP_*`` settings of the plug-in, pytest's ``PYTEST_*``, botocore's ``AWS_*``, SGLang's conv-state
dtype); another environment gets a zygote of its own.  ``HSNAP_TEST_SERVER_ZYGOTE=0``: every server a fresh interpreter (:func:`popen` returns a plain Popen).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["ENABLE_ENV", "ForkedServer", "popen"]

ENABLE_ENV = "HSNAP_TEST_SERVER_ZYGOTE"
MODULE = "hsnap_sglang.serve"
# read by the server at run time only: a server may differ from its zygote here (hsnap's settings, pytest's own,
# botocore's, SGLang's Mamba conv-state dtype: read when the model config is built)
_RUN_TIME_PREFIXES = ("HSNAP_", "PYTEST_", "AWS_")
_RUN_TIME_KEYS = ("SGLANG_MAMBA_CONV_DTYPE",)
_IMPORT_TIME_KEYS = ("HSNAP_SGLANG_CPU",)
READY_TIMEOUT_S = 300.0
# zygotes one test process keeps (~0.5 GB each): past it the least recently used one whose servers have all ended
# is closed; if every one still has a server running, the new server starts the ordinary way
_MAX_ZYGOTES = 3


def _import_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` that can reach an import the zygote has already made (less the CPU platform's own
    settings at the values it gives them: a test process that activated the platform in-process has them)."""
    from hsnap_sglang import cpu

    own = {cpu.SGLANG_CPU_ENV: "1", cpu.ONEDNN_ISA_ENV: cpu.ONEDNN_MAX_ISA, cpu.OMP_WAIT_ENV: cpu.OMP_WAIT}
    return tuple(sorted((k, v) for k, v in env.items()
                        if (k in _IMPORT_TIME_KEYS or not (k.startswith(_RUN_TIME_PREFIXES) or k in _RUN_TIME_KEYS))
                        and own.get(k) != v))


# -- the zygote process

def _preload() -> dict[str, str]:
    """The imports every server makes before it serves; returns what they added to the environment (the CPU
    platform's settings), which a fresh interpreter would have set in the server's own environment."""
    before = dict(os.environ)
    from hsnap_sglang.cpu import activate

    activate()
    # not sglang.launch_server nor hsnap_sglang.serve themselves: each server runs them as __main__ (runpy warns of a
    # module run as __main__ that is already imported)
    import sglang.srt.arg_groups.overrides  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.server_args  # noqa: F401
    import sglang.srt.managers.detokenizer_manager  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.model_executor.model_runner  # noqa: F401
    from sglang.srt.models.registry import ModelRegistry  # noqa: F401  (imports every model class)

    import hsnap_sglang.frontend  # noqa: F401
    import hsnap_sglang.plugin  # noqa: F401
    import hsnap_sglang.scheduler  # noqa: F401

    if threading.active_count() != 1:  # a fork copies only the forking thread: nothing may run beside it
        raise RuntimeError(f"server zygote: threads after the imports: {threading.enumerate()}")
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def _run_server(request: dict, added_env: dict[str, str]) -> int:
    """In the fork (already in a session of its own): become the server ``python -m hsnap_sglang.serve ARGS``."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    for k, v in added_env.items():
        os.environ.setdefault(k, v)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    sys.argv = [MODULE, *request["args"]]
    code = 0
    try:
        import runpy

        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter maps it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own end: join non-daemon threads,
        atexit._run_exitfuncs()  # then the exit handlers
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def _serve(path: str) -> None:
    """The zygote's loop (one thread): accept a request, fork its server, report the pid and later the exit status.
    Ends when the test process closes its stdin (ended, or killed)."""
    added_env = _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.1)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            return
        if listener in readable:
            conn, _ = listener.accept()
            with conn.makefile("r") as f:
                request = json.loads(f.readline())
            started_r, started_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                for held in (listener, conn, *children.values()):  # the zygote's, not the server's
                    held.close()
                os.close(started_r)
                os.setsid()
                os.close(started_w)  # in its own session now: the pid may be reported (as Popen returns after setsid)
                os._exit(_run_server(request, added_env))
            os.close(started_w)
            os.read(started_r, 1)  # end of file once the child closed its end
            os.close(started_r)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                conn = children.pop(pid)
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:  # its ForkedServer is gone
                    pass
                conn.close()


# -- the test process's side

class ForkedServer:
    """The :class:`subprocess.Popen` members a test's server uses (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``), for a server forked by a zygote (its parent, which reports its exit status)."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int) -> None:
        self.args, self._conn, self.pid = args, conn, pid
        self.returncode: int | None = None
        self._buf = b""
        # one reader of the zygote's report at a time, as Popen's waitpid lock: a retiring thread's wait() and the
        # test's poll() (a zygote's idle check) met on a socket the other had just closed (EBADF)
        self._reading = threading.Lock()

    def _collect(self, timeout: float | None) -> None:
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):  # a poll while another waits: None
            return
        try:
            self._read_report(timeout)
        finally:
            self._reading.release()

    def _read_report(self, timeout: float | None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return
            chunk = self._conn.recv(4096)
            if not chunk:  # the zygote ended before reporting: the status is lost; the process is gone or orphaned
                self.returncode = -signal.SIGKILL if not _alive(self.pid) else None
                if self.returncode is None:
                    raise RuntimeError(f"server zygote ended while server {self.pid} still runs")
                return
            self._buf += chunk
            if b"\n" in self._buf:
                self.returncode = os.waitstatus_to_exitcode(json.loads(self._buf.split(b"\n", 1)[0])["status"])
                self._conn.close()

    def poll(self) -> int | None:
        self._collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._collect(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="hsnap-server-zygote-")
        self.path = os.path.join(self._dir, "socket")
        self.log = os.path.join(self._dir, "zygote.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "hsnap_testing.server_zygote", self.path], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._ready = threading.Event()
        self._failed: str | None = None
        self.servers: list[ForkedServer] = []
        self.used = time.monotonic()
        threading.Thread(target=self._await_ready, daemon=True, name="server-zygote-ready").start()

    def _await_ready(self) -> None:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != b"ready":
            self._failed = f"exited with {self.proc.wait()}: {Path(self.log).read_text(errors='replace')[-3000:]}"
        self._ready.set()

    def fork(self, args: list[str], env: dict[str, str], cwd: str | None, log: str) -> ForkedServer:
        if not self._ready.wait(READY_TIMEOUT_S) or self._failed:
            raise RuntimeError(f"server zygote not ready: {self._failed or 'timed out'}")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"args": args, "env": env, "cwd": cwd, "log": log}).encode() + b"\n")
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"server zygote ended: {Path(self.log).read_text(errors='replace')[-3000:]}")
            line += chunk
        server = ForkedServer([sys.executable, "-m", MODULE, *args], conn, json.loads(line)["pid"])
        self.servers.append(server)
        return server

    def idle(self) -> bool:
        """No server of this zygote still runs (the zygote reports their ends: it may go)."""
        return all(s.poll() is not None for s in self.servers)

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)


_lock = threading.Lock()
_zygotes: dict[tuple, _Zygote] = {}


def popen(argv: list[str], *, env: dict[str, str], log_path: str | os.PathLike, cwd: str | None = None) -> "ForkedServer | subprocess.Popen":
    """Start ``[sys.executable, "-m", "hsnap_sglang.serve", *args]`` in a new session, its stdout and stderr to
    ``log_path``: a fork of the zygote for ``env`` (started at the first such server), or a fresh interpreter with
    ``HSNAP_TEST_SERVER_ZYGOTE=0`` or past the zygotes one test process keeps."""
    if argv[:3] != [sys.executable, "-m", MODULE]:
        raise ValueError(f"server zygote: not a {MODULE} command: {argv[:3]!r}")
    key = _import_key(env)
    with _lock:
        zygote = _zygotes.get(key)
        if zygote is None and os.environ.get(ENABLE_ENV, "1") != "0":
            idle = sorted((z.used, k) for k, z in _zygotes.items() if z.idle())
            if len(_zygotes) >= _MAX_ZYGOTES and idle:
                _zygotes.pop(idle[0][1]).close()
            if len(_zygotes) < _MAX_ZYGOTES:
                zygote = _zygotes[key] = _Zygote(env)
        if zygote is not None:
            zygote.used = time.monotonic()
    if zygote is None:
        with open(log_path, "wb") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    open(log_path, "wb").close()  # there at once, as with Popen: a test reads it while the server starts
    return zygote.fork(argv[3:], env, cwd, str(log_path))


@atexit.register
def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
