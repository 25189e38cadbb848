"""hsnap CPU benchmark: export / restore / open against the I/O limit and common peers.

    make bench                       # full run (~10 min on 2 cores), writes bench/RESULTS.md
    python -m bench.run --quick      # 53 tokens, 1 repeat, no 1 GiB case (smoke test)
    python -m bench.run --cold       # drop the page cache before every restore (needs root)

Everything runs in one process on real SGLang 0.5.23 pools (device="cpu") with the
REFERENCE geometry (hsnap_format.reference: 10 full-attention layers 3,7,..,39,
1 KV head x 256 bf16; 30 GDN layers, conv [4096,3] bf16, temporal [16,128,128] fp32).
Sizes: 53, 4096, 32768 committed tokens, and a ~1 GiB case (102,400 tokens of the
same geometry: 30.7 MiB of Mamba state + 10,240 B per token = 1.007 GiB per rank).

Contenders are interleaved (the order drawn afresh every round) and repeated; the
median of ``--repeats`` rounds after ``--warmup`` rounds is reported.

export (source: the request's rows in the pools; destination: a fresh file in --dir)
  hsnap       export_request(..., fsync=F): gather + xxh3-128 digests + pwrite
  raw write   one os.write() of file_length bytes from a ready buffer
  raw falloc+write  the same after posix_fallocate of the whole file, as hsnap does (on
              ext4 this makes buffered writes ~2x cheaper)
  raw pwrite 2MiB, raw falloc+pwrite 2MiB  the same bytes in 2 MiB pwrite() calls (cache-
              sized, as hsnap's export), without and with posix_fallocate
              -- the limit is the FASTEST of the four raw writers, named in the report
  save_file   gather ({name: buf.index_select(0, rows)}) + safetensors.torch.save_file
  torch.save  gather + torch.save(dict)
  -- "fsync" rows: each contender fsyncs its file and then the directory, as hsnap does;
     "no fsync" rows: nobody fsyncs (hsnap fsync=False).
restore (source: a committed file; destination: fresh slots of other pools)
  hsnap       restore_request(..., verify=True / verify=False) incl. open, checks,
              allocation, undo log, upload
  mmap copy   mmap the hsnap file, copy every section into the same slots (the limit):
              one slice copy_ per section when its slots are one run, else index_copy_
  pread copy  the same bytes read with pread straight into the slots (a second, often
              faster limit); the restore targets are judged against the FASTER of the two
  st load     safetensors.torch.load_file + the same copy into the slots
  torch.load  torch.load(weights_only=True) + the same copy into the slots
  exact rollback  hsnap no-verify with exact_rollback=True: the undo log (old bytes of
              every target slot, put back if the upload fails) — what it costs
open          hsnap_format.open(path) (preamble, header, trailer, layout checks) + close
peak RSS      one subprocess per measurement, 1 GiB case: VmHWM after resetting it
              (/proc/self/clear_refs = 5) minus VmRSS before; RssAnon is polled too.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import gc
import importlib.metadata
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import reference as ref  # noqa: E402

SIZES = (53, 4096, 32768)
BIG_TOKENS = 102_400  # 1.007 GiB per rank with the reference geometry
MiB = 1 << 20
PIECE = 2 * MiB  # the verified-copy limit's read and hash unit (the restore's own piece size)
VERIFIED_READERS = ("pread", "mmap")

# Targets (held by the benchmark, never by timed tests)
T_EXPORT_VS_RAW = 0.9
T_EXPORT_VS_PEER = 2.0
T_OPEN_FLAT = 1.5  # open time at the largest size <= 1.5x the smallest
T_RSS_MIB = 128
T_RESTORE_NOVERIFY = 0.9
T_RESTORE_VERIFY = 0.8
T_OPEN_SEED_MS = 0.5  # open of the seed request (53 tokens, 83 sections)


# ---------------------------------------------------------------------------
# reference pools, built with SGLang's own classes
# ---------------------------------------------------------------------------

GDN = dict(k_heads=8, v_heads=16, k_dim=128, v_dim=128, conv_kernel=4)  # conv_dim 4096, temporal [16,128,128]


@dataclass
class Pools:
    req_to_token_pool: object
    allocator: object
    kv_pool: object
    size: int
    device: str

    @property
    def mamba_pool(self):
        return self.req_to_token_pool.mamba_pool

    def kwargs(self) -> dict:
        return dict(req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator)


def build_reference_pools(tokens: int, *, device: str = "cpu", max_reqs: int = 2, margin: int = 64) -> Pools:
    """HybridReqToTokenPool + HybridLinearKVPool + TokenToKVPoolAllocator, reference geometry,
    room for one request of ``tokens`` tokens (+ margin) and ``max_reqs`` mamba slots."""
    from hsnap_io.sglang_env import import_sglang

    sg = import_sglang()
    mu = sg.mamba_utils
    size = tokens + margin
    shape = mu.Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=GDN["v_heads"] * GDN["v_dim"],
        n_groups=GDN["k_heads"],
        num_heads=GDN["v_heads"],
        head_dim=GDN["v_dim"],
        state_size=GDN["k_dim"],
        conv_kernel=GDN["conv_kernel"],
    )
    params = mu.Mamba2CacheParams(
        shape=shape,
        layers=list(ref.GDN_LAYERS),
        dtype=mu.Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )
    rtp = sg.memory_pool.HybridReqToTokenPool(
        size=max_reqs,
        mamba_size=max_reqs,
        mamba_spec_state_size=max_reqs,
        max_context_len=size,
        device=device,
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=list(ref.GDN_LAYERS),
        enable_mamba_extra_buffer=False,
    )
    kv = sg.memory_pool.HybridLinearKVPool(
        size=size,
        dtype=torch.bfloat16,
        page_size=1,
        head_num=1,
        head_dim=256,
        full_attention_layer_ids=list(ref.FULL_ATTENTION_LAYERS),
        device=device,
        mamba_pool=rtp.mamba_pool,
        enable_memory_saver=False,
    )
    alloc = sg.allocator.TokenToKVPoolAllocator(size, torch.bfloat16, device, kv, False)
    pools = Pools(rtp, alloc, kv, size, device)
    geom = view(pools).geometry
    want = ref.geometry()
    if geom.attention != want.attention or geom.mamba != want.mamba:  # the bench must measure THE reference
        raise AssertionError(f"pools do not have the reference geometry: {geom} != {want}")
    return pools


def view(pools: Pools):
    from hsnap_io import view_pools

    return view_pools(pools.req_to_token_pool, pools.allocator)


_BLOCK = None


def noise_block() -> torch.Tensor:
    """8 MiB (+ a bit) of seeded noise; sections are filled by tiling it from shifted offsets."""
    global _BLOCK
    if _BLOCK is None:
        g = torch.Generator().manual_seed(0x45A9)
        _BLOCK = torch.randint(0, 256, (8 * MiB + 4099 * 97,), dtype=torch.uint8, generator=g)
    return _BLOCK


def _fill_rows(buffer: torch.Tensor, rows: torch.Tensor, salt: int) -> None:
    row_shape = tuple(buffer.shape[1:])
    nbytes = len(rows) * buffer[0].numel() * buffer.element_size()
    block = noise_block()
    start = (salt * 4099) % (4099 * 97)
    reps = -(-nbytes // (8 * MiB))
    flat = block[start : start + 8 * MiB].repeat(reps)[:nbytes]
    data = flat.view(buffer.dtype).view(len(rows), *row_shape)
    if buffer.device.type != "cpu":
        data = data.to(buffer.device)
    buffer.index_copy_(0, rows.to(buffer.device), data)


def alloc_slots(pools: Pools, tokens: int) -> int:
    """One request through SGLang's allocators: a req_to_token row, token slots, a mamba slot."""
    rtp = pools.req_to_token_pool
    row = rtp.alloc_rows(1)[0]
    slots = pools.allocator.alloc(tokens)
    if slots is None:
        raise RuntimeError("token pool exhausted")
    rtp.req_to_token[row, :tokens] = slots.to(rtp.req_to_token.dtype)
    mamba = rtp.mamba_allocator.alloc(1)
    rtp.req_index_to_mamba_index_mapping[row] = int(mamba.reshape(-1)[0])
    return row


def alloc_request(pools: Pools, tokens: int) -> int:
    """``alloc_slots`` with the request's rows filled with noise."""
    from hsnap_io.export import request_slots

    row = alloc_slots(pools, tokens)
    v = view(pools)
    s = request_slots(v, row, tokens)
    for i, b in enumerate(v.bindings):
        _fill_rows(b.buffer, s.rows(b.space), i)
    return row


