"""Reference math, in plain torch, for the kernels SGLang calls on its CPU platform for a GDN hybrid.

Every function here is the CPU counterpart of one SGLang kernel, with that kernel's signature, layouts and
in-place semantics (the call sites are named in each docstring); the arithmetic follows transformers' pure-torch
Qwen3-Next fallbacks (``torch_causal_conv1d_update``, ``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``Qwen3NextRMSNormGated``), in float32 whatever the storage dtype.

Determinism: every op computes **one sequence at a time** (a Python loop over the batch), so a request's numbers
never depend on which other requests share its batch, nor on where the batch puts it.  The conv uses the same
explicit tap sum for prefill and decode, so prefilling ``n`` tokens and prefilling ``n - 1`` then decoding one give
the same conv outputs and state bit for bit.

Layouts (SGLang 0.5.23 pools; one request, no slot axis):

* conv state ``[conv_dim, K - 1]``: the last ``K - 1`` inputs, oldest first;
* temporal (recurrent) state ``[H_v, Dv, Dk]`` (transformers keeps ``[H_v, Dk, Dv]``: the last two axes swapped);
* a negative cache index (``PAD_SLOT_ID = -1``) marks a padded row: it is neither read nor written.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "PAD_SLOT_ID",
    "assign_req_to_token_pool",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_gate_sigmoid_mul",
    "fused_gdn_gating",
    "fused_qk_gemma_rmsnorm",
    "fused_qk_gemma_rmsnorm_with_gate",
    "fused_qkvzba_split_reshape_cat_contiguous",
    "fused_sigmoid_gating_delta_rule_update",
    "fused_sigmoid_mul_",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gemma_rms_norm",
    "murmur_hash32",
    "rms_norm_gated",
]

PAD_SLOT_ID = -1
CHUNK_SIZE = 64  # transformers' torch_chunk_gated_delta_rule default (and FLA's chunk size)
_ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


def _activation(name: Optional[str]):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise NotImplementedError(f"activation {name!r} is not supported (expected one of {sorted(map(str, _ACTIVATIONS))})") from None


def _spans(query_start_loc: Optional[torch.Tensor], total: int) -> list[tuple[int, int]]:
    """[(start, end)] per sequence of a packed (varlen) batch (one sequence of ``total`` tokens without one)."""
    if query_start_loc is None:
        return [(0, total)]
    starts = [int(s) for s in query_start_loc.tolist()]
    return list(zip(starts[:-1], starts[1:]))


def _index_list(indices: Optional[torch.Tensor], n: int) -> list[int]:
    return list(range(n)) if indices is None else [int(i) for i in indices.reshape(-1)[:n].tolist()]


# ---------------------------------------------------------------------------------------------------------------
# causal depthwise conv1d (GDN / Mamba short conv)
# ---------------------------------------------------------------------------------------------------------------


def _conv_taps(window: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act) -> torch.Tensor:
    """window [dim, L + K - 1] (float32) -> act(bias + sum_j w[:, j] * window[:, t + j]) [dim, L] (float32)."""
    k = weight.shape[-1]
    length = window.shape[-1] - (k - 1)
    w = weight.float()
    acc = bias.float()[:, None].expand(-1, length).clone() if bias is not None else window.new_zeros(window.shape[0], length)
    for j in range(k):
        acc = acc + w[:, j : j + 1] * window[:, j : j + length]
    return act(acc)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    conv_states: torch.Tensor,
    has_initial_state: Optional[torch.Tensor],
    cache_indices: Optional[torch.Tensor],
    query_start_loc: Optional[torch.Tensor],
    seq_lens_cpu: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Prefill conv over a packed batch (SGLang ``GDNAttnBackend._convolve_prefill``; sgl_kernel.mamba.causal_conv1d_fn_cpu).

    ``x`` [dim, total_tokens] (a transposed view is fine), ``weight`` [dim, K], ``conv_states`` [slots, dim, K-1]
    updated in place at ``cache_indices`` with the last ``K - 1`` inputs of (initial state ++ sequence); the initial
    state is the slot's content where ``has_initial_state`` is true, zeros otherwise.  Returns [dim, total_tokens]
    in ``x.dtype``.
    """
    act = _activation(activation)
    k = weight.shape[-1]
    spans = _spans(query_start_loc, x.shape[-1])  # seq_lens_cpu repeats them; query_start_loc is the truth
    slots = _index_list(cache_indices, len(spans))
    has_init = [True] * len(spans) if has_initial_state is None else [bool(v) for v in has_initial_state.reshape(-1)[: len(spans)].tolist()]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for (start, end), slot, init in zip(spans, slots, has_init):
        if slot < 0:
            continue
        prev = conv_states[slot].float() if init else x.new_zeros((x.shape[0], k - 1), dtype=torch.float32)
        window = torch.cat([prev, x[:, start:end].float()], dim=-1)
        out[:, start:end] = _conv_taps(window, weight, bias, act).to(x.dtype)
        conv_states[slot] = window[:, window.shape[-1] - (k - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    retrieve_next_token: Optional[torch.Tensor] = None,
    retrieve_next_sibling: Optional[torch.Tensor] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode conv (SGLang ``GDNAttnBackend.forward_decode``; sgl_kernel.mamba.causal_conv1d_update_cpu).

    ``x`` [batch, dim] or [batch, dim, T]; row ``b`` uses and updates ``conv_state[conv_state_indices[b]]``
    ([dim, K-1], shifted left by T, the new inputs appended).  Returns the conv outputs, shaped like ``x``.
    The speculative-verify arguments (intermediate windows, draft trees) are not supported.
    """
    if intermediate_conv_window is not None or retrieve_parent_token is not None:
        raise NotImplementedError("causal_conv1d_update: speculative verify (intermediate_conv_window / draft trees) is not supported by hsnap's CPU platform")
    act = _activation(activation)
    k = weight.shape[-1]
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    out = torch.zeros(x3.shape, dtype=x.dtype, device=x.device)
    for b, slot in enumerate(_index_list(conv_state_indices, x3.shape[0])):
        if slot < 0:
            continue
        window = torch.cat([conv_state[slot].float(), x3[b].float()], dim=-1)
        out[b] = _conv_taps(window, weight, bias, act).to(x.dtype)
        conv_state[slot] = window[:, window.shape[-1] - (k - 1) :].to(conv_state.dtype)
    return out.squeeze(-1) if x.dim() == 2 else out


# ---------------------------------------------------------------------------------------------------------------
# gated delta rule (GDN linear attention)
# ---------------------------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _per_value_head(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, H, D] -> [H_v, T, D] float32: key head ``h`` serves value heads ``h * r .. h * r + r - 1`` (r = H_v / H)."""
    x = x.float()
    if x.shape[1] != num_v_heads:
        x = x.repeat_interleave(num_v_heads // x.shape[1], dim=1)
    return x.transpose(0, 1).contiguous()


def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, *, scale: float, use_qk_l2norm: bool, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked form (transformers' ``torch_chunk_gated_delta_rule``), float32.

    q, k [H_v, T, Dk]; v [H_v, T, Dv]; g (log decay), beta [H_v, T]; state [H_v, Dk, Dv].
    Returns (out [H_v, T, Dv], final state [H_v, Dk, Dv]).
    """
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    length = q.shape[1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    heads, n_chunks = q.shape[0], (length + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(heads, n_chunks, chunk_size, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, n_chunks, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()

    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular UT system (diagonal implied)
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)

    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_values)
    state = state.float()
    for i in range(n_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, n_chunks * chunk_size, -1)[:, :length], state


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, *, scale: float, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token (transformers' ``torch_recurrent_gated_delta_rule``), float32.

    Same shapes as :func:`gated_delta_rule_chunked`.  Per token: S *= exp(g); d = beta * (v - S^T k);
    S += k d^T; o = S^T q.
    """
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    state = state.float()
    out = torch.zeros_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        k_t = k[:, t].unsqueeze(-1)
        delta = (v[:, t] - (state * k_t).sum(dim=-2)) * beta[:, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(dim=-2)
    return out, state


def _run_delta_rule(rule, q, k, v, g, beta, state_pool, state_indices, spans, *, scale, use_qk_l2norm, write_state=True):
    """Apply ``rule`` per sequence of a packed batch; pool slots hold [H_v, Dv, Dk]; returns out [1, T, H_v, Dv]."""
    num_v_heads = v.shape[-2]
    out = torch.zeros((1, q.shape[1], num_v_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
    finals = []
    for (start, end), slot in zip(spans, _index_list(state_indices, len(spans))):
        if slot >= 0:
            state = state_pool[slot].float().transpose(-1, -2)
        else:
            state = torch.zeros((num_v_heads, k.shape[-1], v.shape[-1]), dtype=torch.float32, device=q.device)
        o, final = rule(
            _per_value_head(q[0, start:end], num_v_heads), _per_value_head(k[0, start:end], num_v_heads),
            _per_value_head(v[0, start:end], num_v_heads), g[start:end].float().t(), beta[start:end].float().t(),
            state, scale=scale, use_qk_l2norm=use_qk_l2norm,
        )
        out[0, start:end] = o.transpose(0, 1).to(q.dtype)
        final = final.transpose(-1, -2)
        finals.append(final)
        if write_state and slot >= 0:
            state_pool[slot] = final.to(state_pool.dtype)
    return out, finals


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
):
    """Extend (prefill) GDN (SGLang ``TritonGDNKernel.extend``; sgl_kernel.mamba.chunk_gated_delta_rule_cpu).

    q, k [1, T, H, Dk]; v [1, T, H_v, Dv]; g, beta [1, T, H_v] (float32); ``initial_state`` is the temporal pool
    [slots, H_v, Dv, Dk], read and written in place at ``initial_state_indices`` (one per sequence of
    ``cu_seqlens``).  Returns (out [1, T, H_v, Dv] in q's dtype, final states [N, H_v, Dv, Dk] float32, None).
    """
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule: head_first=True is not supported (SGLang passes False)")
    if q.shape[0] != 1:
        raise ValueError(f"chunk_gated_delta_rule: expected a packed batch [1, T, H, D], got q {tuple(q.shape)}")
    spans = _spans(cu_seqlens, q.shape[1])
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    out, finals = _run_delta_rule(
        gated_delta_rule_chunked, q, k, v, g[0], beta[0], initial_state, initial_state_indices, spans,
        scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel,
    )
    final = torch.stack(finals) if finals else initial_state.new_zeros((0, *initial_state.shape[1:]), dtype=torch.float32)
    return out, final, None


def fused_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                     beta: float = 1.0, threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN gates for a prefill (SGLang ``fused_gdn_gating``; torch.ops.sgl_kernel.fused_gdn_gating_cpu).

    a, b [T, H_v] -> g = -exp(A_log) * softplus(a + dt_bias) and sigmoid(b) (rounded through b's dtype, as the
    Triton kernel stores it), both [1, T, H_v] float32.
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=beta, threshold=threshold)
    b_sig = torch.sigmoid(b.float()).to(b.dtype).float()
    return g.unsqueeze(0), b_sig.unsqueeze(0)


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Decode GDN with the gates fused in (SGLang ``TritonGDNKernel.decode``;
    torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu).

    q, k [1, T, H, Dk]; v [1, T, H_v, Dv]; a, b [T, H_v]; the temporal pool [slots, H_v, Dv, Dk] is read and
    written in place at ``initial_state_indices``.  beta = sigmoid(b) in float32 (the decode kernel does not round
    it).  Returns out [1, T, H_v, Dv] in q's dtype.
    """
    if q.shape[0] != 1 and cu_seqlens is not None:
        raise ValueError(f"fused_sigmoid_gating_delta_rule_update: varlen input must be [1, T, H, D], got q {tuple(q.shape)}")
    if cu_seqlens is None:  # [B, T, ...] equal-length batch: one sequence per row
        bsz, length = q.shape[:2]
        cu_seqlens = torch.arange(0, (bsz + 1) * length, length)
        q, k, v = (t.reshape(1, bsz * length, *t.shape[2:]) for t in (q, k, v))
        a, b = (t.reshape(bsz * length, -1) for t in (a, b))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta, threshold=softplus_threshold)
    beta = torch.sigmoid(b.float())
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    out, _ = _run_delta_rule(
        gated_delta_rule_recurrent, q, k, v, g, beta, initial_state_source, initial_state_indices,
        _spans(cu_seqlens, q.shape[1]), scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# norms, gates, bookkeeping
# ---------------------------------------------------------------------------------------------------------------


def rms_norm_gated(x: torch.Tensor, weight: Optional[torch.Tensor], z: Optional[torch.Tensor], eps: float,
                   *, bias: Optional[torch.Tensor] = None, group_size: Optional[int] = None,
                   norm_before_gate: bool = True, is_rms_norm: bool = True, activation: Optional[str] = "swish") -> torch.Tensor:
    """Gated (RMS|Layer)Norm in float32, stored in x's dtype (SGLang's fla ``layernorm_fn`` / ``rms_norm_gated``;
    torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu is the RMS, norm-before-gate, swish case).

    norm_before_gate: y = norm(x) * w (+ b), then y * act(z); otherwise y = norm(x * act(z)) * w (+ b).  The
    normalisation runs over groups of ``group_size`` features (default: all of the last dimension).
    """
    act = _activation(activation)
    shape = x.shape
    xf = x.float().reshape(-1, shape[-1])
    zf = None if z is None else z.float().reshape(-1, shape[-1])
    if zf is not None and not norm_before_gate:
        xf = xf * act(zf)
    group = shape[-1] if group_size is None else group_size
    xg = xf.reshape(xf.shape[0], -1, group)
    if is_rms_norm:
        xhat = xg * torch.rsqrt((xg * xg).mean(dim=-1, keepdim=True) + eps)
    else:
        centered = xg - xg.mean(dim=-1, keepdim=True)
        xhat = centered * torch.rsqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)
    y = xhat.reshape(xf.shape)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if zf is not None and norm_before_gate:
        y = y * act(zf)
    return y.to(x.dtype).reshape(shape)


def fused_gate_sigmoid_mul(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor,
                           output: torch.Tensor, *, do_add: bool) -> None:
    """Shared-expert gate (SGLang ``elementwise._launch_fused_gate_sigmoid_mul``), in place into ``output``:
    output = sigmoid(h . w) * shared (+ output if do_add), per row, in float32."""
    gate = torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(dim=-1, keepdim=True))
    result = gate * shared_output.float()
    if do_add:
        result = result + output.float()
    output.copy_(result.to(output.dtype))


def assign_req_to_token_pool(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                             end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc (runs packed in order)
    (SGLang ``assign_req_to_token_pool_func``; sgl_kernel.assign_req_to_token_pool_cpu)."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(end) - int(start)
        if n > 0:
            req_to_token[int(row), int(start) : int(end)] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


# ---------------------------------------------------------------------------------------------------------------
# Qwen3.5 (dense GDN hybrid): output gate, Gemma-style q/k norms, the contiguous qkvz/ba split
# ---------------------------------------------------------------------------------------------------------------


def fused_sigmoid_mul_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """Attention output gate, in place: x = x * sigmoid(gate), in float32, stored in x's dtype (SGLang
    ``elementwise.fused_sigmoid_mul``; torch.ops.sgl_kernel.fused_sigmoid_mul_cpu as Qwen3.5 calls it).

    ``x`` [T, H * D] contiguous; ``gate`` [T, H * D] or a [T, H, D] strided view (last dimension contiguous).
    """
    if x.dim() != 2 or gate.dim() not in (2, 3) or gate.shape[0] != x.shape[0] or gate[0].numel() != x.shape[1]:
        raise RuntimeError(f"fused_sigmoid_mul: x [T, H*D] and gate [T, H*D] or [T, H, D] expected, got x "
                           f"{tuple(x.shape)} and gate {tuple(gate.shape)}")
    g = gate.reshape(x.shape).float()
    x.copy_((x.float() * torch.sigmoid(g)).to(x.dtype))


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm over the last dimension, float32 inside, x's dtype out: x * rsqrt(mean(x^2) + eps) *
    (1 + w) (transformers ``Qwen3_5RMSNorm``; sgl_kernel's ``NormMode::GemmaNorm``)."""
    xf = x.float()
    y = xf * torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def fused_qk_gemma_rmsnorm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma RMSNorm of q [T, H * D] and k [T, H_kv * D] (SGLang ``models.utils.fused_qk_gemma_rmsnorm``;
    torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu).  Returns new tensors shaped like q and k."""
    q_out = gemma_rms_norm(q.reshape(q.shape[0], -1, head_dim), q_weight, eps).reshape(q.shape)
    k_out = gemma_rms_norm(k.reshape(k.shape[0], -1, head_dim), k_weight, eps).reshape(k.shape)
    return q_out, k_out


def fused_qk_gemma_rmsnorm_with_gate(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                     k_weight: torch.Tensor, eps: float, head_dim: int,
                                     num_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and the output gate interleaved per head in ``q_gate`` [T, H * 2D] ([q_h0, gate_h0, q_h1, ...]):
    returns (norm(q) [T * H, D], norm(k) [T * H_kv, D], gate [T * H, D]), all contiguous (SGLang
    ``models.utils.fused_qk_gemma_rmsnorm_with_gate``; torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu)."""
    tokens = q_gate.shape[0]
    if q_gate.shape[-1] != num_head * head_dim * 2:
        raise RuntimeError(f"fused_qk_gemma_rmsnorm_with_gate: q_gate has {q_gate.shape[-1]} columns, expected "
                           f"num_head * head_dim * 2 = {num_head * head_dim * 2}")
    per_head = q_gate.reshape(tokens, num_head, 2 * head_dim)
    q_out = gemma_rms_norm(per_head[..., :head_dim], q_weight, eps).reshape(tokens * num_head, head_dim)
    gate = per_head[..., head_dim:].reshape(tokens * num_head, head_dim).clone(memory_format=torch.contiguous_format)
    k_out = gemma_rms_norm(k.reshape(tokens, -1, head_dim), k_weight, eps).reshape(-1, head_dim)
    return q_out, k_out, gate


def fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int,
                                              num_heads_v: int, head_qk: int, head_v: int):
    """Qwen3.5's GDN input projections split (SGLang ``triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat_contiguous``;
    torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu): ``mixed_qkvz`` [T, q | k | v | z] and
    ``mixed_ba`` [T, b | a] (every head of a kind together) -> mixed_qkv [T, q | k | v], z [T, H_v, Dv],
    b [T, H_v], a [T, H_v], contiguous copies.  Exact in every dtype (sgl_kernel's build takes bf16/fp16 only)."""
    k_dim, v_dim = num_heads_qk * head_qk, num_heads_v * head_v
    qkv_dim = 2 * k_dim + v_dim
    tokens = mixed_qkvz.shape[0]
    if tuple(mixed_qkvz.shape) != (tokens, qkv_dim + v_dim) or tuple(mixed_ba.shape) != (tokens, 2 * num_heads_v):
        raise RuntimeError(f"fused_qkvzba_split_reshape_cat_contiguous: expected mixed_qkvz {(tokens, qkv_dim + v_dim)} "
                           f"and mixed_ba {(tokens, 2 * num_heads_v)}, got {tuple(mixed_qkvz.shape)} and {tuple(mixed_ba.shape)}")
    def copy(t):  # a new tensor always (an op's output must not alias its input, even where a slice is contiguous)
        return t.clone(memory_format=torch.contiguous_format)

    mixed_qkv = copy(mixed_qkvz[:, :qkv_dim])
    z = copy(mixed_qkvz[:, qkv_dim:].reshape(tokens, num_heads_v, head_v))
    return mixed_qkv, z, copy(mixed_ba[:, :num_heads_v]), copy(mixed_ba[:, num_heads_v:])


# ---------------------------------------------------------------------------------------------------------------
# seeded sampling: MurmurHash3_x86_32 over (seed, position, column)
# ---------------------------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x int64 in [0, 2**32) and a 32-bit constant, with no int64 overflow: c is split into
    16-bit halves, each partial product stays below 2**48."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def _low32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of each element of an integer tensor, as int64 (C++ ``static_cast<uint32_t>``)."""
    if x.dtype == torch.uint64:
        x = x.view(torch.int64)  # same bits; the masks below keep only what the cast keeps
    return x.to(torch.int64) & _MASK32


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's seeded-sampling hash (``kernels/ops/sampling/murmur_hash.py``: the Triton ``murmur_hash32_kernel``;
    torch.ops.sgl_kernel.murmur_hash32_cpu): out[i, j] = MurmurHash3_x86_32, hash seed 0, of the 16 bytes
    (seed[i] low 32 bits, seed[i] high 32 bits, positions[i] low 32 bits, col_indices[j] low 32 bits), each
    little-endian.  seed uint64 [n], positions int64 or uint64 [n], col_indices int64 [m] -> uint32 [n, m].

    Every output depends only on its own (seed, position, column): a row's hashes do not depend on its batch.
    """
    if seed.dim() != 1 or positions.dim() != 1 or col_indices.dim() != 1:
        raise RuntimeError(f"murmur_hash32_cpu: 1-D seed, positions and col_indices expected, got "
                           f"{tuple(seed.shape)}, {tuple(positions.shape)}, {tuple(col_indices.shape)}")
    if seed.shape[0] != positions.shape[0]:
        raise RuntimeError("murmur_hash32_cpu: seed and positions must have the same length")
    if seed.dtype != torch.uint64:
        raise RuntimeError(f"murmur_hash32_cpu: seed must have dtype torch.uint64, got {seed.dtype}")
    if positions.dtype not in (torch.int64, torch.uint64):
        raise RuntimeError(f"murmur_hash32_cpu: positions must have dtype torch.int64 or torch.uint64, got {positions.dtype}")
    if col_indices.dtype != torch.int64:
        raise RuntimeError(f"murmur_hash32_cpu: col_indices must have dtype torch.int64, got {col_indices.dtype}")
    bits = seed.view(torch.int64)
    h = torch.zeros(seed.shape, dtype=torch.int64, device=seed.device)
    for block in (bits & _MASK32, (bits >> 32) & _MASK32, _low32(positions)):  # per row
        h = _murmur3_mix(h, block)
    h = _murmur3_mix(h[:, None], _low32(col_indices)[None, :])  # the column block, per (row, column)
    return _fmix32(h ^ 16).to(torch.uint32)
