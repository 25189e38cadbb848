"""hsnap on an object store: export to and restore from a real SeaweedFS on loopback.

    python -m bench.remote [--tokens 53 4096 102400] [--repeats 3] [--clients] [--parallel 1 2 4 8]

For each size (reference geometry, real SGLang pools on CPU, bench/run.py's helpers):
  export  : export_request(s3://...)  vs the same client's plain multipart put of the
            same bytes (hsnap_format.stores.s3.upload.MultipartUpload, same part size and
            parallelism) vs export_request(local file)
  restore : restore_request(s3://...) (every digest checked as the bytes land) vs the
            same client's plain parallel ranged get of the same object into memory
            (RangeReader.readinto) vs restore_request(local file); the URL restore three
            ways: the default (verify=True: one pass straight into the slots, no undo log),
            and verify="before" (every digest before allocating: a payload under the bound
            staged, a larger one landing with an undo log) into slots holding an earlier
            restore's bytes (what the undo log copies) and into slots never used (zeros: a
            fresh server's, noted, not copied)
  open    : hsnap_format.open(url): wall time and GET round trips
``--parallel 1 2 4 8`` also restores at ``--parallel-tokens`` with that many GETs in
flight, against the plain ranged get with the same count (what picks the default).
Every restore of a size lands in the same warm target pools (put back after each, untimed,
as bench/run.py does) and the plain get fills the same warm buffer each time. Restore by URL with
the default verify=True: a body up to hsnap_io.restore.ONE_READ_BYTES staged and proved first (as
verify="before"); a larger one fetched straight into the slots where they are one run (the read-ahead's
landings), each piece hashed as it lands, a refusal zeroing what it wrote. With verify="before": a
body up to hsnap_io.restore.ONE_READ_BYTES is staged (GETs running ahead of the hashing, then
one copy into the slots); a larger one lands as the default does, each GET saving what it
overwrites first (the undo log of exact_rollback: zeros are noted, not copied).
``--clients`` also compares the candidate clients on one 256 MiB object (botocore
threads — what hsnap uses —, obstore, s3fs), when they are installed.

Loopback caveat: client and server share this machine's cores (2 here) and no
network is crossed, so absolute bandwidths are the server's CPU, not a network's;
the ratios against the plain put/get of the same client are what carries over.
Prints a markdown section (kept in bench/REMOTE.md: bench.run rewrites RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from functools import partial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

import hsnap_format as hf  # noqa: E402
from hsnap_format.stores.s3 import options as s3options, ranges as s3ranges, upload as s3upload  # noqa: E402

MiB = 1 << 20


def _t(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best(ts: list[float]) -> float:
    return min(ts)


def _restore_timed(tgt, fn) -> float:
    """``fn`` (a restore into ``tgt``) timed; then the pools are put back as they were
    (untimed), so every restore lands in the same warm slots, as bench/run.py's do."""
    from bench import run as br
    from hsnap_io.statecheck import PoolCheckpoint

    cp = PoolCheckpoint(br.view(tgt))
    dt = _t(fn)
    cp.rollback()
    return dt


def _zero_state(pools) -> None:
    """Every state buffer zeroed: slots no request has used (a fresh server's), where the restore's undo log holds
    zeros instead of copying the slots' old bytes."""
    from bench import run as br

    for b in br.view(pools).bindings:
        b.buffer.zero_()


