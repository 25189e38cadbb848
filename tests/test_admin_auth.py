"""Who may call the /hsnap routes, without a server: the start-up refusal on an exposed host with no key, hsnap's own
serve flags, and the key the clients send (a loopback HTTP stub records it)."""

from __future__ import annotations

import http.server
import json
import sys
import threading

import pytest

from hsnap_format.tools.cli import main as hsnap
from hsnap_sglang import auth, client
from hsnap_sglang.serve import early_exposure_refusal, take_hsnap_flags


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_host_needs_no_key(host):
    assert auth.exposure_refusal(host, None, None, env={}) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", None, "10.0.0.5", "example.internal"])
def test_exposed_host_without_a_key_is_refused_at_start(host):
    why = auth.exposure_refusal(host, None, None, env={})
    assert why and "--admin-api-key" in why and "--hsnap-allow-unauthenticated" in why


def test_exposed_host_with_a_key_or_explicit_consent_starts():
    assert auth.exposure_refusal("0.0.0.0", None, "A", env={}) is None
    assert auth.exposure_refusal("0.0.0.0", "U", None, env={}) is None
    assert auth.exposure_refusal("0.0.0.0", None, None, env={auth.ALLOW_UNAUTHENTICATED_ENV: "1"}) is None


def test_key_with_several_tokenizer_workers_protects_nothing():
    # SGLang adds its key middleware in single-tokenizer mode only
    assert auth.exposure_refusal("0.0.0.0", None, "A", tokenizer_workers=2, env={})


def test_serve_refuses_an_exposed_host_before_importing_sglang():
    on = {"HSNAP_SGLANG_PLUGIN": "1"}
    why = early_exposure_refusal(["--model-path", "m", "--host", "0.0.0.0"], on)
    assert why == auth.exposure_refusal("0.0.0.0", None, None, env=on)
    assert early_exposure_refusal(["--host=10.0.0.5"], on)
    assert early_exposure_refusal(["--host", "127.0.0.1", "--host", "0.0.0.0"], on)  # the last one given, as argparse
    assert early_exposure_refusal(["--host", "0.0.0.0", "--host=127.0.0.1"], on) is None
    assert early_exposure_refusal(["--model-path", "m"], on) is None  # SGLang's default host is loopback
    assert early_exposure_refusal(["--host", "0.0.0.0"], {}) is None  # the plug-in is off
    assert early_exposure_refusal(["--host", "0.0.0.0"], {**on, auth.ALLOW_UNAUTHENTICATED_ENV: "1"}) is None
    # a key flag, or a prefix argparse takes for one: the plug-in decides on SGLang's parsed arguments
    for key in (["--api-key", "k"], ["--admin-api-key=k"], ["--admin", "k"], ["--api", "k"]):
        assert early_exposure_refusal(["--host", "0.0.0.0", *key], on) is None


def test_serve_exits_on_an_exposed_host_before_sglang_is_imported(tmp_path):
    import os
    import re
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != auth.ALLOW_UNAUTHENTICATED_ENV}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "hsnap_sglang.serve", "--enable-hsnap", "--model-path",
                           str(tmp_path), "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "refusing to enable the plug-in" in proc.stderr
    imported = re.findall(r"^import time:.*\|\s*([\w.]+)\s*$", proc.stderr, re.M)
    assert "hsnap_sglang.auth" in imported and not [m for m in imported if m.split(".")[0] in ("sglang", "torch")]


def test_serve_flags_become_the_environment_and_leave_sglang_argv(tmp_path):
    env: dict = {}
    argv = take_hsnap_flags(["--enable-hsnap", "--hsnap-root", str(tmp_path), "--model-path", "m", "--hsnap-allow-url=s3://a/p",
                             "--hsnap-allow-url", "s3://b", "--hsnap-allow-unauthenticated", "--port", "1",
                             "--hsnap-allow-peer", "http://10.0.0.2:30000", "--hsnap-allow-peer=http://10.0.0.3:30000"], env)
    assert argv == ["--model-path", "m", "--port", "1"]
    assert env == {"HSNAP_SGLANG_PLUGIN": "1", "HSNAP_ROOT": str(tmp_path), "HSNAP_ALLOWED_URLS": "s3://a/p,s3://b",
                   "HSNAP_ALLOW_UNAUTHENTICATED": "1", "HSNAP_ALLOWED_PEERS": "http://10.0.0.2:30000,http://10.0.0.3:30000"}


def test_serve_help_starts_with_hsnaps_own_flags_then_sglangs(monkeypatch, capsys):
    import runpy

    from hsnap_sglang import cpu, serve

    ran = []
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: ran.append((name, list(sys.argv))))
    monkeypatch.setattr(cpu, "activate", lambda: None)
    for var in ("HSNAP_SGLANG_CPU", "HSNAP_SGLANG_PLUGIN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    serve.main(["--help", "--enable-hsnap"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hsnap_sglang.serve")
    for flag in [*serve.HSNAP_SWITCHES, *serve.HSNAP_VALUE_FLAGS]:
        assert flag in out, flag
    assert ran and ran[0][0] == "sglang.launch_server" and "--help" in ran[0][1]  # SGLang's own options follow
    assert "--enable-hsnap" not in ran[0][1]


def test_serve_refuses_a_root_that_is_not_a_directory(tmp_path):
    with pytest.raises(SystemExit, match="not an existing directory"):
        take_hsnap_flags(["--hsnap-root", str(tmp_path / "missing")], {})


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        self.seen.append(self.headers.get("Authorization"))
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Authorization") != "Bearer sekrit":
            body, code = b'{"error": "Unauthorized"}', 401  # SGLang's middleware answers so
        else:
            body, code = json.dumps({"error": {"type": "UnknownRequestError", "status": 404, "message": "no such rid"}}).encode(), 404
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *a):
        pass


@pytest.fixture
def stub():
    _Recorder.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("argv", [
    ["pause", "{url}", "r", "-o", "x.hsnap"], ["resume", "{url}", "x.hsnap"], ["drain", "{url}", "-o", "d"],
    ["checkpoint", "{url}", "r", "-o", "d", "--every", "4"],
])
def test_cli_sends_the_key_from_its_flag_or_the_environment(stub, argv, capsys, monkeypatch):
    monkeypatch.delenv(client.API_KEY_ENV, raising=False)
    args = [a.format(url=stub) for a in argv]
    assert hsnap(args + ["--api-key", "sekrit"]) == 1  # the stub's 404: the key got through
    assert "UnknownRequestError" in capsys.readouterr().err
    monkeypatch.setenv(client.API_KEY_ENV, "sekrit")
    assert hsnap(args) == 1 and "UnknownRequestError" in capsys.readouterr().err
    monkeypatch.delenv(client.API_KEY_ENV)
    assert hsnap(args) == 1
    err = capsys.readouterr().err
    assert "Unauthorized" in err and "--api-key" in err and client.API_KEY_ENV in err
    assert _Recorder.seen == ["Bearer sekrit", "Bearer sekrit", None]


def test_migrate_sends_the_key_to_both_servers(stub, monkeypatch):
    monkeypatch.setenv(client.API_KEY_ENV, "sekrit")
    with pytest.raises(client.ServerError):
        client.move(stub, stub, "r", "mig")
    assert _Recorder.seen == ["Bearer sekrit", "Bearer sekrit"]
