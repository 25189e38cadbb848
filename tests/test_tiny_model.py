"""Exact continuation of the tiny hybrid model (hsnap_testing.model) through real SGLang pools (CPU, in-process).

A greedy / sampled run of N tokens is compared with a run paused after k tokens whose state went
cache -> pool layout -> pools A -> pools B (other capacity, page size, slots; other requests present) -> cache
and was then continued.  Token ids must be equal and logprobs bit-identical (max |diff| == 0.0), and the resumed
part must forward exactly N - k positions (nothing recomputed).  Negative controls show the check can fail.

Then through snapshot files, resumed in one fresh process given the files alone: a sampled request (its sampler
state in the record), SGLang's own greedy ``Req`` (``snapshot_req`` / ``resume_req``) and a TP 2 set re-sharded to
TP 1; and bad snapshots of the tiny model refused with typed errors, the target pools untouched.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hsnap_io.sglang_env import sglang_available  # noqa: E402
from hsnap_testing import pools  # noqa: E402
from hsnap_testing.model import (  # noqa: E402
    Decoder,
    build_model,
    build_pools,
    cache_to_pool_tensors,
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
    other_a = pools.alloc_request(a, 5, seed=1)  # another request occupies slots first
    slots_a = pools.alloc_request(a, seq_len, seed=2)
    write_to_pools(
        a.req_to_token_pool, a.token_to_kv_pool_allocator, slots_a.token_indices, slots_a.mamba_pool_idx, tensors,
        req_pool_idx=slots_a.req_pool_idx,
    )
    from_a = read_from_pools(a.req_to_token_pool, a.token_to_kv_pool_allocator, slots_a.token_indices, slots_a.mamba_pool_idx, geom)

    b = build_pools(geom, size=128, mamba_size=6, page_size=4)
    # the other requests' slots hold seeded noise: a wrong slot or layer index would pick it up
    pools.occupy(b, 2, [7, 3], seed=99)
    slots_b = pools.alloc_request(b, seq_len, seed=3)
    assert slots_b.mamba_pool_idx != slots_a.mamba_pool_idx or slots_b.req_pool_idx != slots_a.req_pool_idx
    assert not torch.equal(slots_b.token_indices, slots_a.token_indices)
    write_to_pools(
        b.req_to_token_pool, b.token_to_kv_pool_allocator, slots_b.token_indices, slots_b.mamba_pool_idx, from_a,
        req_pool_idx=slots_b.req_pool_idx,
    )
    # read back through SGLang's own indirection: req_to_token row and req -> mamba mapping
    tok, mid = request_slots(b.req_to_token_pool, slots_b.req_pool_idx, seq_len)
    assert torch.equal(tok, slots_b.token_indices) and mid == slots_b.mamba_pool_idx
    back = read_from_pools(b.req_to_token_pool, b.token_to_kv_pool_allocator, tok, mid)  # layer ids from the pools' own maps

    # SGLang's per-layer accessor (what its attention backend uses) sees the same state
    for lid in geom.linear_layer_ids:
        view = b.req_to_token_pool.mamba2_layer_cache(lid)
        assert torch.equal(view.conv[0][mid], tensors["conv"][lid])
        assert torch.equal(view.temporal[mid], tensors["temporal"][lid])
    for lid in geom.full_attention_layer_ids:
        kbuf, vbuf = b.kv_pool.get_kv_buffer(lid)
        assert torch.equal(kbuf[tok], tensors["k"][lid]) and torch.equal(vbuf[tok], tensors["v"][lid])

    pools.free_request(b, slots_b)
    pools.free_request(a, other_a)
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
    ps = build_pools(geom, size=32, mamba_size=2)
    slots = pools.alloc_request(ps, part.seq_len, seed=0)
    bad = corrupt("temporal", lambda x: x.transpose(-1, -2).contiguous())
    with pytest.raises(ValueError):
        write_to_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, slots.token_indices, slots.mamba_pool_idx, bad)
    # and a dtype mismatch (e.g. a bf16 pool) is refused rather than rounded silently
    with pytest.raises(TypeError):
        write_to_pools(
            ps.req_to_token_pool, ps.token_to_kv_pool_allocator, slots.token_indices, slots.mamba_pool_idx,
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
    from hsnap_testing.model import weights_digest

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


# --------------------------------------------------------------------------------------------------------------------
# through snapshot files, resumed in a fresh process that is given the files alone


def _resume_from(path, tiny, n: int, **restore_kw):
    """Restore ``path`` into pools of another capacity with other requests in them, rebuild the model's cache from
    the request's slots and continue to ``n`` outputs with what the record carries (sampler state included)."""
    from hsnap_io import restore_request

    ps, _ = tiny.pools(size=512, mamba_size=8, others=(7, 23), noise_seed=23)
    restored = restore_request(path, req_to_token_pool=ps.req_to_token_pool,
                               token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=tiny.identity(), **restore_kw)
    rec, seq = restored.record, restored.state_position
    tok, mid = request_slots(ps.req_to_token_pool, restored.req_pool_idx, seq)
    assert torch.equal(tok, restored.token_indices) and mid == restored.mamba_pool_idx
    cache = pool_tensors_to_cache(read_from_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, tok, mid, tiny.geom),
                                  tiny.geom, seq)
    temperature = float(rec.sampling["temperature"])
    mark = len(tiny.dec.fed_ranges)
    res = tiny.dec.generate(rec.prompt_ids.tolist(), n, temperature=temperature, cache=cache,
                            generator_state=rec.rng_state if temperature > 0 else None,
                            start_outputs=rec.output_ids.tolist(), start_logprobs=rec.output_logprobs.tolist())
    return {"token_ids": res.token_ids, "logprobs": res.logprobs, "positions": res.positions, "forward_calls": res.forward_calls,
            "recomputed": sum(max(0, min(s + k, seq) - s) for s, k in tiny.dec.fed_ranges[mark:]),
            "generator_state": None if res.generator_state is None else res.generator_state.hex(),
            "source_ranks": list(restored.source_ranks), "source_bytes_read": restored.source_bytes_read,
            "bytes_uploaded": restored.bytes_uploaded, "pid": os.getpid()}


