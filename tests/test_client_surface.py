"""The client as its user meets it: a refusal read as one sentence that names it once (no repeated expected/found
pair, no ``<memory>`` for a refusal about a request), a server without the plug-in named as such, an unknown rid
answered with the rids the server has; a server named as curl takes it (``host:port``, a trailing ``/``); a
``--keep-running`` pause reported as a checkpoint."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hsnap_format import SnapshotExistsError
from hsnap_format.errors import Phrase
from hsnap_format import HsnapError
from hsnap_sglang import client
from hsnap_sglang.errors import MAX_RIDS_NAMED, RequestFinishedError, error_dict, unknown_request

URL = "http://127.0.0.1:30000"


def relayed(e: Exception, status: int, route: str = "/hsnap/export") -> str:
    """The client's text of ``e`` as the server sends it (its error dict over HTTP)."""
    return str(client.ServerError(URL + route, status, json.loads(json.dumps(error_dict(e)))))


def test_a_relayed_refusal_names_expected_and_found_once_without_a_memory_path():
    e = RequestFinishedError(None, "rid", Phrase("a request still running in this server"), Phrase("finished (length)"))
    text = relayed(e, 409)
    assert text.startswith(f"{URL}/hsnap/export: RequestFinishedError (HTTP 409): rid: ")
    assert text.count("expected") == 1 and text.count("finished (length)") == 1, text
    assert "<memory>" not in text and "<memory>" not in str(e)


def test_a_relayed_refusal_about_a_file_names_the_file_once():
    e = SnapshotExistsError("/srv/snaps/x.hsnap", "path", Phrase("no file or directory"), Phrase("one exists"))
    text = relayed(e, 409)
    assert text.count("/srv/snaps/x.hsnap") == 1 and text.count("expected no file or directory") == 1, text


def test_an_unknown_rid_is_answered_with_the_rids_here_and_the_closest():
    e = unknown_request("req-4", ["req-1", "chat-77", "req-40"], "a request running here")
    assert e.found == "req-4" and "here: req-1, chat-77, req-40" in str(e) and "did you mean 'req-40'?" in str(e), str(e)
    many = unknown_request("x", [f"r{i}" for i in range(MAX_RIDS_NAMED + 5)], "a request running here")
    assert "and 5 more" in str(many) and f"r{MAX_RIDS_NAMED}," not in str(many)
    none = unknown_request("x", [], "a request running here")
    assert "no request is running" in str(none) and "did you mean" not in str(none)
    assert relayed(e, 404).count("req-40") == 2  # listed, and offered


EXPORTED = {"rid": "r1", "committed_positions": 41, "prompt_tokens": 30, "output_tokens": 12, "path": "/srv/r1.hsnap",
            "bytes": 123, "snapshot_id": "s-1", "timings": {}}


class _JsonHandler(BaseHTTPRequestHandler):
    """A stand-in server's handler: JSON answers, no access log."""

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _NoPlugin(_JsonHandler):
    """SGLang's server without the plug-in: FastAPI's 404 for a route it does not have."""

    def _not_found(self):
        self.answer(404, b'{"detail":"Not Found"}')

    do_GET = do_POST = _not_found


class _Exporting(_JsonHandler):
    """A plug-in's /hsnap/export that answers every export as done, echoing ``keep_running``; its /hsnap/drain finds
    nothing to drain."""

    def do_POST(self):
        got = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = {"ok": True, "items": [], "requests": 0, "dir": "/srv/root/drained"} if self.path == "/hsnap/drain" else dict(
            EXPORTED, keep_running=got["keep_running"], seen_path=self.path)
        body = json.dumps(answer).encode()
        self.answer(200, body)


def _serve(handler):
    httpd = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def no_plugin():
    httpd = _serve(_NoPlugin)
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.fixture
def exporting():
    httpd = _serve(_Exporting)
    yield f"127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def test_a_server_without_the_plugin_is_named_as_such(no_plugin):
    with pytest.raises(client.ServerError) as e:
        client.stats(no_plugin)
    assert e.value.status == 404 and e.value.error_type == "NoHsnapRoutes"
    assert f"no hsnap routes at {no_plugin}" in str(e.value) and "--enable-hsnap" in str(e.value)


@pytest.mark.parametrize("given,url", [("127.0.0.1:30000", "http://127.0.0.1:30000"), ("http://h:1/", "http://h:1"),
                                       ("https://h.example/", "https://h.example"), (" localhost:8 ", "http://localhost:8")])
