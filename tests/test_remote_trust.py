"""The object-store side: gc by URL proves every object it removes
and reports what stale uploads hold; a store that never answers gives a typed,
bounded timeout everywhere; messages name the endpoint, a port that is not S3 says
so, an empty AWS_ENDPOINT_URL is unset. Against a real SeaweedFS (tests/seaweed.py)
and real hung / non-S3 servers on loopback. No S3 mocks."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import signal
import socket
import socketserver
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("botocore")

import hsnap_format as hf  # noqa: E402
from hsnap_format.stores.s3 import S3Store, client as s3client, gc as s3gc, options as s3options, upload as s3upload  # noqa: E402
from hsnap_format.spec import MAGIC, PENDING_MAGIC, PENDING_MARKER, PENDING_MARKER_TEXT  # noqa: E402
from hsnap_format.reference import state_arrays  # noqa: E402
from crash_child import tiny  # noqa: E402
from hsnap_testing import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def opts(s3server):
    return s3server.options()


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    s3client.fault_hook = None


def _client(opts):
    return s3client.client(s3options.StorageOptions.of(opts))


def _keys(opts, bucket, prefix=""):
    return sorted(o["Key"] for o in _client(opts).list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []) or [])


def _uploads(opts, bucket):
    return _client(opts).list_multipart_uploads(Bucket=bucket).get("Uploads", []) or []


def big(pos: int, seed: int = 0, **kw):
    """tiny()'s hybrid geometry at ``pos`` committed tokens (pos=12000: ~24 MB, several 5 MiB parts)."""
    ident, geom, rec, _ = tiny(seed, big=True, **kw)
    rec = hf.RequestRecord(rid="r", prompt_ids=np.arange(pos - 2, dtype=np.int32), output_ids=np.arange(3, dtype=np.int32),
                           output_logprobs=-np.ones(3, dtype=np.float32), state_position=pos, max_new_tokens=16, streamed_tokens=3)
    return ident, geom, rec, dict(state_arrays(geom, pos, seed=seed))


def write_remote(url, opts, ident, geom, rec, state):
    with S3Store(opts).writer(url, identity=ident, geometry=geom, record=rec) as w:
        for spec in w.pending_state_sections():
            w.write_section(spec.name, state[spec.name])
        return w.commit()


class _Run:
    def __init__(self, rc, out, err):
        self.returncode, self.stdout, self.stderr = rc, out, err


def _hsnap(env: dict, *args) -> _Run:
    """The ``hsnap`` CLI in this process, with ``env`` over the environment (as a user has it)."""
    from hsnap_format.tools import cli

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return _Run(rc, out.getvalue(), err.getvalue())


def _env(opts) -> dict:
    return {"AWS_ENDPOINT_URL": opts["endpoint_url"], "AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": opts["secret"],
            "AWS_REGION": "us-east-1"}


# ------------------------------------------------------------------ gc by URL

# A two-rank export into s3://BUCKET/PREFIX, SIGKILLed (no clean-up: a crash) at the
# second part upload of rank KILL_RANK; the earlier ranks are complete objects by then.
_KILLED_EXPORT = r"""
import json, os, signal, sys
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
from hsnap_format.stores.s3 import S3Store, client as s3client
from test_remote_trust import big, write_remote
opts, prefix, kill_rank = json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
w = S3Store(opts).set_writer(prefix)
parts = []
def hook(op, url, offset, length):
    if op == "part" and url == w.rank_path(kill_rank):
        parts.append(offset)
        if len(parts) == 2:  # the first part of this rank is in the store, the writer dies
            os.kill(os.getpid(), signal.SIGKILL)
s3client.fault_hook = hook
for r in range(2):
    ident, geom, rec, state = big(12000, seed=r, tp_size=2, tp_rank=r, snapshot_id="killed")
    write_remote(w.rank_path(r), opts, ident, geom, rec, state)
w.commit(tp_size=2)
"""