def _resume_req_from(path, tiny, n: int):
    """A live SGLang ``Req`` from the snapshot alone (``resume_req``); the model continues from the slots in ``req.kv``."""
    from hsnap_sglang.req import resume_req

    ps, _ = tiny.pools(size=512, mamba_size=8, others=(7, 23), noise_seed=23)
    req = resume_req(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                     identity=tiny.identity())
    seq = req.kv.kv_committed_len
    tok, mid = request_slots(ps.req_to_token_pool, req.kv.req_pool_idx, seq)
    cache = pool_tensors_to_cache(read_from_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, tok, mid, tiny.geom),
                                  tiny.geom, seq)
    mark = len(tiny.dec.fed_ranges)
    res = tiny.dec.generate(list(req.origin_input_ids), n, cache=cache, start_outputs=list(req.output_ids),
                            start_logprobs=list(req.logprob.output_token_logprobs_val))
    return {"token_ids": res.token_ids, "logprobs": res.logprobs, "positions": res.positions,
            "recomputed": sum(max(0, min(s + k, seq) - s) for s, k in tiny.dec.fed_ranges[mark:]),
            "send_token_offset": req.send_token_offset, "mamba_needs_clear": req.kv.mamba_needs_clear,
            "top_k": req.sampling_params.top_k, "pid": os.getpid()}


def _resume_child(spec_path: str) -> None:
    """``python tests/test_tiny_model.py SPEC.json``: resume each snapshot of the spec (a TP 2 set re-sharded to TP 1)."""
    from hsnap_io import reshard
    from hsnap_testing.model import TinyModel, tp_model

    torch.set_num_threads(NUM_THREADS)
    with open(spec_path) as f:
        spec = json.load(f)
    tiny = TinyModel("qwen3_5", 0)
    out = {}
    for name, (path, n, how) in spec["items"].items():
        if how == "req":
            out[name] = _resume_req_from(path, tiny, n)
            continue
        kw = {"sharding": reshard.describe(tp_model(tiny.geom), 1, 0)} if how == "tp" else {}
        out[name] = _resume_from(path, tiny, n, **kw)
    with open(spec["out"], "w") as f:
        json.dump(out, f)


