"""The SGLang ``Req`` resume paths (``resume_req``,
``load_retracted``) hold like the core restore.

Hostile records are written by the project's own writer (``export_request`` with an
edited :class:`RequestRecord`): self-consistent, re-signed files that pass every
integrity check and reach the request checks behind them. Real SGLang pools, real
``Req`` objects, SGLang's own ``SamplingParams``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import io_cases  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_testing import reqs as sr  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import localfs  # noqa: E402
from hsnap_io import export_request  # noqa: E402
from hsnap_sglang import req as hs  # noqa: E402
from hsnap_sglang.req import bind, fields  # noqa: E402
from hsnap_sglang.req.record import UnsupportedRequestError, req_record  # noqa: E402

KINDS = ["swa_mamba", "hybrid_linear"]  # SWA slots + a separate Mamba pool; Mamba in the KV pool


def _source(kind="swa_mamba", seed=1, pool_seed=3, **case_over):
    ps = sp.build(kind, size=512)
    sp.occupy(ps, 2, 37, seed=5)
    case = {**sr.random_case(seed), **case_over}
    req, _ = sr.decode_req(ps, case, pool_seed=pool_seed)
    return ps, req


def _write(ps, req, path, edit=None):
    """``req`` as snapshot_req writes it, the record edited by ``edit(record)`` first:
    written by the project's writer, so every digest and check of the file is honest."""
    record, swa_start = req_record(req, path=path)
    if edit is not None:
        edit(record)
    export_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                   req_pool_idx=int(req.kv.req_pool_idx), record=record, identity=io_cases.identity(), swa_start=swa_start)
    return str(path)


def _resume(ps, path, **kw):
    kw.setdefault("tokenizer", sr.tokenizer())
    return hs.resume_req(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                         identity=io_cases.identity(), **kw)


def free_counts(ps) -> dict[str, int]:
    """Free rows, token slots, SWA slots and Mamba slots of a pool set."""
    rtp, alloc = ps.req_to_token_pool, ps.token_to_kv_pool_allocator
    out = {"rows": rtp.available_size(), "token slots": alloc.available_size()}
    if ps.has_swa:
        out["swa slots"] = alloc.swa_available_size()
    if ps.has_mamba:
        out["mamba slots"] = rtp.mamba_allocator.available_size()
    return out


def _assert_refused_untouched(target, call, field=None, error=hf.HsnapError, tries=3):
    """``call()`` raises ``error`` (typed) ``tries`` times; the target's free counts and every
    pool byte, free list and mapping are as before."""
    counts, before = free_counts(target), sp.pool_state_fingerprint(target)
    for _ in range(tries):
        with pytest.raises(hf.HsnapError) as e:
            call()
        assert isinstance(e.value, error), f"{type(e.value).__name__}: {e.value}"
        if field is not None:
            assert e.value.field == field, str(e.value)
        assert "\n" not in str(e.value)
    assert free_counts(target) == counts
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []
    return e.value


def _set_extra(key, value):
    def edit(record):
        record.extra[key] = value

    return edit


def _set_sampling(name, value, encoded=False):
    """Set ``request.sampling[name]`` (``encoded``: a JSON text, listed in ``__json__``)."""

    def edit(record):
        if name == "__json__":
            record.sampling[name] = value
            return
        record.sampling[name] = json.dumps(value) if encoded else value
        names = [n for n in record.sampling["__json__"] if n != name]
        record.sampling["__json__"] = names + [name] if encoded else names

    return edit


# --------------------------------------------------------------------------- malformed extras leak no slots


