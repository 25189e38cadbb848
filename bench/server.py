"""The hsnap plug-in inside a running SGLang server: what an export costs the other requests,
how fast a pause is durable, and how fast a resumed request gets its first token against re-prefilling its history.

    python -m bench.server                          # 53 / 4k / 32k committed tokens, as far as --budget allows
    python -m bench.server --sizes 53,4096 --rounds 2 --budget 120

One real server (``python -m hsnap_sglang.serve --enable-hsnap``: SGLang's ``launch_server`` with the plug-in, on
hsnap's CPU platform; the tiny random-weight Qwen3-Next of ``hsnap_sglang.tiny``, bfloat16, radix cache on).  A
warm-up export and resume go first (the first export of a server process hashes the model directory for its
identity).  Then for each size n (the committed positions of the exported request x: a prompt of n - K + 1 tokens
and K outputs) and round:

* **stall**: two other requests decode throughout; x is prefilled and decodes beside them; after K outputs it is
  exported (``POST /hsnap/export``).  The others' inter-token gaps (client side, one event per token): *before* =
  while x decodes beside them, before the export is asked for; *around* = every gap that overlaps the export call.
  Extra decode steps = (max around - median before) / median before; the goal is at most 1.  Beside it, the same
  figure for windows as long as the export call before it (no export in them; the median over such windows): what the
  host's scheduling alone gives (2 cores shared by the scheduler, the HTTP process, the detokenizer and this client).
* **pause-to-durable**: the server's figure, from the export request's arrival at the scheduler to the snapshot
  committed (fsynced, renamed), and the client's whole call.
* **resume-to-first-token**: ``POST /hsnap/resume`` to the first event carrying a new token (client side, HTTP
  included), the server otherwise idle, its radix cache flushed; the server's restore time beside it.
* **re-prefill**: the recompute alternative in the same server: x's history (prompt + K outputs) sent as a new
  ``/generate`` (radix cache flushed), to its first token.

Sizes whose projected time does not fit the remaining budget are reported as skipped; a size whose first round fails
(a prefill longer than the stream's timeout) as failed, with the reason.  Writes bench/SERVER.md
(``--results`` to change, ``--results ''`` for none).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.results import publish  # noqa: E402
from hsnap_sglang import client  # noqa: E402
from hsnap_sglang.demo import REQUEST_TIMEOUT_S, DemoError, DemoServer, Stream, abort, flush_cache, payload, prompt_ids, server_args, server_env  # noqa: E402

SIZES = (53, 4096, 32768)
BIG = 16384  # a size whose prefill takes minutes on this CPU platform
K = 24  # outputs before the export: enough decode steps beside x for the "before" gaps
OTHERS = 2
# 3 Mamba slots per running request (SGLang caps --max-running-requests by them): x and the others at once
CAPACITY = {"--max-total-tokens": "81920", "--max-mamba-cache-size": "16", "--max-running-requests": "4"}


@dataclass
class Round:
    committed: int
    bytes: int
    pause_call_s: float
    pause_to_durable_s: float
    write_s: float
    resume_first_token_s: float
    restore_s: float
    reprefill_first_token_s: float
    gaps_before: list[float]
    gaps_around: list[float]
    resume_phases: dict = field(default_factory=dict)  # the server's: hsnap_sglang.frontend.resume_phases, + first_forward_s
    gaps_around_resume: list[float] = field(default_factory=list)  # the others' gaps around a resume while they decode
    busy_resume_first_token_s: float = float("nan")  # that resume's first token, as its client saw it
    # control: windows as long as the export call, before it (no export): the others' longest gap in each
    window_maxima_before: list[float] = field(default_factory=list)

    def _extra(self, around: list[float]) -> float | None:
        """The others' longest gap in ``around``, in decode steps more than their median gap before the export."""
        if not self.gaps_before or not around:
            return None
        med = statistics.median(self.gaps_before)
        return (max(around) - med) / med

    @property
    def extra_steps(self) -> float | None:
        return self._extra(self.gaps_around)

    @property
    def extra_steps_resume(self) -> float | None:
        return self._extra(self.gaps_around_resume)

    @property
    def extra_steps_without_export(self) -> float | None:
        """The same figure for a window as long as the export call with no export in it (the median over such windows
        before the export): what this host's scheduling alone gives, beside which ``extra_steps`` is read."""
        if not self.gaps_before or not self.window_maxima_before:
            return None
        med = statistics.median(self.gaps_before)
        return (statistics.median(self.window_maxima_before) - med) / med


