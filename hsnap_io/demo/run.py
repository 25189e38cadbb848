"""``hsnap demo --library``: a hybrid model resumes in a fresh process with identical tokens and logprobs.

The library-level demo (``hsnap demo`` without ``--library`` runs two real SGLang servers: ``hsnap_sglang.demo``).
On CPU, nothing downloaded, through real SGLang pools and real hsnap files:

1. child 1 (``reference``) generates N tokens uninterrupted (greedy; with ``--all`` also sampled);
2. child 2 (``export``) generates k tokens, writes the attention KV and GDN conv / recurrent state into real SGLang
   pools (``HybridLinearKVPool`` + ``HybridReqToTokenPool``), exports the request with ``hsnap_io.export_request``
   and exits;
3. child 3 (``resume``), a fresh process, builds pools of another capacity with other slots in use, restores with
   ``hsnap_io.restore_request`` and continues to N tokens from the snapshot alone (prompt, outputs so far, sampling
   parameters, budget and sampler state all come from the file);
4. this process compares: token ids, logprobs (bit for bit), positions that went through forward in child 3
   (exactly N - k: no history position recomputed), and lists the snapshot's sections, bytes and digests.

``--negative`` runs the negative client instead (wrong weights, wrong layout, missing rank file, corrupted
section: each refused with its typed error, target pools untouched); ``--all`` runs greedy, sampled and negative.
Children are ``python -m hsnap_io.demo.run --child ROLE ...``; results travel as JSON files (never pickle).
Nothing is ever replaced or deleted: the snapshot goes to a path that must not exist (``--out``; default a new
directory ``hsnap-demo-library-<date>-<time>/``), the negative client's files to a ``--workdir`` without them.
Exit status: 0 when everything is identical / refused as it should be, 1 when not, 2 when the demo could not run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any


DEFAULT_NAME = "request.hsnap"  # inside a new directory hsnap-demo-library-<date>-<time>/ unless --out is given
# A fixed prompt: the bytes of a sentence are the token ids (all < 128 < the tiny model's vocabulary of 512).
PROMPT_TEXT = "Snapshots move one live request between processes."
PROMPT = list(PROMPT_TEXT.encode("ascii"))
SAMPLED_TEMPERATURE = 0.8
ROLES = ("reference", "export", "resume", "negative")
_SPAWNED: list["Child"] = []  # children of the running demo (killed, by their own pid, if it is interrupted)


class DemoError(Exception):
    """The demo could not run (bad arguments, a child process failed, an output path is not ours)."""


@dataclass
class Variant:
    name: str
    temperature: float
    seed: int | None
    path: str

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    result: str
    log: str
    started: float
    wall: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ arguments


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsnap demo --library",
        description="Pause a tiny random-weight hybrid model (attention + GDN) after k tokens, move the request "
        "through real SGLang pools into an hsnap file, restore it into other pools in a fresh process and continue: "
        "token ids and logprobs must equal an uninterrupted run exactly, with no history position recomputed.",
    )
    p.add_argument("--n", type=int, default=64, help="output tokens in total (default 64)")
    p.add_argument("-k", "--k", type=int, default=10, help="tokens generated before the pause (default 10)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=1234, help="sampler seed when sampling (default 1234)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every child (default 1)")
    p.add_argument(
        "--resume-threads", type=int, default=None,
        help="torch threads of the resuming child only (default: --threads); another count shows the numerics "
        "warning: bit-exactness is then not expected",
    )
    p.add_argument("--arch", choices=("qwen3_5", "qwen3_next"), default="qwen3_5", help="tiny model family")
    p.add_argument("--model-seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--out", default=None, help=f"snapshot file to leave on disk, a path that does not exist yet (default: "
                   f"hsnap-demo-library-<date>-<time>/{DEFAULT_NAME}, a new directory)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--negative", action="store_true", help="run the negative client only")
    mode.add_argument("--all", action="store_true", help="greedy + sampled + negative client in one run")
    p.add_argument("--reshard", metavar="SRC:DST", help="export the paused request as a TP SRC snapshot set and resume it at TP DST (2:1)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--workdir", help="keep the children's JSON results and logs in this new directory (default: a temporary "
                   "directory, removed afterwards)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child process (default 600)")
    return p


def _validate(args) -> None:
    if args.threads < 1 or (args.resume_threads is not None and args.resume_threads < 1):
        raise DemoError("--threads must be >= 1")
    if not 1 <= args.k < args.n:
        raise DemoError(f"need 1 <= k < N, got k={args.k}, N={args.n}")
    if len(PROMPT) + args.n > 512:
        raise DemoError(f"prompt ({len(PROMPT)}) + N must fit the tiny model's 512 positions")
    for name, v in (("--model-seed", args.model_seed), ("--seed", args.seed)):
        if not 0 <= v < 2**63:
            raise DemoError(f"{name} must be in [0, 2**63), got {v}")
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise DemoError(f"bad temperature {args.temperature}")


def _default_out() -> str:
    """A new directory for this run's snapshot (never one that exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(100):
        d = f"hsnap-demo-library-{stamp}" + (f"-{i}" if i else "")
        try:
            os.mkdir(d)
            return os.path.join(d, DEFAULT_NAME)
        except FileExistsError:
            continue
    raise DemoError(f"no free name hsnap-demo-library-{stamp}-N in {os.getcwd()}")


