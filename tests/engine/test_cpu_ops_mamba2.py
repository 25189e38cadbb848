"""hsnap's CPU platform ops for Mamba2 (SGLang ``MambaMixer2``: NemotronH, FalconH1, GraniteMoeHybrid) against
transformers' own pure-torch Mamba2 code (``models/nemotron_h/modeling_nemotron_h.py``: ``mamba2_chunk_scan``,
``mamba2_selective_state_update``, ``causal_conv1d_fn`` / ``causal_conv1d_update``), called as SGLang calls them
(``MambaMixer2.forward``: a packed varlen prefill with initial states written back into pool slots, a decode step
in place on the pool with padded rows).  No engine here.

Tolerances: the scan runs transformers' chunked SSD (the same float32 einsums, the same chunk size) one sequence at a
time, so it equals transformers' per-sequence scan bit for bit; per-sequence results are bitwise whatever the batch;
the decode step, the prefix states and chunked prefill against token-by-token decode (another summation order or
another algorithm) agree within 1e-5 on values of size ~1 (observed: 4e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

from hsnap_sglang.cpu import fill_in, ops, ops_mamba2  # noqa: E402

H, P, N, G, K, CHUNK = 8, 16, 32, 2, 4, 16  # the tiny Mamba2 geometry (hsnap_sglang.tiny): heads, head dim, state, groups, conv, chunk
TOL = 1e-5
SPANS = (37, 16, 5)  # a packed prefill: several chunks, exactly one chunk, less than one


def _inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = torch.randn(1, t, H, P, generator=g)
    dt = torch.randn(1, t, H, generator=g) * 0.5
    B = torch.randn(1, t, G, N, generator=g) * 0.3
    C = torch.randn(1, t, G, N, generator=g) * 0.3
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    init = torch.randn(len(lengths), H, P, N, generator=g) * 0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, dt, A, B, C, D, dt_bias, init, cu


def _sglang_scan(x, dt, A, B, C, D, dt_bias, init, cu, *, track_seq_idx=None, track_end_locs=None):
    """``MambaMixer2.forward``'s prefill call; returns (out, intermediate states, varlen states, track states)."""
    out = torch.full_like(x, float("nan"))
    states, varlen, track = ops_mamba2.mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size=CHUNK, D=D, z=None, dt_bias=dt_bias, seq_idx=None, chunk_indices=None,
        chunk_offsets=None, cu_seqlens=cu, initial_states=init, return_varlen_states=True, return_final_states=False,
        return_track_states=True, track_seq_idx=track_seq_idx, track_end_locs=track_end_locs, dt_softplus=True,
        dt_limit=(0.0, float("inf")), out=out, state_dtype=torch.float32,
    )
    return out, states, varlen, track


def _reference_scan(x, dt, A, B, C, D, dt_bias, init):
    """transformers' ``mamba2_chunk_scan`` on one sequence [1, T, ...] -> (y, final state)."""
    return nemotron_h.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=CHUNK, D=D, dt_bias=dt_bias, initial_states=init,
                                        dt_softplus=True, dt_limit=(0.0, float("inf")), return_final_states=True)


def test_chunk_scan_equals_transformers_per_sequence_with_initial_states():
    x, dt, A, B, C, D, dt_bias, init, cu = _inputs(SPANS)
    init[1] = 0  # a sequence without an initial state (SGLang passes zeros where has_initial_state is false)
    out, _, varlen, _ = _sglang_scan(x, dt, A, B, C, D, dt_bias, init, cu)
    assert varlen.shape == (len(SPANS), H, P, N) and varlen.dtype == torch.float32
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y, final = _reference_scan(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D, dt_bias, init[n : n + 1])
        assert torch.equal(out[:, s:e], y) and torch.equal(varlen[n], final[0]), n
    assert not torch.isnan(out).any()  # every position written (in place into `out`)


def test_chunk_scan_is_bitwise_per_sequence_whatever_the_batch():
    x, dt, A, B, C, D, dt_bias, init, cu = _inputs(SPANS, seed=1)
    out, _, varlen, _ = _sglang_scan(x, dt, A, B, C, D, dt_bias, init, cu)
    s, e = int(cu[1]), int(cu[2])
    alone_cu = torch.tensor([0, e - s], dtype=torch.int32)
    out1, _, varlen1, _ = _sglang_scan(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D, dt_bias, init[1:2], alone_cu)
    assert torch.equal(out[:, s:e], out1) and torch.equal(varlen[1], varlen1[0])


