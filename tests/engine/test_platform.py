"""hsnap's CPU platform seams, each in a fresh interpreter: opt-in only (nothing loads without HSNAP_SGLANG_CPU=1),
the ``sgl_kernel`` shim SGLang imports (real ops registered, never-called names raising errors that name
themselves), the torchvision schemas, and import hygiene of the library packages."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def _run(code: str, *, opt_in: bool, extra_env: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HSNAP_SGLANG_CPU", "SGLANG_USE_CPU_ENGINE")}
    if opt_in:
        env["HSNAP_SGLANG_CPU"] = "1"
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_STATE = """
import json, os, sys
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.startswith(("hsnap_sglang", "sgl_kernel", "sglang"))),
    "finders": [type(f).__name__ for f in sys.meta_path],
    "sglang_cpu": os.environ.get("SGLANG_USE_CPU_ENGINE"),
}))
"""


def test_nothing_of_the_platform_loads_without_the_opt_in():
    state = _run("import torch, hsnap_format, hsnap_io, hsnap_sglang.req\n" + _STATE, opt_in=False)
    assert not [m for m in state["modules"] if m.startswith(("hsnap_sglang.cpu", "sgl_kernel"))], state["modules"]
    assert "CpuPlatformFinder" not in state["finders"]
    assert state["sglang_cpu"] is None


def test_library_packages_never_import_the_platform_even_when_opted_in():
    state = _run("import hsnap_format, hsnap_format.tools.cli, hsnap_io\n" + _STATE, opt_in=True)
    assert not [m for m in state["modules"] if m.startswith("hsnap_sglang.cpu")], state["modules"]


def test_importing_hsnap_sglang_imports_nothing_heavy():
    state = _run("import hsnap_sglang, hsnap_sglang.cpu\n" + _STATE + "\nassert 'torch' not in sys.modules", opt_in=False)
    assert state["sglang_cpu"] is None


def test_opt_in_installs_the_finder_at_torch_import_in_every_process():
    state = _run("import torch\n" + _STATE, opt_in=True)
    assert "CpuPlatformFinder" in state["finders"]
    assert state["sglang_cpu"] == "1"
    assert "sgl_kernel" not in state["modules"]  # served only when SGLang imports it


def test_sglang_plugin_entry_point_registers_nothing_without_the_opt_in():
    code = "from hsnap_sglang.cpu import sglang_plugin\nsglang_plugin()\n" + _STATE
    state = _run(code, opt_in=False)
    assert state["modules"] == ["hsnap_sglang", "hsnap_sglang.cpu"], state["modules"]  # returned before any import
    code = """
import json
from hsnap_sglang.cpu import sglang_plugin
sglang_plugin()
from sglang.srt.plugins.hook_registry import HookRegistry
print(json.dumps({"hooks": sorted(HookRegistry._hooks)}))
"""
    from hsnap_sglang.cpu import deterministic, triton_free

    assert set(_run(code, opt_in=True)["hooks"]) == set(triton_free.REPLACEMENTS) | set(deterministic.REPLACEMENTS)


def test_unsupported_sgl_kernel_names_raise_an_error_naming_themselves():
    code = """
import json, torch
import sgl_kernel
from hsnap_sglang.cpu.unsupported import UnsupportedKernelError
messages = {}
for name in sgl_kernel.UNSUPPORTED:
    try:
        getattr(sgl_kernel, name)(1, 2, 3)
    except UnsupportedKernelError as e:
        messages[name] = str(e)
try:
    from sgl_kernel import convert_weight_packed  # must stay absent: SGLang's AMX detection keys on it
    absent = False
except ImportError:
    absent = True
try:
    import sgl_kernel.allreduce
    allreduce = True
except ImportError:
    allreduce = False
print(json.dumps({"file": sgl_kernel.__file__, "names": sorted(sgl_kernel.UNSUPPORTED), "messages": messages,
                  "convert_weight_packed_absent": absent, "allreduce": allreduce,
                  "amx": hasattr(torch.ops.sgl_kernel, "convert_weight_packed")}))
"""
    out = _run(code, opt_in=True)
    assert out["file"].endswith(os.path.join("hsnap_sglang", "cpu", "sgl_kernel", "__init__.py"))
    assert out["names"] and sorted(out["messages"]) == out["names"]
    for name, message in out["messages"].items():
        assert f"sgl_kernel.{name} is not implemented by hsnap's CPU platform" in message
    assert out["convert_weight_packed_absent"] and not out["amx"] and not out["allreduce"]


def test_the_names_sglang_imports_on_cpu_resolve_to_real_ops_with_sglang_signatures():
    code = """
