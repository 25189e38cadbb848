"""hsnap_sglang.req: a live SGLang Req in, a live SGLang Req out.

Real components only: SGLang's Req constructor, SamplingParams.normalize with a real
tokenizer, SGLang's pool classes and allocators on device='cpu', SGLang's own
deferred-clear code path, xgrammar through SGLang's XGrammarGrammarBackend.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import io_cases  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_testing import reqs as sr  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_sglang import req as hs  # noqa: E402
from hsnap_sglang.req import fields  # noqa: E402
from hsnap_sglang.req.record import UnsupportedRequestError  # noqa: E402
from hsnap_testing import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SGLang's XGrammarGrammar passes a GrammarMatcher argument xgrammar 0.2.7 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:max_rollback_tokens is deprecated:DeprecationWarning")


def _source(kind="hybrid_linear", page=1, seed=1, **case_over):
    ps = sp.build(kind, size=512, page_size=page)
    sp.occupy(ps, 2, 37, seed=5)
    case = {**sr.random_case(seed), **case_over}
    req, _ = sr.decode_req(ps, case)
    return ps, req


def _snapshot(ps, req, path):
    return hs.snapshot_req(
        path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=io_cases.identity()
    )


def _resume(ps, path, **kw):
    return hs.resume_req(
        path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=io_cases.identity(), tokenizer=sr.tokenizer(), **kw
    )


# --------------------------------------------------------------------------- the field table


def test_every_attribute_is_classified_and_every_row_exists(tmp_path):
    """Walks vars(Req(...)), req.kv, req.logprob and SamplingParams of a fresh, a decoding
    and a resumed Req: every attribute is classified, every table row names a real one."""
    fresh = sr.new_req()
    ps, decoding = _source(detok=True)  # the detokenizer attributes appear once it has run
    _snapshot(ps, decoding, tmp_path / "r.hsnap")
    resumed = _resume(io_cases.target("hybrid_linear", 1), tmp_path / "r.hsnap")
    seen: dict[str, set] = {cls: set() for cls in fields.TABLES}
    for req in (fresh, decoding, resumed):
        assert fields.unclassified(req) == []
        for cls, attrs in fields.sglang_attributes(req).items():
            seen[cls] |= set(attrs)
    stale = [f"{cls}.{k}" for cls, table in fields.TABLES.items() for k in table if k not in seen[cls]]
    assert stale == []


def test_an_unclassified_attribute_is_refused_before_writing(tmp_path):
    """An SGLang upgrade that adds state to Req must not be silently dropped."""
    ps, req = _source()
    before = sp.pool_state_fingerprint(ps)
    req.new_state_from_a_future_sglang = 1
    assert fields.unclassified(req) == ["Req.new_state_from_a_future_sglang"]
    with pytest.raises(UnsupportedRequestError) as e:
        _snapshot(ps, req, tmp_path / "r.hsnap")
    assert e.value.field == "Req.new_state_from_a_future_sglang"
    assert os.listdir(tmp_path) == []
    assert sp.pool_state_fingerprint(ps) == before


def test_docs_table_is_generated_from_the_code():
    text = open(os.path.join(ROOT, "docs", "sglang.md"), encoding="utf-8").read()
    begin, end = text.index(fields.DOC_BEGIN), text.index(fields.DOC_END) + len(fields.DOC_END) + 1
    assert text[begin:end] == fields.render_table(), "run: python -m hsnap_sglang.req --docs"


# --------------------------------------------------------------------------- refusals


def _mamba_cow(req):
    req.kv.mamba_cow_src_index = torch.tensor([3])


def _spec_in_flight(req):
    req.kv.kv_allocated_len += 3  # draft tokens allocated past the committed boundary


def _n2(req):
    req.sampling_params.n = 2


REFUSALS = [
    ("n>1", _n2, "SamplingParams.n"),
    ("custom_logit_processor", lambda r: setattr(r, "custom_logit_processor", '{"callable": "x"}'), "Req.custom_logit_processor"),
    ("speculative", _spec_in_flight, "ReqKvInfo.kv_allocated_len"),
    ("speculative-topk", lambda r: setattr(r, "output_topk_p", torch.zeros(1, 4)), "Req.output_topk_p"),
    ("multimodal", lambda r: setattr(r, "multimodal_inputs", types.SimpleNamespace(mm_items=[1])), "Req.multimodal_inputs"),
    ("input_embeds", lambda r: setattr(r, "input_embeds", [[0.0, 1.0]]), "Req.input_embeds"),
    ("hidden_states", lambda r: setattr(r, "return_hidden_states", True), "Req.return_hidden_states"),
    ("session", lambda r: setattr(r, "session_id", "sess-1"), "Req.session_id"),
    ("finished", lambda r: setattr(r, "finished_reason", object()), "Req.finished_reason"),
    ("mamba_needs_clear", lambda r: setattr(r.kv, "mamba_needs_clear", True), "ReqKvInfo.mamba_needs_clear"),
    ("mamba_cow", _mamba_cow, "ReqKvInfo.mamba_cow_src_index"),
    ("beam", lambda r: setattr(r.sampling_params, "beam_width", 4), "SamplingParams.beam_width"),
    ("input-logprobs-in-flight", lambda r: setattr(r, "input_token_logprobs", [-0.5]), "Req.input_token_logprobs"),
    ("top-logprobs-in-flight", lambda r: setattr(r, "temp_input_top_logprobs_val", [[-0.5]]), "Req.temp_input_top_logprobs_val"),
]


@pytest.mark.parametrize("mutate,field", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refused_at_snapshot_nothing_written_pools_unchanged(tmp_path, mutate, field):
    ps, req = _source()
    mutate(req)
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(UnsupportedRequestError) as e:
        _snapshot(ps, req, tmp_path / "r.hsnap")
    assert isinstance(e.value, hf.HsnapError)
    assert e.value.field == field and field in str(e.value)
    assert os.listdir(tmp_path) == []
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []


def test_a_request_sglang_prefilled_again_after_a_retraction_can_be_snapshotted(tmp_path):
    """SGLang's re-prefill of a retracted request leaves the input-logprob scratch empty (``[]``), not None: nothing is
    in flight, so the request is written like any other (it was refused, so no request SGLang ever retracted could be
    paused, drained or migrated)."""
    ps, req = _source()
    for name in ("input_token_logprobs", "temp_input_top_logprobs_val", "temp_input_top_logprobs_idx",
                 "temp_input_token_ids_logprobs_val", "temp_input_token_ids_logprobs_idx"):
        setattr(req, name, [])
    _snapshot(ps, req, tmp_path / "r.hsnap")
    assert os.path.getsize(tmp_path / "r.hsnap") > 0


def _lora_source():
    ps = sp.build("mha", size=512)
    params = sr.sampling_params(max_new_tokens=16)
    req = sr.new_req("lora-req", [5, 6, 7], params, lora_id="adapter-a")
    ps.req_to_token_pool.alloc([req])
    idx = sp.alloc_tokens(ps, 3).to(torch.int64)
    ps.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, 3)), idx.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 3
    req.output_ids.append(9)
    return ps, req


def test_resume_refuses_a_lora_the_target_has_not_loaded(tmp_path):
    ps, req = _lora_source()
    path = tmp_path / "r.hsnap"
    _snapshot(ps, req, path)
    target = io_cases.target("mha", 1)
    before = sp.pool_state_fingerprint(target)
    for loaded in (None, {"adapter-b"}):
        with pytest.raises(hf.IncompatibleSnapshotError) as e:
            _resume(target, path, loaded_lora_ids=loaded)
        assert "lora_id" in str(e.value) and "adapter-a" in str(e.value)
        assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []
    got = _resume(target, path, loaded_lora_ids={"adapter-a", "adapter-b"})
    assert (got.lora_id, got.extra_key) == ("adapter-a", req.extra_key) == ("adapter-a", "adapter-a")


# --------------------------------------------------------------------------- restored state survives


@pytest.mark.parametrize("kind", ["hybrid_linear", "swa_mamba"])
def test_first_step_after_resume_reads_the_restored_mamba_state(tmp_path, kind):
    """SGLang's own deferred COW/clear (ScheduleBatch._collect_deferred_mamba_cow_and_clear,
    then what ModelRunner does with its result) runs on the resumed request: the slot the
    decode kernel indexes (req_index_to_mamba_index_mapping[row]) still holds the snapshot's
    state. Control: the same code zeroes a slot SGLang's own alloc() handed out (#32995)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    ps, req = _source(kind)
    src_rows = sr.req_rows(ps, req)
    _snapshot(ps, req, tmp_path / "r.hsnap")
    target = io_cases.target(kind, 1)
    got = _resume(target, tmp_path / "r.hsnap")
    rtp = target.req_to_token_pool

    def first_extend_step(reqs):
        batch = types.SimpleNamespace()
        ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, reqs)
        if batch.mamba_clear_indices is not None:
            rtp.mamba_pool.clear_slots(rtp.translate_mamba_indices(batch.mamba_clear_indices))
        if batch.mamba_cow_src_indices is not None:
            rtp.copy_mamba_state(batch.mamba_cow_src_indices, batch.mamba_cow_dst_indices)

    first_extend_step([got])
    slot = int(rtp.get_mamba_indices(torch.tensor([got.kv.req_pool_idx]))[0])
    assert slot == int(got.kv.mamba_pool_idx)
    rows = sr.req_rows(target, got)
    mamba = [k for k in src_rows if k.startswith("mamba.")]
    assert mamba and all(torch.equal(rows[k], src_rows[k]) for k in mamba)
    assert all(rows[k].abs().sum() > 0 for k in mamba)

    control = sr.new_req("control")
    rtp.alloc([control])  # SGLang's own allocation: mamba_needs_clear=True
    cslot = torch.tensor([int(control.kv.mamba_pool_idx)])
    rtp.mamba_pool.load_cpu_copy(rtp.mamba_pool.get_cpu_copy(torch.tensor([int(got.kv.mamba_pool_idx)])), cslot)
    first_extend_step([control])
    assert all(c[:, cslot].abs().sum() == 0 for c in rtp.mamba_pool.mamba_cache.conv)
    assert rtp.mamba_pool.mamba_cache.temporal[:, cslot].abs().sum() == 0


