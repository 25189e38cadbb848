"""A rolling restart: ``kill -TERM old; start new``, nothing lost.  The old server drains every request on SIGTERM
(``HSNAP_DRAIN_ON_SIGTERM``); the new one, started once the old one has exited, resumes every snapshot there when it
is ready (``HSNAP_RESUME_ON_START``) and holds each request for its client.  Four clients stream through
``hsnap_sglang.client.generate``: each waits for the new server and goes on there — resuming the snapshot itself, or
attaching to the request the server resumed first — as one stream with the tokens, log-probabilities and text of an
uninterrupted run.  A fifth request's client is a plain ``/generate`` stream that ended with the hand-off: it
attaches by rid (``POST /hsnap/attach``) and gets the rest."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from hsnap_support import Stream, flush_cache, hsnap_server, paced, payload, prompt, stats, tokens, wait_idle

from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

N = 160
FOLLOWED = {f"roll-{i}": prompt(130 + i, 20) for i in range(4)}
HELD = ("roll-held", prompt(140, 20))  # its client attaches by rid
CAPACITY = ("--max-total-tokens", "2500", "--max-mamba-cache-size", "15", "--max-running-requests", "5")  # 3 Mamba slots a request


@pytest.fixture(scope="module")
def rolled(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("rolling")
    root = work / "root"
    root.mkdir()
    old = hsnap_server(tiny_model_dir, work / "old.log", *CAPACITY, "--log-level", "info",
                       env={"HSNAP_ROOT": str(root), "HSNAP_DRAIN_ON_SIGTERM": "restart"})
    new = hsnap_server(tiny_model_dir, work / "new.log", *CAPACITY, "--log-level", "info",
                       env={"HSNAP_ROOT": str(root), "HSNAP_RESUME_ON_START": "restart"})
    old.start()
    try:
        everyone = {**FOLLOWED, HELD[0]: HELD[1]}
        refs = {rid: Stream(old.url, payload(f"{rid}-ref", ids, N)) for rid, ids in everyone.items()}  # one batch, uninterrupted
        for st in refs.values():
            st.start()
        refs = {rid: st.finish().final for rid, st in refs.items()}
        flush_cache(old.url)
        runs: dict = {}

        def follow(rid: str) -> None:
            try:
                runs[rid] = client.generate(old.url, payload(rid, FOLLOWED[rid], N), next_url=new.url, wait_s=600)
            except Exception as e:  # noqa: BLE001 - the test reads it
                runs[rid] = e

        threads = [threading.Thread(target=follow, args=(rid,), daemon=True) for rid in FOLLOWED]
        held = Stream(old.url, payload(HELD[0], HELD[1], N))
        with paced(old.url, 0.05):  # 160 tokens take 8 s at least: SIGTERM lands while all five decode
            held.start()
            for t in threads:
                t.start()
            held.wait_tokens(3)
            deadline = time.monotonic() + 120
            while len(stats(old.url)["requests"]["running"]) < 5:
                assert time.monotonic() < deadline, stats(old.url)["requests"]
                time.sleep(0.05)
            old.proc.send_signal(signal.SIGTERM)
            old_exit = old.proc.wait(timeout=120)
        held.finish()
        drained = sorted(p.name for p in (root / "restart").iterdir())
        t0 = time.monotonic()
        new.start()
        cut = held.events[-1]
        deadline = time.monotonic() + 120
        while True:  # the server holds it once its resume of the directory has begun
            try:
                attached = client.attach(new.url, HELD[0], seen=(len(cut.get("text") or ""), len(cut.get("output_ids") or [])))
                break
            except client.ServerError as e:
                assert e.error_type == "UnknownRequestError" and time.monotonic() < deadline, e
                time.sleep(0.2)
        for t in threads:
            t.join(600)
        back_s = time.monotonic() - t0
        again = error_of_attach(new.url, HELD[0])
        unknown = error_of_attach(new.url, "never-here")
        idle = wait_idle(new.url)
    finally:
        old.stop()
        new.retire()
    return {"refs": refs, "runs": runs, "held": held, "attached": attached, "drained": drained, "old_exit": old_exit, "new_url": new.url,
            "dir": root / "restart",
            "back_s": back_s, "again": again, "unknown": unknown, "idle": idle, "new_log": new.log_path.read_text(errors="replace")}


def error_of_attach(url: str, rid: str):
    try:
        client.attach(url, rid)
    except client.ServerError as e:
        return e
    return None


def test_sigterm_drained_every_request_and_the_old_server_exited(rolled):
    assert rolled["old_exit"] is not None
    assert rolled["drained"] == sorted(f"{rid}.hsnap" for rid in [*FOLLOWED, HELD[0]])
    assert rolled["held"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"


def test_every_followed_stream_goes_on_in_the_new_server_exactly(rolled):
    for rid in FOLLOWED:
        run, ref = rolled["runs"][rid], rolled["refs"][rid]
        assert isinstance(run, client.GenerateRun), run
        assert run.hand_offs == [(rolled["new_url"], str(rolled["dir"] / f"{rid}.hsnap"))], run.hand_offs
        assert run.finish_reason["type"] == "length"
        assert run.output_ids == ref["output_ids"] and tokens(run.final) == tokens(ref), rid
        assert run.text == ref["text"], rid


def test_a_plain_client_attaches_by_rid_and_gets_the_rest(rolled):
    held, attached, ref = rolled["held"], rolled["attached"], rolled["refs"][HELD[0]]
    final = attached.finals[HELD[0]]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["output_ids"] == ref["output_ids"] and tokens(final) == tokens(ref)
    assert final["text"] == ref["text"] and final["text"].startswith(held.events[-1].get("text") or "")


def test_a_held_request_has_one_client_and_an_unknown_rid_is_refused_typed(rolled):
    assert rolled["again"] is not None and rolled["again"].status == 409 and rolled["again"].error_type == "RequestBusyError"
    assert rolled["unknown"] is not None and rolled["unknown"].status == 404 and rolled["unknown"].error_type == "UnknownRequestError"


def test_the_new_server_resumed_the_directory_and_ends_consistent(rolled):
    assert "hsnap: resuming every snapshot in restart (HSNAP_RESUME_ON_START)" in rolled["new_log"], rolled["new_log"][-3000:]
    checks = rolled["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks
