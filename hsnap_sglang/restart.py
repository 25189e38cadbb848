"""A rolling restart's second half: a server started with ``HSNAP_RESUME_ON_START=DIR`` resumes, once it is ready,
every snapshot in DIR (a directory beneath the snapshot root or an allowed ``s3://`` prefix: what the old server's
``HSNAP_DRAIN_ON_SIGTERM`` drained there) and holds each resumed request's stream for its client, who takes it with
``POST /hsnap/attach {"rid"}`` (``hsnap_sglang.client.generate`` does, when the snapshot it follows was claimed by
the server itself).

The resume goes through the server's own ``/hsnap/resume`` route (every check, the at-most-once claim, the typed
refusals), called from a thread of the HTTP process once SGLang's warmup has ended (``_wait_and_warmup``, AFTER): a
snapshot a client resumed first is refused to the server by its claim, and the other way round.  For each request
the server keeps its latest event only (events carry the text and ids so far), and the last one of a request that
ended before its client came for ``KEEP_FINISHED_S``.  One tokenizer worker (``--tokenizer-worker-num 1``): with
several, a client may reach a worker that does not hold its request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from hsnap_format.errors import Phrase

from .errors import RequestBusyError, UnknownRequestError

logger = logging.getLogger(__name__)

RESUME_ON_START_ENV = "HSNAP_RESUME_ON_START"
KEEP_FINISHED_S = 600.0  # how long the last event of a request that ended before its client attached is kept
STREAM_TIMEOUT_S = 3600.0  # the held streams' read timeout (a request paced or waiting for room may be silent long)


@dataclass
class Held:
    """A request this server resumed at start: its latest event, whether it ended, whether a client took it."""

    rid: str
    path: str | None = None
    event: dict | None = None
    done: bool = False
    attached: bool = False
    ended_at: float | None = None


_held: dict[str, Held] = {}
_lock = threading.Lock()
_resuming = threading.Event()  # set from the start of the resume until its report names what it holds


def resuming() -> bool:
    """Whether the resume of the directory is under way and has not yet said which requests it holds (an attach of
    a rid not held yet waits for it: the snapshot's claim comes before the report)."""
    return _resuming.is_set()


def held(rid: str) -> Held | None:
    with _lock:
        return _held.get(rid)


def take(rid: str) -> Held:
    """The held request ``rid`` for one client (refused while another client reads it, or after one read it to its
    end; :func:`release` frees it when its client goes away mid-stream)."""
    with _lock:
        _forget_old(time.monotonic())
        h = _held.get(rid)
        if h is None:
            raise UnknownRequestError(None, "rid", Phrase("a request this server resumed at start and holds for its client"), rid)
        if h.attached:
            raise RequestBusyError(None, "rid", Phrase("a held request no other client is attached to"), rid)
        h.attached = True
        return h


def release(h: Held) -> None:
    """The client of ``h`` went away before its end: the next attach may take it."""
    with _lock:
        h.attached = False


def _forget_old(now: float) -> None:
    for rid in [r for r, h in _held.items() if h.done and h.ended_at is not None and now - h.ended_at > KEEP_FINISHED_S]:
        del _held[rid]


def own_url(server_args) -> str:
    """Where this server's HTTP process answers itself: loopback for a wildcard or loopback host."""
    host = str(getattr(server_args, "host", "") or "127.0.0.1")
    if host in ("0.0.0.0", "::", "", "localhost"):
        host = "127.0.0.1"
    return f"http://{'[' + host + ']' if ':' in host else host}:{int(server_args.port)}"


def after_wait_and_warmup(result, *args, **kwargs):
    """AFTER ``http_server._wait_and_warmup`` (SGLang's warmup thread, once the server is ready): with
    ``HSNAP_RESUME_ON_START`` set, resume every snapshot there in a thread of its own."""
    target = os.environ.get(RESUME_ON_START_ENV)
    sa = kwargs.get("server_args", args[0] if args else None)
    if target and sa is not None:
        threading.Thread(target=resume_all, args=(own_url(sa), target, getattr(sa, "admin_api_key", None) or getattr(sa, "api_key", None)),
                         name="hsnap-resume-on-start", daemon=True).start()
    return None


READY_WAIT_S = 300.0  # how long the resume waits for this server's HTTP side to answer /health


def _answers(url: str, wait_s: float = READY_WAIT_S) -> bool:
    """Whether ``url`` answers ``/health`` with 200 within ``wait_s`` (SGLang's warmup thread may end before the HTTP
    server listens, with ``--skip-server-warmup``)."""
    import urllib.request

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def resume_all(url: str, target: str, api_key: str | None) -> None:
    """Resume every snapshot in ``target`` at ``url`` and hold their streams (see the module's docstring)."""
    from . import client

    mine: list[str] = []
    expected = [0]  # a report too long for its header names no rid, only how many: held from each one's first event

    def started(report: Any) -> None:
        items = client.report_items(report)
        with _lock:
            for item in items:
                if item.get("ok") and "result" in item:
                    rid = item["result"]["rid"]
                    _held[rid] = Held(rid, item.get("path"))
                    mine.append(rid)
        if isinstance(report, dict) and report.get("truncated"):
            expected[0] = int(report.get("resumed", 0))
        else:
            _resuming.clear()  # after: an attach waiting on it finds its request held
        refused = [f"{i.get('path')}: {(i.get('error') or {}).get('type')}" for i in items if not i.get("ok")]
        logger.info("hsnap: resumed %d snapshot(s) from %s at start, held for their clients%s", len(mine), target,
                    f"; refused {len(refused)}: {', '.join(refused)}" if refused else "")

    def event(rid: str, text: str, ids: list, ev: dict) -> None:
        with _lock:
            h = _held.get(rid)
            if h is None or h.rid not in mine:  # a report too long for its header names no rid: its first event does
                h = _held[rid] = Held(rid)
                mine.append(rid)
                if len(mine) >= expected[0]:
                    _resuming.clear()
            h.event = ev
            if ((ev.get("meta_info") or {}).get("finish_reason")) is not None:
                h.done, h.ended_at = True, time.monotonic()

    if not _answers(url):
        logger.error("hsnap: %s: this server never answered at %s; nothing resumed from %s", RESUME_ON_START_ENV, url, target)
        return
    logger.info("hsnap: resuming every snapshot in %s (%s)", target, RESUME_ON_START_ENV)
    _resuming.set()
    try:
        client.resume(url, target, on_chunk=event, on_start=started, timeout=STREAM_TIMEOUT_S, api_key=api_key)
    except client.ServerError as e:  # nothing there, or every snapshot claimed by a client first
        logger.info("hsnap: nothing resumed from %s at start: %s", target, e)
    except Exception:  # noqa: BLE001 - hsnap may fail, the server may not
        logger.exception("hsnap: resuming %s at start", target)
    finally:
        _resuming.clear()
        with _lock:  # the stream ended: each request ended (or was aborted) with it
            now = time.monotonic()
            for rid in mine:
                h = _held.get(rid)
                if h is not None and not h.done:
                    h.done, h.ended_at = True, now


__all__ = ["RESUME_ON_START_ENV", "KEEP_FINISHED_S", "Held", "held", "take", "release", "resuming", "own_url", "after_wait_and_warmup", "resume_all"]
