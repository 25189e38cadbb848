"""hsnap's CPU platform ops for Qwen3.5 (SGLang ``models/qwen3_5.py`` binds them under ``if _is_cpu:``) against
transformers' own pure-torch Qwen3.5 code, and the ``torch.ops.sgl_kernel`` registration of every operator of the
platform (schemas as SGLang calls them, fake implementations, no aliasing: ``torch.library.opcheck``).  No engine here.

Bitwise where transformers computes the same float32 expression (the norms, the gate); the split is a copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from hsnap_sglang.cpu import ops  # noqa: E402

T, H, HKV, D = 5, 4, 2, 32  # tokens, attention heads, KV heads, head dim (the tiny model's full attention)
HK, HV, DK, DV, HIDDEN = 2, 4, 16, 32, 128  # the tiny model's GDN geometry


def _norm(dim, seed, dtype=torch.float32):
    norm = qwen3_5.Qwen3_5RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_gemma_rmsnorm_with_gate_matches_transformers_attention(dtype):
    g = torch.Generator().manual_seed(1)
    q_proj_out = torch.randn(T, H * 2 * D, generator=g).to(dtype)  # q and gate interleaved per head
    k_proj_out = torch.randn(T, HKV * D, generator=g).to(dtype)
    q_norm, k_norm = _norm(D, 2, dtype), _norm(D, 3, dtype)
    with torch.no_grad():
        # transformers' Qwen3_5Attention.forward, up to the norms
        ref_q, ref_gate = torch.chunk(q_proj_out.view(T, -1, D * 2), 2, dim=-1)
        ref_gate = ref_gate.reshape(T, -1)
        ref_q = q_norm(ref_q.reshape(T, H, D))
        ref_k = k_norm(k_proj_out.view(T, HKV, D))
    q, k, gate = ops.fused_qk_gemma_rmsnorm_with_gate(q_proj_out, k_proj_out, q_norm.weight.data, k_norm.weight.data,
                                                       1e-6, D, H)
    assert q.shape == (T * H, D) and k.shape == (T * HKV, D) and gate.shape == (T * H, D)
    assert all(t.is_contiguous() and t.dtype == dtype for t in (q, k, gate))
    assert torch.equal(q.view(T, H, D), ref_q) and torch.equal(k.view(T, HKV, D), ref_k)
    assert torch.equal(gate.view(T, -1), ref_gate)
    # the variant without a gate (SGLang's _apply_qk_norm): the same norms, shaped like its inputs
    q_plain = torch.chunk(q_proj_out.view(T, -1, D * 2), 2, dim=-1)[0].reshape(T, H * D)
    q2, k2 = ops.fused_qk_gemma_rmsnorm(q_plain, k_proj_out, q_norm.weight.data, k_norm.weight.data, 1e-6, D)
    assert q2.shape == q_plain.shape and k2.shape == k_proj_out.shape
    assert torch.equal(q2.view(T, H, D), ref_q) and torch.equal(k2.view(T, HKV, D), ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_3d", [False, True])
def test_sigmoid_mul_is_the_attention_output_gate_in_place(dtype, gate_3d):
    g = torch.Generator().manual_seed(4)
    attn = torch.randn(T, H * D, generator=g).to(dtype)
    storage = torch.randn(T, H, 2 * D, generator=g).to(dtype)
    gate = storage[..., D:] if gate_3d else storage[..., D:].reshape(T, H * D)  # a strided [T, H, D] view, or flat
    expected = (attn.float() * torch.sigmoid(gate.reshape(T, H * D).float())).to(dtype)
    x = attn.clone()
    ptr = x.data_ptr()
    ops.fused_sigmoid_mul_(x, gate)
    assert x.data_ptr() == ptr and torch.equal(x, expected)
    if dtype == torch.float32:  # transformers: attn_output * torch.sigmoid(gate)
        assert torch.equal(x, attn * torch.sigmoid(gate.reshape(T, -1)))


def test_qkvzba_split_gives_transformers_projections():
    gdn = qwen3_5.Qwen3_5GatedDeltaNet(
        qwen3_5.Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_key_heads=HK, linear_num_value_heads=HV,
                                  linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4),
        layer_idx=0,
    )
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # SGLang's merged projections: in_proj_qkvz = [in_proj_qkv; in_proj_z], in_proj_ba = [in_proj_b; in_proj_a]
        mixed_qkvz = x @ torch.cat([gdn.in_proj_qkv.weight, gdn.in_proj_z.weight]).t()
        mixed_ba = x @ torch.cat([gdn.in_proj_b.weight, gdn.in_proj_a.weight]).t()
        mixed_qkv, z, b, a = ops.fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, HK, HV, DK, DV)
        ref = [x @ gdn.in_proj_qkv.weight.t(), (x @ gdn.in_proj_z.weight.t()).reshape(T, HV, DV),
               x @ gdn.in_proj_b.weight.t(), x @ gdn.in_proj_a.weight.t()]
    for name, got, want in zip(("qkv", "z", "b", "a"), (mixed_qkv, z, b, a), ref):
        assert got.shape == want.shape and got.is_contiguous(), name
        # the same dot products from GEMMs of other shapes (other K blocking): float32 sums of 128 O(1) products agree
        # within a few 1e-7, not bit for bit (1e-6 failed once on a loaded 3-worker run); a wrong slice is off by O(1)
        assert torch.allclose(got, want, atol=1e-5, rtol=0), name
        assert got.data_ptr() not in (mixed_qkvz.data_ptr(), mixed_ba.data_ptr()), name
    assert torch.equal(mixed_qkv, mixed_qkvz[:, : 2 * HK * DK + HV * DV])  # a copy: bit for bit
    with pytest.raises(RuntimeError, match="expected mixed_qkvz"):
        ops.fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz[:, 1:], mixed_ba, HK, HV, DK, DV)


_REGISTERED = """
import json, torch
import sgl_kernel  # registers torch.ops.sgl_kernel.*
from hsnap_sglang.cpu import library as _library, ops
g = torch.Generator().manual_seed(0)
T, H, HKV, D = 3, 4, 2, 8
q_gate, k = torch.randn(T, H * 2 * D, generator=g, dtype=torch.bfloat16), torch.randn(T, HKV * D, generator=g, dtype=torch.bfloat16)
w1, w2 = torch.randn(D, generator=g, dtype=torch.bfloat16), torch.randn(D, generator=g, dtype=torch.bfloat16)
q = q_gate[:, : H * D].contiguous()
x, gate = torch.randn(T, H * D, generator=g, dtype=torch.bfloat16), torch.randn(T, H * D, generator=g, dtype=torch.bfloat16)
qkvz, ba = torch.randn(T, 2 * 2 * 8 + 2 * 4 * 8, generator=g), torch.randn(T, 2 * 4, generator=g)
seed, pos, cols = torch.tensor([1, 2], dtype=torch.uint64), torch.tensor([5, 6]), torch.arange(7)
# the GDN ops (Qwen3-Next and Qwen3.5): 3 decode requests, 2 key heads, 4 value heads, head dims 8
A_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
gq, gk = torch.randn(1, 3, 2, 8, generator=g, dtype=torch.bfloat16), torch.randn(1, 3, 2, 8, generator=g, dtype=torch.bfloat16)
gv = torch.randn(1, 3, 4, 8, generator=g, dtype=torch.bfloat16)
ga, gb = torch.randn(3, 4, generator=g, dtype=torch.bfloat16), torch.randn(3, 4, generator=g, dtype=torch.bfloat16)
state, slots, cu = torch.randn(5, 4, 8, 8, generator=g), torch.tensor([3, 0, 4]), torch.arange(4)
nx, nz, nw = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(8, generator=g)
calls = {
    "fused_gdn_gating_cpu": (A_log, ga, gb, dt_bias),
    "fused_sigmoid_gating_delta_rule_update_cpu": (A_log, dt_bias, gq, gk, gv, ga, gb, state, slots, cu, True),
    "fused_rmsnorm_gated_cpu": (nx, nw, nz, 1e-6),
    "fused_sigmoid_mul_cpu": (x.clone(), gate),
    "fused_qk_gemma_rmsnorm_cpu": (q, k, w1, w2, 1e-6, D),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (q_gate, k, w1, w2, 1e-6, D, H),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (qkvz, ba, 2, 4, 8, 8),
    "murmur_hash32_cpu": (seed, pos, cols),
}
checks = {}
for name, args in calls.items():
    op = getattr(torch.ops.sgl_kernel, name)
    torch.library.opcheck(op, args)  # schema, fake implementation, aliasing, autograd registration
    checks[name] = True