def bench_size(tokens: int, repeats: int, server, bucket: str, opts: dict, d: str) -> dict:
    from bench import run as br
    from hsnap_io import export_request, restore_request

    src = br.build_reference_pools(tokens)
    br.fill_pool(src)
    row = br.alloc_request(src, tokens)
    ident, rec = br.identity(), br.record(tokens)
    o = s3options.StorageOptions.of(opts)
    res: dict = {"tokens": tokens}
    t_url, t_put, t_loc = [], [], []

    def plain_put(key: str, data: bytes) -> None:
        up = s3upload.MultipartUpload(f"s3://{bucket}/{key}", o)
        p = o.part_bytes
        for n, a in enumerate(range(0, len(data), p)):
            up.submit(n + 1, memoryview(data)[a : a + p])
        up.complete()

    # partial, not a closure: each timed call is bound to this round's values, and `del` frees them
    export = partial(export_request, **src.kwargs(), req_pool_idx=row, record=rec, identity=ident)
    for i in range(repeats):
        url = f"s3://{bucket}/t{tokens}-{i}.hsnap"
        t_url.append(_t(partial(export, url, storage_options=opts)))
        path = os.path.join(d, f"t{tokens}-{i}.hsnap")
        t_loc.append(_t(partial(export, path)))
        data = open(path, "rb").read()
        t_put.append(_t(partial(plain_put, f"plain{tokens}-{i}", data)))
        res["bytes"] = len(data)
        del data
        if i:
            os.unlink(path)
    res.update(export_url=best(t_url), plain_put=best(t_put), export_local=best(t_loc))
    del src, export

    url, path = f"s3://{bucket}/t{tokens}-0.hsnap", os.path.join(d, f"t{tokens}-0.hsnap")
    t_res, t_get, t_resl, t_open, trips = [], [], [], [], []
    tgt, buf = br.build_reference_pools(tokens), bytearray(res["bytes"])  # both warm, reused: like for like
    restore = partial(restore_request, **tgt.kwargs(), identity=ident)

    def plain_get(into: bytearray) -> None:
        r = s3ranges.RangeReader(f"s3://{bucket}/plain{tokens}-0", o)
        r.readinto(memoryview(into), 0)
        r.close()

    t_before, t_fresh = [], []
    for _ in range(repeats):
        t_res.append(_restore_timed(tgt, partial(restore, url, storage_options=opts)))
        t_before.append(_restore_timed(tgt, partial(restore, url, storage_options=opts, verify="before")))
        _zero_state(tgt)  # untimed: the slots as a fresh server has them (what the undo log need not copy)
        t_fresh.append(_restore_timed(tgt, partial(restore, url, storage_options=opts, verify="before")))
        t_resl.append(_restore_timed(tgt, partial(restore, path)))
        t_get.append(_t(partial(plain_get, buf)))
        t0 = time.perf_counter()
        with hf.open(url, storage_options=opts) as s:
            t_open.append(time.perf_counter() - t0)
            trips.append(s.source.requests)
    del tgt, buf, restore
    res.update(restore_url=best(t_res), restore_before=best(t_before), restore_fresh=best(t_fresh), plain_get=best(t_get),
               restore_local=best(t_resl), open=best(t_open), open_trips=max(trips))
    return res


def bench_parallel(tokens: int, counts: list[int], repeats: int, bucket: str, opts: dict, d: str) -> list[dict]:
    """restore_request(url) against the same client's plain ranged get of the same object,
    with 1, 2, 4, 8 GETs in flight (``parallel``) for both: what picks the default."""
    from bench import run as br
    from hsnap_io import export_request, restore_request

    src = br.build_reference_pools(tokens)
    br.fill_pool(src)
    row = br.alloc_request(src, tokens)
    ident = br.identity()
    url, path = f"s3://{bucket}/par{tokens}.hsnap", os.path.join(d, f"par{tokens}.hsnap")
    export_request(url, **src.kwargs(), req_pool_idx=row, record=br.record(tokens), identity=ident, storage_options=opts)
    export_request(path, **src.kwargs(), req_pool_idx=row, record=br.record(tokens), identity=ident)
    del src
    size = os.path.getsize(path)
    os.unlink(path)
    out = []
    tgt, buf = br.build_reference_pools(tokens), bytearray(size)

    def plain_get(o: dict) -> None:
        r = s3ranges.RangeReader(url, s3options.StorageOptions.of(o))
        r.readinto(memoryview(buf), 0)
        r.close()

    for p in counts:
        o = dict(opts, parallel=p)
        t_res, t_get = [], []
        for _ in range(repeats):
            t_res.append(_restore_timed(tgt, partial(restore_request, url, **tgt.kwargs(), identity=ident, storage_options=o)))
            t_get.append(_t(partial(plain_get, o)))
        out.append({"tokens": tokens, "bytes": size, "parallel": p, "restore_url": best(t_res), "plain_get": best(t_get)})
        print(f"# parallel {p} at {tokens} tokens: {out[-1]}", file=sys.stderr, flush=True)
    return out


