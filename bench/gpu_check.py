"""Single-GPU check (one H100/H200, well under 5 minutes):

  1. builds the REFERENCE pools (bench.run.build_reference_pools) on CUDA and one
     request in them (53 tokens and the ~1 GiB case, 102,400 tokens);
  2. exports it through hsnap_io's CudaEngine (pinned staging, side stream) and
     checks the file against a CPU export of the same state: same section digests,
     same root digest, same bytes;
  3. restores the file through the cupy path into fresh CUDA pools (other data in
     their free slots) and checks every restored row byte for byte against the source;
     a copy with one byte flipped in its last state section is refused by each verify
     mode (the default, which has written fresh slots before it meets that piece, and
     "before"), and so is the same byte flipped once the checks passed (what reaches
     the pools is what was hashed), every allocation as it was and every state byte
     unchanged or zero;
  4. moves every dtype hsnap names (float8 included: no kernel may be missing) out of
     and into fragmented rows through CudaEngine on EVERY visible GPU while torch's and
     cupy's current device stay 0 (a TP rank's pools on cuda:N), byte for byte against
     the CPU engine;
  5. measures export against the slower of pinned device-to-host cudaMemcpy and a plain
     write of the same bytes from pinned memory into a file (they overlap) and restore
     against pinned host-to-device bandwidth (target >= 0.8x each), plus the engines
     alone (no file: a null sink / an in-RAM source) to separate the copy engine
     from the host-side page-cache copies;
  6. the hsnap plug-in in two real SGLang servers on the GPU (``python -m
     sglang.launch_server`` with ``HSNAP_SGLANG_PLUGIN=1``: CUDA pools, so the export goes
     through CudaEngine and the restore through cupy uploads), the tiny random-weight
     model of ``hsnap_sglang.tiny``: an uninterrupted greedy reference; the same request
     paused over HTTP after k outputs; the source server stopped (its processes gone); a
     fresh server with other capacities resumes it over HTTP. Token ids and logprobs must
     equal the reference, the target's forwards for it be decode N-k / extend 0, the
     stream continue without a repeated or missing chunk, the snapshot be bound to the
     CUDA device, and the five snapshots the demo refuses (version, layout, binding,
     manifest, a flipped byte) be refused with the server unchanged. Then the rolling
     restart: a second request, y, streamed by ``client.generate`` in the source (paced by
     SGLang's /slow_down), listed running by ``hsnap ls``, the export counted by the
     source's ``/metrics`` (``--enable-metrics``); the source's SIGTERM drains y
     (``HSNAP_DRAIN_ON_SIGTERM``) and y's stream follows its snapshot into the target,
     whose tokens must equal the reference too. Before that, z is live-migrated from the source to
     the target while it decodes, its client's stream relayed by the source (``relay_to``): its
     whole stream must equal the reference, decode-only on the target. The target proves every resume and
     followed link off its scheduler thread (``HSNAP_PROOF_ON_SCHEDULER_BYTES=0``: the CUDA engine is made on the
     proof's worker thread, on the pools' device, and used by the scheduler's upload). Each request runs alone in every server
     (GPU kernels are not batch-invariant in general; the CPU demo, `hsnap demo`, runs it
     beside others).

Prints a small table; exits 1 on any byte, digest or continuation mismatch (a missed
speed target is printed as MISS but is not a failure). Without CUDA it says so, runs
its CPU parts (CPU export twice -> same digests; CPU restore -> same bytes; the refusal) at 53
tokens, prints the two-server commands step 6 would run, and exits 0.

    python -m bench.gpu_check [--tokens 53,102400] [--repeats 5] [--dir DIR]
    python -m bench.gpu_check --only servers        # step 6 alone (a few minutes: two server starts)
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from bench.run import BIG_TOKENS, alloc_request, build_reference_pools, fill_pool, identity, record, view  # noqa: E402

TARGET = 0.8


class Failed(Exception):
    pass


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.unsqueeze(-1).view(torch.uint8).reshape(-1)


def request_rows(pools, row: int, tokens: int, slots=None) -> dict[str, torch.Tensor]:
    from hsnap_io.export import request_slots

    v = view(pools)
    s = slots or request_slots(v, row, tokens)
    from hsnap_io.transfer import raw_rows  # raw words: no dtype lacks the gather kernel

    return {b.name: _bytes(raw_rows(b.buffer).index_select(0, s.rows(b.space).to(b.buffer.device))) for b in v.bindings}


def mirror(src, dst) -> None:
    """Copy every state buffer and the request tables of ``src`` into ``dst`` (same geometry)."""
    for a, b in zip(view(src).bindings, view(dst).bindings):
        assert a.name == b.name
        b.buffer.copy_(a.buffer.to(b.buffer.device))
    for name in ("req_to_token", "req_index_to_mamba_index_mapping"):
        getattr(dst.req_to_token_pool, name).copy_(getattr(src.req_to_token_pool, name).to(dst.device))


def export(pools, row: int, tokens: int, path: str, fsync: bool = True):
    from hsnap_io import export_request

    return export_request(path, **pools.kwargs(), req_pool_idx=row, record=record(tokens), identity=identity(), fsync=fsync)


def check_same_export(a, b, pa: str, pb: str, what: str) -> None:
    if a.digests != b.digests:
        bad = [k for k in a.digests if a.digests[k] != b.digests.get(k)]
        raise Failed(f"{what}: section digests differ: {bad[:5]}")
    if a.root_digest != b.root_digest:
        raise Failed(f"{what}: root digests differ")
    if not filecmp.cmp(pa, pb, shallow=False):
        raise Failed(f"{what}: files differ")


def check_restore(src, row: int, tokens: int, path: str, device: str, verify: bool | str = True) -> None:
    from hsnap_io import restore_request
    from hsnap_io.export import RequestSlots

    tgt = build_reference_pools(tokens, device=device)
    fill_pool(tgt)
    res = restore_request(path, **tgt.kwargs(), identity=identity(), verify=verify)
    slots = RequestSlots(res.token_indices.to(device), None, torch.tensor([res.mamba_pool_idx], device=device))
    want, got = request_rows(src, row, tokens), request_rows(tgt, res.req_pool_idx, tokens, slots)
    for name in want:
        if not torch.equal(want[name].to(got[name].device), got[name]):
            raise Failed(f"restore on {device}: section {name} differs from the source")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))


def check_refused_restore(path: str, tokens: int, device: str, d: str) -> None:
    """Restores into noise-filled pools on ``device`` that must be refused with a typed error naming the section, the
    pools left as a refusal may leave them (hsnap_testing.pools.refusal_changes: every allocation as before, every
    state byte unchanged or zero — a verify that wrote fresh slots before it met the bad piece zeroes them): a copy
    of ``path`` with one byte flipped in the middle of its last state section, by each verify mode; and the same byte
    flipped once the checks passed, right before allocating (the default verify, and ``"before"`` made to take two
    passes): what reaches the pools must be what was hashed, not what was read again."""
    import hsnap_format as hf
    import hsnap_io.restore as restore_mod
    from hsnap_io import restore_request
    from hsnap_testing.pools import PoolSet, pool_state_copy, refusal_changes

    with hf.open(path) as snap:
        last = max((s for s in snap if s.is_state), key=lambda s: s.offset)
    at = last.offset + last.length // 2
    bad = os.path.join(d, f"flipped-{tokens}.hsnap")
    shutil.copyfile(path, bad)
    _flip(bad, at)
    real_checkpoint, one_read = restore_mod.PoolCheckpoint, restore_mod.ONE_READ_BYTES
    cases = [("a flipped byte", True, False), ("a flipped byte", "before", False),
             ("a byte flipped after the checks", True, True), ("a byte flipped after the checks, two passes", "before", True)]
    for what, verify, late in cases:
        target = bad
        if late:
            target = os.path.join(d, f"changing-{tokens}.hsnap")
            shutil.copyfile(path, target)

            def changed_after_the_checks(view, target=target):  # made right after the checks, before allocating
                _flip(target, at)
                return real_checkpoint(view)

            restore_mod.PoolCheckpoint = changed_after_the_checks
            restore_mod.ONE_READ_BYTES = 0 if verify == "before" else one_read
        tgt = build_reference_pools(tokens, device=device)
        fill_pool(tgt)
        ps = PoolSet(kind="hybrid_linear", req_to_token_pool=tgt.req_to_token_pool, token_to_kv_pool_allocator=tgt.allocator,
                     kv_pool=tgt.kv_pool, page_size=1, size=tgt.size, geom={}, device=device)
        before = pool_state_copy(ps)
        case = f"{what} (restore on {device}, verify={verify!r})"
        try:
            restore_request(target, **tgt.kwargs(), identity=identity(), verify=verify)
        except hf.HsnapError as e:
            if last.name not in str(e):
                raise Failed(f"{case}: the error does not name {last.name}: {e}") from None
        else:
            raise Failed(f"{case}: accepted")
        finally:
            restore_mod.PoolCheckpoint, restore_mod.ONE_READ_BYTES = real_checkpoint, one_read
        changed = refusal_changes(before, ps)
        if changed:
            raise Failed(f"{case}: refused, but the pools changed: {changed[:5]}")


def cpu_parts(tokens: int, d: str) -> None:
    """What runs without a GPU: CPU export is deterministic, CPU restore is exact."""
    src = build_reference_pools(tokens)
    row = alloc_request(src, tokens)
    pa, pb = os.path.join(d, "cpu-a.hsnap"), os.path.join(d, "cpu-b.hsnap")
    a, b = export(src, row, tokens, pa), export(src, row, tokens, pb)
    check_same_export(a, b, pa, pb, "CPU export twice")
    check_restore(src, row, tokens, pa, "cpu")
    check_refused_restore(pa, tokens, "cpu", d)
    print(f"CPU parts OK at {tokens} tokens: two exports identical ({len(a.digests)} sections), restore byte-identical, "
          "a flipped byte (in the file, or after the checks) refused with the pools as they were")


def engine_dtype_check() -> None:
    """Step 4: every dtype, fragmented rows, through CudaEngine on every GPU, current device 0."""
    import cupy

    from hsnap_io.adapters import TORCH_DTYPES
    from hsnap_io.transfer import CudaEngine, HostEngine

    rows = torch.tensor([7, 3, 30, 9, 31])
    gen = torch.Generator().manual_seed(5)
    torch.cuda.set_device(0)
    with cupy.cuda.Device(0):
        for index in range(torch.cuda.device_count()):
            dev = torch.device("cuda", index)
            eng = CudaEngine(dev, staging_bytes=256)  # small: chunking and buffer reuse
            if eng.index != index:
                raise Failed(f"CudaEngine for {dev} runs on device {eng.index}")
            for dtype in TORCH_DTYPES:
                raw = torch.randint(0, 2 if dtype == torch.bool else 256, (40, 3, 8), generator=gen, dtype=torch.int16).to(torch.uint8)
                host = raw.view(dtype) if dtype.itemsize == 1 else raw.view(-1).view(dtype).view(40, 3, -1)
                buf = host.to(dev)
                want, got = bytearray(), bytearray()
                HostEngine().export_section(host, rows, lambda d, f, last: want.extend(bytes(d)))  # noqa: B023 (runs within the call)
                eng.export_section(buf, rows.to(dev), lambda d, f, last: got.extend(bytes(d)))  # noqa: B023 (runs within the call)
                eng.finish_export()
                if got != want:
                    raise Failed(f"CudaEngine export on {dev}, {dtype}: bytes differ from the CPU engine")
                new = np.frombuffer(bytes(reversed(want)), dtype=np.uint8)
                eng.import_section(buf, rows.to(dev), new)
                eng.finish_import()
                HostEngine().import_section(host, rows, new)
                if not torch.equal(_bytes(buf.cpu()), _bytes(host)):
                    raise Failed(f"CudaEngine import on {dev}, {dtype}: pool bytes differ from the CPU engine's")
            if torch.cuda.current_device() != 0 or cupy.cuda.runtime.getDevice() != 0:
                raise Failed(f"CudaEngine on {dev} left the current device changed")
    print(f"engine OK: {len(TORCH_DTYPES)} dtypes x {torch.cuda.device_count()} device(s), fragmented rows, byte-identical to the CPU engine", flush=True)


def med(f, repeats: int) -> float:
    xs = []
    for _ in range(repeats):
        xs.append(f())
    return statistics.median(xs)


def cuda_timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def copy_limits(n: int, repeats: int, dev: str) -> tuple[float, float]:
    """Median seconds of a pinned device-to-host and a host-to-device copy of ``n`` bytes: the speed limits of
    export and restore. The buffers are freed on return."""
    dbuf = torch.empty(n, dtype=torch.uint8, device=dev)
    hbuf = torch.empty(n, dtype=torch.uint8, pin_memory=dev == "cuda")
    return (med(lambda: cuda_timed(lambda: hbuf.copy_(dbuf, non_blocking=True)), repeats),
            med(lambda: cuda_timed(lambda: dbuf.copy_(hbuf, non_blocking=True)), repeats))


def write_limit(n: int, repeats: int, d: str) -> float:
    """Median seconds to write ``n`` bytes from one pinned host buffer into a new file (no fsync): the host side an
    export cannot beat, whatever overlaps it (the D2H copy can run beside it, so export's limit is the slower one)."""
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    buf[:] = 1
    path = os.path.join(d, "write-limit.bin")

    def once() -> float:
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(buf)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        dt = time.perf_counter() - t
        os.unlink(path)
        return dt

    return med(once, repeats)


def gpu_run(tokens: int, d: str, repeats: int, rows_out: list, dev: str = "cuda") -> None:
    from hsnap_io import restore_request
    from hsnap_io.export import RequestSlots, request_slots
    from hsnap_io.statecheck import PoolCheckpoint
    from hsnap_io.transfer import CudaEngine

    t0 = time.perf_counter()
    g = build_reference_pools(tokens, device=dev)
    row = alloc_request(g, tokens)
    c = build_reference_pools(tokens)  # CPU twin of the same state
    crow = alloc_request(c, tokens)
    assert crow == row
    mirror(g, c)
    pg, pc = os.path.join(d, f"gpu-{tokens}.hsnap"), os.path.join(d, f"cpu-{tokens}.hsnap")
    ig = export(g, row, tokens, pg)
    ic = export(c, row, tokens, pc)
    check_same_export(ig, ic, pg, pc, f"{tokens} tokens: CUDA export vs CPU export")
    check_restore(g, row, tokens, pg, dev, verify=True)
    check_restore(g, row, tokens, pg, dev, verify=False)
    check_restore(g, row, tokens, pg, dev, verify="before")
    check_refused_restore(pg, tokens, dev, d)
    print(f"[{tokens} tokens] bytes OK: CUDA export == CPU export ({len(ig.digests)} sections, root {ig.root_digest[:16]}...), "
          f"cupy restore byte-identical, a flipped byte (in the file, or after the checks) refused with the pools as they were ({time.perf_counter() - t0:.1f} s)", flush=True)

    # ---- speed
    n = ig.payload_bytes
    d2h, h2d = copy_limits(n, repeats, dev)
    wr = write_limit(n, repeats, d)

    v = view(g)
    slots = request_slots(v, row, tokens)
    k = [0]

    def export_once(fsync: bool) -> float:
        k[0] += 1
        p = os.path.join(d, f"t{k[0]}.hsnap")
        dt = cuda_timed(lambda: export(g, row, tokens, p, fsync=fsync))
        os.unlink(p)
        return dt

    eng = CudaEngine(torch.device(dev))  # one engine (pinned buffers allocated once) for the engine-alone rows

    def engine_export() -> float:
        def run():
            for b in v.bindings:
                eng.export_section(b.buffer, slots.rows(b.space), lambda data, first, last: None)
            eng.finish_export()

        return cuda_timed(run)

    exp_nofsync = med(lambda: export_once(False), repeats)
    exp_fsync = med(lambda: export_once(True), repeats)
    eng_exp = med(engine_export, repeats)

    tgt = build_reference_pools(tokens, device=dev)
    fill_pool(tgt)
    tv = view(tgt)

    got = {}

    def restore_once(verify: bool | str) -> float:
        cp = PoolCheckpoint(tv)
        dt = cuda_timed(lambda: got.update(res=restore_request(pg, **tgt.kwargs(), identity=identity(), verify=verify)))
        cp.rollback()  # free lists back: every run gets the same fresh slots
        return dt

    import hsnap_format as hf

    with hf.open(pg) as snap:
        ram = {b.name: np.array(snap.raw(snap.section(b.name)), dtype=np.uint8) for b in tv.bindings}  # in RAM, not mapped
    restore_once(False)  # warm-up (cupy kernels, page cache); its slots serve the engine-alone timing
    res = got["res"]
    tslots = RequestSlots(res.token_indices.to(dev), None, torch.tensor([res.mamba_pool_idx], device=dev))

    def engine_import() -> float:
        def run():
            for b in tv.bindings:
                eng.import_section(b.buffer, tslots.rows(b.space), ram[b.name])
            eng.finish_import()

        return cuda_timed(run)

    def hash_ram() -> float:
        t = time.perf_counter()
        for a in ram.values():
            xxhash.xxh3_128(a).hexdigest()
        return time.perf_counter() - t

    res_noverify = med(lambda: restore_once(False), repeats)
    res_verify = med(lambda: restore_once(True), repeats)
    res_before = med(lambda: restore_once("before"), repeats)
    eng_imp = med(engine_import, repeats)
    hashed = med(hash_ram, repeats)
    verified = max(h2d, hashed)
    for p in (pg, pc):
        os.unlink(p)
    gbs = lambda t: n / t / 1e9  # noqa: E731
    rows_out += [
        (tokens, "pinned D2H cudaMemcpy (limit)", d2h, gbs(d2h), None),
        (tokens, "pinned host -> file write (limit)", wr, gbs(wr), None),
        (tokens, "export, fsync=False", exp_nofsync, gbs(exp_nofsync), max(d2h, wr) / exp_nofsync),
        (tokens, "export, fsync=True", exp_fsync, gbs(exp_fsync), max(d2h, wr) / exp_fsync),
        (tokens, "CudaEngine export alone (null sink)", eng_exp, gbs(eng_exp), d2h / eng_exp),
        (tokens, "pinned H2D cudaMemcpy (limit)", h2d, gbs(h2d), None),
        (tokens, "restore, verify=False", res_noverify, gbs(res_noverify), h2d / res_noverify),
        (tokens, "xxh3_128 of the bytes in RAM, one thread", hashed, gbs(hashed), None),
        (tokens, "restore, verify=True (vs max(H2D, hash))", res_verify, gbs(res_verify), verified / res_verify),
        (tokens, "restore, verify='before' (the server's)", res_before, gbs(res_before), verified / res_before),
        (tokens, "CudaEngine import alone (in-RAM source)", eng_imp, gbs(eng_imp), h2d / eng_imp),
    ]


# ---------------------------------------------------------------------------------------------- step 6: two servers

SERVER_N, SERVER_K = 64, 10
GPU_SOURCE = {"--max-total-tokens": "4096", "--max-mamba-cache-size": "8", "--max-running-requests": "4"}
GPU_TARGET = {"--max-total-tokens": "3000", "--max-mamba-cache-size": "12", "--max-running-requests": "3"}
GPU_LAUNCHER = ("-m", "sglang.launch_server")  # SGLang's own server on CUDA; the plug-in from the environment


def gpu_server_args(capacity: dict[str, str], extra: list[str]) -> list[str]:
    """launch_server arguments of step 6: bfloat16, Triton attention (any head size: the tiny model's are 32 and 16),
    CUDA graphs for the few batch sizes used, the given capacities."""
    base = ["--dtype", "bfloat16", "--attention-backend", "triton", "--cuda-graph-max-bs", "4", "--skip-server-warmup",
            "--grammar-backend", "none", "--log-level", "warning"]
    return base + [x for kv in capacity.items() for x in kv] + list(extra)


# Step 6 on a machine without sgl_kernel (scripts/gpu_machine/README.md): SGLang's own switches to its torch and triton
# paths — every fused op's forward_native, triton attention / linear attention / Mamba / MoE runner, no CUDA graphs
NO_SGL_KERNEL_ARGS = ["--sampling-backend", "pytorch", "--linear-attn-backend", "triton", "--mamba-backend", "triton",
                      "--moe-runner-backend", "triton", "--disable-custom-all-reduce", "--disable-cuda-graph"]
NO_SGL_KERNEL_ENV = {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
                     "SGLANG_IS_FLASHINFER_AVAILABLE": "false"}


def gpu_server_env() -> dict[str, str]:
    env = dict(os.environ, HSNAP_SGLANG_PLUGIN="1", SGLANG_LOGGING_LEVEL="warning")
    env.pop("HSNAP_SGLANG_CPU", None)  # the CPU platform stays off (it would be ignored on a CUDA machine anyway)
    return env


def _cpu_servers():
    from hsnap_sglang.demo import DemoServer, server_args, server_env

    return {"launcher": DemoServer.CPU_LAUNCHER, "env": server_env(), "args": lambda cap, extra: server_args(cap) + list(extra),
            "device": "cpu"}


# where step 6's servers run: the GPU (what it is for), or hsnap's CPU platform (--servers-on-cpu: the step's own code
# checked on a machine without a GPU; the export then goes through the host engine)
SERVER_PLATFORMS = {
    "cuda": lambda: {"launcher": GPU_LAUNCHER, "env": gpu_server_env(), "args": gpu_server_args, "device": "cuda"},
    "cpu": _cpu_servers,
}


def two_server_plan(d: str, extra: list[str]) -> list[str]:
    """The two server command lines of step 6 (printed without a GPU: what a GPU run will start)."""
    return [" ".join(["HSNAP_SGLANG_PLUGIN=1", f"HSNAP_ROOT={os.path.join(d, 'servers')}", "python", *GPU_LAUNCHER, "--model-path", os.path.join(d, "servers", "model"),
                      "--port", "PORT", *gpu_server_args(cap, extra)]) for cap in (GPU_SOURCE, GPU_TARGET)]


def two_servers(d: str, extra: list[str], platform: str = "cuda", startup_timeout: float = 600.0) -> None:
    """Step 6 (see the module's docstring). Raises Failed on any mismatch."""
    from pathlib import Path

    from hsnap_sglang.demo import DemoError

    try:
        _two_servers(Path(d), extra, SERVER_PLATFORMS[platform](), startup_timeout)
    except DemoError as e:  # a server that did not start, a request that did not finish
        raise Failed(f"two servers: {e}") from None


def _two_servers(work, extra: list[str], where: dict, startup_timeout: float) -> None:
    from hsnap_format import open_snapshot
    from hsnap_sglang import client
    from hsnap_sglang.demo import PROMPT_TEXT, DemoServer, Stream, continuity, flush_cache, negative_snapshots, payload, refuse, tokens
    from hsnap_sglang.tiny import build_model_dir

    t0 = time.perf_counter()
    model = build_model_dir(work / "model")
    env, launcher, server_args = where["env"], where["launcher"], where["args"]
    # every path the step names lies in its work directory; the source drains what still runs when it gets SIGTERM
    env = dict(env, HSNAP_ROOT=str(work.resolve()), HSNAP_DRAIN_ON_SIGTERM="sigterm-drained")
    path = str(work / "x.hsnap")
    n, k = SERVER_N, SERVER_K
    # the target is made first: its URL is the one peer the source may relay a live migration to
    dst = DemoServer("target", model, work / "target.log", server_args(GPU_TARGET, extra), dict(env, HSNAP_PROOF_ON_SCHEDULER_BYTES="0"),
                     launcher=launcher)
    src = DemoServer("source", model, work / "source.log", server_args(GPU_SOURCE, [*extra, "--enable-metrics"]),
                     dict(env, HSNAP_ALLOWED_PEERS=dst.url), launcher=launcher)
    # y: a client of client.generate that follows its request across the source's SIGTERM into the target, once the
    # target has resumed x (alone, as the reference ran)
    target_free, y_run, y_failed = threading.Event(), {}, []

    def next_url(_server: str, _path: str) -> str:
        if not target_free.wait(startup_timeout + 600):
            raise Failed("two servers: the target never came up for y's hand-off")
        return dst.url

    def follow_y() -> None:
        try:
            y_run["run"] = client.generate(src.url, payload("y", n, text=PROMPT_TEXT), next_url=next_url)
        except Exception as e:  # noqa: BLE001 - reported below
            y_failed.append(e)

    y_thread = threading.Thread(target=follow_y, daemon=True)
    try:
        src.start(startup_timeout)
        print(f"[servers] source server ready after {src.ready_s:.1f} s", flush=True)
        ref = Stream(src.url, payload("x-reference", n, text=PROMPT_TEXT))
        ref.start()
        ref.finish()
        flush_cache(src.url)
        x = Stream(src.url, payload("x", n, text=PROMPT_TEXT))
        x.start()
        x.wait_tokens(k)
        out = client.pause(src.url, "x", path)
        x.finish()
        flush_cache(src.url)
        dst.start(startup_timeout)
        print(f"[servers] target server ready after {dst.ready_s:.1f} s", flush=True)
        _slow_down(src.url, Y_PACE_S)  # z and y still decode when the migration and SIGTERM land, however fast the device
        # z: live-migrated to the target while it decodes, its client's stream relayed by the source (CUDA links both
        # ways: pre-copy rounds exported from GPU pools, applied into the target's)
        z = Stream(src.url, payload("z", n, text=PROMPT_TEXT))
        z.start()
        z.wait_tokens(k)
        moved = client.migrate(src.url, "z", str(work / "z-mig"), tail=2, timeout_s=120, relay_to=dst.url)
        z.finish()
        z_forwards = client.stats(dst.url, "z")["forwards"]
        y_thread.start()
        listed = _wait_listed(client, src.url, "y", timeout=120)
        metrics = _scrape(src.url)
        stopped = src.stop()  # SIGTERM: y is drained, its stream ends with its snapshot
        if stopped["left"] or stopped["exit_code"] is None:
            raise Failed(f"the source server did not stop cleanly: {stopped}")
        with open_snapshot(path) as snap:
            snap.verify()
            device = snap.identity.device
        if not device.startswith(where["device"]):
            raise Failed(f"the snapshot is bound to device {device!r}, not {where['device']}: the export did not run on its pools")
        run = client.resume(dst.url, path)
        forwards = client.stats(dst.url, "x")["forwards"]
        target_free.set()
        y_thread.join(600)
        refusals = refuse(dst.url, negative_snapshots(path, work / "negative"))
    finally:
        target_free.set()
        for s in (src, dst):
            s.stop()
    ref_ids, ref_lps = tokens(ref.final)
    ids, lps = tokens(run.final)
    k_out = int(out["output_tokens"])
    info = run.info["result"]
    stream = continuity(x.events, run.events, (info["client_had"]["text_chars"], info["client_had"]["output_ids"]), ref.events)
    diff = max((abs(a - b) for a, b in zip(lps, ref_lps)), default=float("inf")) if len(lps) == len(ref_lps) else float("inf")
    print(f"[servers] {sum(a == b for a, b in zip(ids, ref_ids))}/{n} token ids equal, max |logprob diff| {diff!r}; exported at "
          f"{k_out} outputs ({out['committed_positions']} committed positions, {out['bytes']} bytes, pause-to-durable "
          f"{out['timings']['pause_to_durable_s'] * 1e3:.1f} ms) from {device}; restore {info['timings']['restore_s'] * 1e3:.1f} ms; "
          f"target forwards {forwards}; stream continuous {stream['continuous']}; refusals "
          + ", ".join(f"{r['case']}->{r['error']}" for r in refusals) + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    if ids != ref_ids or len(ids) != n:
        raise Failed(f"two servers: token ids differ from the uninterrupted run ({ids[:k_out + 3]}... vs {ref_ids[:k_out + 3]}...)")
    if diff != 0.0:
        raise Failed(f"two servers: logprobs differ from the uninterrupted run by up to {diff!r}")
    if forwards != {"decode": n - k_out, "extend": 0}:
        raise Failed(f"two servers: the target's forwards for the request were {forwards}, expected decode {n - k_out}, extend 0")
    if not stream["continuous"]:
        raise Failed(f"two servers: the stream did not continue exactly: {stream}")
    bad = [r for r in refusals if not r["ok"]]
    if bad:
        raise Failed(f"two servers: snapshots not refused as they should be: {bad}")
    exported_ok = metrics.get(("hsnap_operations_total", (("op", "export"), ("outcome", "ok"))), 0.0)
    print(f"[servers] hsnap ls listed y as {listed.get('state')}; /metrics: exports ok {exported_ok:g}", flush=True)
    if exported_ok < 1:
        raise Failed(f"two servers: /metrics does not count the export: {sorted(k for k in metrics if k[0].startswith('hsnap_'))[:8]}")
    z_ids = tokens(z.final)
    handed = [e for e in z.events[:-1] if (e.get("meta_info") or {}).get("finish_reason") is not None]  # a hand-off the client saw
    print(f"[servers] z live-migrated with its stream relayed: {len(moved['rounds'])} pre-copy round(s), the final link "
          f"{moved['final_bytes']} bytes; {sum(a == b for a, b in zip(z_ids[0], ref_ids))}/{n} token ids equal; target forwards "
          f"{z_forwards}; finish {z.final['meta_info']['finish_reason']}", flush=True)
    if z_ids != (ref_ids, ref_lps) or handed or z.final["meta_info"]["finish_reason"]["type"] != "length":
        raise Failed(f"two servers: z's relayed live migration: ids equal {z_ids[0] == ref_ids}, logprobs equal {z_ids[1] == ref_lps}, "
                     f"events with a finish before the last {len(handed)}, finish {z.final['meta_info']['finish_reason']}")
    if z_forwards != {"decode": n - int(moved["output_tokens"]), "extend": 0}:
        raise Failed(f"two servers: the target's forwards for z were {z_forwards}, expected decode only")
    if y_failed or "run" not in y_run:
        raise Failed(f"two servers: y's stream did not follow its hand-off: {y_failed or 'no result'}")
    y = y_run["run"]
    y_ids = y.output_ids
    print(f"[servers] y followed {len(y.hand_offs)} hand-off(s) {y.hand_offs}; {sum(a == b for a, b in zip(y_ids, ref_ids))}/{n} "
          f"token ids equal to the uninterrupted run; finish {y.finish_reason}", flush=True)
    if [h[1] for h in y.hand_offs] != [str(work / "sigterm-drained" / "y.hsnap")] or y_ids != ref_ids:
        raise Failed(f"two servers: y across the source's SIGTERM: hand-offs {y.hand_offs}, ids equal {y_ids == ref_ids}")
    print(f"two servers OK: exported from {where['device']} pools, resumed in a fresh server, bit-identical, decode-only, "
          "every refusal clean", flush=True)


def _wait_listed(client, url: str, rid: str, timeout: float) -> dict:
    """``rid``'s row of ``hsnap ls`` once it decodes (the client call behind it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in client.requests(url) if r.get("rid") == rid and r.get("state") == "running"]
        if rows:
            return rows[0]
        time.sleep(0.1)
    raise Failed(f"two servers: {rid} never listed as running by hsnap ls")


Y_PACE_S = 0.1  # seconds each forward of the source sleeps while y runs there (SGLang's /slow_down test route)


def _slow_down(url: str, seconds: float | None) -> None:
    import json
    import urllib.request

    req = urllib.request.Request(url + "/slow_down", data=json.dumps({"forward_sleep_time": seconds}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _scrape(url: str) -> dict:
    """The server's Prometheus /metrics as {(name, labels as a sorted tuple): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def print_table(table: list) -> None:
    print()
    print(f"{'tokens':>8}  {'what':<42} {'time':>10} {'GB/s':>7} {'x limit':>8}  target")
    for tokens, what, t, gb, ratio in table:
        verdict = "" if ratio is None or "alone" in what or "fsync=True" in what else ("PASS" if ratio >= TARGET else "MISS")
        r = "" if ratio is None else f"{ratio:.2f}"
        print(f"{tokens:>8}  {what:<42} {t * 1e3:>8.2f}ms {gb:>7.2f} {r:>8}  {verdict}")
    print(f"\n'x limit' = limit time / hsnap time; export's limit is the slower of the D2H copy and the file write (they "
          f"overlap), restore's the H2D copy (a verified one's the slower of that and one thread's hash); targets (>= {TARGET}) judged on export fsync=False and restore; the "
          "engine-alone rows show the copy engine without the page-cache side.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[53, BIG_TOKENS])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--cpu-tokens", type=int, default=53, help="size of the CPU self-test")
    ap.add_argument("--only", choices=("pools", "servers"), default=None,
                    help="pools: steps 1-5 only; servers: step 6 only (default: all)")
    ap.add_argument("--servers-on-cpu", action="store_true",
                    help="run step 6 on hsnap's CPU platform instead (checks the step's own code without a GPU), then exit")
    ap.add_argument("--without-sgl-kernel", action="store_true",
                    help="step 6 on a machine without sgl_kernel: SGLang's torch / triton paths (scripts/gpu_machine/README.md)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more launch_server argument for step 6's servers (repeat; e.g. --server-arg=--enable-deterministic-inference)")
    args = ap.parse_args(argv)
    if args.without_sgl_kernel and not args.servers_on_cpu:
        args.server_arg = NO_SGL_KERNEL_ARGS + args.server_arg
        os.environ.update(NO_SGL_KERNEL_ENV)  # the servers' environment is this one's (gpu_server_env)
    d = tempfile.mkdtemp(prefix="hsnap-gpu-", dir=args.dir)
    try:
        if args.servers_on_cpu:
            try:
                two_servers(os.path.join(d, "servers"), args.server_arg, platform="cpu")
            except Failed as e:
                print(f"MISMATCH: {e}")
                return 1
            return 0
        try:
            cpu_parts(args.cpu_tokens, d)
        except Failed as e:
            print(f"MISMATCH: {e}")
            return 1
        if not torch.cuda.is_available():
            print("SKIP: torch.cuda.is_available() is False — the CUDA export/restore checks and bandwidth table need one NVIDIA GPU")
            print("SKIP: step 6 (two servers) needs one too; on a GPU machine it starts:")
            for line in two_server_plan(d, args.server_arg):
                print(f"  {line}")
            return 0
        try:
            import cupy  # noqa: F401
        except ImportError as e:
            print(f"FAIL: CudaEngine needs cupy (pip install 'hsnap[gpu]'): {e}")
            return 1
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; dir {d}", flush=True)
        table: list = []
        try:
            if args.only != "servers":
                engine_dtype_check()
                for t in args.tokens:
                    before = len(table)
                    gpu_run(t, d, args.repeats, table)
                    print_table(table[before:])  # each size's rows as they come (a run cut short keeps them)
                    torch.cuda.empty_cache()  # the run's pools were freed on its return
            if args.only != "pools":
                two_servers(os.path.join(d, "servers"), args.server_arg)
        except Failed as e:
            print(f"MISMATCH: {e}")
            return 1
        return 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
