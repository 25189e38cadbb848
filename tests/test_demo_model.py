"""Exact continuation of the tiny hybrid demo model through real SGLang pools (CPU, in-process).

A greedy / sampled run of N tokens is compared with a run paused after k tokens whose state went
cache -> pool layout -> pools A -> pools B (other capacity, page size, slots; other requests present) -> cache
and was then continued.  Token ids must be equal and logprobs bit-identical (max |diff| == 0.0), and the resumed
part must forward exactly N - k positions (nothing recomputed).  Negative controls show the check can fail.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hsnap_io._sglang_env import sglang_available  # noqa: E402
from hsnap_io.demo.model import (  # noqa: E402
    Decoder,
    alloc_request,
    build_model,
    build_pools,
    cache_to_pool_tensors,
    free_request,
    generator_from_state,
    generator_state_bytes,
    pool_tensors_to_cache,
    read_from_pools,
    request_slots,
    write_to_pools,
)

needs_sglang = pytest.mark.skipif(not sglang_available(), reason="sglang is not installed")

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 128]
N = 24
K = 6
# Thread count is part of the numerics: CPU matmul/reduction kernels split work by thread count, so a different
# count changes the summation order and the rounding (2 -> 1 threads gives ~5e-7 logprob differences, see
# shared/research/continuation-on-cpu.md).  The reference and every resumed run must use the same count.
NUM_THREADS = 1


@pytest.fixture(scope="module", autouse=True)
def _fixed_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def demo(request):
    model, geom = build_model(seed=0, arch=request.param)
    dec = Decoder(model, geom)
    yield model, geom, dec
    dec.close()


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _through_pools(tensors, geom, seq_len):
    """pools A (page 1) -> read -> pools B (page 4, other capacity, other requests) -> read back via req_to_token."""
    a = build_pools(geom, size=64, mamba_size=4)
    other_a = alloc_request(a, 5)  # another request occupies slots first
    slots_a = alloc_request(a, seq_len)
    write_to_pools(
        a.req_to_token_pool, a.allocator, slots_a.token_indices, slots_a.mamba_idx, tensors,
        req_pool_idx=slots_a.req_pool_idx,
    )
    from_a = read_from_pools(a.req_to_token_pool, a.allocator, slots_a.token_indices, slots_a.mamba_idx, geom)

    b = build_pools(geom, size=128, mamba_size=6, page_size=4)
    others = [alloc_request(b, n) for n in (7, 3)]
    # fill the other requests' slots with noise: a wrong slot or layer index would pick it up
    gen = torch.Generator().manual_seed(99)
    for o in others:
        noise = {
            name: {lid: torch.randn(t.shape if name in ("conv", "temporal") else (len(o.token_indices), *t.shape[1:]),
                                    generator=gen)
                   for lid, t in d.items()}
            for name, d in from_a.items()
        }
        write_to_pools(b.req_to_token_pool, b.allocator, o.token_indices, o.mamba_idx, noise,
                       req_pool_idx=o.req_pool_idx)
    slots_b = alloc_request(b, seq_len)
    assert slots_b.mamba_idx != slots_a.mamba_idx or slots_b.req_pool_idx != slots_a.req_pool_idx
    assert not torch.equal(slots_b.token_indices, slots_a.token_indices)
    write_to_pools(
        b.req_to_token_pool, b.allocator, slots_b.token_indices, slots_b.mamba_idx, from_a,
        req_pool_idx=slots_b.req_pool_idx,
    )
    # read back through SGLang's own indirection: req_to_token row and req -> mamba mapping
    tok, mid = request_slots(b.req_to_token_pool, slots_b.req_pool_idx, seq_len)
    assert torch.equal(tok, slots_b.token_indices) and mid == slots_b.mamba_idx
    back = read_from_pools(b.req_to_token_pool, b.allocator, tok, mid)  # layer ids from the pools' own maps

    # SGLang's per-layer accessor (what its attention backend uses) sees the same state
    for lid in geom.linear_layer_ids:
        view = b.req_to_token_pool.mamba2_layer_cache(lid)
        assert torch.equal(view.conv[0][mid], tensors["conv"][lid])
        assert torch.equal(view.temporal[mid], tensors["temporal"][lid])
    for lid in geom.full_attention_layer_ids:
        kbuf, vbuf = b.kv_pool.get_kv_buffer(lid)
        assert torch.equal(kbuf[tok], tensors["k"][lid]) and torch.equal(vbuf[tok], tensors["v"][lid])

    free_request(b, slots_b)
    free_request(a, other_a)
    return back


def _pause(dec, k, **kw):
    part = dec.generate(PROMPT, k, **kw)
    assert part.seq_len == len(PROMPT) + k - 1  # last output pending
    assert part.positions == len(PROMPT) + k - 1
    return part


# ---------------------------------------------------------------------------------------------------------------------


def test_layout_mapping(demo):
    model, geom, dec = demo
    part = _pause(dec, K)
    cache = part.cache
    t = cache_to_pool_tensors(cache, geom)
    s = part.seq_len
    for lid in geom.full_attention_layer_ids:
        layer = cache.layers[lid]
        assert t["k"][lid].shape == (s, geom.num_kv_heads, geom.head_dim)
        assert torch.equal(t["k"][lid], layer.keys[0].permute(1, 0, 2))
        assert torch.equal(t["v"][lid], layer.values[0].permute(1, 0, 2))
        assert layer.keys.dtype == geom.kv_dtype
    hv, dv, dk = geom.temporal_shape
    assert dv != dk  # the axes are distinguishable in this geometry
    for lid in geom.linear_layer_ids:
        layer = cache.layers[lid]
        conv, rec = layer.conv_states[0], layer.recurrent_states[0]
        assert conv.shape == (1, geom.conv_dim, geom.conv_kernel) and conv.dtype == geom.conv_dtype
        assert rec.shape == (1, hv, dk, dv) and rec.dtype == geom.temporal_dtype
        assert t["conv"][lid].shape == geom.conv_shape == (geom.conv_dim, geom.conv_kernel - 1)
        assert torch.equal(t["conv"][lid], conv[0, :, 1:])
        assert t["temporal"][lid].shape == geom.temporal_shape
        assert torch.equal(t["temporal"][lid], rec[0].transpose(-1, -2))

    rebuilt = pool_tensors_to_cache(t, geom, s)
    assert rebuilt.get_seq_length() == s
    assert all(rebuilt.layers[lid].has_previous_state[0] for lid in geom.linear_layer_ids)
    t2 = cache_to_pool_tensors(rebuilt, geom)
    for name in t:
        for lid in t[name]:
            assert torch.equal(t[name][lid], t2[name][lid]), (name, lid)

    # a transposed (wrong-layout) recurrent state is refused, not silently accepted
    bad = {name: dict(d) for name, d in t.items()}
    lid = geom.linear_layer_ids[0]
    bad["temporal"][lid] = t["temporal"][lid].transpose(-1, -2).contiguous()
    with pytest.raises(ValueError):
        pool_tensors_to_cache(bad, geom, s)


@needs_sglang
def test_greedy_resume_through_pools_is_exact(demo):
    model, geom, dec = demo
    full = dec.generate(PROMPT, N)
    assert full.positions == len(PROMPT) + N - 1
    assert full.forward_calls == N

    part = _pause(dec, K)
    assert part.token_ids == full.token_ids[:K]

    tensors = cache_to_pool_tensors(part.cache, geom)
    back = _through_pools(tensors, geom, part.seq_len)
    cache = pool_tensors_to_cache(back, geom, part.seq_len)
    res = dec.generate(PROMPT, N, cache=cache, start_outputs=part.token_ids, start_logprobs=part.logprobs)

    assert res.token_ids == full.token_ids
    assert _max_diff(res.logprobs, full.logprobs) == 0.0
    # every resumed step consumes exactly one new position: nothing of the history is recomputed
    assert res.positions == N - K
    assert res.forward_calls == N - K
    assert res.seq_len == full.seq_len


@needs_sglang
def test_negative_controls_change_logprobs(demo):
    model, geom, dec = demo
    full = dec.generate(PROMPT, N)
    part = _pause(dec, K)
    good = _through_pools(cache_to_pool_tensors(part.cache, geom), geom, part.seq_len)

    def resume(tensors):
        cache = pool_tensors_to_cache(tensors, geom, part.seq_len)
        return dec.generate(PROMPT, N, cache=cache, start_outputs=part.token_ids, start_logprobs=part.logprobs)

    def corrupt(name, fn):
        t = {n: {lid: x.clone() for lid, x in d.items()} for n, d in good.items()}
        for lid in t[name]:
            t[name][lid] = fn(t[name][lid])
        return t

    # zeroed recurrent (temporal) state: tokens may survive, logprobs must not
    zeroed = resume(corrupt("temporal", torch.zeros_like))
    assert _max_diff(zeroed.logprobs, full.logprobs) > 0.0
    # conv window shifted by one token
    shifted = resume(corrupt("conv", lambda c: torch.roll(c, 1, dims=-1)))
    assert _max_diff(shifted.logprobs, full.logprobs) > 0.0
    # a Dk/Dv-transposed state does not even fit the pool: writing it is refused
    pools = build_pools(geom, size=32, mamba_size=2)
    slots = alloc_request(pools, part.seq_len)
    bad = corrupt("temporal", lambda x: x.transpose(-1, -2).contiguous())
    with pytest.raises(ValueError):
        write_to_pools(pools.req_to_token_pool, pools.allocator, slots.token_indices, slots.mamba_idx, bad)
    # and a dtype mismatch (e.g. a bf16 pool) is refused rather than rounded silently
    with pytest.raises(TypeError):
        write_to_pools(
            pools.req_to_token_pool, pools.allocator, slots.token_indices, slots.mamba_idx,
            {"conv": {lid: x.to(torch.bfloat16) for lid, x in good["conv"].items()}},
        )


@needs_sglang
def test_sampled_resume_with_restored_generator_is_exact(demo):
    model, geom, dec = demo
    kw = dict(temperature=0.8, seed=1234)
    full = dec.generate(PROMPT, N, **kw)
    part = _pause(dec, K, **kw)
    assert part.token_ids == full.token_ids[:K]
    assert isinstance(part.generator_state, bytes) and part.generator_state

    state = bytes(part.generator_state)  # what a snapshot would carry
    assert generator_state_bytes(generator_from_state(state)) == state
    back = _through_pools(cache_to_pool_tensors(part.cache, geom), geom, part.seq_len)
    res = dec.generate(
        PROMPT, N, temperature=0.8, generator_state=state,
        cache=pool_tensors_to_cache(back, geom, part.seq_len),
        start_outputs=part.token_ids, start_logprobs=part.logprobs,
    )
    assert res.token_ids == full.token_ids
    assert _max_diff(res.logprobs, full.logprobs) == 0.0
    assert res.positions == N - K
    assert res.generator_state == full.generator_state

    # control: re-seeding instead of restoring the generator state diverges
    reseeded = dec.generate(
        PROMPT, N, temperature=0.8, seed=1234,
        cache=pool_tensors_to_cache(back, geom, part.seq_len),
        start_outputs=part.token_ids, start_logprobs=part.logprobs,
    )
    assert reseeded.token_ids != full.token_ids
    assert not any(math.isnan(x) for x in res.logprobs)


def test_weights_digest_identifies_the_weights():
    from hsnap_io.demo.model import weights_digest

    a, _ = build_model(seed=0)
    b, _ = build_model(seed=0)
    c, _ = build_model(seed=1)
    assert weights_digest(a) == weights_digest(b)
    assert weights_digest(a) != weights_digest(c)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1.0  # one element
    assert weights_digest(a) != weights_digest(b)


def test_fed_positions_are_logged(demo):
    model, geom, dec = demo
    before = len(dec.fed_ranges)
    part = _pause(dec, K)
    assert dec.fed_ranges[before:] == [(0, len(PROMPT))] + [(len(PROMPT) + i, 1) for i in range(K - 1)]
    cache = pool_tensors_to_cache(cache_to_pool_tensors(part.cache, geom), geom, part.seq_len)
    mark = len(dec.fed_ranges)
    res = dec.generate(PROMPT, N, cache=cache, start_outputs=part.token_ids, start_logprobs=part.logprobs)
    fed = dec.fed_ranges[mark:]
    assert fed[0] == (part.seq_len, 1) and len(fed) == N - K == res.forward_calls
    # nothing below the restored state position went through forward again
    assert sum(max(0, min(s + n, part.seq_len) - s) for s, n in fed) == 0
    assert dec.positions_below(part.seq_len) >= len(PROMPT) + K - 1  # the pause itself did compute them
