"""Triton launches on SGLang's CPU forward path for a GDN hybrid, replaced with torch through SGLang's plug-in
``HookRegistry`` (``HookType.REPLACE``; the registry also rebinds every ``from module import name`` copy).

Triton has no CPU driver, so each of these launchers would fail on the first forward.  The table lists every one
met by a Qwen3-Next / Qwen3.5 forward (prefill, decode, mixed) on SGLang 0.5.23's CPU platform without AMX, and the
two Mamba2 (SSD) launchers of ``MambaMixer2`` (NemotronH, FalconH1, GraniteMoeHybrid), and the Triton causal conv
that ``layers/attention/mamba/causal_conv1d.py`` falls back to off CUDA (LFM2's short conv calls it, prefill and
decode); the replacements are the reference math of :mod:`hsnap_sglang.cpu.ops` and
:mod:`hsnap_sglang.cpu.ops_mamba2`, with the launchers' signatures.
"""

from __future__ import annotations

from . import fill_in, ops, ops_mamba2

__all__ = ["REPLACEMENTS", "register"]


def _launch_fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output, *, do_add):
    ops.fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output, do_add=do_add)


def _layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False,
                  activation="swish"):
    return ops.rms_norm_gated(x, weight, z, eps, bias=bias, group_size=group_size, norm_before_gate=norm_before_gate,
                              is_rms_norm=is_rms_norm, activation=activation)


def _rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                    eps=1e-6):
    if residual is not None or prenorm:
        raise NotImplementedError("rms_norm_gated with a residual / prenorm is not supported by hsnap's CPU platform")
    return ops.rms_norm_gated(x, weight, g, eps, bias=bias, norm_before_gate=True, is_rms_norm=True, activation=activation)


# SGLang target (module.attr) -> torch replacement with the same signature
REPLACEMENTS = {
    "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul": _launch_fused_gate_sigmoid_mul,
    "sglang.kernels.ops.attention.fla.layernorm_gated.layernorm_fn": _layernorm_fn,
    "sglang.kernels.ops.attention.fla.fused_norm_gate.rms_norm_gated": _rms_norm_gated,
    # Mamba2: the prefill scan and the decode step (the SSU dispatcher's "triton" backend calls the latter)
    "sglang.kernels.ops.mamba.triton_ops.ssd_combined.mamba_chunk_scan_combined": ops_mamba2.mamba_chunk_scan_combined,
    "sglang.kernels.ops.mamba.triton_ops.mamba_ssm.selective_state_update": ops_mamba2.selective_state_update,
    # the causal conv (LFM2's short conv: causal_conv1d.py's non-CUDA path and its speculative verify call these)
    "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn": fill_in.causal_conv1d_fn_triton,
    "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update": fill_in.causal_conv1d_update_triton,
}

_registered = False


def register() -> None:
    """Register every replacement with SGLang's HookRegistry (once per process; ``load_plugins`` applies them)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, replacement in REPLACEMENTS.items():
        HookRegistry.register(target, replacement, HookType.REPLACE)
    _registered = True
