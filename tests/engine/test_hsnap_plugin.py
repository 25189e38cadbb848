"""The hsnap plug-in's registration and its clients, without a server.

* off (no ``HSNAP_SGLANG_PLUGIN=1``): SGLang's own ``load_plugins()`` runs the entry point and nothing happens: no
  hook registered or applied, the scheduler's and tokenizer manager's methods are SGLang's, no message type is added
  to SGLang's IPC decoder, no route exists;
* on: the seven hooks are registered through ``HookRegistry`` and applied by ``load_plugins()``, the message types
  decode through SGLang's own msgpack IPC, and ``launch_server``'s hook adds the /hsnap routes to SGLang's app;
* the Python client turns an HTTP error into a typed ``ServerError`` carrying the server's reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from engine_support import engine_env

_PROBE = r"""
import json, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from sglang.srt.managers import io_struct
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.entrypoints import http_server
state = {
    "hsnap_hooks": sorted(t for t, hooks in HookRegistry._hooks.items() if any(getattr(s, "plugin_name", None) == "hsnap" for _, _, s in hooks)),
    "wrapped": {name: hasattr(getattr(cls, "init_request_dispatcher"), "__wrapped__")
                for name, cls in (("Scheduler", Scheduler), ("TokenizerManager", TokenizerManager))},
    "ingest_wrapped": hasattr(Scheduler.ingest_requests, "__wrapped__"),
    "ipc_types": sorted(t.__name__ for t in io_struct._all_types if t.__name__.startswith("Hsnap")),
    # the plug-in's modules (the entry point's own module is imported by SGLang to call it; the CPU platform's are not
    # the plug-in's)
    "modules": sorted(m for m in sys.modules if m.startswith("hsnap_sglang.") and m not in ("hsnap_sglang._autoload", "hsnap_sglang.plugin")
                      and not m.startswith("hsnap_sglang.cpu")),
}
if "--launch" in sys.argv:
    http_server.launch_server.__wrapped__  # the BEFORE hook's wrapper
    from hsnap_sglang.frontend import before_launch_server
    before_launch_server(None)
def paths(routes):  # FastAPI includes a router as one entry holding it (fastapi.routing._IncludedRouter)
    for r in routes:
        yield from paths(r.original_router.routes) if hasattr(r, "original_router") else [getattr(r, "path", None) or ""]
state["routes"] = sorted(p for p in paths(http_server.app.routes) if p.startswith("/hsnap"))
if state["ipc_types"]:
    from hsnap_sglang.messages import HsnapExportReqInput, HsnapReqOutput
    msg = HsnapExportReqInput(op_id="op", rid="r", path="/p", keep_running=True)
    back = io_struct.msgpack_decode(io_struct.msgpack_encode(msg))
    out = io_struct.msgpack_decode(io_struct.msgpack_encode(HsnapReqOutput(op_id="op", ok=False, error={"type": "X", "status": 404})))
    state["roundtrip"] = [type(back).__name__, back.keep_running, back.path, out.error]
print(json.dumps(state))
"""

pytestmark = pytest.mark.engine


def _probe(on: bool, *args: str) -> subprocess.Popen:
    env = engine_env(**({"HSNAP_SGLANG_PLUGIN": "1"} if on else {}))
    env.pop("HSNAP_SGLANG_PLUGIN", None) if not on else None
    return subprocess.Popen([sys.executable, "-c", _PROBE, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def probes():
    """The probe in a process with the plug-in off and in one with it on, side by side (each is mostly SGLang's
    imports)."""
    procs = {"off": _probe(False), "on": _probe(True, "--launch")}
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        out[name] = (proc.returncode, stdout, stderr)
    return out


def _state(probes, name: str) -> dict:
    code, stdout, stderr = probes[name]
    assert code == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_plugin_off_has_no_effect(probes):
    state = _state(probes, "off")
    assert state["hsnap_hooks"] == [] and state["modules"] == []  # the entry point returned before importing anything
    assert state["wrapped"] == {"Scheduler": False, "TokenizerManager": False} and state["ingest_wrapped"] is False
    assert state["ipc_types"] == [] and state["routes"] == []


def test_plugin_on_registers_through_sglangs_hook_registry(probes):
    from hsnap_sglang.plugin import HOOKS

    state = _state(probes, "on")
    assert state["hsnap_hooks"] == sorted(HOOKS)
    assert state["wrapped"] == {"Scheduler": True, "TokenizerManager": True} and state["ingest_wrapped"] is True
    assert state["ipc_types"] == ["HsnapAdmitReqInput", "HsnapCheckpointReqInput", "HsnapDrainReqInput", "HsnapExportReqInput",
                                  "HsnapFollowReqInput", "HsnapMigrateReqInput", "HsnapProveAheadReqInput", "HsnapReqOutput", "HsnapResumeReqInput", "HsnapStatsReqInput"]
    assert state["roundtrip"] == ["HsnapExportReqInput", True, "/p", {"type": "X", "status": 404}]
    assert state["routes"] == ["/hsnap/attach", "/hsnap/checkpoint", "/hsnap/drain", "/hsnap/export", "/hsnap/follow", "/hsnap/migrate", "/hsnap/resume",
                               "/hsnap/stats"]


class _Refusing(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = json.dumps({"error": {"type": "IncompatibleSnapshotError", "status": 422, "message": "p: identity/geometry differ",
                                     "path": "/s/x.hsnap", "field": "identity/geometry",
                                     "differences": [["identity.weights_hash", "a", "b"]]}}).encode()
        self.send_response(422)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_client_raises_the_servers_typed_reason():
    from hsnap_format import HsnapError
    from hsnap_sglang import client

    httpd = HTTPServer(("127.0.0.1", 0), _Refusing)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(client.ServerError) as e:
            client.resume(url, "/s/x.hsnap")
        assert isinstance(e.value, HsnapError) and e.value.error_type == "IncompatibleSnapshotError" and e.value.status == 422
        assert e.value.error["differences"] == [["identity.weights_hash", "a", "b"]] and e.value.path == "/s/x.hsnap"
        proc = subprocess.run([sys.executable, "-m", "hsnap_format.tools.cli", "resume", url, "/s/x.hsnap"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stderr.startswith("hsnap resume: IncompatibleSnapshotError:"), proc.stderr
        assert "\n" not in proc.stderr.strip()
    finally:
        httpd.shutdown()


def test_cli_clients_import_neither_torch_nor_sglang():
    code = ("import sys, hsnap_format.tools.cli as c\nc.main(['pause', 'http://127.0.0.1:9', 'r', '-o', '/tmp/x'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert proc.stderr.startswith("hsnap pause: HsnapIOError:")
