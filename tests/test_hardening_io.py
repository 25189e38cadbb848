"""Restore-path hardening: float8 storage, zero positions, any target page size, paged
SWA (and the CUDA engine's byte moves, which share the float8 cause). Real SGLang pools on CPU; every restore is checked byte
for byte against the source rows, every refusal against the pool fingerprint.

  9   float8 pools stored natively: restore into fragmented slots, the rollback, and
      uint8-stored fp8 snapshots into native-fp8 pools (same element format);
  10  requests with zero committed positions, every pool kind and page size;
  11  per-token sections restore into any target page size (spec 5.2);
  12  paged SWA: exported snapshots restore (SGLang 0.5.23 pages SWA on CPU).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from io_cases import identity, record  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_io import UnsupportedPoolError, export_request, restore_request  # noqa: E402
from hsnap_io import checks, slots, statecheck, transfer  # noqa: E402
from hsnap_io.adapters import TORCH_DTYPES, pool_device  # noqa: E402

N = 45


# ------------------------------------------------------------------ helpers


def _source(kind, page, n=N, evict=8, seed=1, **geom):
    ps = sp.build(kind, size=512, page_size=page, **geom)
    sp.occupy(ps, 2, 37, seed=5)
    req = sp.alloc_request(ps, n, seed=seed, swa_evict=evict if ps.has_swa else 0)
    return ps, req


def _export(ps, req, path, n=N):
    export_request(
        path,
        req_to_token_pool=ps.req_to_token_pool,
        token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
        req_pool_idx=req.req_pool_idx,
        record=record(n),
        identity=identity(),
        swa_start=req.swa_evicted,
    )
    return path


def _target(kind, page, fragmented=False, size=1024, **geom):
    t = sp.build(kind, size=size, page_size=page, seed=9, **geom)
    sp.occupy(t, 3, 50, seed=7)
    if fragmented:
        sp.fragment(t)
    return t


def _restore(path, t, **kw):
    return restore_request(path, req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator, identity=identity(), **kw)


def _refused(path, t, exc_type, **kw):
    before = sp.pool_state_fingerprint(t)
    with pytest.raises(exc_type) as info:
        _restore(path, t, **kw)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []
    assert isinstance(info.value, hf.HsnapError)
    return info.value


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.contiguous().unsqueeze(-1).view(torch.uint8)


def _assert_restored(src, req, tgt, res, n=N):
    """Byte-exact: full-attention and Mamba rows in position order; SWA rows of the
    positions the snapshot holds (swa_start..), wherever the target's page puts them."""
    assert res.state_position == n and len(res.token_indices) == n
    got_req = sp.RequestRecord(res.req_pool_idx, res.token_indices, res.mamba_pool_idx, n, 0)
    want, got = sp.request_rows(src, req), sp.request_rows(tgt, got_req)
    assert sorted(want) == sorted(got)
    swa_keys = {f"{p}.L{g}" for g in src.geom.get("swa_attention_layer_ids", ()) for p in "kv"}
    for name in want:
        if name == "swa_mask":
            start, floor = req.swa_evicted, res.swa_evict_floor
            assert floor == start // tgt.page_size * tgt.page_size
            assert got[name].tolist() == [False] * floor + [True] * (n - floor)
        elif name in swa_keys:
            held = n - req.swa_evicted  # positions swa_start..n-1, the last rows either side
            assert torch.equal(_raw(want[name]), _raw(got[name][len(got[name]) - held :])), name
        else:
            # same bytes, same shape; the type may be uint8 on one side, fp8 on the other
            assert torch.equal(_raw(want[name]), _raw(got[name])), name


