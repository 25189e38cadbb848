"""Snapshots on a real object store: SeaweedFS on loopback (the ``s3server`` fixture),
real multipart uploads, real ranged GETs, real failures (a killed, a stopped
server). No S3 mocks."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("botocore")

import hsnap_format as hf  # noqa: E402
from hsnap_format.stores.s3 import S3Store, client as s3client, gc as s3gc, options as s3options  # noqa: E402
from hsnap_format.reference import state_arrays  # noqa: E402
from crash_child import tiny  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def opts(s3server):
    return s3server.options()


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    s3client.fault_hook = None


def _client(opts):
    return s3client.client(s3options.StorageOptions.of(opts))


def _uploads(opts, bucket):
    return _client(opts).list_multipart_uploads(Bucket=bucket).get("Uploads", []) or []


def _visible(opts, bucket, key) -> bool:
    return s3client.exists(f"s3://{bucket}/{key}", s3options.StorageOptions.of(opts))


def big(pos: int, seed: int = 0, **kw):
    """tiny()'s hybrid geometry at ``pos`` committed tokens (pos=12000: ~24 MB, several parts)."""
    ident, geom, rec, _ = tiny(seed, big=True, **kw)
    rec = hf.RequestRecord(rid="r", prompt_ids=np.arange(pos - 2, dtype=np.int32), output_ids=np.arange(3, dtype=np.int32),
                           output_logprobs=-np.ones(3, dtype=np.float32), state_position=pos, max_new_tokens=16, streamed_tokens=3)
    return ident, geom, rec, dict(state_arrays(geom, pos, seed=seed))


def write_remote(url, opts, ident, geom, rec, state):
    with S3Store(opts).writer(url, identity=ident, geometry=geom, record=rec) as w:
        for spec in w.pending_state_sections():
            w.write_section(spec.name, state[spec.name])
        return w.commit()


@pytest.fixture(scope="module")
def big_local(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("big") / "big.hsnap")
    ident, geom, rec, state = big(12000)
    hf.write_snapshot(path, identity=ident, geometry=geom, record=rec, state=state)
    return path


# ------------------------------------------------------------------ write, open, verify


def test_multipart_export_is_byte_identical_to_the_local_file(big_local, bucket, opts):
    ident, geom, rec, state = big(12000)
    url = f"s3://{bucket}/a/big.hsnap"
    info = write_remote(url, dict(opts, part_bytes=5 << 20, parallel=2), ident, geom, rec, state)
    data = open(big_local, "rb").read()
    assert info.file_length == len(data) > 3 * (5 << 20)  # first part, middle parts, last part
    body = _client(opts).get_object(Bucket=bucket, Key="a/big.hsnap")["Body"].read()
    assert body == data
    assert _uploads(opts, bucket) == []


def test_open_is_two_round_trips_and_reads_verify(big_local, bucket, opts):
    p = _hsnap(opts, "cp", big_local, f"s3://{bucket}/big.hsnap")
    assert p.returncode == 0, p.stderr
    with hf.open(f"s3://{bucket}/big.hsnap", storage_options=opts) as snap, hf.open(big_local) as local:
        assert snap.source.requests <= 2
        assert snap.header == local.header and snap.root_digest == local.root_digest
        for s in local.sections[:3] + local.sections[-3:]:
            assert np.array_equal(snap.read(s.name).view(np.uint8), local.read(s.name).view(np.uint8))
        assert snap.record().prompt_ids.tolist() == local.record().prompt_ids.tolist()
        snap.verify()
        assert [e for _, e in snap.iter_verify()] == [None] * len(local.sections)
        with pytest.raises(hf.UnsupportedFeatureError):
            snap.fileno()


def _cli_env(opts):
    env = dict(os.environ)
    env.update(AWS_ENDPOINT_URL=opts["endpoint_url"], AWS_ACCESS_KEY_ID=opts["key"], AWS_SECRET_ACCESS_KEY=opts["secret"],
               AWS_REGION="us-east-1", PYTHONPATH=os.path.dirname(HERE))
    return env


class _Run:
    def __init__(self, rc, out, err):
        self.returncode, self.stdout, self.stderr = rc, out, err


def _hsnap(opts, *args):
    """The ``hsnap`` CLI in this process (credentials from the environment, as a user has them)."""
    import contextlib
    import io

    from hsnap_format.tools import cli

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in _cli_env(opts).items() if k.startswith("AWS_")})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return _Run(rc, out.getvalue(), err.getvalue())


