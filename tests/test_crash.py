"""SIGKILL at any instant: a writer that dies leaves, under the final name, either
nothing or a complete snapshot byte-identical to an uninterrupted write; every
leftover is a recognisable temporary that no reader accepts unless it is complete,
and ``hsnap gc`` removes it without touching the committed snapshot.

Trials fork from this process (hsnap_format + numpy only: a few ms each); the
kill point is chosen deterministically (the child SIGKILLs itself at the Nth
phase-hook call) or by a timer. Real SGLang pools and real 2-rank gloo exports
run in one driver process that imports SGLang once and forks per trial.
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys

import pytest

import crash_child as cc
import hsnap_format as hf
from hsnap_format import localfs
from hsnap_format.stores import gc as hgc
from hsnap_testing import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
SINGLE_SEEDS = (0, 1, 2, 3)
SET_SEEDS = (0, 1)
RANDOM_TRIALS = 60

TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def _golden(tmp_path, fn, name, *args):
    d = tmp_path / "golden"
    d.mkdir(exist_ok=True)
    path = str(d / name)
    how, seq, _, _ = cc.fork_trial(fn, path, *args)
    assert how == "exit 0", how
    return path, seq


def _trial(tmp_path, label, fn, name, golden, *args, **kill):
    d = tmp_path / f"t{sum(sum(c.values()) for c in TALLY.values())}"
    d.mkdir()
    how, seen, _pid, _ = cc.fork_trial(fn, str(d / name), *args, **kill)
    assert how in ("killed", "exit 0"), how  # "exit 3" would be an exception inside the writer
    phase = seen[-1] if how == "killed" and seen else ("before first hook" if how == "killed" else "finished")
    out = cc.inspect_dir(str(d), name, golden)
    TALLY[label][phase] += 1
    TALLY[label + " outcome"][out["final"]] += 1
    for v in out["verdicts"]:
        TALLY["leftover verdicts"][v] += 1
    return phase, out


def test_kill_single_file_at_every_hook_call(tmp_path):
    for seed in SINGLE_SEEDS:
        golden, seq = _golden(tmp_path, cc.write_single, f"g{seed}.hsnap", seed)
        assert len(seq) == 29 and seq[-1] == "committed"
        for n in range(1, len(seq) + 1):
            phase, out = _trial(tmp_path, "single", cc.write_single, f"g{seed}.hsnap", golden, seed, kill_at=n)
            assert phase == seq[n - 1]
            # committed exactly when the rename happened before the kill
            assert out["final"] == ("committed" if n > seq.index("before-rename") + 1 else "absent"), (n, phase)
    phases = set(TALLY["single"])
    assert phases >= set(cc.SINGLE_FILE_PHASES), phases


def test_kill_two_rank_set_at_every_hook_call(tmp_path):
    for seed in SET_SEEDS:
        golden, seq = _golden(tmp_path, cc.write_set, f"set{seed}", seed)
        assert seq[-3:] == ["manifest-written", "before-dir-rename", "committed"]
        for n in range(1, len(seq) + 1):
            phase, out = _trial(tmp_path, "set", cc.write_set, f"set{seed}", golden, seed, kill_at=n)
            assert phase == seq[n - 1]
            assert out["final"] == ("committed" if n == len(seq) else "absent"), (n, phase)
    assert set(TALLY["set"]) == set(cc.PHASES), TALLY["set"]


def test_kill_at_random_instants(tmp_path):
    golden, _ = _golden(tmp_path, cc.write_single, "big.hsnap", 5, True)
    durations = sorted(cc.fork_trial(cc.write_single, str(tmp_path / f"timing{i}.hsnap"), 5, True)[3] for i in range(5))
    duration = durations[2]  # median: from the first hook call (file open) to the child's exit
    rng = random.Random(1234)
    for _ in range(RANDOM_TRIALS):
        _trial(tmp_path, "random", cc.write_single, "big.hsnap", golden, 5, True, kill_after=rng.uniform(0, duration))
    assert len(TALLY["random"]) >= 2, TALLY["random"]  # the timer lands in several phases


def test_leftovers_are_never_accepted_partial(tmp_path):
    """Runs after the trials above (same module): the tally of what readers said."""
    if not TALLY:
        pytest.skip("run with the trial tests")
    total = sum(TALLY[k].total() for k in ("single", "set", "random"))
    print(f"\nkill trials: {total}")
    for k in sorted(TALLY):
        print(f"  {k}: {dict(TALLY[k])}")
    assert total >= 200
    assert set(TALLY["leftover verdicts"]) <= {"refused", "complete"}


# ------------------------------------------------------------------ raising hook: source pools untouched


class _Boom(Exception):
    pass


def _raise_at(n: int):
    """A phase hook that raises _Boom at the n-th phase it sees."""
    seen = [0]

    def hook(phase):
        seen[0] += 1
        if seen[0] == n:
            raise _Boom(phase)

    return hook


@pytest.fixture(scope="module")
def pools():
    pytest.importorskip("torch")
    from io_cases import source

    return source("hybrid_linear", 1)


def test_export_failing_at_every_phase_leaves_source_untouched(pools, tmp_path):
    """The same kill points, with the hook raising in this process: after each,
    the source pools are byte-identical (free lists and every buffer), and the
    directory holds nothing or the complete snapshot, never a temporary."""
    from hsnap_testing import pools as sp
    from io_cases import identity, record

    from hsnap_io import export_request

    ps, req = pools
    kw = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
              req_pool_idx=req.req_pool_idx, record=record(), identity=identity(created_at=cc.FIXED_TIME))
    seq = []
    localfs.phase_hook = seq.append
    try:
        export_request(str(tmp_path / "golden.hsnap"), **kw)
    finally:
        localfs.phase_hook = None
    before = sp.pool_state_fingerprint(ps)
    for n in range(1, len(seq) + 1):
        d = tmp_path / f"raise-{n}"
        d.mkdir()
        localfs.phase_hook = _raise_at(n)
        try:
            with pytest.raises(_Boom):
                export_request(str(d / "req.hsnap"), **kw)
        finally:
            localfs.phase_hook = None
        assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == [], seq[n - 1]
        left = os.listdir(d)
        if n > seq.index("before-rename") + 1:  # raised after the rename: the snapshot is complete
            assert left == ["req.hsnap"]
            assert cc.same_tree(str(d / "req.hsnap"), str(tmp_path / "golden.hsnap"))
        else:
            assert left == [], (seq[n - 1], left)  # the temporary was removed by abort()


# ------------------------------------------------------------------ real SGLang pools and real gloo ranks


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """One process imports SGLang once and runs both the real-pool and the gloo trials."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("driver")
    proc = zygote.run([sys.executable, os.path.join(HERE, "crash_child.py"), "pools,gloo", str(out)], text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {m: json.load(open(out / m / "result.json")) for m in ("pools", "gloo")}


@pytest.mark.slow
def test_kill_export_from_real_sglang_pools(driver):
    res = driver["pools"]
    phases = collections.Counter()
    for t in res["trials"]:
        assert t["how"] == "killed", t
        out = cc.inspect_dir(t["dir"], "req.hsnap", res["golden"])
        phases[t["phase"]] += 1
        committed = t["kill_at"] > res["sequence"].index("before-rename") + 1
        assert out["final"] == ("committed" if committed else "absent"), t
    print(f"\nreal-pool kill trials: {len(res['trials'])} {dict(phases)}")
    assert set(phases) == set(cc.SINGLE_FILE_PHASES)


@pytest.mark.slow
def test_kill_a_real_gloo_rank(driver):
    """A rank of a 2-rank gloo export SIGKILLed mid-file, before its rename, or rank 0
    after the manifest / before the directory rename: nothing under the final name,
    the survivor gets an error (never success), gc lists the staging directory."""
    res = driver["gloo"]
    golden = None
    for t in res["trials"]:
        path = os.path.join(t["dir"], "snap")
        if t["kill"] is None:
            assert all(r and r["ok"] for r in t["reports"].values()), t
            with hf.open(path) as snap:
                snap.verify()
            golden = path
            continue
        dead = t["kill"][0]
        survivor = 1 - dead
        assert t["status"][str(dead)] == "killed", t
        assert t["status"][str(survivor)] == "exit 0", t  # no hang: the collective fails fast
        rep = t["reports"][str(survivor)]
        assert rep is not None and rep["ok"] is False, t
        print(f"\ngloo {t['kill']}: survivor rank {survivor} got {rep['error']}: {rep['message'][:120]}")
        assert not os.path.lexists(path), t
        assert rep["typed"] and rep["error"] in ("RankFailedError", "HsnapIOError"), rep  # a typed refusal
        items = hgc.scan(t["dir"])
        if survivor == 0:  # rank 0 lived: it removed the staging directory itself
            assert items == [] and os.listdir(t["dir"]) == [], items
            continue
        assert [i.kind for i in items] == ["staging"] and len(os.listdir(t["dir"])) == 1, items
        staging = items[0]
        # no reader accepts the staging directory unless it is complete (killed just before the rename)
        verdict = cc._reader_verdict(staging.path, golden)
        assert verdict == ("complete" if t["kill"][1] == "before-dir-rename" else "refused"), (t["kill"], verdict)
        # named after the snapshot id: the only pids are those of temporaries inside (a dead rank's)
        print(f"  staging pids {staging.pids} alive {staging.alive}: default gc {'removes' if staging.removable else 'keeps'} it")
        removed = hgc.collect(t["dir"], remove=True, older_than=0)
        if verdict == "complete":  # a complete set never renamed: gc cannot tell it from a committed one, keeps it
            assert staging.reason.startswith(cc.COMPLETE_LEFTOVER) and [i.action for i in removed] == ["kept"], removed
            continue
        done = {os.path.basename(f.path) for f in staging.files if f.reason == hgc.COMPLETE_INSIDE}
        if done:  # complete rank files (and a manifest's temporary): kept with the marker, the rest removed (spec 8.1)
            manifest_tmp = {n for n in os.listdir(staging.path) if (hgc.parse_name(n) or "xx")[1] == cc.MANIFEST_NAME}
            assert [i.action for i in removed] == ["kept"] and set(os.listdir(staging.path)) == done | manifest_tmp | {cc.PENDING_MARKER}, removed
            continue
        assert staging.removable == (staging.alive is False)
        assert [i.action for i in removed] == ["removed"], removed
        assert os.listdir(t["dir"]) == []
    assert golden is not None
