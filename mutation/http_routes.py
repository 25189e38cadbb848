"""The HTTP fuzz target of the mutation tooling (``python -m mutation --target http``): one live server with the hsnap
plug-in (a snapshot root configured), generated bodies over every ``/hsnap/*`` route, and hostile container files for
``/hsnap/migrate`` and ``/hsnap/follow``, while a bystander request streams beside them.

Body ``i`` is a pure function of (seed, i): a route, then each field drawn from a corpus of plausible values (a
running rid, paths beneath the root) and hostile ones (NUL bytes, lone surrogates, 10 MB strings, wrong types,
NaN/Infinity, huge integers, ``..``, absolute paths outside the root, a symlink out of it, a FIFO, a planted
non-snapshot file), or a whole hostile body (100k-deep JSON, not UTF-8, not an object, 2 MB).  Reported:

  deaths          the server stopped answering /health (or its process exited)                    FAILURE
  untyped_5xx     a 5xx whose body is not ``{"error": {"type", "status", ...}}``                   FAILURE
  hangs           an answer slower than its bound (the route's timeout_s + a margin)               FAILURE
  outside_files   files or directories created outside the root (the watched folders)             FAILURE
  echoed          an answer carrying bytes of a planted non-snapshot file                          FAILURE
  bystander_cut   the bystander stream ended other than by its length, or with tokens missing     FAILURE
  typed_5xx       a typed 5xx (504 MigrationError: the other side did not come; 500 PluginError)   reported
  statuses        answers by HTTP status                                                            reported

No pickle; the server is a child process stopped by its own pid."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path

# tests/engine/hsnap_support.py: the live server and the streaming client the engine tests use
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine"))

ROUTES = ("export", "drain", "checkpoint", "resume", "migrate", "follow", "attach", "stats")
LIVE_RID = "fuzz-live"
BYSTANDER_N = 120
BOUND_MARGIN_S = 30.0  # an answer may take its own timeout plus this on a loaded two-core machine
SECRET = "HSNAPFUZZ-SECRET-7c1e"  # planted in a non-snapshot file: no answer may carry it
DEEP = 100_000
CLIENTS = 4  # bodies in flight at once


class Fixture:
    """The folders of a run: ``base/root`` (the server's snapshot root) and, outside it, ``base/outside``."""

    def __init__(self, base: Path) -> None:
        self.base, self.root, self.outside = base, base / "root", base / "outside"
        for d in (self.root, self.outside, self.root / "fz"):
            d.mkdir(parents=True, exist_ok=True)
        for d in (self.root, self.outside):
            (d / "secret.txt").write_text(SECRET * 8)
        (self.root / "garbage.hsnap").write_bytes(b"HSNP" + bytes(random.Random(0).randrange(256) for _ in range(4096)) + SECRET.encode())
        (self.root / "empty.hsnap").write_bytes(b"")
        os.symlink(self.outside, self.root / "escape")
        fifo = self.root / "fifo.hsnap"
        if not fifo.exists():
            os.mkfifo(fifo)
        many = self.root / "many"
        many.mkdir(exist_ok=True)
        for k in range(300):
            (many / f"x{k}.hsnap").write_bytes(b"not a snapshot")
        self.containers = hostile_containers(self.root / "containers")

    def outside_listing(self) -> set[str]:
        """Every path under ``base`` but beneath the root (created outside the root if new)."""
        out = set()
        for dirpath, dirnames, filenames in os.walk(self.base, followlinks=False):
            if Path(dirpath) == self.root:
                dirnames[:] = []
                continue
            out.update(os.path.join(dirpath, n) for n in dirnames + filenames)
        return out


MARKERS = {
    "deep": b"[" * 8000,
    "deep-objects": b'{"a":' * 20000,
    "not-utf8": b'{"type": "\xff\xfe", "reason": "x"}',
    "nan": b'{"type": NaN, "reason": Infinity}',
    "huge": b'{"reason": "' + b"x" * 200_000 + b'"}',
    "secret": SECRET.encode() * 4,
    "empty": b"",
}


def hostile_containers(where: Path) -> list[str]:
    """Migration containers whose files are hostile: ``abandoned.json`` / ``refused.json`` of every kind in
    MARKERS, a garbage first link, a garbage final link, a garbage ``.applied`` marker (names relative to the root)."""
    names = []
    for kind, data in MARKERS.items():
        for marker in ("abandoned.json", "refused.json"):
            c = where / f"{marker.split('.')[0]}-{kind}"
            c.mkdir(parents=True, exist_ok=True)
            (c / marker).write_bytes(data)
            names.append(f"containers/{c.name}")
    for name, files in {"link-garbage": {"link-0000.hsnap": b"garbage" * 100},
                        "final-garbage": {"final.hsnap": SECRET.encode() * 10},
                        "applied-garbage": {"link-0000.hsnap": b"HSNP", "link-0000.hsnap.applied": b"[" * 9000}}.items():
        c = where / name
        c.mkdir(parents=True, exist_ok=True)
        for f, data in files.items():
            (c / f).write_bytes(data)
        names.append(f"containers/{name}")
    return names


# ----------------------------------------------------------------------------- the corpus


def _hostile_text(rng: random.Random) -> str:
    return rng.choice([
        "a\x00b", "\x00", "x\ud800y", "\udfff", "\ud83d", "é" * 5000, "x" * rng.choice([600, 5000, 70_000]), "\n\r\t", "\u202e.hsnap",
        "%00", "$(id)", "`id`", "*", "?", " ", "\\\\?\\C:\\", "CON", "\x1b[2J",
    ])


def _rid(rng: random.Random, fx: Fixture):
    return rng.choice([LIVE_RID, LIVE_RID, "no-such-rid", _hostile_text(rng), _wrong(rng), None])


def _path(rng: random.Random, fx: Fixture, i: int, *, read: bool = False):
    fresh = f"fz/{i}-{rng.randrange(1 << 30)}"
    return rng.choice([
        fresh + ".hsnap", fresh, f"{fresh}/sub/deeper", "secret.txt", "garbage.hsnap", "empty.hsnap", "fifo.hsnap", "many",
        "escape/x.hsnap", "escape/secret.txt", "../outside/x.hsnap", "../outside/secret.txt", str(fx.outside / f"abs-{i}"),
        str(fx.outside / "secret.txt"), "/etc/passwd", "/proc/self/environ", "/dev/zero", f"/tmp/hsnapfuzz-{i}",
        ".", "..", "", "fz/../../outside/y", "fz/./a/../b.hsnap", f"fz/{'d/' * 300}x", "s3://not-allowed/x", "s3://", "http://x/y",
        rng.choice(fx.containers), rng.choice(fx.containers) + "/final.hsnap",
        fresh + "\x00.hsnap", fresh + "\ud800", "x" * 10_000, _hostile_text(rng), _wrong(rng), None,
    ] + (["containers", "containers/link-garbage"] if read else []))


def _wrong(rng: random.Random):
    return rng.choice([0, -1, 1 << 70, 10 ** 40, 1.5, -0.0, True, False, [], [1, "a"], {}, {"a": {"b": None}}, "", None])


def _number(rng: random.Random, good: list):
    return rng.choice(good + [0, -1, 1 << 63, 10 ** 30, 1e308, -1e-308, 0.5, "10", None, True, [], {}, float("nan"), float("inf")])


def _dump(obj) -> bytes:
    # NaN/Infinity are written as Python writes them (not JSON): the server must refuse them by name
    return json.dumps(obj, allow_nan=True).encode()


def _whole_hostile(rng: random.Random) -> bytes:
    return rng.choice([
        b"[" * DEEP + b"]" * DEEP, b'{"a":' * DEEP, b"{" * 100, b"\xff\xfe\x00", b"", b"null", b"[]", b'"x"', b"1e999", b"NaN",
        b'{"rid": "a", "rid": "b"}', b"{" + b'"k":1,' * 50_000 + b'"z":0}', b'{"path": "' + b"y" * (2 << 20) + b'"}',
        b'{"rid": "\\ud800", "path": "\\u0000"}', b"\x00" * 100,
    ])


def body(seed: int, i: int, fx: Fixture) -> tuple[str, str, bytes, float]:
    """Body ``i``: (method, URL path, bytes, bound in seconds)."""
    rng = random.Random(seed * 1_000_003 + i)
    route = rng.choice(ROUTES)
    if route == "stats":
        q = rng.choice([None, LIVE_RID, "nope", "a\x00b", "\ud800", "x" * 20_000, "%ff%fe", ""])
        if q is None:
            return "GET", "/hsnap/stats", b"", BOUND_MARGIN_S
        raw = urllib.parse.quote(q.encode("utf-8", "surrogatepass")) if q != "%ff%fe" else q
        return "GET", f"/hsnap/stats?rid={raw}", b"", BOUND_MARGIN_S
    if rng.random() < 0.08:
        return "POST", f"/hsnap/{route}", _whole_hostile(rng), BOUND_MARGIN_S
    bound = BOUND_MARGIN_S
    if route == "export":
        obj = {"rid": _rid(rng, fx), "path": _path(rng, fx, i), "keep_running": rng.choice([True, True, False, "yes", None, 1])}
    elif route == "drain":  # never a drain that can succeed: it would export the bystander (a legitimate end of it)
        obj = {"dir": rng.choice(["a\x00b", "x\ud800y", "\udfff", "../outside/d", str(fx.outside / f"d{i}"), "escape/d", _wrong(rng),
                                  "x" * 9000, f"fz/d{i}\x00", "s3://not-allowed/d", "fz/../../outside/d", "/etc/hsnapfuzz"]),
               "dedup": rng.choice([False, True, "no"]), "page_size": _number(rng, [0, 64, 1 << 20, 1 << 21])}
    elif route == "checkpoint":
        obj = {"rid": _rid(rng, fx), "dir": _path(rng, fx, i), "every": _number(rng, [0, 16, 64, 1 << 33])}
    elif route == "resume":
        obj = {"path": _path(rng, fx, i, read=True), "stream": rng.choice([False, True, 1, None]),
               "return_text_in_logprobs": rng.choice([False, True, "x"]), "again": rng.choice([False, True, None])}
    elif route == "migrate":
        obj = {"rid": _rid(rng, fx), "dir": rng.choice([_path(rng, fx, i), rng.choice(fx.containers)]), "tail": _number(rng, [0, 2, 16]),
               "max_rounds": _number(rng, [1, 2, 8, 1001]), "timeout_s": _number(rng, [0.2, 0.5, 1, 86401]), "fsync": rng.choice([False, True, 0])}
        if rng.random() < 0.3:  # no peer is allowed here: each is refused (403 / 400) before the request is touched
            obj["relay_to"] = rng.choice([None, "http://127.0.0.1:9", "ftp://h:1", "http://u@h:1", "http://h:1/x?y", "a\x00b", "\ud800", 5,
                                          ["http://h:1"], "x" * 9000])
    elif route == "attach":  # this server resumed nothing at start: every rid is one it does not hold (a typed 404)
        obj = {"rid": _rid(rng, fx), "stream": rng.choice([True, False, "x", None])}
    else:  # follow
        obj = {"dir": rng.choice([rng.choice(fx.containers), _path(rng, fx, i)]), "rid": rng.choice([None, _rid(rng, fx)]),
               "stream": rng.choice([False, True, "x"]), "timeout_s": _number(rng, [0.2, 0.5, 1, 601, 86400])}
    for k in list(obj):
        if rng.random() < 0.04:
            del obj[k]
    if route in ("migrate", "follow"):  # the documented bound: timeout_s (default 60) per link or round
        bound += _timeout_bound(obj.get("timeout_s", 60)) * (10 if route == "migrate" else 1)
    if rng.random() < 0.05:
        obj[rng.choice(["extra", "\x00", "\ud800", "x" * 300])] = _wrong(rng)
    return "POST", f"/hsnap/{route}", _dump(obj), bound


def _timeout_bound(t) -> float:
    return float(t) if type(t) in (int, float) and 0 < t <= 600 else 0.0


# ----------------------------------------------------------------------------- the run


def typed_error(status: int, data: bytes) -> bool:
    try:
        err = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("type"), str) and err.get("status") == status