def test_chunk_scan_intermediate_and_track_states_are_prefix_states():
    """The Triton kernel's extra returns (used by SGLang's Mamba prefix tracking): the state at each multiple of the
    chunk size of the packed row, and the state of a sequence after a given position; each is the final state of
    transformers' scan over that prefix."""
    x, dt, A, B, C, D, dt_bias, init, cu = _inputs(SPANS, seed=2)
    track_seq, track_end = torch.tensor([0, 2]), torch.tensor([21, int(cu[2]) + 3])
    _, states, _, track = _sglang_scan(x, dt, A, B, C, D, dt_bias, init, cu, track_seq_idx=track_seq,
                                       track_end_locs=track_end)
    total = int(cu[-1])
    assert states.shape == (1, -(-total // CHUNK), H, P, N) and track.shape == (1, 2, H, P, N)

    def prefix_state(n, upto):
        s = int(cu[n])
        if upto == s:
            return init[n]
        return _reference_scan(x[:, s:upto], dt[:, s:upto], A, B[:, s:upto], C[:, s:upto], D, dt_bias, init[n : n + 1])[1][0]

    for c in range(states.shape[1]):
        pos = c * CHUNK
        n = int(torch.searchsorted(cu, torch.tensor(pos, dtype=cu.dtype), right=True)) - 1
        assert (states[0, c] - prefix_state(n, pos)).abs().max().item() <= TOL, c
    for i, (n, loc) in enumerate(zip(track_seq.tolist(), track_end.tolist())):
        assert (track[0, i] - prefix_state(n, loc)).abs().max().item() <= TOL, i


def _decode_inputs(batch, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, H, P, generator=g)
    dt = (torch.randn(batch, H, generator=g) * 0.5)[:, :, None].expand(-1, -1, P)
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    B, C = torch.randn(batch, G, N, generator=g) * 0.3, torch.randn(batch, G, N, generator=g) * 0.3
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5
    return x, dt, A, B, C, D, dt_bias


def _sglang_update(pool, x, dt, A, B, C, D, dt_bias, slots):
    """``MambaMixer2.forward``'s decode call (per-head parameters expanded over the head dim, as it does)."""
    out = torch.full_like(x, float("nan"))
    ops_mamba2.selective_state_update(
        pool, x, dt, A[:, None, None].expand(-1, P, N), B, C, D[:, None].expand(-1, P), z=None,
        dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True, state_batch_indices=slots, out=out)
    return out


def test_selective_state_update_matches_transformers_in_place_on_its_slots_only():
    x, dt, A, B, C, D, dt_bias = _decode_inputs(3, seed=3)
    pool = torch.randn(6, H, P, N, generator=torch.Generator().manual_seed(4))
    before = pool.clone()
    slots = torch.tensor([4, ops_mamba2.PAD_SLOT_ID, 1], dtype=torch.int32)
    out = _sglang_update(pool, x, dt, A, B, C, D, dt_bias, slots)
    for b, slot in ((0, 4), (2, 1)):
        state = before[slot : slot + 1].clone()
        ref = nemotron_h.mamba2_selective_state_update(
            state, x[b : b + 1], dt[b : b + 1], A[:, None, None].expand(-1, P, N), B[b : b + 1], C[b : b + 1],
            D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True)
        assert (out[b] - ref[0]).abs().max().item() <= TOL
        assert (pool[slot] - state[0]).abs().max().item() <= TOL
    # the padded row's slot and every slot not in the batch are untouched; the padded row's output is computed
    # from a zero state, as SGLang's Triton kernel does (so it is finite)
    for slot in (0, 2, 3, 5):
        assert torch.equal(pool[slot], before[slot])
    assert torch.isfinite(out[1]).all()
    # disable_state_update (speculative verify's mode) leaves the pool alone
    frozen = pool.clone()
    again = torch.empty_like(x)
    ops_mamba2.selective_state_update(frozen, x, dt, A[:, None, None].expand(-1, P, N), B, C, D[:, None].expand(-1, P),
                                      dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True,
                                      state_batch_indices=slots, out=again, disable_state_update=True)
    assert torch.equal(frozen, pool)


def test_prefill_of_n_equals_prefill_of_n_minus_1_then_one_decode_step():
    """Conv (bitwise: the same tap sum) then SSD (chunked scan against the recurrence: within TOL), through pool
    slots as SGLang runs them."""
    n, slot = 23, 2
    g = torch.Generator().manual_seed(5)
    conv_dim = H * P + 2 * G * N
    xbc = torch.randn(n, conv_dim, generator=g)
    w, bias = torch.randn(conv_dim, K, generator=g) * 0.5, torch.randn(conv_dim, generator=g) * 0.1
    x, dt, A, B, C, D, dt_bias, init, _ = _inputs((n,), seed=6)

    def conv_prefill(tokens, conv_pool):
        return ops.causal_conv1d_fn(xbc[:tokens].t(), w, bias, "silu", conv_pool, torch.tensor([False]),
                                    torch.tensor([slot]), torch.tensor([0, tokens], dtype=torch.int32)).t()

    conv_a, conv_b = torch.zeros(4, conv_dim, K - 1), torch.zeros(4, conv_dim, K - 1)
    full = conv_prefill(n, conv_a)
    head = conv_prefill(n - 1, conv_b)
    last = fill_in.causal_conv1d_update(xbc[n - 1 : n], conv_b, w, bias, "silu", conv_state_indices=torch.tensor([slot]))
    assert torch.equal(torch.cat([head, last]), full) and torch.equal(conv_a, conv_b)

    ssm_a, ssm_b = torch.zeros(4, H, P, N), torch.zeros(4, H, P, N)
    ssm_a[slot], ssm_b[slot] = init[0], init[0]
    one = torch.tensor([0, n], dtype=torch.int32)
    out_full, _, varlen, _ = _sglang_scan(x, dt, A, B, C, D, dt_bias, ssm_a[[slot]], one)
    ssm_a[slot] = varlen[0]
    _, _, varlen_head, _ = _sglang_scan(x[:, :-1], dt[:, :-1], A, B[:, :-1], C[:, :-1], D, dt_bias, ssm_b[[slot]],
                                        torch.tensor([0, n - 1], dtype=torch.int32))
    ssm_b[slot] = varlen_head[0]
    step = _sglang_update(ssm_b, x[0, -1:], dt[0, -1:, :, None].expand(-1, -1, P), A, B[0, -1:], C[0, -1:], D, dt_bias,
                          torch.tensor([slot], dtype=torch.int32))
    assert (step[0] - out_full[0, -1]).abs().max().item() <= TOL
    assert (ssm_a - ssm_b).abs().max().item() <= TOL


def test_causal_conv_names_have_sglang_signatures_and_refuse_what_they_lack():
    import inspect

    g = torch.Generator().manual_seed(7)
    dim, t = 12, 9
    x, w, b = torch.randn(dim, t, generator=g), torch.randn(dim, K, generator=g), torch.randn(dim, generator=g)
    states_a, states_b = torch.randn(3, dim, K - 1, generator=g), None
    states_b = states_a.clone()
    cu, idx, has = torch.tensor([0, 4, t], dtype=torch.int32), torch.tensor([2, 0]), torch.tensor([True, False])
    # mamba.py's call (keywords after the first three) gives the same through both names
    y1 = fill_in.causal_conv1d_fn(x, w, b, activation="silu", conv_states=states_a, has_initial_state=has,
                                  cache_indices=idx, query_start_loc=cu, seq_lens_cpu=[4, 5])
    y2 = fill_in.causal_conv1d_fn_triton(x, w, b, activation="silu", conv_states=states_b, has_initial_state=has,
                                         cache_indices=idx, query_start_loc=cu, seq_lens_cpu=[4, 5])
    assert torch.equal(y1, y2) and torch.equal(states_a, states_b)
    # against transformers' conv on sequence 1 (no initial state)
    ref = nemotron_h.causal_conv1d_fn(x[None, :, 4:], w, b, activation="silu")[0]
    assert (y1[:, 4:] - ref).abs().max().item() <= 1e-6
    assert list(inspect.signature(fill_in.causal_conv1d_fn_triton).parameters)[:6] == [
        "x", "weight", "bias", "conv_states", "query_start_loc", "seq_lens_cpu"]
    with pytest.raises(NotImplementedError, match="cache_seqlens"):
        fill_in.causal_conv1d_update(x[:, :1].t(), states_a, w, b, "silu", cache_seqlens=torch.tensor([1]))


_WIRED = r"""
import json
import torch
from sglang.srt.plugins import load_plugins
load_plugins()  # SGLang's own plug-in loading: hsnap's sglang.srt.plugins entry point registers the replacements
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
import sglang.srt.layers.attention.mamba.mamba as mixer
from sglang.kernels.ops.mamba.triton_ops import mamba_ssm
from hsnap_sglang.cpu import fill_in, ops_mamba2
names = ("causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_fn_triton", "causal_conv1d_update_triton")
print(json.dumps({
    "conv": {n: getattr(mixer, n, None) is fill_in.FILL_IN[mixer.__name__][n] for n in names},
    "scan": getattr(mixer.mamba_chunk_scan_combined, "__wrapped__", None) is not None
            and mixer.mamba_chunk_scan_combined.__name__ == "mamba_chunk_scan_combined",
    "scan_is_ours": mixer.mamba_chunk_scan_combined(
        torch.zeros(1, 2, 2, 1), torch.zeros(1, 2, 2), -torch.ones(2), torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1),
        4, cu_seqlens=torch.tensor([0, 2]), return_varlen_states=True).shape == (1, 2, 1, 1),
    "ssu_is_ours": mamba_ssm.selective_state_update.__wrapped__ is not None,
    "loader": type(mixer.__spec__.loader).__name__,
}))
"""


def test_platform_wires_the_mamba2_ops_into_sglang():
    """In an opted-in process: the conv names SGLang binds only for cuda/npu/xpu are bound in ``mamba.py`` (by the
    import finder), and the two Triton launchers are replaced (SGLang's HookRegistry, through its plug-in loading)."""
    env = dict(os.environ, HSNAP_SGLANG_CPU="1")
    out = subprocess.run([sys.executable, "-c", _WIRED], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(result["conv"].values()), result
    assert result["scan"] and result["scan_is_ours"] and result["ssu_is_ours"], result
    assert result["loader"] == "FillInLoader"