def test_resume_refusals_leave_the_target_byte_identical(tmp_path):
    ps, req = _source("hybrid_linear")
    path = tmp_path / "r.hsnap"
    _snapshot(ps, req, path)
    target = io_cases.target("hybrid_linear", 1)
    before = sp.pool_state_fingerprint(target)
    other = io_cases.identity(weights_version="w2")
    with pytest.raises(hf.IncompatibleSnapshotError):
        hs.resume_req(path, req_to_token_pool=target.req_to_token_pool, token_to_kv_pool_allocator=target.token_to_kv_pool_allocator, identity=other)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []


# --------------------------------------------------------------------------- property test, fresh process


N_CASES = 8


def test_fresh_process_round_trips_of_random_reqs(tmp_path):
    """Randomized Req states (sampling params incl. penalties and seeds, non-ASCII stop
    strings, logprob options with top-k, reasoning started/finished, partial streaming)
    on every pool kind, resumed in ONE fresh process: classified views equal, rows equal."""
    items, expected = [], {}
    for kind, page in sr.POOL_KINDS:
        for seed in range(N_CASES):
            case = sr.random_case(1000 * page + seed)
            ps = sp.build(kind, size=512, page_size=page)
            sp.occupy(ps, 2, 37, seed=seed)
            req, _ = sr.decode_req(ps, case)
            path = str(tmp_path / f"{kind}-{page}-{seed}.hsnap")
            _snapshot(ps, req, path)
            rows = io_cases.rows_as_bytes(sr.req_rows(ps, req))
            expected[path] = (sr.jsonable_view(req), {k: v.tobytes().hex() for k, v in rows.items()})
            items.append({"kind": kind, "page": page, "path": path})
    spec = tmp_path / "spec.json"
    out = tmp_path / "out.json"
    spec.write_text(json.dumps({"items": items, "out": str(out)}))
    zygote.run([sys.executable, os.path.join(ROOT, "tests", "io_cases.py"), "resume", str(spec)], check=True, timeout=300)
    got = json.loads(out.read_text())
    assert {g["pid"] for g in got.values()} != {os.getpid()}
    stops, inf_bias = set(), False
    for path, (view, rows) in expected.items():
        g = got[path]
        diff = {k: (view[k], g["view"].get(k)) for k in view if view[k] != g["view"].get(k)}
        assert diff == {}, path
        assert g["rows"] == rows, path
        assert g["mamba_needs_clear"] is False
        stops |= set(view["SamplingParams.stop_strs"])
        inf_bias |= float("-inf") in (view["SamplingParams.logit_bias"] or {}).values()
    # the cases did exercise non-ASCII stop strings and an infinite logit bias
    assert any(not s.isascii() for s in stops) and inf_bias