def send(port: int, method: str, path: str, data: bytes, timeout: float) -> tuple[int | None, dict, bytes, float]:
    """(status or None on a transport failure, headers, body, seconds); a streamed answer is read to its end."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=data if method == "POST" else None,
                     headers={"Content-Type": "application/json"} if method == "POST" else {})
        r = conn.getresponse()
        out = r.read()
        return r.status, dict(r.getheaders()), out, time.monotonic() - t0
    except (OSError, http.client.HTTPException) as e:
        return None, {}, repr(e).encode(), time.monotonic() - t0
    finally:
        conn.close()


def healthy(port: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, _, _ = send(port, "GET", "/health", b"", 10)
        if status == 200:
            return True
        time.sleep(0.5)
    return False


class Streams:
    """The bystander (a request no body names, restarted as it finishes: each run must end by its length with every
    token) and the live request the bodies name (restarted whenever it ends, however)."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.cut, self.bystander_runs, self.live_runs = url, threading.Event(), [], 0, 0
        self.threads = [threading.Thread(target=self._bystander, daemon=True), threading.Thread(target=self._live, daemon=True)]

    def start(self) -> "Streams":
        for t in self.threads:
            t.start()
        return self

    def _run(self, rid: str, n: int):
        from hsnap_support import Stream, payload, prompt

        s = Stream(self.url, payload(rid, prompt(len(rid), 20), n))
        s.start()
        s.join(600)
        return s

    def _bystander(self) -> None:
        k = 0
        while not self.stop.is_set():
            k += 1
            s = self._run(f"bystander-{k}-{os.getpid()}", BYSTANDER_N)
            final = s.events[-1] if s.events else {}
            fr = (final.get("meta_info") or {}).get("finish_reason") or {}
            got = len(final.get("output_ids") or [])
            if s.error is not None or fr.get("type") != "length" or got != BYSTANDER_N:
                self.cut.append({"run": k, "error": repr(s.error)[:300], "finish_reason": fr, "tokens": got})
            self.bystander_runs += 1

    def _live(self) -> None:
        while not self.stop.is_set():
            self._run(LIVE_RID, 3000)
            self.live_runs += 1
            time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        port = int(urllib.parse.urlsplit(self.url).port)
        send(port, "POST", "/abort_request", json.dumps({"rid": LIVE_RID}).encode(), 30)  # not its 3000 tokens
        for t in self.threads:
            t.join(900)


