"""hsnap_sglang.req on a request as SGLang's server leaves it, with SGLang's own pools on CPU.

SGLang's output streamer sets ``Req.send_decode_id_offset`` to ``len(surr_and_decode_ids)`` — the prompt tail used
as the detokenizer's context (up to 5 tokens) plus the output sent — so on every streamed request it exceeds the
number of output tokens.  resume_req refused exactly that (it bounded the offset by the output length), so no
request snapshotted in a running server could be resumed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import io_cases  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_testing import reqs as sr  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import MalformedHeaderError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:max_rollback_tokens is deprecated:DeprecationWarning")


def _served_req(seed: int = 3):
    """A decoding Req whose detokenizer offsets are what SGLang's output streamer writes after each send."""
    ps = sp.build("hybrid_linear", size=512, page_size=1)
    case = {**sr.random_case(seed), "detok": True}
    case["streamed"] = len(case["output"])
    req, _ = sr.decode_req(ps, case)
    decode_ids, _ = req.init_incremental_detokenize()  # as _GenerationStreamAccumulator.accept
    req.send_decode_id_offset = len(decode_ids)
    assert req.send_decode_id_offset > len(req.output_ids)  # the prompt context is part of it
    return ps, req


def test_resume_req_accepts_the_detokenizer_offset_sglang_streams_with(tmp_path):
    from hsnap_sglang.req import resume_req, snapshot_req

    ps, req = _served_req()
    path = str(tmp_path / "served.hsnap")
    pools = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)
    snapshot_req(path, req, identity=io_cases.identity(), **pools)
    target = sp.build("hybrid_linear", size=512, page_size=1)
    back = resume_req(path, req_to_token_pool=target.req_to_token_pool, token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
                      identity=io_cases.identity(), tokenizer=sr.tokenizer())
    assert back.send_decode_id_offset == req.send_decode_id_offset
    assert list(back.surr_and_decode_ids) == list(req.surr_and_decode_ids)


def test_detokenizer_offset_past_its_ids_is_refused_by_name(tmp_path):
    from hsnap_sglang.req import snapshot_req
    from hsnap_sglang.req.record import decode_carried

    ps, req = _served_req(5)
    path = str(tmp_path / "served.hsnap")
    snapshot_req(path, req, identity=io_cases.identity(), req_to_token_pool=ps.req_to_token_pool,
                 token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)
    with hf.open(path) as snap:
        record = snap.record()
    bound = len(req.origin_input_ids) - req.surr_offset + req.cur_decode_ids_len
    assert decode_carried(record, path, swa_start=0)["Req"]["send_decode_id_offset"] == bound
    bad = dataclasses.replace(record, extra={**record.extra, "sglang.Req.send_decode_id_offset": bound + 1})
    with pytest.raises(MalformedHeaderError) as e:
        decode_carried(bad, path, swa_start=0)
    assert e.value.field == "request.extra.sglang.Req.send_decode_id_offset" and e.value.found == bound + 1


def test_resume_req_refuses_a_record_of_another_request_before_allocating(tmp_path):
    from hsnap_format import IncompatibleSnapshotError
    from hsnap_sglang.req import resume_req, snapshot_req

    ps, req = _served_req(7)
    path = str(tmp_path / "served.hsnap")
    snapshot_req(path, req, identity=io_cases.identity(), req_to_token_pool=ps.req_to_token_pool,
                 token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)
    target = sp.build("hybrid_linear", size=512, page_size=1)
    before = (target.req_to_token_pool.available_size(), target.token_to_kv_pool_allocator.available_size(),
              target.req_to_token_pool.mamba_allocator.available_size())
    with pytest.raises(IncompatibleSnapshotError) as e:
        resume_req(path, req_to_token_pool=target.req_to_token_pool, token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
                   identity=io_cases.identity(), tokenizer=sr.tokenizer(), expect_rid="another-request")
    assert e.value.differences == [("request.rid", "another-request", req.rid)]
    assert before == (target.req_to_token_pool.available_size(), target.token_to_kv_pool_allocator.available_size(),
                      target.req_to_token_pool.mamba_allocator.available_size())


def test_resume_req_commit_failure_gives_every_allocation_back(tmp_path):
    """The TP agreement's hook: a ``commit`` that raises (another rank refused) leaves the pools as they were."""
    from hsnap_sglang.req import resume_req, snapshot_req

    ps, req = _served_req(9)
    path = str(tmp_path / "served.hsnap")
    snapshot_req(path, req, identity=io_cases.identity(), req_to_token_pool=ps.req_to_token_pool,
                 token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)
    target = sp.build("hybrid_linear", size=512, page_size=1)
    rtp, alloc = target.req_to_token_pool, target.token_to_kv_pool_allocator
    before = (sorted(rtp.free_slots), alloc.available_size(), rtp.mamba_allocator.available_size())
    calls = []

    def commit():
        calls.append(1)
        raise hf.HsnapError(path, "tp rank 1", detail="refused")

    with pytest.raises(hf.HsnapError, match="tp rank 1"):
        resume_req(path, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, identity=io_cases.identity(), tokenizer=sr.tokenizer(),
                   commit=commit)
    assert calls == [1]
    assert before == (sorted(rtp.free_slots), alloc.available_size(), rtp.mamba_allocator.available_size())