def _variants(args) -> list[Variant]:
    if args.negative:
        return []
    out = os.path.abspath(args.out)
    if args.all:
        stem, ext = os.path.splitext(out)
        t = args.temperature if args.temperature > 0 else SAMPLED_TEMPERATURE
        return [Variant("greedy", 0.0, None, out), Variant("sampled", t, args.seed, f"{stem}.sampled{ext or '.hsnap'}")]
    if args.temperature > 0:
        return [Variant("sampled", args.temperature, args.seed, out)]
    return [Variant("greedy", 0.0, None, out)]


def _refuse_existing(path: str) -> None:
    """The demo writes only new files: an existing ``path`` (a previous snapshot or anything else) is left alone."""
    if os.path.lexists(path):
        raise DemoError(f"{path} exists: the demo never replaces a file (choose another --out)")


# ------------------------------------------------------------------------------------------------ children


def _spawn(role: str, workdir: str, args, threads: int, extra: list[str]) -> Child:
    result = os.path.join(workdir, f"{role}.json")
    log = os.path.join(workdir, f"{role}.log")
    cmd = [
        sys.executable, "-m", "hsnap_io.demo.run", "--child", role, "--result", result,
        "--arch", args.arch, "--model-seed", str(args.model_seed), "--threads", str(threads), *extra,
    ]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        OPENBLAS_NUM_THREADS=str(threads),
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env)
    child = Child(role, proc, result, log, time.perf_counter())
    _SPAWNED.append(child)
    return child


def _wait(children: list[Child], timeout: float) -> None:
    failed = []
    for c in children:
        try:
            rc = c.proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - c.started)))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
            rc = "timeout"
        c.wall = time.perf_counter() - c.started
        if rc != 0 or not os.path.exists(c.result):
            failed.append((c, rc))
            continue
        with open(c.result) as f:
            c.data = json.load(f)
    if failed:
        lines = []
        for c, rc in failed:
            with open(c.log, errors="replace") as f:
                tail = f.read().splitlines()[-25:]
            lines.append(f"child {c.role} (pid {c.proc.pid}) failed: exit {rc}\n    " + "\n    ".join(tail))
        raise DemoError("\n".join(lines))


def _variant_args(variants: list[Variant], with_path: bool) -> list[str]:
    out = []
    for v in variants:
        out += ["--variant", v.name, repr(v.temperature), "-" if v.seed is None else str(v.seed)]
        if with_path:
            out += ["--snapshot", v.name, v.path]
    return out


# ------------------------------------------------------------------------------------------------ report


def _snapshot_report(path: str, export: dict[str, Any]) -> dict[str, Any]:
    import hsnap_format as hf

    with hf.open(path) as snap:
        snap.verify()
        sections = [
            {
                "name": s.name,
                "kind": s.kind,
                "layer": s.layer,
                "dtype": s.dtype,
                "shape": list(s.shape),
                "bytes": s.length,
                "digest": s.digest,
            }
            for s in snap.sections
        ]
        ident = snap.identity
        by_kind: dict[str, int] = {}
        for s in sections:
            by_kind[s["kind"]] = by_kind.get(s["kind"], 0) + s["bytes"]
        return {
            "path": path,
            "file_length": snap.file_length,
            "payload_bytes": snap.payload_bytes,
            "sections": sections,
            "section_count": len(sections),
            "bytes_by_kind": by_kind,
            "root_digest": snap.root_digest,
            "digest_algorithm": "xxh3-128",
            "root_digest_matches_commit": snap.root_digest == export["root_digest"],
            "verified": True,
            "identity": {
                "model_id": ident.model_id,
                "weights_version": ident.weights_version,
                "engine": f"{ident.engine.name} {ident.engine.version}",
                "snapshot_id": ident.snapshot_id,
                "created_at": ident.created_at,
                "numerics": dict(ident.numerics),
            },
            "request": {
                "rid": snap.request["rid"],
                "prompt_tokens": snap.request["prompt_tokens"],
                "output_tokens": snap.request["output_tokens"],
                "state_position": snap.state_position,
                "remaining_budget": snap.request["remaining_budget"],
                "streamed_tokens": snap.request["streamed"]["tokens"],
                "sampling": snap.request["sampling"],
                "has_rng_state": snap.request["has_rng_state"],
            },
        }