def container_scenarios(port: int, fx: Fixture) -> list[tuple[str, str, bytes, float]]:
    """Hostile files written into a live migration's container while it runs (the source reads ``refused.json``
    in the scheduler), and follows of containers whose ``abandoned.json`` / links are hostile."""
    out = []
    for kind in MARKERS:
        out.append(("POST", "/hsnap/follow", _dump({"dir": f"containers/abandoned-{kind}", "timeout_s": 2}), 2 + BOUND_MARGIN_S))
    for name in ("link-garbage", "final-garbage", "applied-garbage"):
        out.append(("POST", "/hsnap/follow", _dump({"dir": f"containers/{name}", "timeout_s": 2}), 2 + BOUND_MARGIN_S))
    return out


def live_refusal_of(port: int, fx: Fixture, rid: str, kind: str, tag: str = "") -> dict:
    """Migrate the running request ``rid`` into a fresh container; once its first link is there, put a hostile
    ``refused.json`` (MARKERS[kind]) beside it: the migration must end with a typed answer, the server alive."""
    c = fx.root / "fz" / f"mig-{rid}-{kind}{tag}"
    box = {}
    deadline = time.monotonic() + 60  # the request running (the fuzz may have exported it: it is restarted)
    while time.monotonic() < deadline:
        status, _, out, _ = send(port, "GET", f"/hsnap/stats?rid={urllib.parse.quote(rid)}", b"", 30)
        if status == 200 and json.loads(out).get("where") == "running":
            break
        time.sleep(0.2)

    def planter():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (c / "link-0000.hsnap").exists():
            time.sleep(0.01)
        if (c / "link-0000.hsnap").exists():
            (c / "refused.json").write_bytes(MARKERS[kind])
            box["planted"] = True

    t = threading.Thread(target=planter, daemon=True)
    t.start()
    status, headers, data, dt = send(port, "POST", "/hsnap/migrate", _dump({"rid": rid, "dir": f"fz/{c.name}", "timeout_s": 20,
                                                                           "max_rounds": 50, "tail": 0}), 120)
    t.join(70)
    return {"status": status, "data": data, "dt": dt, "planted": box.get("planted", False), "headers": headers}


