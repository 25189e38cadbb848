"""Helpers of the hsnap plug-in tests: servers with the plug-in on (SGLang's own strict memory and tree checks on),
streamed requests in threads, reference runs, and stream comparisons.  HTTP through urllib and hsnap_sglang.client."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine_support import REQUEST_TIMEOUT_S, Server

from hsnap_sglang import client, demo

# SGLang's own invariant checks, strict: a leak found while idle, or a tree that fails its sanity check, raises in
# the scheduler (the server dies and every later call fails)
PLUGIN_ENV = {
    "HSNAP_SGLANG_PLUGIN": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
}


def hsnap_server(model_dir: Path, log: Path, *args: str, radix: bool = True, overlap: bool = False, plugin: bool = True,
                 env: dict | None = None) -> Server:
    """A server as it runs in production here: bfloat16, the radix cache on (then SGLang's CPU platform needs the
    overlap scheduler off), chunked prefill in 128-token chunks, the hsnap plug-in on."""
    drop = tuple(f for f, on in (("--disable-radix-cache", radix), ("--disable-overlap-schedule", overlap)) if on)
    extra = {**(PLUGIN_ENV if plugin else {}), **(env or {})}
    return Server(model_dir, log, "--dtype", "bfloat16", "--chunked-prefill-size", "128", *args, env=extra, drop=drop)


def linkgate_env(gate: Path) -> dict:
    """Environment of a server whose checkpoint link writer holds a link while ``<gate>/<link file>.hold`` exists
    (tests/engine/linkgate/sitecustomize.py installs the hold: a test seam production code never reads)."""
    import os

    seam = str(Path(__file__).resolve().parent / "linkgate")
    return {"HSNAP_TEST_LINK_GATE": str(gate), "PYTHONPATH": os.pathsep.join(p for p in (seam, os.environ.get("PYTHONPATH")) if p)}


def start_together(*servers: Server) -> None:
    """Start ``servers`` at the same time (each one's start is mostly its imports: side by side they take little more
    than one); if any fails, every one is stopped and the first error raised."""
    errors: list[BaseException] = []

    def start(s: Server) -> None:
        try:
            s.start()
        except BaseException as e:  # noqa: BLE001 - raised below, after every server is stopped
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]


def error_of(call, *args, **kw) -> "client.ServerError | None":
    """The ServerError ``call`` raises, or None when it succeeds (a fixture records refusals for its tests)."""
    try:
        call(*args, **kw)
    except client.ServerError as e:
        return e
    return None


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 500) for _ in range(n)]


def payload(rid: str, ids: list[int], n: int, **sampling) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sampling}
    return {"rid": rid, "input_ids": ids, "sampling_params": sp, "return_logprob": True}


def generate(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


PACE_S = 0.1  # seconds each forward sleeps while a test's admin call is on its way


@contextlib.contextmanager
def paced(url: str, seconds: float = PACE_S):
    """SGLang's own test route ``/slow_down``: every forward of the server sleeps ``seconds`` inside the block.  A
    test that exports, drains or checkpoints a request after K of its N tokens starts it inside, so the N - K tokens
    take (N - K) * ``seconds`` at least and the call lands while it decodes, on any machine (an unpaced tiny model
    decodes a token in milliseconds: a fast machine finished 32-token requests before the pause arrived)."""
    def slow_down(t: float | None) -> None:
        req = urllib.request.Request(url + "/slow_down", data=json.dumps({"forward_sleep_time": t}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    slow_down(seconds)
    try:
        yield
    finally:
        try:
            slow_down(None)
        except urllib.error.URLError as e:  # the server is gone (SIGKILLed inside the block): nothing to speed up
            if not isinstance(e.reason, ConnectionRefusedError):
                raise


def flush_cache(url: str) -> None:
    """SGLang's /flush_cache (the radix tree emptied; refused while requests run, so retried)."""
    deadline = time.monotonic() + 120
    while True:
        req = urllib.request.Request(url + "/flush_cache", data=b"{}", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60):
                return
        except urllib.error.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Stream(demo.Stream):
    """The demo's streamed /generate in a thread (events, arrival times, the error if any); ``finish`` asserts
    instead of raising the demo's error, and lets a stream that got no event through (the test looks at it)."""

    def finish(self, timeout: float = REQUEST_TIMEOUT_S) -> "Stream":
        self.join(timeout)
        assert not self.is_alive(), f"{self.body['rid']} still streaming"
        assert self.error is None, self.error
        return self

    def decoded_meanwhile(self, n: int, timeout: float = 30.0) -> int:
        """Tokens this stream got from now until it has ``n`` more (or ``timeout`` passed): what it decoded while
        something else was held."""
        at, deadline = self.tokens_so_far(), time.monotonic() + timeout
        while self.tokens_so_far() < at + n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.tokens_so_far() - at


