"""The CUDA path (pinned staging + side stream on export, cupy uploads on restore),
checked byte for byte against the CPU path. Skipped, with the reason, where there is
no CUDA device or no cupy: this machine class has neither. bench/gpu_check.py runs
the same comparison plus bandwidths on a GPU machine. The CPU-testable parts of the
engine (device selection, raw-word row views) are in tests/test_hardening_io.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA export/restore path runs only on a GPU machine (bench/gpu_check.py)", allow_module_level=True)
pytest.importorskip("cupy", reason="cupy (hsnap[gpu]) is needed for the restore uploads")

from io_cases import identity, record, source  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_io import export_request, view_pools  # noqa: E402
from hsnap_io.adapters import TORCH_DTYPES  # noqa: E402
from hsnap_io.transfer import CudaEngine  # noqa: E402


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().cpu().unsqueeze(-1).view(torch.uint8).reshape(-1).numpy())


@pytest.mark.gpu
def test_cuda_engine_export_matches_cpu(tmp_path):
    ps, req = source("hybrid_linear", 1)
    cpu_path = str(tmp_path / "cpu.hsnap")
    export_request(cpu_path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                   req_pool_idx=req.req_pool_idx, record=record(), identity=identity())
    view = view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)
    engine = CudaEngine(torch.device("cuda"), staging_bytes=1 << 16)  # small: forces chunking and buffer reuse
    with hf.open(cpu_path) as snap:
        for b in view.bindings:
            info = snap.section(b.name)
            dev = b.buffer.cuda()
            rows = {"token": req.token_indices, "mamba": torch.tensor([req.mamba_pool_idx])}[b.space]
            got = bytearray()
            engine.export_section(dev, rows.cuda(), lambda data, first, last: got.extend(bytes(data)))  # noqa: B023 (runs within the call)
            engine.finish_export()
            assert bytes(got) == bytes(snap.raw(info)), b.name
            # and back: upload the file bytes into fresh rows of the device buffer
            fresh = torch.arange(len(rows), dtype=torch.int64) + 1
            engine.import_section(dev, fresh.cuda(), snap.array(info).reshape(-1).view("uint8"))
            engine.finish_import()
            assert _bytes(dev[fresh.cuda()]) == bytes(snap.raw(info)), b.name


def _every_dtype_through(device: torch.device) -> None:
    """Every dtype hsnap names (float8 included), fragmented rows, out and back in."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([7, 3, 30, 9, 31])
    engine = CudaEngine(device, staging_bytes=256)
    assert engine.index == device.index
    for dtype in TORCH_DTYPES:
        host = torch.randint(0, 2 if dtype == torch.bool else 256, (40, 3, 8), generator=gen, dtype=torch.int16).to(torch.uint8)
        host = host.view(torch.bool) if dtype == torch.bool else host.view(dtype) if dtype.itemsize == 1 else host.view(-1).view(dtype).view(40, 3, -1)
        buf = host.to(device)
        got = bytearray()
        engine.export_section(buf, rows.to(device), lambda data, first, last: got.extend(bytes(data)))  # noqa: B023 (runs within the call)
        engine.finish_export()
        assert bytes(got) == _bytes(host[rows]), dtype
        new = bytes(reversed(got))
        engine.import_section(buf, rows.to(device), torch.frombuffer(bytearray(new), dtype=torch.uint8).numpy())
        engine.finish_import()
        assert _bytes(buf[rows.to(device)]) == new, dtype
        others = torch.tensor([0, 1, 2, 39])
        assert _bytes(buf[others.to(device)]) == _bytes(host[others]), dtype


@pytest.mark.gpu
def test_cuda_engine_moves_every_dtype_bytewise():
    _every_dtype_through(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
def test_cuda_engine_runs_on_the_pools_device_not_the_current_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device: the cuda:1-while-current-is-0 case needs two")
    import cupy

    torch.cuda.set_device(0)
    with cupy.cuda.Device(0):
        _every_dtype_through(torch.device("cuda", 1))
        assert torch.cuda.current_device() == 0 and cupy.cuda.runtime.getDevice() == 0  # left as found