# --------------------------------------------------------------------------- grammar (xgrammar)

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]})


def _backend():
    pytest.importorskip("xgrammar", reason="xgrammar is installed by scripts/bootstrap")
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    tok = sr.tokenizer()
    return XGrammarGrammarBackend(tok, vocab_size=sr.vocab_size(), model_eos_token_ids=[tok.eos_token_id])


def _mask(grammar) -> torch.Tensor:
    m = grammar.allocate_vocab_mask(sr.vocab_size(), 1, "cpu")
    grammar.fill_vocab_mask(m, 0)
    return m.clone()


def _allowed(mask: torch.Tensor) -> list[int]:
    bits = [(int(w) >> b) & 1 for w in mask[0].tolist() for b in range(32)]
    return [i for i, bit in enumerate(bits[: sr.vocab_size()]) if bit]


def test_grammar_matcher_is_rederived_and_the_next_mask_equals_the_uninterrupted_one(tmp_path):
    import random

    key = ("json", SCHEMA)
    _, uninterrupted = hs.replay_grammar(_backend(), key, [], require_reasoning=False)
    rng = random.Random(11)
    output = []
    for _ in range(9):  # an uninterrupted constrained decode
        tok = rng.choice(_allowed(_mask(uninterrupted)))
        uninterrupted.accept_token(tok)
        output.append(tok)
    ps = sp.build("hybrid_linear", size=512)
    case = {**sr.random_case(3), "output": output, "streamed": 4, "params": {"max_new_tokens": 64, "json_schema": SCHEMA}}
    req, _ = sr.decode_req(ps, case)
    path = tmp_path / "g.hsnap"
    _snapshot(ps, req, path)

    target = io_cases.target("hybrid_linear", 1)
    before = sp.pool_state_fingerprint(target)
    with pytest.raises(hf.HsnapError) as e:  # no backend: refused before the pools are touched
        _resume(target, path)
    assert e.value.field == "request.sampling.json_schema"
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []

    got = _resume(target, path, grammar_backend=_backend())  # a fresh backend, as in a new process
    assert got.grammar_key == key
    # control: the mask depends on how much output the matcher has seen, so equal masks
    # below are evidence of equal matcher state, not of a mask that never changes
    masks = [_mask(hs.replay_grammar(_backend(), key, output[:j], require_reasoning=False)[1]) for j in range(len(output))]
    assert any(not torch.equal(m, _mask(uninterrupted)) for m in masks)
    for _ in range(12):  # the next step and the ones after it
        m = _mask(uninterrupted)
        assert torch.equal(_mask(got.grammar), m)
        assert got.grammar.is_terminated() == uninterrupted.is_terminated()
        if uninterrupted.is_terminated():
            break
        tok = rng.choice(_allowed(m))
        uninterrupted.accept_token(tok)
        got.grammar.accept_token(tok)


