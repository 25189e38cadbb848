"""hsnap may fail; the server may not.  One real server (``python -m hsnap_sglang.serve`` with the plug-in on, a
snapshot root, SGLang's strict checks) is sent what an attacker would send: NUL bytes, lone surrogates, 100k-deep
JSON, oversized strings, wrong types, NaN/Infinity over every ``/hsnap`` route; hostile ``refused.json`` /
``abandoned.json`` in migration containers; more follows than the server takes.  After each: ``/health`` answers,
every answer is a typed JSON error (never a bare 500 or a traceback), and a bystander stream keeps decoding.  Then a
short run of the HTTP fuzz target (mutation/http_routes.py) against the same server."""

from __future__ import annotations

import json
import threading
import time

import pytest

from hsnap_support import Stream, generate, paced, payload, prompt, stats
from mutation import http_routes as mh  # the fuzz target, its fixture and checks

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROUTES = ("export", "drain", "checkpoint", "resume", "migrate", "follow", "attach")
TEN_MB = "x" * (10 << 20)
BYSTANDER_N = 200  # tokens per bystander request (they follow one another through the module)
RUN_PACE_S = 0.05  # seconds per forward while a live migration is refused: 600 tokens last 30 s at least


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return mh.Fixture(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def server(fx, tiny_model_dir):
    s = mh.start_server(fx, tiny_model_dir, fx.base / "server.log")
    yield s
    s.retire()


class Bystander(threading.Thread):
    """Requests no hostile call names, one after another for as long as the module runs: each must end by its
    length with every token (``cuts`` lists those that did not)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.cuts, self.done_tokens, self.current = url, threading.Event(), [], 0, None

    def run(self) -> None:
        k = 0
        while not self.stop.is_set():
            k += 1
            s = self.current = Stream(self.url, payload(f"bystander-{k}", prompt(7, 20), BYSTANDER_N))
            s.start()
            s.join(600)
            final = s.events[-1] if s.events else {}
            if s.error is not None or (final.get("meta_info") or {}).get("finish_reason", {}).get("type") != "length" \
                    or len(final.get("output_ids") or []) != BYSTANDER_N:
                self.cuts.append({"run": k, "error": repr(s.error), "final": str(final)[:300]})
            self.done_tokens += s.tokens_so_far()

    def tokens_so_far(self) -> int:
        return self.done_tokens + (self.current.tokens_so_far() if self.current is not None else 0)


@pytest.fixture(scope="module")
def bystander(server):
    b = Bystander(server.url)
    b.start()
    yield b
    b.stop.set()
    b.join(600)
    assert b.cuts == [] and b.done_tokens > 0


def post(server, route: str, data: bytes, timeout: float = 120):
    status, _, out, _ = mh.send(server.port, "POST", f"/hsnap/{route}", data, timeout)
    return status, out


def assert_serving(server, bystander) -> None:
    """The server answers /health and the bystander decoded on meanwhile."""
    before = bystander.tokens_so_far()
    assert mh.healthy(server.port, 30), server.log_tail()
    deadline = time.monotonic() + 60
    while bystander.tokens_so_far() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bystander.tokens_so_far() > before, "the bystander stopped decoding"
    assert bystander.cuts == []


def assert_typed_refusal(status, out: bytes, *, statuses=(400,)) -> dict:
    assert status in statuses, (status, out[:300])
    assert mh.typed_error(status, out), out[:300]
    assert b"Traceback" not in out
    return json.loads(out)["error"]


def _raw(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


HOSTILE_VALUES = {
    "nul": "/x\x00y", "lone-surrogate": "x\ud800", "high-surrogate-only": "\udbff", "ten-mb": TEN_MB,
    "int": 7, "list": ["a"], "object": {"a": 1}, "nan": float("nan"), "infinity": float("inf"), "bool": True,
}
FIELDS = {"export": ("rid", "path"), "drain": ("dir",), "checkpoint": ("rid", "dir"), "resume": ("path",), "migrate": ("rid", "dir"),
          "follow": ("dir", "rid"), "attach": ("rid",)}
VALID = {"export": {"rid": "bystander-not", "path": "fz/e.hsnap"}, "drain": {"dir": "fz/drained"},
         "checkpoint": {"rid": "nope", "dir": "fz/ck", "every": 4}, "resume": {"path": "fz/none.hsnap"},
         "migrate": {"rid": "nope", "dir": "fz/mig", "timeout_s": 1}, "follow": {"dir": "fz/fol", "timeout_s": 1},
         "attach": {"rid": "nope"}}


def test_nul_byte_in_drain_dir_is_a_typed_400_and_the_server_keeps_serving(server, bystander):
    status, out = post(server, "drain", _raw({"dir": "/tmp/x\x00y"}))
    err = assert_typed_refusal(status, out, statuses=(400, 403))
    assert err["field"] == "dir"
    assert_serving(server, bystander)


@pytest.mark.parametrize("route", ROUTES)
def test_hostile_field_values_over_every_route_are_typed_refusals(server, bystander, route):
    for field in FIELDS[route]:
        for name, value in HOSTILE_VALUES.items():
            status, out = post(server, route, _raw(dict(VALID[route], **{field: value})))
            assert_typed_refusal(status, out, statuses=(400, 403, 413)), (field, name)
            assert len(out) < 20_000, (field, name, len(out))  # a capped echo, never the 10 MB back
    assert_serving(server, bystander)


@pytest.mark.parametrize("route", ["resume", "follow", "attach"])
def test_a_lone_surrogate_where_a_flag_belongs_is_a_typed_400_echoed_escaped(server, bystander, route):
    """A value refused by type is echoed in the answer: a lone surrogate (no UTF-8 answer can carry it) is written as
    its escape, not turned into a 500."""
    status, out = post(server, route, _raw(dict(VALID[route], stream="x\ud800")))
    err = assert_typed_refusal(status, out)
    assert err["field"] == "stream" and err["found"] == "x\\ud800", err
    assert_serving(server, bystander)


@pytest.mark.parametrize("route", ROUTES)
def test_hostile_whole_bodies_over_every_route_are_typed_400s(server, bystander, route):
    for data in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000, b"\xff\xfe", b"", b"[]", b"NaN", b'{"x": Infinity}',
                 b'{"rid": "' + b"y" * (2 << 20) + b'"}'):
        status, out = post(server, route, data)
        assert_typed_refusal(status, out)
    assert_serving(server, bystander)


def test_stats_with_a_hostile_rid_is_a_typed_400(server, bystander):
    for q in ("a%00b", "x" * 5000):
        status, _, out, _ = mh.send(server.port, "GET", f"/hsnap/stats?rid={q}", b"", 60)
        assert_typed_refusal(status, out)
    status, _, out, _ = mh.send(server.port, "GET", "/hsnap/stats?rid=%ED%A0%80", b"", 60)  # decoded with U+FFFD by Starlette
    assert status == 200 and json.loads(out)["where"] is None
    assert_serving(server, bystander)


def test_error_answers_echo_a_capped_part_of_a_huge_value(server, bystander):
    rid = "r" * 500  # within the rid cap: an unknown request, named in the answer
    status, out = post(server, "export", _raw({"rid": rid, "path": "fz/capped.hsnap"}))
    assert_typed_refusal(status, out, statuses=(404,))
    assert rid not in out.decode() and "500 chars" in out.decode()
    status, out = post(server, "export", _raw({"rid": "q" * 900_000, "path": "fz/capped.hsnap"}))
    assert_typed_refusal(status, out)
    assert len(out) < 5_000


def test_finished_request_answers_finished_not_unknown(server, bystander):
    generate(server.url, payload("done-early", prompt(3, 12), 4))
    status, out = post(server, "export", _raw({"rid": "done-early", "path": "fz/done.hsnap"}))
    err = assert_typed_refusal(status, out, statuses=(409,))
    assert err["type"] == "RequestFinishedError" and "finished" in err["message"]
    status, out = post(server, "export", _raw({"rid": "never-was", "path": "fz/never.hsnap"}))
    assert assert_typed_refusal(status, out, statuses=(404,))["type"] == "UnknownRequestError"


@pytest.mark.parametrize("kind", ["deep", "not-utf8", "huge"])
def test_hostile_refused_json_during_a_live_migration_gives_it_up_typed(server, bystander, fx, kind):
    """The source reads ``refused.json`` (its watcher thread, once the marker is seen; the scheduler's
    advance_migrations gives the migration up with what it said): ``"[" * 8000`` there used to raise RecursionError in
    SGLang's loop and stop the server.  Now the migration is given up with a typed answer and the request decodes on
    here."""
    rid = f"mig-{kind}"
    s = Stream(server.url, payload(rid, prompt(11, 20), 600))
    with paced(server.url, RUN_PACE_S):  # an unpaced tiny model may finish its 600 tokens before the migration lands
        s.start()
        s.wait_tokens(2)
        got = mh.live_refusal_of(server.port, fx, rid, kind)
        assert got["planted"], {k: got[k] for k in ("status", "data", "dt")}
        err = assert_typed_refusal(got["status"], got["data"], statuses=(504,))
        assert err["type"] == "MigrationError" and "unreadable" in err["message"]
        assert_serving(server, bystander)
        before, deadline = s.tokens_so_far(), time.monotonic() + 30
        while s.tokens_so_far() <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.tokens_so_far() > before and s.error is None  # it stays here, decoding
    post(server, "export", _raw({"rid": rid, "path": f"fz/{rid}-end.hsnap"}))  # ends it (frees the machine)
    s.join(120)


@pytest.mark.parametrize("kind", sorted(mh.MARKERS))
def test_hostile_abandoned_json_is_a_typed_follow_refusal(server, bystander, kind):
    t0 = time.monotonic()
    status, out = post(server, "follow", _raw({"dir": f"containers/abandoned-{kind}", "timeout_s": 5}))
    err = assert_typed_refusal(status, out, statuses=(504,))
    assert err["type"] == "MigrationError" and time.monotonic() - t0 < 30
    assert mh.SECRET not in out.decode("utf-8", "replace")
    assert_serving(server, bystander)


def test_follows_are_bounded_in_number_and_wait(server, fx, bystander):
    status, out = post(server, "follow", _raw({"dir": "fz/f-long", "timeout_s": 601}))
    assert assert_typed_refusal(status, out)["field"] == "timeout_s"
    held: list = []

    def hold(k):
        held.append(post(server, "follow", _raw({"dir": f"fz/hold-{k}", "timeout_s": 300})))

    holders = [threading.Thread(target=hold, args=(k,)) for k in range(4)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 120  # four follows running (the scheduler lists them), however slow this machine
    while len(stats(server.url)["follows"]) < 4:
        assert time.monotonic() < deadline and not held, held
        time.sleep(0.2)
    extra = [post(server, "follow", _raw({"dir": f"fz/extra-{k}", "timeout_s": 4})) for k in range(2)]
    busy = [json.loads(out)["error"] for status, out in extra if status == 429]
    assert len(busy) == 2 and all(e["type"] == "ServerBusyError" for e in busy), extra
    for k in range(4):  # the source gives up: each held follow ends with its typed reason, long before its 300 s
        (fx.root / "fz" / f"hold-{k}").mkdir(exist_ok=True)
        (fx.root / "fz" / f"hold-{k}" / "abandoned.json").write_text(json.dumps({"reason": "test", "type": "MigrationError", "links": 0}))
    for t in holders:
        t.join(120)
    ended = [json.loads(out)["error"] for status, out in held if status == 504]
    assert len(ended) == 4 and all(e["type"] == "MigrationError" for e in ended), held
    status, out = post(server, "follow", _raw({"dir": "fz/after", "timeout_s": 2}))  # the slots were given back
    assert assert_typed_refusal(status, out, statuses=(504,))["expected"] == "committed within 2.0 s"
    assert_serving(server, bystander)


def test_http_fuzz_short_run_finds_no_failure(server, fx, bystander):
    report = mh.fuzz(server, fx, 200, seed=11, progress=False, scenarios=False)
    assert {k: report[k] for k in mh.FAILURE_KEYS} == dict.fromkeys(mh.FAILURE_KEYS, 0), report["failures"][:5]
    assert_serving(server, bystander)
