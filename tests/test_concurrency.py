"""Concurrency: threads exporting and restoring different requests on ONE set of
SGLang pools at once, and two processes restoring from one snapshot file.

What hsnap promises (hsnap_io.slots.pool_lock): a restore's allocate / upload /
rollback step holds a lock hsnap owns per pool set (keyed by the
req_to_token_pool), because SGLang's allocators are not thread-safe and a
rollback puts back the allocators' whole earlier state; opening, identity and
capacity checks and the full verify run concurrently, and export (read-only on
the request's own rows) takes no lock. A caller that allocates or frees in the
same pools from other threads holds pool_lock too — these tests free that way.

Checked: no slot leaks (free lists equal, as sets, to before), no cross-talk (no
slot in two requests, no used slot in a free list, source rows unchanged), every
restored request byte-identical, every export byte-identical to a serial one.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from io_cases import identity, record, rows_as_bytes, source  # noqa: E402

import crash_child as cc  # noqa: E402
import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_io import export_request, restore_request, transfer  # noqa: E402
from hsnap_io import restore as restore_mod  # noqa: E402
from hsnap_io import slots  # noqa: E402
from hsnap_testing import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
KIND = "hybrid_linear"
LENGTHS = (20, 33, 45, 52, 61, 70)
ROUNDS = 8
FAILERS = 2
SAME_FILE = 2
IDENT = identity(created_at=cc.FIXED_TIME)


def _record(n):
    return record(n)


def _export(ps, req, path):
    return export_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          req_pool_idx=req.req_pool_idx, record=_record(req.n_tokens), identity=IDENT)


def _restore(ps, path):
    return restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=IDENT)


def _as_request(res) -> sp.RequestRecord:
    kv = sp.import_sglang().schedule_batch.ReqKvInfo(req_pool_idx=res.req_pool_idx,
                                                      mamba_pool_idx=None if res.mamba_pool_idx is None else torch.tensor(res.mamba_pool_idx))
    return sp.RequestRecord(res.req_pool_idx, res.token_indices, res.mamba_pool_idx, res.state_position, 0, 0, SimpleNamespace(kv=kv))


def _free(ps, res) -> None:
    with slots.pool_lock(ps.req_to_token_pool):  # the caller's allocator calls go under hsnap's lock
        sp.free_request(ps, _as_request(res))


def _free_sets(ps) -> dict:
    a = ps.token_to_kv_pool_allocator
    pages = set(sp.as_list(a.free_pages)) | set(sp.as_list(getattr(a, "release_pages", None)) or [])
    return {"rows": set(ps.req_to_token_pool.free_slots), "tokens": pages, "mamba": set(sp.as_list(ps.mamba_allocator.free_slots))}


def _check_no_cross_talk(ps, requests) -> None:
    """No slot in two live requests, and no live slot in a free list."""
    rows, tokens, mambas = [], [], []
    for r in requests:
        rows.append(int(r.req_pool_idx))
        tokens += [int(x) for x in r.token_indices.tolist()]
        mambas.append(int(r.mamba_pool_idx))
    assert len(set(rows)) == len(rows) and len(set(tokens)) == len(tokens) and len(set(mambas)) == len(mambas)
    free = _free_sets(ps)
    assert not (free["rows"] & set(rows)) and not (free["tokens"] & set(tokens)) and not (free["mamba"] & set(mambas))


@pytest.fixture(scope="module")
def pool_set(tmp_path_factory):
    ps = sp.build(KIND, size=4096, page_size=1, seed=3, max_reqs=64)
    sources = [sp.alloc_request(ps, n, seed=100 + i) for i, n in enumerate(LENGTHS)]
    root = tmp_path_factory.mktemp("conc")
    refs = []
    for i, req in enumerate(sources):
        p = str(root / f"ref-{i}.hsnap")
        _export(ps, req, p)
        refs.append(p)
    expected = [rows_as_bytes(sp.request_rows(ps, req)) for req in sources]
    return ps, sources, refs, expected


def _same_rows(a, b) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and (a[k] == b[k]).all() for k in a)


def test_threads_export_and_restore_on_one_pool_set(pool_set, tmp_path, monkeypatch):
    ps, sources, refs, expected = pool_set
    before = _free_sets(ps)
    real = transfer.HostEngine.import_section

    def flaky(self, buffer, rows, src, host=None):  # threads named fail-* lose their disk mid-upload
        if threading.current_thread().name.startswith("fail-") and getattr(threading.current_thread(), "calls", 0) == 2:
            raise OSError(5, "Input/output error")
        threading.current_thread().calls = getattr(threading.current_thread(), "calls", 0) + 1
        return real(self, buffer, rows, src, host)

    monkeypatch.setattr(transfer.HostEngine, "import_section", flaky)
    tally = collections.Counter()

    def run(barrier, results, name, fn):
        barrier.wait()
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001
            results[name] = e

    for rnd in range(ROUNDS):
        jobs = []  # (name, fn)
        for i, req in enumerate(sources):
            jobs.append((f"export-{i}", lambda i=i, req=req, rnd=rnd: ("export", i, _export(ps, req, str(tmp_path / f"r{rnd}-{i}.hsnap")))))
        for i in range(len(sources)):
            j = (i + rnd) % len(sources)
            jobs.append((f"restore-{i}", lambda j=j: ("restore", j, _restore(ps, refs[j]))))
        same = rnd % len(sources)
        for k in range(SAME_FILE):  # more readers of one file at once
            jobs.append((f"same-{k}", lambda j=same: ("restore", j, _restore(ps, refs[j]))))
        for k in range(FAILERS):
            jobs.append((f"fail-{k}", lambda k=k: ("restore", k, _restore(ps, refs[k]))))
        barrier = threading.Barrier(len(jobs), timeout=60)
        results: dict[str, object] = {}
        threads = [threading.Thread(target=run, args=(barrier, results, *job), name=job[0]) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        restored = []
        for name, out in sorted(results.items()):
            if name.startswith("fail-"):
                assert isinstance(out, hf.HsnapIOError) and "Input/output error" in str(out), out
                tally["failed restores (typed, rolled back)"] += 1
                continue
            assert not isinstance(out, BaseException), (name, out)
            kind, idx, value = out
            if kind == "export":
                assert cc.same_tree(value.path, refs[idx]), name
                tally["exports"] += 1
            else:
                got = rows_as_bytes(sp.request_rows(ps, _as_request(value)))
                assert _same_rows(got, expected[idx]), name
                restored.append(value)
                tally["restores"] += 1
        assert len(results) == len(jobs)
        _check_no_cross_talk(ps, list(sources) + restored)
        for req, exp in zip(sources, expected):  # the sources were only read
            assert _same_rows(rows_as_bytes(sp.request_rows(ps, req)), exp)
        frees = [threading.Thread(target=_free, args=(ps, r)) for r in restored]
        for t in frees:
            t.start()
        for t in frees:
            t.join(60)
        tally["frees"] += len(restored)
        assert _free_sets(ps) == before  # no leak: every slot back
    print(f"\nconcurrent operations over {ROUNDS} rounds: {dict(tally)}")


class _Gate:
    """Blocks the first upload of the thread named ``name`` until released, then fails it."""

    def __init__(self, name):
        self.name, self.inside, self.release, self.failed_at = name, threading.Event(), threading.Event(), None

    def install(self, monkeypatch):
        real = transfer.HostEngine.import_section

        def gated(engine, buffer, rows, src, host=None):
            if threading.current_thread().name == self.name:
                self.inside.set()
                self.release.wait(10)
                self.failed_at = time.monotonic()
                raise OSError(5, "Input/output error")
            return real(engine, buffer, rows, src, host)

        monkeypatch.setattr(transfer.HostEngine, "import_section", gated)


def _lock_scenario(pool_set, monkeypatch, locked: bool):
    ps, sources, refs, expected = pool_set
    before = _free_sets(ps)
    gate = _Gate("A")
    gate.install(monkeypatch)
    if not locked:
        monkeypatch.setattr(restore_mod, "pool_lock", lambda _rtp: contextlib.nullcontext())
    out = {}

    def a():
        try:
            _restore(ps, refs[0])
        except hf.HsnapError as e:
            out["A"] = e

    def b():
        out["B"] = _restore(ps, refs[1])
        out["B at"] = time.monotonic()

    ta = threading.Thread(target=a, name="A")
    ta.start()
    assert gate.inside.wait(10)  # A has allocated and is uploading
    tb = threading.Thread(target=b, name="B")
    tb.start()
    tb.join(1.0)  # with the lock B waits for A; without it B is done by now
    gate.release.set()
    ta.join(10)
    tb.join(10)
    return ps, before, expected, out, gate


def test_the_lock_keeps_a_rollback_from_freeing_another_restore(pool_set, monkeypatch):
    ps, before, expected, out, gate = _lock_scenario(pool_set, monkeypatch, locked=True)
    assert isinstance(out["A"], hf.HsnapIOError)
    assert out["B at"] > gate.failed_at  # B allocated only after A had rolled back
    _check_no_cross_talk(ps, [out["B"]])
    assert _same_rows(rows_as_bytes(sp.request_rows(ps, _as_request(out["B"]))), expected[1])
    _free(ps, out["B"])
    assert _free_sets(ps) == before


def test_without_the_lock_a_rollback_frees_another_restores_slots(pool_set, monkeypatch):
    """Why the lock exists: the same interleaving without it corrupts the free lists."""
    ps, before, expected, out, gate = _lock_scenario(pool_set, monkeypatch, locked=False)
    assert isinstance(out["A"], hf.HsnapIOError) and out["B at"] < gate.failed_at
    b = out["B"]
    free = _free_sets(ps)
    # A's rollback put the allocators back to their state before A — erasing B's allocation:
    # B's live row, token slots and mamba slot are all "free", ready to be handed out again
    assert free == before
    assert int(b.req_pool_idx) in free["rows"] and int(b.mamba_pool_idx) in free["mamba"]
    assert set(b.token_indices.tolist()) <= free["tokens"]


@pytest.mark.slow
def test_two_processes_restore_one_snapshot(tmp_path):
    """Two fresh processes restore from the same file at the same time into their own pools."""
    ps, req = source(KIND, 1)
    path = str(tmp_path / "req.hsnap")
    export_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                   req_pool_idx=req.req_pool_idx, record=record(), identity=identity())
    expected = rows_as_bytes(sp.request_rows(ps, req))
    digest = hf.open(path).root_digest
    procs, outs = [], []
    for k in range(2):
        out = tmp_path / f"out-{k}"
        spec = tmp_path / f"spec-{k}.json"
        spec.write_text(json.dumps({"items": [{"kind": KIND, "page": 1, "path": path, "out": str(out)}] * 3}))
        outs.append(out)
        procs.append(zygote.popen([sys.executable, os.path.join(HERE, "io_cases.py"), "restore", str(spec)], text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    import numpy as np

    pids = set()
    for out in outs:
        meta = json.load(open(out / "meta.json"))
        pids.add(meta["pid"])
        got = {f[:-4]: np.load(out / f, allow_pickle=False) for f in os.listdir(out) if f.endswith(".npy")}
        assert _same_rows(got, expected)
    assert len(pids) == 2 and os.getpid() not in pids
    with hf.open(path) as s:  # readers never write
        s.verify()
        assert s.root_digest == digest