def _killed_export(opts, url, kill_rank):
    o = dict(opts, part_bytes=5 << 20, parallel=1, retries=0)
    p = zygote.run([sys.executable, "-c", _KILLED_EXPORT, ROOT, json.dumps(o), url, str(kill_rank)], text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr


@pytest.mark.parametrize("kill_rank", [1, 0])
def test_url_gc_keeps_a_committed_snapshot_under_a_killed_set_prefix(bucket, opts, kill_rank):
    """The tester's case: a committed, verified setp/keep.hsnap under a prefix into which a
    two-rank export was killed; gc --remove --older-than 0 keeps it, removes only what it
    proves unfinished, and names each removal with its size before making it."""
    ident, geom, rec, state = tiny(11)
    keep = f"s3://{bucket}/setp/keep.hsnap"
    keep_bytes = write_remote(keep, opts, ident, geom, rec, state).file_length
    with hf.open(keep, storage_options=opts) as s:
        s.verify()
        keep_etag = s.source.etag
    _killed_export(opts, f"s3://{bucket}/setp", kill_rank)
    assert f"setp/{PENDING_MARKER}" in _keys(opts, bucket) and len(_uploads(opts, bucket)) == 1

    text = _hsnap(_env(opts), "gc", f"s3://{bucket}/setp", "--older-than", "0", "--wide")  # the text report: each entry, its size, its verdict
    assert text.returncode == 0 and "removing" not in text.stdout, text.stderr
    assert re.search(rf"^kept +object +{re.escape(keep)} +{keep_bytes} ", text.stdout, re.M), text.stdout
    upload = re.escape(f"s3://{bucket}/setp/rank-{kill_rank}.hsnap?uploadId=")
    assert re.search(rf"^would remove +upload +{upload}\S+ +{5 << 20} ", text.stdout, re.M), text.stdout
    p = _hsnap(_env(opts), "gc", f"s3://{bucket}/setp", "--remove", "--older-than", "0", "--json")
    assert p.returncode == 0, p.stderr
    report = {i["path"]: i for i in json.loads(p.stdout)["leftovers"]}
    upload = next(i for i in report.values() if i["kind"] == "upload")
    assert upload["final"] == f"s3://{bucket}/setp/rank-{kill_rank}.hsnap" and upload["action"] == "removed"
    assert upload["bytes"] == 5 << 20  # the one part the killed writer got into the store (not "0 bytes")
    assert report[keep]["action"] == "kept" and "complete snapshot" in report[keep]["reason"]
    marker = report[f"s3://{bucket}/setp/{PENDING_MARKER}"]
    if kill_rank == 1:  # rank 0 was complete: not proved unfinished, it stays, and the marker (its proof) with it
        rank0 = report[f"s3://{bucket}/setp/rank-0.hsnap"]
        assert (rank0["kind"], rank0["action"]) == ("file", "kept") and "complete" in rank0["reason"]
        assert marker["action"] == "kept"
        left = ["setp/.hsnap-pending", "setp/keep.hsnap", "setp/rank-0.hsnap"]
    else:  # nothing of the set is left: the marker goes too, last
        assert marker["action"] == "removed"
        left = ["setp/keep.hsnap"]
    assert _keys(opts, bucket) == left and _uploads(opts, bucket) == []
    # every removal was announced, with its size, before it was made; nothing else was
    removed = {(i["path"], i["bytes"]) for i in report.values() if i["action"] == "removed"}
    announced = {(line.split()[1], int(line.split()[2])) for line in p.stderr.splitlines() if line.startswith("removing ")}
    assert announced == removed and len(removed) == (1 if kill_rank == 1 else 2)
    with hf.open(keep, storage_options=opts) as s:
        s.verify()
        assert s.source.etag == keep_etag


def test_url_gc_proves_each_temporary_by_its_bytes_and_deletes_only_that_version(bucket, opts):
    """Objects under a temporary's name: removed only with the unfinished-write mark at
    byte 0 (or empty); one replaced by a committed snapshot between the proof and the
    delete is refused by the store (If-Match on the ETag), not deleted."""
    c = _client(opts)
    pending = (PENDING_MAGIC + b"writer 1-0a1b2c3d").ljust(4096, b"\0")
    ident, geom, rec, state = tiny(12)
    write_remote(f"s3://{bucket}/src.hsnap", opts, ident, geom, rec, state)
    committed = c.get_object(Bucket=bucket, Key="src.hsnap")["Body"].read()
    assert committed[:8] == MAGIC
    names = {"d/.a.hsnap.hsnap-tmp-1-0a1b2c3d": pending, "d/.b.hsnap.hsnap-tmp-2-0a1b2c3d": committed,
             "d/.c.hsnap.hsnap-tmp-3-0a1b2c3d": b"", "d/.e.hsnap.hsnap-tmp-4-0a1b2c3d": pending,
             "d/.f.hsnap.hsnap-tmp-5-0a1b2c3d": b"not hsnap at all", "d/plain.hsnap": pending}
    for k, v in names.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)

    def swap(path, nbytes):  # right before e's delete: a committed snapshot takes its key
        if path.endswith("/.e.hsnap.hsnap-tmp-4-0a1b2c3d"):
            c.put_object(Bucket=bucket, Key="d/.e.hsnap.hsnap-tmp-4-0a1b2c3d", Body=committed)

    items = {i.path.rpartition("/")[2]: i for i in s3gc.collect_url(f"s3://{bucket}/d", remove=True, older_than=0,
                                                                     storage_options=opts, announce=swap)}
    acts = {n: (i.kind, i.action, i.bytes) for n, i in items.items()}
    assert acts == {".a.hsnap.hsnap-tmp-1-0a1b2c3d": ("file", "removed", 4096), ".b.hsnap.hsnap-tmp-2-0a1b2c3d": ("file", "kept", len(committed)),
                    ".c.hsnap.hsnap-tmp-3-0a1b2c3d": ("file", "removed", 0), ".e.hsnap.hsnap-tmp-4-0a1b2c3d": ("file", "failed", 4096),
                    ".f.hsnap.hsnap-tmp-5-0a1b2c3d": ("file", "kept", 16)}  # plain.hsnap: no write was interrupted there
    assert "replaced since it was proved" in items[".e.hsnap.hsnap-tmp-4-0a1b2c3d"].reason
    assert items[".a.hsnap.hsnap-tmp-1-0a1b2c3d"].final == f"s3://{bucket}/d/a.hsnap"
    assert _keys(opts, bucket, "d/") == ["d/.b.hsnap.hsnap-tmp-2-0a1b2c3d", "d/.e.hsnap.hsnap-tmp-4-0a1b2c3d",
                                         "d/.f.hsnap.hsnap-tmp-5-0a1b2c3d", "d/plain.hsnap"]
    assert c.get_object(Bucket=bucket, Key="d/.e.hsnap.hsnap-tmp-4-0a1b2c3d")["Body"].read() == committed