def _record(part, n: int, temperature: float, seed):
    import hsnap_format as hf

    return hf.RequestRecord(rid="tiny-1", prompt_ids=list(PROMPT), output_ids=part.token_ids, output_logprobs=part.logprobs,
                            state_position=part.seq_len, sampling={"temperature": temperature, "top_p": 1.0, "sampling_seed": seed},
                            max_new_tokens=n, streamed_tokens=len(part.token_ids), rng_state=part.generator_state)


def _export(tiny, path, part, record, tp: int = 1) -> None:
    """``part``'s state in the pools of each rank of ``tp`` (its shard, split the way SGLang splits KV heads and the
    GDN [q|k|v] conv channels and value heads), exported as one file (TP 1) or a committed set."""
    import hsnap_format as hf
    from hsnap_io import export_request, reshard
    from hsnap_testing.model import rank_geometry, shard_tensors, tp_model

    tensors = cache_to_pool_tensors(part.cache, tiny.geom)
    sw = hf.SetWriter(path) if tp > 1 else None
    for r in range(tp):
        ps, _ = tiny.pools(size=256, mamba_size=4, others=(13,), noise_seed=11, geom=rank_geometry(tiny.geom, tp, r))
        slots = pools.alloc_request(ps, part.seq_len, seed=5)
        write_to_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, slots.token_indices, slots.mamba_pool_idx,
                       shard_tensors(tensors, tiny.geom, tp, r), req_pool_idx=slots.req_pool_idx)
        kw = dict(identity=tiny.identity(tp_size=tp, tp_rank=r, snapshot_id=f"tiny-tp{tp}"))
        if sw is not None:
            kw["sharding"] = reshard.describe(tp_model(tiny.geom), tp, r)
        export_request(sw.rank_path(r) if sw else path, req_to_token_pool=ps.req_to_token_pool,
                       token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, req_pool_idx=slots.req_pool_idx, record=record, **kw)
    if sw is not None:
        sw.commit(tp_size=tp)


def _export_req(tiny, path, part, n: int) -> None:
    """``part`` as SGLang's own greedy ``Req`` (constructor, ``HybridReqToTokenPool.alloc``, outputs, logprobs and
    stream offsets as the scheduler leaves them), its state written by the model, saved with ``snapshot_req``."""
    from array import array

    from hsnap_io.sglang_env import import_sglang
    from hsnap_sglang.req import snapshot_req

    import_sglang()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    params.normalize(None)  # SGLang's normal form of greedy: temperature 1.0, top_k 1
    req = Req("tiny-greedy", "", array("q", PROMPT), params, return_logprob=True, stream=True, vocab_size=tiny.geom.vocab_size)
    ps, _ = tiny.pools(size=256, mamba_size=4, others=(13,), noise_seed=11)
    ps.req_to_token_pool.alloc([req])
    tok = pools.alloc_tokens(ps, part.seq_len).to(torch.int64)
    ps.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, part.seq_len)), tok.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = part.seq_len
    write_to_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, tok, int(req.kv.mamba_pool_idx),
                   cache_to_pool_tensors(part.cache, tiny.geom))
    req.kv.mamba_needs_clear = False  # the prefill forward wrote the slot
    for t, lp in zip(part.token_ids, part.logprobs):
        req.output_ids.append(t)
        req.logprob.output_token_logprobs_val.append(lp)
        req.logprob.output_token_logprobs_idx.append(t)
    req.send_token_offset = req.send_output_token_logprobs_offset = len(part.token_ids)  # all streamed
    snapshot_req(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                 identity=tiny.identity())


@pytest.fixture(scope="module")
def tiny():
    from hsnap_testing.model import TinyModel

    t = TinyModel("qwen3_5", 0)
    yield t
    t.dec.close()


