"""Single-GPU check (one H100/H200, well under 5 minutes):

  1. builds the REFERENCE pools (bench.run.build_reference_pools) on CUDA and one
     request in them (53 tokens and the ~1 GiB case, 102,400 tokens);
  2. exports it through hsnap_io's CudaEngine (pinned staging, side stream) and
     checks the file against a CPU export of the same state: same section digests,
     same root digest, same bytes;
  3. restores the file through the cupy path into fresh CUDA pools (other data in
     their free slots) and checks every restored row byte for byte against the source;
  4. moves every dtype hsnap names (float8 included: no kernel may be missing) out of
     and into fragmented rows through CudaEngine on EVERY visible GPU while torch's and
     cupy's current device stay 0 (a TP rank's pools on cuda:N), byte for byte against
     the CPU engine;
  5. measures export against pinned device-to-host cudaMemcpy bandwidth and restore
     against pinned host-to-device bandwidth (target >= 0.8x each), plus the engines
     alone (no file: a null sink / an in-RAM source) to separate the copy engine
     from the host-side page-cache copies.

Prints a small table; exits 1 on any byte or digest mismatch (a missed speed target
is printed as MISS but is not a failure). Without CUDA it says so, runs its CPU parts
(CPU export twice -> same digests; CPU restore -> same bytes) at 53 tokens, and exits 0.

    python -m bench.gpu_check [--tokens 53,102400] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

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


def check_restore(src, row: int, tokens: int, path: str, device: str, verify: bool = True) -> None:
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


def cpu_parts(tokens: int, d: str) -> None:
    """What runs without a GPU: CPU export is deterministic, CPU restore is exact."""
    src = build_reference_pools(tokens)
    row = alloc_request(src, tokens)
    pa, pb = os.path.join(d, "cpu-a.hsnap"), os.path.join(d, "cpu-b.hsnap")
    a, b = export(src, row, tokens, pa), export(src, row, tokens, pb)
    check_same_export(a, b, pa, pb, "CPU export twice")
    check_restore(src, row, tokens, pa, "cpu")
    print(f"CPU parts OK at {tokens} tokens: two exports identical ({len(a.digests)} sections), restore byte-identical")


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
                HostEngine().export_section(host, rows, lambda d, f, last: want.extend(bytes(d)))
                eng.export_section(buf, rows.to(dev), lambda d, f, last: got.extend(bytes(d)))
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
    print(f"[{tokens} tokens] bytes OK: CUDA export == CPU export ({len(ig.digests)} sections, root {ig.root_digest[:16]}...), "
          f"cupy restore byte-identical ({time.perf_counter() - t0:.1f} s)", flush=True)

    # ---- speed
    n = ig.payload_bytes
    dbuf = torch.empty(n, dtype=torch.uint8, device=dev)
    hbuf = torch.empty(n, dtype=torch.uint8, pin_memory=dev == "cuda")
    d2h = med(lambda: cuda_timed(lambda: hbuf.copy_(dbuf, non_blocking=True)), repeats)
    h2d = med(lambda: cuda_timed(lambda: dbuf.copy_(hbuf, non_blocking=True)), repeats)
    del dbuf, hbuf

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

    def restore_once(verify: bool) -> float:
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

    res_noverify = med(lambda: restore_once(False), repeats)
    res_verify = med(lambda: restore_once(True), repeats)
    eng_imp = med(engine_import, repeats)
    for p in (pg, pc):
        os.unlink(p)
    gbs = lambda t: n / t / 1e9  # noqa: E731
    rows_out += [
        (tokens, "pinned D2H cudaMemcpy (limit)", d2h, gbs(d2h), None),
        (tokens, "export, fsync=False", exp_nofsync, gbs(exp_nofsync), d2h / exp_nofsync),
        (tokens, "export, fsync=True", exp_fsync, gbs(exp_fsync), d2h / exp_fsync),
        (tokens, "CudaEngine export alone (null sink)", eng_exp, gbs(eng_exp), d2h / eng_exp),
        (tokens, "pinned H2D cudaMemcpy (limit)", h2d, gbs(h2d), None),
        (tokens, "restore, verify=False", res_noverify, gbs(res_noverify), h2d / res_noverify),
        (tokens, "restore, verify=True", res_verify, gbs(res_verify), h2d / res_verify),
        (tokens, "CudaEngine import alone (in-RAM source)", eng_imp, gbs(eng_imp), h2d / eng_imp),
    ]
    del g, c, tgt
    torch.cuda.empty_cache()


def print_table(table: list) -> None:
    print()
    print(f"{'tokens':>8}  {'what':<42} {'time':>10} {'GB/s':>7} {'x limit':>8}  target")
    for tokens, what, t, gb, ratio in table:
        verdict = "" if ratio is None or "alone" in what or "fsync=True" in what else ("PASS" if ratio >= TARGET else "MISS")
        r = "" if ratio is None else f"{ratio:.2f}"
        print(f"{tokens:>8}  {what:<42} {t * 1e3:>8.2f}ms {gb:>7.2f} {r:>8}  {verdict}")
    print(f"\n'x limit' = limit time / hsnap time; targets (>= {TARGET}) judged on export fsync=False and restore; "
          "the engine-alone rows show the copy engine without the page-cache side.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[53, BIG_TOKENS])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--cpu-tokens", type=int, default=53, help="size of the CPU self-test")
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="hsnap-gpu-", dir=args.dir)
    try:
        try:
            cpu_parts(args.cpu_tokens, d)
        except Failed as e:
            print(f"MISMATCH: {e}")
            return 1
        if not torch.cuda.is_available():
            print("SKIP: torch.cuda.is_available() is False — the CUDA export/restore checks and bandwidth table need one NVIDIA GPU")
            return 0
        try:
            import cupy  # noqa: F401
        except ImportError as e:
            print(f"FAIL: CudaEngine needs cupy (pip install 'hsnap[gpu]'): {e}")
            return 1
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; dir {d}", flush=True)
        table: list = []
        try:
            engine_dtype_check()
            for t in args.tokens:
                gpu_run(t, d, args.repeats, table)
        except Failed as e:
            print(f"MISMATCH: {e}")
            return 1
        print_table(table)
        return 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