# as SGLang's qwen3_5.py calls them
y = x.clone()
torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(y, gate)
ref = x.clone()
ops.fused_sigmoid_mul_(ref, gate)
same = torch.equal(y, ref)
for name, fn in (("fused_qk_gemma_rmsnorm_cpu", ops.fused_qk_gemma_rmsnorm),
                 ("fused_qk_gemma_rmsnorm_with_gate_cpu", ops.fused_qk_gemma_rmsnorm_with_gate),
                 ("fused_qkvzba_split_reshape_cat_contiguous_cpu", ops.fused_qkvzba_split_reshape_cat_contiguous),
                 ("murmur_hash32_cpu", ops.murmur_hash32)):
    got, want = getattr(torch.ops.sgl_kernel, name)(*calls[name]), fn(*calls[name])
    got, want = (got, want) if isinstance(got, (tuple, list)) else ((got,), (want,))
    same = same and all(torch.equal(a, b) for a, b in zip(got, want))
# every registered operator is checked, its fake included
print(json.dumps({"opcheck": checks, "same": same, "registered": sorted(_library.OPS), "fakes": sorted(_library.FAKES)}))
"""


def test_platform_ops_are_registered_with_sglang_schemas_and_fakes():
    env = dict(os.environ, HSNAP_SGLANG_CPU="1")
    out = subprocess.run([sys.executable, "-c", _REGISTERED], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] is True and all(result["opcheck"].values())
    assert sorted(result["opcheck"]) == result["registered"] == result["fakes"]