@pytest.fixture(scope="module")
def resumed(tiny, tmp_path_factory):
    """References computed here; a sampled request's file and a greedy request's TP 2 set resumed in ONE fresh process."""
    d = tmp_path_factory.mktemp("tiny")
    sampled = dict(temperature=0.8, seed=1234)
    ref = {"sampled": tiny.dec.generate(PROMPT, N, **sampled), "tp2": tiny.dec.generate(PROMPT, 20), "req": tiny.dec.generate(PROMPT, N)}
    _export_req(tiny, str(d / "req.hsnap"), _pause(tiny.dec, K), N)
    _export(tiny, str(d / "sampled.hsnap"), part := _pause(tiny.dec, K, **sampled), _record(part, N, 0.8, 1234))
    _export(tiny, str(d / "req.tp2"), part := _pause(tiny.dec, 6), _record(part, 20, 0.0, None), tp=2)
    items = {"sampled": [str(d / "sampled.hsnap"), N, "record"], "tp2": [str(d / "req.tp2"), 20, "tp"], "req": [str(d / "req.hsnap"), N, "req"]}
    (d / "spec.json").write_text(json.dumps({"items": items, "out": str(d / "out.json")}))
    subprocess.run([sys.executable, os.path.abspath(__file__), str(d / "spec.json")], check=True, timeout=600,
                   env=dict(os.environ, OMP_NUM_THREADS=str(NUM_THREADS)))
    return ref, json.loads((d / "out.json").read_text()), d


@needs_sglang
def test_sampled_request_resumed_from_its_snapshot_file_continues_exactly(resumed):
    """The sampler's generator state travels in the record: restored in a fresh process from the file alone, the
    continuation draws the same tokens with bit-identical logprobs, and nothing of the history goes through forward."""
    ref, got, _ = resumed
    full, res = ref["sampled"], got["sampled"]
    assert res["pid"] != os.getpid()
    assert res["token_ids"] == full.token_ids
    assert _max_diff(res["logprobs"], full.logprobs) == 0.0
    assert bytes.fromhex(res["generator_state"]) == full.generator_state
    assert res["positions"] == res["forward_calls"] == N - K and res["recomputed"] == 0


@needs_sglang
def test_tp2_snapshot_set_resumed_at_tp1_continues_exactly(resumed):
    """The paused request exported as a TP 2 set (each rank's shard in that rank's own pools) and re-sharded into
    TP 1 pools of a fresh process continues exactly, reading only the slices it uploads."""
    import hsnap_format as hf

    ref, got, d = resumed
    full, res = ref["tp2"], got["tp2"]
    with hf.open_snapshot(str(d / "req.tp2")) as s:
        assert s.manifest.tp_size == 2
        assert [s.ranks[r].geometry.attention.heads for r in range(2)] == [1, 1]  # two KV heads, one per rank
        assert [s.ranks[r].geometry.sharding.conv[0].parts[2][0] for r in range(2)] == [64, 128]  # v channels
    assert res["token_ids"] == full.token_ids
    assert _max_diff(res["logprobs"], full.logprobs) == 0.0
    assert res["positions"] == 20 - 6 and res["recomputed"] == 0
    assert res["source_ranks"] == [0, 1] and res["source_bytes_read"] == res["bytes_uploaded"]


@needs_sglang
def test_greedy_sglang_req_resumed_in_a_fresh_process_continues_exactly(resumed):
    """SGLang's own ``Req`` written with ``snapshot_req`` and brought back with ``resume_req`` in a fresh process:
    greedy in SGLang's normal form, the stream offset carried, the restored Mamba slot kept, the continuation exact."""
    ref, got, _ = resumed
    full, res = ref["req"], got["req"]
    assert res["pid"] != os.getpid() and res["top_k"] == 1
    assert res["send_token_offset"] == K and res["mamba_needs_clear"] is False
    assert res["token_ids"] == full.token_ids
    assert _max_diff(res["logprobs"], full.logprobs) == 0.0
    assert res["positions"] == N - K and res["recomputed"] == 0


@needs_sglang
def test_snapshot_file_carries_the_record_and_the_identity(tiny, resumed):
    import hsnap_format as hf

    ref, _, d = resumed
    with hf.open(str(d / "sampled.hsnap")) as snap:
        snap.verify()
        rec, ident = snap.record(), snap.identity
    assert list(rec.prompt_ids) == PROMPT and list(rec.output_ids) == ref["sampled"].token_ids[:K]
    assert rec.state_position == len(PROMPT) + K - 1
    assert rec.max_new_tokens == N and rec.streamed_tokens == K and rec.remaining_budget == N - K
    assert rec.rng_state is not None and rec.sampling["temperature"] == pytest.approx(0.8)
    assert ident.weights_version == f"sha256:{tiny.weights[:16]}" and ident.engine.name == "sglang"
    assert ident.numerics["num_threads"] == NUM_THREADS and ident.numerics["device"] == "cpu"


