"""Resume versus recompute: the number a user decides on.

    python -m bench.resume                  # 64 / 1k / 8k / 32k committed tokens, as far as --budget allows
    python -m bench.resume --sizes 64,1024 --budget 120

A random-weight Qwen3.5-architecture hybrid model (transformers ``Qwen3_5ForCausalLM``,
~320 M parameters: 16 layers, every 4th full attention (8 q / 2 kv heads x 128), 12
Gated-DeltaNet layers with the reference GDN geometry (8 k / 16 v heads x 128, conv
kernel 4), hidden 1024, vocab 32k, float32, sdpa attention) is built locally — nothing
is downloaded — and loaded once. For each size n (committed positions):

  setup (untimed but for the recompute's first round): prefill n random tokens, copy the
  cache into real SGLang pools, ``export_request`` it to a file (fsync: the snapshot is
  on disk), free the source slots.
  resume     = time from the snapshot on disk to the first new token, in pools that never
               held the request (the "fresh process" with the model loaded):
               ``restore_request(verify=True)`` (open + checks + verify + upload) + the
               pools -> model cache glue + ONE decode step (the pending token) + argmax.
  recompute  = re-prefill the same n positions + the same decode step + argmax.

Both run in this process with the same torch thread count; both must produce the same
next token (asserted) — the restored state is the prefilled state, byte for byte. The
glue (``read_from_pools`` + ``pool_tensors_to_cache``: copies the state out of the pools
into transformers' cache) is counted in resume: a serving engine's kernels read the pools
directly, so resume here is an upper bound. Page cache: warm (the file was just written).

Sizes whose projected recompute (from the per-token prefill rate measured so far) does not
fit the remaining budget are reported as skipped, with the projection.
Writes bench/RESUME.md (``--results`` to change, ``--results ''`` for none).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.results import publish  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import hsnap_format as hf  # noqa: E402
from bench.run import collect_garbage  # noqa: E402

SIZES = (64, 1024, 8192, 32768)  # 64: a second small point for the crossover fit
# ~320 M parameters; the GDN part is the reference geometry (hsnap_format.reference)
CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=40960,
)
OUTPUTS = 10  # the request's last 10 history tokens are outputs; the last one is pending (fed by the decode step)


def build(seed: int = 0, tiny: bool = False):
    from hsnap_testing.model import Decoder, build_model

    cfg = dict(CONFIG)
    if tiny:  # the smoke test: same code path, a model that builds in a second
        cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                   vocab_size=512, max_position_embeddings=4096)
    model, geom = build_model(seed, "qwen3_5", dtype=torch.float32, attn_implementation="sdpa", **cfg)
    return model, geom, Decoder(model, geom)


def identity(geom) -> hf.Identity:
    return hf.Identity(
        model_id="bench/qwen3.5-random", weights_version="seed-0", engine=hf.Engine("sglang", "0.5.23", ""),
        tp_size=1, tp_rank=0, device="cpu", snapshot_id="", created_at="", hsnap_version="",
    )


def record(history: list[int], n: int) -> hf.RequestRecord:
    k = min(OUTPUTS, n + 1)
    prompt, outputs = history[: n + 1 - k], history[n + 1 - k : n + 1]
    return hf.RequestRecord(
        rid=f"resume-{n}", prompt_ids=np.asarray(prompt, np.int32), output_ids=np.asarray(outputs, np.int32),
        output_logprobs=None, state_position=n, sampling={"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
        max_new_tokens=k + 16, streamed_tokens=k,
    )


class Size:
    def __init__(self, n: int) -> None:
        self.n = n
        self.recompute: list[float] = []
        self.prefill: list[float] = []
        self.resume: list[float] = []
        self.restore: list[float] = []
        self.glue: list[float] = []
        self.step: list[float] = []
        self.file_length = 0
        self.token = None
        self.skipped = ""


def run_size(dec, geom, n: int, d: str, s: Size, rounds_resume: int, rounds_recompute: int, log) -> None:
    from hsnap_io import export_request, restore_request, view_pools
    from hsnap_testing import pools
    from hsnap_testing.model import build_pools, cache_to_pool_tensors, pool_tensors_to_cache, read_from_pools, write_to_pools
    from hsnap_io.statecheck import PoolCheckpoint

    g = torch.Generator().manual_seed(n)
    history = torch.randint(0, geom.vocab_size, (n + 1,), generator=g).tolist()
    pending = history[n]  # the last output: not yet in the state, fed by the decode step

    def recompute(keep_state: bool):
        t = time.perf_counter()
        cache, _ = dec.prefill(history[:n])
        t_prefill = time.perf_counter() - t
        state = cache_to_pool_tensors(cache, geom) if keep_state else None  # untimed copy for the snapshot
        t = time.perf_counter()
        tok = int(torch.argmax(dec.step(cache, pending)))
        t_step = time.perf_counter() - t
        s.recompute.append(t_prefill + t_step)
        s.prefill.append(t_prefill)
        return tok, state

    log(f"{n} tokens: recompute (round 1, the snapshot's state)")
    tok_recompute, state = recompute(True)
    size = n + 64
    src = build_pools(geom, size=size, mamba_size=2)
    slots = pools.alloc_request(src, n, seed=n)
    write_to_pools(src.req_to_token_pool, src.token_to_kv_pool_allocator, slots.token_indices, slots.mamba_pool_idx, state,
                   req_pool_idx=slots.req_pool_idx)
    path = os.path.join(d, f"resume-{n}.hsnap")
    ident = identity(geom)
    info = export_request(path, req_to_token_pool=src.req_to_token_pool, token_to_kv_pool_allocator=src.token_to_kv_pool_allocator,
                          req_pool_idx=slots.req_pool_idx, record=record(history, n), identity=ident, fsync=True)
    s.file_length = info.file_length
    pools.free_request(src, slots)
    del src, state
    collect_garbage()

    tgt = build_pools(geom, size=size, mamba_size=2)  # pools that never held the request
    view = view_pools(tgt.req_to_token_pool, tgt.token_to_kv_pool_allocator)
    for r in range(rounds_resume + 1):  # round 0: warm-up (first touch of the target pools)
        cp = PoolCheckpoint(view)
        collect_garbage()
        t0 = time.perf_counter()
        res = restore_request(path, req_to_token_pool=tgt.req_to_token_pool, token_to_kv_pool_allocator=tgt.token_to_kv_pool_allocator,
                              identity=ident, verify=True)
        t1 = time.perf_counter()
        cache = pool_tensors_to_cache(read_from_pools(tgt.req_to_token_pool, tgt.token_to_kv_pool_allocator, res.token_indices, res.mamba_pool_idx, geom), geom, n)
        t2 = time.perf_counter()
        tok = int(torch.argmax(dec.step(cache, pending)))
        t3 = time.perf_counter()
        cp.rollback()
        if tok != tok_recompute:
            raise AssertionError(f"{n} tokens: resume gives token {tok}, recompute {tok_recompute}")
        if r:
            s.resume.append(t3 - t0)
            s.restore.append(t1 - t0)
            s.glue.append(t2 - t1)
            s.step.append(t3 - t2)
        del cache
    log(f"{n} tokens: resume x{rounds_resume} done; recompute rounds 2..{rounds_recompute}")
    for _ in range(rounds_recompute - 1):
        tok, _ = recompute(False)
        if tok != tok_recompute:
            raise AssertionError(f"{n} tokens: recompute is not deterministic ({tok} vs {tok_recompute})")
    s.token = tok_recompute
    os.unlink(path)


def fmt(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def report(sizes: list[Size], args, params: float, elapsed: float, load0, load1, rate) -> str:
    med = statistics.median
    out = ["# Resume vs recompute (bench/resume.py)", ""]
    out.append(f"Command: `python -m bench.resume {' '.join(sys.argv[1:])}`  ")
    out.append(f"Date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; bench time {elapsed:.0f} s (budget {args.budget:.0f} s)  ")
    out.append(f"Machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores usable; torch {torch.__version__}, "
               f"{torch.get_num_threads()} intra-op thread(s) for both paths. Load average at start {'/'.join(f'{x:.1f}' for x in load0)}, "
               f"at end {'/'.join(f'{x:.1f}' for x in load1)} (shared machine).  ")
    out.append(f"Model: random-weight Qwen3.5-architecture hybrid, {params:.0f} M parameters (`bench.resume.CONFIG`: 16 layers, "
               "4 full attention + 12 Gated-DeltaNet), float32, sdpa; transformers' reference (pure PyTorch) GDN kernels.  ")
    out.append("resume = restore_request(verify=True) from the file on disk (warm page cache) + pools->cache glue + one decode step; "
               "recompute = prefill of the same history + the same decode step. Both give the same next token (asserted). "
               "Medians; `rounds` = resume / recompute rounds.")
    out.append("")
    head = ["committed tokens", "snapshot", "resume", "restore (open+verify+upload)", "glue", "decode step", "recompute", "prefill",
            "recompute/resume", "rounds", "next token"]
    rows = []
    for s in sizes:
        if s.skipped:
            rows.append([f"{s.n:,}", "", "", "", "", "", s.skipped, "", "", "", ""])
            continue
        rows.append([f"{s.n:,}", f"{s.file_length / (1 << 20):.1f} MiB", fmt(med(s.resume)), fmt(med(s.restore)), fmt(med(s.glue)),
                     fmt(med(s.step)), fmt(med(s.recompute)), fmt(med(s.prefill)), f"{med(s.recompute) / med(s.resume):.1f}x",
                     f"{len(s.resume)} / {len(s.recompute)}", str(s.token)])
    w = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    out.append("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    out += ["| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) + " |" for r in rows]
    out.append("")
    done = [s for s in sizes if not s.skipped]
    if done:
        out.append(crossover(done))
        out.append("")
    return "\n".join(out)


def crossover(done: list[Size]) -> str:
    """Where recompute would start to win, from measured figures only: the decode step is
    common to both paths, so it is prefill(n) against restore(n) + glue(n)."""
    med = statistics.median
    rows = [(s.n, med(s.prefill), med(s.restore) + med(s.glue)) for s in done]
    lose = [n for n, pre, extra in rows if pre <= extra]
    if lose:
        win = [n for n, pre, extra in rows if pre > extra]
        return (f"Crossover: recompute is as fast or faster at {', '.join(map(str, lose))} tokens"
                + (f", resume faster from {min(win):,} tokens." if win else "."))
    step = med([t for s in done for t in s.step])
    n0, pre0, extra0 = rows[0]
    worst = min(pre / extra for _, pre, extra in rows)
    text = (f"Crossover: none measured — resume is faster at every size (prefill / (restore + glue), the decode step being "
            f"common: at least {worst:.0f}x).")
    if step > extra0:
        text += (f" Below {n0} tokens: a prefill of even one token is one forward pass, which costs about a decode step "
                 f"({fmt(step)} here), more than the whole restore + glue of the {n0}-token request ({fmt(extra0)}): "
                 "resume wins from the first token.")
    else:
        text += f" Below {n0} tokens it is not measured (restore + glue there: {fmt(extra0)}, one forward pass: {fmt(step)})."
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=list(SIZES))
    ap.add_argument("--budget", type=float, default=300.0, help="seconds of bench time (sizes that would not fit are skipped)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="resume rounds per size (recompute: up to 3, as the budget allows)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke test of the code path)")
    ap.add_argument("--results", default=None, help="markdown output (default bench/RESUME.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load0 = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    log("building the model")
    model, geom, dec = build(tiny=args.tiny)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    rate = None  # seconds of prefill per token, from the sizes done so far
    sizes: list[Size] = []
    with tempfile.TemporaryDirectory(prefix="hsnap-resume-") as d:
        for n in sorted(args.sizes):
            s = Size(n)
            sizes.append(s)
            left = args.budget - (time.perf_counter() - t_start)
            # attention grows faster than linearly: project with 1.3x per doubling beyond the measured size
            projected = None if rate is None else rate * n * 1.3 ** max(0.0, np.log2(n / max(x.n for x in sizes if x.recompute)))
            # the first recompute round also makes the snapshot's state; export + resume rounds are small
            if projected is not None and 1.15 * projected + 10 > left:
                s.skipped = f"skipped: projected recompute ~{fmt(projected)}, {fmt(max(left, 0))} of budget left"
                log(f"{n} tokens: {s.skipped}")
                continue
            rounds_recompute = 1 if projected is None else int(max(1, min(3, (left - 10) // (1.15 * projected))))
            run_size(dec, geom, n, d, s, args.rounds, rounds_recompute, log)
            rate = statistics.median(s.prefill) / n
            log(f"{n} tokens: resume {fmt(statistics.median(s.resume))}, recompute {fmt(statistics.median(s.recompute))}")
            collect_garbage()
    text = report(sizes, args, params, time.perf_counter() - t_start, load0, os.getloadavg(), rate or 0.0)
    publish(text, args.results, "RESUME.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