def _assert_page_aligned(tgt, tokens):
    """Token i at page_i * P + i % P in whole pages the allocator no longer lists free."""
    P = tgt.page_size
    i = torch.arange(len(tokens))
    assert ((tokens % P) == (i % P)).all()
    pages = tokens // P
    assert (pages == pages[i - i % P]).all()
    alloc = tgt.token_to_kv_pool_allocator
    full = getattr(alloc, "full_attn_allocator", alloc)
    assert set(pages.tolist()).isdisjoint(full.free_pages.tolist())


def _is_run(tokens) -> bool:
    return len(tokens) > 0 and transfer._run_start(tokens) is not None


def _flaky_upload(monkeypatch, fail_at=4):
    real = transfer.HostEngine.import_section
    calls = {"n": 0}

    def flaky(self, buffer, rows, src, host=None):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(5, "Input/output error")
        return real(self, buffer, rows, src, host)

    monkeypatch.setattr(transfer.HostEngine, "import_section", flaky)
    return calls


# ------------------------------------------------------------------ float8 storage


@pytest.mark.parametrize("exact_rollback", [False, True])
def test_fp8_native_restore_into_fragmented_slots(tmp_path, exact_rollback):
    src, req = _source("mha_fp8_native", 1)
    assert all(b.dtype == torch.float8_e4m3fn for b in src.kv_pool.k_buffer)
    path = _export(src, req, str(tmp_path / "fp8.hsnap"))
    tgt = _target("mha_fp8_native", 1, fragmented=True)
    res = _restore(path, tgt, exact_rollback=exact_rollback)
    assert not _is_run(res.token_indices)  # the scatter path, not one slice copy
    _assert_restored(src, req, tgt, res)


def test_fp8_native_failed_restore_with_exact_rollback_leaves_pools_identical(tmp_path, monkeypatch):
    src, req = _source("mha_fp8_native", 1)
    path = _export(src, req, str(tmp_path / "fp8.hsnap"))
    tgt = _target("mha_fp8_native", 1, fragmented=True)
    calls = _flaky_upload(monkeypatch, fail_at=4)
    err = _refused(path, tgt, hf.HsnapIOError, exact_rollback=True)
    assert calls["n"] == 4 and "Input/output error" in str(err)


def test_rollback_puts_allocations_back_even_when_a_row_restore_fails(tmp_path, monkeypatch):
    """A byte restore that fails must not stop the rest of the rollback: free lists,
    request rows, req_generation and mappings come back; a typed error names the part
    that could not be put back."""
    src, req = _source("hybrid_linear", 1)
    path = _export(src, req, str(tmp_path / "h.hsnap"))
    tgt = _target("hybrid_linear", 1, fragmented=True)
    victim = tgt.kv_pool.full_kv_pool.k_buffer[0]  # attn.1.k, the third section uploaded
    real = statecheck.PoolCheckpoint.remember_rows

    def sabotaged(self, buffer, rows, *a, **kw):
        real(self, buffer, rows, *a, **kw)
        if buffer is victim:  # a saved copy that cannot go back (wrong row count)
            entry = self._rows[-1]
            self._rows[-1] = (*entry[:-1], entry[-1][:0])

    monkeypatch.setattr(statecheck.PoolCheckpoint, "remember_rows", sabotaged)
    _flaky_upload(monkeypatch, fail_at=4)
    before = sp.pool_state_fingerprint(tgt)
    with pytest.raises(hf.HsnapError) as info:
        _restore(path, tgt, exact_rollback=True)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(tgt)) == ["buffers.full.k.L1"]
    assert isinstance(info.value, statecheck.RollbackError)
    assert "attn.1.k" in str(info.value) and path in str(info.value)
    assert isinstance(info.value.__cause__, OSError)  # the failure that started the rollback


