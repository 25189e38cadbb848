"""Tensor parallelism on gloo: two CPU processes export their shards into one
snapshot directory (committed only with every rank file and the manifest), and
two fresh processes restore their own rank's file."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

pytest.importorskip("torch")

import hsnap_format as hf  # noqa: E402
from hsnap_testing import zygote

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(mode, path, tmp_path, world=2, options=None):
    port = str(_free_port())
    outs = [str(tmp_path / f"{mode}-{r}.json") for r in range(world)]
    extra = [] if options is None else [json.dumps(options)]
    procs = [
        zygote.popen([sys.executable, os.path.join(HERE, "tp_child.py"), mode, str(r), str(world), port, str(path), outs[r], *extra],
                     text=True)
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [json.load(open(o)) for o in outs]


def test_two_rank_export_and_restore(tmp_path):
    path = tmp_path / "snap"
    exported = _run_ranks("export", path, tmp_path)
    assert all(r["ok"] for r in exported)
    with hf.open(path) as snap:
        assert isinstance(snap, hf.SnapshotSet) and snap.manifest.tp_size == 2
        snap.verify()
        assert [s.identity.tp_rank for s in snap.ranks.values()] == [0, 1]
    assert sorted(os.listdir(tmp_path)) == sorted(["snap"] + [f"export-{r}.json" for r in range(2)])  # no staging left
    restored = _run_ranks("restore", path, tmp_path)
    for e, r in zip(exported, restored):
        assert e["rows"] == r["rows"]  # each rank got its own shard back, byte for byte
    assert exported[0]["rows"] != exported[1]["rows"]


def test_rank_failing_mid_export_commits_nothing(tmp_path):
    path = tmp_path / "snap"
    results = _run_ranks("export-fail", path, tmp_path)
    assert [r["ok"] for r in results] == [False, False]
    assert results[1]["error"] == "HsnapIOError" and "No space left" in results[1]["message"]
    assert not os.path.exists(path)
    assert [n for n in os.listdir(tmp_path) if not n.endswith(".json")] == []  # staging removed


def test_two_ranks_export_a_set_under_an_object_store_prefix(tmp_path, s3server, bucket):
    """The same protocol under ``s3://`` (a real SeaweedFS): each rank uploads its rank object, rank 0 the manifest
    last and no pending marker is left; two fresh ranks restore their own shards.  A rank that cannot write (its
    credentials refused) commits nothing: no manifest, and what was uploaded lies beside the pending marker, which
    hsnap gc lists."""
    from hsnap_format.stores import store_for

    opts = s3server.options()
    url = f"s3://{bucket}/snap"
    exported = _run_ranks("export", url, tmp_path, options=opts)
    assert all(r["ok"] for r in exported), exported
    store = store_for(url, opts)
    assert sorted(e.path.rsplit("/", 1)[1] for e in store.list(url)) == ["manifest.json", "rank-0.hsnap", "rank-1.hsnap"]
    with hf.open(url, storage_options=opts) as snap:
        assert isinstance(snap, hf.SnapshotSet) and snap.manifest.tp_size == 2
        snap.verify()
    restored = _run_ranks("restore", url, tmp_path, options=opts)
    assert [r["rows"] for r in restored] == [e["rows"] for e in exported]

    bad = f"s3://{bucket}/bad"
    results = _run_ranks("export-badkey", bad, tmp_path, options=opts)
    assert [r["ok"] for r in results] == [False, False], results
    with pytest.raises(hf.HsnapError):
        hf.open(bad, storage_options=opts)
    left = {e.path.rsplit("/", 1)[1] for e in store.list(bad)}
    assert "manifest.json" not in left and ".hsnap-pending" in left, left
    assert store.collect(bad), "hsnap gc lists nothing of the unfinished set"
