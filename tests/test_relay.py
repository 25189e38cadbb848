"""The relay of a live migration's target stream into the request's own stream (hsnap_sglang.relay), against a real
HTTP peer (an aiohttp server playing the target's /hsnap/follow and /hsnap/stats as a server does, and as one that
breaks, refuses or errs does), without SGLang: what reaches the client when the target's stream ends well, breaks
before the finish, sends an error event, refuses the follow, or never follows.  The whole path between two real
servers is tests/engine/test_hsnap_server.py's (relayed migrations out of O)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web

from hsnap_sglang import relay
from hsnap_sglang.client import HAND_OFF
from hsnap_sglang.confine import ALLOWED_PEERS_ENV, ConfinementError, peer_origin, resolve_peer
from hsnap_sglang.errors import RelayError, RequestBusyError, UnknownRequestError, error_dict

RID, CONTAINER = "r1", "/root/mig"


def _event(ids: list[int], finish=None) -> dict:
    return {"text": "".join(f"<{i}>" for i in ids), "output_ids": ids, "meta_info": {"id": RID, "finish_reason": finish}}


SOURCE = [_event([1]), _event([1, 2]), _event([1, 2, 3], {"type": HAND_OFF, "migration": CONTAINER, "path": CONTAINER + "/final.hsnap"})]
TARGET_WHOLE = [_event([1, 2, 3, 4]), _event([1, 2, 3, 4, 5]), _event([1, 2, 3, 4, 5, 6], {"type": "length", "length": 6})]


def _sse(events: list[dict], done: bool = True) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (b"data: [DONE]\n\n" if done else b"")


class Peer:
    """A target: ``mode`` says what its follow does (``whole``, ``broken``, ``short``, ``error_event``, ``refuse``,
    ``silent``)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.following, self.bodies, self.auth = mode, [], [], []

    async def follow(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.mode == "refuse":
            return web.json_response({"error": {"type": "RequestBusyError", "status": 409, "message": "rid: in use"}}, status=409)
        if self.mode == "silent":
            await asyncio.sleep(3600)
        self.following.append(body["rid"])
        await asyncio.sleep(0.05)  # the follow waits for the links
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "whole":
            await resp.write(_sse(TARGET_WHOLE))
        elif self.mode == "short":  # ends well, but before the request finished
            await resp.write(_sse(TARGET_WHOLE[:2]))
        elif self.mode == "error_event":
            await resp.write(_sse([TARGET_WHOLE[0], {"error": {"message": "aborted", "type": "invalid_request_error"}}]))
        else:  # broken: two events, then the connection goes (a target killed mid-stream)
            await resp.write(_sse(TARGET_WHOLE[:2], done=False))
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"follows": [{"dir": "x", "rid": r, "applied": 0} for r in self.following]})


async def _serve(peer: Peer):
    app = web.Application()
    app.router.add_post("/hsnap/follow", peer.follow)
    app.router.add_get("/hsnap/stats", peer.stats)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # a silent peer's handler is not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _frontend(obj) -> SimpleNamespace:
    tm = SimpleNamespace(rid_to_state={RID: SimpleNamespace(obj=obj)}, server_args=SimpleNamespace(admin_api_key="adm", api_key=None))
    return SimpleNamespace(tm=tm, relays={}, relayable={})


async def _source(events):
    for e in events:
        await asyncio.sleep(0.01)
        yield e