def fill_pool(pools: Pools) -> None:
    """Every state row of the pools gets noise: a serving engine's free slots hold stale data."""
    for i, b in enumerate(view(pools).bindings):
        _fill_rows(b.buffer, torch.arange(b.buffer.shape[0], device=b.buffer.device), 1000 + i)


def identity() -> hf.Identity:
    return ref.identity(snapshot_id="bench")


def record(tokens: int) -> hf.RequestRecord:
    return ref.record(state_position=tokens)


def gather(pools: Pools, row: int, tokens: int) -> dict[str, torch.Tensor]:
    """The request's state as contiguous tensors (what save_file / torch.save are given)."""
    from hsnap_io.export import request_slots

    v = view(pools)
    s = request_slots(v, row, tokens)
    return {b.name: b.buffer.index_select(0, s.rows(b.space).to(b.buffer.device)) for b in v.bindings}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK) and drop_caches()


class Names:
    def __init__(self, d: str) -> None:
        self.d, self.n = d, 0

    def __call__(self, ext: str) -> str:
        self.n += 1
        return os.path.join(self.d, f"f{self.n:05d}{ext}")


def unlink(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}" if unit != "GiB" else f"{n / k:.3f} {unit}"
    return f"{n} B"


def fmt_t(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


@dataclass
class Case:
    tokens: int
    src: Pools
    row: int
    tgt: Pools
    payload: int = 0
    file_length: int = 0
    hsnap_file: str = ""
    st_file: str = ""
    pt_file: str = ""
    slots: object = None  # RequestSlots in tgt (from hsnap's own allocation)
    rounds: int = 0
    times: dict = field(default_factory=dict)  # (phase, contender) -> [seconds]


# ---------------------------------------------------------------------------
# contenders
# ---------------------------------------------------------------------------


# The export limit: the fastest way this machine puts the same bytes, already gathered in
# memory, into a file (same fsyncs as hsnap). Every way is measured and the best one is
# the limit — a "limit" that loses to the product would be the wrong limit.
RAW_WRITERS = {  # name -> (posix_fallocate first, pwrite chunk bytes or None for one write(), writeback)
    "raw write": (False, None, False),
    "raw falloc+write": (True, None, False),
    "raw pwrite 2MiB": (False, 2 << 20, False),
    "raw falloc+pwrite 2MiB": (True, 2 << 20, False),
    # + sync_file_range(SYNC_FILE_RANGE_WRITE) after each chunk: the device starts while the
    # rest is written (what hsnap's writer does when it will fsync)
    "raw falloc+pwrite 2MiB+writeback": (True, 2 << 20, True),
}


from hsnap_format.localfs import sync_file_range  # noqa: E402  (the writer's own libc binding)


def best_raw(t: dict[str, float]) -> tuple[str, float]:
    """(name, time) of the fastest raw writer in a {contender: median time} map."""
    name = min(RAW_WRITERS, key=lambda k: t[k])
    return name, t[name]


def export_contenders(case: Case, names: Names, fsync: bool) -> dict[str, Callable[[], float]]:
    from safetensors.torch import save_file

    from hsnap_io import export_request

    src, row, tokens = case.src, case.row, case.tokens
    rec, ident = record(tokens), identity()
    raw = np.ones(case.file_length, dtype=np.uint8)  # touched: the limit writes from RAM
    suffix = "fsync" if fsync else "nofsync"

    def hsnap() -> float:
        p = names(".hsnap")
        t = time.perf_counter()
        export_request(p, **src.kwargs(), req_pool_idx=row, record=rec, identity=ident, fsync=fsync)
        dt = time.perf_counter() - t
        unlink(p)
        return dt

    def raw_write(prealloc: bool, chunk: int | None = None, writeback: bool = False) -> Callable[[], float]:
        return lambda: _raw_write(prealloc, chunk, writeback)

    def _raw_write(prealloc: bool, chunk: int | None, writeback: bool) -> float:
        p = names(".raw")
        t = time.perf_counter()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if prealloc:
            os.posix_fallocate(fd, 0, len(raw))
        mv, done = memoryview(raw), 0
        if chunk is None:  # one write() of everything
            while done < len(mv):
                done += os.write(fd, mv[done:])
        else:  # pwrite in cache-sized chunks, as hsnap's export does
            while done < len(mv):
                n = os.pwrite(fd, mv[done : done + chunk], done)
                if writeback:
                    sync_file_range(fd, done, n, 2)  # SYNC_FILE_RANGE_WRITE
                done += n
        if fsync:
            os.fsync(fd)
        os.close(fd)
        if fsync:
            fsync_dir(names.d)
        dt = time.perf_counter() - t
        unlink(p)
        return dt

    def st_save() -> float:
        p = names(".safetensors")
        t = time.perf_counter()
        save_file(gather(src, row, tokens), p)
        if fsync:
            fsync_path(p)
        dt = time.perf_counter() - t
        unlink(p)
        return dt

    def pt_save() -> float:
        p = names(".pt")
        t = time.perf_counter()
        torch.save(gather(src, row, tokens), p)
        if fsync:
            fsync_path(p)
        dt = time.perf_counter() - t
        unlink(p)
        return dt

    return {
        f"export/{suffix}/hsnap": hsnap,
        **{f"export/{suffix}/{name}": raw_write(*how) for name, how in RAW_WRITERS.items()},
        f"export/{suffix}/save_file": st_save,
        f"export/{suffix}/torch.save": pt_save,
    }


def contiguous_start(rows: torch.Tensor) -> int | None:
    """First row if ``rows`` is one ascending run a, a+1, ..., else None."""
    n = len(rows)
    if n == 0:
        return None
    a = int(rows[0])
    if int(rows[-1]) - a + 1 != n:
        return None
    if n > 1 and not bool(torch.all(rows[1:] - rows[:-1] == 1)):
        return None
    return a


def pread_full(fd: int, dst: np.ndarray, offset: int) -> None:
    view, done = memoryview(dst).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += got


def copy_rows(buf: torch.Tensor, rows: torch.Tensor, data: torch.Tensor) -> None:
    """The plainest fast copy into slots: one slice copy for a run of slots, else index_copy_."""
    a = contiguous_start(rows)
    if a is not None:
        buf[a : a + len(rows)].copy_(data)
    else:
        buf.index_copy_(0, rows, data)


class KeptWorker:
    """One thread started once that runs a job beside the caller: what the restore does for its second thread (a
    thread started per call waits for the OS to run it), so the 2-thread limits pay no more for their helper."""

    def __init__(self) -> None:
        import queue

        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="bench-limit-worker", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, done, out = self._jobs.get()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - raised in the caller by join()
                out.append(e)
            done.set()

    def start(self, fn: Callable[[], None]) -> Callable[[], None]:
        done, out = threading.Event(), []
        self._jobs.put((fn, done, out))

        def join() -> None:
            done.wait()
            if out:
                raise out[0]

        return join


def restore_contenders(case: Case, cold: bool) -> dict[str, Callable[[], float]]:
    from safetensors.torch import load_file

    from hsnap_io import restore_request
    from hsnap_io.statecheck import PoolCheckpoint

    tgt, ident = case.tgt, identity()
    v = view(tgt)
    slots = case.slots
    with hf.open(case.hsnap_file) as snap:
        plan = [(b.buffer, slots.rows(b.space), snap.section(b.name)) for b in v.bindings]
    digests = [s.digest for _, _, s in plan]
    plan = [(buf, rows, s.offset, s.length) for buf, rows, s in plan]
    # each section's slots as one byte array where they are one run, made before the clock starts (the restore
    # keeps its pools' byte views between restores: Binding.host_rows), so a limit pays no torch view per section
    runs = [contiguous_start(rows) for _, rows, _, _ in plan]
    dests = [None if a is None else buf[a : a + len(rows)].reshape(-1).view(torch.uint8).numpy() for (buf, rows, _, _), a in zip(plan, runs)]

    def prep():
        if cold:
            drop_caches()

    def hsnap(verify: bool, **kw):
        label = {True: "verify", False: "no-verify", "before": "verify before"}[verify] + (" exact_rollback" if kw else "")

        def run() -> float:
            prep()
            cp = PoolCheckpoint(v)  # free lists etc.: put back after the run (untimed)
            c, t = time.process_time(), time.perf_counter()
            res = restore_request(case.hsnap_file, **tgt.kwargs(), identity=ident, verify=verify, **kw)
            dt = time.perf_counter() - t
            case.times.setdefault(f"cpu/{label}", []).append(time.process_time() - c)  # every thread's
            if not torch.equal(res.token_indices, slots.token):
                raise AssertionError("restore did not reuse the same slots")
            cp.rollback()
            for phase, seconds in res.timings.items():  # (the warm-up rounds' are dropped by interleave)
                case.times.setdefault(f"phase/{label}/{phase}", []).append(seconds)
            case.times.setdefault(f"phase/{label}/total_s", []).append(dt)
            return dt

        return run

    def mmap_copy() -> float:
        prep()
        t = time.perf_counter()
        fd = os.open(case.hsnap_file, os.O_RDONLY | os.O_CLOEXEC)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapped view: only read
            for (buf, rows, off, length), dest in zip(plan, dests):
                if dest is not None:
                    np.copyto(dest, np.frombuffer(mm, dtype=np.uint8, count=length, offset=off))
                    continue
                src = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=length, offset=off))
                copy_rows(buf, rows, src.view(buf.dtype).view(len(rows), *buf.shape[1:]))
                del src
        mm.close()
        return time.perf_counter() - t

    def pread_copy() -> float:
        prep()
        t = time.perf_counter()
        fd = os.open(case.hsnap_file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for (buf, rows, off, length), dest in zip(plan, dests):
                if dest is not None:  # straight into the slots
                    pread_full(fd, dest, off)
                else:
                    tmp = np.empty(length, dtype=np.uint8)
                    pread_full(fd, tmp, off)
                    buf.index_copy_(0, rows, torch.from_numpy(tmp).view(buf.dtype).view(len(rows), *buf.shape[1:]))
        finally:
            os.close(fd)
        return time.perf_counter() - t

    def verified(reader: str, threads: int, *, name: str, hashed: bool = True) -> Callable[[], float]:
        """The verified-copy limit: every section's bytes copied into its slots *and* hashed (xxh3-128, the file's own
        section digest, compared) — the least a restore that proves what it uploads must do — by 2 MiB pieces, each
        hashed right after it landed (still in cache), read by ``pread`` straight into the slots or copied out of an
        ``mmap``, on ``threads`` threads each taking the next section (preadv, the copies and xxhash release the GIL).
        ``hashed`` False: the same copy without the hash (a plain limit on ``threads`` threads). The CPU time of every
        thread is kept under ``cpu/<name>``."""
        order = sorted(range(len(plan)), key=lambda i: -plan[i][3])
        workers = [KeptWorker() for _ in range(threads - 1)]  # started once, like the restore's helper thread

        def one_share(take: Callable[[], int], fd: int, mm) -> None:
            while True:
                try:
                    i = take()
                except IndexError:
                    return
                buf, rows, off, length = plan[i]
                h = xxhash.xxh3_128()
                a, whole = runs[i], dests[i]
                if whole is None:
                    whole = np.empty(length, dtype=np.uint8)
                for p in range(0, length, PIECE):
                    dst = whole[p : p + PIECE]
                    if mm is None:
                        pread_full(fd, dst, off + p)
                    else:
                        dst[:] = np.frombuffer(mm, dtype=np.uint8, count=len(dst), offset=off + p)
                    if hashed:
                        h.update(dst)
                if a is None:
                    buf.index_copy_(0, rows, torch.from_numpy(whole).view(buf.dtype).view(len(rows), *buf.shape[1:]))
                if hashed and h.hexdigest() != digests[i]:
                    raise AssertionError(f"section {i}: digest mismatch")

        def run() -> float:
            prep()
            c, t = time.process_time(), time.perf_counter()
            fd = os.open(case.hsnap_file, os.O_RDONLY | os.O_CLOEXEC)
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if reader == "mmap" else None
            try:
                # each takes the next section when free: the worker the largest left, the caller the smallest (as the
                # restore's upload: in A/B runs here as fast as a split by bytes up front, or faster)
                left = collections.deque(order)
                joins = [worker.start(lambda: one_share(left.popleft, fd, mm)) for worker in workers]
                one_share(left.pop, fd, mm)
                for join in joins:
                    join()
            finally:
                if mm is not None:
                    mm.close()
                os.close(fd)
            dt = time.perf_counter() - t
            case.times.setdefault(f"cpu/{name}", []).append(time.process_time() - c)
            return dt

        return run

    def copy_in(tensors: dict) -> None:
        for b in v.bindings:
            copy_rows(b.buffer, slots.rows(b.space), tensors[b.name])

    def st_load() -> float:
        prep()
        t = time.perf_counter()
        copy_in(load_file(case.st_file))
        return time.perf_counter() - t

    def pt_load() -> float:
        prep()
        t = time.perf_counter()
        copy_in(torch.load(case.pt_file, weights_only=True))
        return time.perf_counter() - t

    return {
        "restore/hsnap verify": hsnap(True),  # default: read once, hashed as it lands in fresh slots
        "restore/hsnap verify before": hsnap("before"),  # every digest before allocating (a caller that evicts for it)
        "restore/hsnap no-verify": hsnap(False),
        "restore/hsnap exact rollback": hsnap(False, exact_rollback=True),
        "restore/mmap copy": mmap_copy,
        "restore/pread copy": pread_copy,
        **{f"restore/verified {reader} {n}T": verified(reader, n, name=f"verified {reader} {n}T") for reader in VERIFIED_READERS for n in (1, 2)},
        **{f"restore/copy {reader} 2T": verified(reader, 2, hashed=False, name=f"copy {reader} 2T") for reader in VERIFIED_READERS},  # plain limits, 2 threads
        "restore/st load": st_load,
        "restore/torch.load": pt_load,
    }


class _FullChecks:
    """Open with the fast paths switched off: canonical.loads' C-encoder proof
    and the reader's column-wise section table check — the pure-Python checks that were
    the only path before (the "before" of the open table, measured in the same run)."""

    def __enter__(self):
        from hsnap_format import canonical, reader

        def not_fast(*a, **k):
            raise canonical._NotFast

        self.saved = (canonical._loads_fast, reader._sections_fast)
        canonical._loads_fast, reader._sections_fast = not_fast, lambda *a, **k: None
        return self

    def __exit__(self, *exc):
        from hsnap_format import canonical, reader

        canonical._loads_fast, reader._sections_fast = self.saved


def open_contender(case: Case, cold: bool) -> dict[str, Callable[[], float]]:
    def run() -> float:
        if cold:
            drop_caches()
        t = time.perf_counter()
        s = hf.open(case.hsnap_file)
        s.close()
        return time.perf_counter() - t

    def full() -> float:
        with _FullChecks():
            return run()

    return {"open/hsnap": run, "open/full checks": full}


def collect_garbage() -> None:
    """A full collection, then everything alive frozen (``gc.freeze``): the next collection scans only what was
    allocated since.  SGLang's and torch's modules are ~10^6 tracked objects, so an unfrozen ``gc.collect()`` between
    two timed calls cost ~0.35 s here (28 of them: 9.6 of bench.run --quick's 22 s)."""
    gc.collect()
    if not gc.get_freeze_count():  # the first freeze: thaw at exit, or triton's nanobind reports its modules as leaked
        atexit.register(gc.unfreeze)
    gc.freeze()


def export_alone(case: Case, contenders: dict[str, Callable[[], float]], warmup: int, repeats: int) -> None:
    """hsnap and the raw writer that won the interleaved rounds (no fsync), each run ``warmup + repeats`` times in a
    row with nothing between (``alone/nofsync/<name>``): on this VM a writer that follows another's hundreds of MiB
    of freed memory can take 10x its time reading its own source (bench/RESULTS.md), which the interleaved medians
    charge to whoever runs next; alone, each writer's steady state."""
    t = {k.split("/")[2]: med(v) for k, v in case.times.items() if k.startswith("export/nofsync/")}
    winner, _ = best_raw(t)
    for name in ("hsnap", winner):
        fn = contenders[f"export/nofsync/{name}"]
        for r in range(warmup + repeats):
            collect_garbage()
            dt = fn()
            if r >= warmup:
                case.times.setdefault(f"alone/nofsync/{name}", []).append(dt)


def round_order(names: list, r: int) -> list:
    """The contenders' order in round ``r``: a permutation drawn afresh each round (seeded: a run is repeatable).  A
    rotation kept every contender's predecessor the same round after round — on this VM whoever runs right after a
    peer that faults in and frees hundreds of MiB (torch.save, save_file) pays for the host's page reporting, up to
    1 s for 350 MiB, so one contender took that cost in every round."""
    import random

    return random.Random(0x5EED + r).sample(list(names), len(names))


def interleave(contenders: dict[str, Callable[[], float]], warmup: int, repeats: int, sink: dict, log=None) -> None:
    keys = list(contenders)
    kept = {k: len(v) for k, v in sink.items()}
    for r in range(warmup + repeats):
        if r == warmup:  # what contenders recorded in ``sink`` themselves (phases, CPU time) counts from here too
            for k in [k for k in sink if k not in kept]:
                del sink[k]
            for k, n in kept.items():
                del sink[k][n:]
        for name in round_order(keys, r):
            collect_garbage()
            dt = contenders[name]()
            if r >= warmup:
                sink.setdefault(name, []).append(dt)
        if log:
            log(f"    round {r + 1}/{warmup + repeats}" + (" (warm-up)" if r < warmup else ""))


# ---------------------------------------------------------------------------
# peak RSS: one subprocess per measurement
# ---------------------------------------------------------------------------


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


class PeakAnon:
    """Polls RssAnon every ~1 ms on a thread (VmHWM has no anonymous-only twin)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _proc_status()["RssAnon"])
            time.sleep(0.001)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _proc_status()["RssAnon"])


def rss_child(what: str, tokens: int, d: str, path: str | None) -> dict:
    """Runs in a subprocess: set up, reset the peak, do ``what`` once, report the peak delta."""
    from safetensors.torch import load_file, save_file

    from hsnap_io import export_request, restore_request

    exporting = what.startswith("export")
    pools = build_reference_pools(tokens)
    row = alloc_request(pools, tokens) if exporting else fill_pool(pools)
    if what in ("restore st load", "restore torch.load"):  # the slots hsnap's restore would take
        from hsnap_io.export import request_slots

        v = view(pools)
        slots = request_slots(v, alloc_slots(pools, tokens), tokens)
    noise_block()
    out = os.path.join(d, f"rss-{os.getpid()}")
    gc.collect()
    gc.disable()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # reset VmHWM to VmRSS
        exact = True
    except OSError:
        exact = False
    before = _proc_status()
    with PeakAnon() as anon:
        if what == "export hsnap":
            export_request(out, **pools.kwargs(), req_pool_idx=row, record=record(tokens), identity=identity())
        elif what == "export save_file":
            save_file(gather(pools, row, tokens), out)
            fsync_path(out)
        elif what == "export torch.save":
            torch.save(gather(pools, row, tokens), out)
            fsync_path(out)
        elif what in ("restore hsnap verify", "restore hsnap no-verify", "restore hsnap exact_rollback"):
            restore_request(path, **pools.kwargs(), identity=identity(), verify=what.endswith(" verify"), exact_rollback=what.endswith("exact_rollback"))
        elif what in ("restore st load", "restore torch.load"):
            t = load_file(path) if what == "restore st load" else torch.load(path, weights_only=True)
            for b in v.bindings:
                copy_rows(b.buffer, slots.rows(b.space), t[b.name])
            del t
        else:
            raise ValueError(what)
    after = _proc_status()
    unlink(out)
    import resource

    return {
        "what": what,
        "exact": exact,
        "rss_before": before["VmRSS"],
        "peak_extra_rss": after["VmHWM"] - before["VmRSS"] if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before["VmRSS"],
        "peak_extra_anon": anon.peak - before["RssAnon"],
        "end_extra_rss": after["VmRSS"] - before["VmRSS"],
    }


def run_rss(what: str, tokens: int, d: str, path: str | None) -> dict:
    cmd = [sys.executable, "-m", "bench.run", "--rss-child", what, "--tokens", str(tokens), "--dir", d, "--threads", str(torch.get_num_threads())]
    if path:
        cmd += ["--file", path]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"rss child {what!r} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# machine description
# ---------------------------------------------------------------------------


def machine(d: str) -> dict:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        info["cpu"] = platform.processor()
    info["cores"] = f"{len(os.sched_getaffinity(0))} usable ({os.cpu_count()} online); torch threads {torch.get_num_threads()}"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(l.split()[1]) for l in f if l.startswith("MemTotal"))
        info["ram"] = f"{kb / (1 << 20):.1f} GiB"
    except (OSError, StopIteration):
        info["ram"] = "?"
    best = ("?", "", "?")
    try:
        real = os.path.realpath(d)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs, opts = line.split()[:4]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[1]):
                    best = (dev, mnt, f"{fs} ({opts})")
    except OSError:
        pass
    info["fs"] = f"{best[2]} on {best[0]} mounted at {best[1]}; bench dir {d}"
    info["kernel"] = platform.release()
    import safetensors
    import xxhash

    try:  # the installed distribution's version: importing sglang itself costs seconds
        sgv = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        sgv = "?"
    info["versions"] = (
        f"python {platform.python_version()}, torch {torch.__version__}, sglang {sgv}, safetensors {safetensors.__version__}, "
        f"numpy {np.__version__}, xxhash {xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION}), hsnap {hf.__version__}"
    )
    info["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return info


def header_lines(cmd: str, info: dict, elapsed: float, load0, load1, load_note: str = "") -> list[str]:
    """The lines under a report's title: the command, date and duration, the machine
    (:func:`machine`), the load average at start and end (``load_note`` after it)."""
    return [
        f"Command: `{cmd.strip()}`  ",
        f"Date: {info['date']}; total {elapsed:.0f} s  ",
        f"Machine: {info['cpu']}; cores: {info['cores']}; RAM {info['ram']}; kernel {info['kernel']}  ",
        f"Filesystem: {info['fs']}  ",
        f"Versions: {info['versions']}  ",
        "Load average (1/5/15 min) at start " + "/".join(f"{x:.1f}" for x in load0) + ", at end " + "/".join(f"{x:.1f}" for x in load1)
        + f" — the machine is shared, other jobs run beside the bench{load_note}.  ",
    ]


def bench_parser(prog: str, doc: str | None, *, quick: str, out: str, rounds: int) -> argparse.ArgumentParser:
    """A bench's parser with the options every bench has: ``--quick`` (``quick`` says what
    it runs; prints, writes nothing), ``--rounds``, ``--dir`` (for its files), ``--out``."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{quick}; prints, writes nothing")
    ap.add_argument("--rounds", type=int, default=rounds, help="measured rounds (median), after the warm-up")
    ap.add_argument("--dir", default=None, help="where its files go (a temporary directory in it)")
    ap.add_argument("--out", default=None, help=f"markdown output (default bench/{out}; none with --quick)")
    return ap


