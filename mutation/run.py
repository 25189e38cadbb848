"""The mutation run's driver: worker processes (time and memory limits, JSON lines, no pickle),
the tallies, minimization of failures, and the command line (``python -m mutation``)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import xxhash

from mutation import ROOT, targets
from mutation.format_target import (
    CLASSES, FAIL_CLASSES, OK_CLASSES, Context, Hang, build, examine, generate, layer_of, load_inputs, untyped,
)

# ====================================================================== worker pool


def _worker_main(args) -> int:
    """Answer one JSON line per request line: {"i": n} or {"case": desc}."""
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print from the library cannot corrupt the protocol
    if getattr(args, "target", "format") != "format":
        return _target_worker(args, proto_in, proto_out)
    ctx = Context(args.scratch, cli_every=args.cli_every)
    return _serve(args, proto_in, proto_out, lambda i: generate(args.seed, i, ctx.inputs, ctx.groups),
                  lambda desc, req: examine(desc, ctx, cli=req.get("cli")))


def _serve(args, proto_in, proto_out, describe, examine_one, default=None) -> int:
    """Limit this worker's memory, say ready, then answer each request line with one JSON line."""
    if args.mem_gib > 0:
        lim = int(args.mem_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    inject = dict(x.split(":") for x in os.environ.get("HSNAP_MUTATE_INJECT", "").split(",") if ":" in x)
    proto_out.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in proto_in:
        req = json.loads(line)
        desc = req["case"] if "case" in req else describe(req["i"])
        what = inject.get(str(desc["i"]))  # tests of the pool itself: a hang, a crash
        if what == "hang":
            time.sleep(3600)
        elif what == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            r = examine_one(desc, req)
        except MemoryError as e:
            r = untyped(e, "examine")
        r["i"] = desc["i"]
        proto_out.write(json.dumps(r, default=default) + "\n")
    return 0


class _Worker:
    def __init__(self, n: int, args, base: str) -> None:
        self.n = n
        self.scratch = os.path.join(base, f"w{n}-{time.monotonic_ns()}")
        self.log = open(os.path.join(base, f"w{n}.log"), "ab")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
        cmd = [sys.executable, "-m", "mutation", "--worker", "--seed", str(args.seed), "--scratch", self.scratch,
               "--mem-gib", str(args.mem_gib), "--cli-every", str(args.cli_every)] + _target_argv(args)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=ROOT)
        self.buf = b""
        self.job = None
        self.deadline = 0.0
        line = self._line(time.monotonic() + (120 if getattr(args, "target", "format") == "format" else 600))
        if line is None or "ready" not in json.loads(line):
            raise RuntimeError(f"worker {n} did not start (see {self.log.name})")

    def _line(self, deadline: float):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return ""
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8")

    def send(self, job, req: dict, timeout: float) -> None:
        self.job = job
        self.deadline = time.monotonic() + timeout
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its pid
        rc = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return rc

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class Pool:
    """At most ``jobs`` worker processes; a per-request deadline; a dead or late worker is
    replaced and its request reported as a crash or a hang."""

    def __init__(self, args, base: str) -> None:
        self.args, self.base = args, base
        self.workers = [_Worker(n, args, base) for n in range(args.jobs)]

    def run(self, jobs, on_result) -> None:
        """``jobs``: iterable of (key, request); ``on_result(key, result)`` for each."""
        it = iter(jobs)
        pending = True
        busy: dict[int, _Worker] = {}
        while True:
            for w in self.workers:
                if w.job is None and pending:
                    try:
                        key, req = next(it)
                    except StopIteration:
                        pending = False
                        break
                    try:
                        w.send(key, req, self.args.timeout)
                    except OSError:  # it died between two mutants: the pipe is closed
                        self._replace(w, on_result, crashed=True)
                        continue
                    busy[w.proc.stdout.fileno()] = w
            if not busy:
                if pending:  # a worker was replaced before it got work
                    continue
                return
            wait = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            ready, _, _ = select.select(list(busy), [], [], wait)
            for fd in ready:
                w = busy[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del busy[fd]
                    self._replace(w, on_result, crashed=True)
                    continue
                w.buf += chunk
                while b"\n" in w.buf and w.job is not None:
                    line, _, w.buf = w.buf.partition(b"\n")
                    key, w.job = w.job, None
                    del busy[fd]
                    on_result(key, json.loads(line))
            now = time.monotonic()
            for fd, w in list(busy.items()):
                if w.job is not None and now >= w.deadline:
                    del busy[fd]
                    self._replace(w, on_result, crashed=False)

    def _replace(self, w: _Worker, on_result, *, crashed: bool) -> None:
        key = w.job
        rc = w.kill()
        if crashed:
            tail = _tail(os.path.join(self.base, f"w{w.n}.log"))
            res = {"cls": "untyped", "stage": "worker", "error": f"worker died (exit {rc})", "where": "process",
                   "message": tail}
        else:
            res = {"cls": "hang", "stage": "?", "error": "timeout", "where": f"over {self.args.timeout} s", "message": ""}
        self.workers[self.workers.index(w)] = _Worker(w.n, self.args, self.base)
        on_result(key, res)

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _tail(path: str, n: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _run_in_pool(args, base: str, mutants: int, describe, tally, report) -> None:
    """Mutants 0 .. mutants-1 through worker processes; ``describe(i)``: mutant i's description, for the tally."""
    pool = Pool(args, base)
    try:
        def on_result(i, r):
            r["i"] = i
            tally.add(describe(i), r)
            report()

        pool.run(((i, {"i": i}) for i in range(mutants)), on_result)
    finally:
        pool.close()


# ================================================================== in-process runs


@contextlib.contextmanager
def _time_limit(seconds: float):
    def fire(signum, frame):
        raise Hang()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def examine_in_process(desc: dict, ctx: Context, timeout: float, cli=None) -> dict:
    try:
        with _time_limit(timeout):
            r = examine(desc, ctx, cli=cli)
    except Hang:
        r = {"cls": "hang", "stage": "?", "error": "timeout", "where": f"over {timeout} s", "message": ""}
    r["i"] = desc["i"]
    return r


# ============================================================================ the run


class Tally:
    fail_classes = FAIL_CLASSES

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.total = collections.Counter()
        self.by_operator = collections.defaultdict(collections.Counter)
        self.by_target = collections.defaultdict(collections.Counter)
        self.by_variant = collections.defaultdict(collections.Counter)
        self.typed_errors = collections.Counter()
        self.typed_stages = collections.Counter()
        self.typed_fields = collections.Counter()
        self.typed_layers = collections.Counter()
        self.notes = collections.Counter()
        self.independent = collections.Counter()
        self.independent_examples: list[dict] = []
        self.cli_checked = 0
        self.failures: list[dict] = []

    def _count(self, desc: dict, r: dict) -> str:
        """The counts every target keeps; the mutant's variant."""
        cls = r["cls"]
        self.total[cls] += 1
        variant = "re-signed" if desc["resign"] else "raw"
        self.by_operator[desc["operator"]][cls] += 1
        self.by_target[desc["target"]][cls] += 1
        self.by_variant[variant][cls] += 1
        if cls == "typed":
            self.typed_errors[r["error"]] += 1
            self.typed_stages[f"{variant} {r['stage']}"] += 1
        if cls in self.fail_classes:
            self.failures.append(dict(r, desc=desc))
        return variant

    def add(self, desc: dict, r: dict) -> None:
        self._count(desc, r)
        if r["cls"] == "typed" and desc["resign"]:
            self.typed_fields[f"{r['error']} {r.get('field', '')}"] += 1
            self.typed_layers[layer_of(r["error"], r.get("field", ""))] += 1
        if r.get("note"):
            self.notes[r["note"]] += 1
        if r.get("independent"):
            self.independent[r["independent"].split(":")[0]] += 1
            if len(self.independent_examples) < 20:
                self.independent_examples.append({"i": desc["i"], "target": desc["target"], "ops": desc["ops"], "independent": r["independent"]})
        if r.get("cli"):
            self.cli_checked += 1

    @property
    def n(self) -> int:
        return sum(self.total.values())

    @property
    def failed(self) -> int:
        return sum(self.total[c] for c in self.fail_classes)

    def totals_line(self) -> str:
        t = self.total
        return (f"mutants: {self.n}  typed: {t['typed']}  accepted-unchanged: {t['accepted-unchanged']}  "
                f"accepted-but-changed: {t['accepted-but-changed']}  untyped: {t['untyped']}  hangs: {t['hang']}  seed: {self.seed}")

    def to_dict(self) -> dict:
        return {
            "seed": self.seed, "mutants": self.n, "totals": {c: self.total[c] for c in CLASSES},
            "by_operator": {k: dict(v) for k, v in sorted(self.by_operator.items())},
            "by_target": {k: dict(v) for k, v in sorted(self.by_target.items())},
            "by_variant": {k: dict(v) for k, v in sorted(self.by_variant.items())},
            "typed_errors": dict(self.typed_errors.most_common()), "typed_stages": dict(self.typed_stages.most_common()),
            "resigned_typed_fields": dict(self.typed_fields.most_common()),
            "resigned_typed_layers": dict(self.typed_layers.most_common()), "notes": dict(self.notes),
            "independent_reader_refuses_accepted_valid": dict(self.independent),
            "independent_examples": self.independent_examples, "cli_checked": self.cli_checked,
            "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in sorted(self.failures, key=lambda f: f["i"])[:200]],
        }


def signature(r: dict) -> tuple:
    if r["cls"] in ("accepted-but-changed", "cli-disagrees", "spec-disagrees"):
        reason = re.sub(r"'[^']*'|\"[^\"]*\"", "_", r.get("reason", ""))  # values out, the check stays
        return (r["cls"], re.sub(r"[0-9]+", "N", reason)[:80])
    return (r["cls"], r.get("error"), r.get("where"))


def run(mutants: int, seed: int, *, jobs: int = 0, timeout: float = 10.0, mem_gib: float = 2.0, cli_every: int = 10,
        progress: bool = False, scratch: str | None = None) -> Tally:
    """The core: ``mutants`` mutants of ``seed`` (in-process when jobs == 0)."""
    base = scratch or tempfile.mkdtemp(prefix="hsnap-mutate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tally = Tally(seed)
    inputs, groups = load_inputs()
    t0 = last = time.monotonic()

    def report() -> None:
        nonlocal last
        if progress and time.monotonic() - last > 10:
            last = time.monotonic()
            rate = tally.n / (last - t0)
            print(f"  {tally.n}/{mutants} ({rate:.0f}/s) failures {tally.failed}", file=sys.stderr, flush=True)

    try:
        if jobs <= 0:
            ctx = Context(os.path.join(base, "inproc"), cli_every=cli_every)
            for i in range(mutants):
                desc = generate(seed, i, inputs, groups)
                tally.add(desc, examine_in_process(desc, ctx, timeout))
                report()
        else:
            args = argparse.Namespace(seed=seed, jobs=jobs, timeout=timeout, mem_gib=mem_gib, cli_every=cli_every)
            _run_in_pool(args, base, mutants, lambda i: generate(seed, i, inputs, groups), tally, report)
    finally:
        if scratch is None:
            shutil.rmtree(base, ignore_errors=True)
    return tally


# ====================================================================== minimization


def _shrinks(ops):
    """Smaller variants of an op list: one op dropped, then one size halved."""
    for k in range(len(ops)):
        if len(ops) > 1:
            yield ops[:k] + ops[k + 1 :]
    for k, op in enumerate(ops):
        for field in ("n", "del"):
            if isinstance(op.get(field), int) and op[field] > 1:
                yield ops[:k] + [dict(op, **{field: op[field] // 2})] + ops[k + 1 :]
        if op["op"] == "j.lit" and "text" in op and len(op["text"]) > 8:
            yield ops[:k] + [dict(op, text=op["text"][: len(op["text"]) // 2 + 1])] + ops[k + 1 :]
        if "hex" in op and len(op["hex"]) > 2 and op["op"] == "b.ins":
            yield ops[:k] + [dict(op, hex=op["hex"][: len(op["hex"]) // 4 * 2])] + ops[k + 1 :]


def minimize(desc: dict, sig: tuple, evaluate, budget: int = 60, signature_of=None) -> dict:
    """Greedy: keep any shrink whose failure has the same signature (``signature_of``, default
    ``signature``)."""
    signature_of = signature_of or signature
    best = desc
    improved = True
    while improved and budget > 0:
        improved = False
        for ops in _shrinks(best["ops"]):
            budget -= 1
            cand = dict(best, ops=ops)
            if signature_of(evaluate(cand)) == sig:
                best, improved = cand, True
                break
            if budget <= 0:
                break
    return best


def save_findings(tally: Tally, out_dir: str, evaluate, keep: int, inputs, groups) -> list[str]:
    """Minimize and save the first ``keep`` distinct failures of each class; returns the case files."""
    shutil.rmtree(out_dir, ignore_errors=True)
    saved, seen = [], collections.Counter()
    sigs = set()
    for f in sorted(tally.failures, key=lambda f: f["i"]):
        sig = signature(f)
        if sig in sigs or seen[f["cls"]] >= keep:
            continue
        sigs.add(sig)
        seen[f["cls"]] += 1
        desc = f["desc"]
        small = desc if f["cls"] == "hang" or f.get("stage") == "worker" else minimize(desc, sig, evaluate)
        again = f if small is desc else evaluate(small)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{seen[f['cls']]:02d}-{f.get('error') or 'changed'}-{desc['target']}-{desc['operator']}")[:90]
        d = os.path.join(out_dir, f["cls"], slug)
        os.makedirs(d, exist_ok=True)
        files = build(small, inputs, groups)
        for name, data in files.items():
            p = os.path.join(d, "mutant", name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as fh:
                fh.write(data)
        case = {"seed": tally.seed, "i": desc["i"], "class": f["cls"], "signature": list(sig), "result": {k: v for k, v in again.items() if k != "desc"},
                "desc": small, "original_desc": desc,
                "reproduce": f".venv/bin/python -m mutation --replay {os.path.join(d, 'case.json')}",
                "open": os.path.join(d, "mutant", desc["target"].split("/")[0])}
        with open(os.path.join(d, "case.json"), "w") as fh:
            json.dump(case, fh, indent=1, default=str)
        saved.append(os.path.join(d, "case.json"))
    return saved


# ======================================================== the other targets
#
# --target reshard|resume|retract|gc|gc-url drives re-signed and raw mutants of seeds
# written from real SGLang pools (re-sharded restores across TP sizes, resume_req,
# load_retracted) and of directory / object-store layouts (hsnap gc) through the library,
# with the oracles of mutation/targets.py. Same pool, same limits, same JSON lines.

TARGETS = ("format",) + targets.TARGETS
TARGET_GROUPS = {"all": TARGETS, "new": targets.TARGETS}


def _targets_of(spec: str) -> list[str]:
    out = []
    for name in spec.split(","):
        for t in TARGET_GROUPS.get(name.strip(), (name.strip(),)):
            if t not in TARGETS:
                raise SystemExit(f"mutation: unknown target {t!r} (one of {', '.join(TARGETS)}, all, new)")
            if t not in out:
                out.append(t)
    return out


def _target_argv(args) -> list[str]:
    t = getattr(args, "target", "format")
    if t == "format":
        return []
    argv = ["--target", t, "--seeds", args.seeds]
    if getattr(args, "store", None):
        argv += ["--store", args.store]
    if getattr(args, "gc_strict", False):
        argv.append("--gc-strict")
    return argv


def _target_worker(args, proto_in, proto_out) -> int:
    seeds = targets.load_seeds(args.target, args.seeds)
    gen = targets.generator(seeds)
    store = None
    if args.store:
        with open(args.store) as f:
            store = json.load(f)
    ex = targets.examiner(seeds, args.scratch, cli_every=args.cli_every, store=store, strict=args.gc_strict)
    ex.warm()  # pools, descriptions, SGLang imports: before "ready", outside any mutant's time limit
    return _serve(args, proto_in, proto_out, lambda i: gen.generate(args.seed, i), lambda desc, req: ex.examine(desc), default=str)


def examine_target_in_process(desc: dict, ex, timeout: float) -> dict:
    try:
        with _time_limit(timeout):
            r = ex.examine(desc)
    except Hang:
        r = {"cls": "hang", "stage": "?", "error": "timeout", "where": f"over {timeout} s", "message": ""}
    r["i"] = desc["i"]
    return r


class TargetTally(Tally):
    """Counts of one target of mutation/targets.py (its classes, its failures)."""

    fail_classes = targets.FAIL_CLASSES

    def __init__(self, seed: int, target: str) -> None:
        super().__init__(seed)
        self.target = target
        self.uncommitted_removed = 0
        self.removed = 0  # gc: entries it removed (evidence that it still cleans)
        self.refusal_fields = collections.Counter()

    def add(self, desc: dict, r: dict) -> None:
        variant = self._count(desc, r)
        if r["cls"] == "typed":
            self.refusal_fields[f"{variant} {r['error']} {r.get('field', '')}"] += 1
        if r.get("note"):
            self.notes[r["note"][:60]] += 1
        self.uncommitted_removed += int(r.get("uncommitted_removed", 0))
        self.removed += int(r.get("removed", 0))

    def totals_line(self) -> str:
        t = self.total
        fails = ", ".join(f"{c} {t[c]}" for c in targets.FAIL_CLASSES if t[c])
        acc = "  ".join(f"{c} {t[c]}" for c in targets.OK_CLASSES[1:] if t[c]) or "accepted 0"
        return f"{self.target}: mutants {self.n}  typed {t['typed']}  {acc}  failures {self.failed}" + (f" ({fails})" if fails else "")

    def to_dict(self) -> dict:
        return {
            "target": self.target, "seed": self.seed, "mutants": self.n, "totals": {c: self.total[c] for c in targets.CLASSES},
            "failed": self.failed, "by_operator": {k: dict(v) for k, v in sorted(self.by_operator.items())},
            "by_target": {k: dict(v) for k, v in sorted(self.by_target.items())},
            "by_variant": {k: dict(v) for k, v in sorted(self.by_variant.items())},
            "typed_errors": dict(self.typed_errors.most_common()), "refusal_fields": dict(self.refusal_fields.most_common(60)),
            "notes": dict(self.notes), "uncommitted_rank_files_removed": self.uncommitted_removed, "gc_entries_removed": self.removed,
            "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in sorted(self.failures, key=lambda f: f["i"])[:200]],
        }


def target_signature(r: dict) -> tuple:
    """Failures of one kind: an exception by its class and the library frame; an oracle
    finding by its class and its reason with names and numbers folded."""
    if r.get("where") in (None, "oracle", "after gc", "after refusal", "cli gc") or r["cls"] in ("committed-removed", "pool-changed"):
        reason = re.sub(r"'[^']*'|\"[^\"]*\"", "_", r.get("reason", ""))
        reason = re.sub(r"[0-9]+", "N", re.sub(r"\.[A-Za-z0-9_.-]*hsnap-(staging|tmp)-[A-Za-z0-9_.-]*", ".STAGING", reason))
        return (r["cls"], reason[:70])
    return (r["cls"], r.get("error"), r.get("where"))


def run_target(target: str, mutants: int, seed: int, *, seeds_dir: str, jobs: int = 0, timeout: float = 10.0, mem_gib: float = 0.0,
               cli_every: int = 10, store: dict | None = None, strict: bool = False, progress: bool = False,
               scratch: str | None = None) -> TargetTally:
    """``mutants`` mutants of ``target`` from the seeds in ``seeds_dir`` (in-process when jobs == 0)."""
    base = scratch or tempfile.mkdtemp(prefix=f"hsnap-mutate-{target}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(base, exist_ok=True)
    seeds = targets.load_seeds(target, seeds_dir)
    gen = targets.generator(seeds)
    tally = TargetTally(seed, target)
    t0 = last = time.monotonic()

    def report() -> None:
        nonlocal last
        if progress and time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"  {target}: {tally.n}/{mutants} ({tally.n / (last - t0):.0f}/s) failures {tally.failed}", file=sys.stderr, flush=True)

    try:
        if jobs <= 0:
            ex = targets.examiner(seeds, os.path.join(base, "inproc"), cli_every=cli_every, store=store, strict=strict)
            ex.warm()
            for i in range(mutants):
                desc = gen.generate(seed, i)
                tally.add(desc, examine_target_in_process(desc, ex, timeout))
                report()
        else:
            store_file = None
            if store is not None:
                store_file = os.path.join(base, "store.json")
                with open(store_file, "w") as f:
                    json.dump(store, f)
            args = argparse.Namespace(seed=seed, jobs=jobs, timeout=timeout, mem_gib=max(mem_gib, targets.MEM_GIB[target]),
                                      cli_every=cli_every, target=target, seeds=seeds_dir, store=store_file, gc_strict=strict)
            _run_in_pool(args, base, mutants, lambda i: gen.generate(seed, i), tally, report)
    finally:
        if scratch is None:
            shutil.rmtree(base, ignore_errors=True)
    return tally


def save_target_findings(tally: TargetTally, out_dir: str, evaluate, keep: int, seeds) -> list[str]:
    """The first ``keep`` distinct failures of each class, minimized (ops dropped and
    shrunk while the signature stays) and saved with their files."""
    shutil.rmtree(out_dir, ignore_errors=True)
    saved, seen, sigs = [], collections.Counter(), set()
    for f in sorted(tally.failures, key=lambda f: f["i"]):
        sig = target_signature(f)
        if sig in sigs or seen[f["cls"]] >= keep:
            continue
        sigs.add(sig)
        seen[f["cls"]] += 1
        desc = f["desc"]
        unshrinkable = f["cls"] == "hang" or f.get("stage") == "worker"
        small = desc if unshrinkable else minimize(desc, sig, evaluate, budget=40, signature_of=target_signature)
        again = f if small is desc else evaluate(small)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{seen[f['cls']]:02d}-{f['cls']}-{desc['target']}-{desc['operator']}")[:90]
        d = os.path.join(out_dir, f["cls"], slug)
        os.makedirs(d, exist_ok=True)
        for name, data in targets.mutant_files(seeds, small).items():
            p = os.path.join(d, "mutant", name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as fh:
                fh.write(data)
        case = {"seed": tally.seed, "i": desc["i"], "target": tally.target, "class": f["cls"], "signature": list(sig),
                "result": {k: v for k, v in again.items() if k != "desc"}, "desc": small, "original_desc": desc,
                "reproduce": f".venv/bin/python -m mutation --replay {os.path.join(d, 'case.json')}"}
        with open(os.path.join(d, "case.json"), "w") as fh:
            json.dump(case, fh, indent=1, default=str)
        saved.append(os.path.join(d, "case.json"))
    return saved


def _counts_table(tally: Tally, cols: list[str], heads: list[str], width: int) -> str:
    """Mutants per class (``cols``, headed ``heads``) by operator, by target and by variant."""
    lines = [f"{'operator':<14} {'mutants':>8} " + " ".join(f"{h:>{width}}" for h in heads)]
    for groupname, table in (("operator", tally.by_operator), ("target", tally.by_target), ("variant", tally.by_variant)):
        if groupname != "operator":
            lines.append(f"-- by {groupname}")
        for name in sorted(table):
            c = table[name]
            lines.append(f"{name[:14]:<14} {sum(c.values()):>8} " + " ".join(f"{c[k]:>{width}}" for k in cols))
    return "\n".join(lines)


def _target_table(tally: TargetTally) -> str:
    shown = [c for c in targets.CLASSES if tally.total[c]] or ["typed", "accepted"]
    return _counts_table(tally, shown, [c[:12] for c in shown], 12)


def seeds_cache(target: str) -> str:
    """Where ``--replay`` (and a run without ``--seeds``) keeps a target's seeds: they are
    rebuilt identically (fixed identities, seeded pools), so a case replays anywhere."""
    return os.path.join(tempfile.gettempdir(), f"hsnap-mutate-seeds-{os.getuid()}", target)


def _replay_target(case: dict, timeout: float) -> int:
    t = case["target"]
    seeds = targets.load_seeds(t, targets.build_seeds(t, seeds_cache(t)))
    server = store = None
    with tempfile.TemporaryDirectory(prefix="hsnap-replay-") as d:
        try:
            if t == "gc-url":
                server, store = targets.start_store(os.path.join(d, "weed"))
            ex = targets.examiner(seeds, os.path.join(d, "x"), cli_every=0, store=store)
            if hasattr(ex, "warm"):  # SGLang's imports and the pools: outside the mutant's time limit, as in a run
                ex.warm()
            r = examine_target_in_process(case["desc"], ex, timeout)
        finally:
            if server is not None:
                server.stop()
    print(json.dumps({k: v for k, v in r.items() if k != "traceback"}, indent=1, default=str))
    if r.get("traceback"):
        print(r["traceback"])
    return 0 if r["cls"] in targets.OK_CLASSES else 1


def main_targets(args) -> int:
    """``--target`` other than ``format``: each target in turn, counts per target and overall."""
    sel = _targets_of(args.target)
    t_all = time.monotonic()
    base = tempfile.mkdtemp(prefix="hsnap-mutate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    results, rc = {}, 0
    try:
        for t in sel:
            t0 = time.monotonic()
            n = args.url_mutants if t == "gc-url" and args.url_mutants is not None else args.mutants
            if t == "format":
                out = os.path.join(base, "format.json")
                argv = ["--mutants", str(n), "--seed", str(args.seed), "--jobs", str(args.jobs), "--timeout", str(args.timeout),
                        "--mem-gib", str(args.mem_gib), "--cli-every", str(args.cli_every), "--json", out, "--findings", args.findings,
                        "--keep", str(args.keep)] + (["--quiet"] if args.quiet else [])
                rc |= main(argv)
                with open(out) as f:
                    d = json.load(f)
                failed = sum(d["totals"].get(c, 0) for c in FAIL_CLASSES)
                results[t] = {"mutants": d["mutants"], "failed": failed, "totals": d["totals"], "wall_s": round(time.monotonic() - t0, 1)}
                continue
            print(f"== target {t}: {n} mutants, seed {args.seed}, jobs {args.jobs}", flush=True)
            seeds_dir = args.seeds or os.path.join(base, "seeds", t)
            t_seeds = time.monotonic()
            targets.build_seeds(t, seeds_dir)
            seeds_s = time.monotonic() - t_seeds
            server = store = None
            try:
                if t == "gc-url":
                    server, store = targets.start_store(os.path.join(base, "weed"))
                tally = run_target(t, n, args.seed, seeds_dir=seeds_dir, jobs=args.jobs, timeout=args.timeout, mem_gib=args.mem_gib,
                                   cli_every=args.cli_every, store=store, strict=args.gc_strict, progress=not args.quiet,
                                   scratch=os.path.join(base, f"run-{t}"))
                saved = []
                if tally.failures:  # minimized in a worker (time and memory limits: a mutant may crash or hang)
                    seeds = targets.load_seeds(t, seeds_dir)
                    mbase = os.path.join(base, f"min-{t}")
                    os.makedirs(mbase, exist_ok=True)
                    store_file = None
                    if store is not None:
                        store_file = os.path.join(mbase, "store.json")
                        with open(store_file, "w") as f:
                            json.dump(store, f)
                    pool = Pool(argparse.Namespace(seed=args.seed, jobs=1, timeout=args.timeout, mem_gib=max(args.mem_gib, targets.MEM_GIB[t]),
                                                   cli_every=0, target=t, seeds=seeds_dir, store=store_file, gc_strict=args.gc_strict), mbase)

                    def evaluate(desc, pool=pool):
                        box = {}
                        pool.run([(0, {"case": desc})], lambda k, r: box.setdefault("r", r))
                        return box["r"]

                    try:
                        saved = save_target_findings(tally, os.path.join(args.findings, f"seed{args.seed}", t), evaluate, args.keep, seeds)
                    finally:
                        pool.close()
            finally:
                if server is not None:
                    server.stop()
            wall = time.monotonic() - t0
            print(_target_table(tally))
            if tally.refusal_fields:
                print("refusals, top checks: " + ", ".join(f"{k} {v}" for k, v in tally.refusal_fields.most_common(10)))
            if t in ("gc", "gc-url"):
                print(f"entries gc removed (leftovers it proved unfinished): {tally.removed}")
            if tally.uncommitted_removed:
                print(f"rank files of unfinished set exports removed (not counted as committed; --gc-strict counts them): {tally.uncommitted_removed}")
            for f in sorted(tally.failures, key=lambda f: f["i"])[:15]:
                print(f"FAIL {t} #{f['i']} {f['cls']} {f['desc']['target']} {f['desc']['operator']} {'re-signed' if f['desc']['resign'] else 'raw'}: "
                      f"{f.get('error', '')} {f.get('where', '')} {f.get('reason', '')[:160]} {f.get('message', '')[:100]}")
            for p in saved:
                print(f"saved {p}")
            print(f"{tally.totals_line()}  wall {wall:.1f} s (seeds {seeds_s:.1f} s)", flush=True)
            results[t] = dict(tally.to_dict(), wall_s=round(wall, 1), seeds_s=round(seeds_s, 1), findings=saved)
            rc |= 1 if tally.failed else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    total = sum(r["mutants"] for r in results.values())
    failed = sum(r["failed"] for r in results.values())
    wall = time.monotonic() - t_all
    print("overall: " + "  ".join(f"{t} {r['mutants']} ({r['failed']} failed, {r['wall_s']} s)" for t, r in results.items())
          + f"  total {total} mutants, {failed} failures, wall {wall:.1f} s, jobs {args.jobs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": results, "mutants": total, "failed": failed, "wall_s": round(wall, 1), "jobs": args.jobs,
                       "seed": args.seed, "timeout_s": args.timeout}, f, indent=1, default=str)
    return 1 if rc or failed else 0


# ============================================================================== CLI


def _table(tally: Tally) -> str:
    return _counts_table(tally, list(CLASSES), ["typed", "acc-same", "acc-valid", "acc-changed", "untyped", "hangs", "cli-disagr",
                                                "spec-disag", "harness"], 10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mutation", description="Structure-aware mutation run: only typed refusals may come out.")
    ap.add_argument("--mutants", type=int, default=50000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (0: in this process, no memory limit)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per mutant before it counts as a hang")
    ap.add_argument("--mem-gib", type=float, default=2.0, help="RLIMIT_AS of each worker, GiB")
    ap.add_argument("--cli-every", type=int, default=10, help="run the CLI on every Nth mutant (0: never)")
    ap.add_argument("--json", metavar="OUT", help="write counts and failures as JSON")
    ap.add_argument("--findings", default="/tmp/mutate-findings", help="where minimized failing inputs go (a seed<S> folder)")
    ap.add_argument("--keep", type=int, default=5, help="failures saved per class (distinct stack locations)")
    ap.add_argument("--replay", metavar="CASE_JSON", help="rerun one saved case in this process, with its traceback")
    ap.add_argument("--show", type=int, metavar="I", help="print mutant I's description and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--target", default="format",
                    help="what to mutate, comma-separated: format (the golden vectors through the readers), reshard, resume, "
                         "retract, gc, gc-url, migrate, chain, compact (mutation/targets.py); all; new (all but format); "
                         "http (one live server, bodies over every /hsnap route: mutation/http_routes.py)")
    ap.add_argument("--url-mutants", type=int, help="mutants of gc-url (each a few dozen requests to SeaweedFS; default --mutants)")
    ap.add_argument("--seeds", help="a folder of seeds to reuse (default: built for the run)")
    ap.add_argument("--gc-strict", action="store_true",
                    help="count rank files of an unfinished set export (rank-N.hsnap in a marked staging directory without manifest) as committed")
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.target == "http":  # a live server, not a pool of workers
        from mutation import http_routes

        return http_routes.main(["--mutants", str(args.mutants), "--seed", str(args.seed)] + (["--json", args.json] if args.json else [])
                                + (["--quiet"] if args.quiet else []))
    if args.worker:
        return _worker_main(args)
    if args.replay:
        with open(args.replay) as f:
            case = json.load(f)
        if case.get("target") in targets.TARGETS:
            return _replay_target(case, args.timeout)
    if args.target != "format":
        if args.show is not None:
            t = _targets_of(args.target)[0]
            seeds = targets.load_seeds(t, targets.build_seeds(t, args.seeds or seeds_cache(t)))
            print(json.dumps(targets.generator(seeds).generate(args.seed, args.show), indent=1))
            return 0
        return main_targets(args)
    inputs, groups = load_inputs()
    if args.show is not None:
        print(json.dumps(generate(args.seed, args.show, inputs, groups), indent=1))
        return 0
    if args.replay:
        with open(args.replay) as f:
            case = json.load(f)
        with tempfile.TemporaryDirectory(prefix="hsnap-replay-") as d:
            r = examine_in_process(case["desc"], Context(d, cli_every=1), args.timeout, cli=True)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}, indent=1))
        if r.get("traceback"):
            print(r["traceback"])
        return 0 if r["cls"] in OK_CLASSES else 1

    t0 = time.monotonic()
    print(f"hsnap mutation run: {args.mutants} mutants, seed {args.seed}, jobs {args.jobs}, timeout {args.timeout} s/mutant, "
          f"RLIMIT_AS {args.mem_gib} GiB, CLI every {args.cli_every}", flush=True)
    print("inputs: " + ", ".join(f"{n} ({len(b)} B)" for n, b in inputs.items()), flush=True)
    tally = run(args.mutants, args.seed, jobs=args.jobs, timeout=args.timeout, mem_gib=args.mem_gib, cli_every=args.cli_every,
                progress=not args.quiet)
    wall = time.monotonic() - t0
    saved = []
    if tally.failures:
        out_dir = os.path.join(args.findings, f"seed{args.seed}")
        base = tempfile.mkdtemp(prefix="hsnap-mutate-min-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            if args.jobs > 0:
                pool = Pool(argparse.Namespace(seed=args.seed, jobs=1, timeout=args.timeout, mem_gib=args.mem_gib, cli_every=args.cli_every), base)

                def evaluate(desc):
                    box = {}
                    pool.run([(0, {"case": desc, "cli": True})], lambda k, r: box.setdefault("r", r))
                    return box["r"]
            else:
                pool, ctx = None, Context(os.path.join(base, "c"))

                def evaluate(desc):
                    return examine_in_process(desc, ctx, args.timeout, cli=True)
            try:
                saved = save_findings(tally, out_dir, evaluate, args.keep, inputs, groups)
            finally:
                if pool is not None:
                    pool.close()
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print(_table(tally))
    print("typed refusals by class: " + ", ".join(f"{k} {v}" for k, v in tally.typed_errors.most_common()))
    print("re-signed refusals by layer of checks: " + ", ".join(f"{k} {v}" for k, v in tally.typed_layers.most_common()))
    print("re-signed refusals, top checks: " + ", ".join(f"{k} {v}" for k, v in tally.typed_fields.most_common(12)))
    if tally.independent:
        print("accepted-valid mutants the independent reader refuses where it deviates from the spec: "
              + ", ".join(f"{k} {v}" for k, v in tally.independent.items()))
        for x in tally.independent_examples[:5]:
            print(f"  #{x['i']} {x['target']} {json.dumps(x['ops'])[:160]}: {x['independent'][:160]}")
    if tally.notes:
        print("typed refusals with notes: " + ", ".join(f"{k} {v}" for k, v in tally.notes.items()))
    for f in sorted(tally.failures, key=lambda f: f["i"])[:20]:
        print(f"FAIL #{f['i']} {f['cls']} {f['desc']['target']} {f['desc']['operator']} "
              f"{'re-signed' if f['desc']['resign'] else 'raw'}: {f.get('error', '')} {f.get('where', '')} {f.get('reason', '')} {f.get('message', '')[:120]}")
    for p in saved:
        print(f"saved {p}")
    print(f"accepted-valid: {tally.total['accepted-valid']}  cli-disagrees: {tally.total['cli-disagrees']}  "
          f"harness-errors: {tally.total['harness-error']}  CLI checked: {tally.cli_checked}  wall: {wall:.1f} s")
    print(tally.totals_line(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tally.to_dict(), wall_s=round(wall, 1), jobs=args.jobs, timeout_s=args.timeout, mem_gib=args.mem_gib,
                           inputs={n: {"bytes": len(b), "xxh3_128": xxhash.xxh3_128_hexdigest(b)} for n, b in inputs.items()},
                           findings=saved), f, indent=1)
    return 1 if tally.failed else 0