def _variant_report(v: Variant, n: int, k: int, ref: dict, exp: dict, res: dict) -> dict[str, Any]:
    a, b = ref["token_ids"], res["token_ids"]
    matching = sum(1 for x, y in zip(a, b) if x == y)
    first_mismatch = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first_mismatch is None and len(a) != len(b):
        first_mismatch = min(len(a), len(b))
    if len(ref["logprobs"]) == len(res["logprobs"]) and res["logprobs"]:
        max_diff = max(abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf for x, y in zip(ref["logprobs"], res["logprobs"]))
    else:
        max_diff = math.inf
    expected_forward = n - k
    checks = {
        "tokens_equal": a == b and len(a) == n,
        "logprobs_bit_identical": max_diff == 0.0,
        "forwarded_is_n_minus_k": res["positions_forwarded"] == expected_forward and res["forward_calls"] == expected_forward,
        "no_history_recomputed": res["history_positions_recomputed"] == 0,
        "paused_prefix_matches_reference": exp["token_ids"] == a[:k],
    }
    if v.sampled:
        checks["sampler_state_equal"] = res["rng_state_sha256"] == ref["rng_state_sha256"] and res["rng_state_restored"]
    stream = reasoning = None
    if res.get("api") == "sglang.Req":
        stream = _stream_report(exp["stream_chunks"], res["stream_chunks"], a, ref["logprobs"], res["streamed_at_resume"])
        reasoning = {
            "at_pause": exp["reasoning"],
            "at_resume": res["reasoning_at_resume"],
            "final": res["reasoning_final"],
            "reference_at_pause": ref["reasoning_at_k"],
            "reference_final": ref["reasoning_final"],
        }
        checks["stream_continuous"] = stream["continuous"]
        checks["reasoning_state_carried"] = (
            reasoning["at_resume"] == reasoning["at_pause"] == reasoning["reference_at_pause"]
            and reasoning["final"] == reasoning["reference_final"]
        )
        checks["restored_state_not_cleared"] = res["flags"]["mamba_needs_clear"] is False and res["flags"]["mamba_cow_src_index"] is None
    return {
        "ok": all(checks.values()),
        "api": res.get("api", "record"),
        "stream": stream,
        "reasoning": reasoning,
        "checks": checks,
        "temperature": v.temperature,
        "seed": v.seed,
        "n": n,
        "k": k,
        "tokens_matching": matching,
        "tokens_equal": checks["tokens_equal"],
        "first_mismatch": first_mismatch,
        "max_abs_logprob_diff": max_diff if math.isfinite(max_diff) else None,  # None: lengths differ / NaN
        "positions_recomputed": res["history_positions_recomputed"],
        "positions_forwarded": res["positions_forwarded"],
        "forward_calls": res["forward_calls"],
        "expected_forwarded": expected_forward,
        "first_position_fed": res["first_position_fed"],
        "state_position": res["state_position"],
        "reference_positions_forwarded": ref["positions_forwarded"],
        "numerics_warnings": res["numerics_warnings"],
        "numerics_differences": res["numerics_differences"],
        "reference_token_ids": a,
        "resumed_token_ids": b,
        "export": {"slots": exp["slots"], "export_seconds": exp["export_seconds"], "file_length": exp["file_length"]},
        "restore": {
            "slots": res["slots"],
            "other_requests": res["other_requests"],
            "bytes_uploaded": res["bytes_uploaded"],
            "restore_seconds": res["restore_seconds"],
        },
        "snapshot": _snapshot_report(v.path, exp),
    }


