"""Periodic checkpoints of a running request, at the library level: a live SGLang ``Req`` in real
SGLang pools (hsnap_testing/pools.py) decodes step by step, a :class:`hsnap_format.checkpoints.Checkpoints` writes a
link every M output tokens (plain, then deltas of the link before), the "process" stops at a random step; the newest
committed link resumes into fresh pools exactly as the request was at that link."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import io_cases  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_testing import reqs as sr  # noqa: E402

from hsnap_format import HsnapError, open_chain  # noqa: E402
from hsnap_format.checkpoints import Checkpoints, choose_links, highest_seq, link_name, newest_links, parse_link  # noqa: E402
from hsnap_sglang import req as hs  # noqa: E402
from hsnap_sglang.req.record import req_record  # noqa: E402


def _pools():
    ps = sp.build("hybrid_linear", size=1024)
    sp.occupy(ps, 2, 37, seed=5)
    return ps


def _decode_step(ps, req, rng: random.Random) -> None:
    """One decode step as a scheduler leaves it at a committed boundary: the last output token's KV row written
    into a new slot, the Mamba slot overwritten, a new output token sampled (with its logprob)."""
    n = req.kv.kv_committed_len
    slot = sp.alloc_tokens(ps, 1).to(torch.int64)
    ps.req_to_token_pool.write((req.kv.req_pool_idx, slice(n, n + 1)), slot.to(torch.int32))
    sp.fill_request(ps, sp.RequestRecord(req.kv.req_pool_idx, slot, int(req.kv.mamba_pool_idx), 1, rng.randrange(1 << 30)))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n + 1
    token = rng.randrange(sr.vocab_size())
    req.output_ids.append(token)
    if req.return_logprob:
        req.logprob.output_token_logprobs_val.append(sr.f32(-rng.random()))
        req.logprob.output_token_logprobs_idx.append(token)


def _rows(ps, req) -> dict:
    return {k: v.clone() for k, v in sr.req_rows(ps, req).items()}


CASE = dict(params=dict(max_new_tokens=400, temperature=0.0, ignore_eos=True), return_logprob=True, top_logprobs_num=0,
            token_ids_logprob=None, stop=None, stream=True, detok=False, reasoning="none")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_checkpoint_chain_resumes_the_newest_link_exactly(tmp_path, seed):
    """Every M tokens a link (base = the link before; a fresh plain link after ``rebase_every``); stopped at a random
    step, mid-way between links, with a dead writer's temporary of the next link beside them: the newest committed
    link is the highest number; it opens as a chain down to the plain link, verifies, and resumes into fresh pools
    with the rows, Mamba state, tokens and logprobs the request had at that link."""
    rng = random.Random(seed)
    M = rng.choice([3, 5, 8])
    ps = _pools()
    req, _ = sr.decode_req(ps, {**sr.random_case(seed), **CASE})
    cp = Checkpoints.start(str(tmp_path), "req", every=M, rebase_every=4)
    at_link: dict[str, tuple] = {}
    stop = rng.randrange(6 * M, 12 * M)
    for _ in range(stop):
        if cp.due(len(req.output_ids)):
            cp.write(lambda path, base: hs.snapshot_req(path, req, req_to_token_pool=ps.req_to_token_pool,
                                                        token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                                                        identity=io_cases.identity(), base=base), len(req.output_ids))
            at_link[cp.last] = (_rows(ps, req), list(req.output_ids), list(req.logprob.output_token_logprobs_val), cp.depth)
        _decode_step(ps, req, rng)
    # a writer killed while writing the next link leaves its temporary (a hidden name), never the final name
    nxt = cp.next_link()[0]
    open(os.path.join(tmp_path, f".{os.path.basename(nxt)}.hsnap-tmp-1-deadbeef"), "wb").close()

    newest = newest_links(str(tmp_path))
    assert list(newest) == ["req"] and newest["req"] == cp.last and parse_link(os.path.basename(cp.last)) == ("req", cp.seq)
    assert cp.seq == len(at_link) >= 6 and len(os.listdir(tmp_path)) == cp.seq + 1
    rows, outputs, logprobs, depth = at_link[cp.last]
    with open_chain(cp.last) as chain:  # a delta down to the last plain link (rebase_every 4)
        assert len(chain) == depth and 1 <= depth <= 4
        chain.verify()
    target = sp.build("hybrid_linear", size=1024)
    sp.occupy(target, 3, 11, seed=9)
    got = hs.resume_req(cp.last, req_to_token_pool=target.req_to_token_pool, token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
                        identity=io_cases.identity(), tokenizer=sr.tokenizer())
    assert list(got.output_ids) == outputs and list(got.logprob.output_token_logprobs_val) == logprobs
    resumed = sr.req_rows(target, got)
    assert resumed.keys() == rows.keys()
    for name, value in rows.items():
        assert torch.equal(resumed[name], value), name


def test_checkpoint_numbers_continue_after_existing_links_and_refuse_bad_settings(tmp_path):
    """A checkpointer started where links of its name exist (a request resumed after a crash, checkpointed again into
    the same directory) numbers after the highest — never overwriting — and starts with a plain link; other names and
    temporaries do not count; typed refusals for a bad interval or name."""
    for leaf in (link_name("req", 1), link_name("req", 7), link_name("other", 12), ".req.ck000009.hsnap.hsnap-tmp-1-00", "req.hsnap"):
        open(os.path.join(tmp_path, leaf), "wb").close()
    cp = Checkpoints.start(str(tmp_path), "req", every=4)
    path, base = cp.next_link()
    assert os.path.basename(path) == link_name("req", 8) and base is None
    assert {n: highest_seq(str(tmp_path), n) for n in ("req", "other")} == {"req": 7, "other": 12}
    assert choose_links(str(tmp_path))["req"].path is None  # empty files: numbered like links, but none opens ...
    assert newest_links(str(tmp_path))["req"] == str(tmp_path / link_name("req", 7))  # ... so a resume names the highest, refused typed
    cp.committed(path, 10, None)
    assert not cp.due(13) and cp.due(14) and cp.next_link() == (str(tmp_path / link_name("req", 9)), path)
    for bad in (dict(every=0), dict(every=2.5), dict(every=4, rebase_every=0)):
        with pytest.raises(HsnapError):
            Checkpoints.start(str(tmp_path), "req", **bad)
    with pytest.raises(HsnapError):
        Checkpoints.start(str(tmp_path), "a/b", every=4)


# --------------------------------------------------------------------------- the client's side of a cut stream


def _sse_server(info: dict, events: list[dict]):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("X-Hsnap-Resume", json.dumps(info))
            self.end_headers()
            for e in events:
                self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("incremental, seen, expected", [
    (False, None, (" world!", [3, 4])),  # the client had what the snapshot holds ("Hello", 2 ids)
    (True, None, (" world!", [3, 4])),
    (False, (8, 3), ("rld!", [4])),  # it had read more before the crash: those parts are not given again
    (True, (8, 3), ("rld!", [4])),
    (False, (3, 1), ("lo world!", [2, 3, 4])),  # it had read less: the part it missed comes first
])
def test_client_resume_continues_the_clients_cut_stream(incremental, seen, expected):
    """``client.resume(..., seen=(chars, ids))``: on_chunk gets exactly what lies beyond what the client had, from
    /generate-shaped events carrying the text so far (or, incremental, deltas after the snapshot's part)."""
    from hsnap_sglang import client

    meta = {"id": "c"}
    if incremental:
        events = [{"text": " wor", "output_ids": [3], "meta_info": meta}, {"text": "ld!", "output_ids": [4], "meta_info": meta}]
    else:
        events = [{"text": "Hello wor", "output_ids": [1, 2, 3], "meta_info": meta},
                  {"text": "Hello world!", "output_ids": [1, 2, 3, 4], "meta_info": meta}]
    info = {"path": "/ck", "ok": True, "result": {"rid": "c", "client_had": {"text_chars": 5, "output_ids": 2, "incremental": incremental}}}
    httpd = _sse_server(info, events)
    try:
        got = []
        client.resume(f"http://127.0.0.1:{httpd.server_address[1]}", "/ck", seen=seen, on_chunk=lambda rid, t, ids, e: got.append((t, ids)))
    finally:
        httpd.shutdown()
    assert ("".join(t for t, _ in got), [i for _, ids in got for i in ids]) == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_captured_link_is_the_direct_export_at_capture_time_whatever_decodes_after(tmp_path, seed):
    """The checkpoint writer's split (hsnap_io.export.capture_request at the boundary, write_captured later, off the
    decode path): the rows after the base, the recurrent state and the record are host copies, so decode steps taken
    between capture and write (the Mamba slot overwritten, new rows) change nothing: each link is byte-identical to
    snapshot_req's at the capture boundary (plain and delta), and the chain resumes exactly."""
    import dataclasses

    from hsnap_io.export import capture_request, write_captured

    rng = random.Random(seed)
    ps = _pools()
    req, _ = sr.decode_req(ps, {**sr.random_case(seed), **CASE})
    pools = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)
    base, base_position, last_rows = None, 0, None
    for k in range(4):
        ident = dataclasses.replace(io_cases.identity(), snapshot_id=f"{k:032x}", created_at="2026-01-01T00:00:00.000000Z")
        direct, path = tmp_path / f"d{k}.hsnap", tmp_path / f"req.ck{k + 1:06d}.hsnap"
        record, swa_start = req_record(req, path=str(path))
        hs.snapshot_req(str(direct), req, identity=ident, base=None if base is None else str(tmp_path / f"d{k - 1}.hsnap"), **pools)
        cap = capture_request(req_pool_idx=int(req.kv.req_pool_idx), record=record, identity=ident, swa_start=swa_start,
                              base_position=base_position, **pools)
        rows, outputs = _rows(ps, req), list(req.output_ids)
        for _ in range(rng.randrange(1, 6)):  # the request decodes on while the link waits for the writer
            _decode_step(ps, req, rng)
        if base is not None:  # the base by path (opened and checked) and as held by its writer (not re-opened): one file
            by_path = write_captured(str(tmp_path / f"p{k}.hsnap"), cap, base=base.path)
        link = write_captured(str(path), cap, base=base)
        assert link.info.file_length == os.path.getsize(direct) and link.path == str(path)
        if k == 0:
            assert path.read_bytes() == direct.read_bytes()
        else:
            assert (tmp_path / f"p{k}.hsnap").read_bytes() == path.read_bytes()
            assert dataclasses.replace(by_path.ref, name=link.ref.name) == link.ref and link.ref.depth == k + 1
        base, base_position, last_rows = link, record.state_position, (rows, outputs)
    with pytest.raises(HsnapError):  # a capture whose rows do not start at the base's position is refused by name
        cap = capture_request(req_pool_idx=int(req.kv.req_pool_idx), record=req_record(req)[0], identity=io_cases.identity(),
                              base_position=base_position - 1, **pools)
        write_captured(str(tmp_path / "bad.hsnap"), cap, base=base)
    assert not os.path.exists(tmp_path / "bad.hsnap")
    with open_chain(base.path) as chain:
        assert len(chain) == 4
        chain.verify()
    target = sp.build("hybrid_linear", size=1024)
    got = hs.resume_req(base.path, identity=io_cases.identity(), tokenizer=sr.tokenizer(), req_to_token_pool=target.req_to_token_pool,
                        token_to_kv_pool_allocator=target.token_to_kv_pool_allocator)
    rows, outputs = last_rows
    assert list(got.output_ids) == outputs
    resumed = sr.req_rows(target, got)
    for name, value in rows.items():
        assert torch.equal(resumed[name], value), name


