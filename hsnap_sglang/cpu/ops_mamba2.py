"""Reference math, in plain torch, for the Mamba2 (SSD) kernels SGLang calls on its CPU platform (``MambaMixer2`` in
``sglang/srt/layers/attention/mamba/mamba.py``: NemotronH, FalconH1, GraniteMoeHybrid).

* :func:`mamba_chunk_scan_combined`: the prefill (extend) scan over a packed varlen batch, with the signature,
  return values and in-place output of SGLang's Triton ``triton_ops.ssd_combined.mamba_chunk_scan_combined``;
* :func:`selective_state_update`: the decode step, in place on the temporal pool, with the signature of the Triton
  launcher ``triton_ops.mamba_ssm.selective_state_update``;
* the causal conv is :mod:`hsnap_sglang.cpu.ops`' (the same depthwise conv as GDN's, same conv-state layout).

The arithmetic follows transformers' pure-torch Mamba2 (``mamba2_chunk_scan`` and ``mamba2_selective_state_update``
in ``models/nemotron_h/modeling_nemotron_h.py``; FalconH1's and GraniteMoeHybrid's ``torch_forward`` are the same
SSD), in float32 whatever the storage dtype, **one sequence at a time** (a request's numbers never depend on its
batch).  Layouts (SGLang 0.5.23's ``MambaPool``, one slot): temporal state ``[H, P, N]`` (heads, head dim, state
size, as transformers keeps it); a negative slot index (``PAD_SLOT_ID = -1``) marks a padded row, whose slot is
neither read nor written.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["PAD_SLOT_ID", "mamba_chunk_scan_combined", "selective_state_update", "ssd_chunked", "ssd_state_after"]

PAD_SLOT_ID = -1


def _discretized_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], softplus: bool, dt_limit) -> torch.Tensor:
    """dt (+ bias), softplus (threshold 20, as the Triton kernels), clamped to ``dt_limit``; float32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N] float32: group ``g`` serves heads ``g * H/G .. (g + 1) * H/G - 1``."""
    return t.float().repeat_interleave(num_heads // t.shape[1], dim=1)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = sum x[j+1 .. i] for j <= i, -inf above the diagonal (transformers'
    ``segment_sum``)."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    x = x.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0), -torch.inf)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                state: Optional[torch.Tensor], chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, the chunked SSD (transformers' ``mamba2_chunk_scan``), float32, without D and z.

    x [T, H, P]; dt [T, H] (discretized); A [H]; B, C [T, H, N] (per head); state [H, P, N] or None (zeros).
    Returns (y [T, H, P], chunk start states [K + 1, H, P, N]): row k is the state after the first ``k * chunk_size``
    tokens, the last row the state after all T tokens (K = ceil(T / chunk_size)).
    """
    length, heads, head_dim = x.shape
    pad = (chunk_size - length % chunk_size) % chunk_size
    n_chunks = (length + pad) // chunk_size

    def chunks(t):
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(n_chunks, chunk_size, *t.shape[1:])

    xs = chunks(x * dt[..., None])  # [c, l, h, p]
    dA = chunks(A[None, :] * dt).permute(2, 0, 1)  # [h, c, l]
    Bc, Cc = chunks(B), chunks(C)  # [c, l, h, n]
    cum = torch.cumsum(dA, dim=-1)

    # 1. intra-chunk (diagonal blocks)
    L = torch.exp(_segment_sum(dA))  # [h, c, l, s]
    G = torch.einsum("clhn,cshn->clsh", Cc, Bc)
    y_diag = torch.einsum("clsh,cshp->clhp", G * L.permute(1, 2, 3, 0), xs)
    # 2. each chunk's own state contribution
    decay_states = torch.exp(cum[:, :, -1:] - cum)  # [h, c, l]
    chunk_states = torch.einsum("clhn,clhp->chpn", Bc * decay_states.permute(1, 2, 0)[..., None], xs)
    # 3. inter-chunk recurrence: the state at each chunk start
    first = state.float()[None] if state is not None else torch.zeros_like(chunk_states[:1])
    chunk_states = torch.cat([first, chunk_states], dim=0)  # [c + 1, h, p, n]
    decay_chunk = torch.exp(_segment_sum(F.pad(cum[:, :, -1], (1, 0))))  # [h, c + 1, c + 1]
    starts = torch.einsum("hzc,chpn->zhpn", decay_chunk, chunk_states)  # [c + 1, h, p, n]
    # 4. the chunk start states seen by each position
    y_off = torch.einsum("clhn,chpn->clhp", Cc, starts[:-1]) * torch.exp(cum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(n_chunks * chunk_size, heads, head_dim)[:length]
    return y, starts


def ssd_state_after(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor) -> torch.Tensor:
    """The state after feeding tokens ``x`` [T, H, P] (dt [T, H] discretized, B [T, H, N] per head) to ``state``
    [H, P, N]: exp(sum dA) * state + sum_t exp(sum dA[t+1:]) dt_t x_t B_t^T, float32."""
    if x.shape[0] == 0:
        return state.float()
    dA = A[None, :] * dt  # [t, h]
    cum = torch.cumsum(dA, dim=0)
    weight = torch.exp(cum[-1:] - cum) * dt  # [t, h]
    return state.float() * torch.exp(cum[-1])[:, None, None] + torch.einsum("th,thp,thn->hpn", weight, x.float(), B)


def _seq_spans(row_len: int, cu_seqlens: Optional[torch.Tensor], seq_idx_row: Optional[torch.Tensor]) -> list[tuple[int, int]]:
    if cu_seqlens is not None:
        bounds = [int(v) for v in cu_seqlens.tolist()]
        return list(zip(bounds[:-1], bounds[1:]))
    if seq_idx_row is None or row_len == 0:
        return [(0, row_len)]
    ids = seq_idx_row.tolist()
    cuts = [0] + [t for t in range(1, row_len) if ids[t] != ids[t - 1]] + [row_len]
    return list(zip(cuts[:-1], cuts[1:]))


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, chunk_indices=None,
    chunk_offsets=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), out=None,
    return_final_states=False, return_varlen_states=False, return_intermediate_states=False, state_dtype=None,
    return_track_states=False, track_seq_idx=None, track_end_locs=None,
):
    """The Mamba2 prefill scan (SGLang ``MambaMixer2.forward``, ``triton_ops.mamba_chunk_scan_combined``).

    x [batch, T, H, P]; dt [batch, T, H]; A [H]; B, C [batch, T, G, N]; D [H] or [H, P]; z like x (the output is
    then gated by silu(z)); initial_states [sequences, H, P, N] (one per sequence of ``cu_seqlens``, else per batch
    row) or None.  With ``cu_seqlens`` (only read when ``return_varlen_states``) the batch is one packed row of
    sequences; without it each row is one sequence (or several, cut where ``seq_idx`` changes: only the first gets
    the row's initial state).  The output goes into ``out`` when given (in place), and the return values are
    Triton's: ``varlen_states`` [sequences, H, P, N] (each sequence's final state), ``final_states`` [batch, H, P, N]
    (each row's last sequence), the intermediate ``states`` [batch, ceil(T / chunk_size), H, P, N] (the state at
    each position ``c * chunk_size`` of the row, of the sequence holding that position, after its tokens before
    it) and ``track_states`` [1, len(track_end_locs), H, P, N] (sequence ``track_seq_idx[i]`` after its tokens
    before ``track_end_locs[i]``).  ``chunk_indices`` / ``chunk_offsets`` (the Triton kernels' pseudo-chunks)
    are not needed: every sequence is scanned on its own.
    """
    if not return_varlen_states:
        cu_seqlens = None
    elif cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    batch, seqlen, heads, head_dim = x.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError("passing cu_seqlens to get the varlen states is only supported if batch dimension is 1")
    state_dtype = state_dtype if state_dtype is not None else C.dtype
    A32 = A.float()
    D32 = None if D is None else (D.float()[:, None] if D.dim() == 1 else D.float())
    n_chunks = -(-seqlen // chunk_size)
    out_x = out if out is not None else torch.empty_like(x)
    states = torch.zeros((batch, n_chunks, heads, head_dim, B.shape[-1]), dtype=state_dtype, device=x.device)
    final_states = torch.zeros((batch, heads, head_dim, B.shape[-1]), dtype=state_dtype, device=x.device)
    varlen, per_seq = [], []  # per_seq: (start, end, xs, dts, Bs, chunk start states) for tracking
    for b in range(batch):
        spans = _seq_spans(seqlen, cu_seqlens, None if seq_idx is None else seq_idx[b])
        for n, (start, end) in enumerate(spans):
            init = None
            if initial_states is not None:
                if cu_seqlens is not None:
                    init = initial_states[n]
                elif n == 0:
                    init = initial_states[b]
            xs = x[b, start:end].float()
            dts = _discretized_dt(dt[b, start:end], dt_bias, dt_softplus, dt_limit)
            Bs, Cs = _per_head(B[b, start:end], heads), _per_head(C[b, start:end], heads)
            y, starts = ssd_chunked(xs, dts, A32, Bs, Cs, init, chunk_size)
            if D32 is not None:
                y = y + xs * D32
            if z is not None:
                y = y * F.silu(z[b, start:end].float())
            out_x[b, start:end] = y.to(out_x.dtype)
            varlen.append(starts[-1])
            final_states[b] = starts[-1].to(state_dtype)
            per_seq.append((b, start, end, xs, dts, Bs, starts))
    for b, start, end, xs, dts, Bs, starts in per_seq:
        for c in range(-(-start // chunk_size), -(-end // chunk_size)):
            pos = c * chunk_size - start  # this sequence's tokens before the grid point
            k = pos // chunk_size
            states[b, c] = ssd_state_after(starts[k], xs[k * chunk_size : pos], dts[k * chunk_size : pos], A32,
                                           Bs[k * chunk_size : pos]).to(state_dtype)
    varlen_states = torch.stack(varlen).to(state_dtype) if cu_seqlens is not None else None
    track_states = None
    if return_track_states:
        if cu_seqlens is None:
            raise ValueError("return_track_states requires return_varlen_states (cu_seqlens mode)")
        if track_seq_idx is not None and track_end_locs is not None and track_end_locs.numel() > 0:
            tracked = []
            for n, loc in zip(track_seq_idx.tolist(), track_end_locs.tolist()):
                _, start, _, xs, dts, Bs, starts = per_seq[int(n)]
                pos = int(loc) - start
                k = pos // chunk_size
                tracked.append(ssd_state_after(starts[k], xs[k * chunk_size : pos], dts[k * chunk_size : pos], A32,
                                               Bs[k * chunk_size : pos]))
            track_states = torch.stack(tracked)[None].to(state_dtype)
        return states, varlen_states, track_states
    if return_intermediate_states:
        if varlen_states is not None:
            return (states, final_states, varlen_states) if return_final_states else (states, varlen_states)
        return (states, final_states) if return_final_states else states
    if varlen_states is None:
        return final_states if return_final_states else None
    return (final_states, varlen_states) if return_final_states else varlen_states


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None,
    pad_slot_id=PAD_SLOT_ID, out=None, disable_state_update=False, intermediate_states_buffer=None, cache_steps=None,
    retrieve_parent_token=None, intermediate_state_indices=None, enable_stochastic_rounding=False,
    cache_philox_rounds=0,
):
    """The Mamba2 decode step (SGLang ``MambaMixer2.forward``, ``triton_ops.mamba_ssm.selective_state_update``).

    state [slots, H, P, N] (or [slots, P, N]), read and written in place at ``state_batch_indices`` (row b uses slot
    ``state_batch_indices[b]``, else slot b); x [batch, H, P] or [batch, T, H, P] (T tokens in order); dt like x;
    A, dt_bias, D [H, P] per head (A [H, P, N]); B, C [batch, G, N] or [batch, T, G, N]; z like x or None; ``out``
    like x, written in place.  Per token, float32: dt' = softplus(dt + bias); S = S * exp(dt' A) + dt' x B^T;
    y = S C + D x (then * silu(z)).  A padded row (slot ``pad_slot_id``) starts from a zero state and its slot is not
    written, as in the Triton kernel; ``disable_state_update`` leaves every slot unwritten.  Speculative verify
    (intermediate state buffers, draft trees) and stochastic rounding are not supported.
    """
    if intermediate_states_buffer is not None or retrieve_parent_token is not None:
        raise NotImplementedError("selective_state_update: speculative verify (intermediate states / draft trees) is not supported by hsnap's CPU platform")
    if enable_stochastic_rounding:
        raise NotImplementedError("selective_state_update: stochastic rounding is not supported by hsnap's CPU platform")
    if out is None:
        raise ValueError("selective_state_update: out (the preallocated output) is required, as in SGLang's kernel")
    def tokens(t):  # the Triton launcher's normalisation: [batch, dim] / [batch, H, P] -> [batch, T, H, P]
        if t.dim() == 2:
            t = t.unsqueeze(1)
        return t.unsqueeze(1) if t.dim() == 3 else t

    pool = state.unsqueeze(1) if state.dim() == 3 else state
    x4, dt4, out4, B4, C4 = tokens(x), tokens(dt), tokens(out), tokens(B), tokens(C)
    z4 = None if z is None else tokens(z)
    A3 = (A.unsqueeze(0) if A.dim() == 2 else A).float()
    D2 = None if D is None else (D.unsqueeze(0) if D.dim() == 1 else D).float()
    bias2 = None if dt_bias is None else (dt_bias.unsqueeze(0) if dt_bias.dim() == 1 else dt_bias).float()
    batch, steps, heads, _ = x4.shape
    slots = list(range(batch)) if state_batch_indices is None else [int(i) for i in state_batch_indices.tolist()]
    for b, slot in enumerate(slots):
        padded = state_batch_indices is not None and slot == pad_slot_id
        s = torch.zeros(pool.shape[1:], dtype=torch.float32, device=pool.device) if padded else pool[slot].float()
        for t in range(steps):
            xt = x4[b, t].float()
            d = dt4[b, t].float() + (bias2 if bias2 is not None else 0.0)
            if dt_softplus:
                d = F.softplus(d)
            Bt, Ct = _per_head(B4[b, t][None], heads)[0], _per_head(C4[b, t][None], heads)[0]  # [H, N]
            s = s * torch.exp(d[..., None] * A3) + (d[..., None] * Bt[:, None, :]) * xt[..., None]
            y = (s * Ct[:, None, :]).sum(-1)
            if D2 is not None:
                y = y + xt * D2
            if z4 is not None:
                y = y * F.silu(z4[b, t].float())
            out4[b, t] = y.to(out4.dtype)
        if not padded and not disable_state_update:
            pool[slot] = s.to(pool.dtype)