MALFORMED_KV_EXTRAS = [
    ("sglang.ReqKvInfo.component_evicted_seqlens", '{"NOPE":1}'),
    ("sglang.ReqKvInfo.component_evicted_seqlens", "[1,2]"),
    ("sglang.ReqKvInfo.component_evicted_seqlens", '{"SWA":"x"}'),
    ("sglang.ReqKvInfo.swa_evict_floor", "x"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key,value", MALFORMED_KV_EXTRAS, ids=[f"{k.rsplit('.', 1)[1]}={v}" for k, v in MALFORMED_KV_EXTRAS])
def test_resume_req_malformed_extra_leaks_no_slots(tmp_path, kind, key, value):
    """The reported malformed values, three tries each: typed refusal, nothing allocated (rows,
    token, SWA and Mamba slots, every byte of the pools as before)."""
    ps, req = _source(kind)
    path = _write(ps, req, tmp_path / "r.hsnap", _set_extra(key, value))
    target = io_cases.target(kind, 1)
    _assert_refused_untouched(target, lambda: _resume(target, path), field=f"request.extra.{key}", error=hf.MalformedHeaderError)


def _retracted(kind, tmp_path, edit=None, pool_seed=3, name="r.hsnap"):
    """A request retracted to disk (the file written with ``edit`` applied to its record),
    its pools and tree cache."""
    from test_retract import tree_cache

    from hsnap_sglang.retract import retract_to_disk

    ps, req = _source(kind, seed=21, pool_seed=pool_seed)
    tc = tree_cache(ps)
    path = str(tmp_path / name)
    if edit is None:
        retract_to_disk(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                        tree_cache=tc, identity=io_cases.identity())
    else:  # the record retract_to_disk writes, edited; then SGLang's own release, as retract_to_disk does
        from sglang.srt.managers.schedule_batch import release_req

        _write(ps, req, path, edit)
        release_req(req=req, remaing_req_count=0, req_to_token_pool=ps.req_to_token_pool,
                    token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, tree_cache=tc, hisparse_coordinator=None, offload_kv=False)
    return ps, req, path


@pytest.fixture
def scheduler_context():
    """release_req reads the scheduler's published config (as in tests/test_retract.py)."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 64
    with use_context(create_context(args, role="scheduler")):
        yield


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key,value", MALFORMED_KV_EXTRAS, ids=[f"{k.rsplit('.', 1)[1]}={v}" for k, v in MALFORMED_KV_EXTRAS])
def test_load_retracted_malformed_extra_leaks_no_slots(tmp_path, scheduler_context, kind, key, value):
    from hsnap_sglang.retract import load_retracted

    ps, req, path = _retracted(kind, tmp_path, _set_extra(key, value))
    sp.occupy(ps, 1, 30, seed=77)  # other requests take the freed slots
    kv_before = {k: getattr(req.kv, k) for k in ("req_pool_idx", "kv_committed_len", "mamba_pool_idx")}
    _assert_refused_untouched(
        ps,
        lambda: load_retracted(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                               identity=io_cases.identity()),
        field=f"request.extra.{key}",
        error=hf.MalformedHeaderError,
    )
    assert req.is_retracted and {k: getattr(req.kv, k) for k in kv_before} == kv_before


def _fail_after(monkeypatch, obj, name):
    """``obj.name`` runs, then raises: a failure after the restore allocated."""
    original = getattr(obj, name)

    def failing(*a, **kw):
        original(*a, **kw)
        raise RuntimeError(f"injected after {name}")

    monkeypatch.setattr(obj, name, failing)


@pytest.mark.parametrize("kind", KINDS)
def test_failure_after_allocation_gives_every_allocation_back(tmp_path, monkeypatch, kind):
    """Binding the Req to the restored slots fails after the upload: every allocation comes
    back (and, with exact_rollback, every byte), the error is typed and names the step."""
    ps, req = _source(kind)
    path = _write(ps, req, tmp_path / "r.hsnap")
    target = io_cases.target(kind, 1)
    _fail_after(monkeypatch, bind, "bind_restored")
    err = _assert_refused_untouched(target, lambda: _resume(target, path, exact_rollback=True), field="bind", tries=2)
    assert type(err).__name__ == "UploadError" and "every allocation was given back" in str(err)
    counts = free_counts(target)  # without exact_rollback: every allocation back, free slots' bytes not restored
    with pytest.raises(hf.HsnapError):
        _resume(target, path)
    assert free_counts(target) == counts


def test_ping_pong_failure_after_allocation_gives_the_track_slots_back(tmp_path, monkeypatch):
    """On a target with Mamba ping-pong track buffers the track slots are taken after the
    restore: a failure there gives back the restore's slots and the track slots."""
    from test_sglang_req import _ping_pong_target

    ps, req = _source("hybrid_linear")
    path = _write(ps, req, tmp_path / "r.hsnap")
    target = _ping_pong_target(mamba_size=8)
    _fail_after(monkeypatch, target.req_to_token_pool, "_alloc_ping_pong_buffer")
    counts, before = free_counts(target), sp.pool_state_fingerprint(target)
    for _ in range(3):
        with pytest.raises(hf.HsnapError) as e:
            _resume(target, path, exact_rollback=True)
        assert e.value.field == "bind"
    assert free_counts(target) == counts
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(target)) == []
    assert target.req_to_token_pool.mamba_allocator.available_size() == counts["mamba slots"]


def test_bind_failure_after_a_resharded_restore_gives_every_allocation_back(tmp_path):
    """The re-sharded path (TP 2 set into TP 1 pools) runs bind inside the same rollback."""
    from hsnap_testing import tp_pools as rp

    from hsnap_io import reshard
    from hsnap_io.adapters import view_pools
    from hsnap_io.restore import open_source, restore_opened

    m = rp.MODELS["qwen35"]
    path = rp.export_set(m, 2, rp.global_state(m), tmp_path / "set")
    ps = rp.build(m, 1, 0, seed=77)
    free = {b.name: rp.as_bytes(b.buffer) for b in view_pools(ps.rtp, ps.alloc).bindings}
    state = (list(ps.rtp.free_slots), rp.as_bytes(ps.alloc.free_pages.clone()), rp.as_bytes(ps.rtp.req_to_token),
             rp.as_bytes(ps.rtp.mamba_allocator.free_slots.clone()))

    def bind(restored):
        assert restored.source_ranks  # the re-sharded path did run
        raise RuntimeError("injected in bind")

    identity = rp.identity(1, 0)
    with open_source(path, identity=identity, sharding=reshard.describe(m.tp, 1, 0)) as source:
        assert source.resharded
        with pytest.raises(hf.HsnapError) as e:
            restore_opened(source, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=identity, bind=bind,
                           exact_rollback=True)
    assert e.value.field == "bind"
    assert (list(ps.rtp.free_slots), rp.as_bytes(ps.alloc.free_pages.clone()), rp.as_bytes(ps.rtp.req_to_token),
            rp.as_bytes(ps.rtp.mamba_allocator.free_slots.clone())) == state
    assert {b.name: rp.as_bytes(b.buffer) for b in view_pools(ps.rtp, ps.alloc).bindings} == free


# --------------------------------------------------------------------------- malformed extras and sampling: typed before the pools

DEEP = "[" * 400_000 + "]" * 400_000

MALFORMED_EXTRAS = [
    # (key, stored value, why)
    ("sglang.ReqKvInfo.component_evicted_seqlens", DEEP, "400k-deep JSON"),
    ("sglang.ReqKvInfo.component_evicted_seqlens", "{not json", "JSONDecodeError"),
    ("sglang.ReqKvInfo.component_evicted_seqlens", 7, "not a JSON text"),
    ("sglang.ReqKvInfo.component_evicted_seqlens", '{"SWA": -3}', "negative cursor"),
    ("sglang.ReqKvInfo.component_evicted_seqlens", '{"SWA": 5}', "SWA cursor other than swa_start"),
    ("sglang.ReqKvInfo.component_evicted_seqlens", '{"SWA": 6, "C128": 2}', "a component hsnap does not restore"),
    ("sglang.ReqKvInfo.swa_evict_floor", 10**15, "past the committed positions"),
    ("sglang.ReqKvInfo.swa_evict_floor", True, "a bool for an int"),
    ("sglang.ReqLogprob.input_token_logprobs_val", DEEP, "400k-deep JSON"),
    ("sglang.ReqLogprob.input_top_logprobs_val", "[[[[1]]]]", "nested too deep for its shape"),
    ("sglang.ReqLogprob.output_token_ids_logprobs_idx", '[["a"]]', "strings for ids"),
    ("sglang.ReqLogprob.top_logprobs_num", "3", "a string for an int"),
    ("sglang.ReqLogprob.token_ids_logprob", [1, 10**12], "an id past the vocabulary"),
    ("sglang.ReqLogprob.output_token_logprobs_idx", [1.5], "a float id"),
    ("sglang.Req.kv_hints", '{"x": 1}', "not a KvHintsEnvelope"),
    ("sglang.Req.kv_hints", DEEP, "400k-deep JSON"),
    ("sglang.Req.bootstrap_room", "1" * 5000, "a 5,000-digit integer"),
    ("sglang.Req.bootstrap_room", "-1", "negative room"),
    ("sglang.Req.eos_token_ids", [-1], "negative id"),
    ("sglang.Req.eos_token_ids", "x", "not a list"),
    ("sglang.Req.stream", "yes", "a string for a bool"),
    ("sglang.Req.priority", 1.5, "a float for an int"),
    ("sglang.Req.sampling_logprobs_mode", "bogus", "not a SamplingLogprobsMode"),
    ("sglang.Req.send_decode_id_offset", 10**9, "past the output"),
    ("sglang.Req.logprob_start_len", -7, "below -1"),
    ("sglang.Req.surr_offset", 10**6, "past the prompt"),
    ("sglang.Req.decoded_text", None, "null text"),
    ("sglang.Req.lora_id", 5, "an int for a string"),
    ("sglang.Req.spec_cap_lens_histogram", [1, -2], "negative count"),
    ("sglang.Req.bootstrap_port", 70000, "not a port"),
]


@pytest.mark.parametrize("key,value,why", MALFORMED_EXTRAS, ids=[w for *_, w in MALFORMED_EXTRAS])
def test_resume_req_malformed_extras_are_typed_before_the_pools(tmp_path, key, value, why):
    ps, req = _source("swa_mamba", detok=True)
    path = _write(ps, req, tmp_path / "r.hsnap", _set_extra(key, value))
    target = io_cases.target("swa_mamba", 1)
    err = _assert_refused_untouched(target, lambda: _resume(target, path), field=f"request.extra.{key}", error=hf.MalformedHeaderError, tries=1)
    assert str(path) in str(err)


MALFORMED_SAMPLING = [
    (_set_sampling("__json__", 5), "request.sampling.__json__"),
    (_set_sampling("__json__", ["not_a_field"]), "request.sampling.__json__"),
    (_set_sampling("logit_bias", DEEP), "request.sampling.logit_bias"),  # a JSON text of 400k-deep brackets
    (lambda r: (r.sampling.__setitem__("logit_bias", DEEP), r.sampling["__json__"].append("logit_bias")), "request.sampling.logit_bias"),
    (_set_sampling("temperature", "hot"), "request.sampling.temperature"),
    (_set_sampling("top_k", 2**70, encoded=True), "request.sampling.top_k"),
    (lambda r: r.sampling.pop("top_p"), "request.sampling.top_p"),
    (_set_sampling("stop_token_ids", [1, "x"], encoded=True), "request.sampling.stop_token_ids"),
    (_set_sampling("watermark", {"enabled": "yes"}, encoded=True), "request.sampling.watermark"),
]


@pytest.mark.parametrize("edit,field", MALFORMED_SAMPLING, ids=[f"{i}-{f.rsplit('.', 1)[1]}" for i, (_, f) in enumerate(MALFORMED_SAMPLING)])
def test_resume_req_malformed_sampling_is_typed_before_the_pools(tmp_path, edit, field):
    ps, req = _source("hybrid_linear")
    path = _write(ps, req, tmp_path / "r.hsnap", edit)
    target = io_cases.target("hybrid_linear", 1)
    _assert_refused_untouched(target, lambda: _resume(target, path), field=field, error=hf.MalformedHeaderError, tries=1)


# --------------------------------------------------------------------------- the file opened once


def _rename_after_first_open(monkeypatch, path, replacement):
    """Count the opens of ``path``; right after the first, rename ``replacement`` over it
    (deterministically, where the old code read the record and opened again)."""
    opens = []
    original = localfs.open_regular

    def counting(p, *a, **kw):
        out = original(p, *a, **kw)
        if os.fspath(p) == os.fspath(path):
            opens.append(p)
            if len(opens) == 1:
                os.replace(replacement, path)
        return out

    monkeypatch.setattr(localfs, "open_regular", counting)
    return opens


def test_resume_req_opens_the_file_once(tmp_path, monkeypatch):
    """File B (another request, other KV) is renamed over the path right after the first
    open: the resumed Req holds A's tokens and A's KV, from one open."""
    ps_a, req_a = _source("swa_mamba", seed=1, pool_seed=3)
    ps_b, req_b = _source("swa_mamba", seed=2, pool_seed=4)
    rows_a = sr.req_rows(ps_a, req_a)
    path = _write(ps_a, req_a, tmp_path / "r.hsnap")
    other = _write(ps_b, req_b, tmp_path / "b.hsnap")
    assert list(req_a.output_ids) != list(req_b.output_ids)
    target = io_cases.target("swa_mamba", 1)
    opens = _rename_after_first_open(monkeypatch, path, other)
    got = _resume(target, path)
    assert len(opens) == 1
    assert list(got.output_ids) == list(req_a.output_ids) and list(got.origin_input_ids) == list(req_a.origin_input_ids)
    rows = sr.req_rows(target, got)
    assert all(torch.equal(rows[k], rows_a[k]) for k in rows_a if k != "swa_mask" and not k.startswith(("k.L0", "v.L0", "k.L2", "v.L2")))
    assert all(torch.equal(rows[k], rows_a[k]) for k in rows_a if k.startswith("mamba."))
    with hf.open(path) as now:  # the path holds B now: what was restored is not what is there
        assert now.record().rid == req_b.rid


def test_load_retracted_opens_the_file_once(tmp_path, monkeypatch, scheduler_context):
    """B is the same request retracted from pools with other KV bytes: the old code checked
    A's record, then uploaded B's state."""
    from hsnap_sglang.retract import load_retracted

    ps, req, path = _retracted("hybrid_linear", tmp_path, pool_seed=3, name="a.hsnap")
    _, req_b, other = _retracted("hybrid_linear", tmp_path, pool_seed=4, name="b.hsnap")
    with hf.open(path) as a, hf.open(other) as b:
        state_a = {s.name: a.read(s).tobytes() for s in a if s.is_state}
        state_b = {s.name: b.read(s).tobytes() for s in b if s.is_state}
        assert a.record().rid == b.record().rid and state_a.keys() == state_b.keys()
    differ = [k for k in state_a if state_a[k] != state_b[k]]
    assert differ
    opens = _rename_after_first_open(monkeypatch, path, other)
    load_retracted(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                   identity=io_cases.identity())
    assert len(opens) == 1
    rows = io_cases.rows_as_bytes(sr.req_rows(ps, req))  # the request's rows as the pools hold them now
    with hf.open(path) as now:  # B's bytes, now under the path
        assert {s.name: now.read(s).tobytes() for s in now if s.is_state} == state_b
    attn = [k for k in state_a if k.startswith("attn.")]  # attn.<layer>.<k|v> <-> rows <k|v>.L<layer>
    assert attn and any(k in differ for k in attn)
    for k in attn:
        _, layer, part = k.split(".")
        assert rows[f"{part}.L{layer}"].tobytes() == state_a[k], k


def test_resharded_restore_opens_the_set_once(tmp_path, monkeypatch):
    """The re-sharded path read the manifest from one open and restored from a second."""
    from hsnap_testing import tp_pools as rp

    from hsnap_format import manifest as hf_manifest
    from hsnap_io import reshard, restore_request

    m = rp.MODELS["gqa"]
    path = rp.export_set(m, 2, rp.global_state(m), tmp_path / "set")
    opened = []
    original = hf_manifest.SnapshotSet.__init__

    def counting(self, *a, **kw):
        opened.append(a)
        original(self, *a, **kw)

    monkeypatch.setattr(hf_manifest.SnapshotSet, "__init__", counting)
    ps = rp.build(m, 1, 0, seed=77)
    restored = restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(1, 0),
                               sharding=reshard.describe(m.tp, 1, 0))
    assert restored.source_ranks == (0, 1)
    assert len(opened) == 1


