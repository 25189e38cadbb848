"""Crash-safe checkpoints and a dedup drain in SGLang's real server.

Two real servers (``python -m hsnap_sglang.serve`` with the plug-in on; bfloat16, chunked prefill, SGLang's strict
idle memory check on), each a module fixture:

1. S1: three requests sharing a 32-token prefix are drained with ``dedup`` (pages of 16 positions) into a directory;
   then request ``c`` streams with checkpoints every ``CK_M`` output tokens, and S1 is SIGKILLed (its whole process
   group) at a random point mid-decode.
2. S2, fresh: the newest committed link of ``c`` is resumed (the client giving what its cut stream had), then the
   drained directory; uninterrupted references computed afterwards in S2.

Exactness (tokens and logprobs bit-identical) rests on what hsnap_sglang/README.md says: bfloat16, batch-invariant
numerics here, the same thread count, no radix-cache hit in either run (the radix cache is off in both servers).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from engine_support import retire
from hsnap_support import Stream, hsnap_server, linkgate_env, paced, payload, prompt, references, start_together, stats, tokens, wait_idle, wait_links

from hsnap_format import open_chain, open_snapshot
from hsnap_format.checkpoints import newest_links, parse_link
from hsnap_sglang import client
from hsnap_sglang.jobs import PROOF_HERE_BYTES_ENV

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PAGE = 16
SHARED = prompt(51, 2 * PAGE)  # two full pages shared by the three drained requests
DEDUP = {f"p{i}": (SHARED + prompt(60 + i, 8), 40 + 8 * i) for i in range(3)}  # 3 x 40 prompt tokens: one prefill chunk
CK_PROMPT, CK_N, CK_M = prompt(71, 30), 160, 8
CK_PACE_S = 0.03  # seconds per forward while c is checkpointed: its 160 tokens last 4.8 s at least
GATED_N = 300
# seconds per forward while a link or a proof is held: GATED_N tokens take 6 s at least, so the held request (or the
# bystander) still decodes when the pause, the restart or the resume lands, on any load
GATED_PACE_S = 0.02


@pytest.fixture(scope="module")
def servers(tiny_model_dir, work):
    """S1 (killed) and S2 (a fresh server: it knows nothing of the requests until they are resumed there),
    started side by side (a start is mostly imports)."""
    (work / "gate").mkdir()
    started = {"s1": hsnap_server(tiny_model_dir, work / "s1.log", radix=False),
               # every resume proved off the scheduler thread (the tiny files here would be proved on it)
               "s2": hsnap_server(tiny_model_dir, work / "s2.log", radix=False,
                                  env={**linkgate_env(work / "gate"), PROOF_HERE_BYTES_ENV: "0"})}
    start_together(*started.values())
    yield started
    retire(*started.values())


@pytest.fixture(scope="module")
def crashed(servers, work):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    s1 = servers["s1"]
    try:
        # a dedup drain of three requests sharing a prefix
        shared = {rid: Stream(s1.url, payload(rid, ids, n)) for rid, (ids, n) in DEDUP.items()}
        with paced(s1.url):
            for st in shared.values():
                st.start()
            for st in shared.values():
                st.wait_tokens(12)  # 51+ committed positions: 2 shared pages and 1 own each
            drained = client.drain(s1.url, str(work / "drained"), dedup=True, page_size=PAGE)
        for st in shared.values():
            st.finish()
        idle = wait_idle(s1.url)
        # checkpoints every CK_M tokens, then SIGKILL mid-decode
        c = Stream(s1.url, payload("c", CK_PROMPT, CK_N))
        with paced(s1.url, CK_PACE_S):  # (an unpaced request finished its 160 tokens before 3 links were written)
            c.start()
            c.wait_tokens(2)
            first = client.checkpoint(s1.url, "c", str(work / "ck"), every=CK_M)
            kill_at = rng.randrange(first["output_tokens"] + 2 * CK_M + 1, CK_N - 12)
            c.wait_tokens(kill_at)
            # the link writer runs off the scheduler's path and may trail the decode by a link or two: kill once 3
            # are written (the request decodes on meanwhile)
            wait_links(s1.url, "c", 3, stream=c)
            during = stats(s1.url)["checkpoints"]  # the links committed before the kill (a later one may commit meanwhile)
            alive = s1.crash()
        c.join(60)
    finally:
        s1.stop()
    return {"seed": seed, "drained": drained, "idle": idle, "shared": shared, "c": c, "first": first, "kill_at": kill_at,
            "during": during, "alive": alive, "log": s1.log_tail()}


@pytest.fixture(scope="module")
def resumed(servers, work, crashed):
    s2 = servers["s2"]
    try:
        cut = crashed["c"].events[-1]  # what the client of c had when the server died
        had = (len(cut.get("text") or ""), len(cut.get("output_ids") or []))
        chunks = []
        run_c = client.resume(s2.url, str(work / "ck"), seen=had, on_chunk=lambda rid, text, ids, e: chunks.append((text, ids)))
        forwards = stats(s2.url, "c")["forwards"]
        run_d = client.resume(s2.url, str(work / "drained"))
        idle = wait_idle(s2.url)
        ref_c = Stream(s2.url, payload("c-ref", CK_PROMPT, CK_N))
        ref_c.start()
        ref_c.finish()
        refs = references(s2.url, DEDUP)
        gated = _pause_while_a_link_is_written(s2, work)
        restarted = _restart_while_a_link_is_written(s2, work)
        proving = _resume_while_its_proof_is_held(s2, work)
    finally:
        s2.retire()  # stopped in the background: nothing here waits on its exit
    return {"had": had, "cut": cut, "chunks": chunks, "run_c": run_c, "forwards": forwards, "run_d": run_d, "idle": idle,
            "ref_c": ref_c.final, "refs": refs, "gated": gated, "restarted": restarted, "proving": proving}


def _wait_for(path: Path, what, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared: {what()}"
        time.sleep(0.05)


def _resume_while_its_proof_is_held(s2, work) -> dict:
    """g's final snapshot resumed while its proof (the snapshot opened, checked, every byte read and hashed) is held
    by the server's test gate, with a bystander decoding; then let go; g's uninterrupted reference after."""
    gate = work / "gate"
    hold = gate / "g-final.hsnap.hold"
    out: dict = {}
    with paced(s2.url, GATED_PACE_S):
        bystander = Stream(s2.url, payload("by", prompt(81, 20), 400))
        bystander.start()
        bystander.wait_tokens(2)
        hold.touch()
        resume = threading.Thread(target=lambda: out.update(run=client.resume(s2.url, str(work / "g-final.hsnap"))), daemon=True)
        resume.start()
        _wait_for(gate / "g-final.hsnap.held", lambda: os.listdir(gate))
        # the proof started ahead, when the route was called: the resume's own message comes once g is claimed and registered
        deadline = time.monotonic() + 60
        while "g" not in (listed := stats(s2.url)["requests"])["resuming"] and time.monotonic() < deadline:
            time.sleep(0.02)
        during = bystander.decoded_meanwhile(10)
        still_held = resume.is_alive() and hold.exists()
        hold.unlink()
    resume.join(300)
    bystander.finish()
    ref = Stream(s2.url, payload("g-ref", CK_PROMPT, GATED_N))
    ref.start()
    return {"during": during, "still_held": still_held, "run": out.get("run"), "ref": ref.finish().final, "idle": wait_idle(s2.url),
            "listed": listed}


def _checkpointed_with_link_2_held(s2, gate, rid: str, ck) -> tuple:
    """``rid`` streaming, checkpointed into ``ck`` every 4 tokens, its second link held in the writer thread by the
    server's test gate (released by removing the returned hold file); (its stream, the hold, the first checkpoint's answer)."""
    hold = gate / f"{rid}.ck000002.hsnap.hold"
    hold.touch()
    stream = Stream(s2.url, payload(rid, CK_PROMPT, GATED_N))
    stream.start()
    stream.wait_tokens(2)
    first = client.checkpoint(s2.url, rid, str(ck), every=4)
    _wait_for(gate / f"{rid}.ck000002.hsnap.held", lambda: stats(s2.url)["checkpoints"])
    return stream, hold, first


def _pause_while_a_link_is_written(s2, work) -> dict:
    """Request g checkpointed every 4 tokens; its second link is held in the writer thread (the server's test gate)
    while the request decodes on; a pause of g is asked for and reaches the boundary, where it waits for the link
    (said by the gate) while the scheduler goes on — g decodes meanwhile, no link queued behind the pause; then the
    link is let go."""
    gate, ck = work / "gate", work / "ckg"
    out: dict = {}
    with paced(s2.url, GATED_PACE_S):
        g, hold, first = _checkpointed_with_link_2_held(s2, gate, "g", ck)
        during = stats(s2.url)["checkpoints"]["g"]
        pause = threading.Thread(target=lambda: out.update(pause=client.pause(s2.url, "g", str(work / "g-final.hsnap"))), daemon=True)
        pause.start()
        _wait_for(gate / "g.ck000002.hsnap.export-waiting", lambda: os.listdir(gate))
        decoded_while_waiting = g.decoded_meanwhile(5)
        files_while_held = sorted(os.listdir(ck))
        hold.unlink()
        pause.join(300)
    g.finish()
    idle = wait_idle(s2.url)
    return {"first": first, "during": during, "pause": out.get("pause"), "files_while_held": files_while_held,
            "decoded_while_waiting": decoded_while_waiting,
            "files": sorted(os.listdir(ck)), "final": g.final, "idle": idle}


def _restart_while_a_link_is_written(s2, work) -> dict:
    """Request h checkpointed every 4 tokens; its second link held in the writer thread; its checkpoints stopped and
    started again into the same directory meanwhile: the restart waits for the link on the way (its number comes
    after it) while the scheduler goes on; then the link is let go."""
    gate, ck = work / "gate", work / "ckh"
    out: dict = {}
    with paced(s2.url, GATED_PACE_S):
        h, hold, first = _checkpointed_with_link_2_held(s2, gate, "h", ck)
        stopped = client.checkpoint(s2.url, "h", str(ck), every=0)
        restart = threading.Thread(target=lambda: out.update(restart=client.checkpoint(s2.url, "h", str(ck), every=4)), daemon=True)
        restart.start()
        decoded, still_waiting = h.decoded_meanwhile(5), restart.is_alive()
        files_while_held = sorted(n for n in os.listdir(ck) if not n.startswith("."))
        hold.unlink()
        restart.join(300)
    h.finish()
    return {"first": first, "stopped": stopped, "restart": out.get("restart"), "decoded": decoded, "still_waiting": still_waiting,
            "files_while_held": files_while_held, "idle": wait_idle(s2.url)}


def test_sigkill_mid_decode_resumes_from_the_newest_link_exactly(crashed, resumed, work):
    why = f"seed {crashed['seed']}, killed at {crashed['kill_at']} tokens; log: {crashed['log'][-800:]}"
    assert crashed["alive"] == [], why
    c = crashed["c"]
    assert c.events[-1]["meta_info"]["finish_reason"] is None, why  # the stream was cut mid-decode: the request never finished
    # the newest committed link is the highest number; a delta chain down to the first (plain) link, intact
    newest = newest_links(str(work / "ck"))["c"]
    links = sorted(parse_link(n)[1] for n in os.listdir(work / "ck") if parse_link(n))
    assert parse_link(os.path.basename(newest))[1] == links[-1] == len(links) >= 3, why
    with open_chain(newest) as chain:
        assert len(chain) == len(links) and chain.links[0].base is None
        chain.verify()
        link_outputs = chain.head.request["output_tokens"]
    # every link committed before the kill survived it; the tokens lost are those decoded since the newest one (the
    # writer never holds the decode back: CK_M when it keeps up, more on a loaded machine - bench/CHECKPOINT.md)
    assert link_outputs >= crashed["during"]["c"]["last_output_tokens"], why
    assert 0 <= resumed["had"][1] - link_outputs, why
    info = resumed["run_c"].info[0]
    assert info["ok"] and info["path"] == newest and info["result"]["committed_positions"] == len(CK_PROMPT) + link_outputs - 1
    # tokens and logprobs identical to an uninterrupted run; the client's text continues with nothing repeated or missing
    ref = resumed["ref_c"]
    final = resumed["run_c"].final
    assert tokens(final) == tokens(ref), why
    text = (resumed["cut"].get("text") or "") + "".join(t for t, _ in resumed["chunks"])
    ids = list(resumed["cut"].get("output_ids") or []) + [i for _, chunk in resumed["chunks"] for i in chunk]
    assert text == ref["text"] and ids == ref["output_ids"], why
    assert final["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert resumed["forwards"]["extend"] == 0  # continued by decoding: no history position recomputed


def test_checkpoints_run_while_the_request_decodes(crashed):
    first, during = crashed["first"], crashed["during"]
    assert first["keep_running"] is True and first["link"] == 1 and first["base"] is None and first["every"] == CK_M
    assert set(during) == {"c"} and during["c"]["every"] == CK_M and during["c"]["links"] >= 3
    assert during["c"]["last_output_tokens"] >= first["output_tokens"] + 2 * CK_M


def test_dedup_drain_stores_shared_pages_once_and_resumes_all(crashed, resumed, work):
    d = crashed["drained"]
    assert d["ok"] and {i["rid"] for i in d["items"]} == set(DEDUP), d
    dd = d["dedup"]
    full_pages = {i["rid"]: i["result"]["committed_positions"] // PAGE for i in d["items"]}
    shared = len(SHARED) // PAGE
    assert all(n > shared for n in full_pages.values())
    assert dd["page_size"] == PAGE and dd["pages_put"] == shared + sum(n - shared for n in full_pages.values())
    assert dd["pages_reused"] == shared * (len(DEDUP) - 1)  # the prefix's pages put once, referenced three times
    page_dir = work / "drained" / "pages"
    page_files = [p for p in page_dir.iterdir() if p.is_file()]
    assert len(page_files) == dd["pages_put"] and sum(p.stat().st_size for p in page_files) == dd["page_bytes_put"]
    files = sum((work / "drained" / Path(i["path"]).name).stat().st_size for i in d["items"])
    assert dd["file_bytes"] == files and dd["bytes_written"] == files + dd["page_bytes_put"] < dd["single_bytes"]
    for i in d["items"]:
        with open_snapshot(i["path"]) as snap:
            assert snap.pages is not None and snap.pages.count == full_pages[i["rid"]]
    checks = crashed["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks
    # every drained request resumed, exactly
    run = resumed["run_d"]
    assert all(item["ok"] for item in run.info) and set(run.finals) == set(DEDUP)
    for rid, final in run.finals.items():
        assert tokens(final) == resumed["refs"][rid], rid
    checks = resumed["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks


def test_pause_while_a_link_is_being_written_waits_for_it_and_no_link_follows(resumed, work):
    """A pause of a checkpointed request whose link is in the writer thread: the link is committed first (never
    after the request's slots are released), the final snapshot continues it, and no later link is written; the
    scheduler does not wait for the writer meanwhile (the request itself decodes on)."""
    g = resumed["gated"]
    assert g["first"]["link"] == 1 and g["during"]["links"] == 1, g
    assert g["decoded_while_waiting"] >= 5, g["decoded_while_waiting"]
    assert [n for n in g["files_while_held"] if not n.startswith(".")] == ["g.ck000001.hsnap"], g  # link 2 not yet committed
    pause = g["pause"]
    assert pause is not None and pause["keep_running"] is False, g
    assert g["files"] == ["g.ck000001.hsnap", "g.ck000002.hsnap"], g["files"]  # committed, no temporary, no link 3
    assert g["final"]["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    link2 = str(work / "ckg" / "g.ck000002.hsnap")
    with open_chain(link2) as chain:
        assert len(chain) == 2 and chain.links[0].base is None
        chain.verify()
        at_link = chain.head.request["output_tokens"]
    with open_snapshot(pause["path"]) as final:
        final.verify()
        outputs = list(final.read("request.output_ids"))
    with open_snapshot(link2) as snap:
        assert list(snap.read("request.output_ids")) == outputs[:at_link] and at_link <= len(outputs)
    assert pause["committed_positions"] >= len(CK_PROMPT) + at_link - 1
    assert "g" not in g["idle"]["checkpoints"]
    checks = g["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks


def test_checkpoints_restarted_while_a_link_is_written_number_after_it_and_hold_up_nothing(resumed):
    """Checkpoints stopped and started again while a link of the earlier ones is in the writer thread: the restart is
    answered once that link is committed and numbers its first link after it (not over it); the scheduler does not
    wait for the writer meanwhile (the request decodes on)."""
    r = resumed["restarted"]
    assert r["first"]["link"] == 1 and r["stopped"]["stopped"] is True, r
    assert r["still_waiting"] and r["decoded"] >= 5, r
    assert r["files_while_held"] == ["h.ck000001.hsnap"], r
    assert r["restart"] is not None and r["restart"]["link"] == 3, r
    checks = r["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks


def test_a_resume_whose_snapshot_is_still_being_read_holds_up_no_other_request(resumed):
    """A resume's proof runs off the scheduler thread: held (the test gate stands for a slow disk or object store),
    another request decodes on; let go, the resumed request continues exactly and nothing leaks."""
    p = resumed["proving"]
    assert p["still_held"] and p["during"] >= 10, p["during"]  # the scheduler went on while the proof was held
    assert p["listed"]["resuming"] == ["g"] and "g" not in p["listed"]["running"], p["listed"]  # an operator sees it
    assert p["idle"]["requests"]["resuming"] == []
    run = p["run"]
    assert run is not None and tokens(run.final) == tokens(p["ref"])
    t = run.info["result"]["timings"]
    assert t["prove_s"] >= 0.05 and abs(t["prove_s"] + t["pickup_s"] + t["upload_s"] - t["restore_s"]) < 1e-3, t
    assert t["ahead_s"] > 0 and t["proof_s"] >= t["prove_s"] + t["ahead_s"] - 1e-3, t  # started when the route was called
    checks = p["idle"]["checks"]
    assert checks["pool_leak"] is False and checks["req_rows_ok"] is True, checks