def test_a_server_is_named_as_curl_takes_it(given, url):
    assert client.server_url(given) == url


@pytest.mark.parametrize("given", ["ftp://h:1", "http://", "file:///etc"])
def test_other_schemes_are_refused_typed(given):
    with pytest.raises(HsnapError) as e:
        client.server_url(given)
    assert e.value.field == "url"


def said(capsys) -> str:
    """What the command printed, its lines within 80 columns (asserted), as one line of words."""
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    return " ".join(out.split())


def test_the_cli_takes_host_port_and_reports_a_kept_running_pause_as_a_checkpoint(exporting, capsys):
    assert client.pause_main([exporting + "/", "r1", "-o", "r1.hsnap", "--keep-running"]) == 0
    out = said(capsys)
    assert out.startswith("checkpointed r1: 41 committed positions") and "still running" in out
    assert client.pause_main([exporting, "r1", "-o", "r1.hsnap"]) == 0
    assert capsys.readouterr().out.startswith("paused r1: ")
    with pytest.raises(SystemExit) as e:
        client.pause_main(["ftp://x", "r1", "-o", "r1.hsnap"])
    assert e.value.code == 2 and "http://host:port" in capsys.readouterr().err


def test_an_idle_drain_says_there_was_nothing_to_drain(exporting, capsys):
    assert client.drain_main([exporting, "-o", "drained"]) == 0
    assert said(capsys) == ("nothing to drain: no request was running, queued or being prefilled; nothing "
                                               "written to /srv/root/drained (the relative path drained taken beneath the "
                                               "server's snapshot root)")


