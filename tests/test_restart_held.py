"""hsnap_sglang.restart without a server: what the resume at start holds, when an attach may take it, and the typed
refusals (the engine test, tests/engine/test_hsnap_rolling_restart.py, runs it in real servers)."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")

from hsnap_sglang import client, restart  # noqa: E402
from hsnap_sglang.errors import RequestBusyError, UnknownRequestError  # noqa: E402


def _event(rid: str, n: int, finish=None) -> dict:
    return {"text": "x" * n, "output_ids": list(range(n)), "meta_info": {"id": rid, "finish_reason": finish}}


@pytest.fixture
def fake_resume(monkeypatch):
    """client.resume replaced by a script: the report, then events; each step records what restart says meanwhile."""
    seen: list = []

    def run(report, events):
        def resume(url, path, *, on_chunk, on_start, timeout, api_key):
            on_start(report)
            seen.append(("reported", restart.resuming()))
            for ev in events:
                on_chunk(ev["meta_info"]["id"], "", [], ev)
                seen.append((ev["meta_info"]["id"], restart.resuming()))

        monkeypatch.setattr(client, "resume", resume)
        monkeypatch.setattr(restart, "_answers", lambda url: True)
        monkeypatch.setattr(restart, "_held", {})
        restart.resume_all("http://127.0.0.1:1", "restart", None)
        return seen

    return run


def test_a_named_report_holds_each_request_and_attach_takes_it_once(fake_resume):
    report = [{"path": "/r/a.hsnap", "ok": True, "result": {"rid": "a"}}, {"path": "/r/b.hsnap", "ok": False, "error": {"type": "SnapshotClaimedError"}}]
    seen = fake_resume(report, [_event("a", 1), _event("a", 2, {"type": "length"})])
    assert seen[0] == ("reported", False)  # the report named what is held: an attach need not wait
    h = restart.take("a")
    assert (h.path, h.done, h.event["output_ids"]) == ("/r/a.hsnap", True, [0, 1])
    with pytest.raises(RequestBusyError):
        restart.take("a")
    restart.release(h)  # its client went away mid-stream: another may attach
    assert restart.take("a") is h
    with pytest.raises(UnknownRequestError):
        restart.take("b")  # claimed by a client first: not held here


def test_a_truncated_report_keeps_attaches_waiting_until_each_request_has_spoken(fake_resume):
    seen = fake_resume({"truncated": True, "resumed": 2}, [_event("a", 1), _event("b", 1), _event("a", 2)])
    assert seen == [("reported", True), ("a", True), ("b", False), ("a", False)]
    assert restart.held("a") is not None and restart.held("b") is not None
    assert restart.held("b").done  # the stream ended: so did every request it carried
    assert not restart.resuming()


class _ServerArgs:
    host, port = "127.0.0.1", 30001


class _Manager:
    """What resume_one reads of SGLang's TokenizerManager before it registers a request: its rids and its address."""

    def __init__(self, rids):
        self.rid_to_state = dict.fromkeys(rids, object())
        self.server_args = _ServerArgs()


@pytest.mark.parametrize("claimed_first", [True, False], ids=["claimed by the resume at start", "not claimed"])
def test_a_resume_of_a_rid_this_server_runs_is_refused_as_claimed_when_it_is(tmp_path, monkeypatch, claimed_first):
    """The client of a rolling restart attaches when its resume is refused as claimed; the server's own resume at
    start registers the rid right after claiming it, so the claim must be what a resume checks first."""
    import asyncio

    from hsnap_io.sglang_env import import_sglang, sglang_available

    if not sglang_available():
        pytest.skip("SGLang not installed: the frontend imports its message classes")
    import_sglang()  # SGLang's configs import torchvision: hsnap's placeholders where it is absent
    from hsnap_sglang import claims, frontend

    snap = tmp_path / "roll-3.hsnap"
    snap.write_bytes(b"x")
    monkeypatch.setattr(frontend, "read_resume_info", lambda path: {"rid": "roll-3"})
    if claimed_first:
        claims.claim(str(snap), {"server": "127.0.0.1:30001", "host": "here", "pid": 1})
    marker = tmp_path / "roll-3.hsnap.claimed"
    before = marker.read_bytes() if claimed_first else None
    fe = frontend.HsnapFrontend(_Manager(["roll-3"]))
    with pytest.raises(claims.SnapshotClaimedError if claimed_first else RequestBusyError) as e:
        asyncio.run(fe.resume_one(str(snap), stream=True, text_in_logprobs=False))
    assert e.value.field == ("claim" if claimed_first else "request.rid"), e.value
    # a refused resume leaves the claim as it found it: the first claimant's, or none
    assert (marker.read_bytes() if marker.exists() else None) == before
