"""Clients of a server running the hsnap plug-in: Python calls and the ``hsnap pause | resume | drain`` commands.

    from hsnap_sglang import client
    info = client.pause("http://127.0.0.1:30000", "req-42", "/snaps/req-42.hsnap")    # export, release, end the stream
    info = client.pause(url, "req-42", "/snaps/ck.hsnap", keep_running=True)           # a checkpoint: it keeps decoding
    run = client.resume("http://127.0.0.1:30001", "/snaps/req-42.hsnap", on_chunk=print)  # stream the rest
    run.final["meta_info"]["finish_reason"], run.text, run.output_ids, run.info         # info: the X-Hsnap-Resume header
    client.drain(url, "/snaps/upgrade-1")   # every request of the server; resume("/snaps/upgrade-1") brings them back
    client.drain(url, "/snaps/upgrade-1", dedup=True)   # shared full pages stored once (dir/pages)
    client.checkpoint(url, "req-42", "/ck", every=64)  # a link now and every 64 output tokens; after a crash:
    run = client.resume(url2, "/ck", seen=(len(text_so_far), len(ids_so_far)))  # the newest link; on_chunk: only what is new
    client.stats(url, "req-42")["forwards"]  # {"decode": n, "extend": m}: completed forwards in that server
    mig = client.move(url, url2, "req-42", "/mig/req-42", on_chunk=print)  # live migration: pre-copy while it decodes
    mig.source["timings"], mig.run.final, mig.downtime_s      # the source's report, the target's stream, the client's gap

Paths are on the server's machine, beneath its snapshot root (relative ones: relative to it).  Every call takes
``api_key=`` (default ``$HSNAP_API_KEY``), sent as ``Authorization: Bearer``: the server's admin key, else its API key.

Every HTTP error becomes a :class:`ServerError` (an :class:`hsnap_format.HsnapError`) carrying the server's typed
reason: ``error_type`` (``IncompatibleSnapshotError``, ``UnknownRequestError``, ...), ``status``, ``field``,
``expected``, ``found``.  Only the standard library and hsnap_format are imported (no torch, no SGLang).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from hsnap_format.errors import HsnapError, HsnapIOError, escape_text
from hsnap_format.tools.fit import Printer, elide_end

__all__ = ["ServerError", "ResumeRun", "GenerateRun", "Migration", "HAND_OFF", "pause", "resume", "generate", "pause_back", "interrupted_path", "drain", "checkpoint", "migrate", "follow", "move", "stats", "attach", "report_items",
           "stream_events", "requests", "ls_main", "pause_main", "resume_main", "drain_main", "checkpoint_main", "migrate_main"]

DEFAULT_TIMEOUT_S = 600.0
RESUME_HEADER = "X-Hsnap-Resume"


class ServerError(HsnapError):
    """The server refused (an HTTP error status): ``error_type`` is the server-side error class, ``error`` the whole
    answer (``message``, ``path``, ``field``, ``expected``, ``found``, ``differences``...)."""

    def __init__(self, url: str, status: int, error: dict) -> None:
        self.url, self.status, self.error = url, status, dict(error)
        self.error_type = str(error.get("type", "HTTPError"))
        super().__init__(error.get("path") or url, str(error.get("field") or "server"), error.get("expected"), error.get("found"),
                         detail=f"{self.error_type} (HTTP {status}): {error.get('message', '')}")

    def _message(self) -> str:
        """One sentence: where, which refusal, and the server's own message (which already names the file, field,
        expected and found: they are not repeated)."""
        message = str(self.error.get("message") or "")
        message = message.removeprefix("<memory>: ")  # a refusal about no file (older servers said so)
        return f"{self.url}: {self.error_type} (HTTP {self.status}): {escape_text(message)}"

    def __reduce__(self):
        return (type(self), (self.url, self.status, self.error))


API_KEY_ENV = "HSNAP_API_KEY"  # the key the clients send when none is given (the server's admin key, else its API key)


def server_url(text: str) -> str:
    """A server's base URL as a user may write it, curl-style: ``host:port`` means ``http://host:port``; a trailing
    ``/`` is dropped.  Any scheme but http and https is refused (typed)."""
    text = str(text).strip()
    if "://" not in text:
        text = "http://" + text
    scheme = text.split("://", 1)[0].lower()
    if scheme not in ("http", "https") or not text.split("://", 1)[1].strip("/"):
        raise HsnapError(None, "url", "http://host:port, https://host:port or host:port", text)
    return text.rstrip("/")


def _headers(api_key: str | None) -> dict:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _request(url: str, route: str, payload: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None):
    data = None if payload is None else json.dumps(payload).encode()
    url = server_url(url)
    req = urllib.request.Request(url + route, data=data, headers=_headers(api_key),
                                 method="GET" if payload is None else "POST")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            error = json.loads(body).get("error")
        except ValueError:
            error = None
        if not isinstance(error, dict) and e.code in (401, 403):  # SGLang's key check: {"error": "Unauthorized"}
            error = {"type": "Unauthorized", "message": f"{body[:100].decode(errors='replace')}: the /hsnap routes need the "
                     f"server's admin key (else its API key): --api-key or {API_KEY_ENV}"}
        elif not isinstance(error, dict) and e.code == 404 and route.startswith("/hsnap/"):  # FastAPI's {"detail": "Not Found"}
            error = {"type": "NoHsnapRoutes", "message": f"no hsnap routes at {url}: start the server with the plug-in on "
                     "(python -m hsnap_sglang.serve --enable-hsnap)"}
        elif not isinstance(error, dict):
            error = {"type": "HTTPError", "message": body[:300].decode(errors="replace")}
        raise ServerError(url + route, e.code, error) from None
    except (urllib.error.URLError, OSError) as e:
        raise HsnapIOError(url + route, "connect", e) from None


def _json(url: str, route: str, payload: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> dict:
    with _request(url, route, payload, timeout, api_key) as r:
        return json.loads(r.read())


def pause(url: str, rid: str, path: str, *, keep_running: bool = False, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> dict:
    """Export request ``rid`` to ``path`` (a path on the server's machine, or ``s3://``) at its next committed decode
    boundary.  Without ``keep_running`` the server releases its slots once the snapshot is durable and ends the
    client's stream with ``finish_reason {"type": "hsnap_export", "path": ...}``.  Returns the server's report
    (``path``, ``bytes``, ``committed_positions``, ``snapshot_id``, ``timings``...)."""
    return _json(url, "/hsnap/export", {"rid": rid, "path": path, "keep_running": keep_running}, timeout, api_key)


def drain(url: str, dir: str, *, dedup: bool = False, page_size: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,  # noqa: A002
          api_key: str | None = None) -> dict:
    """Export every request of the server into ``dir`` (``{"ok", "items": [{rid, path, ok, result|error}]}``).
    ``dedup``: their full pages of ``page_size`` positions (default 64) stored once, in ``dir/pages`` (format 1.3);
    the answer's ``dedup`` says what was written against the sum of single snapshots."""
    body: dict[str, object] = {"dir": dir}
    if dedup:
        body.update(dedup=True, page_size=page_size or 0)
    return _json(url, "/hsnap/drain", body, timeout, api_key)


def checkpoint(url: str, rid: str, dir: str, *, every: int, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> dict:  # noqa: A002
    """Checkpoint request ``rid`` into ``dir`` at its next committed decode boundary (returned once durable, with
    ``link`` 1) and every ``every`` output tokens after that, while it keeps decoding: ``<name>.ckNNNNNN.hsnap``, a
    plain link then deltas of the link before.  ``resume(url2, dir)`` takes the newest committed link.  ``every=0``
    stops checkpointing it."""
    return _json(url, "/hsnap/checkpoint", {"rid": rid, "dir": dir, "every": every}, timeout, api_key)


def stats(url: str, rid: str | None = None, *, timeout: float = 60.0, api_key: str | None = None) -> dict:
    """Completed forwards (``forwards``: decode / extend) of ``rid`` in that server, its requests, pools, checks."""
    q = "" if rid is None else "?" + urllib.parse.urlencode({"rid": rid})
    return _json(url, "/hsnap/stats" + q, None, timeout, api_key)


def stream_events(response) -> Any:
    """The ``data:`` events of a server-sent-events response, in order (``[DONE]`` ends it)."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        body = line[5:].strip()
        if body == "[DONE]":
            return
        yield json.loads(body)


def _raise_stream_error(where: str, event: dict) -> None:
    """A streamed event that is an error (the server's typed error in the stream after its 200) as ServerError."""
    if "error" in event:
        err = event["error"]
        raise ServerError(where, 200, err if isinstance(err, dict) else {"message": str(err)})


@dataclass
class ResumeRun:
    """What :func:`resume` saw: the resume report (``info``), every event, and per request the last event."""

    info: Any
    events: list = field(default_factory=list)
    finals: dict = field(default_factory=dict)  # rid -> last event
    interrupted: dict | None = None  # on_interrupt's answer when the read was interrupted (Ctrl-C), else None

    @property
    def final(self) -> dict:
        return next(iter(self.finals.values()))

    @property
    def text(self) -> str:
        return self.final.get("text", "")

    @property
    def output_ids(self) -> list:
        return list(self.final.get("output_ids", []))

    @property
    def results(self) -> dict:
        """rid -> the resume report of each request resumed (``path``, ``committed_positions``, ``timings``...)."""
        return {i["result"]["rid"]: i["result"] for i in report_items(self.info) if i.get("ok") and "result" in i}

    @property
    def resumed(self) -> dict:
        """rid -> the snapshot (its path on the server's machine) each resumed request was resumed from."""
        return {rid: res["path"] for rid, res in self.results.items()}

    @property
    def running(self) -> list:
        """The resumed requests whose stream has not ended yet (no finish reason seen)."""
        return [rid for rid in self.resumed if not ((self.finals.get(rid) or {}).get("meta_info") or {}).get("finish_reason")]

    @property
    def aborted(self) -> dict:
        """rid -> finish reason of each request whose stream ended in an abort (the continuation is incomplete)."""
        return {rid: (e.get("meta_info") or {}).get("finish_reason") for rid, e in self.finals.items()
                if ((e.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort"}


def resume(url: str, path: str, *, on_chunk: Callable[[str, str, list, dict], None] | None = None, stream: bool = True,
           seen: tuple[int, int] | dict | None = None, again: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
           api_key: str | None = None, on_start: Callable[[Any], None] | None = None,
           on_interrupt: Callable[[ResumeRun], dict] | None = None) -> ResumeRun:
    """Resume the snapshot (or every snapshot of a drain's or a checkpoint directory) at ``path`` in the server at
    ``url`` and read the rest of the request(s).  ``on_chunk(rid, new_text, new_ids, event)`` gets each event with
    what it adds to that request's text and token ids (events carry the text and ids so far, as /generate's do).
    ``seen``: what this client already received of the request — ``(text characters, output ids)``, or a dict rid ->
    that — when it is not what the snapshot holds (a stream cut by a crash, resumed from the last checkpoint: the
    client may have more, or less): ``on_chunk`` then gets only what lies beyond it, so the text continues with
    nothing repeated or missing.  (With the server's ``--incremental-streaming-output`` the events carry only what
    follows the snapshot: a client that had less than the snapshot does not get the part in between from them.)
    A snapshot is resumed at most once (the server claims it: a second resume is refused, ``SnapshotClaimedError``);
    ``again``: resume it anyway.  A refusal raises :class:`ServerError` before any output; a resumed request that
    ends aborted is in ``run.aborted``.  ``on_start(report)``: called with the resume report before the first event
    (what was resumed, what was refused).

    The server aborts the resumed requests when their stream's client goes away (as SGLang does for /generate).
    ``on_interrupt(run)``: called on Ctrl-C (KeyboardInterrupt) while the stream is still open, so that it can keep
    the requests' progress (:func:`pause_back` pauses each into a snapshot); its answer is ``run.interrupted``, the
    rest of the stream is read and the run returned.  Without it the interrupt propagates."""
    body = {"path": path, "stream": stream, **({"again": True} if again else {})}
    return _read_run(url, "/hsnap/resume", body, on_chunk=on_chunk, stream=stream, seen=seen, timeout=timeout, api_key=api_key,
                     on_start=on_start, on_interrupt=on_interrupt)


def attach(url: str, rid: str, *, on_chunk: Callable[[str, str, list, dict], None] | None = None,
           seen: tuple[int, int] | None = None, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> ResumeRun:
    """Read the rest of request ``rid`` that the server at ``url`` resumed by itself (``HSNAP_RESUME_ON_START``: a
    rolling restart) and holds for its client; ``on_chunk`` and ``seen`` as for :func:`resume` (the events carry the
    text and ids so far: ``seen`` is what this client already has).  One client at a time: an attach while another
    client reads the request, or after one read it to its end, is refused (``RequestBusyError``; a client that went
    away mid-stream frees it), as is a rid the server does not hold (``UnknownRequestError``)."""
    return _read_run(url, "/hsnap/attach", {"rid": rid, "stream": True}, on_chunk=on_chunk, stream=True, seen=seen or (0, 0),
                     timeout=timeout, api_key=api_key)


def _read_run(url: str, route: str, body: dict, *, on_chunk, stream: bool, seen, timeout: float, api_key: str | None = None,
              on_start: Callable[[Any], None] | None = None, on_interrupt: Callable[[ResumeRun], dict] | None = None) -> ResumeRun:
    """A /hsnap/resume, /hsnap/follow or /hsnap/attach call's events (see :func:`resume`)."""
    with _request(url, route, body, timeout, api_key) as r:
        header = r.headers.get(RESUME_HEADER)
        run = ResumeRun(info=json.loads(header) if header else None)
        if on_start is not None:
            on_start(run.info)
        if not stream:
            body = json.loads(r.read())
            for event in body if isinstance(body, list) else [body]:
                run.events.append(event)
                run.finals[event["meta_info"]["id"]] = event
            return run
        # what each request's client already had (its first event repeats it: events carry the text and ids so far)
        had = {i["result"]["rid"]: i["result"].get("client_had", {}) for i in report_items(run.info) if i.get("ok")}
        # per request: where the next event's addition starts in the whole stream, and what the client has
        at: dict[str, tuple[int, int]] = {}
        floor: dict[str, tuple[int, int]] = {}

        def take(event: dict) -> None:
            _raise_stream_error(url + route, event)
            rid = event["meta_info"]["id"]
            run.events.append(event)
            text, ids = event.get("text") or "", list(event.get("output_ids") or [])
            incremental = bool(had.get(rid, {}).get("incremental"))
            if rid not in at:
                h = had.get(rid, {})
                snap_has = (int(h.get("text_chars", 0)), int(h.get("output_ids", 0)))
                at[rid] = snap_has if incremental else (0, 0)  # incremental events start after the snapshot's part
                mine = seen.get(rid) if isinstance(seen, dict) else seen
                floor[rid] = tuple(mine) if mine is not None else snap_has
            (a_text, a_ids), (f_text, f_ids) = at[rid], floor[rid]
            add_text, add_ids = (text, ids) if incremental else (text[a_text:], ids[a_ids:])
            if on_chunk is not None:
                on_chunk(rid, add_text[max(0, f_text - a_text):], add_ids[max(0, f_ids - a_ids):], event)
            at[rid] = (a_text + len(add_text), a_ids + len(add_ids))
            floor[rid] = (max(f_text, at[rid][0]), max(f_ids, at[rid][1]))
            run.finals[rid] = event

        try:
            for event in stream_events(r):
                take(event)
        except KeyboardInterrupt:
            if on_interrupt is None:
                raise
            run.interrupted = on_interrupt(run)  # the stream still open: the server has not aborted anything
            try:  # the rest: each request paused back ends its stream with its export's finish reason
                for event in stream_events(r):
                    take(event)
            except (OSError, ValueError, http.client.HTTPException):
                pass  # a read the interrupt cut mid-chunk: run.interrupted says what became of each request
        return run


HAND_OFF = "hsnap_export"  # the finish reason of a stream whose request was paused or drained into a snapshot
MAX_HAND_OFFS = 16


@dataclass
class GenerateRun:
    """What :func:`generate` saw: the request's whole text and output ids across every server it ran in, its last
    event, and each hand-off as ``(server URL, snapshot path)`` in order."""

    text: str = ""
    output_ids: list = field(default_factory=list)
    final: dict = field(default_factory=dict)
    hand_offs: list = field(default_factory=list)

    @property
    def finish_reason(self) -> dict | None:
        return (self.final.get("meta_info") or {}).get("finish_reason")


def _finish(event: dict) -> dict:
    return (event.get("meta_info") or {}).get("finish_reason") or {}


HAND_OFF_WAIT_S = 300.0  # how long generate waits for the next server to answer (a rolling restart's new one starting)


def generate(url: str, body: dict, *, next_url: str | Callable[[str, str], str] | None = None,
             on_chunk: Callable[[str, str, list, dict], None] | None = None, max_hand_offs: int = MAX_HAND_OFFS,
             timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None, wait_s: float = HAND_OFF_WAIT_S) -> GenerateRun:
    """SGLang's streamed ``/generate`` of ``body`` at ``url``, followed across hand-offs: when the stream ends with
    ``finish_reason {"type": "hsnap_export", "path": ...}`` (the request was paused, drained, or drained by a server
    going down on SIGTERM), the snapshot is resumed in ``next_url`` (a URL, or ``next_url(server_url, path)`` -> URL;
    default: the same server) and its events continue the same request, with nothing repeated or missing; up to
    ``max_hand_offs`` times.  ``on_chunk(rid, new_text, new_ids, event)`` gets what each event adds, as from
    :func:`resume`.  The server must stream whole text and ids per event (SGLang's default, not
    ``--incremental-streaming-output``).  A next server that does not answer yet (a rolling restart: the new server
    is starting) is asked again for up to ``wait_s``; one that resumed the snapshot by itself
    (``HSNAP_RESUME_ON_START``: the resume is refused as claimed) is attached to (:func:`attach`).  A hand-off the
    next server refuses otherwise raises its :class:`ServerError`; the run so far is on the error as ``run``."""
    run = GenerateRun()

    def take(rid: str, new_text: str, new_ids: list, event: dict) -> None:
        run.text += new_text
        run.output_ids += list(new_ids)
        run.final = event
        if on_chunk is not None:
            on_chunk(rid, new_text, new_ids, event)

    with _request(url, "/generate", dict(body, stream=True), timeout, api_key) as r:
        for event in stream_events(r):
            _raise_stream_error(url + "/generate", event)
            text, ids = event.get("text") or "", list(event.get("output_ids") or [])
            take(event["meta_info"]["id"], text[len(run.text):], ids[len(run.output_ids):], event)
    server = url
    while _finish(run.final).get("type") == HAND_OFF and len(run.hand_offs) < max_hand_offs:
        path = _finish(run.final)["path"]
        server = next_url(server, path) if callable(next_url) else (next_url or server)
        run.hand_offs.append((server, path))
        rid = run.final["meta_info"]["id"]
        try:
            _continue_in(server, path, rid, take, (len(run.text), len(run.output_ids)), timeout, api_key, wait_s)
        except ServerError as e:
            e.run = run  # type: ignore[attr-defined]
            raise
    return run


def _continue_in(server: str, path: str, rid: str, take, seen: tuple[int, int], timeout: float, api_key: str | None,
                 wait_s: float) -> None:
    """Resume ``path`` in ``server`` (waiting up to ``wait_s`` for it to answer), or attach to ``rid`` there when the
    server resumed it by itself."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            resume(server, path, on_chunk=take, seen=seen, timeout=timeout, api_key=api_key)
            return
        except ServerError as e:
            if e.error_type != "SnapshotClaimedError":
                raise
            try:
                attach(server, rid, on_chunk=take, seen=seen, timeout=timeout, api_key=api_key)
                return
            except ServerError:
                raise e from None  # claimed, and not held there: another client or server has it
        except HsnapIOError as e:
            if e.field != "connect" or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def interrupted_path(entry: str, n: int = 1) -> str:
    """Where a request resumed from the snapshot ``entry`` is paused back to (:func:`pause_back`): beside it,
    ``<name>.interrupted.hsnap``, then ``<name>.interrupted-2.hsnap``... (a TP set directory: no suffix); a
    snapshot that was itself such a pause keeps one ``.interrupted``."""
    suffix = ".hsnap" if entry.endswith(".hsnap") else ""
    stem = re.sub(r"\.interrupted(-\d+)?$", "", entry[: len(entry) - len(suffix)])
    return f"{stem}.interrupted{'' if n == 1 else f'-{n}'}{suffix}"


MAX_PAUSE_BACK_NAMES = 100  # interrupted-2 ... interrupted-100: past that a name collision is not a coincidence


def pause_back(url: str, run: ResumeRun, *, api_key: str | None = None) -> dict:
    """Pause each request of ``run`` still running back into a snapshot beside the one it was resumed from
    (:func:`interrupted_path`; a name taken: the next one).  rid -> the pause's report (``path``, ``output_tokens``...),
    or ``{"error": ServerError}`` when the server refused (the request finished meanwhile: its stream says how)."""
    done: dict[str, dict] = {}
    for rid in run.running:
        entry = run.resumed[rid]
        for n in range(1, MAX_PAUSE_BACK_NAMES + 1):
            try:
                done[rid] = pause(url, rid, interrupted_path(entry, n), api_key=api_key)
                break
            except ServerError as e:
                if e.error_type == "SnapshotExistsError" and n < MAX_PAUSE_BACK_NAMES:
                    continue
                done[rid] = {"error": e}
                break
            except HsnapError as e:
                done[rid] = {"error": e}
                break
    return done


def migrate(url: str, rid: str, dir: str, *, tail: int = 16, max_rounds: int = 8, timeout_s: float = 60.0, fsync: bool = False,  # noqa: A002
            relay_to: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> dict:
    """Migrate request ``rid`` out of the server at ``url`` through ``dir`` (a directory both servers reach, or
    ``s3://``), which a target server follows (:func:`follow`): pre-copy rounds while it decodes, then, once the
    target applied the last round and at most ``tail`` rows are left, the request is stopped, the final link
    written and its slots released; its client's stream ends with ``finish_reason {"type": "hsnap_export",
    "migration": dir}``.  Returns the source's report (``rounds``, ``final_rows``, ``timings``...).

    ``relay_to``: the target server (one the source's operator allowed, ``--hsnap-allow-peer``).  The source then
    has the target follow ``dir`` itself and relays the target's stream into the request's own: its client's stream
    does not end at the hand-off but goes on to the request's finish (``hsnap_sglang.relay``); no :func:`follow`."""
    body = {"rid": rid, "dir": dir, "tail": tail, "max_rounds": max_rounds, "timeout_s": timeout_s, "fsync": fsync}
    if relay_to is not None:
        body["relay_to"] = server_url(relay_to)
    return _json(url, "/hsnap/migrate", body, timeout, api_key)


def follow(url: str, dir: str, *, rid: str | None = None, on_chunk: Callable[[str, str, list, dict], None] | None = None,  # noqa: A002
           stream: bool = True, seen=None, timeout_s: float = 60.0, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> ResumeRun:
    """Have the server at ``url`` follow the migration in ``dir`` (each link applied as it is committed) and read the
    rest of the request once it runs there, as :func:`resume` reads it (``info``: the follow's report)."""
    body = {"dir": dir, "stream": stream, "timeout_s": timeout_s}
    if rid is not None:
        body["rid"] = rid
    return _read_run(url, "/hsnap/follow", body, on_chunk=on_chunk, stream=stream, seen=seen, timeout=timeout, api_key=api_key)


@dataclass
class Migration:
    """What :func:`move` saw: the source's report, the target's run, and the client's view of the gap."""

    source: dict
    run: ResumeRun
    last_source_event_at: float | None  # time.monotonic() of the source stream's last event with a token (when given)
    first_target_event_at: float | None  # ... of the target stream's first event with a new token

    @property
    def downtime_s(self) -> float | None:
        """The client's gap: the source's last token to the target's first (when the source stream was given).  The
        two streams arrive on two connections: when the target's first token reaches the client before the source's
        last event does, the gap is negative (a few hundred microseconds)."""
        if self.last_source_event_at is None or self.first_target_event_at is None:
            return None
        return self.first_target_event_at - self.last_source_event_at


def move(source_url: str, target_url: str, rid: str, dir: str, *, on_chunk=None, last_source_event_at: Callable[[], float] | None = None,  # noqa: A002
         timeout_s: float = 60.0, api_key: str | None = None, **migrate_kw) -> Migration:
    """Live-migrate ``rid`` from ``source_url`` to ``target_url`` through ``dir``: the target follows first (in a
    thread), then the source migrates; returns once the target's stream ended.  ``last_source_event_at()``: when the
    caller's source stream got its last token (for :attr:`Migration.downtime_s`).  A refusal of the source is raised
    once the target's follow has ended too (the source tells it, by ``abandoned.json``): ``follow_error`` on the
    exception is the target's side of it."""
    import threading
    import time

    got: dict = {}
    first: list = []

    def chunk(r, text, ids, event):
        if ids and not first:
            first.append(time.monotonic())
        if on_chunk is not None:
            on_chunk(r, text, ids, event)

    def target():
        try:
            got["run"] = follow(target_url, dir, rid=rid, on_chunk=chunk, timeout_s=timeout_s, api_key=api_key)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            got["error"] = e

    t = threading.Thread(target=target, name="hsnap-follow", daemon=True)
    t.start()
    try:
        report = migrate(source_url, rid, dir, timeout_s=timeout_s, api_key=api_key, **migrate_kw)
    except HsnapError as e:
        t.join(DEFAULT_TIMEOUT_S)  # the source said why in the container: the target's follow ends with it
        e.follow_error = got.get("error")  # type: ignore[attr-defined]  # on whichever HsnapError: see the docstring
        raise
    t.join(DEFAULT_TIMEOUT_S)
    if "error" in got:
        raise got["error"]
    return Migration(report, got["run"], last_source_event_at() if last_source_event_at is not None else None, first[0] if first else None)


def _cli_url(text: str) -> str:
    try:
        return server_url(text)
    except HsnapError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``p``'s arguments plus ``--api-key`` (every command calls admin routes)."""
    p.add_argument("--api-key", default=None, metavar="KEY", help=f"the server's admin key (else its API key), sent as a Bearer "
                   f"token; default ${API_KEY_ENV} (which, unlike an argument, other users cannot see)")
    p.add_argument("--wide", action="store_true", help="lines as long as they are, whole paths (default: 80 columns)")
    return p.parse_args(argv)


def _printers(args) -> tuple[Printer, Printer]:
    """Standard output and standard error, 80 columns unless ``--wide``."""
    return Printer(wide=args.wide), Printer(wide=args.wide, file=sys.stderr)


def report_items(info) -> list:
    """The resume report as a list of ``{path, ok, result | error}`` (one snapshot: a list of one)."""
    return info if isinstance(info, list) else [info] if info else []


def pause_main(argv) -> int:
    """export one live request of a server: hsnap pause URL RID -o PATH"""
    p = argparse.ArgumentParser(prog="hsnap pause", description="Export one live request of a server (hsnap plug-in) at its "
                                "next committed decode boundary; its slots are released and its client's stream ends with "
                                "finish_reason hsnap_export (--keep-running: a checkpoint, the request keeps decoding).")
    p.add_argument("url", type=_cli_url, help="the server: http://host:port, or host:port")
    p.add_argument("rid", help="the request id")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="the snapshot path on the server's machine, or s3://"
                   "; a relative one is relative to the server's --hsnap-root, not to this shell")
    p.add_argument("--keep-running", action="store_true", help="snapshot and keep decoding (nothing released)")
    p.add_argument("--json", action="store_true", help="the server's report as JSON")
    args = _parse(p, argv)
    say, err = _printers(args)
    try:
        out = pause(args.url, args.rid, args.output, keep_running=args.keep_running, api_key=args.api_key)
    except HsnapError as e:
        return _fail("pause", e)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    t = out.get("timings", {})
    say.line(f"{'checkpointed' if out.get('keep_running') else 'paused'} {escape_text(out['rid'])}: {out['committed_positions']} committed positions, {out['prompt_tokens']} prompt + "
             f"{out['output_tokens']} output tokens -> {_where(args.output, out['path'])} ({out['bytes']} bytes, snapshot {out['snapshot_id']})")
    say.line(f"pause-to-durable {t.get('pause_to_durable_s', 0) * 1e3:.1f} ms (waited {t.get('wait_s', 0) * 1e3:.1f} ms for the boundary, "
             f"wrote in {t.get('write_s', 0) * 1e3:.1f} ms); {'still running (checkpoint)' if out.get('keep_running') else 'slots released'}")
    return 0


def resume_main(argv) -> int:
    """resume a snapshot in a server and print the rest: hsnap resume URL PATH"""
    p = argparse.ArgumentParser(prog="hsnap resume", description="Resume a snapshot (or a drain's directory of snapshots) "
                                "in a server running the hsnap plug-in and print the rest of the stream.  The plan (what is "
                                "resumed, what is refused) goes to stderr first; several requests print whole lines labelled "
                                "[rid], or one file each with --output-dir.  Ctrl-C pauses each request still running back into "
                                "a snapshot beside the one it came from (<name>.interrupted.hsnap) and says where.")
    p.add_argument("url", type=_cli_url, help="the server: http://host:port, or host:port")
    p.add_argument("path", help="a snapshot path on the server's machine, a directory of "
                   "snapshots, or s3://; a relative one is relative to the server's --hsnap-root, not to this shell")
    p.add_argument("--again", action="store_true", help="resume a snapshot that was resumed before (a duplicate continuation)")
    p.add_argument("--json", action="store_true", help="every event as one JSON line")
    p.add_argument("--output-dir", metavar="DIR", default=None, help="write each request's text to DIR/<rid>.txt on this "
                   "machine (progress on stderr) instead of stdout")
    p.add_argument("--on-interrupt", choices=("pause", "abort"), default="pause", help="what Ctrl-C does to the requests "
                   "still running: pause each back into a snapshot (default), or abort it (the server ends it; its output "
                   "since the snapshot is lost)")
    args = _parse(p, argv)
    say, err = _printers(args)
    view = _ResumeView(args, err)
    try:
        run = resume(args.url, args.path, on_chunk=view.chunk, on_start=view.plan, again=args.again, api_key=args.api_key,
                     on_interrupt=(lambda r: pause_back(args.url, r, api_key=args.api_key)) if args.on_interrupt == "pause" else None)
    except KeyboardInterrupt:  # --on-interrupt abort: the stream closes, the server aborts what was still running
        view.close()
        err.line(f"hsnap resume: interrupted: the server aborts the requests still running as their stream closes; each "
                 f"snapshot stays claimed (--again resumes it from its own position): {escape_text(args.path)}")
        return 130
    except HsnapError as e:
        view.close()
        return _fail("resume", e)
    view.close()
    if not args.json:
        for rid, res in run.results.items():
            meta = run.finals.get(rid, {}).get("meta_info", {})
            err.line(f"resumed {escape_text(rid)} from {escape_text(res['path'])}: {res['committed_positions']} committed positions "
                     f"({res['bytes_uploaded']} bytes uploaded, restore {res['timings']['restore_s'] * 1e3:.1f} ms); "
                     f"{meta.get('completion_tokens')} output tokens, finish {json.dumps(meta.get('finish_reason'))}")
    if run.interrupted is not None:
        _say_interrupted(args.url, run.interrupted, err)
        return 130
    for rid, why in run.aborted.items():  # a continuation cut short is a failure, whatever the HTTP status said
        err.line(f"hsnap resume: {escape_text(rid)} ended aborted, not finished: {escape_text(json.dumps(why))}")
    return 1 if run.aborted else 0


def _say_interrupted(url: str, interrupted: dict, err: Printer) -> None:
    """What Ctrl-C made of each request still running: where it was paused back to, or why it was not."""
    if not interrupted:
        err.line("hsnap resume: interrupted: every request had ended")
    for rid, out in interrupted.items():
        if "error" in out:
            e = out["error"]
            kind = e.error_type if isinstance(e, ServerError) else type(e).__name__
            err.line(f"interrupted: {escape_text(rid)} not paused: {kind}: {escape_text(str(e))}")
            continue
        err.line(f"interrupted: {escape_text(rid)} paused at {out.get('output_tokens')} output tokens "
                 f"({out.get('committed_positions')} committed positions) -> {escape_text(out['path'])}; continue it with: "
                 f"hsnap resume {url} {escape_text(out['path'])}")


def _safe_file_name(rid: str) -> str:
    """``rid`` as a file name on this machine: unsafe characters replaced, and then its hash appended (two rids
    never share a file)."""
    import hashlib

    safe = re.sub(r"[^A-Za-z0-9._-]", "_", rid)[:100].lstrip(".") or "_"
    return safe if safe == rid else f"{safe}-{hashlib.sha256(rid.encode()).hexdigest()[:12]}"


class _ResumeView:
    """``hsnap resume``'s output: the plan on stderr first; one request streamed as it comes; several as whole lines
    labelled ``[rid]`` (or one file each under ``--output-dir``), each one's end reported as it ends."""

    def __init__(self, args, err: Printer) -> None:
        self.args, self.err = args, err
        self.many = False
        self.partial: dict[str, str] = {}  # rid -> the text after its last newline (several requests on one stdout)
        self.files: dict[str, Any] = {}
        self.ended: set[str] = set()
        self.count = 0

    def plan(self, info) -> None:
        items = report_items(info)
        ok = [i for i in items if i.get("ok")]
        self.count = len(ok) if items and not (isinstance(info, dict) and info.get("truncated")) else int((info or {}).get("resumed", 0))
        self.many = isinstance(info, list) or bool(isinstance(info, dict) and info.get("truncated")) or self.args.output_dir is not None
        if self.args.output_dir is not None:
            os.makedirs(self.args.output_dir, exist_ok=True)
        if isinstance(info, dict) and info.get("truncated"):
            self.err.line(f"resuming {self.count} snapshots from {escape_text(self.args.path)} (too many to list)")
            return
        if self.many:
            self.err.line(f"resuming {len(ok)} of {len(items)} snapshots in {escape_text(self.args.path)}:")
        for i in items:
            if i.get("ok"):
                res = i["result"]
                self.err.line(f"{'  ' if self.many else 'resuming '}{escape_text(res['rid'])} from {escape_text(res['path'])}: "
                              f"{res['committed_positions']} committed positions")
            else:
                err = i.get("error", {})
                self.err.line(f"{'  ' if self.many else ''}not resumed {escape_text(i.get('path'))}: {err.get('type')}: "
                              f"{escape_text(err.get('message'))}")

    def chunk(self, rid, text, ids, event) -> None:
        if self.args.json:
            print(json.dumps(event), flush=True)
        elif self.args.output_dir is not None:
            f = self.files.get(rid)
            if f is None:
                f = self.files[rid] = open(os.path.join(self.args.output_dir, _safe_file_name(rid) + ".txt"), "a", encoding="utf-8")
            f.write(text)
            f.flush()
        elif self.many:
            lines = (self.partial.pop(rid, "") + text).split("\n")
            for line in lines[:-1]:
                print(f"[{escape_text(rid)}] {line}", flush=True)
            self.partial[rid] = lines[-1]
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
        finish = (event.get("meta_info") or {}).get("finish_reason")
        if finish and rid not in self.ended:
            self.ended.add(rid)
            self._end(rid, event, finish)

    def _end(self, rid, event, finish) -> None:
        if rid in self.partial:
            print(f"[{escape_text(rid)}] {self.partial.pop(rid)}", flush=True)
        f = self.files.pop(rid, None)
        if f is not None:
            f.close()
        if self.many and not self.args.json:
            where = f" -> {os.path.join(self.args.output_dir, _safe_file_name(rid) + '.txt')}" if self.args.output_dir else ""
            self.err.line(f"[{escape_text(rid)}] ended ({len(self.ended)} of {self.count}): "
                          f"{(event.get('meta_info') or {}).get('completion_tokens')} output tokens, finish {json.dumps(finish)}{where}")

    def close(self) -> None:
        for rid, rest in self.partial.items():
            if rest:
                print(f"[{escape_text(rid)}] {rest}", flush=True)
        self.partial.clear()
        for f in self.files.values():
            f.close()
        self.files.clear()
        if not self.many and not self.args.json:
            print(file=sys.stdout)


def drain_main(argv) -> int:
    """export every request of a server: hsnap drain URL -o DIR [--dedup]"""
    p = argparse.ArgumentParser(prog="hsnap drain", description="Export every request of a server running the hsnap plug-in "
                                "(graceful shutdown for a rolling upgrade); `hsnap resume URL DIR` brings them back.")
    p.add_argument("url", type=_cli_url, help="the server: http://host:port, or host:port")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="a directory on the server's machine, or s3://bucket/prefix"
                   "; a relative one is relative to the server's --hsnap-root, not to this shell")
    p.add_argument("--dedup", action="store_true", help="store shared full pages (a system prompt) once, in DIR/pages (format 1.3)")
    p.add_argument("--page-size", type=int, default=None, metavar="N", help="positions per stored page with --dedup (default 64)")
    p.add_argument("--json", action="store_true")
    args = _parse(p, argv)
    say, err = _printers(args)
    try:
        with _Progress(args.url, args.api_key, _drain_progress, err, quiet=args.json):
            out = drain(args.url, args.output, dedup=args.dedup, page_size=args.page_size, api_key=args.api_key)
    except HsnapError as e:
        return _fail("drain", e)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for item in out.get("items", []):
            if item["ok"]:
                res = item["result"]
                say.line(f"drained {escape_text(item['rid'])} -> {escape_text(item['path'])} ({res['committed_positions']} committed positions, "
                         f"{res['bytes']} bytes)")
            else:
                err = item["error"]
                err.line(f"not drained {escape_text(item['rid'])}: {err.get('type')}: {escape_text(err.get('message'))}")
        if not out.get("items"):
            say.line(f"nothing to drain: no request was running, queued or being prefilled; nothing written to "
                     f"{_where(args.output, out.get('dir'))}")
        else:
            say.line(f"{len(out['items'])} requests, {'all exported' if out.get('ok', True) else 'some refused'} into "
                     f"{_where(args.output, out.get('dir'))}")
        d = out.get("dedup")
        if d:
            say.line(f"dedup: {d['bytes_written']} bytes written ({d['pages_put']} pages put, {d['pages_reused']} reused) "
                     f"against {d['single_bytes']} bytes of single snapshots")
    return 0 if out.get("ok", True) else 1


def checkpoint_main(argv) -> int:
    """checkpoint a live request every N tokens: hsnap checkpoint URL RID -o DIR --every N"""
    p = argparse.ArgumentParser(prog="hsnap checkpoint", description="Checkpoint one live request of a server (hsnap plug-in) "
                                "now and every N output tokens while it keeps decoding: a chain of links in DIR; after a crash "
                                "`hsnap resume URL DIR` resumes the newest committed link.")
    p.add_argument("url", type=_cli_url, help="the server: http://host:port, or host:port")
    p.add_argument("rid", help="the request id")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="a directory on the server's machine, or s3://bucket/prefix"
                   "; a relative one is relative to the server's --hsnap-root, not to this shell")
    p.add_argument("--every", type=int, required=True, metavar="N", help="output tokens between links (0: stop checkpointing)")
    p.add_argument("--json", action="store_true", help="the server's report as JSON")
    args = _parse(p, argv)
    say, err = _printers(args)
    try:
        out = checkpoint(args.url, args.rid, args.output, every=args.every, api_key=args.api_key)
    except HsnapError as e:
        return _fail("checkpoint", e)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    elif out.get("stopped"):
        say.line(f"stopped checkpointing {escape_text(args.rid)}: {out['links']} links, last {escape_text(str(out['last']))}")
    else:
        say.line(f"checkpointing {escape_text(out['rid'])} every {out['every']} output tokens into {_where(args.output, out['dir'])}: first link "
                 f"{escape_text(out['path'])} ({out['committed_positions']} committed positions, {out['bytes']} bytes)")
    return 0


def migrate_main(argv) -> int:
    """live-migrate a request between servers: hsnap migrate URL RID --to URL2 --via DIR"""
    p = argparse.ArgumentParser(prog="hsnap migrate", description="Live-migrate one request from a server to another (both "
                                "running the hsnap plug-in) through a directory both reach or s3://: the target follows, the "
                                "source pre-copies while the request decodes, then stops it for the last few rows and its "
                                "recurrent state; the rest of the stream is printed from the target.")
    p.add_argument("source", type=_cli_url, help="the server the request runs in: http://host:port, or host:port")
    p.add_argument("rid", help="the request id")
    p.add_argument("--to", required=True, metavar="URL", type=_cli_url, help="the target server: http://host:port, or host:port")
    p.add_argument("--via", required=True, metavar="DIR", help="the migration's container: a fresh directory both servers "
                   "reach, or s3://; a relative one is relative to the server's --hsnap-root, not to this shell")
    p.add_argument("--tail", type=int, default=16, help="stop the request once at most this many rows are left (default 16)")
    p.add_argument("--max-rounds", type=int, default=8, help="pre-copy rounds at most (default 8)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds either side waits for the other's next step")
    p.add_argument("--relay", action="store_true", help="the source relays the target's stream into the request's own "
                   "(its client's stream goes on; the target must be among the source's --hsnap-allow-peer): only the "
                   "source's report is printed")
    p.add_argument("--json", action="store_true", help="both reports as JSON (no text)")
    args = _parse(p, argv)
    say, err = _printers(args)
    if args.relay:
        return _migrate_relayed(args, err)

    def show(rid, text, ids, event):
        if not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()

    try:
        with _Progress(args.source, args.api_key, lambda st: _migrate_progress(st, args.rid), err, quiet=args.json):
            mig = move(args.source, args.to, args.rid, args.via, on_chunk=show, tail=args.tail, max_rounds=args.max_rounds,
                       timeout_s=args.timeout, api_key=args.api_key)
    except HsnapError as e:
        return _fail("migrate", e)
    src, info = mig.source, mig.run.info or {}
    if args.json:
        print(json.dumps({"source": src, "target": info}, indent=2, sort_keys=True))
        return 0
    t = src.get("timings", {})
    meta = mig.run.final.get("meta_info", {})
    print(file=sys.stdout)
    err.line(f"migrated {escape_text(src['rid'])} via {escape_text(src['dir'])}: {len(src['rounds'])} pre-copy rounds "
             f"({src['precopy_bytes']} bytes) while it decoded, then {src['final_rows']} rows + state in the final link "
             f"({src['final_bytes']} bytes, written in {(t.get('final_capture_s', 0) + t.get('final_write_s', 0)) * 1e3:.1f} ms); "
             f"target applied {len(info.get('links', []))} links; {meta.get('completion_tokens')} output tokens, finish "
             f"{json.dumps(meta.get('finish_reason'))}")
    stopped = t.get("final_capture_s", 0) + t.get("final_write_s", 0) + (info.get("timings") or {}).get("final_apply_s", 0)
    err.line(f"downtime: the request was stopped {stopped * 1e3:.1f} ms for the final link (capture and write at the source, "
             f"apply at the target), then admitted at the target")
    return 0


def _migrate_relayed(args, err) -> int:
    """``hsnap migrate --relay``: the source's report (the request's own client keeps its stream)."""
    try:
        with _Progress(args.source, args.api_key, lambda st: _migrate_progress(st, args.rid), err, quiet=args.json):
            src = migrate(args.source, args.rid, args.via, tail=args.tail, max_rounds=args.max_rounds, timeout_s=args.timeout,
                          relay_to=args.to, api_key=args.api_key)
    except HsnapError as e:
        return _fail("migrate", e)
    if args.json:
        print(json.dumps({"source": src}, indent=2, sort_keys=True))
        return 0
    t = src.get("timings", {})
    err.line(f"migrated {escape_text(src['rid'])} via {escape_text(src['dir'])} to {escape_text((src.get('relay') or {}).get('target', '?'))}: "
             f"{len(src['rounds'])} pre-copy rounds ({src['precopy_bytes']} bytes), then {src['final_rows']} rows + state in the "
             f"final link ({(t.get('final_capture_s', 0) + t.get('final_write_s', 0)) * 1e3:.1f} ms); its client's stream goes on "
             f"through the source")
    return 0


class _Progress:
    """While a long call runs: the server's ``/hsnap/stats`` polled every ``every`` seconds in a thread, and one
    line on stderr each time what ``render`` makes of it changes (None: nothing to say).  A poll that fails is
    skipped: progress is a courtesy, the call's own answer is what counts."""

    def __init__(self, url: str, api_key: str | None, render: Callable[[dict], str | None], err, *, every: float = 0.5,
                 quiet: bool = False) -> None:
        import threading

        self.url, self.api_key, self.render, self.err, self.every, self.quiet = url, api_key, render, err, every, quiet
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hsnap-progress", daemon=True)
        self.last: str | None = None

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                said = self.render(stats(self.url, timeout=10.0, api_key=self.api_key))
            except (HsnapError, KeyError, TypeError, ValueError):
                continue
            if said and said != self.last and not self.stopped.is_set():
                self.last = said
                self.err.line(said)

    def __enter__(self) -> "_Progress":
        if not self.quiet:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(15.0)


def _drain_progress(st: dict) -> str | None:
    requests = st.get("requests") or {}
    left = {*requests.get("pending_exports", ()), *requests.get("writing", ()), *requests.get("parked", ())}
    return f"draining: {len(left)} request{'' if len(left) == 1 else 's'} still to export" if left else None


def _migrate_progress(st: dict, rid: str) -> str | None:
    m = (st.get("migrations") or {}).get(rid)
    return f"migrating {escape_text(rid)}: pre-copy round {m['rounds']} while it decodes" if m else None


def _where(given: str, answered: str | None) -> str:
    """The path the server used, and — for a relative one the user gave — that it was taken beneath the server's
    snapshot root (not this shell's working directory)."""
    if "://" in given or os.path.isabs(given):
        return escape_text(str(answered or given))
    if answered and answered != given:
        return f"{escape_text(answered)} (the relative path {escape_text(given)} taken beneath the server's snapshot root)"
    return f"{escape_text(given)} (relative: beneath the server's snapshot root)"


LS_COLUMNS = (("RID", 20), ("STATE", 10), ("PROMPT", 6), ("OUTPUT", 6), ("COMMITTED", 9), ("HSNAP", 24))  # 80 columns


def requests(url: str, *, timeout: float = 60.0, api_key: str | None = None) -> list:
    """The server's requests now, one dict each: ``rid``, ``state`` (running, parked, writing, prefilling, waiting),
    ``prompt_tokens``, ``output_tokens``, ``committed_positions`` (None before its first decode), ``checkpoint``
    (``dir``, ``every``, ``links``) and ``migration`` (``dir``, ``rounds``), None when not."""
    return list(stats(url, timeout=timeout, api_key=api_key).get("table") or [])


def ls_main(argv) -> int:
    """list the requests of a server: hsnap ls URL"""
    p = argparse.ArgumentParser(prog="hsnap ls", description="List the requests of a server running the hsnap plug-in: "
                                "where each one is (running, waiting, prefilling...), its tokens, the positions its KV "
                                "rows hold, and whether it is checkpointed or migrating (an admin route, like the others).")
    p.add_argument("url", type=_cli_url, help="the server: http://host:port, or host:port")
    p.add_argument("--json", action="store_true", help="the rows as JSON (the keys of hsnap_sglang.client.requests)")
    args = _parse(p, argv)
    say, err = _printers(args)
    try:
        rows = requests(args.url, api_key=args.api_key)
    except HsnapError as e:
        return _fail("ls", e)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    if not rows:
        say.line(f"no request in {args.url}")
        return 0

    def hsnap_state(row: dict) -> str:
        ck, mig = row.get("checkpoint"), row.get("migration")
        if mig:
            return f"migrating r{mig['rounds']} {mig['dir']}"
        return f"ckpt {ck['links']}/{ck['every']} {ck['dir']}" if ck else "-"

    for cells in [[name for name, _ in LS_COLUMNS]] + [
            [escape_text(r["rid"]), r["state"], str(r["prompt_tokens"]), str(r["output_tokens"]),
             "-" if r.get("committed_positions") is None else str(r["committed_positions"]), escape_text(hsnap_state(r))] for r in rows]:
        print(" ".join(c.ljust(w) if args.wide else elide_end(c, w).ljust(w) for c, (_, w) in zip(cells, LS_COLUMNS)).rstrip())
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    say.line(f"{len(rows)} requests: " + ", ".join(f"{n} {state}" for state, n in states.items()))
    return 0


def _fail(cmd: str, e: HsnapError) -> int:
    kind = e.error_type if isinstance(e, ServerError) else type(e).__name__
    print(f"hsnap {cmd}: {kind}: {escape_text(str(e))}", file=sys.stderr)
    return 1