def test_cli_info_verify_cp_with_urls(tmp_path, bucket, opts):
    src = str(tmp_path / "t.hsnap")
    ident, geom, rec, state = tiny(3)
    hf.write_snapshot(src, identity=ident, geometry=geom, record=rec, state=state)
    url = f"s3://{bucket}/x/t.hsnap"
    p = _hsnap(opts, "cp", src, url)
    assert p.returncode == 0, p.stderr
    p = _hsnap(opts, "info", url, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["ranks"][0]["identity"]["snapshot_id"] == "crash"
    p = _hsnap(opts, "verify", url)
    assert p.returncode == 0 and p.stdout.startswith("OK"), p.stderr
    back = str(tmp_path / "back.hsnap")
    assert _hsnap(opts, "cp", url, back).returncode == 0
    assert open(back, "rb").read() == open(src, "rb").read()
    assert _hsnap(opts, "cp", url, f"s3://{bucket}/y/t2.hsnap").returncode == 0  # URL -> URL
    assert _hsnap(opts, "diff", url, f"s3://{bucket}/y/t2.hsnap").returncode == 0
    p = _hsnap(opts, "cp", src, url)  # never overwrites
    assert p.returncode == 1 and "SnapshotExistsError" in p.stderr


def test_cp_of_a_corrupt_file_leaves_nothing(tmp_path, bucket, opts):
    src = str(tmp_path / "t.hsnap")
    ident, geom, rec, state = tiny(4)
    hf.write_snapshot(src, identity=ident, geometry=geom, record=rec, state=state)
    with hf.open(src) as s:
        at = s.sections[0].offset
    data = bytearray(open(src, "rb").read())
    data[at] ^= 0x40
    open(src, "wb").write(bytes(data))
    p = _hsnap(opts, "cp", src, f"s3://{bucket}/bad.hsnap")
    assert p.returncode == 1 and "DigestMismatchError" in p.stderr
    assert not _visible(opts, bucket, "bad.hsnap") and _uploads(opts, bucket) == []


# ------------------------------------------------------------------ atomic visibility, gc


def test_object_invisible_until_completion_and_failed_export_leaves_nothing(bucket, opts):
    ident, geom, rec, state = big(6000)
    url = f"s3://{bucket}/v.hsnap"
    seen = {}

    def hook(op, u, offset, length):
        if op == "complete":
            seen["visible"] = _visible(opts, bucket, "v.hsnap")
            seen["uploads"] = len(_uploads(opts, bucket))

    s3client.fault_hook = hook
    write_remote(url, dict(opts, part_bytes=5 << 20), ident, geom, rec, state)
    assert seen == {"visible": False, "uploads": 1}
    assert _visible(opts, bucket, "v.hsnap") and _uploads(opts, bucket) == []

    def fail(op, u, offset, length):
        if op == "part":
            raise OSError(5, "injected")

    s3client.fault_hook = fail
    with pytest.raises(OSError):
        write_remote(f"s3://{bucket}/w.hsnap", dict(opts, part_bytes=5 << 20), ident, geom, rec, state)
    s3client.fault_hook = None
    assert not _visible(opts, bucket, "w.hsnap") and _uploads(opts, bucket) == []  # the writer aborted its upload
    with pytest.raises(s3client.RemoteNotFoundError):
        hf.open(f"s3://{bucket}/w.hsnap", storage_options=opts)


def test_unfinished_set_is_collected_committed_ones_never(bucket, opts):
    def write_set(prefix, commit):
        w = S3Store(opts).set_writer(f"s3://{bucket}/{prefix}")
        for r in range(2):
            ident, geom, rec, state = tiny(1, tp_size=2, tp_rank=r, snapshot_id=prefix)
            with w.rank_writer(r, identity=ident, geometry=geom, record=rec) as rw:
                for spec in rw.pending_state_sections():
                    rw.write_section(spec.name, state[spec.name])
                rw.commit()
            if not commit:
                return
        w.commit(tp_size=2)

    write_set("done", True)
    write_set("half", False)
    # a lone completed object named like a rank: not proved unfinished, kept
    _client(opts).put_object(Bucket=bucket, Key="lone/rank-0.hsnap", Body=b"x")
    with hf.open(f"s3://{bucket}/done", storage_options=opts) as s:
        assert isinstance(s, hf.SnapshotSet) and sorted(s.ranks) == [0, 1]
        s.verify()
    with pytest.raises(hf.MalformedManifestError):
        hf.open(f"s3://{bucket}/half/", storage_options=opts)
    items = s3gc.collect_url(f"s3://{bucket}/", remove=True, older_than=0, storage_options=opts)
    acts = {i.path: (i.kind, i.action) for i in items}
    # half's rank 0 is complete (the magic at byte 0): not proved unfinished, so it stays,
    # and the marker with it (its proof); nothing of the committed set is even listed
    assert acts == {f"s3://{bucket}/half/.hsnap-pending": ("marker", "kept"), f"s3://{bucket}/half/rank-0.hsnap": ("file", "kept"),
                    f"s3://{bucket}/lone/rank-0.hsnap": ("object", "kept")}
    keys = sorted(o["Key"] for o in _client(opts).list_objects_v2(Bucket=bucket).get("Contents", []))
    assert keys == ["done/manifest.json", "done/rank-0.hsnap", "done/rank-1.hsnap", "half/.hsnap-pending", "half/rank-0.hsnap",
                    "lone/rank-0.hsnap"]


def test_manifest_with_a_missing_rank_object(bucket, opts):
    w = S3Store(opts).set_writer(f"s3://{bucket}/s")
    for r in range(2):
        ident, geom, rec, state = tiny(2, tp_size=2, tp_rank=r, snapshot_id="s")
        write_remote(w.rank_path(r), opts, ident, geom, rec, state)
    w.commit(tp_size=2)
    _client(opts).delete_object(Bucket=bucket, Key="s/rank-1.hsnap")
    with pytest.raises(hf.MalformedManifestError, match="rank-1.hsnap.*missing"):
        hf.open(f"s3://{bucket}/s", storage_options=opts)


# ------------------------------------------------------------------ refusals


def test_missing_bucket_and_key_are_typed(opts):
    with pytest.raises(s3client.RemoteNotFoundError, match="bucket"):
        hf.open("s3://no-such-bucket-hsnap/x.hsnap", storage_options=opts)
    ident, geom, rec, state = tiny(0)
    with pytest.raises(s3client.RemoteNotFoundError):
        write_remote("s3://no-such-bucket-hsnap/x.hsnap", opts, ident, geom, rec, state)


def test_wrong_credentials_typed_without_the_secret(bucket, opts):
    bad = dict(opts, secret="WRONG-" + "s3cr3t" * 6)
    with pytest.raises(s3client.RemoteAuthError) as e:
        hf.open(f"s3://{bucket}/x.hsnap", storage_options=bad)
    assert "s3cr3t" not in str(e.value) and opts["secret"] not in str(e.value) and bad["key"] not in repr(s3options.StorageOptions.of(bad))
    ident, geom, rec, state = tiny(0)
    with pytest.raises(s3client.RemoteAuthError) as e:
        write_remote(f"s3://{bucket}/x.hsnap", bad, ident, geom, rec, state)
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(hf.UnsupportedFeatureError) as e:
        hf.open(f"s3://AKIA:{bad['secret']}@{bucket}/x.hsnap")
    assert "s3cr3t" not in str(e.value)


def test_replaced_or_truncated_object_is_refused(bucket, opts, tmp_path):
    ident, geom, rec, state = tiny(5)
    url = f"s3://{bucket}/r.hsnap"
    write_remote(url, opts, ident, geom, rec, state)
    c = _client(opts)
    data = c.get_object(Bucket=bucket, Key="r.hsnap")["Body"].read()
    snap = hf.open(url, storage_options=dict(opts, chunk_bytes=1 << 16, first_read=4096))
    c.put_object(Bucket=bucket, Key="r.hsnap", Body=data[:-100])  # truncated in place, after open
    with pytest.raises(s3client.ObjectChangedError):
        snap.verify()
    with pytest.raises(s3client.ObjectChangedError):
        snap.check_unchanged()
    snap.close()
    with pytest.raises(hf.TruncatedError):  # a fresh open sees the short object
        hf.open(url, storage_options=opts)


# ------------------------------------------------------------------ SGLang pools: export + restore


@pytest.fixture(scope="module")
def pools():
    pytest.importorskip("torch")
    import io_cases

    return io_cases


def _export(io_cases, ps, req, url, opts):
    from hsnap_io import export_request

    return export_request(url, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          req_pool_idx=req.req_pool_idx, record=io_cases.record(), identity=io_cases.identity(created_at="2026-01-01T00:00:00Z"),
                          swa_start=req.swa_evicted, storage_options=opts)


def _restore(io_cases, ps, url, opts, **kw):
    from hsnap_io import restore_request

    return restore_request(url, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                           identity=io_cases.identity(), storage_options=opts, **kw)


@pytest.mark.parametrize("kind", ["hybrid_linear", "swa_mamba"])
def test_export_restore_round_trip_through_the_store(pools, kind, bucket, opts, tmp_path):
    from hsnap_testing import pools as sp

    ps, req = pools.source(kind, 1)
    url = f"s3://{bucket}/{kind}.hsnap"
    before = sp.pool_state_fingerprint(ps)
    _export(pools, ps, req, url, opts)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    # same bytes as the local path
    local = str(tmp_path / "l.hsnap")
    from hsnap_io import export_request

    export_request(local, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                   req_pool_idx=req.req_pool_idx, record=pools.record(), identity=pools.identity(created_at="2026-01-01T00:00:00Z"),
                   swa_start=req.swa_evicted)
    assert _client(opts).get_object(Bucket=bucket, Key=f"{kind}.hsnap")["Body"].read() == open(local, "rb").read()
    expected = pools.rows_as_bytes(sp.request_rows(ps, req))
    tgt = pools.target(kind, 1)
    got = _restore(pools, tgt, url, opts)
    assert got.bytes_uploaded > 0 and got.record.output_ids.tolist() == pools.record().output_ids.tolist()

    class R:  # what sp.request_rows reads
        req_pool_idx, n_tokens, mamba_pool_idx = got.req_pool_idx, got.state_position, got.mamba_pool_idx

    rows = pools.rows_as_bytes(sp.request_rows(tgt, R))
    assert sorted(rows) == sorted(expected)
    for k in expected:
        assert np.array_equal(rows[k], expected[k]), k


def _faulty_restore(pools, bucket, opts, s3server, act, err, **kw):
    from hsnap_testing import pools as sp

    ps, req = pools.source("hybrid_linear", 1)
    url = f"s3://{bucket}/f.hsnap"
    _export(pools, ps, req, url, opts)
    tgt = pools.target("hybrid_linear", 1)
    before = sp.pool_state_fingerprint(tgt)
    gets = []

    def hook(op, u, offset, length):
        if op == "head" and u == url:  # restore checks the object, then uploads: count from here
            gets.append("head")
        elif op == "get" and u == url and gets:
            gets.append(offset)
            if len(gets) == 3:  # mid-download: a section already in the slots
                act(url)

    s3client.fault_hook = hook
    with pytest.raises(err) as e:
        # small reads: many GETs, so the fault lands between two of them, mid-upload
        _restore(pools, tgt, url, dict(opts, first_read=4096, chunk_bytes=4096, parallel=1, **kw), exact_rollback=True)
    s3client.fault_hook = None
    assert len(gets) >= 3
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(tgt)) == []
    return e.value