import json, torch
from sgl_kernel import assign_req_to_token_pool_cpu
from sgl_kernel.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu
from hsnap_sglang.cpu import ops
HV, DV, DK = 4, 8, 8
g = torch.Generator().manual_seed(0)
q, k = torch.randn(1, 2, 2, DK, generator=g), torch.randn(1, 2, 2, DK, generator=g)
v, a, b = torch.randn(1, 2, HV, DV, generator=g), torch.randn(2, HV, generator=g), torch.randn(2, HV, generator=g)
A_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g)
pool = torch.randn(3, HV, DV, DK, generator=g)
ref_pool = pool.clone()
# keyword call exactly as SGLang's TritonGDNKernel.decode makes it
out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
    A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
    initial_state_indices=torch.tensor([2, 0]), cu_seqlens=torch.tensor([0, 1, 2]), use_qk_l2norm_in_kernel=True,
    softplus_beta=1.0, softplus_threshold=20.0)
ref = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, ref_pool, torch.tensor([2, 0]),
                                                 torch.tensor([0, 1, 2]), True, 1.0, 20.0)
gg, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
x, z, w = torch.randn(3, DV, generator=g), torch.randn(3, DV, generator=g), torch.randn(DV, generator=g)
norm = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, w, z, 1e-6)
print(json.dumps({"decode": torch.equal(out, ref) and torch.equal(pool, ref_pool),
                  "gating": torch.equal(gg, ops.fused_gdn_gating(A_log, a, b, dt_bias)[0]),
                  "norm": torch.equal(norm, ops.rms_norm_gated(x, w, z, 1e-6)),
                  "callables": all(map(callable, (assign_req_to_token_pool_cpu, causal_conv1d_fn_cpu,
                                                  causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu)))}))
"""
    assert _run(code, opt_in=True) == {"decode": True, "gating": True, "norm": True, "callables": True}


def test_torchvision_placeholder_imports_for_sglang_and_names_itself_when_called():
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("a torchvision is installed here: the placeholder is served only where it is absent")
    code = """
import json, torch
import torchvision.transforms as T
from torchvision.transforms.functional import InterpolationMode
from hsnap_io.sglang_env import TorchvisionUnavailable
try:
    T.Resize((4, 4), interpolation=InterpolationMode.BICUBIC)
    msg = None
except TorchvisionUnavailable as e:
    msg = str(e)
print(json.dumps({"msg": msg}))
"""
    assert _run(code, opt_in=True)["msg"].startswith("torchvision.transforms.Resize is unavailable: torchvision is not installed")
    no_opt_in = "import importlib.util, json\nprint(json.dumps({'found': importlib.util.find_spec('torchvision') is not None}))"
    assert _run(no_opt_in, opt_in=False) == {"found": False}


def test_cuda_torchvision_beside_cpu_torch_gets_schemas_whose_kernels_name_themselves(tmp_path):
    (tmp_path / "_C.so").write_bytes(b"not a loadable library")  # what a CUDA build is to a CPU torch
    code = f"""
import json, torch
from hsnap_io.sglang_env import TorchvisionUnavailable, prepare_torchvision
defined = prepare_torchvision({str(tmp_path)!r})
torch.library.register_fake("torchvision::nms")(lambda dets, scores, iou_threshold: dets.new_empty(0, dtype=torch.long))
try:
    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    msg = None
except TorchvisionUnavailable as e:
    msg = str(e)
print(json.dumps({{"defined": defined, "msg": msg}}))
"""
    out = _run(code, opt_in=False)
    assert out["defined"] and out["msg"].startswith("torchvision::nms is unavailable")


def test_nothing_loads_on_a_machine_with_a_cuda_device():
    code = """
import json, os, sys, types
import hsnap_sglang.cpu as cpu
gpu_torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.8", hip=None),
                                  cuda=types.SimpleNamespace(is_available=lambda: True))
cpu_build = types.SimpleNamespace(version=types.SimpleNamespace(cuda=None, hip=None), cuda=None)
detected = [cpu._cuda_device_present(gpu_torch), cpu._cuda_device_present(cpu_build)]
cpu._cuda_device_present = lambda torch: True  # this machine, seen as a GPU machine
installed = cpu.install()
try:
    cpu.activate()
    refused = False
except cpu.CpuPlatformUnavailable:
    refused = True