def test_writers_refuse_a_key_inside_an_unfinished_set_prefix(bucket, opts):
    """A prefix holding an unfinished set's marker is gc's to look at: a writer does not
    commit a snapshot into it, and a second set writer does not take it over."""
    marker = f"s3://{bucket}/setp/{PENDING_MARKER}"
    s3client.put_bytes(marker, PENDING_MARKER_TEXT, s3options.StorageOptions.of(opts))
    ident, geom, rec, state = tiny(13)
    with pytest.raises(hf.ReservedNameError, match="unfinished"):
        write_remote(f"s3://{bucket}/setp/keep.hsnap", opts, ident, geom, rec, state)
    with pytest.raises(hf.ReservedNameError, match="unfinished"):
        S3Store(opts).set_writer(f"s3://{bucket}/setp")
    assert _keys(opts, bucket) == [f"setp/{PENDING_MARKER}"] and _uploads(opts, bucket) == []
    write_remote(f"s3://{bucket}/other/keep.hsnap", opts, ident, geom, rec, state)  # elsewhere: fine


def test_a_failed_set_copy_never_deletes_an_object_it_did_not_write(bucket, opts, tmp_path):
    """hsnap cp of a set onto a prefix where rank-0.hsnap is someone's committed object:
    refused, and the clean-up removes only what the copy itself committed."""
    src = str(tmp_path / "set")
    from crash_child import write_set

    write_set(src, seed=3)
    ident, geom, rec, state = tiny(14)
    theirs = f"s3://{bucket}/p/rank-0.hsnap"
    write_remote(theirs, opts, ident, geom, rec, state)
    p = _hsnap(_env(opts), "cp", src, f"s3://{bucket}/p")
    assert p.returncode == 1 and "SnapshotExistsError" in p.stderr
    assert _keys(opts, bucket) == ["p/rank-0.hsnap"] and _uploads(opts, bucket) == []
    with hf.open(theirs, storage_options=opts) as s:
        s.verify()
        assert s.record().rid == rec.rid


# ------------------------------------------------------------------ what a stale upload holds


def test_url_gc_reports_the_bytes_a_stale_upload_holds(bucket, opts):
    o = s3options.StorageOptions.of(dict(opts, parallel=1))
    up = s3upload.MultipartUpload(f"s3://{bucket}/stale.hsnap", o)
    up.submit(1, bytes(5 << 20))
    up.submit(2, bytes(3 << 20))
    for f in up._futures.values():
        f.result()
    up._pool.shutdown(wait=True)  # abandoned, as by a killed writer: never completed nor aborted
    p = _hsnap(_env(opts), "gc", f"s3://{bucket}/", "--wide")
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if "stale.hsnap?uploadId=" in x)
    assert str(8 << 20) in line.split() and line.startswith("kept")  # young: listed, kept
    items = s3gc.collect_url(f"s3://{bucket}/", remove=True, older_than=0, storage_options=opts)
    assert [(i.kind, i.bytes, i.action) for i in items] == [("upload", 8 << 20, "removed")]
    assert _uploads(opts, bucket) == []


