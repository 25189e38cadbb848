"""hsnap's CPU platform ops (hsnap_sglang.cpu.ops) against transformers' own pure-torch Qwen3-Next code, and the
properties the server path relies on: SGLang's layouts and in-place semantics, per-sequence determinism (a
request's numbers do not depend on its batch), prefill-then-decode equal to one prefill.  No engine here.

Tolerances: float32 against transformers' float32 functions; the same algorithm (chunked, recurrent) agrees to
<= 2e-6 (rounding of a few hundred float32 multiply-adds); the chunked and recurrent forms against each other to
1e-4 (different summation orders over 64-token chunks).  Bitwise where the code path is the same.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from hsnap_sglang.cpu import ops  # noqa: E402

H, HV, DK, DV, K = 2, 4, 16, 32, 4  # the tiny model's GDN geometry (2 key heads serve 4 value heads)


def _gdn_inputs(length, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, H, DK, generator=g)
    k = torch.randn(1, length, H, DK, generator=g)
    v = torch.randn(1, length, HV, DV, generator=g)
    a = torch.randn(length, HV, generator=g)
    b = torch.randn(length, HV, generator=g)
    A_log = torch.randn(HV, generator=g) * 0.5
    dt_bias = torch.randn(HV, generator=g) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def _tf_inputs(q, k, v):
    # transformers repeats the key heads to the value heads before calling its delta-rule functions
    return q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2), v


def test_chunk_gated_delta_rule_matches_transformers_chunked_with_sglang_state_layout():
    starts = [0, 70, 71, 104]  # sequences of 70, 1 and 33 tokens: the first spans two 64-token chunks
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(104, seed=1)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    pool = torch.randn(6, HV, DV, DK, generator=torch.Generator().manual_seed(2))  # [slots, H_v, Dv, Dk]
    before = pool.clone()
    slots = torch.tensor([4, 1, 2])
    out, final, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor(starts), False, True, slots)
    for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        tq, tk, tv = _tf_inputs(q[:, s:e], k[:, s:e], v[:, s:e])
        ref_out, ref_state = qwen3_next.torch_chunk_gated_delta_rule(
            tq, tk, tv, g[:, s:e], beta[:, s:e], initial_state=before[slots[i]].transpose(-1, -2)[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert torch.allclose(out[:, s:e], ref_out, atol=2e-6, rtol=0), (out[:, s:e] - ref_out).abs().max()
        # SGLang's temporal layout is transformers' state with the last two axes swapped
        assert torch.allclose(pool[slots[i]], ref_state[0].transpose(-1, -2), atol=2e-6, rtol=0)
        assert torch.equal(final[i], pool[slots[i]])
    untouched = [j for j in range(6) if j not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_update_matches_transformers_recurrent_and_writes_only_its_slots():
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(3, seed=3)  # three one-token sequences (a decode batch)
    pool = torch.randn(5, HV, DV, DK, generator=torch.Generator().manual_seed(4))
    before = pool.clone()
    slots = torch.tensor([3, -1, 0])  # -1: a padded row, neither read nor written
    out = ops.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pool, slots, torch.arange(4), True, 1.0, 20.0
    )
    assert out.shape == (1, 3, HV, DV)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = b.sigmoid()
    for i in (0, 2):
        tq, tk, tv = _tf_inputs(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        ref_out, ref_state = qwen3_next.torch_recurrent_gated_delta_rule(
            tq, tk, tv, g[None, i : i + 1], beta[None, i : i + 1],
            initial_state=before[slots[i]].transpose(-1, -2)[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert torch.allclose(out[:, i : i + 1], ref_out, atol=2e-6, rtol=0)
        assert torch.allclose(pool[slots[i]], ref_state[0].transpose(-1, -2), atol=2e-6, rtol=0)
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


def test_chunked_prefill_agrees_with_token_by_token_decode():
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(90, seed=5)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    pool_a = torch.zeros(2, HV, DV, DK)
    out_a, _, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_a, torch.tensor([0, 90]), False, True, torch.tensor([1]))
    pool_b = torch.zeros(2, HV, DV, DK)
    out_b = ops.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pool_b, torch.tensor([1]), torch.tensor([0, 90]), True, 1.0, 20.0
    )
    assert torch.allclose(out_a, out_b, atol=1e-4, rtol=0)
    assert torch.allclose(pool_a, pool_b, atol=1e-4, rtol=0)


def test_gdn_ops_are_per_sequence_bitwise_whatever_the_batch():
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(60, seed=6)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    alone = torch.zeros(3, HV, DV, DK)
    out_alone, _, _ = ops.chunk_gated_delta_rule(
        q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], alone, torch.tensor([0, 40]), False, True, torch.tensor([2])
    )
    batched = torch.zeros(3, HV, DV, DK)
    out_batched, _, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, batched, torch.tensor([0, 20, 60]), False, True, torch.tensor([0, 2]))
    assert torch.equal(out_batched[:, 20:], out_alone)
    assert torch.equal(batched[2], alone[2])


def test_causal_conv1d_matches_transformers_and_keeps_the_last_k_minus_1_inputs():
    dim = 10
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(dim, K, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(dim, 9, generator=gen)  # two sequences: 6 tokens (fresh), 3 tokens (with a prior state)
    states = torch.randn(4, dim, K - 1, generator=gen)
    prior = states[1].clone()
    out = ops.causal_conv1d_fn(x, weight, bias, "silu", states, torch.tensor([False, True]), torch.tensor([3, 1]),
                               torch.tensor([0, 6, 9]), [6, 3])
    with torch.no_grad():  # transformers' pure-torch fallbacks (no causal_conv1d package here)
        ref_fresh = qwen3_next.causal_conv1d_fn(x[None, :, :6], weight, bias, "silu")[0]
        # its decode update with SGLang's K-1 state padded to transformers' K-wide state (column 0 unused)
        tf_state = torch.cat([torch.zeros(1, dim, 1), prior[None]], dim=-1)
        ref_cont = qwen3_next.causal_conv1d_update(x[None, :, 6:], tf_state, weight, bias, "silu")[0]
    assert torch.allclose(out[:, :6], ref_fresh, atol=1e-6, rtol=0)
    assert torch.allclose(out[:, 6:], ref_cont, atol=1e-6, rtol=0)
    assert torch.equal(states[3], x[:, 3:6])
    assert torch.equal(states[1], torch.cat([prior, x[:, 6:]], dim=-1)[:, -(K - 1):])
    assert torch.allclose(tf_state[0, :, 1:], states[1])  # transformers' state after its update, columns 1..K-1


def test_conv_prefill_then_decode_is_bitwise_one_prefill():
    dim = 6
    gen = torch.Generator().manual_seed(8)
    weight, bias, x = torch.randn(dim, K, generator=gen), torch.randn(dim, generator=gen), torch.randn(dim, 12, generator=gen)
    one = torch.zeros(2, dim, K - 1)
    out_one = ops.causal_conv1d_fn(x, weight, bias, "silu", one, torch.tensor([False]), torch.tensor([1]), torch.tensor([0, 12]))
    two = torch.zeros(2, dim, K - 1)
    out_pre = ops.causal_conv1d_fn(x[:, :11], weight, bias, "silu", two, torch.tensor([False]), torch.tensor([1]), torch.tensor([0, 11]))
    out_dec = ops.causal_conv1d_update(x[None, :, 11], two, weight, bias, "silu", torch.tensor([1]))
    assert torch.equal(torch.cat([out_pre, out_dec.t()], dim=-1), out_one)
    assert torch.equal(one, two)


def test_rms_norm_gated_matches_transformers():
    gen = torch.Generator().manual_seed(9)
    x, z = torch.randn(5, DV, generator=gen), torch.randn(5, DV, generator=gen)
    norm = qwen3_next.Qwen3NextRMSNormGated(DV, eps=1e-6)
    norm.weight.data = torch.randn(DV, generator=gen)
    with torch.no_grad():
        ref = norm(x, gate=z)
    assert torch.allclose(ops.rms_norm_gated(x, norm.weight, z, 1e-6), ref, atol=1e-6, rtol=0)


def test_shared_expert_gate_matches_transformers_formula():
    gen = torch.Generator().manual_seed(10)
    h, w, shared = torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen), torch.randn(4, 8, generator=gen)
    routed = torch.randn(4, 8, generator=gen)
    out = routed.clone()
    ops.fused_gate_sigmoid_mul(h, w, shared, out, do_add=True)
    ref = routed + torch.sigmoid(h @ w)[:, None] * shared  # Qwen3NextSparseMoeBlock: sigmoid(gate(h)) * shared
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)


def test_assign_req_to_token_pool_writes_each_run_into_its_row():
    table = torch.zeros(4, 10, dtype=torch.int32)
    ops.assign_req_to_token_pool(torch.tensor([2, 0]), table, torch.tensor([3, 0]), torch.tensor([5, 3]),
                                 torch.tensor([11, 12, 21, 22, 23]), 10)
    assert table[2].tolist() == [0, 0, 0, 11, 12, 0, 0, 0, 0, 0]
    assert table[0].tolist() == [21, 22, 23] + [0] * 7
    assert not table[[1, 3]].any()