def _run(mode: str, *, stream: bool = True, monkeypatch=None):
    """The request's stream as its client gets it: (events, the error that ended it or None, the peer)."""
    async def main():
        peer = Peer(mode)
        runner, url = await _serve(peer)
        try:
            obj = SimpleNamespace(stream=stream, return_text_in_logprobs=False)
            fe = _frontend(obj)
            got, error = [], None
            responses = relay.relayed(fe, obj, _source(SOURCE))
            first = await responses.__anext__()  # the stream is live before the migrate call comes
            got.append(first)
            opened = None
            try:
                opened = await relay.open_relay(fe, RID, url, "mig", CONTAINER, timeout_s=5)
                async for e in responses:
                    got.append(e)
            except RelayError as e:
                error = e
                async for e2 in responses:  # a refused relay: the stream goes on here
                    got.append(e2)
            return got, error, peer, fe, opened
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_a_relayed_stream_goes_on_with_the_targets_events_to_the_finish():
    got, error, peer, fe, _ = _run("whole")
    assert error is None
    assert [e["output_ids"] for e in got] == [[1], [1, 2], [1, 2, 3], *[e["output_ids"] for e in TARGET_WHOLE]]
    assert [e["meta_info"]["finish_reason"] for e in got[:-1]] == [None] * (len(got) - 1)  # the hand-off as a plain chunk
    assert got[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert peer.bodies == [{"dir": "mig", "rid": RID, "stream": True, "timeout_s": 5, "return_text_in_logprobs": False}]
    assert peer.auth == ["Bearer adm"]  # the server's own admin key (no HSNAP_PEER_API_KEY)
    assert fe.relays == {} and fe.relayable == {}


def test_a_relayed_request_that_does_not_stream_gets_the_targets_last_event():
    got, error, _, _, _ = _run("whole", stream=False)
    assert error is None and got[-1] == TARGET_WHOLE[-1]
    assert HAND_OFF not in json.dumps(got[1:])


@pytest.mark.parametrize("mode, found", [("broken", "the connection failed"), ("short", "ended before the request finished"),
                                          ("error_event", "error: aborted")])
def test_a_target_stream_that_ends_before_the_finish_ends_the_clients_stream_with_a_typed_error(mode, found):
    got, err, peer, _, opened = _run(mode)
    assert opened is not None and isinstance(err, RelayError)  # it followed: the error came in the stream
    assert all(e["meta_info"]["finish_reason"] is None for e in got)  # nothing pretended to finish
    assert err.status_code == 502 and f"peer {opened.target.split('://')[1]}" in str(err) and found in str(err)
    assert error_dict(err)["type"] == "RelayError" and error_dict(err)["status"] == 502


def test_a_target_that_refuses_the_follow_refuses_the_migrate_and_the_stream_goes_on_here():
    got, error, _, fe, opened = _run("refuse")
    assert opened is None and isinstance(error, RelayError)
    assert error_dict(error)["remote"]["type"] == "RequestBusyError" and "refused (RequestBusyError)" in str(error)
    assert [e["meta_info"]["finish_reason"] for e in got][-1]["type"] == HAND_OFF  # no relay: the stream ends as without one
    assert fe.relays == {}


def test_a_target_that_never_follows_refuses_the_migrate_after_the_wait(monkeypatch):
    monkeypatch.setattr(relay, "FOLLOW_WAIT_S", 0.3)
    got, error, _, fe, opened = _run("silent")
    assert opened is None and isinstance(error, RelayError) and "following within 0.3 s" in str(error)
    assert fe.relays == {}


def test_only_a_request_streamed_here_and_only_once_is_relayable():
    async def main():
        obj = SimpleNamespace(stream=True, return_text_in_logprobs=False)
        fe = _frontend(obj)
        with pytest.raises(UnknownRequestError):  # no stream of it here (a batch's prompt, another worker's request)
            await relay.open_relay(fe, RID, "http://127.0.0.1:9", "mig", CONTAINER, timeout_s=5)
        with pytest.raises(UnknownRequestError):
            await relay.open_relay(fe, "other", "http://127.0.0.1:9", "mig", CONTAINER, timeout_s=5)
        fe.relayable[id(obj)] = obj
        fe.relays[RID] = relay.Relay(RID, "http://127.0.0.1:9", CONTAINER, obj)
        with pytest.raises(RequestBusyError):
            await relay.open_relay(fe, RID, "http://127.0.0.1:9", "mig", CONTAINER, timeout_s=5)

    asyncio.run(main())


def test_a_peer_is_named_by_its_origin_and_only_an_allowed_one_is_called():
    env = {ALLOWED_PEERS_ENV: "http://127.0.0.1:3000, https://Peer.example"}
    assert resolve_peer("http://127.0.0.1:3000/", "relay_to", env) == "http://127.0.0.1:3000"
    assert resolve_peer("https://peer.example:443", "relay_to", env) == "https://peer.example:443"
    for url in ("http://127.0.0.1:3001", "http://localhost:3000", "http://u:p@127.0.0.1:3000", "http://127.0.0.1:3000/hsnap",
                "http://127.0.0.1:3000?x", "ftp://127.0.0.1:3000", " http://127.0.0.1:3000", None, 3000):
        with pytest.raises(ConfinementError) as e:
            resolve_peer(url, "relay_to", env)
        assert e.value.field == "relay_to" and "u:p" not in str(e.value)
    with pytest.raises(ConfinementError, match="none configured"):
        resolve_peer("http://127.0.0.1:3000", "relay_to", {})
    assert peer_origin("http://[::1]:8/") == "http://[::1]:8" and peer_origin("http://h:99999") is None