# ------------------------------------------------------------------ a store that accepts and never answers


class HungStore:
    """A loopback TCP server that accepts every connection, reads the request, and never
    answers; counts the requests it swallowed."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.conns.append(conn)
            threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    def _swallow(self, conn) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:
                    return
                data += piece
        except OSError:
            return
        with self.lock:
            self.requests += 1

    def close(self) -> None:
        self.sock.close()
        with self.lock:
            for c in self.conns:
                c.close()


@pytest.fixture
def hung():
    h = HungStore()
    yield h
    h.close()


HUNG_ENV = {"AWS_ACCESS_KEY_ID": "dummy", "AWS_SECRET_ACCESS_KEY": "dummy-secret-never-shown", "AWS_REGION": "us-east-1",
            "HSNAP_S3_TIMEOUT": "1", "HSNAP_S3_CONNECT_TIMEOUT": "1", "HSNAP_S3_RETRIES": "1"}


@pytest.mark.parametrize("argv, rc", [(["info", "s3://b/x.hsnap"], 1), (["verify", "s3://b/x.hsnap"], 1),
                                      (["cp", "s3://b/x.hsnap", os.devnull + "/x"], 1), (["gc", "s3://b/x.hsnap"], 2)],
                         ids=["info", "verify", "cp", "gc"])
def test_hung_store_info_verify_typed_timeout_within_the_bound(hung, argv, rc):
    env = dict(HUNG_ENV, AWS_ENDPOINT_URL=hung.endpoint)
    started = time.monotonic()
    p = _hsnap(env, *argv)
    waited = time.monotonic() - started
    assert p.returncode == rc
    assert p.stderr.count("\n") == 1 and "RemoteTimeoutError" in p.stderr, p.stderr
    assert "s3://b/x.hsnap" in p.stderr and hung.endpoint in p.stderr and "1 s per attempt, 2 attempts" in p.stderr
    assert "dummy-secret" not in p.stderr
    assert hung.requests == 2  # HSNAP_S3_RETRIES=1: the first attempt and one retry, not one more
    with _environ(env):
        bound = s3options.StorageOptions().request_bound_s
    assert bound == 2 * (1 + 1) + 1 and waited <= 2 * bound  # the documented bound for a reading command


@contextlib.contextmanager
def _environ(env):
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_hung_store_restore_typed_timeout_pools_identical(hung):
    pytest.importorskip("torch")
    import io_cases
    from hsnap_testing import pools as sp
    from hsnap_io import restore_request

    tgt = io_cases.target("hybrid_linear", 1)
    before = sp.pool_state_fingerprint(tgt)
    o = {"endpoint_url": hung.endpoint, "key": "dummy", "secret": "dummy-secret-never-shown", "timeout": 1, "connect_timeout": 1, "retries": 0}
    with pytest.raises(s3client.RemoteTimeoutError) as e:
        restore_request("s3://b/x.hsnap", req_to_token_pool=tgt.req_to_token_pool, token_to_kv_pool_allocator=tgt.token_to_kv_pool_allocator,
                        identity=io_cases.identity(), storage_options=o)
    assert hung.endpoint in str(e.value) and "dummy-secret" not in str(e.value)
    assert hung.requests == 1  # retries=0: one attempt
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(tgt)) == []


async def test_hung_store_viewer_says_it_waits_then_shows_the_typed_error(hung, monkeypatch):
    pytest.importorskip("textual")
    from textual.widgets import Static

    from hsnap_view.app import make_app
    from hsnap_view.screens.error import ErrorScreen
    from hsnap_view.screens.loading import LoadingScreen

    for k, v in dict(HUNG_ENV, AWS_ENDPOINT_URL=hung.endpoint, HSNAP_S3_RETRIES="0", HSNAP_S3_TIMEOUT="3").items():
        monkeypatch.setenv(k, v)
    app = make_app("s3://b/x.hsnap")  # returns at once: the open waits on the network, after the first frame
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, LoadingScreen)
        text = str(app.screen.query_one("#opening-text", Static).content)
        assert "Opening x.hsnap" in text and hung.endpoint in text and "at most 4 s" in text
        for _ in range(600):  # until the open gives up (4 s documented; generous for a loaded machine)
            if isinstance(app.screen, ErrorScreen):
                break
            await pilot.pause(0.05)
        await pilot.pause()  # the error screen composed
        assert isinstance(app.screen, ErrorScreen)
        shown = str(app.screen.query_one("#error-text", Static).content)
        assert "RemoteTimeoutError" in shown and hung.endpoint in shown and "may be intact" in shown
        assert app.error is not None and isinstance(app.error[1], s3client.RemoteTimeoutError)
        await pilot.press("q")


# ------------------------------------------------------------------ endpoint, non-S3 ports, empty AWS_ENDPOINT_URL


def test_messages_name_the_endpoint_never_the_credentials(bucket, opts, s3server):
    with pytest.raises(s3client.RemoteNotFoundError) as e:
        hf.open(f"s3://{bucket}/missing.hsnap", storage_options=opts)
    msg = str(e.value)
    assert s3server.endpoint in msg and "no such object" in msg and opts["secret"] not in msg and opts["key"] not in msg
    p = _hsnap(_env(opts), "info", f"s3://{bucket}/missing.hsnap")
    assert p.returncode == 1 and s3server.endpoint in p.stderr and opts["secret"] not in p.stderr


class _Html404(http.server.BaseHTTPRequestHandler):
    def _answer(self, body=True):
        page = b"<html><body><h1>404 Not Found</h1></body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self.wfile.write(page)

    do_GET = do_PUT = do_POST = do_DELETE = _answer

    def do_HEAD(self):
        self._answer(body=False)

    def log_message(self, *a):
        pass


@pytest.fixture(params=["html-404", "tcp-echo"])
def not_s3(request):
    if request.param == "html-404":
        srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Html404)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{srv.server_address[1]}"
        srv.shutdown()
        srv.server_close()
        return
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def echo(conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_port_that_is_not_s3_says_so_not_no_such_object(not_s3):
    o = {"endpoint_url": not_s3, "key": "dummy", "secret": "dummy", "retries": 0, "timeout": 5}
    with pytest.raises(s3client.NotS3EndpointError, match="not an S3 endpoint") as e:
        hf.open("s3://b/x.hsnap", storage_options=o)
    assert not isinstance(e.value, s3client.RemoteNotFoundError) and not_s3 in str(e.value)
    ident, geom, rec, state = tiny(15)
    with pytest.raises(s3client.NotS3EndpointError):  # the writer's HEAD bucket, whose 404 has no body to tell
        write_remote("s3://b/x.hsnap", o, ident, geom, rec, state)
    with pytest.raises(s3client.NotS3EndpointError):
        s3gc.collect_url("s3://b/", storage_options=o)


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (and no metadata service): no request leaves."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "HSNAP_S3_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_empty_aws_endpoint_url_counts_as_unset_as_in_botocore(no_aws, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")
    assert s3options.resolve_endpoint(s3options.StorageOptions()) == (None, "AWS")
    with pytest.raises(s3client.RemoteAuthError, match="no usable credentials") as e:  # signed before sending: no request made
        hf.open("s3://b/x.hsnap")
    assert "https://s3.amazonaws.com" in str(e.value)
    p = _hsnap({}, "info", "s3://b/x.hsnap")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "RemoteAuthError" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("var, value", [("AWS_ENDPOINT_URL", "localhost:9000"), ("AWS_ENDPOINT_URL_S3", "ftp://x"),
                                        ("HSNAP_S3_TIMEOUT", "soon"), ("HSNAP_S3_TIMEOUT", "0"), ("HSNAP_S3_RETRIES", "1.5"),
                                        ("HSNAP_S3_CONNECT_TIMEOUT", "inf")])
def test_a_bad_endpoint_or_timeout_variable_is_refused_by_name(no_aws, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    p = _hsnap({}, "info", "s3://b/x.hsnap")
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "UnsupportedFeatureError" in p.stderr and var in p.stderr


def test_timeouts_from_storage_options_and_the_documented_bound():
    o = s3options.StorageOptions.of({"timeout": 2, "connect_timeout": 0.5, "retries": 3})
    assert (o.timeout, o.connect_timeout, o.retries, o.attempts) == (2.0, 0.5, 3, 4)
    assert o.request_bound_s == 4 * 2.5 + (1 + 2 + 4)  # botocore's standard back-off: at most 2**(i-1) s before retry i
    with pytest.raises(hf.UnsupportedFeatureError, match="storage_options retries"):
        s3options.StorageOptions.of({"retries": -1})