def test_any_upload_failure_is_a_typed_error_naming_the_section(tmp_path, monkeypatch):
    """Whatever fails inside the upload (a missing torch kernel was one), the caller gets
    an HsnapError naming the section, and every allocation is given back."""
    src, req = _source("hybrid_linear", 1)
    path = _export(src, req, str(tmp_path / "h.hsnap"))
    tgt = _target("hybrid_linear", 1, fragmented=True)
    real = transfer.HostEngine.import_section
    calls = {"n": 0}

    def no_kernel(self, buffer, rows, src_, host=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise NotImplementedError('"index_copy_cpu" not implemented for \'Float8_e4m3fn\'')
        return real(self, buffer, rows, src_, host)

    monkeypatch.setattr(transfer.HostEngine, "import_section", no_kernel)
    err = _refused(path, tgt, slots.UploadError, exact_rollback=True)
    assert err.field == "sections[attn.1.k]" and "NotImplementedError" in str(err)


@pytest.mark.parametrize("src_kind,tgt_kind", [("mha_fp8", "mha_fp8_native"), ("mha_fp8_native", "mha_fp8")])
def test_fp8_stored_as_uint8_and_native_fp8_restore_into_each_other(tmp_path, src_kind, tgt_kind):
    src, req = _source(src_kind, 1)
    path = _export(src, req, str(tmp_path / "fp8.hsnap"))
    with hf.open(path) as snap:
        assert snap.geometry.attention.dtype == "float8_e4m3fn"
        assert snap.geometry.attention.storage_dtype == ("uint8" if src_kind == "mha_fp8" else "float8_e4m3fn")
    tgt = _target(tgt_kind, 1, fragmented=True)
    _assert_restored(src, req, tgt, _restore(path, tgt))


@pytest.mark.parametrize("tgt_kind", ["mha_fp8", "mha_fp8_native"])
def test_another_fp8_format_is_still_refused(tmp_path, tgt_kind):
    src, req = _source("mha_fp8", 1)
    path = _export(src, req, str(tmp_path / "e4m3.hsnap"))
    tgt = _target(tgt_kind, 1, dtype=torch.float8_e5m2)
    err = _refused(path, tgt, hf.IncompatibleSnapshotError)
    assert ("geometry.attention.dtype", "float8_e5m2", "float8_e4m3fn") in err.differences


@pytest.mark.parametrize(
    "target,snap,differs",
    [
        (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "uint8"), False),  # byte view of the same format
        (("float8_e4m3fn", "uint8"), ("float8_e4m3fn", "float8_e4m3fn"), False),
        (("float8_e4m3fn", "uint8"), ("float8_e4m3fn", "uint8"), False),
        (("float8_e4m3fn", "int8"), ("float8_e4m3fn", "uint8"), True),  # not a byte view
        (("float8_e5m2", "float8_e5m2"), ("float8_e4m3fn", "uint8"), True),  # another format
        (("bfloat16", "bfloat16"), ("bfloat16", "int16"), True),  # 2-byte: no byte-view rule
        (("bfloat16", "bfloat16"), ("bfloat16", "uint8"), True),
    ],
)
def test_storage_rule_is_same_format_or_its_byte_view(target, snap, differs):
    base = hf.AttentionGeometry(kind="mha", layers=(0,), heads=1, k_head_dim=8, v_head_dim=8, dtype="bfloat16", storage_dtype="bfloat16")
    t = dataclasses.replace(base, dtype=target[0], storage_dtype=target[1])
    s = dataclasses.replace(base, dtype=snap[0], storage_dtype=snap[1])
    assert checks.storage_differs(t, s) is differs


def _random_bytes(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.int16).to(torch.uint8).view(dtype).view(shape)