# --------------------------------------------------------------------------- what a fresh request is refused


def _set_output_id(value):
    def edit(record):
        record.output_ids[-1] = value

    return edit


def _set_prompt_id(value):
    def edit(record):
        record.prompt_ids[0] = value

    return edit


FRESH_REQUEST_REFUSALS = [
    ("max_new_tokens=-5", _set_sampling("max_new_tokens", -5), ("request.sampling.max_new_tokens", "request.stop.max_new_tokens")),
    ("temperature=-1", _set_sampling("temperature", -1.0), "request.sampling.temperature"),
    ("top_p=0", _set_sampling("top_p", 0.0), "request.sampling.top_p"),
    ("top_k=0", _set_sampling("top_k", 0), "request.sampling.top_k"),
    ("min_p=2", _set_sampling("min_p", 2.0), "request.sampling.min_p"),
    ("repetition_penalty=0", _set_sampling("repetition_penalty", 0.0), "request.sampling.repetition_penalty"),
    ("frequency_penalty=9", _set_sampling("frequency_penalty", 9.0), "request.sampling.frequency_penalty"),
    ("logit_bias out of vocab", _set_sampling("logit_bias", {"99999": 1.0}, encoded=True), "request.sampling.logit_bias"),
    ("n=4", _set_sampling("n", 4), "request.sampling.n"),
    ("beam_width=4", _set_sampling("beam_width", 4), "request.sampling.beam_width"),
    ("is_normalized=False", _set_sampling("is_normalized", False), "request.sampling.is_normalized"),
    ("sampling_seed=2**64", _set_sampling("sampling_seed", 2**64, encoded=True), "request.sampling.sampling_seed"),
    ("two grammars", lambda r: (_set_sampling("regex", "a+")(r), _set_sampling("ebnf", 'root ::= "a"')(r)), "request.sampling"),
    ("output id 2**31-1", _set_output_id(2**31 - 1), "request.output_ids[-1]"),
    ("prompt id = vocab", _set_prompt_id(sr.vocab_size()), "request.prompt_ids[0]"),
    ("vocab_size=-1", _set_extra("sglang.Req.vocab_size", -1), "request.extra.sglang.Req.vocab_size"),
    ("vocab_size=null", _set_extra("sglang.Req.vocab_size", None), "request.extra.sglang.Req.vocab_size"),
    ("max_new_tokens agrees nowhere", _set_sampling("max_new_tokens", 10**6), "request.stop.max_new_tokens"),
    ("stop strings differ", _set_sampling("stop_strs", ["other"]), "request.stop.stop_strings"),
]