@needs_sglang
def test_resume_under_another_thread_count_warns_and_names_it(tiny, resumed):
    import dataclasses

    from hsnap_io import NumericsWarning, restore_request

    _, _, d = resumed
    ps, _ = tiny.pools(size=512, mamba_size=8, others=(7,), noise_seed=29)
    ident = tiny.identity()
    ident = dataclasses.replace(ident, numerics={**ident.numerics, "num_threads": NUM_THREADS + 1})
    with pytest.warns(NumericsWarning, match="bit-exactness"):
        restored = restore_request(str(d / "sampled.hsnap"), req_to_token_pool=ps.req_to_token_pool,
                                   token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=ident)
    assert ("identity.numerics.num_threads", NUM_THREADS + 1, NUM_THREADS) in [tuple(x) for x in restored.numerics_differences]


def _other_weights(tiny, path):
    import dataclasses

    from hsnap_testing.model import build_model, weights_digest

    w = weights_digest(build_model(seed=1)[0])
    return path, dict(identity=dataclasses.replace(tiny.identity(), weights_version=f"sha256:{w[:16]}", weights_hash=f"sha256:{w}"))


def _other_head_count(tiny, path):
    import dataclasses

    heads = tiny.geom.num_kv_heads * 2
    return path, dict(geom=dataclasses.replace(tiny.geom, num_kv_heads=heads, kv_shape=(heads, tiny.geom.head_dim)))


def _missing_rank_file(tiny, path):
    import shutil

    copy = os.path.join(os.path.dirname(path), "missing-rank", "req.tp2")
    shutil.copytree(os.path.join(os.path.dirname(path), "req.tp2"), copy)
    os.remove(os.path.join(copy, "rank-1.hsnap"))
    return copy, dict(identity=tiny.identity(tp_size=2, tp_rank=1), rank=1)


def _flipped_byte(tiny, path):
    import shutil

    import hsnap_format as hf

    bad = path + ".corrupted"
    shutil.copyfile(path, bad)
    with hf.open(bad) as s:
        sec = next(x for x in s.sections if x.kind == "temporal")
    with open(bad, "r+b") as f:
        f.seek(sec.offset + sec.length // 2)
        b = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b ^ 0xFF]))
    return bad, {}


@needs_sglang
@pytest.mark.parametrize("bad,error,named", [
    (_other_weights, "IncompatibleSnapshotError", "identity.weights_version"),
    (_other_head_count, "IncompatibleSnapshotError", "geometry.attention.heads"),
    (_missing_rank_file, "MalformedManifestError", "rank-1.hsnap"),
    (_flipped_byte, "DigestMismatchError", "temporal"),
], ids=["other-weights", "other-head-count", "missing-rank-file", "flipped-byte"])
def test_bad_snapshot_of_the_tiny_model_is_refused_pools_untouched(tiny, resumed, bad, error, named):
    """Another model's weights, pools of another layout, a set with a rank file gone, one byte flipped in a state
    section: each refused with its typed error naming what is wrong, every pool byte and free list as before."""
    import hsnap_format as hf
    from hsnap_io import restore_request

    _, _, d = resumed
    path, kw = bad(tiny, str(d / "sampled.hsnap"))
    ps, _ = tiny.pools(size=512, mamba_size=8, others=(7, 23), noise_seed=31, geom=kw.pop("geom", None))
    before = pools.pool_state_fingerprint(ps)
    with pytest.raises(hf.HsnapError) as info:
        restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                        **{"identity": tiny.identity(), "exact_rollback": True, **kw})
    assert type(info.value).__name__ == error and named in str(info.value)
    assert pools.diff_fingerprints(before, pools.pool_state_fingerprint(ps)) == []


if __name__ == "__main__":
    _resume_child(sys.argv[1])