def deltas(events: list[dict], had: tuple[int, int] = (0, 0)) -> list[tuple[str, list[int]]]:
    """What each event adds to the text and the token ids (events carry both so far); empty additions left out."""
    out, (n_text, n_ids), prev = [], had, None
    for e in events:
        text, ids = e.get("text") or "", list(e.get("output_ids") or [])
        if prev is not None:
            assert text.startswith(prev[0]) and ids[: len(prev[1])] == prev[1], "an event took text or ids back"
        add = (text[n_text:], ids[n_ids:])
        if add != ("", []):
            out.append(add)
        n_text, n_ids, prev = len(text), len(ids), (text, ids)
    return out


HELD_BACK_CHARS = 16  # what an event may lag the uninterrupted stream's at the same token count: a token or two's text


def assert_continues(first: list[dict], resumed: list[dict], reference: list[dict], had: tuple[int, int]) -> None:
    """The stream a client gets from the source (``first``) and then from the resumed request (``resumed``, whose
    events carry the client's earlier text and ids too: ``had`` = (text chars, ids) of them) is the uninterrupted
    ``reference`` stream: no repeated and no missing chunk of text or token id.  Where the client read two outputs
    at once (the TokenizerManager hands the latest state), the check is at the boundaries both streams have: the
    same token ids, and text that is the uninterrupted stream's so far — how much of it an event carries may differ
    by the characters SGLang's detokenizer still holds back (at 66 tokens a migrated stream's event lacked its last
    token's text, which the next event carried; seen twice in fresh-clone runs under load) — and the same text at the
    end."""
    def points(events):
        return [(len(e.get("output_ids") or []), e.get("text") or "", list(e.get("output_ids") or [])) for e in events]

    ref = {n: (t, ids) for n, t, ids in points(reference)}
    src, res = points(first), points(resumed)
    n_k, text_k, ids_k = src[-1]
    assert (len(text_k), n_k) == had, "the resume did not start where the source stream ended"
    joined = src + res
    for (n0, t0, i0), (n1, t1, i1) in zip(joined, joined[1:]):
        assert n1 >= n0 and t1.startswith(t0) and i1[:n0] == i0, "a chunk repeated or went missing"
    assert all(t.startswith(text_k) and ids[:n_k] == ids_k for _, t, ids in res)
    common = [(n, t, ids) for n, t, ids in joined if n in ref]
    assert len(common) >= len(reference) // 2, "too few common boundaries to compare"
    final = points(reference)[-1][1]
    for n, t, ids in common:
        assert ids == ref[n][1], f"at {n} tokens: ids {ids[-5:]} != {ref[n][1][-5:]}"
        assert final.startswith(t) and final.startswith(ref[n][0]), f"at {n} tokens: {t[-20:]!r} vs {ref[n][0][-20:]!r}: not the same text"
        assert len(ref[n][0]) - len(t) <= HELD_BACK_CHARS and len(t) - len(ref[n][0]) <= HELD_BACK_CHARS, f"at {n} tokens: {t[-20:]!r} != {ref[n][0][-20:]!r}"
    assert joined[-1][1:] == points(reference)[-1][1:]


CHUNK = 128  # hsnap_server's --chunked-prefill-size


def references(url: str, requests: dict[str, tuple[list[int], int]]) -> dict[str, tuple[list[int], list[float]]]:
    """Uninterrupted runs of ``requests`` ({rid: (prompt ids, output tokens)}), all at once: in bfloat16 a request's
    numbers do not depend on its batch, so running them together gives what running them one by one gives, in the
    time of the longest.  Their prompts together must fit one prefill chunk (so that none is split differently)."""
    assert sum(len(ids) for ids, _ in requests.values()) <= CHUNK, "the prompts would be prefilled in other chunks"
    streams = {rid: Stream(url, payload(f"{rid}-ref", ids, n)) for rid, (ids, n) in requests.items()}
    for st in streams.values():
        st.start()
    return {rid: tokens(st.finish().final) for rid, st in streams.items()}


def tokens(out: dict) -> tuple[list[int], list[float]]:
    pairs = out["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


def stats(url: str, rid: str | None = None) -> dict:
    return client.stats(url, rid)


def wait_links(url: str, rid: str, n: int, timeout: float = 120.0, stream: "Stream | None" = None) -> dict:
    """Until ``rid``'s checkpoints count ``n`` committed links in /hsnap/stats; returns the stats' ``checkpoints``.
    Fails after ``timeout`` s, or once ``stream`` (the request's) has ended first."""
    deadline = time.monotonic() + timeout
    while (ck := stats(url)["checkpoints"]).get(rid, {}).get("links", 0) < n:
        assert time.monotonic() < deadline and not (stream is not None and stream.done.is_set()), ck
        time.sleep(0.05)
    return ck


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    """The server's hsnap stats once it runs nothing (its idle checks included)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        if s["checks"].get("idle"):
            return s
        assert time.monotonic() < deadline, s["requests"]
        time.sleep(0.2)
