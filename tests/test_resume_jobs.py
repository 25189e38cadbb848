"""Where a resume's proof runs (hsnap_sglang.jobs): on the scheduler thread for a small local file, on a worker of its
own otherwise; and the job the scheduler polls."""

from __future__ import annotations

import os
import threading

import pytest

from hsnap_format.errors import HsnapError
from hsnap_sglang.jobs import PROOF_HERE_BYTES, PROOF_HERE_BYTES_ENV, Job, proof_here_bytes, proves_here


def test_a_small_local_file_is_proved_in_place_a_large_one_or_an_object_or_a_set_off_the_thread(tmp_path):
    small, large, tp_set = tmp_path / "small.hsnap", tmp_path / "large.hsnap", tmp_path / "set"
    small.write_bytes(b"x" * 1000)
    with open(large, "wb") as f:
        f.truncate(PROOF_HERE_BYTES + 1)
    tp_set.mkdir()
    assert proves_here(str(small), PROOF_HERE_BYTES)
    assert not proves_here(str(large), PROOF_HERE_BYTES)
    assert proves_here(str(large), PROOF_HERE_BYTES + 1)
    assert not proves_here(str(small), 0)  # the operator's 0: every resume off the scheduler thread
    assert not proves_here(str(tp_set), PROOF_HERE_BYTES)
    assert not proves_here("s3://bucket/snaps/x.hsnap", PROOF_HERE_BYTES)
    assert proves_here(str(tmp_path / "missing.hsnap"), PROOF_HERE_BYTES)  # refused by the proof at once
    link = tmp_path / "req-7.ck000003.hsnap"
    link.write_bytes(b"x" * 1000)
    assert not proves_here(str(link), PROOF_HERE_BYTES)  # a small link: the chain below it is read too


@pytest.mark.parametrize(("given", "expected"), [(None, PROOF_HERE_BYTES), ("0", 0), (" 1048576 ", 1048576), ("-1", PROOF_HERE_BYTES),
                                                 ("4MiB", PROOF_HERE_BYTES), ("", PROOF_HERE_BYTES),
                                                 ("\u00b2", PROOF_HERE_BYTES)])
def test_the_operators_byte_count_is_read_and_anything_else_keeps_the_default(given, expected, caplog):
    env = {} if given is None else {PROOF_HERE_BYTES_ENV: given}
    assert proof_here_bytes(env) == expected
    warned = any(PROOF_HERE_BYTES_ENV in r.getMessage() for r in caplog.records)
    assert warned == (given is not None and expected == PROOF_HERE_BYTES)


def test_a_job_runs_off_the_callers_thread_and_keeps_its_result_or_error():
    gate, threads = threading.Event(), []

    def held():
        threads.append(threading.current_thread())
        gate.wait(10)
        return "proved"

    job = Job(held, "hsnap-resume-test")
    assert not job.wait(0.05) and not job.done  # held: the caller goes on
    gate.set()
    assert job.wait(10) and job.result == "proved" and job.error is None
    assert threads[0] is not threading.current_thread() and threads[0].name == "hsnap-resume-test"
    assert job.ended is not None and job.ended >= job.started

    def refused():
        raise HsnapError("/s/x.hsnap", "identity", "this server's", "another")

    failed = Job(refused, "hsnap-resume-test")
    assert failed.wait(10) and isinstance(failed.error, HsnapError) and failed.result is None


def test_a_job_run_here_is_done_when_made_and_an_interrupt_is_not_swallowed():
    here = Job.run_here(lambda: threading.current_thread())
    assert here.done and here.result is threading.current_thread() and here.wait(0)
    err = Job.run_here(lambda: os.stat("/nonexistent/hsnap"))
    assert err.done and isinstance(err.error, FileNotFoundError)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Job.run_here(interrupted)
    refused = Job.failed(HsnapError(None, "request.rid", "a rid no request of this server has", "r"))
    assert refused.done and refused.wait(0) and refused.result is None and refused.error.field == "request.rid"


def test_at_most_two_proofs_run_at_once_and_the_rest_start_in_order():
    """Each proof off the scheduler thread holds a staging buffer of up to 128 MiB: the scheduler starts at most
    MAX_PROOFS_IN_FLIGHT, the others as places free up, oldest first."""
    from types import SimpleNamespace

    from hsnap_io.sglang_env import import_sglang, sglang_available

    if not sglang_available():
        pytest.skip("SGLang not installed: the scheduler imports its classes")
    import_sglang()
    from hsnap_sglang.jobs import Resuming
    from hsnap_sglang.scheduler import MAX_PROOFS_IN_FLIGHT, HsnapScheduler

    assert MAX_PROOFS_IN_FLIGHT == 2
    gates = {i: threading.Event() for i in range(4)}
    started: list[int] = []

    def starter(i):
        def start():
            started.append(i)
            return Job(lambda: gates[i].wait(10), f"hsnap-resume-test-{i}")

        return start

    hs = SimpleNamespace(resuming={f"op{i}": Resuming(None, 0.0, None, start=starter(i)) for i in range(4)})
    HsnapScheduler._start_proofs(hs)
    assert started == [0, 1] and [r.job is None for r in hs.resuming.values()] == [False, False, True, True]
    HsnapScheduler._start_proofs(hs)
    assert started == [0, 1]  # both places still taken
    gates[1].set()
    assert hs.resuming["op1"].job.wait(10)
    HsnapScheduler._start_proofs(hs)
    assert started == [0, 1, 2] and hs.resuming["op3"].job is None
    for g in gates.values():
        g.set()