@dataclass
class Size:
    n: int
    rounds: list[Round] = field(default_factory=list)
    skipped: str | None = None


def prefill_timeout_s(n: int) -> float:
    """How long a stream may wait for the first token of an ``n``-token prompt: the CPU platform's prefill grows
    faster than linearly (a 32k prompt beside two decoding requests took 160 s one hour, over 300 s another)."""
    return max(REQUEST_TIMEOUT_S, 0.03 * n)


def _first_token_s(url: str, body: dict, n: int) -> float:
    s = Stream(url, body, timeout=prefill_timeout_s(n))
    t0 = time.monotonic()
    s.start()
    s.wait_tokens(1, timeout=prefill_timeout_s(n))
    s.finish()
    return s.times[0] - t0


def one_round(url: str, n: int, tag: str, d: Path, log, reprefill_s: float | None = None) -> Round:
    """One round at ``n`` committed positions (``reprefill_s``: the re-prefill measured by an earlier round, not
    measured again: at 32k it takes minutes)."""
    prompt = prompt_ids(zlib.crc32(tag.encode()), max(1, n - K + 1))
    flush_cache(url)
    # x first, the others once it is prefilled: a 32k prefill outlives requests started before it (minutes here)
    x = Stream(url, payload(f"x-{tag}", K + 40, ids=prompt), timeout=prefill_timeout_s(n))  # still decoding at the export
    x.start()
    x.wait_tokens(2, timeout=prefill_timeout_s(n))
    others = [Stream(url, payload(f"bg{i}-{tag}", 10_000, ids=prompt_ids(100 + i, 30))) for i in range(OTHERS)]
    for o in others:
        o.start()
    for o in others:
        o.wait_tokens(5)
    t_decoding = time.monotonic()  # x decoding beside the others
    x.wait_tokens(K)
    path = d / f"x-{tag}.hsnap"
    t0 = time.monotonic()
    out = client.pause(url, f"x-{tag}", str(path))
    t1 = time.monotonic()
    x.finish()
    # a resume while the others decode (again: the idle resume below is the claimed one): their gaps around it
    busy_first: list[float] = []
    t2 = time.monotonic()
    client.resume(url, str(path), again=True, on_chunk=lambda rid, text, ids, e: busy_first.append(time.monotonic()) if ids and not busy_first else None)
    t3 = busy_first[0] if busy_first else time.monotonic()
    before, around, around_resume = [], [], []
    for o in others:
        for a, b in zip(o.times, o.times[1:]):
            if a >= t_decoding and b < t0:
                before.append(b - a)
            if b >= t0 and a <= t1:
                around.append(b - a)
            if b >= t2 and a <= t3:
                around_resume.append(b - a)
    # control: windows as long as the export call, sliding by half of it over the time before the export
    span, maxima, ws = t1 - t0, [], t_decoding
    while span > 0 and ws + span < t0:
        inside = [b - a for o in others for a, b in zip(o.times, o.times[1:]) if a >= t_decoding and b < t0 and b >= ws and a <= ws + span]
        if inside:
            maxima.append(max(inside))
        ws += span / 2
    for o in others:
        abort(url, o.rid)
    for o in others:
        o.join(120)
    k = int(out["output_tokens"])
    history = prompt + list(x.final["output_ids"][:k])
    flush_cache(url)
    reprefill = reprefill_s if reprefill_s is not None else _first_token_s(url, payload(f"re-{tag}", 1, ids=history), len(history))
    flush_cache(url)
    first: list[float] = []
    t_res = time.monotonic()
    run = client.resume(url, str(path), on_chunk=lambda rid, text, ids, e: first.append(time.monotonic() - t_res) if ids and not first else None)
    t = out["timings"]
    phases = {k: float(v) for k, v in run.info["result"]["timings"].items() if k in RESUME_PHASES}
    if first and "to_answer_s" in phases:  # the rest, as the client saw it: the first decode step and its way back
        phases["first_forward_s"] = first[0] - phases["to_answer_s"]
    r = Round(committed=int(out["committed_positions"]), bytes=int(out["bytes"]), pause_call_s=t1 - t0,
              pause_to_durable_s=float(t["pause_to_durable_s"]), write_s=float(t["write_s"]),
              resume_first_token_s=first[0] if first else float("nan"), restore_s=float(run.info["result"]["timings"]["restore_s"]),
              reprefill_first_token_s=reprefill, gaps_before=before, gaps_around=around, resume_phases=phases,
              gaps_around_resume=around_resume, busy_resume_first_token_s=t3 - t2, window_maxima_before=maxima)
    log("  export timings: " + ", ".join(f"{k} {fmt(v)}" for k, v in t.items() if isinstance(v, float)))
    log(f"{n} ({r.committed} committed): pause-to-durable {fmt(r.pause_to_durable_s)}, resume->first token {fmt(r.resume_first_token_s)} "
        f"vs re-prefill {fmt(r.reprefill_first_token_s)}; others' gap median {fmt(statistics.median(before)) if before else '-'} "
        f"-> around the export max {fmt(max(around)) if around else '-'}")
    log("  resume phases: " + ", ".join(f"{k.removesuffix('_s')} {fmt(v)}" for k, v in phases.items()))
    return r


