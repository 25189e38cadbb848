"""The ``torch.ops.sgl_kernel.*`` operators SGLang calls on its CPU platform for a GDN hybrid, registered with
``torch.library`` and backed by :mod:`hsnap_sglang.cpu.ops`.

SGLang looks these up as attributes of ``torch.ops.sgl_kernel`` (some at module import time, e.g.
``gdn_backend.py``: ``fused_gdn_gating = torch.ops.sgl_kernel.fused_gdn_gating_cpu``), and calls
``fused_sigmoid_gating_delta_rule_update_cpu`` with keyword arguments, so the schemas carry SGLang's argument names.
Registration is idempotent and happens when the ``sgl_kernel`` shim is imported.

``murmur_hash32_cpu`` (seeded sampling, ``--enable-deterministic-inference``) is called inside SGLang's
``torch.compile``'d ``multinomial_with_seed``, so every operator here also has a fake (meta) implementation: the
output shapes and dtypes, for tracing.

``convert_weight_packed`` is deliberately absent: SGLang's AMX detection (``cpu_has_amx_support``) looks for it,
and it must stay false so that SGLang's fused ops fall back to their plain-torch ``forward_native``.
"""

from __future__ import annotations

import threading

import torch

from . import ops

__all__ = ["FAKES", "OPS", "register"]

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
    # seeded sampling (SGLang kernels/ops/sampling/murmur_hash.py, on CPU tensors)
    "murmur_hash32_cpu": (
        "murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor",
        ops.murmur_hash32,
    ),
    # Qwen3.5 (SGLang models/qwen3_5.py binds these at import under `if _is_cpu:`)
    "fused_sigmoid_mul_cpu": (
        "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
        ops.fused_sigmoid_mul_,
    ),
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
        " -> (Tensor, Tensor)",
        ops.fused_qk_gemma_rmsnorm,
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps,"
        " int head_dim, int num_head) -> (Tensor, Tensor, Tensor)",
        ops.fused_qk_gemma_rmsnorm_with_gate,
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk,"
        " int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)",
        ops.fused_qkvzba_split_reshape_cat_contiguous,
    ),
}


def _fake_gdn_gating(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    return a.new_empty((1, *a.shape), dtype=torch.float32), b.new_empty((1, *b.shape), dtype=torch.float32)


def _fake_delta_rule_update(A_log, dt_bias, q, k, v, *rest, **kw):
    # [B, T, H_v, Dv] -> [1, B * T, H_v, Dv] in q's dtype (ops.fused_sigmoid_gating_delta_rule_update)
    return v.new_empty((1, v.shape[0] * v.shape[1], *v.shape[2:]), dtype=q.dtype)


def _fake_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim, num_head):
    rows = q_gate.shape[0] * num_head
    return (q_gate.new_empty((rows, head_dim)), k.new_empty((k.shape[0] * (k.shape[1] // head_dim), head_dim)),
            q_gate.new_empty((rows, head_dim)))


def _fake_qkvzba_split(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    t = mixed_qkvz.shape[0]
    return (mixed_qkvz.new_empty((t, 2 * num_heads_qk * head_qk + num_heads_v * head_v)),
            mixed_qkvz.new_empty((t, num_heads_v, head_v)), mixed_ba.new_empty((t, num_heads_v)),
            mixed_ba.new_empty((t, num_heads_v)))


# name -> fake implementation (shapes and dtypes only; what torch.compile traces with)
FAKES = {
    "fused_gdn_gating_cpu": _fake_gdn_gating,
    "fused_sigmoid_gating_delta_rule_update_cpu": _fake_delta_rule_update,
    "fused_rmsnorm_gated_cpu": lambda x, weight, z, eps: torch.empty_like(x),
    "murmur_hash32_cpu": lambda seed, positions, col_indices: seed.new_empty(
        (seed.shape[0], col_indices.shape[0]), dtype=torch.uint32),
    "fused_sigmoid_mul_cpu": lambda x, gate: None,
    "fused_qk_gemma_rmsnorm_cpu": lambda q, k, q_weight, k_weight, eps, head_dim: (torch.empty_like(q), torch.empty_like(k)),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": _fake_qk_gemma_rmsnorm_with_gate,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": _fake_qkvzba_split,
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
            torch.library.register_fake(f"sgl_kernel::{name}", FAKES[name], lib=lib)
        _library = lib