@pytest.mark.parametrize("edit,field", [c[1:] for c in FRESH_REQUEST_REFUSALS], ids=[c[0] for c in FRESH_REQUEST_REFUSALS])
def test_resume_req_refuses_what_a_fresh_request_is_refused(tmp_path, edit, field):
    ps, req = _source("hybrid_linear", return_logprob=True, top_logprobs_num=3)
    path = _write(ps, req, tmp_path / "r.hsnap", edit)
    n_out = len(req.output_ids)
    target = io_cases.target("hybrid_linear", 1)
    err = _assert_refused_untouched(target, lambda: _resume(target, path), error=hf.MalformedHeaderError, tries=1)
    fields = field if isinstance(field, tuple) else (field,)
    assert err.field in tuple(f.replace("[-1]", f"[{n_out - 1}]") for f in fields), str(err)


def test_the_rules_are_sglangs_own(tmp_path):
    """Control: the values refused above are refused by SGLang for a fresh request too, and
    the unedited file resumes (the refusals come from the edit, not from the case)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": 0}, {"max_new_tokens": -5}, {"logit_bias": {"99999": 1.0}}):
        p = SamplingParams(**bad)
        p.normalize(sr.tokenizer())
        with pytest.raises(ValueError):
            p.verify(sr.vocab_size())
    ps, req = _source("hybrid_linear", return_logprob=True, top_logprobs_num=3)
    path = _write(ps, req, tmp_path / "r.hsnap")
    got = _resume(io_cases.target("hybrid_linear", 1), path)
    assert list(got.output_ids) == list(req.output_ids)


def test_a_top_logprob_id_past_the_vocabulary_is_refused(tmp_path):
    ps, req = _source("hybrid_linear", return_logprob=True, top_logprobs_num=3)

    def edit(record):
        record.top_logprob_ids[0, 1] = sr.vocab_size() + 5

    path = _write(ps, req, tmp_path / "r.hsnap", edit)
    target = io_cases.target("hybrid_linear", 1)
    err = _assert_refused_untouched(target, lambda: _resume(target, path), error=hf.MalformedHeaderError, tries=1)
    assert err.field == "request.top_logprob_ids[0][1]"


def test_a_carried_vocab_size_other_than_the_targets_is_refused(tmp_path):
    """A fresh Req gets the target model's vocabulary size (SGLang's scheduler passes
    model_config.vocab_size): a record carrying another one — 2**31-1 with ids all below
    it — is refused before the pools; the true size resumes."""
    ps, req = _source("hybrid_linear")

    def edit(record):
        record.extra["sglang.Req.vocab_size"] = 2**31 - 1

    path = _write(ps, req, tmp_path / "r.hsnap", edit)
    target = io_cases.target("hybrid_linear", 1)
    err = _assert_refused_untouched(target, lambda: _resume(target, path, vocab_size=sr.vocab_size()),
                                    error=hf.IncompatibleSnapshotError, tries=1)
    assert "vocab_size" in str(err) and str(2**31 - 1) in str(err)
    good = _write(ps, req, tmp_path / "g.hsnap")
    assert _resume(target, good, vocab_size=sr.vocab_size()).vocab_size == sr.vocab_size()


def test_stop_strings_without_a_tokenizer_are_refused_before_the_pools(tmp_path):
    ps, req = _source("hybrid_linear", params={"max_new_tokens": 40, "stop": ["</answer>"]})
    path = _write(ps, req, tmp_path / "r.hsnap")
    target = io_cases.target("hybrid_linear", 1)
    err = _assert_refused_untouched(target, lambda: _resume(target, path, tokenizer=None), tries=1)
    assert err.field == "resume_req(tokenizer=...)" and "stop_strs" in str(err)


# --------------------------------------------------------------------------- ids past int32, PD and stream fields


@pytest.mark.parametrize("where,value", [("output", 2**31 + 7), ("output", 2**64 + 1), ("prompt", 2**31), ("top", 2**31 + 1)])
def test_token_id_past_int32_is_named_with_path_and_field(tmp_path, where, value):
    """The range check runs before any cast: the id is reported as itself, with the file
    and the field, and nothing is written."""
    ps, req = _source("hybrid_linear", return_logprob=True, top_logprobs_num=3)
    field = {"output": f"Req.output_ids[{len(req.output_ids) - 1}]", "prompt": "Req.origin_input_ids[0]", "top": "ReqLogprob.output_top_logprobs_idx[0][2]"}[where]
    if where == "output":
        req.output_ids = list(req.output_ids[:-1]) + [value]
    elif where == "prompt":
        req.origin_input_ids = list(req.origin_input_ids)
        req.origin_input_ids[0] = req.origin_input_ids_unpadded = value
        req.origin_input_ids_unpadded = req.origin_input_ids
    else:
        req.logprob.output_top_logprobs_idx[0][2] = value
    path = tmp_path / "r.hsnap"
    with pytest.raises(UnsupportedRequestError) as e:
        hs.snapshot_req(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                        identity=io_cases.identity())
    assert (e.value.path, e.value.field, e.value.found) == (str(path), field, value)
    assert str(value) in str(e.value) and str(path) in str(e.value)
    assert os.listdir(tmp_path) == []


def _envelope():
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    return decode_kv_hints_envelope({"protocol_version": "1", "message_id": "m-7",
                                     "actions": [{"action_id": "a", "action_type": "pin", "action_version": "1", "payload": {"n": [1, 2]}}]})


def test_pd_rebootstrap_fields_and_kv_hints_are_carried(tmp_path):
    """bootstrap_host/port/room and disagg_prefill_dp_rank re-bootstrap a retracted decoding
    request on a PD decode server (Req.build_rebootstrap_payload); kv_hints are client-given
    like routing_key and cache_salt: a resumed request keeps them all."""
    ps, req = _source("hybrid_linear")
    req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = "10.0.0.7", 8998, 2**62 + 5
    req.disagg_prefill_dp_rank, req.routed_dp_rank = 1, 1
    req.kv_hints, req.routing_key, req.cache_salt = _envelope(), "route-9", "salt-3"
    path = _write(ps, req, tmp_path / "r.hsnap")
    got = _resume(io_cases.target("hybrid_linear", 1), path)
    assert got.build_rebootstrap_payload() == req.build_rebootstrap_payload()
    assert got.kv_hints == req.kv_hints and type(got.kv_hints) is type(req.kv_hints)
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank", "kv_hints", "routing_key", "cache_salt"):
        assert fields.TABLES["Req"][name].disposition == fields.CARRIED, name


def test_http_worker_ipc_is_caller_supplied_and_required_with_several_workers(tmp_path):
    """The source's worker names a socket of the source server; the target's own worker is
    given at resume, and a server with several tokenizer workers (which routes each stream
    by it) refuses to guess."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    ps, req = _source("hybrid_linear")
    req.http_worker_ipc = "ipc:///tmp/source-worker-3"
    path = _write(ps, req, tmp_path / "r.hsnap")
    target = io_cases.target("hybrid_linear", 1)
    assert fields.TABLES["Req"]["http_worker_ipc"].disposition == fields.REDERIVED
    with use_context(create_context(ServerArgs(model_path="dummy", tokenizer_worker_num=2), role="scheduler")):
        err = _assert_refused_untouched(target, lambda: _resume(target, path), field="Req.http_worker_ipc", tries=1)
        assert "http_worker_ipc" in str(err) and "2 tokenizer workers" in str(err)
        got = _resume(target, path, http_worker_ipc="ipc:///tmp/target-worker-1")
        assert got.http_worker_ipc == "ipc:///tmp/target-worker-1"
    with pytest.raises(hf.HsnapError):  # not a string: typed
        _resume(target, path, http_worker_ipc=5)
    single = _resume(target, path)  # no published config: one worker, nothing to route
    assert single.http_worker_ipc is None