def test_grammar_resume_refuses_output_the_grammar_rejects(tmp_path):
    ps = sp.build("mha", size=512)
    case = {**sr.random_case(5), "output": [sr.tokenizer().convert_tokens_to_ids("]")] * 2, "params": {"max_new_tokens": 64, "json_schema": SCHEMA}}
    req, _ = sr.decode_req(ps, case)
    _snapshot(ps, req, tmp_path / "g.hsnap")
    target = io_cases.target("mha", 1)
    before = sp.pool_state_fingerprint(target)
    with pytest.raises(hf.HsnapError) as e:
        _resume(target, tmp_path / "g.hsnap", grammar_backend=_backend())
    assert e.value.field == "request.output_ids[0]"
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []


def _ping_pong_target(mamba_size: int):
    """Hybrid pools built with enable_mamba_extra_buffer (radix-tracking ping-pong slots)."""
    from hsnap_io.sglang_env import import_sglang

    sg = import_sglang()
    g = sp.geometry("hybrid_linear", 1024, {})
    rtp = sg.memory_pool.HybridReqToTokenPool(
        size=g["max_reqs"], mamba_size=mamba_size, mamba_spec_state_size=mamba_size, max_context_len=1024,
        device="cpu", enable_memory_saver=False, cache_params=sp.cache_params(sg, g, g["mamba_layer_ids"]),
        mamba_layer_ids=list(g["mamba_layer_ids"]), enable_mamba_extra_buffer=True,
    )
    kv = sg.memory_pool.HybridLinearKVPool(
        size=1024, dtype=g["dtype"], page_size=1, head_num=g["head_num"], head_dim=g["head_dim"],
        full_attention_layer_ids=list(g["full_attention_layer_ids"]), device="cpu", mamba_pool=rtp.mamba_pool, enable_memory_saver=False,
    )
    alloc = sg.allocator.TokenToKVPoolAllocator(1024, g["dtype"], "cpu", kv, False)
    return sp.PoolSet("hybrid_linear", rtp, alloc, kv, 1, 1024, g)