_LAYOUTS = [
    ((40,), lambda t: t),  # one element per row (index tables)
    ((40, 3), lambda t: t),
    ((40, 2, 5), lambda t: t),
    ((40, 4, 6), lambda t: t[:, :, ::2]),  # rows not contiguous inside
]


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=lambda d: str(d).split(".")[-1])
def test_host_engine_moves_every_dtype_bytewise(tmp_path, dtype):
    """No element type can miss a gather/scatter kernel: every dtype hsnap names goes
    out of and into fragmented rows (numpy source and file source) byte-exact."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.tensor([7, 3, 30, 9, 31], dtype=torch.int64)
    others = torch.tensor([0, 1, 2, 39])
    for shape, layout in _LAYOUTS:
        base = _random_bytes(shape, dtype, gen)
        buf = layout(base)
        out = bytearray()
        transfer.HostEngine(staging_bytes=64).export_section(buf, rows, lambda d, first, last: out.extend(bytes(d)))  # noqa: B023 (runs within the call)
        assert bytes(out) == _raw(buf[rows]).numpy().tobytes(), shape
        blob = _raw(_random_bytes((len(rows), *buf.shape[1:]), dtype, gen)).numpy().tobytes()
        for how in ("numpy", "file"):
            tgt = layout(base.clone())
            assert tgt.is_contiguous() == buf.is_contiguous()
            keep = _raw(tgt[others]).clone()
            if how == "numpy":
                transfer.HostEngine(staging_bytes=64).import_section(tgt, rows, np.frombuffer(blob, dtype=np.uint8))
            else:
                p = tmp_path / "section.bin"
                p.write_bytes(b"\0" * 8 + blob)
                fd = os.open(p, os.O_RDONLY)
                try:
                    transfer.HostEngine(staging_bytes=64).import_section(tgt, rows, transfer.FileRange(fd, 8, len(blob)))
                finally:
                    os.close(fd)
            assert _raw(tgt[rows]).numpy().tobytes() == blob, (how, shape)
            assert torch.equal(_raw(tgt[others]), keep), (how, shape)  # other rows untouched


def test_a_bindings_host_rows_are_its_slots_bytes_and_a_run_outside_them_is_refused(tmp_path):
    """Binding.host_rows, the byte rows a host engine reads into instead of viewing the tensor per section: the
    buffer's own memory (None where the rows are not contiguous), followed when the buffer's storage moves; a run of
    slots read through them lands byte-exact with every other row untouched, and a run past the buffer's end is
    refused, as without them (a numpy slice would clamp it)."""
    from hsnap_io.adapters import Binding

    gen = torch.Generator().manual_seed(5)
    for shape, layout in _LAYOUTS:
        buf = layout(_random_bytes(shape, torch.bfloat16, gen))
        b = Binding("s", "conv", 0, buf, "mamba")
        if not buf.is_contiguous():
            assert b.host_rows is None
            continue
        host = b.host_rows
        assert host.shape == (buf.shape[0], _raw(buf[:1]).numel()) and np.shares_memory(host, buf.view(torch.uint8).numpy())
        rows = torch.tensor([11, 12, 13], dtype=torch.int64)
        blob = _raw(_random_bytes((3, *buf.shape[1:]), torch.bfloat16, gen)).numpy().tobytes()
        keep = _raw(buf).clone()
        p = tmp_path / "section.bin"
        p.write_bytes(blob)
        fd = os.open(p, os.O_RDONLY)
        try:
            transfer.HostEngine().import_section(buf, rows, transfer.FileRange(fd, 0, len(blob)), host)
            assert _raw(buf[rows]).numpy().tobytes() == blob
            others = [i for i in range(buf.shape[0]) if i not in (11, 12, 13)]
            assert torch.equal(_raw(buf)[others], keep[others])
            with pytest.raises(IndexError):  # rows 38..40 of 40: the index path refuses row 40
                transfer.HostEngine().import_section(buf, torch.tensor([38, 39, 40]), transfer.FileRange(fd, 0, len(blob)), host)
        finally:
            os.close(fd)
        moved = _random_bytes(shape, torch.bfloat16, gen)
        buf.set_(moved)  # the same tensor object over other memory
        assert np.shares_memory(b.host_rows, moved.view(torch.uint8).numpy())


# ------------------------------------------------------------------ zero positions


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kind", sp.KINDS + sp.EXTRA_KINDS)
def test_zero_committed_positions_export_and_restore(tmp_path, kind, page):
    src, req = _source(kind, page, n=0)
    path = _export(src, req, str(tmp_path / "zero.hsnap"), n=0)
    with hf.open(path) as snap:
        assert snap.state_position == 0
        assert all(s.shape[0] == 0 for s in snap.sections if s.kind in ("attn_k", "attn_v", "swa_k", "swa_v", "mla_kv"))
    tgt = _target(kind, page, fragmented=True)
    alloc = tgt.token_to_kv_pool_allocator
    avail = alloc.available_size()
    res = _restore(path, tgt)
    assert res.token_indices.numel() == 0 and res.swa_evict_floor == 0
    assert alloc.available_size() == avail  # no token (or SWA) slot taken for no position
    _assert_restored(src, req, tgt, res, n=0)


# ------------------------------------------------------------------ any target page size

PAGE_CASES = [
    ("mha", 16, 1),
    ("mha", 16, 64),
    ("mha", 1, 16),
    ("mha_fp8", 64, 16),
    ("mla", 16, 1),
    ("hybrid_linear", 1, 16),
    ("swa", 1, 16),
    ("swa", 16, 1),
    ("swa_mamba", 16, 64),
]


@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("kind,src_page,tgt_page", PAGE_CASES, ids=[f"{k}-{a}to{b}" for k, a, b in PAGE_CASES])
def test_per_token_sections_restore_into_any_page_size(tmp_path, kind, src_page, tgt_page, fragmented):
    src, req = _source(kind, src_page, evict=16)
    path = _export(src, req, str(tmp_path / "p.hsnap"))
    tgt = _target(kind, tgt_page, fragmented=fragmented)
    res = _restore(path, tgt)
    if fragmented and N > tgt_page:
        assert not _is_run(res.token_indices)  # pages that are no run: the scatter path
    _assert_page_aligned(tgt, res.token_indices)
    _assert_restored(src, req, tgt, res)


@pytest.mark.parametrize("kind,src_page,tgt_page", [("mha", 16, 64), ("swa", 1, 16), ("swa_mamba", 16, 16)])
def test_failed_paged_restore_rolls_back_exactly(tmp_path, monkeypatch, kind, src_page, tgt_page):
    """Paged allocation (alloc_extend, SWA pages freed below swa_start) is rolled back
    exactly too: pages, both SWA sides, the full->SWA mapping, every byte."""
    src, req = _source(kind, src_page, evict=20)
    path = _export(src, req, str(tmp_path / "p.hsnap"))
    tgt = _target(kind, tgt_page, fragmented=True)
    calls = _flaky_upload(monkeypatch, fail_at=4)
    _refused(path, tgt, hf.HsnapIOError, exact_rollback=True)
    assert calls["n"] == 4


def test_capacity_counts_pages_of_the_target(tmp_path):
    src, req = _source("mha", 64)  # 45 tokens: one page of 64 in the source
    path = _export(src, req, str(tmp_path / "p64.hsnap"))
    fits = sp.build("mha", size=128, page_size=16, seed=9)
    sp.occupy(fits, 1, 80, seed=7)  # 3 pages of 16 left: 48 >= 45 (one source page would be 64)
    _assert_restored(src, req, fits, _restore(path, fits))
    short = sp.build("mha", size=128, page_size=16, seed=9)
    sp.occupy(short, 1, 96, seed=7)  # 2 pages of 16 left: 32 < 48
    err = _refused(path, short, hf.CapacityError)
    assert "token slots: need 48, free 32" in str(err)


# ------------------------------------------------------------------ paged SWA


@pytest.mark.parametrize(
    "kind,src_page,tgt_page,evict",
    [("swa", 16, 16, 16), ("swa_mamba", 16, 16, 32), ("swa", 16, 1, 16), ("swa", 1, 16, 20), ("swa_mamba", 1, 16, 8)],
)
def test_paged_swa_snapshots_restore(tmp_path, kind, src_page, tgt_page, evict):
    """SGLang 0.5.23 pages SWA on CPU (alloc_extend, free_swa_segment), so hsnap restores
    paged SWA: SWA slots for every position from swa_start, freed in whole target pages
    below it."""
    src, req = _source(kind, src_page, evict=evict)
    assert req.swa_evicted == evict // src_page * src_page
    path = _export(src, req, str(tmp_path / "swa.hsnap"))
    tgt = _target(kind, tgt_page, fragmented=True)
    swa_free = tgt.token_to_kv_pool_allocator.swa_available_size()
    res = _restore(path, tgt)
    floor = req.swa_evicted // tgt_page * tgt_page
    assert res.swa_evict_floor == floor
    pages = -(-N // tgt_page) * tgt_page
    assert tgt.token_to_kv_pool_allocator.swa_available_size() == swa_free - (pages - floor)
    _assert_page_aligned(tgt, res.token_indices)
    _assert_restored(src, req, tgt, res)


def test_swa_pool_without_a_slot_mapping_is_refused_before_writing(tmp_path):
    """A per-request SWA ring has no full->SWA mapping: its rows cannot be exported,
    so nothing may be written (a snapshot nobody can restore)."""
    src, req = _source("swa", 1)
    src.kv_pool.swa_req_ring_size = 64
    path = tmp_path / "ring.hsnap"
    with pytest.raises(UnsupportedPoolError, match="swa_req_ring_size"):
        _export(src, req, str(path))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ CUDA engine, on CPU


@pytest.mark.parametrize(
    "device,current,index",
    [("cuda:1", 0, 1), ("cuda:0", 3, 0), ("cuda", 3, 3), ("cuda", 0, 0), (torch.device("cuda", 7), 2, 7)],
)
def test_cuda_engine_runs_under_the_pools_device(device, current, index):
    assert transfer.cuda_device_index(device, current) == index


def test_cuda_device_index_refuses_a_host_device():
    with pytest.raises(ValueError, match="not a CUDA device"):
        transfer.cuda_device_index("cpu", 0)


def test_engine_device_is_the_one_device_of_every_buffer():
    assert pool_device([torch.device("cuda:1")] * 3) == torch.device("cuda:1")
    for mixed in (["cuda:0", "cuda:1"], ["cpu", "cuda:0"]):
        with pytest.raises(UnsupportedPoolError, match="one device"):
            pool_device(mixed)


@pytest.mark.parametrize("n", [0, 1, transfer.COPY_PIECE_BYTES * 2 - 1, transfer.COPY_PIECE_BYTES * 2, transfer.COPY_PIECE_BYTES * 5 + 3])
def test_host_copy_copies_every_byte_in_pieces(n):
    src = np.frombuffer(np.random.default_rng(n).bytes(n), dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    transfer.host_copy(dst, src)
    assert np.array_equal(dst, src)


# ------------------------------------------------------------------ a CUDA engine's reads into its pinned staging
# (CudaEngine reads every source through read_spread; these are its host halves, run on any machine)

SPREAD_SIZES = [1, transfer.COPY_PIECE_BYTES * 2 - 1, transfer.COPY_PIECE_BYTES * 3 + 5]


def _section_file(tmp_path, n: int, lead: int = 8):
    """A file of ``lead`` bytes then ``n`` random ones; (its fd, those n bytes, a section info naming their digest)."""
    import xxhash

    data = np.random.default_rng(n).bytes(n)
    p = tmp_path / "section.bin"
    p.write_bytes(b"\x01" * lead + data)
    info = dataclasses.make_dataclass("Info", ["name", "offset", "length", "digest"])("s", lead, n, xxhash.xxh3_128_hexdigest(data))
    return os.open(p, os.O_RDONLY), data, info


@pytest.mark.parametrize("n", SPREAD_SIZES)
def test_file_range_read_on_the_copy_threads_gives_the_same_bytes(tmp_path, n):
    fd, data, _ = _section_file(tmp_path, n)
    try:
        out = bytearray(n)
        transfer.read_spread(transfer.FileRange(fd, 8, n), memoryview(out), 0)
        assert bytes(out) == data
    finally:
        os.close(fd)


@pytest.mark.parametrize("n", SPREAD_SIZES)
def test_verified_range_read_on_the_copy_threads_hashes_what_landed(tmp_path, n):
    from hsnap_io.pieces import VerifiedFileRange

    fd, data, info = _section_file(tmp_path, n)
    try:
        out = bytearray(n)
        src = VerifiedFileRange(fd, info, "section.bin")
        half = n // 2
        transfer.read_spread(src, memoryview(out)[:half], 0)  # in two reads, in order (a staging chunk each)
        transfer.read_spread(src, memoryview(out)[half:], half)
        src.finish()
        assert bytes(out) == data
        wrong = dataclasses.replace(info, digest="0" * 32)
        src = VerifiedFileRange(fd, wrong, "section.bin")
        transfer.read_spread(src, memoryview(out), 0)
        with pytest.raises(hf.DigestMismatchError, match="digest"):
            src.finish()
        src = VerifiedFileRange(fd, info, "section.bin")
        with pytest.raises(hf.HsnapError, match="out of order"):  # the digest is over the section in order
            transfer.read_spread(src, memoryview(out)[1:], 1)
    finally:
        os.close(fd)


def test_window_read_on_the_copy_threads_hands_on_its_rows_and_hashes_the_whole_section(tmp_path):
    from types import SimpleNamespace

    from hsnap_format.chain import Piece
    from hsnap_io.pieces import piece_source

    n = transfer.COPY_PIECE_BYTES * 3
    fd, data, info = _section_file(tmp_path, n)
    link = SimpleNamespace(source=SimpleNamespace(), fileno=lambda: fd, path="section.bin")  # a local file's link
    try:
        skip, take = transfer.COPY_PIECE_BYTES // 2 + 3, transfer.COPY_PIECE_BYTES * 2
        for digest, ok in ((info.digest, True), ("0" * 32, False)):
            src = piece_source(Piece(link, dataclasses.replace(info, digest=digest), skip, 0, 1, take), check_digests=True)
            out = bytearray(take)
            transfer.read_spread(src, memoryview(out), 0)
            assert bytes(out) == data[skip : skip + take]
            if ok:
                src.finish()  # reads the rest of the section for its digest
            else:
                with pytest.raises(hf.DigestMismatchError):
                    src.finish()
    finally:
        os.close(fd)


def test_a_source_without_spread_reads_is_read_by_its_own_call():
    class Gets:  # an object's ranged GETs: read in order by their own call
        length = 10
        calls: list = []

        def readinto(self, view, at):
            self.calls.append((len(view), at))
            view[:] = bytes(range(at, at + len(view)))

    out = bytearray(4)
    transfer.read_spread(Gets(), memoryview(out), 3)
    assert Gets.calls == [(4, 3)] and bytes(out) == bytes([3, 4, 5, 6])


def test_a_failed_spread_read_raises_only_once_every_piece_ended(monkeypatch):
    import time

    n = transfer.COPY_PIECE_BYTES * 3
    ended: list = []

    def pread(fd, view, offset):  # the first piece fails at once; the others take a while
        if offset == 0:
            raise OSError(5, "read failed")
        time.sleep(0.05)
        ended.append(offset)

    monkeypatch.setattr(transfer, "pread_into", pread)
    with pytest.raises(OSError, match="read failed"):
        transfer.spread_preads(-1, memoryview(bytearray(n)), 0)
    assert len(ended) == min(transfer.COPY_THREADS, 3) - 1  # no piece left writing into the buffer