print(json.dumps({"detected": detected, "installed": installed, "refused": refused,
                  "finders": [type(f).__name__ for f in sys.meta_path], "sglang_cpu": os.environ.get("SGLANG_USE_CPU_ENGINE")}))
"""
    out = _run(code, opt_in=True, extra_env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out["detected"] == [True, False]
    assert not out["installed"] and out["refused"]
    assert "CpuPlatformFinder" not in out["finders"] and out["sglang_cpu"] is None


def test_serve_adds_the_cpu_flags_unless_given_and_binds_one_core_range_per_rank():
    from hsnap_sglang.serve import CPU_DEFAULTS, launch_server_argv, omp_threads_bind

    argv = launch_server_argv(["--model-path", "m", "--attention-backend=triton", "--max-mamba-cache-size", "4"])
    assert argv.count("--attention-backend") == 0 and argv.count("--max-mamba-cache-size") == 1
    assert argv[argv.index("--device") + 1] == "cpu" and "--disable-cuda-graph" in argv
    assert set(CPU_DEFAULTS) <= {a.split("=")[0] for a in argv if a.startswith("--")}
    assert "--disable-overlap-schedule" in argv  # radix cache on: SGLang's CPU platform runs it only without overlap
    assert "--disable-overlap-schedule" not in launch_server_argv(["--disable-radix-cache"])
    cores = sorted(os.sched_getaffinity(0))
    assert omp_threads_bind(len(cores) + 1) is None
    ranges = omp_threads_bind(1).split("|")
    assert ranges == [str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"]


_ROWS = """
import json, os, torch
import torch.nn.functional as F
g = torch.Generator().manual_seed(0)
differ = []
for dtype in (torch.float16, torch.bfloat16):
    for k, n in ((128, 512), (128, 384), (64, 128)):
        w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(8, k, generator=g).to(dtype)
        rows = F.linear(x, w)
        differ += [f"{dtype} {k}x{n} m={m}" for m in range(1, 8) if not torch.equal(F.linear(x[:m], w), rows[:m])]
print(json.dumps({"differ": differ, "isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "omp": os.environ.get("OMP_WAIT_POLICY")}))
"""


def _rows(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("HSNAP_SGLANG_CPU", "SGLANG_USE_CPU_ENGINE", "ONEDNN_MAX_CPU_ISA", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _ROWS], capture_output=True, text=True, timeout=300, env={**clean, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_row_of_a_half_precision_matmul_has_the_same_bits_alone_and_batched():
    """A request's numbers must not depend on the requests batched with it: on a CPU with AVX512-FP16, oneDNN takes
    float16 matmuls of two or more rows and torch the one-row ones, with other bits, unless the platform caps
    oneDNN's ISA; an operator's own ONEDNN_MAX_CPU_ISA is kept."""
    capped = _rows(HSNAP_SGLANG_CPU="1")
    assert capped["isa"] == "AVX512_CORE_BF16" and capped["differ"] == [], capped
    kept = _rows(HSNAP_SGLANG_CPU="1", ONEDNN_MAX_CPU_ISA="AVX2")
    assert kept["isa"] == "AVX2" and kept["differ"] == [], kept
    assert _rows()["isa"] is None  # nothing is set without the opt-in


def test_the_processes_a_server_starts_wait_passively_on_shared_cores():
    """OpenMP threads that spin after each parallel region take the cores the server's other processes need: the
    platform sets OMP_WAIT_POLICY=PASSIVE for the processes it starts, unless the operator chose."""
    assert _rows(HSNAP_SGLANG_CPU="1")["omp"] == "PASSIVE"
    assert _rows(HSNAP_SGLANG_CPU="1", OMP_WAIT_POLICY="ACTIVE")["omp"] == "ACTIVE"
    assert _rows()["omp"] is None


_START_METHOD_PROBE = """
import multiprocessing, sys
from hsnap_sglang.serve import use_start_method
use_start_method(sys.argv[1])
multiprocessing.set_start_method("spawn", force=True)  # what SGLang's launch does
print(multiprocessing.get_start_method())
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_serve_starts_sglangs_processes_by_the_chosen_method_over_sglangs_forced_spawn(method):
    out = subprocess.run([sys.executable, "-c", _START_METHOD_PROBE, method], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == method, out.stderr


def test_serve_refuses_an_unknown_start_method_by_name():
    out = subprocess.run([sys.executable, "-c", _START_METHOD_PROBE, "forkserver"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "HSNAP_SGLANG_START_METHOD='forkserver': expected one of fork, spawn" in out.stderr
