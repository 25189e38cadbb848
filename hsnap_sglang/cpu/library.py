"""The ``torch.ops.sgl_kernel.*`` operators SGLang calls on its CPU platform for a GDN hybrid, registered with
``torch.library`` and backed by :mod:`hsnap_sglang.cpu.ops`.

SGLang looks these up as attributes of ``torch.ops.sgl_kernel`` (some at module import time, e.g.
``gdn_backend.py``: ``fused_gdn_gating = torch.ops.sgl_kernel.fused_gdn_gating_cpu``), and calls
``fused_sigmoid_gating_delta_rule_update_cpu`` with keyword arguments, so the schemas carry SGLang's argument names.
Registration is idempotent and happens when the ``sgl_kernel`` shim is imported.

``convert_weight_packed`` is deliberately absent: SGLang's AMX detection (``cpu_has_amx_support``) looks for it,
and it must stay false so that SGLang's fused ops fall back to their plain-torch ``forward_native``.
"""

from __future__ import annotations

import threading

import torch

from . import ops

__all__ = ["OPS", "register"]

# name -> (schema, implementation)
OPS = {
    "fused_gdn_gating_cpu": (
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias, float beta=1.0, float threshold=20.0)"
        " -> (Tensor, Tensor)",
        ops.fused_gdn_gating,
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v,"
        " Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor? cu_seqlens,"
        " bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
        ops.fused_sigmoid_gating_delta_rule_update,
    ),
    "fused_rmsnorm_gated_cpu": (
        "fused_rmsnorm_gated_cpu(Tensor x, Tensor weight, Tensor z, float eps) -> Tensor",
        lambda x, weight, z, eps: ops.rms_norm_gated(x, weight, z, eps, norm_before_gate=True, is_rms_norm=True, activation="swish"),
    ),
}

_lock = threading.Lock()
_library: torch.library.Library | None = None


def register() -> None:
    """Define ``sgl_kernel::<name>`` for every entry of :data:`OPS` (once per process)."""
    global _library
    with _lock:
        if _library is not None:
            return
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        for name, (schema, impl) in OPS.items():
            lib.define(schema)
            lib.impl(name, impl, "CPU")
        _library = lib