def test_an_answer_to_a_relative_path_says_where_the_server_put_it(exporting, capsys):
    assert client.pause_main([exporting, "r1", "-o", "r1.hsnap"]) == 0
    assert "-> /srv/r1.hsnap (the relative path r1.hsnap taken beneath the server's snapshot root)" in said(capsys)
    assert client.pause_main([exporting, "r1", "-o", "/srv/r1.hsnap"]) == 0
    out = said(capsys)
    assert "-> /srv/r1.hsnap (" in out and "relative" not in out
    assert client.pause_main([exporting, "r1", "-o", "r1.hsnap", "--wide"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) > 80  # --wide: each report on one line


@pytest.mark.parametrize("entry,n,expected", [
    ("/s/req-4.hsnap", 1, "/s/req-4.interrupted.hsnap"),
    ("/s/req-4.hsnap", 3, "/s/req-4.interrupted-3.hsnap"),
    ("/s/req-4.interrupted.hsnap", 2, "/s/req-4.interrupted-2.hsnap"),  # a pause of a pause: one suffix, the next number
    ("/s/req-4.interrupted-2.hsnap", 1, "/s/req-4.interrupted.hsnap"),
    ("/s/ck/r.ck000003.hsnap", 1, "/s/ck/r.ck000003.interrupted.hsnap"),
    ("/s/drained/req-4", 1, "/s/drained/req-4.interrupted"),  # a TP set directory
    ("s3://b/p/x.hsnap", 1, "s3://b/p/x.interrupted.hsnap"),
])
def test_a_request_paused_back_on_ctrl_c_lands_beside_its_snapshot(entry, n, expected):
    assert client.interrupted_path(entry, n) == expected


def test_every_server_path_option_says_what_a_relative_path_is_relative_to(capsys):
    for main in (client.pause_main, client.resume_main, client.drain_main, client.checkpoint_main, client.migrate_main):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert "relative to the server's --hsnap-root" in " ".join(capsys.readouterr().out.split()), main.__name__


ROWS = [{"rid": "req-" + "x" * 40, "state": "running", "prompt_tokens": 20, "output_tokens": 7, "committed_positions": 26,
         "checkpoint": {"dir": "/srv/root/" + "ck" * 30, "every": 4, "links": 3}, "migration": None},
        {"rid": "req-2", "state": "waiting", "prompt_tokens": 9, "output_tokens": 0, "committed_positions": None,
         "checkpoint": None, "migration": None}]


class _Listing(_JsonHandler):
    """A plug-in's /hsnap/stats with two requests, or none for the key ``empty``."""

    def do_GET(self):
        body = json.dumps({"table": [] if self.headers.get("Authorization") == "Bearer empty" else ROWS}).encode()
        self.answer(200, body)


def test_hsnap_ls_fits_80_columns_and_says_what_each_request_is(capsys):
    httpd = _serve(_Listing)
    url = f"127.0.0.1:{httpd.server_port}"
    try:
        assert client.ls_main([url]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert all(len(line) <= 80 for line in lines), lines
        assert lines[1].split()[1:5] == ["running", "20", "7", "26"] and "ckpt 3/4 /srv/root/" in lines[1] and "…" in lines[1]
        assert lines[2].split() == ["req-2", "waiting", "9", "0", "-", "-"]
        assert lines[-1] == "2 requests: 1 running, 1 waiting"
        assert client.ls_main([url, "--wide"]) == 0
        assert "req-" + "x" * 40 in capsys.readouterr().out
        assert client.ls_main([url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == ROWS
        assert client.ls_main([url, "--api-key", "empty"]) == 0
        assert capsys.readouterr().out.strip() == f"no request in http://{url}"
    finally:
        httpd.shutdown()


class _SlowDrain(_JsonHandler):
    """A drain that takes a while: its stats show two exports pending, then one, then none; the drain answers once
    the stats were asked for four times."""

    polls = 0

    def _json(self, answer: dict) -> None:
        self.answer(200, json.dumps(answer).encode())

    def do_GET(self):
        type(self).polls += 1
        pending = [["a", "b"], ["b"], []][min(type(self).polls - 1, 2)]
        self._json({"requests": {"pending_exports": pending, "writing": [], "parked": []}})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        deadline = time.monotonic() + 30
        while type(self).polls < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        self._json({"ok": True, "dir": "/srv/d", "requests": 2, "items": [
            {"rid": r, "path": f"/srv/d/{r}.hsnap", "ok": True, "result": {"committed_positions": 9, "bytes": 10}} for r in "ab"]})


def test_a_drain_shows_its_progress_on_stderr_while_it_runs(capsys):
    from http.server import ThreadingHTTPServer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SlowDrain)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert client.drain_main([f"127.0.0.1:{httpd.server_port}", "-o", "/srv/d"]) == 0
    finally:
        httpd.shutdown()
    got = capsys.readouterr()
    progress = [line for line in got.err.splitlines() if line.startswith("draining:")]
    assert progress == ["draining: 2 requests still to export", "draining: 1 request still to export"], got.err
    assert "2 requests, all exported into /srv/d" in got.out


class _HandingOff(_JsonHandler):
    """/generate streams two events, the second ending the request with its snapshot (a drain); every /hsnap/resume
    is refused as already claimed, and the request is not held for an attach either."""

    resumes: list = []
    attaches: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/hsnap/resume":
            type(self).resumes.append(body["path"])
            return self.answer(409, json.dumps({"error": {"type": "SnapshotClaimedError", "message": "claimed"}}).encode())
        if self.path == "/hsnap/attach":  # claimed by another client: this server does not hold it
            type(self).attaches.append(body["rid"])
            return self.answer(404, json.dumps({"error": {"type": "UnknownRequestError", "message": "not held"}}).encode())
        events = [{"text": "Hel", "output_ids": [1], "meta_info": {"id": "r", "finish_reason": None}},
                  {"text": "Hello", "output_ids": [1, 2], "meta_info": {"id": "r", "finish_reason": {"type": "hsnap_export", "path": "/snaps/r.hsnap"}}}]
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_generate_follows_a_hand_off_and_a_refused_one_raises_with_the_run_so_far():
    httpd = _serve(_HandingOff)
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        chunks: list = []
        with pytest.raises(client.ServerError) as e:
            client.generate(url, {"text": "x"}, on_chunk=lambda rid, text, ids, ev: chunks.append((rid, text, ids)))
        assert e.value.error_type == "SnapshotClaimedError" and _HandingOff.resumes == ["/snaps/r.hsnap"]
        assert _HandingOff.attaches == ["r"]  # the server might have resumed it itself: asked once, then the refusal
        run = e.value.run
        assert (run.text, run.output_ids, run.hand_offs) == ("Hello", [1, 2], [(url, "/snaps/r.hsnap")])
        assert chunks == [("r", "Hel", [1]), ("r", "lo", [2])]  # each piece once
        kept = client.generate(url, {"text": "x"}, max_hand_offs=0)  # not followed: the stream's own end
        assert kept.finish_reason == {"type": "hsnap_export", "path": "/snaps/r.hsnap"} and kept.hand_offs == []
        assert _HandingOff.resumes == ["/snaps/r.hsnap"]
    finally:
        httpd.shutdown()