def bench_clients(server, bucket: str, opts: dict, size: int = 256 * MiB) -> list[tuple[str, float, float]]:
    """(client, put MB/s, parallel ranged get MB/s) on the same bytes."""
    import concurrent.futures as cf

    data = os.urandom(size)
    o = s3options.StorageOptions.of(opts)
    C, P = o.chunk_bytes, o.parallel
    out = []

    def ours():
        up = s3upload.MultipartUpload(f"s3://{bucket}/c-boto", o)
        for n, a in enumerate(range(0, size, o.part_bytes)):
            up.submit(n + 1, memoryview(data)[a : a + o.part_bytes])
        up.complete()

    buf = bytearray(size)
    tp = _t(ours)
    tg = _t(lambda: s3ranges.RangeReader(f"s3://{bucket}/c-boto", o).readinto(memoryview(buf), 0))
    assert bytes(buf) == data
    out.append(("botocore, thread pool (hsnap)", size / tp / 1e6, size / tg / 1e6))
    try:
        import obstore
        from obstore.store import S3Store

        st = S3Store(bucket, endpoint=opts["endpoint_url"], access_key_id=opts["key"], secret_access_key=opts["secret"], region="us-east-1",
                     client_options={"allow_http": True})
        tp = _t(lambda: obstore.put(st, "c-obs", data, chunk_size=o.part_bytes, max_concurrency=P))

        def get_obs():
            mv = memoryview(buf)
            with cf.ThreadPoolExecutor(P) as ex:
                def one(a):
                    mv[a : a + C] = obstore.get_range(st, "c-obs", start=a, length=min(C, size - a))
                list(ex.map(one, range(0, size, C)))

        tg = _t(get_obs)
        assert bytes(buf) == data
        out.append(("obstore 0.12.1, thread pool", size / tp / 1e6, size / tg / 1e6))
    except ImportError:
        out.append(("obstore (not installed)", float("nan"), float("nan")))
    try:
        import s3fs

        fs = s3fs.S3FileSystem(key=opts["key"], secret=opts["secret"], client_kwargs={"endpoint_url": opts["endpoint_url"], "region_name": "us-east-1"})
        tp = _t(lambda: fs.pipe(f"{bucket}/c-s3fs", data))
        starts = list(range(0, size, C))
        tg = _t(lambda: fs.cat_ranges([f"{bucket}/c-s3fs"] * len(starts), starts, [min(a + C, size) for a in starts]))
        out.append(("s3fs 2026.9.0, cat_ranges", size / tp / 1e6, size / tg / 1e6))
    except ImportError:
        out.append(("s3fs (not installed)", float("nan"), float("nan")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[53, 4096, 102_400])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-repeats", type=int, default=1, help="repeats at sizes >= 256 MiB")
    ap.add_argument("--clients", action="store_true")
    ap.add_argument("--parallel", type=int, nargs="*", default=[], help="GETs in flight to compare (e.g. 1 2 4 8)")
    ap.add_argument("--parallel-tokens", type=int, nargs="+", default=[53, 4096])
    args = ap.parse_args(argv)
    import seaweed

    load0 = os.getloadavg()

    root = tempfile.mkdtemp(prefix="hsnap-bench-remote-")
    server = seaweed.Server(root, seaweed.weed_binary())
    server.start()
    try:
        bucket = server.make_bucket()
        opts = server.options(timeout=60.0)
        rows = []
        for tokens in args.tokens:
            reps = args.repeats if tokens < 20_000 else args.big_repeats
            r = bench_size(tokens, reps, server, bucket, opts, root)
            rows.append(r)
            print(f"# {tokens} tokens done: {r}", file=sys.stderr, flush=True)
        sweep = [r for t in (args.parallel_tokens if args.parallel else []) for r in bench_parallel(t, args.parallel, args.repeats, bucket, opts, root)]
        clients = bench_clients(server, bucket, opts) if args.clients else []
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()
    print(f"Load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} "
          f"on {os.cpu_count()} cores (shared machine: other jobs ran beside the bench).")
    print()
    print("| tokens | bytes | export URL | plain put | ratio | export local | restore URL | plain get | ratio | restore URL, verify=\"before\" | ratio "
          "| verify=\"before\", slots never used | ratio | restore local | open | GETs at open |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mb, get = r["bytes"] / 1e6, r["plain_get"]
        print(f"| {r['tokens']} | {r['bytes'] / MiB:.1f} MiB | {r['export_url']:.2f} s ({mb / r['export_url']:.0f} MB/s) | {r['plain_put']:.2f} s | "
              f"{r['plain_put'] / r['export_url']:.2f}x | {r['export_local']:.2f} s | {r['restore_url']:.2f} s ({mb / r['restore_url']:.0f} MB/s) | "
              f"{get:.2f} s | {get / r['restore_url']:.2f}x | {r['restore_before']:.2f} s | {get / r['restore_before']:.2f}x | "
              f"{r['restore_fresh']:.2f} s | {get / r['restore_fresh']:.2f}x | {r['restore_local']:.2f} s | {r['open'] * 1e3:.1f} ms | {r['open_trips']} |")
    if sweep:
        print()
        print("| tokens | bytes | GETs in flight (parallel) | restore URL | plain get | ratio |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in sweep:
            print(f"| {r['tokens']} | {r['bytes'] / MiB:.1f} MiB | {r['parallel']} | {r['restore_url'] * 1e3:.0f} ms | {r['plain_get'] * 1e3:.0f} ms | "
                  f"{r['plain_get'] / r['restore_url']:.2f}x |")
    if clients:
        print()
        print("| client (same 256 MiB object) | put MB/s | parallel ranged get MB/s |")
        print("|---|---:|---:|")
        for name, p, g in clients:
            print(f"| {name} | {p:.0f} | {g:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