def test_a_discarded_proof_is_closed_once_it_ends_and_never_taken():
    """A proof whose request went away (a follow refused, a retracted request aborted) is closed: at once when done,
    else by the job's end — its open files and staging buffer are not left to the garbage collector."""

    class Proof:
        closed = 0

        def close(self):
            Proof.closed += 1

    gate = threading.Event()
    running = Job(lambda: (gate.wait(10), Proof())[1], "hsnap-resume-test")
    running.discard()
    assert Proof.closed == 0  # still being read: nothing to close yet, and the caller did not wait
    gate.set()
    deadline = threading.Event()
    for _ in range(200):
        if Proof.closed:
            break
        deadline.wait(0.01)
    assert Proof.closed == 1 and running.result is None
    done = Job.run_here(Proof)
    done.discard()
    assert Proof.closed == 2 and done.result is None
    Job.run_here(lambda: 1 / 0).discard()  # a proof that failed has nothing to close
    assert Proof.closed == 2


def test_a_proof_started_ahead_of_its_resume_is_held_bounded_given_back_on_drop_and_after_its_time(tmp_path, monkeypatch):
    """HsnapProveAheadReqInput: the scheduler proves the snapshot while the HTTP process reads, claims and registers.
    At most MAX_PROVED_AHEAD are held (more are not started: their resumes prove as they arrive); a path outside the
    root is not proved; ``drop`` gives one back at once (closed), and one no resume took is given back after
    PROVED_AHEAD_TTL_S."""
    from types import SimpleNamespace

    from hsnap_io.sglang_env import import_sglang, sglang_available

    if not sglang_available():
        pytest.skip("SGLang not installed: the scheduler imports its classes")
    import_sglang()
    from hsnap_sglang import scheduler as sched_mod
    from hsnap_sglang.confine import ROOT_ENV
    from hsnap_sglang.jobs import MAX_PROVED_AHEAD
    from hsnap_sglang.messages import HsnapProveAheadReqInput
    from hsnap_sglang.scheduler import HsnapScheduler

    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.hsnap").write_bytes(b"x" * 100)
    closed, proved = [], []

    class Proof:
        def __init__(self, path):
            self.path = path
            proved.append(path)

        def close(self):
            closed.append(self.path)

    hs = SimpleNamespace(proved_ahead={}, proof_here_bytes=1 << 20, tp_rank=0,
                         _resume_proof=lambda path, ipc, rid: (lambda: Proof(path)))
    hs._expire_proved_ahead = lambda: HsnapScheduler._expire_proved_ahead(hs)
    ahead = lambda op, path, **kw: HsnapScheduler.on_prove_ahead(hs, HsnapProveAheadReqInput(op_id=op, path=path, **kw))  # noqa: E731

    assert MAX_PROVED_AHEAD == 2
    ahead("op-a", "a.hsnap")
    ahead("op-b", "b.hsnap")
    ahead("op-c", "c.hsnap")  # a third: not started
    ahead("op-out", "../outside.hsnap")  # refused by the root: not proved (its resume answers the refusal)
    assert list(hs.proved_ahead) == ["op-a", "op-b"] and proved == [str(tmp_path / "a.hsnap"), str(tmp_path / "b.hsnap")]
    assert hs.proved_ahead["op-a"].path == str(tmp_path / "a.hsnap") and hs.proved_ahead["op-a"].job.done  # small: proved in place
    ahead("op-a", "", drop=True)
    assert list(hs.proved_ahead) == ["op-b"] and closed == [str(tmp_path / "a.hsnap")]
    ahead("op-a", "", drop=True)  # again (the resume took it, or it was given back): nothing
    assert closed == [str(tmp_path / "a.hsnap")]
    HsnapScheduler._expire_proved_ahead(hs)
    assert list(hs.proved_ahead) == ["op-b"]  # within its time
    monkeypatch.setattr(sched_mod, "PROVED_AHEAD_TTL_S", 0.0)
    HsnapScheduler._expire_proved_ahead(hs)
    assert hs.proved_ahead == {} and closed == [str(tmp_path / "a.hsnap"), str(tmp_path / "b.hsnap")]


def test_a_migrations_refusal_is_answered_once_the_marker_that_tells_the_other_side_is_written():
    """abandoned.json / refused.json are written off the scheduler thread; the caller's answer waits for them (at an
    iteration that finds the write ended), so a caller told "given up" finds the marker; nothing to write: at once."""
    from types import SimpleNamespace

    from hsnap_io.sglang_env import import_sglang, sglang_available

    if not sglang_available():
        pytest.skip("SGLang not installed: the scheduler imports its classes")
    import_sglang()
    from hsnap_sglang.scheduler import HsnapScheduler

    answered, gate = [], threading.Event()
    hs = SimpleNamespace(telling=[], answer=lambda op, **kw: answered.append((op, kw["ok"], kw["error"]["type"])))
    HsnapScheduler.answer_once_told(hs, None, "op-now", error={"type": "MigrationError"})
    assert answered == [("op-now", False, "MigrationError")] and hs.telling == []
    writing = Job(lambda: gate.wait(10), "hsnap-migration-abandon-test")
    HsnapScheduler.answer_once_told(hs, writing, "op-later", error={"type": "MigrationError"})
    HsnapScheduler.answer_told(hs)
    assert len(answered) == 1 and len(hs.telling) == 1  # the marker not written yet: no answer
    gate.set()
    assert writing.wait(10)
    HsnapScheduler.answer_told(hs)
    assert answered[-1] == ("op-later", False, "MigrationError") and hs.telling == []
