"""Helpers of the engine tests: a real ``python -m hsnap_sglang.serve`` server on a free loopback port, HTTP calls
(urllib only), a clean stop, and transformers' reference log-probabilities for the tiny model.

Every server is started with an explicit deadline and stopped with SIGTERM to its own pid; nothing is killed by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from hsnap_testing import server_zygote

STARTUP_TIMEOUT_S = float(os.environ.get("HSNAP_ENGINE_STARTUP_TIMEOUT", "420"))
REQUEST_TIMEOUT_S = 300.0

# The prompt of the numeric comparisons: tokenizer ids of "The quick brown fox jumps over the lazy dog." x 4.
PROMPT_IDS = [54, 74, 71, 401, 503, 270, 464, 223, 76, 478, 318, 285, 320, 71, 307, 465, 431, 16] * 4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["HSNAP_SGLANG_CPU"] = "1"
    env.setdefault("SGLANG_LOGGING_LEVEL", "warning")
    env.update(extra)
    return env


class Server:
    """``python -m hsnap_sglang.serve --model-path DIR ...`` as a child process, its output in ``log_path``."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> None:
        """``args`` follow the defaults below; ``drop``: default switches to leave out (e.g. "--disable-radix-cache")."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        # --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning a core (servers of one test
        # module run side by side on two cores)
        defaults = [a for a in ("--disable-radix-cache", "--disable-overlap-schedule", "--skip-server-warmup", "--sleep-on-idle")
                    if a not in drop]
        self.argv = [
            sys.executable, "-m", "hsnap_sglang.serve", "--model-path", str(model_dir), "--host", "127.0.0.1",
            "--port", str(self.port), *defaults,
            "--max-total-tokens", "4096", "--max-mamba-cache-size", "8", "--max-running-requests", "4",
            "--grammar-backend", "none", "--log-level", "warning", *args,
        ]
        self.env = engine_env(**(env or {}))
        self.proc: subprocess.Popen | server_zygote.ForkedServer | None = None
        self.ready_after_s: float | None = None
        self.descendants: list[int] = []

    def _launch(self) -> "subprocess.Popen | server_zygote.ForkedServer":
        """A new session (its own process group), output to the log: forked from the server zygote (SGLang's server
        already imported; a fresh interpreter with ``HSNAP_TEST_SERVER_ZYGOTE=0``)."""
        return server_zygote.popen(self.argv, env=self.env, log_path=self.log_path)

    def _new_port(self) -> None:
        """Another free port, in ``url`` and ``argv`` (the one picked was taken before the server bound it)."""
        old, self.port = self.port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        i = self.argv.index("--port")
        assert self.argv[i + 1] == str(old)
        self.argv[i + 1] = str(self.port)

    def _port_taken(self) -> bool:
        """The port was taken between free_port() and the server's bind: SGLang's internal ports (22000-29999, found
        free and bound later) or the HTTP port (uvicorn: "error while attempting to bind"), by a server starting at the
        same moment (start_together, another pytest-xdist worker). Then whatever answers the port is not this server."""
        log = self.log_path.read_bytes()
        return b"EADDRINUSE" in log or b"error while attempting to bind on address" in log

    def start(self) -> "Server":
        """Launch and wait until /health answers; whatever ends the wait early (a failed check, an interrupt) leaves
        no server running behind it."""
        try:
            return self._start()
        except BaseException:
            if self.proc is not None and self.proc.poll() is None:
                self._kill_group()
            raise

    def _start(self) -> "Server":
        t0 = time.monotonic()
        self.proc, retries = self._launch(), 2
        deadline = t0 + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._port_taken():
                if retries == 0:
                    break
                self._kill_group()
                self._new_port()
                self.proc, retries = self._launch(), retries - 1
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready; log: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200 and not self._port_taken():
                        self.ready_after_s = time.monotonic() - t0
                        self.descendants = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {time.monotonic() - t0:.0f} s; log: {self.log_tail()}")

    def _kill_group(self) -> None:
        """SIGKILL to the process group of a launch that lost its port (started with start_new_session), then reap."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def crash(self, timeout: float = 60.0) -> list[int]:
        """SIGKILL to the server's process group (its own session), as a machine failure would: reaped, then up to
        ``timeout`` s for its scheduler and detokenizer, which die with the group a moment later.  Returns the pids
        still living (none expected)."""
        self._kill_group()
        deadline = time.monotonic() + timeout
        while self.living_descendants() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.living_descendants()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def post(self, path: str, payload: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def stream(self, path: str, payload: dict) -> list[dict]:
        """The ``data:`` events of a streamed response, in order (``[DONE]`` excluded)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(dict(payload, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    events.append(json.loads(line[5:]))
        return events

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the server's pid; wait; returns its exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            return None

    def retire(self) -> None:
        """stop() in the background: a module's teardown does not wait the ~10 s a SIGTERMed server takes (SGLang's
        SIGTERM watchdog polls every 5 s, then its schedulers exit); :func:`join_retiring` waits for every one."""
        t = threading.Thread(target=self.stop, daemon=True, name=f"retire-{self.port}")
        t.start()
        _RETIRING.append(t)

    def living_descendants(self) -> list[int]:
        return [pid for pid in self.descendants if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


_RETIRING: list[threading.Thread] = []


def retire(*servers: Server) -> None:
    for s in servers:
        s.retire()


def join_retiring(timeout: float = 120.0) -> None:
    """Wait for every server retired so far to be stopped (the session's end)."""
    while _RETIRING:
        _RETIRING.pop().join(timeout)


def full_distribution(top: list) -> list[float]:
    """A top-logprobs list covering the whole vocabulary -> logprob per token id (NaN where missing)."""
    dist = [float("nan")] * 512
    for logprob, token_id, *_ in top:
        dist[token_id] = logprob
    return dist


def reference_logprobs(model_dir: Path, prompt_ids: list[int], output_ids: list[int], dtype: str = "float32"):
    """transformers' own pure-torch model on the same weights: (prefill, decode) log-softmax rows, float64.

    prefill[i] is the distribution after prompt_ids[: i + 1]; decode[j] the one that chose output_ids[j] (the
    prompt prefilled once, then the outputs fed one at a time through the cache, as SGLang serves them).
    """
    import torch

    from hsnap_sglang.tiny import load_reference_model

    model = load_reference_model(model_dir, getattr(torch, dtype))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        prefill = out.logits[0].double().log_softmax(-1)
        cache, decode = out.past_key_values, [prefill[-1]]
        for token in output_ids[:-1]:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            decode.append(out.logits[0, -1].double().log_softmax(-1))
    return prefill, torch.stack(decode)
