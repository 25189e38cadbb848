"""A server with the plug-in confines what its clients name, and lets only its admin in (real SGLang servers on CPU).

Two servers for the module, started side by side: K (``--api-key U --admin-api-key A``, a snapshot root, one allowed
``s3://`` prefix) and N (no root configured, no key, loopback).  A third start, on ``0.0.0.0`` with no key, must
refuse.  Every path check happens at the HTTP edge before the scheduler is asked; the scheduler repeats it where it
opens or creates (tests/test_confine.py covers the resolution itself, no server)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from engine_support import retire
from hsnap_support import hsnap_server, start_together

from hsnap_format.tools.cli import main as hsnap
from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ADMIN, USER = "admin-key-A", "user-key-U"


@pytest.fixture(scope="module")
def dirs(work):
    root, outside = work / "root", work / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "evil").symlink_to(outside)  # planted by someone with access to the root: never followed
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def servers(tiny_model_dir, work, dirs):
    keyed = hsnap_server(tiny_model_dir, work / "keyed.log", "--api-key", USER, "--admin-api-key", ADMIN,
                         env={"HSNAP_ROOT": str(dirs["root"]), "HSNAP_ALLOWED_URLS": "s3://allowed/snaps"})
    # started by SGLang's own spawn (hsnap_sglang.serve forks by default): the suite's one HTTP server that is
    rootless = hsnap_server(tiny_model_dir, work / "rootless.log", env={"HSNAP_ROOT": "", "HSNAP_SGLANG_START_METHOD": "spawn"})
    start_together(keyed, rootless)
    yield {"keyed": keyed, "rootless": rootless}
    retire(keyed, rootless)


def call(url: str, route: str, body: dict | None, key: str | None = ADMIN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + route, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def refused(answer: tuple[int, dict], *words: str) -> dict:
    status, body = answer
    err = body.get("error", {})
    assert status == 403 and err.get("type") == "ConfinementError", answer
    assert all(w in err["message"] for w in words), err["message"]
    return err


def everything_under(d) -> list[str]:
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, ds, fs in os.walk(d) for f in ds + fs)


# ----------------------------------------------------------------------------- who may call

def test_admin_key_unlocks_the_hsnap_routes_and_the_user_key_does_not(servers):
    url = servers["keyed"].url
    assert call(url, "/hsnap/stats", None, ADMIN)[0] == 200
    assert call(url, "/hsnap/stats", None, USER)[0] == 401
    assert call(url, "/hsnap/stats", None, None)[0] == 401
    assert call(url, "/hsnap/drain", {"dir": "d"}, USER)[0] == 401
    assert call(url, "/hsnap/resume", {"path": "x.hsnap"}, USER)[0] == 401


def test_cli_sends_the_admin_key(servers, dirs, capsys, monkeypatch):
    url = servers["keyed"].url
    monkeypatch.delenv(client.API_KEY_ENV, raising=False)
    assert hsnap(["drain", url, "-o", "cli-drain"]) == 1 and "Unauthorized" in capsys.readouterr().err
    assert hsnap(["drain", url, "-o", "cli-drain", "--api-key", ADMIN]) == 0
    assert capsys.readouterr().out.startswith("nothing to drain")  # let in: an idle server had nothing to drain
    monkeypatch.setenv(client.API_KEY_ENV, ADMIN)
    assert hsnap(["drain", url, "-o", "cli-drain-env"]) == 0
    assert capsys.readouterr().out.startswith("nothing to drain")


def test_exposed_host_without_a_key_refuses_to_start(tiny_model_dir, work):
    s = hsnap_server(tiny_model_dir, work / "exposed.log", "--host", "0.0.0.0")
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            s.start()
    finally:
        s.stop()
    assert "refusing to enable the plug-in" in s.log_tail() and "--hsnap-allow-unauthenticated" in s.log_tail()


# ----------------------------------------------------------------------------- where paths may lead

def test_relative_drain_dir_lands_under_the_root_and_an_idle_drain_creates_nothing(servers, dirs):
    status, body = call(servers["keyed"].url, "/hsnap/drain", {"dir": "rel/drained"})
    assert status == 200 and body["requests"] == 0, body
    assert body["dir"] == os.path.join(os.path.realpath(dirs["root"]), "rel", "drained")  # where it would have written
    assert not (dirs["root"] / "rel").exists() and not os.path.exists("rel")


def test_absolute_export_outside_the_root_is_refused(servers, dirs):
    target = dirs["outside"] / "x.hsnap"
    refused(call(servers["keyed"].url, "/hsnap/export", {"rid": "r", "path": str(target)}), "beneath the snapshot root")
    assert not target.exists()


@pytest.mark.parametrize("route,body", [
    ("/hsnap/export", {"rid": "r", "path": "../outside/x.hsnap"}),
    ("/hsnap/drain", {"dir": "sub/../../outside/d"}),
    ("/hsnap/checkpoint", {"rid": "r", "dir": "../outside/ck", "every": 4}),
    ("/hsnap/migrate", {"rid": "r", "dir": "../outside/mig"}),
    ("/hsnap/resume", {"path": "../outside"}),
])
def test_dot_dot_is_refused_on_every_route(servers, dirs, route, body):
    refused(call(servers["keyed"].url, route, body), "'..'")
    assert everything_under(dirs["outside"]) == []


@pytest.mark.parametrize("route,body", [
    ("/hsnap/export", {"rid": "r", "path": "evil/x.hsnap"}),
    ("/hsnap/drain", {"dir": "evil/drained"}),
    ("/hsnap/drain", {"dir": "evil"}),
    ("/hsnap/checkpoint", {"rid": "r", "dir": "evil/ck", "every": 4}),
    ("/hsnap/follow", {"dir": "evil/mig", "timeout_s": 1}),
])
def test_planted_symlinked_dir_is_not_followed(servers, dirs, route, body):
    refused(call(servers["keyed"].url, route, body), "evil is a symlink")
    assert everything_under(dirs["outside"]) == []


def test_drain_with_no_request_is_refused_outside_the_root(servers, dirs):
    target = dirs["outside"] / "drained"
    refused(call(servers["keyed"].url, "/hsnap/drain", {"dir": str(target)}), "beneath the snapshot root")
    assert not target.exists()


def test_no_root_configured_is_a_typed_refusal_naming_the_setting(servers, work):
    url = servers["rootless"].url
    for route, body in (("/hsnap/drain", {"dir": str(work / "nr")}), ("/hsnap/export", {"rid": "r", "path": "x.hsnap"}),
                        ("/hsnap/resume", {"path": str(work / "nr.hsnap")})):
        refused(call(url, route, body, None), "--hsnap-root", "HSNAP_ROOT")
    assert not (work / "nr").exists()
    assert call(url, "/hsnap/stats", None, None)[0] == 200  # a route that takes no path still answers


@pytest.mark.parametrize("url", ["s3://other/x.hsnap", "s3://allowed/snapsX/x.hsnap", "s3://allowed/snaps/../x.hsnap"])
def test_url_outside_the_allowed_prefixes_is_refused(servers, url):
    refused(call(servers["keyed"].url, "/hsnap/export", {"rid": "r", "path": url}))


# ----------------------------------------------------------------------------- no file-reading oracle

def test_resume_outside_the_root_gives_no_bytes_and_tells_nothing_apart(servers, dirs):
    fifo = dirs["outside"].parent / "a-fifo"
    os.mkfifo(fifo)  # an open of it would hang: the answer comes at once, as for any other path outside
    answers = [refused(call(servers["keyed"].url, "/hsnap/resume", {"path": p}), "beneath the snapshot root")
               for p in ("/etc/passwd", "/proc/self/environ", "/no/such/file", "/tmp", str(fifo))]
    assert len({(a["field"], a["expected"], a["found"]) for a in answers}) == 1, answers
    assert not any("root:" in json.dumps(a) for a in answers)


def test_resume_of_a_non_snapshot_inside_the_root_does_not_echo_its_bytes(servers, dirs):
    secret = b"zqroot:x:0:0:secret-line:/root:/bin/sh\n"
    (dirs["root"] / "passwd-copy").write_bytes(secret)
    status, body = call(servers["keyed"].url, "/hsnap/resume", {"path": "passwd-copy"})
    assert status == 400 and body["error"]["type"] == "BadMagicError", body
    assert "not the hsnap magic" in body["error"]["message"] and "zqroot" not in json.dumps(body), body
