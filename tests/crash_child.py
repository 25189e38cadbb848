"""Writers that die: SIGKILL at a chosen phase-hook call or at a random instant.

Imported by ``tests/test_crash.py`` (numpy + hsnap_format only, so that a
forked trial costs milliseconds), and runnable as a driver for the trials that
need real SGLang pools (``python tests/crash_child.py pools OUT``) or a real
2-rank gloo export (``python tests/crash_child.py gloo OUT``): the driver imports
SGLang once, pins torch to one thread (fork-safe: no OpenMP pool in the parent)
and forks one child per trial (two per gloo trial). Every trial leaves a
directory; the test checks it with :func:`inspect_dir`.

A killed child cannot report, so each child writes one byte per phase-hook call
to a pipe before it acts on it: the parent reads which phase it died in.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import hsnap_format as hf  # noqa: E402
from hsnap_format import localfs  # noqa: E402
from hsnap_format.stores import gc  # noqa: E402
from hsnap_format.reference import state_arrays  # noqa: E402
from hsnap_format.spec import MANIFEST_NAME, PENDING_MARKER  # noqa: E402

PHASES = ("open", "chunk", "section", "before-fsync", "after-fsync", "magic-written", "before-rename", "after-rename",
          "committed", "manifest-written", "before-dir-rename")
SINGLE_FILE_PHASES = PHASES[:9]
# gc keeps a complete snapshot that was never renamed (it cannot tell it from a committed
# one renamed by hand): killed after the magic and before the rename, or after the
# manifest and before the directory rename. Such a leftover must be the golden snapshot.
COMPLETE_LEFTOVER = ("a complete snapshot under a temporary name", "holds manifest.json")
_CODE = {p: i for i, p in enumerate(PHASES)}
FIXED_TIME = "2026-01-01T00:00:00Z"  # export fills an empty created_at with now(): pin it for byte comparison


# ------------------------------------------------------------------ a tiny snapshot (numpy only)


def tiny(seed: int = 0, *, big: bool = False, tp_size: int = 1, tp_rank: int = 0, snapshot_id: str = "crash"):
    """identity, geometry, record, state arrays of a small hybrid snapshot (big: ~2 MB)."""
    heads, dim, pos = (2, 128, 1000) if big else (1, 8, 5)
    geom = hf.Geometry(
        attention=hf.AttentionGeometry(kind="mha", layers=(1, 3), heads=heads, k_head_dim=dim, v_head_dim=dim,
                                       dtype="bfloat16", storage_dtype="bfloat16"),
        mamba=hf.MambaGeometry(layers=(0, 2), conv_shapes=((6, 3),), conv_dtype="bfloat16",
                               temporal_shape=(2, 2, 2), temporal_dtype="float32"),
        num_layers=4,
    )
    ident = hf.Identity(model_id="crash/tiny", weights_version="w1", engine=hf.Engine("sglang", "0.5.23", "t"),
                        tp_size=tp_size, tp_rank=tp_rank, snapshot_id=snapshot_id, created_at="2026-01-01T00:00:00Z")
    rng = np.random.default_rng(seed)
    out = 3
    rec = hf.RequestRecord(
        rid=f"r{seed}", prompt_ids=rng.integers(0, 1000, pos + 1 - out, dtype=np.int32),
        output_ids=rng.integers(0, 1000, out, dtype=np.int32), output_logprobs=-rng.random(out, dtype=np.float32),
        state_position=pos, max_new_tokens=16, streamed_tokens=out,
    )
    state = dict(state_arrays(geom, pos, seed=seed * 7 + tp_rank))
    return ident, geom, rec, state


def write_single(path: str, seed: int = 0, big: bool = False) -> None:
    ident, geom, rec, state = tiny(seed, big=big)
    hf.write_snapshot(path, identity=ident, geometry=geom, record=rec, state=state)


def write_set(path: str, seed: int = 0) -> None:
    """A 2-rank snapshot directory from one process: SetWriter + two SnapshotWriters."""
    w = hf.SetWriter(path)
    for r in range(2):
        ident, geom, rec, state = tiny(seed, tp_size=2, tp_rank=r, snapshot_id=f"set-{seed}")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    w.commit(tp_size=2)


# ------------------------------------------------------------------ fork, die, tell which phase


def _hook(pipe_w: int, kill_at: int):
    count = [0]

    def hook(phase: str) -> None:
        count[0] += 1
        os.write(pipe_w, bytes([_CODE[phase]]))
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def fork_trial(fn, *args, kill_at: int = 0, kill_after: float | None = None, timeout: float = 60.0):
    """Run ``fn(*args)`` in a forked child that SIGKILLs itself at hook call ``kill_at``
    (0: never), or that the parent SIGKILLs ``kill_after`` seconds after the child's
    first hook call (the file is open then: the timer lands inside the write).

    Returns ``(how, phases, pid, seconds)``: how is "killed" or "exit <code>", phases
    the hook calls seen, seconds from the first hook call to the child's end.
    """
    import select

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller (pytest) — always _exit
        code = 0
        try:
            os.close(r)
            localfs.phase_hook = _hook(w, kill_at)
            fn(*args)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    first = None
    if select.select([r], [], [], timeout)[0]:
        data = os.read(r, 1)
        first = time.perf_counter()
    if kill_after is not None:
        time.sleep(kill_after)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"trial child {pid} hung")
        time.sleep(0.0005)
    seconds = time.perf_counter() - first if first is not None else 0.0
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    how = "killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else f"exit {os.waitstatus_to_exitcode(status)}"
    return how, [PHASES[b] for b in data], pid, seconds


# ------------------------------------------------------------------ what a trial left behind


def _reader_verdict(path: str, golden: str) -> str:
    """'refused' (a typed error), or 'complete' (opens, verifies, byte-identical to golden).
    Anything else — accepted but different, or an untyped exception — raises AssertionError."""
    try:
        snap = hf.open_snapshot(path)
    except hf.HsnapError:
        return "refused"
    try:
        ranks = list(snap.ranks.values()) if isinstance(snap, hf.SnapshotSet) else [snap]
        try:
            for s in ranks:
                s.verify()
        except hf.HsnapError as e:
            raise AssertionError(f"{path}: opened but does not verify ({e}): a partial file got past open") from None
    finally:
        snap.close()
    if not same_tree(path, golden):
        raise AssertionError(f"{path}: accepted but differs from the uninterrupted write")
    return "complete"


def same_tree(a: str, b: str) -> bool:
    """Byte-identical files, or directories of byte-identical files (same names)."""
    if os.path.isdir(b):
        if not os.path.isdir(a) or sorted(os.listdir(a)) != sorted(os.listdir(b)):
            return False
        return all(same_tree(os.path.join(a, n), os.path.join(b, n)) for n in os.listdir(b))
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def inspect_dir(directory: str, final_name: str, golden: str, remove: bool = True) -> dict:
    """Check the invariants after a trial; raise AssertionError on any violation.

    * under the final name: nothing, or a complete snapshot byte-identical to the golden one;
    * every other entry is a recognised leftover, and no reader accepts a partial one;
    * gc lists every leftover as removable (its writer is dead) and removes it,
      leaving the final snapshot as it was.
    """
    final = os.path.join(directory, final_name)
    out = {"final": "absent", "leftovers": [], "verdicts": []}
    if os.path.lexists(final):
        if _reader_verdict(final, golden) != "complete":
            raise AssertionError(f"{final}: refused by the reader: an incomplete snapshot under the final name")
        out["final"] = "committed"
    others = sorted(n for n in os.listdir(directory) if n != final_name)
    items = {os.path.basename(i.path): i for i in gc.scan(directory)}
    unknown = [n for n in others if n not in items]
    assert not unknown, f"unrecognised leftovers {unknown}"
    complete, parts = [], {}
    for name in others:
        item = items[name]
        p = os.path.join(directory, name)
        verdict = _reader_verdict(p, golden)
        if item.reason.startswith(COMPLETE_LEFTOVER):
            assert verdict == "complete" and not item.removable, (item, verdict)
            complete.append(name)
            out["leftovers"].append("complete")
            continue
        if item.kind == gc.STAGING:  # temporaries inside a staging directory, too
            for inner in sorted(os.listdir(p)):
                if gc.parse_name(inner):
                    rank_golden = os.path.join(golden, gc.parse_name(inner)[1])
                    out["verdicts"].append(_reader_verdict(os.path.join(p, inner), rank_golden))
        out["verdicts"].append(verdict)
        out["leftovers"].append(item.kind)
        if item.alive is not False and not any(gc.pid_alive(p_) for p_ in item.pids):
            raise AssertionError(f"{name}: gc thinks its writer is alive")
        done = [f for f in item.files if f.reason == gc.COMPLETE_INSIDE]
        if done:  # rank files that were complete, in an unfinished set: gc keeps them (spec 8.1)
            for f in done:
                rank = gc.parse_name(os.path.basename(f.path))
                assert _reader_verdict(f.path, os.path.join(golden, rank[1] if rank else os.path.basename(f.path))) == "complete", f
            manifest_tmp = {n for n in map(os.path.basename, (f.path for f in item.files)) if (gc.parse_name(n) or "xx")[1] == MANIFEST_NAME}
            parts[name] = {PENDING_MARKER} | {os.path.basename(f.path) for f in done} | manifest_tmp  # the manifest: not a snapshot
        elif item.alive is False:
            assert item.removable, item
    if remove:
        for item in gc.collect(directory, remove=True):
            assert item.action in ("removed", "kept"), item
            if item.action == "kept":  # a complete leftover, or the dead child's pid was reused meanwhile
                assert item.alive or os.path.basename(item.path) in complete + list(parts), item
        for name, names in parts.items():  # all but the complete files and the marker went
            assert set(os.listdir(os.path.join(directory, name))) == names, (name, names)
        left = sorted(set(os.listdir(directory)) - set(complete) - set(parts))
        assert left in ([], [final_name]), left
        if out["final"] == "committed":
            assert same_tree(final, golden), "gc changed a committed snapshot"
    return out


# ------------------------------------------------------------------ drivers with real SGLang pools


def _pools_driver(out_dir: str) -> None:
    """Kill export_request from real SGLang pools at every hook call."""
    import torch

    torch.set_num_threads(1)  # fork-safe: no OpenMP thread pool is ever started here
    from io_cases import identity, record, source

    from hsnap_io import export_request

    ps, req = source("hybrid_linear", 1)
    kw = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
              req_pool_idx=req.req_pool_idx, record=record(), identity=identity(created_at=FIXED_TIME))

    def export(path):
        export_request(path, **kw)

    gold_dir = os.path.join(out_dir, "golden")
    os.makedirs(gold_dir)
    how, seq, _, _ = fork_trial(export, os.path.join(gold_dir, "req.hsnap"))
    assert how == "exit 0", how
    trials = []
    for n in range(1, len(seq) + 1):
        d = os.path.join(out_dir, f"kill-{n}")
        os.makedirs(d)
        how, seen, _, _ = fork_trial(export, os.path.join(d, "req.hsnap"), kill_at=n)
        trials.append({"dir": d, "kill_at": n, "how": how, "phase": seen[-1] if seen else None})
    json.dump({"golden": os.path.join(gold_dir, "req.hsnap"), "sequence": seq, "trials": trials},
              open(os.path.join(out_dir, "result.json"), "w"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, port: int, path: str, kill: tuple[int, str, int] | None, report: str) -> None:
    """One rank of export_request_tp; ``kill = (rank, phase, occurrence)`` picks who dies where."""
    from datetime import timedelta

    import torch.distributed as dist
    from io_cases import identity, record, source

    from hsnap_io.tp import export_request_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    ps, req = source("hybrid_linear", 1, seed=10 + rank)
    if kill is not None and kill[0] == rank:
        seen = [0]

        def hook(phase):
            if phase == kill[1]:
                seen[0] += 1
                if seen[0] == kill[2]:
                    os.kill(os.getpid(), signal.SIGKILL)

        localfs.phase_hook = hook
    result = {"rank": rank}
    try:
        export_request_tp(path, identity=identity(tp_size=2, tp_rank=rank, snapshot_id="tp-crash", created_at=FIXED_TIME), record=record(),
                          req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          req_pool_idx=req.req_pool_idx)
        result.update(ok=True)
    except BaseException as e:  # noqa: BLE001 - what a surviving rank sees is the point
        result.update(ok=False, error=type(e).__name__, typed=isinstance(e, hf.HsnapError), message=str(e)[:300])
    with open(report, "w") as f:
        json.dump(result, f)


# (rank that dies, phase, occurrence of that phase on that rank); None: nobody dies (golden)
GLOO_SCENARIOS = [None, (1, "chunk", 3), (1, "before-rename", 1), (0, "manifest-written", 1), (0, "before-dir-rename", 1)]


def _gloo_driver(out_dir: str, scenarios: list[int]) -> None:
    import torch

    torch.set_num_threads(1)
    import io_cases  # noqa: F401  (SGLang imported once, here)
    from hsnap_testing import pools

    pools.import_sglang()
    trials = []
    for i in scenarios:
        kill = GLOO_SCENARIOS[i]
        d = os.path.join(out_dir, f"scenario-{i}")
        os.makedirs(d)
        path, port = os.path.join(d, "snap"), _free_port()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _gloo_rank(rank, port, path, kill, os.path.join(out_dir, f"scenario-{i}.rank{rank}.json"))
                except BaseException:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                    code = 3
                finally:
                    os._exit(code)
            pids.append(pid)
        statuses = {}
        deadline = time.monotonic() + 90
        while len(statuses) < 2:
            for rank, pid in enumerate(pids):
                if rank not in statuses:
                    done, st = os.waitpid(pid, os.WNOHANG)
                    if done:
                        statuses[rank] = "killed" if os.WIFSIGNALED(st) else f"exit {os.waitstatus_to_exitcode(st)}"
            if time.monotonic() > deadline:
                for rank, pid in enumerate(pids):
                    if rank not in statuses:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        statuses[rank] = "hung"
            time.sleep(0.01)
        reports = {}
        for rank in range(2):
            rp = os.path.join(out_dir, f"scenario-{i}.rank{rank}.json")
            reports[rank] = json.load(open(rp)) if os.path.exists(rp) else None
        trials.append({"scenario": i, "kill": kill, "dir": d, "status": statuses, "reports": reports})
    json.dump({"trials": trials}, open(os.path.join(out_dir, "result.json"), "w"))


if __name__ == "__main__":
    # python tests/crash_child.py pools,gloo OUT: each mode writes OUT/<mode>/result.json (SGLang imported once)
    modes, out = sys.argv[1].split(","), sys.argv[2]
    for mode in modes:
        os.makedirs(os.path.join(out, mode))
        if mode == "pools":
            _pools_driver(os.path.join(out, mode))
        elif mode == "gloo":
            _gloo_driver(os.path.join(out, mode), list(range(len(GLOO_SCENARIOS))))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