def test_resume_gives_fresh_ping_pong_track_slots_on_targets_with_the_extra_buffer(tmp_path):
    ps, req = _source("hybrid_linear")
    src_rows = sr.req_rows(ps, req)
    _snapshot(ps, req, tmp_path / "r.hsnap")
    target = _ping_pong_target(mamba_size=8)
    rtp = target.req_to_token_pool
    free0 = rtp.mamba_allocator.available_size()
    got = _resume(target, tmp_path / "r.hsnap")
    n = rtp.mamba_initial_tracking_slots
    track = got.kv.mamba_ping_pong_track_buffer
    assert n >= 1 and rtp.mamba_allocator.available_size() == free0 - 1 - n
    assert torch.equal(rtp.req_index_to_mamba_ping_pong_track_buffer_mapping[got.kv.req_pool_idx], track)
    assert int(got.kv.mamba_pool_idx) not in track.tolist() and got.kv.mamba_last_track_seqlen is None
    rows = sr.req_rows(target, got)
    assert all(torch.equal(rows[k], src_rows[k]) for k in src_rows)
    rtp.free_mamba_cache(got)  # SGLang's own release gives back the working and the track slots
    assert rtp.mamba_allocator.available_size() == free0


def test_resume_refuses_when_the_ping_pong_slots_do_not_fit(tmp_path):
    ps, req = _source("hybrid_linear")
    _snapshot(ps, req, tmp_path / "r.hsnap")
    target = _ping_pong_target(mamba_size=2)  # room for the working slot, not for the track slots
    before = sp.pool_state_fingerprint(target)
    with pytest.raises(hf.CapacityError) as e:
        _resume(target, tmp_path / "r.hsnap")
    assert "ping-pong" in str(e.value)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []


def test_a_target_short_of_ping_pong_slots_even_with_its_cache_makes_no_room(tmp_path):
    """A target whose cache could free token slots but not the Mamba slots the track buffers need: refused before the
    room is made (a resume refused for anything never costs the cache)."""
    ps, req = _source("hybrid_linear")
    _snapshot(ps, req, tmp_path / "r.hsnap")
    target = _ping_pong_target(mamba_size=2)  # room for the working slot, not for the track slots

    class Room:  # a cache holding token slots only (hsnap_io.slots.Room)
        def __init__(self):
            self.made = []

        def spare(self):
            return {"token slots": 64, "mamba slots": 0}

        def make(self, token_slots, mamba_slots):
            self.made.append((token_slots, mamba_slots))

    room = Room()
    before = sp.pool_state_fingerprint(target)
    with pytest.raises(hf.CapacityError) as e:
        _resume(target, tmp_path / "r.hsnap", room=room)
    assert "ping-pong" in str(e.value) and room.made == []
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []


def test_a_failure_building_the_req_leaves_the_target_untouched(tmp_path):
    """The Req is built (SGLang's constructor, target-specific kwargs) before any slot is taken."""
    ps, req = _source("swa_mamba")
    _snapshot(ps, req, tmp_path / "r.hsnap")
    target = io_cases.target("swa_mamba", 1)
    before = sp.pool_state_fingerprint(target)
    with pytest.raises(TypeError):
        _resume(target, tmp_path / "r.hsnap", req_kwargs={"no_such_constructor_argument": 1})
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []


def test_binding_refuses_a_state_of_another_step_than_the_requests_record(tmp_path):
    """The KV rows restored hold the prompt and every output but the last: a record one step off (a stale link's,
    once: a TP set's final link taken for an earlier one) would decode on from the wrong token.  Refused, typed,
    before the request is touched."""
    from types import SimpleNamespace

    from hsnap_sglang.req.bind import binder

    ps, req = _source("hybrid_linear")
    committed = len(req.origin_input_ids) + len(req.output_ids) - 1
    import dataclasses

    kv_before = {f.name: getattr(req.kv, f.name) for f in dataclasses.fields(req.kv)}
    for off in (-1, 1):
        restored = SimpleNamespace(state_position=committed + off, req_pool_idx=0, mamba_pool_idx=None, swa_evict_floor=0)
        with pytest.raises(hf.IncompatibleSnapshotError, match="state_position"):
            binder(req, {}, None, ps.req_to_token_pool, 0)(restored)
        assert {f.name: getattr(req.kv, f.name) for f in dataclasses.fields(req.kv)} == kv_before