def start_server(fx: Fixture, model_dir: Path, log: Path):
    """A server as hsnap_support starts them (strict checks on), its snapshot root the fixture's."""
    from hsnap_support import hsnap_server

    return hsnap_server(model_dir, log, env={"HSNAP_ROOT": str(fx.root)}).start()


def run(n: int, seed: int, *, base: Path, model_dir: Path, log: Path, progress: bool = True, scenarios: bool = True) -> dict:
    """Start a server over a fresh fixture, fuzz it (:func:`fuzz`), stop it."""
    fx = Fixture(base)
    cwd_before = set(os.listdir(os.getcwd()))
    server = start_server(fx, model_dir, log)
    try:
        report = fuzz(server, fx, n, seed, progress=progress, scenarios=scenarios, cwd_before=cwd_before)
    finally:
        alive = server.proc.poll() is None
        server.stop()
    report["deaths"] += 0 if alive else 1
    return report


def fuzz(server, fx: Fixture, n: int, seed: int, *, progress: bool = True, scenarios: bool = True, cwd_before: set | None = None) -> dict:
    """``n`` bodies (and, with ``scenarios``, the hostile container files) against a running ``server`` whose root is
    ``fx.root``, with the bystander and the live request streaming; the report's counts (FAILURE_KEYS)."""
    cwd_before = set(os.listdir(os.getcwd())) if cwd_before is None else cwd_before
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    outside_before = fx.outside_listing()
    t0 = time.monotonic()
    port = server.port
    streams = Streams(server.url).start()
    counts = Counter()
    statuses, by_route, failures, typed_5xx = Counter(), Counter(), [], Counter()

    def record(i, method, path, data, bound, status, headers, out, dt):
        route = path.split("?")[0]
        by_route[route] += 1
        statuses[str(status)] += 1
        where = {"i": i, "route": route, "status": status, "seconds": round(dt, 2), "body": data[:200].decode("utf-8", "replace")}
        if status is None:
            if dt >= bound - 0.5:
                counts["hangs"] += 1
                failures.append(dict(where, cls="hang"))
            elif not healthy(port):
                counts["deaths"] += 1
                failures.append(dict(where, cls="death", error=out[:300].decode("utf-8", "replace")))
                raise SystemExit("the server died")
            else:
                counts["transport_errors"] += 1
            return
        if dt > bound:
            counts["hangs"] += 1
            failures.append(dict(where, cls="hang"))
        if status >= 500:
            if typed_error(status, out):
                typed_5xx[json.loads(out)["error"]["type"]] += 1
            else:
                counts["untyped_5xx"] += 1
                failures.append(dict(where, cls="untyped_5xx", answer=out[:300].decode("utf-8", "replace")))
        blob = out + json.dumps(headers).encode()
        if SECRET.encode() in blob:
            counts["echoed"] += 1
            failures.append(dict(where, cls="echoed"))

    try:
        jobs = [(i, *body(seed, i, fx)) for i in range(n)]
        if scenarios:
            jobs += [(n + k, *job) for k, job in enumerate(container_scenarios(port, fx))]
        def one(job):
            i, method, path, data, bound = job
            return job, send(port, method, path, data, bound + 5)

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:  # several clients at once, as on a shared server
            for done, ((i, method, path, data, bound), got) in enumerate(pool.map(one, jobs)):
                record(i, method, path, data, bound, *got)
                if done % 100 != 99:
                    continue
                if not healthy(port, 30):
                    counts["deaths"] += 1
                    failures.append({"i": i, "cls": "death", "after": path})
                    break
                if progress:
                    print(f"  {done + 1}/{len(jobs)} bodies, {time.monotonic() - t0:.0f} s, {dict(counts)}, statuses {dict(statuses)}",
                          flush=True)
        if scenarios:
            for k, kind in enumerate(("deep", "not-utf8", "huge", "nan")):
                got = live_refusal_of(port, fx, LIVE_RID, kind, f"-{k}")
                record(f"live-refusal-{kind}", "POST", "/hsnap/migrate", b"", 120, got["status"], got["headers"], got["data"], got["dt"])
                counts["live_refusals_planted"] += int(got["planted"])
                if got["status"] is not None and got["planted"] and not typed_error(got["status"], got["data"]):
                    failures.append({"i": f"live-refusal-{kind}", "cls": "untyped", "answer": got["data"][:300].decode("utf-8", "replace")})
                    counts["untyped_5xx"] += 1
        if not healthy(port) or server.proc.poll() is not None:
            counts["deaths"] += 1
    finally:
        streams.close()
    created = sorted(fx.outside_listing() - outside_before)
    created += sorted(os.path.join(os.getcwd(), x) for x in set(os.listdir(os.getcwd())) - cwd_before)
    created += sorted(os.path.join(tempfile.gettempdir(), x) for x in set(os.listdir(tempfile.gettempdir())) - tmp_before
                      if x.startswith("hsnapfuzz"))
    counts["outside_files"] = len(created)
    counts["bystander_cut"] = len(streams.cut)
    return {"bodies": len(jobs) + (4 if scenarios else 0), "seed": seed, "wall_s": round(time.monotonic() - t0, 1),
            "deaths": counts["deaths"], "untyped_5xx": counts["untyped_5xx"], "hangs": counts["hangs"],
            "outside_files": counts["outside_files"], "echoed": counts["echoed"], "bystander_cut": counts["bystander_cut"],
            "transport_errors": counts["transport_errors"], "live_refusals_planted": counts["live_refusals_planted"],
            "typed_5xx": dict(typed_5xx), "statuses": dict(statuses), "by_route": dict(by_route),
            "bystander_runs": streams.bystander_runs, "live_runs": streams.live_runs,
            "created_outside": created[:20], "bystander_cuts": streams.cut[:10], "failures": failures[:50]}


FAILURE_KEYS = ("deaths", "untyped_5xx", "hangs", "outside_files", "echoed", "bystander_cut")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="HTTP fuzz of the /hsnap routes against one live server")
    ap.add_argument("--mutants", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--quiet", action="store_true")
    args, _ = ap.parse_known_args(argv)
    from hsnap_sglang.tiny import build_model_dir

    base = Path(tempfile.mkdtemp(prefix="hsnap-httpfuzz-"))
    model = build_model_dir(base / "model" / "qwen3-next-tiny")
    print(f"hsnap HTTP fuzz: {args.mutants} bodies, seed {args.seed}, under {base}", flush=True)
    report = run(args.mutants, args.seed, base=base / "run", model_dir=model, log=base / "server.log", progress=not args.quiet)
    print(json.dumps({k: v for k, v in report.items() if k not in ("failures",)}, indent=1, default=str))
    for f in report["failures"][:20]:
        print("FAIL", json.dumps(f, default=str)[:400])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 1 if any(report[k] for k in FAILURE_KEYS) else 0