def test_object_overwritten_during_restore_is_refused_pools_identical(pools, bucket, opts, s3server):
    def overwrite(url):
        c = _client(opts)
        body = bytearray(c.get_object(Bucket=bucket, Key="f.hsnap")["Body"].read())
        body[-200] ^= 1
        c.put_object(Bucket=bucket, Key="f.hsnap", Body=bytes(body))  # replaced under the reader

    _faulty_restore(pools, bucket, opts, s3server, overwrite, s3client.ObjectChangedError)


def test_slow_server_times_out_typed_pools_identical(pools, bucket, opts, s3server):
    t = []

    def stop(url):
        s3server.signal(signal.SIGSTOP)
        t.append(time.monotonic())

    try:
        e = _faulty_restore(pools, bucket, opts, s3server, stop, s3client.RemoteTimeoutError, timeout=1.0, retries=0)
    finally:
        s3server.signal(signal.SIGCONT)
    assert isinstance(e, hf.HsnapIOError) and "1 s per attempt" in str(e)
    assert time.monotonic() - t[0] < 15


# last: these kill the shared server and start it again on the same directory and ports


def test_server_killed_mid_download_typed_pools_identical(pools, bucket, opts, s3server):
    try:
        e = _faulty_restore(pools, bucket, opts, s3server, lambda url: s3server.kill(), hf.HsnapIOError, retries=0)
        assert isinstance(e, s3client.RemoteIOError)
    finally:
        s3server.start()


