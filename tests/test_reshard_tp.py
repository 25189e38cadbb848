"""Re-sharding on gloo: a TP 1 snapshot set restored by a TP 2 group of CPU
processes, each rank restoring its own shard with ``restore_request_tp``."""

from __future__ import annotations

import json
import os
import socket
import sys

from hsnap_testing import tp_pools as rp
from hsnap_testing import zygote

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp1_set_restored_by_a_tp2_gloo_group(tmp_path):
    m = rp.MODELS["qwen35"]
    state = rp.global_state(m)
    path = rp.export_set(m, 1, state, tmp_path / "tp1")
    port, world = str(_free_port()), 2
    outs = [str(tmp_path / f"r{r}.json") for r in range(world)]
    procs = [zygote.popen([sys.executable, os.path.join(HERE, "reshard_tp_child.py"), "qwen35", str(r), str(world), port, path, outs[r]],
                          text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    for r in range(world):
        got = json.load(open(outs[r]))
        assert got["source_ranks"] == [0]
        for sec, hexbytes in got["rows"].items():
            assert hexbytes == rp.as_bytes(rp.shard_of(m, world, r, sec, state[sec])).hex(), (r, sec)