def _stream_report(before: list[dict], after: list[dict], ref_ids: list[int], ref_lps: list[float], offset: int) -> dict[str, Any]:
    """What the client received, chunk by chunk, before the pause and from the resumed request:
    every chunk must start where the previous one ended (no repeated, no missing token or logprob)."""
    pos = lp_pos = repeated = missing = 0
    ids: list[int] = []
    lps: list[float] = []
    for c in before + after:
        for start, cur in ((c["start"], pos), (c["logprob_start"], lp_pos)):
            repeated += max(0, cur - start)
            missing += max(0, start - cur)
        ids += c["token_ids"]
        lps += c["logprobs"]
        pos, lp_pos = c["start"] + len(c["token_ids"]), c["logprob_start"] + len(c["logprobs"])
    first = after[0]["start"] if after else None
    return {
        "chunks_before_pause": len(before),
        "chunks_after_resume": len(after),
        "tokens_received_before_pause": sum(len(c["token_ids"]) for c in before),
        "send_token_offset_at_resume": offset,
        "first_resumed_chunk_starts_at": first,
        "repeated": repeated,
        "missing": missing,
        "received_equals_reference": ids == ref_ids and lps == ref_lps,
        "continuous": repeated == 0 and missing == 0 and ids == ref_ids and lps == ref_lps and first == offset,
    }


def _process_row(c: Child) -> dict[str, Any]:
    d = c.data
    return {
        "role": c.role,
        "pid": d.get("pid", c.proc.pid),
        "threads": d.get("threads"),
        "wall_seconds": round(c.wall, 3),
        "seconds": {k: round(v, 3) for k, v in d.get("seconds", {}).items()},
        "positions_forwarded": d.get("positions_forwarded_in_process"),
        "forward_calls": d.get("forward_calls_in_process"),
    }


def run_demo(args) -> dict[str, Any]:
    """Run the children and build the report (a JSON-able dict). Raises :class:`DemoError` when it cannot run."""
    _validate(args)
    if args.out is None and not args.negative:
        args.out = _default_out()
    variants = _variants(args)
    negative = args.negative or args.all
    resume_threads = args.threads if args.resume_threads is None else args.resume_threads
    for v in variants:
        _refuse_existing(v.path)
    for v in variants:
        os.makedirs(os.path.dirname(v.path), exist_ok=True)

    own_workdir = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="hsnap-demo-") if own_workdir else os.path.abspath(args.workdir)
    if not own_workdir:
        try:  # a new directory: the children's results, logs and negative files never replace anything
            os.makedirs(workdir)
        except FileExistsError:
            raise DemoError(f"--workdir {workdir} exists: the demo writes only into a new directory") from None
    negdir = os.path.join(workdir, "negative")
    if negative:
        os.makedirs(negdir)
    t0 = time.perf_counter()
    try:
        gen = ["--prompt", ",".join(map(str, PROMPT)), "--n", str(args.n), "--k", str(args.k)]
        phase1 = []
        if variants:
            phase1.append(_spawn("reference", workdir, args, args.threads, gen + _variant_args(variants, False)))
        phase1.append(
            _spawn("export", workdir, args, args.threads,
                   gen + _variant_args(variants, True) + (["--negative-dir", negdir] if negative else []))
        )
        _wait(phase1, args.timeout)
        phase2 = []
        if variants:
            snaps = [a for v in variants for a in ("--snapshot", v.name, v.path)]
            phase2.append(_spawn("resume", workdir, args, resume_threads, snaps))
        if negative:
            phase2.append(_spawn("negative", workdir, args, args.threads, ["--negative-dir", negdir]))
        _wait(phase2, args.timeout)
        children = {c.role: c for c in phase1 + phase2}
        report: dict[str, Any] = {
            "config": {
                "arch": args.arch,
                "model_seed": args.model_seed,
                "prompt_text": PROMPT_TEXT,
                "prompt_ids": PROMPT,
                "n": args.n,
                "k": args.k,
                "threads": args.threads,
                "resume_threads": resume_threads,
                "mode": "all" if args.all else "negative" if args.negative else "single",
            },
            "model": {
                "model_id": f"hsnap-demo/tiny-{args.arch}",
                "weights_version": children["export"].data["weights_version"],
                "numerics": children["export"].data["numerics"],
            },
            "processes": [_process_row(c) for c in phase1 + phase2],
            "variants": {},
            "negative": None,
        }
        for v in variants:
            report["variants"][v.name] = _variant_report(
                v, args.n, args.k,
                children["reference"].data["variants"][v.name],
                children["export"].data["variants"][v.name],
                children["resume"].data["variants"][v.name],
            )
        if negative:
            report["negative"] = children["negative"].data
        if variants:
            resume = children["resume"].data
            report["resume_process"] = {
                "positions_forwarded": resume["positions_forwarded_in_process"],
                "expected": (args.n - args.k) * len(variants),
            }
        report["open_with"] = [c for v in variants for c in (f"hsnap info {_rel(v.path)}", f"hsnap-view {_rel(v.path)}")]
        report["wall_seconds"] = round(time.perf_counter() - t0, 3)
        report["workdir"] = None if own_workdir else workdir
        ok = all(r["ok"] for r in report["variants"].values())
        if variants:
            ok = ok and report["resume_process"]["positions_forwarded"] == report["resume_process"]["expected"]
        if negative:
            ok = ok and bool(report["negative"]["ok"])
        report["ok"] = ok
        return report
    finally:
        for c in _SPAWNED:  # interrupted or failed: no child outlives the demo
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        _SPAWNED.clear()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _rel(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def _progress(args, msg: str) -> None:
    print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)