def test_field_table_classifies_the_pd_and_stream_fields():
    rows = {name: fields.TABLES["Req"][name] for name in ("http_worker_ipc", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                                                      "disagg_prefill_dp_rank", "kv_hints", "routing_key", "cache_salt")}
    assert rows.pop("http_worker_ipc").disposition == fields.REDERIVED
    assert {n: f.disposition for n, f in rows.items()} == {n: fields.CARRIED for n in rows}
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "sglang.md"), encoding="utf-8").read()
    assert "`http_worker_ipc` is **given by the target**" in text.split(fields.DOC_BEGIN)[0]  # explained outside the generated table


# --------------------------------------------------------------------------- the restored SWA bookkeeping


def test_resumed_swa_request_frees_exactly_its_own_slots(tmp_path, scheduler_context):
    """SGLang's own release of a resumed SWA request (window-evicted positions present,
    prefill-aware shield set at the source) gives back exactly the slots the resume took:
    no SWA slot freed twice, none leaked."""
    from sglang.srt.managers.schedule_batch import release_req
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from test_retract import tree_cache

    ps, req = _source("swa_mamba", seed=4)
    req.kv.swa_evict_floor = 3  # a prefill-aware shield below the eviction cursor (6)
    assert req.kv.get_evicted_seqlen(ComponentType.SWA) == 6
    path = _write(ps, req, tmp_path / "r.hsnap")
    target = io_cases.target("swa_mamba", 1)
    counts = free_counts(target)
    got = _resume(target, path)
    assert got.kv.get_evicted_seqlen(ComponentType.SWA) == 6
    release_req(req=got, remaing_req_count=0, req_to_token_pool=target.req_to_token_pool,
                token_to_kv_pool_allocator=target.token_to_kv_pool_allocator, tree_cache=tree_cache(target), hisparse_coordinator=None,
                offload_kv=False)
    assert free_counts(target) == counts
    alloc = target.token_to_kv_pool_allocator
    swa_free = alloc.swa_attn_allocator.free_pages if hasattr(alloc, "swa_attn_allocator") else None
    if swa_free is not None:
        assert len(set(swa_free.tolist())) == len(swa_free.tolist())  # no slot on the free list twice
