"""The CUDA path (pinned staging + side stream on export, cupy uploads on restore),
checked byte for byte against the CPU path. Skipped, with the reason, where there is
no CUDA device or no cupy: this machine class has neither. bench/gpu_check.py runs
the same comparison plus bandwidths on a GPU machine."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA export/restore path runs only on a GPU machine (bench/gpu_check.py)", allow_module_level=True)
pytest.importorskip("cupy", reason="cupy (hsnap[gpu]) is needed for the restore uploads")

from io_cases import identity, record, source  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_io import export_request, view_pools  # noqa: E402
from hsnap_io.transfer import CudaEngine  # noqa: E402

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
            engine.export_section(dev, rows.cuda(), lambda data, first, last: got.extend(bytes(data)))
            engine.finish_export()
            assert bytes(got) == bytes(snap.raw(info)), b.name
            # and back: upload the file bytes into fresh rows of the device buffer
            fresh = torch.arange(len(rows), dtype=torch.int64) + 1
            engine.import_section(dev, fresh.cuda(), snap.array(info).reshape(-1).view("uint8"))
            engine.finish_import()
            assert bytes(dev[fresh.cuda()].cpu().reshape(-1).view(torch.uint8).numpy()) == bytes(snap.raw(info)), b.name