def test_a_capture_reuses_released_memory_and_never_memory_another_capture_holds(tmp_path, monkeypatch):
    """Captures copy into one host buffer each (hsnap_io.export.CAPTURE_BUFFERS): two captures alive at once never
    share memory (the later one holds its own bytes whatever the earlier holds), a released capture's buffer is what
    the next capture takes (no fresh pages faulted in on the scheduler thread), and a released capture is refused
    by write_captured instead of writing whatever the memory holds now."""
    import dataclasses

    import numpy as np

    from hsnap_format.buffers import KeptBuffers
    from hsnap_io import export

    monkeypatch.setattr(export, "CAPTURE_BUFFERS", KeptBuffers(export.CAPTURE_KEEP_BYTES))  # this test's alone
    ps = _pools()
    req, _ = sr.decode_req(ps, {**sr.random_case(7), **CASE})
    pools = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator)

    def capture(k: int):
        ident = dataclasses.replace(io_cases.identity(), snapshot_id=f"{k:032x}", created_at="2026-01-01T00:00:00.000000Z")
        record, swa_start = req_record(req, path=str(tmp_path / f"c{k}.hsnap"))
        return export.capture_request(req_pool_idx=int(req.kv.req_pool_idx), record=record, identity=ident, swa_start=swa_start, **pools)

    first = capture(0)
    held = {name: [np.array(c, copy=True) for c in chunks] for name, chunks in first.sections.items()}
    second = capture(1)
    assert first.backing is not None and second.backing is not None
    assert not np.shares_memory(first.backing, second.backing)
    second.backing[:] = 0xA5  # the later capture's memory overwritten: the earlier one's bytes do not move
    assert all(np.array_equal(c, h) for name in held for c, h in zip(first.sections[name], held[name]))
    written = export.write_captured(str(tmp_path / "first.hsnap"), first)
    first_memory = first.backing
    first.release()
    assert first.released and first.backing is None and first.sections == {}
    third = capture(2)
    assert third.backing is first_memory  # the released memory, taken again
    assert not np.shares_memory(third.backing, second.backing)
    with pytest.raises(ValueError, match="released"):
        export.write_captured(str(tmp_path / "again.hsnap"), first)
    assert not os.path.exists(tmp_path / "again.hsnap")
    with open_chain(written.path) as chain:
        chain.verify()