def test_server_killed_mid_upload_nothing_visible_gc_cleans(bucket, opts, s3server):
    ident, geom, rec, state = big(12000)
    parts = []

    def kill_at_second_part(op, u, offset, length):
        if op == "part":
            parts.append(offset)
            if len(parts) == 2:
                s3server.kill()

    s3client.fault_hook = kill_at_second_part
    try:
        with pytest.raises(s3client.RemoteIOError):
            write_remote(f"s3://{bucket}/k.hsnap", dict(opts, part_bytes=5 << 20, parallel=1, retries=0), ident, geom, rec, state)
    finally:
        s3client.fault_hook = None
        s3server.start()
    assert not _visible(opts, bucket, "k.hsnap")
    with pytest.raises(s3client.RemoteNotFoundError):
        hf.open(f"s3://{bucket}/k.hsnap", storage_options=opts)
    assert len(_uploads(opts, bucket)) == 1  # the dead writer's upload, uncommitted
    p = _hsnap(opts, "gc", f"s3://{bucket}/", "--json")  # young: listed, kept
    assert p.returncode == 0, p.stderr
    assert [i["action"] for i in json.loads(p.stdout)["leftovers"]] == ["kept"]
    p = _hsnap(opts, "gc", f"s3://{bucket}/", "--remove", "--older-than", "0", "--json")
    assert p.returncode == 0, p.stderr
    assert [(i["kind"], i["action"]) for i in json.loads(p.stdout)["leftovers"]] == [("upload", "removed")]
    assert _uploads(opts, bucket) == []