def timed_in_tempdir(prefix: str, parent: str | None, fn):
    """Run ``fn(d)`` in a fresh temporary directory ``d`` (removed after); returns
    (:func:`machine` of ``d``, what ``fn`` returned, seconds, load average at start, at end)."""
    load0, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as d:
        info = machine(d)
        out = fn(d)
    return info, out, time.perf_counter() - t0, load0, os.getloadavg()


def write_report(lines: list[str], quick: bool, out: str | None, default: str) -> None:
    """Print the report; unless ``quick``, write it to ``out`` (default ``bench/<default>``)."""
    text = "\n".join(lines)
    print(text)
    if not quick:
        with open(out or os.path.join(REPO, "bench", default), "w") as f:
            f.write(text)


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def med(xs) -> float:
    return statistics.median(xs)


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.verdicts: list[tuple[str, bool, str]] = []

    def add(self, s: str = "") -> None:
        self.lines.append(s)

    def table(self, head: list[str], rows: list[list[str]]) -> None:
        w = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        self.add("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
        self.add("|" + "|".join("-" * (x + 2) for x in w) + "|")
        for r in rows:
            self.add("| " + " | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) + " |")
        self.add()

    def verdict(self, what: str, ok: bool, figure: str) -> None:
        self.verdicts.append((what, ok, figure))

    def text(self) -> str:
        return "\n".join(self.lines)


def build_report(cases: list[Case], rss: list[dict], args, info: dict, elapsed: float, viewer_rounds: list[dict] | None = None) -> Report:
    R = Report()
    R.add("# hsnap benchmark results")
    R.add()
    R.add(f"Command: `python -m bench.run {' '.join(sys.argv[1:])}`  ")
    R.add(f"Date: {info['date']}; total bench time {elapsed:.0f} s  ")
    R.add(f"Machine: {info['cpu']}; cores: {info['cores']}; RAM {info['ram']}; kernel {info['kernel']}  ")
    R.add(f"Filesystem: {info['fs']}  ")
    R.add(f"Versions: {info['versions']}  ")
    cache = "COLD (page cache dropped before every restore/open run: sync; echo 1 > /proc/sys/vm/drop_caches)" if args.cold else "WARM (restore/open read files that were just written and are in the page cache; export writes fresh files)"
    R.add(f"Page cache: {cache}  ")
    R.add(f"Statistic: median of {args.repeats} interleaved rounds ({max(args.repeats, args.small_repeats)} for cases under 100 MiB) after {args.warmup} warm-up round(s); contender order drawn afresh every round (bench.run.round_order); wall clock (time.perf_counter).  ")
    R.add(f"torch intra-op threads: {args.threads} for every contender. Load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in info['load_start'])}, at end {'/'.join(f'{x:.1f}' for x in info['load_end'])} — the machine is shared, other jobs run beside the bench.  ")
    R.add("Geometry: hsnap_format.reference (10 attn layers x K,V [tokens,1,256] bf16; 30 GDN layers conv [4096,3] bf16 + temporal [16,128,128] fp32); ")
    R.add(f"the 1 GiB case is {BIG_TOKENS:,} committed tokens of the same geometry." if any(c.tokens == BIG_TOKENS for c in cases) else "")
    R.add()
    R.add("Ratios are speed ratios: `hsnap/limit` = t(limit) / t(hsnap) (1.0 = as fast as the limit); "
          "`peer/hsnap` = t(peer) / t(hsnap) (2.0 = hsnap twice as fast). Peers' times include the gather of the "
          "request's rows into contiguous tensors (they cannot write pool rows otherwise); the `gather` column shows its share.")
    R.add()
    for fs_mode in ("fsync", "nofsync"):
        title = "fsync file + directory (hsnap's default, like for like)" if fs_mode == "fsync" else "no fsync (hsnap fsync=False; nobody fsyncs)"
        R.add(f"## Export — {title}")
        R.add()
        rows = []
        for c in cases:
            t = {k.split("/")[2]: med(v) for k, v in c.times.items() if k.startswith(f"export/{fs_mode}/")}
            if not t:
                continue
            g = med(c.times["gather"]) if "gather" in c.times else float("nan")
            winner, lim = best_raw(t)
            rows.append([
                f"{c.tokens:,}", fmt_bytes(c.payload), fmt_t(t["hsnap"]), f"{c.file_length / t['hsnap'] / 1e9:.2f}",
                *(fmt_t(t[k]) for k in RAW_WRITERS), winner, fmt_t(t["save_file"]), fmt_t(t["torch.save"]), fmt_t(g),
                f"{lim / t['hsnap']:.2f}", f"{t['save_file'] / t['hsnap']:.2f}", f"{t['torch.save'] / t['hsnap']:.2f}",
                f"{t['save_file'] / lim:.2f} / {t['torch.save'] / lim:.2f}",
            ])
            R.verdict(f"export {fs_mode} {c.tokens:,} tok: hsnap/best raw write >= {T_EXPORT_VS_RAW}", lim / t["hsnap"] >= T_EXPORT_VS_RAW, f"{lim / t['hsnap']:.2f}")
            for peer in ("save_file", "torch.save"):
                R.verdict(f"export {fs_mode} {c.tokens:,} tok: {peer}/hsnap >= {T_EXPORT_VS_PEER}", t[peer] / t["hsnap"] >= T_EXPORT_VS_PEER, f"{t[peer] / t['hsnap']:.2f}")
        R.table(["tokens", "payload", "hsnap", "hsnap GB/s", *RAW_WRITERS, "best raw", "save_file", "torch.save", "gather",
                 "hsnap/best raw", "save_file/hsnap", "torch.save/hsnap", "ceiling (peer/best raw)"], rows)
        if fs_mode == "nofsync":
            alone = []
            for c in cases:
                a = {k.split("/")[2]: med(v) for k, v in c.times.items() if k.startswith("alone/nofsync/")}
                if "hsnap" not in a:
                    continue
                (raw_name, raw_t), = [(k, v) for k, v in a.items() if k != "hsnap"]
                inter = {k.split("/")[2]: med(v) for k, v in c.times.items() if k.startswith("export/nofsync/")}
                alone.append([f"{c.tokens:,}", fmt_t(a["hsnap"]), fmt_t(raw_t), raw_name, f"{raw_t / a['hsnap']:.2f}",
                              f"{best_raw(inter)[1] / inter['hsnap']:.2f}"])
                R.verdict(f"export nofsync {c.tokens:,} tok, each alone: hsnap/best raw write >= {T_EXPORT_VS_RAW}",
                          raw_t / a["hsnap"] >= T_EXPORT_VS_RAW, f"{raw_t / a['hsnap']:.2f}")
            if alone:
                R.add("Each writer alone (no fsync): hsnap and the raw writer that won above, each run the same rounds in a row "
                      "with nothing between (median): the steady state of each, without what the previous contender left "
                      "behind in this VM's memory.")
                R.add()
                R.table(["tokens", "hsnap alone", "best raw alone", "raw writer", "hsnap/best raw alone", "hsnap/best raw interleaved"], alone)
        if fs_mode == "fsync":
            R.add("`hsnap/best raw` = t(fastest raw writer) / t(hsnap), what the target is judged on; `best raw` names the writer that won "
                  "(one write() or 2 MiB pwrites, each with and without posix_fallocate, and 2 MiB pwrites after posix_fallocate with "
                  "sync_file_range writeback started after each — from bytes already gathered in memory). "
                  "`ceiling (peer/best raw)`: the best peer/hsnap ratio any writer could reach (one as fast as the raw write): "
                  "where it is under 2, the 2x target is out of reach by construction.")
            R.add()
    R.add("## Restore into fresh slots" + (" (cold page cache)" if args.cold else " (warm page cache)"))
    R.add()
    rows = []
    for c in cases:
        t = {k.split("/")[1]: med(v) for k, v in c.times.items() if k.startswith("restore/")}
        if not t:
            continue
        lim = min(t["mmap copy"], t["pread copy"], *(v for k, v in t.items() if k.startswith("copy ")))
        copy2 = min(v for k, v in t.items() if k.startswith("copy "))
        verified = {k: v for k, v in t.items() if k.startswith("verified ")}
        vbest = min(verified, key=verified.__getitem__)
        vlim = verified[vbest]
        rows.append([
            f"{c.tokens:,}", fmt_bytes(c.payload), fmt_t(t["hsnap verify"]), fmt_t(t["hsnap verify before"]),
            fmt_t(t["hsnap no-verify"]), fmt_t(t["hsnap exact rollback"]),
            fmt_t(t["mmap copy"]), fmt_t(t["pread copy"]), fmt_t(copy2), f"{fmt_t(vlim)} ({vbest.split(' ', 1)[1]})", fmt_t(t["st load"]), fmt_t(t["torch.load"]),
            f"{lim / t['hsnap no-verify']:.2f}", f"{vlim / t['hsnap verify']:.2f}", f"{vlim / t['hsnap verify before']:.2f}",
            f"{lim / t['hsnap verify']:.2f}", f"{lim / t['hsnap exact rollback']:.2f}",
            f"{t['st load'] / t['hsnap verify']:.2f}", f"{t['torch.load'] / t['hsnap verify']:.2f}",
        ])
        for mode, kind, target, limit in (("no-verify", "best", T_RESTORE_NOVERIFY, lim), ("verify", "verified", T_RESTORE_VERIFY, vlim)):
            ratio, floor = limit / t[f"hsnap {mode}"], two_core_floor(c, mode)
            # a miss names the best any schedule of the restore's measured work could reach here
            ceiling = f" (ceiling {limit / floor:.2f})" if floor and ratio < target else ""
            R.verdict(f"restore {c.tokens:,} tok: {mode} hsnap/{kind} limit >= {target}", ratio >= target, f"{ratio:.2f}{ceiling}")
    R.table(["tokens", "payload", "hsnap verify", "hsnap verify before", "hsnap no-verify", "no-verify exact_rollback", "mmap copy (limit)",
             "pread copy (limit)", "copy 2 threads (limit)", "verified copy (limit)", "st load+copy", "torch.load+copy", "no-verify/best limit", "verify/verified limit",
             "verify before/verified limit", "verify/best plain limit", "exact_rollback/best limit",
             "st/hsnap(verify)", "torch/hsnap(verify)"], rows)
    R.add("`hsnap verify` is the default verify=True: read once, each 2 MiB piece hashed as it lands in the fresh slots (on two "
          "threads from 4 MiB, each taking the next section when it is free, the helper the largest left, the caller the smallest: a helper that comes late takes what is left), the padding and record checked before allocating; a digest mismatch gives back every "
          "allocation and zeroes the slots it wrote. `hsnap verify before` is verify=\"before\" (what prove_opened does for "
          "the server, which may evict for the snapshot): every digest checked before allocating, so a refusal leaves the "
          "pools byte-identical — a body up to hsnap_io.restore.ONE_READ_BYTES (128 MiB) read once into a reused staging "
          "buffer, hashed as it lands, and uploaded from it (a second copy), a larger one verified, then read and hashed "
          "again as it lands. "
          "`hsnap no-verify` / `verify` are restore_request's defaults otherwise (exact_rollback=False: a failure mid-upload gives "
          "back every allocation and zeroes the slots written, not their old bytes). `no-verify exact_rollback` adds the undo log "
          "(PoolCheckpoint.remember_rows: every target slot's old bytes copied into fresh memory first). "
          "`best limit` = the fastest of mmap copy, pread copy and `copy 2 threads` (two threads each taking the next section, "
          "2 MiB preads into the slots or copies out of an mmap, the faster; no hashing): what no-verify is judged on. `verified copy "
          "(limit)` = the fastest way found here to copy the same page-cached bytes into the slots *and* hash them (xxh3-128, "
          "each section's digest compared): by 2 MiB pieces hashed right after they land, read by pread straight into the "
          "slots or copied out of an mmap, on 1 or 2 threads (the second a thread kept between runs, as the restore keeps its helper; "
          "each taking the next section when free, the helper the largest left, the caller the smallest, as the restore does — "
          "as fast as a split by bytes up front in A/B runs here, or faster; the winner in brackets): what verify is judged on. Every limit finds the slots' bytes of each section before its clock "
          "starts (a byte array over the slots where they are one run: the restore keeps such arrays with its pools' view), so "
          "none pays a torch view per section. Each way: "
          + "; ".join(f"{c.tokens:,} tokens " + ", ".join(f"{k.split('/', 1)[1][len('verified '):]} {fmt_t(med(v))}" for k, v in c.times.items()
                                                         if k.startswith("restore/verified ")) for c in cases) + ".")
    R.add()
    phase_rows = restore_phase_rows(cases)
    if phase_rows:
        R.add("## Where a restore's time goes (RestoredRequest.timings, medians of the same rounds)")
        R.add()
        R.table(["tokens", "mode", "open", "prove", "allocate", "plan", "upload", "the rest", "total", "limit", "upload/limit",
                 "total - upload", "CPU", "limit CPU", "2-core floor", "ceiling", "total/limit"], phase_rows)
        R.add("`prove`: identity, geometry, capacity and the bytes checked before allocating (verify: the padding and the record; "
              "verify before: every byte); `plan`: each section's pieces and the rollback plan; `upload`: read, hash (verify) and "
              "copy into the slots, on two threads from 4 MiB; `the rest`: the total less the phases (the pools' view, closing). "
              "`limit`: the verified-copy limit for verify, the best plain limit for no-verify — each a copy alone, with no file to "
              "open and check and no slot to allocate: `upload/limit` is how near the copy itself is, `total - upload` what the "
              "restore does besides. `CPU`: the restore's CPU time, every thread (time.process_time), `limit CPU` the limit's. "
              "`2-core floor`: the least wall time two cores can give the restore's work — the phases before the upload on one "
              "thread (the helper has nothing to take yet), the rest of its CPU time spread over both: open + prove + allocate + "
              "plan + (CPU - those) / 2. `ceiling` = limit / floor: the best ratio any schedule of this much work can reach on this "
              "machine; `total/limit` the ratio reached (the target's figure, as a ratio of medians).")
        R.add()
    R.add("## Open (preamble + header + trailer read and validated)")
    R.add()
    rows, opens = [], []
    for c in cases:
        if "open/hsnap" in c.times:
            o = med(c.times["open/hsnap"])
            full = med(c.times["open/full checks"])
            opens.append(o)
            rows.append([f"{c.tokens:,}", fmt_bytes(c.file_length), f"{o * 1e3:.3f} ms", f"{full * 1e3:.3f} ms", f"{full / o:.1f}x", f"{o / opens[0]:.2f}"])
    R.table(["tokens", "file", "open", "open, pure-Python checks (before)", "speed-up", "vs smallest"], rows)
    R.add("`open, pure-Python checks`: the same open with the fast paths off (canonical.loads' C-encoder proof, the "
          "column-wise section-table check) — the checks every open ran before the fast paths; both accept and refuse the same headers.")
    R.add()
    if opens and cases[0].tokens == 53:
        R.verdict(f"open 53 tok (seed) <= {T_OPEN_SEED_MS} ms", opens[0] * 1e3 <= T_OPEN_SEED_MS, f"{opens[0] * 1e3:.3f} ms")
    if len(opens) > 1:
        R.verdict(f"open flat: largest/smallest <= {T_OPEN_FLAT}", opens[-1] / opens[0] <= T_OPEN_FLAT, f"{opens[-1] / opens[0]:.2f}")
    if rss:
        R.add(f"## Peak extra memory at {rss[0]['tokens']:,} tokens (one subprocess per row)")
        R.add()
        R.add("`peak extra RSS` = VmHWM after the operation - VmRSS before it (VmHWM reset through /proc/self/clear_refs); "
              "it counts mapped file pages (page cache touched through mmap) as well as anonymous memory. "
              "`peak extra anon` = polled (1 ms) RssAnon peak - RssAnon before: private memory only.")
        R.add()
        rows = []
        for r in rss:
            rows.append([r["what"], f"{r['peak_extra_rss'] / MiB:.1f} MiB", f"{r['peak_extra_anon'] / MiB:.1f} MiB", f"{r['end_extra_rss'] / MiB:.1f} MiB", "exact" if r["exact"] else "ru_maxrss"])
            if r["what"].split()[1] == "hsnap" and "exact_rollback" not in r["what"]:
                R.verdict(f"peak extra RSS {r['what']} <= {T_RSS_MIB} MiB", r["peak_extra_rss"] <= T_RSS_MIB * MiB, f"{r['peak_extra_rss'] / MiB:.1f} MiB")
        R.table(["operation", "peak extra RSS", "peak extra anon", "extra RSS after", "peak method"], rows)
    if viewer_rounds:
        from bench import viewer

        R.add("## hsnap-view on a 10,006-section directory (bench/viewer.py; a fresh process per round, median)")
        R.add()
        R.table(viewer.HEAD, viewer.rows(viewer_rounds))
        cpu = statistics.median(r["first_frame_cpu_s"] for r in viewer_rounds)
        R.verdict(f"viewer first frame, 10,006 sections <= {viewer.T_FIRST_FRAME_CPU} CPU s", cpu <= viewer.T_FIRST_FRAME_CPU, f"{cpu:.2f} s")
    R.add("## Targets")
    R.add()
    R.table(["target", "result", "figure"], [[w, "PASS" if ok else "MISS", f] for w, ok, f in R.verdicts])
    notes = limits_notes(cases, rss)
    if notes:
        R.add("## What limits the misses (figures from this run)")
        R.add()
        for n in notes:
            R.add(f"- {n}")
        R.add()
    return R


BEFORE_UPLOAD = ("open_s", "prove_s", "allocate_s", "plan_s")  # on one thread: the helper has nothing to take yet
PHASES = (*BEFORE_UPLOAD, "upload_s")


def restore_phase_rows(cases: list[Case]) -> list[list[str]]:
    """Per size and mode (verify, no-verify): the medians of each phase of hsnap's restore, against the limit it is
    judged on; the CPU time of each (every thread) and the least wall time two cores can give the restore's work."""
    rows = []
    for c in cases:
        for mode, limit_keys in (("verify", [k for k in c.times if k.startswith("restore/verified ")]),
                                 ("no-verify", [k for k in c.times if k in ("restore/mmap copy", "restore/pread copy") or k.startswith("restore/copy ")])):
            if f"phase/{mode}/upload_s" not in c.times or not limit_keys:
                continue
            ph = {p: med(c.times[f"phase/{mode}/{p}"]) for p in PHASES}
            total = med(c.times[f"phase/{mode}/total_s"])
            best = min(limit_keys, key=lambda k: med(c.times[k]))
            limit = med(c.times[best])
            cpu = restore_cpu(c, mode)
            limit_cpu = contender_cpu(c, best)
            floor = two_core_floor(c, mode)
            rows.append([f"{c.tokens:,}", mode, *(fmt_t(ph[p]) for p in PHASES), fmt_t(max(0.0, total - sum(ph.values()))), fmt_t(total),
                         fmt_t(limit), f"{limit / ph['upload_s']:.2f}" if ph["upload_s"] else "-", fmt_t(total - ph["upload_s"]),
                         fmt_t(cpu) if cpu else "-", fmt_t(limit_cpu), fmt_t(floor) if floor else "-",
                         f"{limit / floor:.2f}" if floor else "-", f"{limit / total:.2f}"])
    return rows


def contender_cpu(c: Case, key: str) -> float:
    """The median CPU time (every thread) of the restore contender ``key`` ("restore/<name>"); a copy that does not
    record it runs on one thread: its wall time."""
    return med(c.times.get(f"cpu/{key.split('/', 1)[1]}", c.times[key]))


def restore_cpu(c: Case, mode: str) -> float | None:
    """The median CPU time (every thread) of hsnap's restore in ``mode``."""
    k = f"cpu/{mode}"
    return med(c.times[k]) if k in c.times else None


def two_core_floor(c: Case, mode: str) -> float | None:
    """The least wall time two cores can give the work of hsnap's restore in ``mode``, as measured: the phases before
    the upload (open, prove, allocate, plan) run on one thread — the helper has nothing to take yet — and the rest of
    its CPU time at best on both cores: (before + (cpu - before) / 2). A lower bound whatever the schedule: the
    phases' wall time is at least their CPU time."""
    if f"cpu/{mode}" not in c.times:
        return None
    # each run's floor, then their median: a floor no more than each run's time has a median no more than theirs
    befores = [sum(run) for run in zip(*(c.times[f"phase/{mode}/{p}"] for p in BEFORE_UPLOAD))]
    return med([before + max(0.0, cpu - before) / 2 for before, cpu in zip(befores, c.times[f"cpu/{mode}"], strict=True)])


def limits_notes(cases: list[Case], rss: list[dict]) -> list[str]:
    out = []
    if not cases:
        return out
    small, big = cases[0], cases[-1]

    def t(c: Case, k: str) -> float:
        return med(c.times[k])

    if "export/nofsync/hsnap" in small.times:
        lim = min(t(small, f"export/nofsync/{k}") for k in RAW_WRITERS)
        out.append(
            f"Export at {small.tokens:,} tokens: hsnap takes {fmt_t(t(small, 'export/nofsync/hsnap'))} without fsync against "
            f"{fmt_t(lim)} for the best raw write: what the raw write does not do — an xxh3-128 digest of every byte (~1.7 ms "
            f"for 31 MiB here), 83 gather/begin/digest/end steps through the pools' adapters, the header, fallocate, rename; with fsync it is diluted "
            f"({fmt_t(t(small, 'export/fsync/hsnap'))} vs {fmt_t(min(t(small, f'export/fsync/{k}') for k in RAW_WRITERS))})."
        )
        capped = []
        for c in cases:
            for mode in ("fsync", "nofsync"):
                if f"export/{mode}/hsnap" not in c.times:
                    continue
                lim = min(t(c, f"export/{mode}/{k}") for k in RAW_WRITERS)
                for peer in ("save_file", "torch.save"):
                    if t(c, f"export/{mode}/{peer}") / lim < T_EXPORT_VS_PEER:
                        capped.append(f"{peer} {mode} {c.tokens:,} tok ({t(c, f'export/{mode}/{peer}') / lim:.2f})")
        if capped:
            out.append(
                "Export vs save_file / torch.save: where `ceiling (peer/best raw)` is under 2, no writer can be 2x faster than the "
                "peer, because the peer itself takes less than twice the raw write: " + "; ".join(capped) + "."
            )
    if "alone/nofsync/hsnap" in big.times:
        (raw_k,) = [k for k in big.times if k.startswith("alone/nofsync/") and k != "alone/nofsync/hsnap"]
        inter = {k: big.times[f"export/nofsync/{k.split('/')[2]}"] for k in ("alone/nofsync/hsnap", raw_k)}
        out.append(
            f"Export without fsync at {big.tokens:,} tokens, interleaved vs alone: hsnap {fmt_t(t(big, 'export/nofsync/hsnap'))} "
            f"(rounds {fmt_t(min(inter['alone/nofsync/hsnap']))}–{fmt_t(max(inter['alone/nofsync/hsnap']))}) vs {fmt_t(t(big, 'alone/nofsync/hsnap'))} alone; "
            f"{raw_k.split('/')[2]} {fmt_t(med(inter[raw_k]))} (rounds {fmt_t(min(inter[raw_k]))}–{fmt_t(max(inter[raw_k]))}) vs {fmt_t(t(big, raw_k))} alone. "
            "Interleaved, hsnap reads its source (the pools) after another contender freed hundreds of MiB: on this VM that read "
            "(the pwrites' copy and the digest) can take many times its time alone."
        )
    if "export/fsync/hsnap" in big.times:
        spread = ", ".join(
            f"{k.split('/')[2]} {fmt_t(min(big.times[k]))}–{fmt_t(max(big.times[k]))}"
            for k in ("export/fsync/hsnap", *(f"export/fsync/{w}" for w in RAW_WRITERS))
        )
        out.append(f"The fsync rows follow the shared disk's fsync latency; at {big.tokens:,} tokens the rounds spread over {spread}.")
    if "restore/hsnap exact rollback" in big.times:
        nv, ex, v = t(big, "restore/hsnap no-verify"), t(big, "restore/hsnap exact rollback"), t(big, "restore/hsnap verify")
        lim = min(t(big, k) for k in big.times if k in ("restore/mmap copy", "restore/pread copy") or k.startswith("restore/copy "))
        out.append(
            f"Restore at {big.tokens:,} tokens: {fmt_t(nv)} without verification, {fmt_t(v)} with it, against {fmt_t(lim)} for the "
            f"best limit. Verification (verify=True) costs {fmt_t(v - nv)}: each 2 MiB piece hashed right after it lands in "
            f"the slots, while in cache"
            + f". exact_rollback=True costs {fmt_t(ex - nv)} more: the undo log copies the whole payload into "
            f"newly faulted pages, which this VM makes expensive (virtio-balloon free page reporting)."
        )
    for c in cases:
        if "restore/hsnap verify" in c.times and c is not big and med(c.times["restore/mmap copy"]) < 0.02:
            plain = min(t(c, k) for k in c.times if k in ('restore/mmap copy', 'restore/pread copy') or k.startswith('restore/copy '))
            line = (f"Restore at {c.tokens:,} tokens: the fixed cost of opening and checking the file (open alone is "
                    f"{fmt_t(t(c, 'open/hsnap'))}: canonical-JSON header check, layout check) and of allocating weighs against a "
                    f"{fmt_t(plain)} copy")
            if "phase/verify/upload_s" in c.times:
                best = min((k for k in c.times if k.startswith("restore/verified ")), key=lambda k: t(c, k))
                verified = t(c, best)
                up, total = t(c, "phase/verify/upload_s"), t(c, "phase/verify/total_s")
                line += (f": verify's upload (read, hash, copy) took {fmt_t(up)} against {fmt_t(verified)} for the verified-copy "
                         f"limit, and the rest of the restore {fmt_t(total - up)} (open {fmt_t(t(c, 'phase/verify/open_s'))}, prove "
                         f"{fmt_t(t(c, 'phase/verify/prove_s'))}, allocate {fmt_t(t(c, 'phase/verify/allocate_s'))}, plan "
                         f"{fmt_t(t(c, 'phase/verify/plan_s'))}), none of which the limit does")
                budget = verified / T_RESTORE_VERIFY  # the goal as arithmetic: what the whole restore may take
                if budget < total:
                    line += (f". At {T_RESTORE_VERIFY} of the limit the whole restore may take {fmt_t(budget)}: "
                             f"{fmt_t(budget - verified)} beside a copy as fast as the limit's, against {fmt_t(total - up)} of the rest here")
                # a server proves when the resume route is called, before its scheduler's step: what the step pays
                ahead = up + t(c, "phase/verify/allocate_s") + t(c, "phase/verify/plan_s")
                line += (f"; proved ahead, as the server does (open and prove when the route is called), what is left — allocate, "
                         f"plan, upload — is {fmt_t(ahead)}: {verified / ahead:.2f} of the limit")
                floor, cpu = two_core_floor(c, "verify"), restore_cpu(c, "verify")
                if floor:
                    before = sum(t(c, f"phase/verify/{p}") for p in BEFORE_UPLOAD)
                    line += (f". As CPU time: the restore's work took {fmt_t(cpu)} of CPU (both threads) against "
                             f"{fmt_t(contender_cpu(c, best))} for the limit's; with {fmt_t(before)} of it before the upload (on one thread), two cores cannot "
                             f"run it in under {fmt_t(floor)}: no schedule of this work passes {verified / floor:.2f} of the limit "
                             f"(this run reached {verified / total:.2f}, {floor / total:.2f} of that ceiling; "
                             f"even with every phase split over both cores, {fmt_t(cpu / 2)}: {2 * verified / cpu:.2f})")
                    if floor > budget:
                        line += (f"; at {T_RESTORE_VERIFY} the phases before the upload would have to lose {fmt_t(floor - budget)} "
                                 f"of their {fmt_t(before)} (or the upload {fmt_t(2 * (floor - budget))} of CPU), with a perfect schedule")
            out.append(line + ".")
    for r in rss:
        if r["what"].startswith("restore hsnap") and r["peak_extra_rss"] > T_RSS_MIB * MiB:
            out.append(
                f"{r['what']}: peak extra RSS {r['peak_extra_rss'] / MiB:.0f} MiB, of which {r['peak_extra_anon'] / MiB:.0f} MiB "
                f"anonymous (the rest is mapped page-cache pages, which RSS counts while they are mapped)."
            )
    return out


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="53 tokens, 1 repeat, no warm-up, no 1 GiB case, no RSS (smoke test)")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None, help="comma-separated token counts (default 53,4096,32768)")
    ap.add_argument("--big-tokens", type=int, default=BIG_TOKENS, help="the ~1 GiB case (0 = skip)")
    ap.add_argument("--repeats", type=int, default=7, help="measured rounds per case (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every contender (default 1: the machine is shared)")
    ap.add_argument("--small-repeats", type=int, default=11, help="at least this many rounds for cases under 100 MiB (cheap, noisier)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each restore/open run (root)")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    ap.add_argument("--dir", default=None, help="where files are written (default: a fresh temp dir)")
    ap.add_argument("--results", default=None, help="markdown output (default bench/RESULTS.md; none with --quick)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.tokens, args.dir, args.file)))
        return 0

    if args.quick:
        args.sizes = args.sizes or [53]
        args.big_tokens = 0
        args.repeats = 1 if args.repeats == 7 else args.repeats
        args.small_repeats = 1
        args.warmup = 0 if args.warmup == 1 else args.warmup
        args.no_rss = True
    sizes = list(args.sizes or SIZES)
    if args.big_tokens:
        sizes.append(args.big_tokens)
    results = args.results if args.results is not None else (None if args.quick else os.path.join(REPO, "bench", "RESULTS.md"))
    if args.cold and not can_drop_caches():
        print("--cold needs a writable /proc/sys/vm/drop_caches (root); running warm", file=sys.stderr)
        args.cold = False

    own_dir = args.dir is None
    d = tempfile.mkdtemp(prefix="hsnap-bench-") if own_dir else os.path.abspath(args.dir)
    os.makedirs(d, exist_ok=True)
    names = Names(d)
    t_start = time.perf_counter()

    def log(s: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {s}", file=sys.stderr, flush=True)

    info = machine(d)
    info["load_start"] = os.getloadavg()
    cases: list[Case] = []
    rss: list[dict] = []
    try:
        for tokens in sizes:
            log(f"{tokens} tokens: building pools")
            src = build_reference_pools(tokens)
            row = alloc_request(src, tokens)
            tgt = build_reference_pools(tokens)
            fill_pool(tgt)
            case = Case(tokens, src, row, tgt)
            from hsnap_io import export_request, restore_request
            from hsnap_io.statecheck import PoolCheckpoint

            case.hsnap_file = names(".hsnap")
            ci = export_request(case.hsnap_file, **src.kwargs(), req_pool_idx=row, record=record(tokens), identity=identity())
            case.payload, case.file_length = ci.payload_bytes, ci.file_length
            tensors = gather(src, row, tokens)
            from safetensors.torch import save_file

            case.st_file, case.pt_file = names(".safetensors"), names(".pt")
            save_file(tensors, case.st_file)
            torch.save(tensors, case.pt_file)
            del tensors
            # the slots hsnap's restore allocates in tgt (every run gets the same: free lists are put back)
            cp = PoolCheckpoint(view(tgt))
            res = restore_request(case.hsnap_file, **tgt.kwargs(), identity=identity())
            from hsnap_io.export import RequestSlots

            m = torch.tensor([res.mamba_pool_idx], dtype=torch.int64)
            sw = None
            case.slots = RequestSlots(res.token_indices, sw, m)
            _check_restored(case)
            cp.rollback()

            gt = []
            for _ in range(max(3, args.repeats)):
                t = time.perf_counter()
                gather(src, row, tokens)
                gt.append(time.perf_counter() - t)
            case.times["gather"] = gt
            reps = max(args.repeats, args.small_repeats) if case.payload < 100 * MiB else args.repeats
            case.rounds = reps
            for fsync in (True, False):
                log(f"{tokens} tokens: export, fsync={fsync}")
                interleave(export_contenders(case, names, fsync), args.warmup, reps, case.times, log)
            log(f"{tokens} tokens: export alone, no fsync")
            export_alone(case, export_contenders(case, names, False), args.warmup, reps)
            log(f"{tokens} tokens: restore")
            interleave(restore_contenders(case, args.cold), args.warmup, reps, case.times, log)
            log(f"{tokens} tokens: open")
            interleave(open_contender(case, args.cold), args.warmup, max(args.repeats, 21 if not args.quick else 1), case.times)
            cases.append(case)
            if tokens == args.big_tokens and not args.no_rss:
                for what in ("export hsnap", "export save_file", "export torch.save"):
                    log(f"rss: {what}")
                    rss.append({**run_rss(what, tokens, d, None), "tokens": tokens})
                for what, p in (("restore hsnap verify", case.hsnap_file), ("restore hsnap no-verify", case.hsnap_file), ("restore hsnap exact_rollback", case.hsnap_file), ("restore st load", case.st_file), ("restore torch.load", case.pt_file)):
                    log(f"rss: {what}")
                    rss.append({**run_rss(what, tokens, d, p), "tokens": tokens})
            for p in (case.hsnap_file, case.st_file, case.pt_file):
                unlink(p)
            case.src = case.tgt = None  # free the pools before the next size
            gc.unfreeze()  # the pools were frozen with everything else: let this collection free them
            collect_garbage()
    finally:
        if own_dir:
            shutil.rmtree(d, ignore_errors=True)
    viewer_rounds = None
    try:
        import textual  # noqa: F401  (hsnap[view])
    except ImportError as e:  # the viewer is not installed: its row is left out, said so
        log(f"viewer: skipped ({e})")
    else:
        from bench import viewer

        log("viewer: first frame of 10,006 sections")
        viewer_rounds = viewer.measure(1 if args.quick else 5)
    info["load_end"] = os.getloadavg()
    R = build_report(cases, rss, args, info, time.perf_counter() - t_start, viewer_rounds)
    print(R.text())
    print("\nTargets:")
    for w, ok, f in R.verdicts:
        print(f"  {'PASS' if ok else 'MISS'}  {w}  ({f})")
    if results:
        with open(results, "w") as f:
            f.write(R.text() + "\n")
        print(f"\nwrote {results}")
    return 0


def _check_restored(case: Case) -> None:
    """The bench's restore must put the source bytes into the slots (sanity, untimed)."""
    from hsnap_io.export import request_slots

    vs, vt = view(case.src), view(case.tgt)
    ss = request_slots(vs, case.row, case.tokens)
    for bs, bt in zip(vs.bindings, vt.bindings):
        a = bs.buffer.index_select(0, ss.rows(bs.space))
        b = bt.buffer.index_select(0, case.slots.rows(bt.space))
        if not torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a, b.view(torch.uint8) if b.dtype != torch.uint8 else b):
            raise AssertionError(f"restored {bs.name} differs from the source")


if __name__ == "__main__":
    sys.exit(main())
