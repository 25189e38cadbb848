"""What a user reads when the server refuses: one sentence that names the refusal once (no repeated expected/found
pair, no ``<memory>`` for a refusal about a request), a server without the plug-in named as such, and an unknown rid
answered with the rids the server has."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hsnap_format import SnapshotExistsError
from hsnap_format.errors import Phrase
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


class _NoPlugin(BaseHTTPRequestHandler):
    """SGLang's server without the plug-in: FastAPI's 404 for a route it does not have."""

    def _answer(self):
        body = b'{"detail":"Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def no_plugin():
    httpd = HTTPServer(("127.0.0.1", 0), _NoPlugin)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def test_a_server_without_the_plugin_is_named_as_such(no_plugin):
    with pytest.raises(client.ServerError) as e:
        client.stats(no_plugin)
    assert e.value.status == 404 and e.value.error_type == "NoHsnapRoutes"
    assert f"no hsnap routes at {no_plugin}" in str(e.value) and "--enable-hsnap" in str(e.value)
