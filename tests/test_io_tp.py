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


def _run_ranks(mode, path, tmp_path, world=2):
    port = str(_free_port())
    outs = [str(tmp_path / f"{mode}-{r}.json") for r in range(world)]
    procs = [
        zygote.popen([sys.executable, os.path.join(HERE, "tp_child.py"), mode, str(r), str(world), port, str(path), outs[r]], text=True)
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
