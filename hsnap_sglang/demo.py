"""``hsnap demo``: one live request of SGLang's real server is paused over HTTP and continues, exactly, in a fresh server.

What it runs (``python -m hsnap_sglang.serve --enable-hsnap``: SGLang's unmodified ``sglang.launch_server`` with the
hsnap plug-in on, on hsnap's CPU platform; bfloat16, radix cache on, both servers bound to the same cores):

1. a tiny random-weight hybrid model (``--arch``: GDN + full attention by default, or a Mamba2 hybrid such as
   ``nemotron_h``: README's model families) and its tokenizer, built locally (``hsnap_sglang.tiny``);
2. the **source** server: an uninterrupted greedy reference of N=128 tokens; then the same request again, streamed,
   beside two other requests; after k=10 outputs ``POST /hsnap/export`` (``hsnap_sglang.client.pause``) — the
   request is exported at its next committed decode boundary, its stream ends with ``finish_reason hsnap_export``;
   then the server is stopped and its processes are shown to be gone;
3. the **target** server, fresh, with other capacities (Mamba slots, token slots, running requests) and another
   request already decoding: ``POST /hsnap/resume`` streams the rest;
4. the report: token ids and logprobs against the reference (bit for bit), the target's completed forwards for the
   request (decode N−k, extend 0: no history position recomputed), stream continuity (no repeated or missing text
   chunk or token), the other requests against their own uninterrupted runs, and five snapshots the target must
   refuse — another format version, another layout, another source binding (weights), a manifest that binds another
   file, a flipped byte — each an HTTP error before any output, the server's pools and requests unchanged.

Every output goes into a fresh directory (``--out``, which must not exist; default ``hsnap-demo-<time>``); nothing
is ever deleted.  The servers are stopped (SIGTERM, then SIGKILL after a bound, each process by its pid) on success,
failure, Ctrl-C and SIGTERM.  Exit status: 0 every check holds, 1 a check failed, 2 the demo could not run, 130
interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Any

from hsnap_format.errors import HsnapError, escape_text

from . import client
from .tiny import ARCHS

__all__ = ["main", "run_demo", "format_report", "DemoError", "DemoServer", "Stream", "abort", "continuity", "flush_cache", "negative_snapshots",
           "payload", "refuse", "server_args", "server_env", "tokens"]

N, K = 128, 10
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown"
# the other requests: (prompt seed, prompt tokens, output tokens); long enough to be decoding around the export/resume
SOURCE_OTHERS = {"other-1": (1, 40, 112), "other-2": (2, 30, 112)}  # long enough to decode beside x however slow its prefill
TARGET_OTHERS = {"other-3": (3, 36, 160)}  # it decodes on after x's resume (160 tokens: on a loaded machine 64 ended first)
# SGLang holds 3 Mamba slots per running request here (its log says so): 12 slots -> x and both others at once
SOURCE_CAPACITY = {"--max-total-tokens": "4096", "--max-mamba-cache-size": "12", "--max-running-requests": "4"}
TARGET_CAPACITY = {"--max-total-tokens": "3000", "--max-mamba-cache-size": "9", "--max-running-requests": "3"}
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL
# A server's children still running once it has exited are orphans: SGLang's shutdown kills its children before it
# exits, and a SIGTERM before SGLang installs its handler (Ctrl-C while a server starts) ends the main process at once
# while its scheduler goes on loading the model (measured: ~20 s) until it finds no parent to report to
ORPHAN_GRACE_S = 2.0
REQUEST_TIMEOUT_S = 300.0


class DemoError(Exception):
    """The demo could not run (an argument, a server that does not start, an output path that exists)."""


class Interrupted(BaseException):
    """SIGTERM/SIGHUP to the demo: unwinds like Ctrl-C, so every server is stopped."""


# ----------------------------------------------------------------------------- servers


_PORT_TAKEN = (b"EADDRINUSE", b"error while attempting to bind on address")  # SGLang's zmq ports; uvicorn's


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoServer:
    """``python -m hsnap_sglang.serve --enable-hsnap ...`` as a child process in its own session, its output in
    ``log``.  :meth:`stop` ends it and every process it started, each by its pid."""

    CPU_LAUNCHER = ("-m", "hsnap_sglang.serve", "--enable-hsnap")  # sglang.launch_server on hsnap's CPU platform

    def __init__(self, role: str, model_dir: Path, log: Path, args: list[str], env: dict[str, str],
                 launcher: tuple[str, ...] = CPU_LAUNCHER) -> None:
        """``launcher``: the python arguments that start the server (a GPU machine: ``("-m", "sglang.launch_server")``
        with ``HSNAP_SGLANG_PLUGIN=1`` in ``env``)."""
        self.role, self.log = role, Path(log)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, *launcher, "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.known: set[int] = set()  # every descendant pid seen while it ran

    def spawn(self) -> "DemoServer":
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        return self

    def start(self, timeout: float, on_spawn=None) -> "DemoServer":
        """Spawn it and wait until ``/health`` answers 200 (or raise :class:`DemoError` with its log's end).  A port
        taken between :func:`_free_port` and the server's bind (by the other server starting, or anything else) is
        another launch on another port: whatever answers the taken port is not this server."""
        t0, relaunches = time.monotonic(), 2
        self.spawn()
        if on_spawn is not None:
            on_spawn(self)
        while time.monotonic() - t0 < timeout:
            if self._port_taken() and relaunches > 0:
                self.stop()
                self._new_port()
                self.spawn()
                relaunches -= 1
                if on_spawn is not None:
                    on_spawn(self)
                continue
            if self.proc.poll() is not None:
                raise DemoError(f"the {self.role} server exited with {self.proc.returncode} before it was ready; "
                                f"its log ({self.log}) ends:\n{self.log_tail()}")
            self._see_descendants()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200 and not self._port_taken():
                        self.ready_s = time.monotonic() - t0
                        self._see_descendants()
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise DemoError(f"the {self.role} server was not ready after {timeout:.0f} s; its log ({self.log}) ends:\n{self.log_tail()}")

    def _port_taken(self) -> bool:
        """SGLang's internal ports and the HTTP port are found free and bound later: the log says when one was taken."""
        try:
            tail = self.log.read_bytes()[-20000:]
        except OSError:
            return False
        return any(sign in tail for sign in _PORT_TAKEN)

    def _new_port(self) -> None:
        i = self.argv.index("--port")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv[i + 1] = str(self.port)

    def _see_descendants(self) -> None:
        import psutil

        try:
            self.known.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            pass

    def log_tail(self, n: int = 2500) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def living(self) -> list[int]:
        """The server's pid and every descendant seen, those still running (zombies count as gone)."""
        import psutil

        out = []
        for pid in sorted(({self.proc.pid} if self.proc else set()) | self.known):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    def stop(self, grace: float = STOP_GRACE_S) -> dict[str, Any]:
        """SIGTERM to the server's pid, wait ``grace`` s; then SIGKILL to it and (after :data:`ORPHAN_GRACE_S`) to every
        descendant still running.
        Returns ``{"pid", "exit_code", "killed", "left"}`` (``left``: pids still running afterwards: none expected)."""
        if self.proc is None:
            return {"pid": None, "exit_code": None, "killed": [], "left": []}
        import psutil

        self._see_descendants()
        killed: list[int] = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                killed.append(self.proc.pid)
        deadline = time.monotonic() + min(grace, ORPHAN_GRACE_S)
        while [p for p in self.living() if p != self.proc.pid] and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.living():
            try:
                psutil.Process(pid).kill()
                killed.append(pid)
            except psutil.Error:
                pass
        t = time.monotonic() + 10
        while self.living() and time.monotonic() < t:
            time.sleep(0.05)
        return {"pid": self.proc.pid, "exit_code": None if killed and self.proc.pid in killed else self.proc.returncode,
                "killed": killed, "left": self.living(), "descendants": sorted(self.known)}


# ----------------------------------------------------------------------------- HTTP


def _post(url: str, route: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> bytes:
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def abort(url: str, rid: str, timeout: float = 60.0) -> None:
    """SGLang's ``/abort_request`` of ``rid`` (its stream ends with finish reason ``abort``)."""
    _post(url, "/abort_request", {"rid": rid}, timeout)


def flush_cache(url: str, timeout: float = 120.0) -> None:
    """SGLang's ``/flush_cache`` (the radix tree emptied: a reference must not hit what an earlier run cached);
    refused while requests run, so retried."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _post(url, "/flush_cache", {}, 60)
            return
        except urllib.error.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def payload(rid: str, n: int, *, text: str | None = None, ids: list[int] | None = None) -> dict:
    body: dict[str, Any] = {"rid": rid, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    body.update({"text": text} if text is not None else {"input_ids": ids})
    return body


def prompt_ids(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(1, 500) for _ in range(n)]


class Stream(threading.Thread):
    """A streamed ``/generate`` in a thread: its events and their arrival times (monotonic), the error if any."""

    def __init__(self, url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.timeout = url, dict(body, stream=True), timeout  # timeout: the longest silence (a prefill)
        self.events: list[dict] = []
        self.times: list[float] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    @property
    def rid(self) -> str:
        return self.body["rid"]

    def run(self) -> None:
        try:
            req = urllib.request.Request(self.url + "/generate", data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                for event in client.stream_events(r):
                    self.events.append(event)
                    self.times.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e
        finally:
            self.done.set()

    def tokens_so_far(self) -> int:
        return self.events[-1]["meta_info"]["completion_tokens"] if self.events else 0

    def wait_tokens(self, n: int, timeout: float = REQUEST_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.tokens_so_far() < n:
            if self.done.is_set() or time.monotonic() > deadline:
                raise DemoError(f"request {self.rid}: {self.tokens_so_far()} of {n} tokens streamed (error: {self.error!r})")
            time.sleep(0.002)

    def finish(self, timeout: float = REQUEST_TIMEOUT_S) -> "Stream":
        self.join(timeout)
        if self.is_alive() or self.error is not None or not self.events:
            raise DemoError(f"request {self.rid} did not finish: {self.error!r}")
        return self

    @property
    def final(self) -> dict:
        return self.events[-1]

    def last_token_at(self) -> float | None:
        """When the last event that added a token arrived (a finishing event may add none)."""
        n, at = 0, None
        for event, t in zip(self.events, self.times):
            k = len(event.get("output_ids") or [])
            if k > n:
                n, at = k, t
        return at


def tokens(event: dict) -> tuple[list[int], list[float]]:
    pairs = event["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


def _batched(url: str, requests: dict[str, tuple[int, int, int]], x: dict) -> tuple[dict[str, "Stream"], "Stream"]:
    """Uninterrupted runs of ``requests`` with ``x`` started beside them once they are prefilled, as the paused run
    starts them (the same batch shape until the pause), from an empty radix tree."""
    streams = {rid: Stream(url, payload(f"{rid}-reference", m, ids=prompt_ids(seed, p))) for rid, (seed, p, m) in requests.items()}
    for s in streams.values():
        s.start()
    for s in streams.values():
        s.wait_tokens(1)
    xs = Stream(url, x)
    xs.start()
    xs.finish()
    for s in streams.values():
        s.finish()
    return streams, xs


def _references(url: str, requests: dict[str, tuple[int, int, int]]) -> dict[str, tuple[list[int], list[float]]]:
    """Uninterrupted runs of the other requests, together, from an empty radix tree (the target's references: the
    demo's ``reference_batch_invariant`` check shows that a request's numbers do not depend on its batch here)."""
    streams = {rid: Stream(url, payload(f"{rid}-reference", m, ids=prompt_ids(seed, p))) for rid, (seed, p, m) in requests.items()}
    for s in streams.values():
        s.start()
    return {rid: tokens(s.finish().final) for rid, s in streams.items()}


# ----------------------------------------------------------------------------- checks


def continuity(first: list[dict], resumed: list[dict], had: tuple[int, int], reference: list[dict]) -> dict[str, Any]:
    """What a client saw: the source's stream until it ended (``first``), then the resumed one (``resumed``, whose
    events carry the text and ids so far, the part before the snapshot included; ``had`` = the server's count of what
    the client already had, in text characters and token ids).  Continuous: every event extends the one before, the
    resumed stream starts exactly where the first ended (nothing repeated, nothing missing), the text at every
    boundary both this and the uninterrupted ``reference`` stream have is equal, and the end is the reference's."""

    def points(events):
        return [(len(e.get("output_ids") or []), e.get("text") or "", list(e.get("output_ids") or [])) for e in events]

    src, res, ref = points(first), points(resumed), points(reference)
    n_k, text_k, ids_k = src[-1] if src else (0, "", [])
    repeated = (max(0, len(text_k) - had[0]), max(0, n_k - had[1]))  # chars, ids the client would see twice
    missing = (max(0, had[0] - len(text_k)), max(0, had[1] - n_k))  # ... never see
    joined = src + res
    extends = all(n1 >= n0 and t1.startswith(t0) and i1[:n0] == i0 for (n0, t0, i0), (n1, t1, i1) in zip(joined, joined[1:]))
    by_n = {n: (t, i) for n, t, i in ref}
    common = [(n, t, i) for n, t, i in joined if n in by_n]
    at_boundaries = all((t, i) == by_n[n] for n, t, i in common)
    client_text = (text_k + (res[-1][1][had[0]:] if res else "")) if had[0] <= len(text_k) else None
    chunks_before = sum(1 for (n0, t0, _), (n1, t1, _) in zip([(0, "", [])] + src, src) if (t1, n1) != (t0, n0))
    chunks_after = sum(1 for (n0, t0, _), (n1, t1, _) in zip([(n_k, text_k, ids_k)] + res, res) if (t1, n1) != (t0, n0))
    end_equal = bool(res) and bool(ref) and res[-1][1:] == ref[-1][1:]
    ok = repeated == (0, 0) and missing == (0, 0) and extends and at_boundaries and end_equal and client_text == (ref[-1][1] if ref else None)
    return {
        "continuous": ok, "chunks_before_pause": chunks_before, "chunks_after_resume": chunks_after,
        "source_stream_ended_at": {"text_chars": len(text_k), "output_ids": n_k},
        "resume_started_at": {"text_chars": had[0], "output_ids": had[1]},
        "repeated": {"text_chars": repeated[0], "output_ids": repeated[1]},
        "missing": {"text_chars": missing[0], "output_ids": missing[1]},
        "every_event_extends_the_last": extends, "common_boundaries": len(common),
        "equal_to_reference_at_common_boundaries": at_boundaries, "end_equal_to_reference": end_equal,
        "client_text_equals_reference": client_text == (ref[-1][1] if ref else None),
    }


def _beside(times: list[float], asked: float, first_token: list[float]) -> bool:
    """A stream whose events came before the resume was asked for and after the resumed request's first token (``asked``
    + ``first_token[0]``): it decoded beside the resumed request (a stats sample before the resume can miss a request
    between batches, or one a loaded machine let finish first)."""
    return bool(times and first_token) and times[0] < asked and times[-1] > asked + first_token[0]


def _new_parts(events: list[dict], had: tuple[int, int]) -> list[tuple[str, list[int]]]:
    """What each event adds to the text and token ids the client has (events carry both so far; ``had``: text chars
    and ids the client had before the first), empty additions left out."""
    out, (n_text, n_ids) = [], had
    for e in events:
        text, ids = e.get("text") or "", list(e.get("output_ids") or [])
        if (text[n_text:], ids[n_ids:]) != ("", []):
            out.append((text[n_text:], ids[n_ids:]))
        n_text, n_ids = len(text), len(ids)
    return out


def _resigned(data: bytes, header: dict | None = None, major: int | None = None) -> bytes:
    """``data`` (an hsnap file) with another header and/or major version, its integrity fields made honest again
    (header digest, root digest, preamble and trailer checks: spec section 3), so that what the reader refuses it for
    is the property changed, not a digest.  The header must still fit before the data (it does for the small
    changes made here)."""
    import xxhash

    from hsnap_format import canonical
    from hsnap_format.spec import HEADER_OFFSET, PREAMBLE, TRAILER

    pre = list(PREAMBLE.unpack(data[: PREAMBLE.size]))
    tra = list(TRAILER.unpack(data[-TRAILER.size:]))
    data_offset = pre[5]
    hb = data[HEADER_OFFSET: HEADER_OFFSET + pre[4]] if header is None else canonical.dumps(header)
    if HEADER_OFFSET + len(hb) > data_offset:
        raise DemoError(f"a changed header ({len(hb)} bytes) no longer fits before the data at {data_offset}")
    obj = canonical.loads(hb) if header is None else header
    digest = xxhash.xxh3_128_digest(hb)
    root = xxhash.xxh3_128()
    root.update(digest)
    for s in obj["sections"]:
        root.update(bytes.fromhex(s["digest"]))
    if major is not None:
        pre[1] = major
    pre[4], pre[6], pre[8] = len(hb), digest, 0
    tra[3], tra[5] = root.digest(), 0

    def check(block: bytes) -> bytes:
        return block[:56] + xxhash.xxh3_64_intdigest(block[:56]).to_bytes(8, "little")

    body = data[data_offset: len(data) - TRAILER.size]
    return (check(PREAMBLE.pack(*pre)) + hb + bytes(data_offset - HEADER_OFFSET - len(hb)) + body
            + check(TRAILER.pack(*tra)))


# case -> (what it is, the error type the server must answer with)
NEGATIVE = {
    "version": ("a future major format version (every digest and check honest)", "UnsupportedVersionError"),
    "layout": ("another linear-attention head layout than this model's (temporal state shape changed in geometry and sections)", "IncompatibleSnapshotError"),
    "binding": ("bound to other weights (another identity.weights_hash), re-signed", "IncompatibleSnapshotError"),
    "manifest": ("a one-rank set whose manifest binds another file than the rank file it holds", "MalformedManifestError"),
    "digest": ("one byte flipped inside a temporal-state section", "DigestMismatchError"),
}


def negative_snapshots(good: str, outdir: Path) -> dict[str, str]:
    """The snapshots the target must refuse, each made from the real export ``good`` with one property wrong."""
    from hsnap_format import canonical, open_snapshot
    from hsnap_format.manifest import manifest_for
    from hsnap_format.spec import HEADER_OFFSET, PREAMBLE

    outdir.mkdir()
    data = Path(good).read_bytes()
    pre = PREAMBLE.unpack(data[: PREAMBLE.size])
    pre_major, header = pre[1], canonical.loads(data[HEADER_OFFSET: HEADER_OFFSET + pre[4]])
    files = {}

    def write(name: str, blob: bytes) -> str:
        p = outdir / name
        with open(p, "xb") as f:
            f.write(blob)
        return str(p)

    files["version"] = write("future-major.hsnap", _resigned(data, major=pre_major + 1))

    layout = json.loads(json.dumps(header))
    h, dv, dk = layout["geometry"]["mamba"]["temporal_shape"]
    other = [h // 2, dv, dk * 2] if h % 2 == 0 else [h * 2, dv, dk // 2]
    layout["geometry"]["mamba"]["temporal_shape"] = other
    if (layout["geometry"].get("sharding") or {}).get("temporal"):  # described (1.1): this one rank holds all heads
        layout["geometry"]["sharding"]["temporal"] = {"axis": 0, "global": other[0], "parts": [[0, other[0], 1]]}
    for s in layout["sections"]:
        if s["kind"] == "temporal":
            s["shape"] = list(other)
    files["layout"] = write("other-layout.hsnap", _resigned(data, header=layout))

    binding = json.loads(json.dumps(header))
    binding["identity"]["weights_hash"] = "0" * 32
    files["binding"] = write("other-weights.hsnap", _resigned(data, header=binding))

    s = outdir / "set"
    s.mkdir()
    rank0 = write("set/rank-0.hsnap", data)
    with open_snapshot(rank0) as snap:
        manifest = manifest_for([snap])
    with open_snapshot(files["binding"]) as other_snap:
        other_root = other_snap.root_digest
    entry = dataclasses.replace(manifest.ranks[0], root_digest=other_root)
    write("set/manifest.json", dataclasses.replace(manifest, ranks=(entry,)).encode())
    files["manifest"] = str(s)

    with open_snapshot(good) as snap:
        sec = next(x for x in snap.sections if x.kind == "temporal")
    flipped = bytearray(data)
    flipped[sec.offset + sec.length // 2] ^= 0x10
    files["digest"] = write("flipped-byte.hsnap", bytes(flipped))
    return files


def _state(stats: dict) -> dict:
    """What must not change when a resume is refused: pool free counts, the requests, SGLang's invariant checks."""
    return {"pools": stats["pools"], "requests": stats["requests"],
            "checks": {k: v for k, v in stats["checks"].items() if k != "messages"}}


def _wait_idle(url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats(url)
        if s["checks"].get("idle"):
            return s
        if time.monotonic() > deadline:
            raise DemoError(f"{url} still busy after {timeout:.0f} s: {s['requests']}")
        time.sleep(0.1)


def _consistent(checks: dict) -> bool:
    """SGLang's own idle checks as the hsnap stats report them: no leaked token or Mamba slot, every request row free,
    the radix tree sane."""
    return checks.get("pool_leak") is False and checks.get("req_rows_ok") is True and checks.get("tree_sanity", "ok") == "ok"


def refuse(url: str, files: dict[str, str]) -> list[dict[str, Any]]:
    """Each negative snapshot resumed in the (idle) server at ``url``: the answer, what was streamed (nothing
    expected) and the server's state before and after."""
    out = []
    for case, path in files.items():
        what, expected = NEGATIVE[case]
        before = _wait_idle(url)
        streamed: list = []
        error = None
        try:
            client.resume(url, path, on_chunk=lambda *a: streamed.append(a))  # noqa: B023 (runs within the call)
        except client.ServerError as e:
            error = e
        after = _wait_idle(url)
        unchanged = _state(before) == _state(after)
        got = None if error is None else error.error_type
        out.append({
            "case": case, "description": what, "path": path, "expected": expected, "error": got,
            "status": None if error is None else error.status,
            "message": None if error is None else str(error.error.get("message") or error),
            "outputs": len(streamed), "state_unchanged": unchanged,
            "ok": got == expected and error is not None and 400 <= error.status < 500 and not streamed and unchanged,
        })
    return out


# ----------------------------------------------------------------------------- the run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsnap demo",
        description="Pause one live request of SGLang's real server over HTTP (the hsnap plug-in), stop that server, "
        "resume the request in a fresh server with other capacities: its token ids and logprobs must equal an "
        "uninterrupted run exactly, with no history position recomputed.",
    )
    p.add_argument("--n", type=int, default=N, help=f"output tokens in total (default {N})")
    p.add_argument("-k", "--k", type=int, default=K, help=f"outputs streamed before the pause (default {K})")
    p.add_argument("--arch", choices=ARCHS, default="qwen3_next",
                   help="tiny model family (a GDN or Mamba2 hybrid with full attention: hsnap_sglang.tiny; default qwen3_next)")
    p.add_argument("--model-seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--model-dir", help="use (or build) the tiny model here instead of inside --out: an existing directory is "
                   "reused only when hsnap_sglang.tiny built it with the same recipe (any other content is refused)")
    p.add_argument("--out", help="a directory that does not exist yet, for everything the run writes "
                   "(default: hsnap-demo-<date>-<time> in the working directory)")
    p.add_argument("--startup-timeout", type=float, default=420.0, help="seconds a server may take to start (default 420)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _fresh_out(arg: str | None) -> Path:
    if arg is not None:
        out = Path(arg)
        try:
            out.mkdir(parents=False)
        except FileExistsError:
            raise DemoError(f"--out {arg}: exists; the demo writes only into a new directory") from None
        except OSError as e:
            raise DemoError(f"--out {arg}: cannot create it ({e.strerror})") from None
        return out.resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(100):
        out = Path(f"hsnap-demo-{stamp}" + (f"-{i}" if i else ""))
        try:
            out.mkdir()
            return out.resolve()
        except FileExistsError:
            continue
    raise DemoError(f"no free name hsnap-demo-{stamp}-N in {os.getcwd()}")


def server_env(root: Path | str | None = None) -> dict[str, str]:
    """The same environment for both servers: the CPU platform, and the same cores (the thread count is part of the
    numerics: a request continues bit for bit only with the same one); ``root``: the snapshot root every client path
    resolves beneath (``HSNAP_ROOT``, hsnap_sglang.confine)."""
    from .serve import omp_threads_bind

    env = dict(os.environ)
    env["HSNAP_SGLANG_CPU"] = "1"
    if root is not None:
        env["HSNAP_ROOT"] = str(Path(root).resolve())
    env.setdefault("SGLANG_LOGGING_LEVEL", "warning")
    bind = omp_threads_bind(1)
    if bind is not None:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", bind)
    return env


def server_args(capacity: dict[str, str]) -> list[str]:
    base = ["--dtype", "bfloat16", "--chunked-prefill-size", "128", "--skip-server-warmup", "--grammar-backend", "none",
            "--log-level", "warning"]
    return base + [x for kv in capacity.items() for x in kv]


class _Run:
    """One demo run: the servers it started (always stopped), progress lines, the phases' wall times."""

    def __init__(self, args, out: Path) -> None:
        self.args, self.out = args, out
        self.servers: list[DemoServer] = []
        self.t0 = time.monotonic()
        self.phases: dict[str, float] = {}

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.phases[name] = round(now - since, 3)
        return now

    def _record_pids(self, srv: DemoServer) -> None:
        """``servers.json`` in the output directory: every server's pid as soon as it exists (what to look for if
        the demo itself were killed with SIGKILL, which nothing can catch)."""
        rows = [{"role": s.role, "pid": s.pid, "url": s.url, "log": str(s.log)} for s in self.servers]
        tmp = self.out / ".servers.json.tmp"
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        os.replace(tmp, self.out / "servers.json")

    def server(self, role: str, model: Path, capacity: dict[str, str], env: dict[str, str]) -> DemoServer:
        srv = DemoServer(role, model, self.out / f"{role}.log", server_args(capacity), env)
        self.servers.append(srv)
        self.say(f"starting the {role} server (python -m hsnap_sglang.serve --enable-hsnap, {srv.url}) ...")
        srv.start(self.args.startup_timeout, on_spawn=self._record_pids)
        self.say(f"{role} server ready (pid {srv.pid}) after {srv.ready_s:.1f} s")
        return srv

    def stop_all(self) -> list[dict]:
        """Stop every server still running (a second Ctrl-C meanwhile does not cut the stopping short)."""
        main_thread = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            return [s.stop() for s in self.servers if s.proc is not None]
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, old)


def run_demo(args) -> dict[str, Any]:
    if not 1 <= args.k < args.n:
        raise DemoError(f"need 1 <= k < N, got k={args.k}, N={args.n}")
    if args.n > 4000:
        raise DemoError(f"--n {args.n}: at most 4000 (the servers' token capacity)")
    out = _fresh_out(args.out)
    run = _Run(args, out)
    try:
        return _run(run)
    except (HsnapError, OSError, ValueError) as e:  # a refusal where none was expected, a server that went away
        raise DemoError(f"{type(e).__name__}: {e} (server logs in {out})") from None
    finally:
        run.stop_all()


def _run(run: _Run) -> dict[str, Any]:
    args, out = run.args, run.out
    n, k = args.n, args.k
    run.say(f"writing into {out}")
    t = time.monotonic()
    from .tiny import build_model_dir

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        model = build_model_dir(args.model_dir or out / "model", arch=args.arch, seed=args.model_seed)
    except (FileExistsError, ValueError) as e:
        raise DemoError(f"--model-dir: {e}") from None
    t = run.phase("build_model", t)
    run.say(f"the tiny {args.arch} model and tokenizer, built locally (no download), in {run.phases['build_model']:.1f} s: {model}")
    env = server_env(root=out)  # every path the demo names lies in its output directory
    snapshot = out / "x.hsnap"

    # ---- the source server: reference, then the same request paused after k outputs
    src = run.server("source", model, SOURCE_CAPACITY, env)
    t = run.phase("source_start", t)
    ref = Stream(src.url, payload("x-reference", n, text=PROMPT_TEXT))
    ref.start()
    ref.finish()
    flush_cache(src.url)  # the paused run prefills from an empty tree, as the reference did
    run.say(f"reference: {len(ref.final['output_ids'])} tokens, uninterrupted")
    # the same batch shape as the paused run below, uninterrupted: x beside the others (their references) and the
    # control that this server's numerics do not depend on the batch (x alone == x batched)
    ref_others, ref_batched = _batched(src.url, SOURCE_OTHERS, payload("x-reference-batched", n, text=PROMPT_TEXT))
    src_refs = {rid: tokens(s.final) for rid, s in ref_others.items()}
    flush_cache(src.url)
    batch_invariant = tokens(ref_batched.final) == tokens(ref.final)
    run.say(f"x alone and x beside {len(SOURCE_OTHERS)} others, uninterrupted: {'equal' if batch_invariant else 'DIFFERENT'}")
    others = {rid: Stream(src.url, payload(rid, m, ids=prompt_ids(seed, p))) for rid, (seed, p, m) in SOURCE_OTHERS.items()}
    for o in others.values():
        o.start()
    for o in others.values():
        o.wait_tokens(1)  # prefilled: x is prefilled alone, in the same chunks as the reference
    x = Stream(src.url, payload("x", n, text=PROMPT_TEXT))
    x.start()
    x.wait_tokens(min(2, k))
    running_beside_x = client.stats(src.url)["requests"]["running"]  # x decodes in one batch with the others
    x.wait_tokens(k)
    seen_at_pause = x.tokens_so_far()
    t_pause = time.monotonic()
    exported = client.pause(src.url, "x", str(snapshot))
    pause_call_s = time.monotonic() - t_pause
    x.finish()
    run.say(f"paused x after {seen_at_pause} streamed outputs: exported at {exported['output_tokens']} outputs, "
            f"{exported['committed_positions']} committed positions -> {snapshot} ({exported['bytes']} bytes)")
    for o in others.values():
        o.finish()
    src_forwards = client.stats(src.url, "x")["forwards"]
    src_idle = _wait_idle(src.url)
    t = run.phase("source_run", t)
    src_stop = src.stop()
    run.say(f"source server stopped: exit {src_stop['exit_code']}, {len(src_stop['left'])} of its processes left")
    t = run.phase("source_stop", t)

    # ---- the target server: fresh, other capacities, another request already decoding
    dst = run.server("target", model, TARGET_CAPACITY, env)
    t = run.phase("target_start", t)
    o3 = {rid: Stream(dst.url, payload(rid, m, ids=prompt_ids(seed, p))) for rid, (seed, p, m) in TARGET_OTHERS.items()}
    for o in o3.values():
        o.start()
    for o in o3.values():
        o.wait_tokens(3)
    running_at_resume = client.stats(dst.url)["requests"]["running"]  # (what the report shows; a sample, not the check)
    chunks: list[tuple[str, list[int]]] = []
    t_res = time.monotonic()
    first_token = []

    def on_chunk(rid, text, ids, event):
        if not first_token and ids:
            first_token.append(time.monotonic() - t_res)
        chunks.append((text, list(ids)))

    resumed = client.resume(dst.url, str(snapshot), on_chunk=on_chunk)
    for o in o3.values():
        o.finish()
    forwards = client.stats(dst.url, "x")["forwards"]
    dst_idle = _wait_idle(dst.url)
    run.say(f"resumed x in the target server: {len(resumed.output_ids)} tokens in all; target forwards for x: {forwards}")
    flush_cache(dst.url)
    dst_refs = _references(dst.url, TARGET_OTHERS)
    t = run.phase("target_run", t)

    # ---- refusals: checked before anything is allocated, nothing changed
    files = negative_snapshots(str(snapshot), out / "negative")
    refusals = refuse(dst.url, files)
    run.say("negative clients: " + ", ".join(f"{r['case']} -> {r['error']}" for r in refusals))
    t = run.phase("negative", t)
    dst_stop = dst.stop()
    run.phase("target_stop", t)

    # ---- the report
    ref_ids, ref_lps = tokens(ref.final)
    ids, lps = tokens(resumed.final)
    k_exported = int(exported["output_tokens"])
    matching = sum(a == b for a, b in zip(ids, ref_ids))
    max_diff = max((abs(a - b) for a, b in zip(lps, ref_lps)), default=None) if len(lps) == len(ref_lps) else None
    info = resumed.info["result"]
    had = (int(info["client_had"]["text_chars"]), int(info["client_had"]["output_ids"]))
    stream = continuity(x.events, resumed.events, had, ref.events)
    stream["chunks_reported_by_the_client"] = len(chunks)
    # what the client's on_chunk got: exactly the new part of each event (nothing it already had from the source)
    stream["client_chunks_are_the_new_parts"] = chunks == _new_parts(resumed.events, had)
    others_rows = [{"rid": rid, "server": "source", "equal": tokens(o.final) == src_refs[rid], "tokens": len(tokens(o.final)[0])}
                   for rid, o in others.items()]
    others_rows += [{"rid": rid, "server": "target", "equal": tokens(o.final) == dst_refs[rid], "tokens": len(tokens(o.final)[0]),
                     "running_when_x_resumed": _beside(o.times, t_res, first_token)} for rid, o in o3.items()]
    from hsnap_format import open_snapshot

    with open_snapshot(str(snapshot)) as snap:
        snap.verify()
        ident = snap.identity
        snap_info = {"path": str(snapshot), "bytes": snap.file_length, "sections": len(snap.sections), "root_digest": snap.root_digest,
                     "snapshot_id": ident.snapshot_id, "state_position": snap.state_position, "numerics": dict(ident.numerics),
                     "model_id": ident.model_id, "engine": f"{ident.engine.name} {ident.engine.version}"}
    servers = []
    for srv, stopped, cap in ((src, src_stop, SOURCE_CAPACITY), (dst, dst_stop, TARGET_CAPACITY)):
        servers.append({"role": srv.role, "pid": srv.pid, "url": srv.url, "ready_s": round(srv.ready_s, 3), "log": str(srv.log),
                        "capacity": {f[2:]: int(v) for f, v in cap.items()}, "exit_code": stopped["exit_code"],
                        "killed": stopped["killed"], "processes_left": stopped["left"], "descendants": stopped["descendants"]})
    checks = {
        "token_ids_equal": ids == ref_ids and len(ids) == n,
        "logprobs_equal": max_diff == 0.0,
        "finish_equal": resumed.final["meta_info"]["finish_reason"] == ref.final["meta_info"]["finish_reason"],
        "text_equal": resumed.final["text"] == ref.final["text"],
        "decode_only_in_target": forwards == {"decode": n - k_exported, "extend": 0},
        "exported_at_committed_boundary": exported["committed_positions"] == exported["prompt_tokens"] + k_exported - 1,
        "source_stream_ended_with_the_snapshot": x.final["meta_info"]["finish_reason"] == {
            "type": "hsnap_export", "path": str(snapshot), "snapshot_id": exported["snapshot_id"],
            "committed_positions": exported["committed_positions"]},
        "stream_continuous": stream["continuous"] and stream["client_chunks_are_the_new_parts"],
        "others_decoding_beside_x": {"x", *SOURCE_OTHERS} <= set(running_beside_x),
        # a request's numbers do not depend on its batch on this server (else 'equal to the reference' could not be asked
        # of x, which the target runs beside another request): checked, not assumed
        "reference_batch_invariant": batch_invariant,
        "other_requests_unaffected": all(r["equal"] for r in others_rows) and all(r.get("running_when_x_resumed", True) for r in others_rows),
        "source_gone_before_target_started": src_stop["left"] == [] and src_stop["exit_code"] is not None,
        "target_stopped": dst_stop["left"] == [],
        "same_numerics": info["numerics_differences"] == [],
        "pools_consistent": all(_consistent(i["checks"]) for i in (src_idle, dst_idle)),
        "refused_before_allocation": all(r["ok"] for r in refusals),
    }
    report = {
        "ok": all(checks.values()),
        "checks": checks,
        "config": {"arch": args.arch, "model_seed": args.model_seed, "n": n, "k": k, "prompt_text": PROMPT_TEXT,
                   "dtype": "bfloat16", "threads_bind": env.get("SGLANG_CPU_OMP_THREADS_BIND"), "out": str(out), "model": str(model)},
        "servers": servers,
        "export": {"streamed_before_pause": seen_at_pause, "output_tokens": k_exported, "prompt_tokens": exported["prompt_tokens"],
                   "committed_positions": exported["committed_positions"], "bytes": exported["bytes"], "found_in": exported.get("found_in"),
                   "pause_call_s": round(pause_call_s, 4), "timings": exported["timings"], "source_forwards": src_forwards,
                   "running_beside_x": running_beside_x},
        "resume": {"tokens_matching": matching, "n": n, "max_abs_logprob_diff": max_diff,
                   # no extend forward for x in the target: no history position went through the model again
                   "history_positions_recomputed": 0 if forwards.get("extend") == 0 else None,
                   "target_forwards": forwards, "expected_forwards": {"decode": n - k_exported, "extend": 0},
                   "bytes_uploaded": info["bytes_uploaded"], "restore_s": info["timings"]["restore_s"],
                   "first_token_s": round(first_token[0], 4) if first_token else None,
                   "numerics_differences": info["numerics_differences"], "running_when_resumed": running_at_resume,
                   "finish_reason": resumed.final["meta_info"]["finish_reason"]},
        "stream": stream,
        "others": others_rows,
        "negative": refusals,
        "snapshot": snap_info,
        "open_with": [f"hsnap info {_rel(snapshot)}", f"hsnap-view {_rel(snapshot)}"],
        "phases_s": run.phases,
        "wall_s": round(time.monotonic() - run.t0, 3),
    }
    return report


def _rel(path: Path | str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


# ----------------------------------------------------------------------------- text


def _yes(b: bool) -> str:
    return "yes" if b else "NO"


def format_report(r: dict[str, Any]) -> str:
    c, e, res, st, ck = r["config"], r["export"], r["resume"], r["stream"], r["checks"]
    src, dst = r["servers"]
    num = r["snapshot"]["numerics"]
    lines = [
        "hsnap demo: SGLang's real server (python -m hsnap_sglang.serve --enable-hsnap: sglang.launch_server + the hsnap plug-in)",
        f"  model     tiny random-weight {c['arch']} (seed {c['model_seed']}), built locally: {_rel(c['model'])}",
        f"  numerics  {c['dtype']}, torch {num.get('torch', '?')}, {num.get('threads', '?')} thread(s) in each server "
        f"(cores {c['threads_bind']}); the target found no numerics difference: {_yes(ck['same_numerics'])}",
        "",
        f"source server  pid {src['pid']}, ready in {src['ready_s']:.1f} s, capacity {src['capacity']}",
        f"  reference    {res['n']} tokens of request x, greedy, uninterrupted",
        f"  pause        x again beside {sum(o['server'] == 'source' for o in r['others'])} other requests; after {e['streamed_before_pause']} "
        f"streamed outputs POST /hsnap/export -> exported at its next committed boundary: {e['output_tokens']} outputs, "
        f"{e['committed_positions']} committed positions",
        f"               pause-to-durable {e['timings']['pause_to_durable_s'] * 1e3:.1f} ms (the call {e['pause_call_s'] * 1e3:.1f} ms); "
        f"x's stream ended with finish_reason hsnap_export naming the snapshot: {_yes(ck['source_stream_ended_with_the_snapshot'])}",
        f"  stopped      exit {src['exit_code']}; pid {src['pid']} and its {len(src['descendants'])} child processes gone: "
        f"{_yes(not src['processes_left'])}",
        f"target server  pid {dst['pid']} (fresh), ready in {dst['ready_s']:.1f} s, capacity {dst['capacity']}; "
        f"already running: {', '.join(res['running_when_resumed']) or 'nothing'}",
        f"  resume       POST /hsnap/resume: {res['bytes_uploaded']:,} bytes uploaded, restore {res['restore_s'] * 1e3:.1f} ms, "
        f"first new token after {res['first_token_s'] * 1e3 if res['first_token_s'] is not None else float('nan'):.1f} ms",
        "",
        "result",
        f"  token ids equal        {res['tokens_matching']}/{res['n']}: {_yes(ck['token_ids_equal'])} (text and finish reason equal: "
        f"{_yes(ck['text_equal'] and ck['finish_equal'])})",
        f"  logprobs equal         max |delta| {res['max_abs_logprob_diff']!r}: {_yes(ck['logprobs_equal'])}",
        f"  positions recomputed   {0 if res['target_forwards'].get('extend') == 0 else 'SOME'}: the target's completed forwards for x: "
        f"decode {res['target_forwards'].get('decode')} (N-k = {res['expected_forwards']['decode']}), extend {res['target_forwards'].get('extend')}: "
        f"{_yes(ck['decode_only_in_target'])}",
        f"  stream continuity      {_yes(st['continuous'])}: {st['chunks_before_pause']} chunks before the pause, {st['chunks_after_resume']} after; "
        f"the source stream ended at {st['source_stream_ended_at']['output_ids']} tokens / {st['source_stream_ended_at']['text_chars']} chars, "
        f"the resumed one went on from {st['resume_started_at']['output_ids']} / {st['resume_started_at']['text_chars']}; "
        f"repeated {st['repeated']['text_chars']} chars, missing {st['missing']['text_chars']} chars; "
        f"equal to the uninterrupted stream at {st['common_boundaries']} boundaries",
        f"  other requests         {sum(o['equal'] for o in r['others'])}/{len(r['others'])} equal to their uninterrupted runs in the same "
        f"batch shape (source: beside x, never paused; target: their own run) "
        f"({', '.join(o['rid'] + ' in the ' + o['server'] for o in r['others'])}): {_yes(ck['other_requests_unaffected'])}",
        f"  batch invariance       x alone == x beside the others, uninterrupted (the reference above may stand for a batched "
        f"run): {_yes(ck['reference_batch_invariant'])}",
        f"  pools consistent       SGLang's own idle checks in both servers (no leaked token, Mamba or request slot; the radix tree sane): "
        f"{_yes(ck['pools_consistent'])}",
        "",
        "checked before allocation: snapshots the target must refuse (each an HTTP error before any output; the server's "
        "pools, requests and checks compared before and after)",
        f"  {'case':<9} {'expected':<26} {'got':<26} {'HTTP':>4}  outputs  state unchanged",
    ]
    for n in r["negative"]:
        lines.append(f"  {n['case']:<9} {n['expected']:<26} {str(n['error']):<26} {str(n['status']):>4}  {n['outputs']:>7}  "
                     f"{_yes(n['state_unchanged'])}" + ("" if n["ok"] else "   <- FAILED"))
        lines.append(f"      {n['description']}")
        if n["message"]:
            lines.append(f"      {escape_text(n['message'])[:300]}")
    s = r["snapshot"]
    lines += [
        "",
        f"snapshot  {_rel(s['path'])}: {s['bytes']:,} bytes, {s['sections']} sections, {s['state_position']} committed positions, "
        f"root digest {s['root_digest']}",
        "  open it with:",
        *[f"    {cmd}" for cmd in r["open_with"]],
        f"  every file of this run (model, snapshot, server logs, the refused snapshots) is in {_rel(c['out'])}",
        "",
        f"wall {r['wall_s']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items()) + ")",
        f"result: {'OK' if r['ok'] else 'FAILED: ' + ', '.join(k for k, v in ck.items() if not v)}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """pause a request of a real SGLang server, resume it in a fresh one (needs hsnap[engine])"""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        report = run_demo(args)
    except DemoError as e:
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}, indent=2))
        print(f"hsnap demo: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"hsnap demo: interrupted ({type(e).__name__} {e}); the servers it started were stopped", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