# --------------------------------------------------------------------------- which link a resume takes


def test_resume_takes_the_highest_verified_position_not_the_highest_link_number(tmp_path, caplog):
    """A link's number only says where it was written: a stray copy of link 1 under a higher number must not
    restart the request at link 1's position, a truncated non-hsnap file or a damaged link there must not block the
    resume. The link taken is the one at the highest position whose chain opens and verifies; each link passed
    over is reported (and logged) with its reason, and a new link is still numbered after the highest number."""
    import shutil

    import test_pagestore as tp

    d = str(tmp_path)
    t = tp.tokens_for([], 41, seed=7)
    tp.write_plain(os.path.join(d, link_name("c", 1)), t[:21], "c")  # position 20
    tp.write_plain(os.path.join(d, link_name("c", 2)), t, "c")  # position 40: the newest
    shutil.copy(os.path.join(d, link_name("c", 1)), os.path.join(d, link_name("c", 20)))  # a stray copy of link 1
    with open(os.path.join(d, link_name("c", 21)), "wb") as f:
        f.write(b"not a snapshot")  # a truncated, non-hsnap file under the highest number
    data = bytearray(open(os.path.join(d, link_name("c", 2)), "rb").read())
    data[-100] ^= 1  # a section byte of a copy of link 2: opens at position 40, fails verify
    with open(os.path.join(d, link_name("c", 19)), "wb") as f:
        f.write(bytes(data))
    with caplog.at_level("WARNING", logger="hsnap.checkpoints"):
        choice = choose_links(d)["c"]
    assert choice.path == os.path.join(d, link_name("c", 2)) and choice.position == 40
    why = dict(choice.passed_over)
    assert set(why) == {os.path.join(d, link_name("c", n)) for n in (19, 21)}
    assert "does not open (BadMagicError" in why[os.path.join(d, link_name("c", 21))]
    assert "does not hold (DigestMismatchError" in why[os.path.join(d, link_name("c", 19))]
    assert sum("passed over" in r.getMessage() for r in caplog.records) == 2
    assert newest_links(d) == {"c": os.path.join(d, link_name("c", 2))}
    assert Checkpoints.start(d, "c", every=4).next_link()[0] == os.path.join(d, link_name("c", 22))
    os.remove(os.path.join(d, link_name("c", 2)))  # with the newest gone, the stray copy (position 20) is what holds
    assert newest_links(d) == {"c": os.path.join(d, link_name("c", 20))}