# the phases of a resume, in order (hsnap_sglang.frontend.resume_phases; first_forward: the client's first token less
# the server's answer, i.e. the first decode step, the detokenizer and the stream's way back)
RESUME_PHASES = ("read_s", "claim_s", "register_s", "queue_s", "restore_s", "prove_s", "pickup_s", "upload_s", "proof_s", "ahead_s", "admit_s",
                 "answer_s", "to_answer_s")
PHASE_COLUMNS = RESUME_PHASES + ("first_forward_s",)


def fmt(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _range(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    return "-" if not xs else f"{min(xs):.1f}–{max(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def _span(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} – {fmt(hi)}"


def report(sizes: list[Size], args, srv: DemoServer, wall: float, load0, load1) -> str:
    out = ["# The hsnap plug-in in a running server (python -m bench.server)", ""]
    import torch

    out.append(f"Machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores usable; torch "
               f"{torch.__version__}; load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end; {wall:.0f} s in all  ")
    out.append(f"Server: `python -m hsnap_sglang.serve --enable-hsnap` (SGLang's launch_server, hsnap's CPU platform), tiny "
               f"random-weight {args.arch}, bfloat16, radix cache on, {' '.join(f'{k} {v}' for k, v in CAPACITY.items())}; "
               f"ready after {srv.ready_s:.1f} s  ")
    out.append(f"Per round: x prefilled, then {OTHERS} other requests decode beside it; x exported after {K} outputs and resumed once while they "
               "decode (again; its first token and their longest gap around it); then re-prefill and resume "
               f"with the server otherwise idle, radix cache flushed (at {BIG:,} positions or more, the re-prefill is measured in "
               "the first round only). Times are client side (HTTP included) except "
               "pause-to-durable and restore (the server's). Ranges: min–max over the rounds.")
    out.append("")
    head = ["committed positions", "rounds", "snapshot", "pause call", "pause-to-durable", "resume → first token (restore)",
            "re-prefill → first token", "others' gap before: median / p90", "around the export: max", "extra decode steps (goal ≤ 1)",
            "as long a window before it: extra steps (median)",
            "resume while they decode: first token / their extra decode steps"]
    rows = []
    for s in sizes:
        if s.skipped:
            rows.append([f"{s.n:,}", "0", s.skipped, "", "", "", "", "", "", "", "", ""])
            continue
        rs = s.rounds
        before = [g for r in rs for g in r.gaps_before]
        p90 = sorted(before)[int(0.9 * (len(before) - 1))] if before else float("nan")
        extra = [r.extra_steps for r in rs if r.extra_steps is not None]
        rows.append([
            f"{statistics.median(r.committed for r in rs):,.0f}", str(len(rs)), f"{statistics.median(r.bytes for r in rs) / 1e6:.2f} MB",
            _span([r.pause_call_s for r in rs]), _span([r.pause_to_durable_s for r in rs]),
            f"{_span([r.resume_first_token_s for r in rs])} ({_span([r.restore_s for r in rs])})",
            _span([r.reprefill_first_token_s for r in rs]),
            f"{fmt(statistics.median(before)) if before else '-'} / {fmt(p90) if before else '-'} ({len(before)} gaps)",
            _span([max(r.gaps_around) for r in rs if r.gaps_around]),
            (f"{min(extra):.1f}–{max(extra):.1f}" if len(extra) > 1 else f"{extra[0]:.1f}") if extra else "-",
            _range([r.extra_steps_without_export for r in rs]),
            f"{_span([r.busy_resume_first_token_s for r in rs])} / {_range([r.extra_steps_resume for r in rs])}",
        ])
    w = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    out.append("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    out += ["| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) + " |" for r in rows]
    out.append("")
    done = [s for s in sizes if not s.skipped and s.rounds]
    if any(r.resume_phases for s in done for r in s.rounds):
        out.append("Where a resume's time goes (median over the rounds; the server's stamps, one monotonic clock; restore = "
                   "prove (the wait, from the resume's message, for its proof: the snapshot opened, checked, every byte read and "
                   "hashed — started ahead, when the route was called, while the HTTP process reads, claims and registers) + "
                   "pickup (to the scheduler's next iteration) + upload (the scheduler thread: room, slots, copy); proof = the "
                   "proof's own time, ahead = the part of it before the resume's message; first forward = the client's first "
                   "token less the server's answer):")
        out.append("")
        out.append("| committed positions | " + " | ".join(c.removesuffix("_s").replace("_", " ") for c in PHASE_COLUMNS) + " |")
        out.append("|---" * (len(PHASE_COLUMNS) + 1) + "|")
        for s in done:
            cells = [fmt(statistics.median(v)) if (v := [r.resume_phases[c] for r in s.rounds if c in r.resume_phases]) else "-"
                     for c in PHASE_COLUMNS]
            out.append(f"| {statistics.median(r.committed for r in s.rounds):,.0f} | " + " | ".join(cells) + " |")
        out.append("")
    if done:
        out += goals(done)
        worst = max((r.extra_steps for s in done for r in s.rounds if r.extra_steps is not None), default=None)
        if worst is not None:
            ctrl = [r.extra_steps_without_export for s in done for r in s.rounds if r.extra_steps_without_export is not None]
            out.append(f"Stall: the other requests' longest gap around an export was {worst:.1f} decode steps more than their "
                       f"median gap ({'within' if worst <= 1.0 else 'OVER'} the goal of one extra step)"
                       + (f"; in windows as long before the export, without one, {statistics.median(ctrl):.1f} (median over the rounds, "
                          f"up to {max(ctrl):.1f})." if ctrl else "."))
        for s in done:
            res = statistics.median(r.resume_first_token_s for r in s.rounds)
            pre = statistics.median(r.reprefill_first_token_s for r in s.rounds)
            out.append(f"At {statistics.median(r.committed for r in s.rounds):,.0f} committed positions: resume gets its first token in "
                       f"{fmt(res)}, re-prefilling the history in {fmt(pre)} ({pre / res:.1f}x).")
    out.append("")
    out.append("Raw rounds (JSON):")
    out.append("")
    out.append("```json")
    out.append(json.dumps({str(s.n): [r.__dict__ | {"extra_steps": r.extra_steps, "extra_steps_resume": r.extra_steps_resume,
                                                   "extra_steps_without_export": r.extra_steps_without_export} for r in s.rounds] for s in done},
                          sort_keys=True))
    out.append("```")
    return "\n".join(out)


GOAL_SLACK_S = 0.005  # resume -> first token: at most the restore + one decode step + this


def _restore_work(r) -> float:
    """The restore's own time: its proof (wherever and whenever it ran) + its upload; the server's restore_s (from the
    resume's message) where the phases do not say."""
    p = r.resume_phases or {}
    return p["proof_s"] + p["upload_s"] if "proof_s" in p and "upload_s" in p else r.restore_s


def goals(done) -> list[str]:
    """The goals per size, met or missed, with where the time went: resume -> first token <= restore + one decode
    step (the median gap of the others while x decoded beside them) + 5 ms; at most one extra decode step for the
    others around an export."""
    out = ["Goals (medians over the rounds; a decode step = the others' median gap while x decoded beside them):", "",
           "| committed positions | resume → first token | restore (proof + upload) + step + 5 ms | met | over the restore and the step: hsnap's "
           "phases / the first forward beyond a step | extra decode steps | met |", "|---|---|---|---|---|---|---|"]
    for s in done:
        rs = s.rounds
        res = statistics.median(r.resume_first_token_s for r in rs)
        # the restore's own work (its proof, wherever it ran, and its upload): what a resume must spend at least
        restore = statistics.median(_restore_work(r) for r in rs)
        step = statistics.median(g for r in rs for g in r.gaps_before)
        goal = restore + step + GOAL_SLACK_S
        phases = [r.resume_phases for r in rs if r.resume_phases]
        overhead = statistics.median(p["to_answer_s"] - (p["proof_s"] + p["upload_s"] if "proof_s" in p else p["restore_s"])
                                     for p in phases) if phases else None
        beyond = statistics.median(p["first_forward_s"] - step for p in phases) if phases else None
        extra = max((r.extra_steps for r in rs if r.extra_steps is not None), default=None)
        out.append(f"| {statistics.median(r.committed for r in rs):,.0f} | {fmt(res)} | {fmt(goal)} | {'met' if res <= goal else 'missed'} | "
                   + (f"{fmt(overhead)} / {fmt(beyond)}" if phases else "-") + " | "
                   + (f"{extra:.1f} | {'met' if extra <= 1.0 else 'missed'}" if extra is not None else "- | -") + " |")
    out.append("")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=list(SIZES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--big-rounds", type=int, default=1, help=f"rounds at {BIG:,} positions or more (each prefills minutes; "
                                                             "its re-prefill is measured in the first round only)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds in all, server start included (default 300)")
    ap.add_argument("--arch", choices=("qwen3_next", "qwen3_5"), default="qwen3_next")
    ap.add_argument("--model-dir", default=None, help="a tiny model directory to use or build (default: built in a temporary directory)")
    ap.add_argument("--results", default=None, help="markdown output (default bench/SERVER.md; '' for none)")
    args = ap.parse_args(argv)
    if any(n < K for n in args.sizes) or max(args.sizes) > 40000:
        ap.error(f"--sizes: each between {K} and 40000 committed positions")
    t_start = time.monotonic()
    load0 = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    from hsnap_sglang.tiny import build_model_dir

    sizes = [Size(n) for n in sorted(args.sizes)]
    with tempfile.TemporaryDirectory(prefix="hsnap-bench-server-") as tmp:
        d = Path(tmp)
        model = build_model_dir(args.model_dir or d / "model", arch=args.arch)
        srv = DemoServer("bench", model, d / "server.log", server_args(CAPACITY), server_env(root=d))
        try:
            srv.start(420.0)
            log(f"server ready after {srv.ready_s:.1f} s")
            one_round(srv.url, K + 10, "warmup", d, lambda m: log("warm-up: " + m))
            rate = None  # seconds per committed position of one round, from the sizes done so far
            for s in sizes:
                left = args.budget - (time.monotonic() - t_start)
                projected = None if rate is None else rate * s.n * 1.3
                if projected is not None and projected + 5 > left:
                    s.skipped = f"skipped: a round projected at ~{fmt(projected)}, {fmt(max(left, 0))} of budget left"
                    log(f"{s.n}: {s.skipped}")
                    continue
                rounds = args.rounds if s.n < BIG else args.big_rounds
                for i in range(rounds):
                    t = time.monotonic()
                    again = s.rounds[0].reprefill_first_token_s if s.rounds and s.n >= BIG else None
                    try:
                        s.rounds.append(one_round(srv.url, s.n, f"{s.n}-{i}", d, log, reprefill_s=again))
                    except DemoError as e:  # (a prefill that outlives the stream's timeout): reported, the rest kept
                        s.skipped = None if s.rounds else f"failed: {e}"
                        log(f"{s.n}: round {i} failed after {fmt(time.monotonic() - t)}: {e}")
                        break
                    took = time.monotonic() - t
                    rate = took / s.n if s.n >= 1024 else rate
                    if i + 1 < rounds and took + 5 > args.budget - (time.monotonic() - t_start):
                        break
        finally:
            srv.stop()
        text = report(sizes, args, srv, time.monotonic() - t_start, load0, os.getloadavg())
    publish(text, args.results, "SERVER.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
