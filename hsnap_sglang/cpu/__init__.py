"""hsnap's CPU platform for SGLang: what SGLang 0.5.23's own CPU platform (``SGLANG_USE_CPU_ENGINE=1``) needs from
outside the package to serve a GDN hybrid (Qwen3-Next / Qwen3.5) or a Mamba2 hybrid (NemotronH, FalconH1,
GraniteMoeHybrid) on a machine without a GPU and without a CPU build of sgl_kernel.  See hsnap_sglang/README.md.

Opt-in: nothing here loads unless ``HSNAP_SGLANG_CPU=1`` is in the environment (or :func:`activate` is called), and
even then nothing loads on a machine with a CUDA device or with a real sgl_kernel installed.  Two official seams
carry it into every process SGLang starts (scheduler, detokenizer, TP workers), since the environment is inherited:

* ``torch.backends`` entry point (:func:`hsnap_sglang._autoload.torch_autoload`, run by torch at the end of
  ``import torch``, so before any SGLang module): sets ``SGLANG_USE_CPU_ENGINE=1`` and installs the import finder
  (:mod:`.finder`: the ``sgl_kernel`` shim, the torchvision schemas, the Mamba2 conv names :mod:`.fill_in` gives);
* ``sglang.srt.plugins`` entry point (:func:`sglang_plugin`, run by SGLang's ``load_plugins`` in every process):
  replaces the Triton launchers met on the forward path with torch (:mod:`.triton_free`) through SGLang's
  ``HookRegistry``, and lets ``--enable-deterministic-inference`` (seeded sampling) run here (:mod:`.deterministic`).

Without the opt-in this module imports only the standard library.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["ENV_VAR", "OMP_WAIT", "OMP_WAIT_ENV", "ONEDNN_ISA_ENV", "ONEDNN_MAX_ISA", "activate", "active", "install", "requested", "sglang_plugin", "CpuPlatformUnavailable"]

ENV_VAR = "HSNAP_SGLANG_CPU"
SGLANG_CPU_ENV = "SGLANG_USE_CPU_ENGINE"
# oneDNN's AVX512-FP16 kernels (Sapphire Rapids and later) take a float16 matmul of two or more rows, while torch
# computes a one-row matmul itself: the same row gets other bits in a batch than alone, so a request's numbers would
# depend on the requests beside it (measured: a decode step's logprobs differ by ~1e-5).  Capped at AVX512-BF16,
# torch computes every float16 row alike; bfloat16 keeps its oneDNN kernels (row-invariant here).  Read by oneDNN at
# its first primitive, so set before any matmul; an operator's own setting wins.
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
ONEDNN_MAX_ISA = "AVX512_CORE_BF16"
# A server's processes (HTTP, scheduler ranks, detokenizer) share the machine's few cores here, and OpenMP's default
# wait spins a thread on its core after every parallel region, taking it from the others: measured on 2 cores, two
# servers' test modules side by side took 384 CPU-s spinning, 136 CPU-s passive (wall 255 -> 105 s).  Read when
# OpenMP loads, so it reaches the processes the server starts (this one loaded it with torch); the operator's wins.
OMP_WAIT_ENV = "OMP_WAIT_POLICY"
OMP_WAIT = "PASSIVE"

logger = logging.getLogger("hsnap_sglang.cpu")


class CpuPlatformUnavailable(RuntimeError):
    """The CPU platform was asked for where it must not (or cannot) load."""


def requested() -> bool:
    """Whether the operator opted in (``HSNAP_SGLANG_CPU=1``)."""
    return os.environ.get(ENV_VAR) == "1"


def _cuda_device_present(torch) -> bool:
    if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
        return False  # a CPU-only torch build
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver means no usable device
        return False


def active() -> bool:
    """Whether this process runs with hsnap's CPU platform (the import finder is installed)."""
    from . import finder

    return finder.installed()


_decided: bool | None = None  # once per process: installed or refused


def install() -> bool:
    """Install the platform in this process if requested and allowed; returns whether it is active."""
    global _decided
    if not requested():
        return False
    if _decided is not None:
        return _decided
    import torch  # re-entrant when torch's own autoload calls us: torch is then already in sys.modules

    if _decided is not None:  # decided by that re-entrant call
        return _decided
    if _cuda_device_present(torch):
        logger.warning("%s=1 ignored: a CUDA device is present; hsnap's CPU platform does not load on a GPU machine", ENV_VAR)
        _decided = False
        return False
    os.environ[SGLANG_CPU_ENV] = "1"  # SGLang's own CPU platform; inherited by every process it starts
    os.environ.setdefault(ONEDNN_ISA_ENV, ONEDNN_MAX_ISA)  # batch invariance (above); inherited too
    os.environ.setdefault(OMP_WAIT_ENV, OMP_WAIT)  # cores shared by the server's processes (above)
    from . import finder

    finder.install()
    _decided = True
    return True


def activate() -> None:
    """Turn the CPU platform on for this process and every process it starts (sets ``HSNAP_SGLANG_CPU=1``).

    Call it before SGLang is imported: SGLang decides ``is_cpu()`` once per module at import time.  Raises
    :class:`CpuPlatformUnavailable` on a machine with a CUDA device, or when SGLang's runtime was already imported
    without its CPU platform.
    """
    if os.environ.get(SGLANG_CPU_ENV) != "1" and any(name.startswith("sglang.srt.") for name in sys.modules):
        raise CpuPlatformUnavailable(
            "hsnap_sglang.cpu.activate() must run before SGLang's runtime is imported "
            f"(sglang.srt modules are loaded with {SGLANG_CPU_ENV} unset); set {ENV_VAR}=1 in the environment instead"
        )
    os.environ[ENV_VAR] = "1"
    if not install():
        raise CpuPlatformUnavailable("hsnap's CPU platform does not load on a machine with a CUDA device")


def sglang_plugin() -> None:
    """``sglang.srt.plugins`` entry point: in an opted-in process, register the Triton-launch replacements and what
    ``--enable-deterministic-inference`` needs here (:mod:`.deterministic`)."""
    if not install():
        return
    from . import deterministic, triton_free

    triton_free.register()
    deterministic.register()