# ------------------------------------------------------------------------------------------------ text


def _yes(b: bool) -> str:
    return "yes" if b else "NO"


def _slots(s: dict) -> str:
    return (f"req row {s['req_pool_idx']}, mamba slot {s['mamba_idx']}, token slots {s['first_token_slot']}.."
            f"{s['last_token_slot']} ({s['token_slots']}) of {s['pool_token_capacity']}")


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    out = []
    out.append(f"hsnap demo --library: tiny random-weight {c['arch']} (seed {c['model_seed']}), {r['model']['model_id']} "
               f"weights {r['model']['weights_version']}")
    num = r["model"]["numerics"]
    out.append(f"numerics: torch {num.get('torch')}, {c['threads']} thread(s) (resume: {c['resume_threads']}), "
               f"{num.get('device')}, {num.get('attn_implementation')} attention, {num.get('dtype')}")
    out.append(f"prompt: {len(c['prompt_ids'])} tokens {c['prompt_text']!r}; N={c['n']} outputs, paused after k={c['k']}")
    out.append("")
    out.append(f"  {'process':<10} {'pid':>7} {'threads':>7} {'wall s':>7} {'forwarded':>9}")
    for p in r["processes"]:
        out.append(f"  {p['role']:<10} {p['pid']:>7} {p['threads']:>7} {p['wall_seconds']:>7.1f} {p['positions_forwarded']:>9}")
    for name, v in r["variants"].items():
        out.append("")
        mode = "temperature 0" if v["temperature"] == 0 else f"temperature {v['temperature']}, seed {v['seed']}"
        out.append(f"{name} ({mode}): {'IDENTICAL' if v['ok'] else 'NOT IDENTICAL'}")
        out.append(f"  tokens equal:          {v['tokens_matching']}/{v['n']} ({_yes(v['tokens_equal'])})"
                   + ("" if v["first_mismatch"] is None else f", first mismatch at output {v['first_mismatch']}"))
        out.append(f"  max |logprob diff|:    {v['max_abs_logprob_diff']!r}")
        out.append(f"  positions recomputed:  {v['positions_recomputed']} (child 3 forwarded {v['positions_forwarded']} "
                   f"positions in {v['forward_calls']} calls = N-k {v['expected_forwarded']}, first position fed "
                   f"{v['first_position_fed']} = state position {v['state_position']}; the reference forwarded "
                   f"{v['reference_positions_forwarded']})")
        out.append(f"  request object:        {'SGLang Req (snapshot_req / resume_req)' if v['api'] == 'sglang.Req' else 'hand-built record (export_request / restore_request)'}")
        if v["stream"] is not None:
            st = v["stream"]
            out.append(f"  stream continuity:     {_yes(st['continuous'])}: {st['tokens_received_before_pause']} tokens in {st['chunks_before_pause']} chunks "
                       f"before the pause, the resumed stream starts at token {st['first_resumed_chunk_starts_at']} "
                       f"(send_token_offset {st['send_token_offset_at_resume']}), {st['chunks_after_resume']} chunks after; "
                       f"repeated {st['repeated']}, missing {st['missing']}")
        if v["reasoning"] is not None:
            rs = v["reasoning"]
            p, fin, ref = rs["at_pause"], rs["final"], rs["reference_final"]
            out.append(f"  reasoning state:       {_yes(v['checks']['reasoning_state_carried'])}: paused after {p['reasoning_tokens']} reasoning tokens "
                       f"({'finished' if p['reasoning_over'] else 'mid-reasoning'}, {p['think_end_match_len']} id(s) of the think-end sequence matched); "
                       f"resumed with the same; final {fin['reasoning_tokens']} reasoning tokens, "
                       f"{'finished' if fin['reasoning_over'] else 'unfinished'} = reference {ref['reasoning_tokens']}, "
                       f"{'finished' if ref['reasoning_over'] else 'unfinished'}")
        if "restored_state_not_cleared" in v["checks"]:
            out.append(f"  restored Mamba slot:   kept (mamba_needs_clear False, no pending COW): {_yes(v['checks']['restored_state_not_cleared'])}")
        if "sampler_state_equal" in v["checks"]:
            out.append(f"  sampler state:         restored from the snapshot; final generator state equal: "
                       f"{_yes(v['checks']['sampler_state_equal'])}")
        for w in v["numerics_warnings"]:
            out.append(f"  NUMERICS WARNING:      {w}")
        if v["numerics_warnings"]:
            out.append("                         " + ("identical anyway here, but not guaranteed under other numerics"
                                                      if v["ok"] else "so the differences above are expected"))
        out.append(f"  exported from:         {_slots(v['export']['slots'])}")
        out.append(f"  restored into:         {_slots(v['restore']['slots'])}"
                   f" (other requests at rows {[o['req_pool_idx'] for o in v['restore']['other_requests']]})")
        s = v["snapshot"]
        out.append(f"  snapshot:              {_rel(s['path'])}: {s['file_length']:,} bytes, {s['section_count']} sections, "
                   f"payload {s['payload_bytes']:,} bytes, root digest {s['root_digest']} ({s['digest_algorithm']})")
        out.append(f"    {'section':<24} {'kind':<16} {'dtype':<8} {'shape':<16} {'bytes':>8}  digest")
        for sec in s["sections"]:
            out.append(f"    {sec['name']:<24} {sec['kind']:<16} {sec['dtype']:<8} {str(sec['shape']):<16} "
                       f"{sec['bytes']:>8,}  {sec['digest']}")
    if r["negative"] is not None:
        neg = r["negative"]
        out.append("")
        out.append(f"negative client (pid {neg['pid']}): {'every case refused, pools untouched' if neg['ok'] else 'FAILED'}")
        out.append(f"  {'case':<22} {'expected':<26} {'got':<26} pools untouched")
        for case in neg["cases"]:
            out.append(f"  {case['case']:<22} {case['expected_error']:<26} {str(case['error']):<26} "
                       f"{_yes(case['pools_untouched'])}" + ("" if case["ok"] else "   <- FAILED"))
            out.append(f"      {case['description']}")
            out.append(f"      {case['message']}")
            if case["changed"]:
                out.append(f"      changed: {', '.join(case['changed'])}")
        a = neg["advisory"]
        out.append(f"  {a['case']:<22} {'restored + NumericsWarning':<26} {'restored + ' + str(a['warning']):<26} "
                   f"(advisory, not a refusal)" + ("" if a["ok"] else "   <- FAILED"))
        out.append(f"      {a['description']}")
        out.append(f"      {a['message']}")
        out.append("  pools untouched = the same fingerprint before and after: free lists of req rows, token and mamba "
                   "allocators, and a digest of every pool buffer byte")
        out.append("  " + (f"the negative client's files are kept in {r['workdir']}" if r["workdir"] else
                           "the negative client's files were in a temporary directory (keep them with --workdir DIR)"))
    out.append("")
    if r["variants"]:
        rp = r["resume_process"]
        out.append(f"child 3 forwarded {rp['positions_forwarded']} positions in all (expected {rp['expected']}); "
                   f"total wall {r['wall_seconds']:.1f} s")
    out.append(f"result: {'OK' if r['ok'] else 'FAILED'}")
    if r["open_with"]:
        out.append("open the snapshot with:")
        out += [f"  {c}" for c in r["open_with"]]
    return "\n".join(out)


def _json_default(o):
    raise TypeError(f"not JSON: {type(o).__name__}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "--child":
        from .children import child_main

        return child_main(argv)
    args = _parser().parse_args(argv)
    if args.reshard:
        from . import reshard_demo

        run, fmt = reshard_demo.run, reshard_demo.format_report
    else:
        run, fmt = run_demo, format_report
    try:
        report = run(args)
    except DemoError as e:
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}, indent=2))
        else:
            print(f"hsnap demo --library: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=_json_default))
    else:
        print(fmt(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
