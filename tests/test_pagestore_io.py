"""Pages stored once, from and into SGLang's real pools (spec 5.10, 7.6):
a snapshot whose full pages live in a page store restores exactly like a plain export and
compacts into its bytes, for every pool kind, alone or as a chain of deltas; requests that
share a prefix (SGLang's radix cache: the same slots) store its pages once; every hostile
page or reference is refused typed with the target pools byte-identical — on a local
directory and on SeaweedFS."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import chain_cases as cc  # noqa: E402
import craft  # noqa: E402
import io_cases as ic  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import pages as pg  # noqa: E402
from hsnap_format.chain import compact, open_chain  # noqa: E402
from hsnap_io import restore_request  # noqa: E402
from hsnap_io.pagestore import page_store  # noqa: E402

KINDS = [("mha", 1), ("mha", 16), ("mla", 1), ("hybrid_linear", 1), ("swa", 1), ("swa_mamba", 1), ("mha_fp8", 1)]
PAGE = 8  # the page store's page size (any page size works with any pool page size: spec 5.10)


def _restore(path, ps, **kw):
    return restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                           identity=kw.pop("identity", ic.identity()), **kw)


def _export(ps, req, path, pos, *, kind, pages=None, **kw):
    start = cc.swa_starts(kind)[0]
    return cc.export(ps, req, path, pos, snapshot_id="p", swa_start=start, pages=pages, **kw)


def _refused(path, ps, exc_type, **kw):
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(exc_type) as info:
        _restore(path, ps, **kw)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # nothing allocated, no byte written
    return info.value


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("kind,page", KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def test_paged_export_restores_and_compacts_like_a_plain_export(kind, page, tmp_path):
    ps, req = cc.source(kind, page)
    pos = cc.POSITIONS[-1]
    with page_store(tmp_path / "pages", page_size=PAGE) as store:
        info = _export(ps, req, tmp_path / "paged.hsnap", pos, kind=kind, pages=store)
        assert store.stats.pages_put == pos // PAGE
    plain = _export(ps, req, tmp_path / "plain.hsnap", pos, kind=kind)
    assert info.payload_bytes < plain.payload_bytes
    with hf.open(tmp_path / "paged.hsnap") as snap:
        assert snap.version == (1, 3) and snap.pages.count == pos // PAGE and snap.pages.store == "pages"
        for s in snap.sections:  # only the rows after the last full page
            if s.kind in ("attn_k", "attn_v", "mla_kv"):
                assert s.shape[0] == pos % PAGE
    with open_chain(tmp_path / "paged.hsnap") as chain:
        chain.verify()
        compact(chain, tmp_path / "compact.hsnap")
    assert (tmp_path / "compact.hsnap").read_bytes() == (tmp_path / "plain.hsnap").read_bytes()  # byte for byte
    t1, t2 = ic.target(kind, page), ic.target(kind, page)
    a, b = _restore(tmp_path / "paged.hsnap", t1), _restore(tmp_path / "plain.hsnap", t2)
    assert (a.state_position, a.bytes_uploaded) == (b.state_position, b.bytes_uploaded)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))


@pytest.mark.parametrize("verify", [True, "during", False])
def test_paged_restore_every_verify_mode(verify, tmp_path):
    kind = "swa_mamba"
    ps, req = cc.source(kind)
    with page_store(tmp_path / "pages", page_size=PAGE) as store:
        _export(ps, req, tmp_path / "paged.hsnap", cc.POSITIONS[-1], kind=kind, pages=store)
    _export(ps, req, tmp_path / "plain.hsnap", cc.POSITIONS[-1], kind=kind)
    t1, t2 = ic.target(kind, 1), ic.target(kind, 1)
    a, b = _restore(tmp_path / "paged.hsnap", t1, verify=verify), _restore(tmp_path / "plain.hsnap", t2)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))


@pytest.mark.parametrize("kind", ["mha", "swa_mamba", "mla"])
def test_deltas_and_pages_compose(kind, tmp_path):
    """A chain whose links all store their new full pages once (spec 7.6 with 7.5): a delta
    with rows before its first page, pages, rows after its last; restores and compacts like
    a direct export at the head's position."""
    ps, req = cc.source(kind)
    with page_store(tmp_path / "pages", page_size=4) as store:
        paths = cc.export_chain(ps, req, kind, tmp_path, pages=store)
    counts = []
    for p in paths:
        with hf.open(p) as s:
            counts.append(s.pages.count)
    assert counts == [6, 2, 2]  # 0..24, then 24..32 (+1 row), then 33..36 rows, 36..44, (+1 row)
    with hf.open(paths[-1]) as head:
        ident, swa_start, pos = head.identity, head.swa_start, head.state_position
    cc.export(ps, req, tmp_path / "direct.hsnap", pos, snapshot_id="", ident=ident, swa_start=swa_start)
    with open_chain(paths[-1]) as chain:
        chain.verify()
        compact(chain, tmp_path / "compact.hsnap")
    assert (tmp_path / "compact.hsnap").read_bytes() == (tmp_path / "direct.hsnap").read_bytes()
    t1, t2 = ic.target(kind, 1), ic.target(kind, 1)
    a, b = _restore(paths[-1], t1), _restore(tmp_path / "direct.hsnap", t2)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))


# ----------------------------------------------------------------------------- stored once, from the pools


def _shared_prefix_requests(kind: str, n: int, prefix: int, length: int):
    """``n`` requests whose first ``prefix`` positions share their slots (SGLang's radix cache
    hands a new request the slots of a cached prefix), each then its own rows."""
    ps = sp.build(kind, size=2048, page_size=1)
    first = sp.alloc_request(ps, length, seed=1)
    reqs = [first]
    for i in range(1, n):
        r = sp.alloc_request(ps, length, seed=1 + i)
        ps.req_to_token_pool.req_to_token[r.req_pool_idx, :prefix] = ps.req_to_token_pool.req_to_token[first.req_pool_idx, :prefix]
        reqs.append(r)
    return ps, reqs


def _record(i: int, prefix_tokens: np.ndarray, length: int) -> hf.RequestRecord:
    rng = np.random.default_rng(100 + i)
    ids = np.concatenate([prefix_tokens, rng.integers(0, 150_000, length + 1 - len(prefix_tokens), dtype=np.int32)])
    prompt = len(prefix_tokens) + 4
    return hf.RequestRecord(rid=f"req-{i}", prompt_ids=ids[:prompt], output_ids=ids[prompt:], state_position=length,
                            sampling={"temperature": 0.0}, max_new_tokens=64, streamed_tokens=len(ids) - prompt)


def test_requests_sharing_a_prefix_store_its_pages_once_from_the_pools(tmp_path):
    """A drain of 6 requests behind one 40-token system prompt (5 pages of 8): its pages are
    put once; bytes written are far below the sum of single snapshots; each restores exactly."""
    kind, n, prefix, length = "hybrid_linear", 6, 40, 60
    ps, reqs = _shared_prefix_requests(kind, n, prefix, length)
    system = np.arange(5000, 5000 + prefix, dtype=np.int32)
    records = [_record(i, system, length) for i in range(n)]
    plain = paged = 0
    with page_store(tmp_path / "pages", page_size=PAGE) as store:
        for i, (r, rec) in enumerate(zip(reqs, records)):
            paged += cc.export(ps, r, tmp_path / f"r{i}.hsnap", length, snapshot_id=f"r{i}", rec=rec, pages=store).payload_bytes
            plain += cc.export(ps, r, tmp_path / f"plain{i}.hsnap", length, snapshot_id=f"r{i}", rec=rec).payload_bytes
        stats = store.stats
    assert stats.pages_reused == 5 * (n - 1) and stats.pages_put == 5 + n * (length // PAGE - 5)
    objects = list((tmp_path / "pages").glob("*.hpage"))
    assert len(objects) == stats.pages_put
    with pg.open_page(str(objects[0])) as p:
        page_payload = p.payload_bytes
    # every row stored exactly once: the shared prefix's rows once, each request's own once
    assert paged + stats.pages_put * page_payload == plain - stats.pages_reused * page_payload
    assert paged + stats.pages_put * page_payload < 0.75 * plain  # (this tiny geometry's GDN state is most of the rest)
    for i in range(n):
        with open_chain(tmp_path / f"r{i}.hsnap") as chain:
            compact(chain, tmp_path / f"c{i}.hsnap")
        assert (tmp_path / f"c{i}.hsnap").read_bytes() == (tmp_path / f"plain{i}.hsnap").read_bytes()
    t1, t2 = ic.target(kind, 1), ic.target(kind, 1)
    a, b = _restore(tmp_path / "r3.hsnap", t1), _restore(tmp_path / "plain3.hsnap", t2)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))


def test_a_named_page_store_is_a_session_of_one_export(tmp_path):
    """``pages="pages"``: the page directory beside the file, its marker gone after commit."""
    kind = "mha"
    ps, req = cc.source(kind)
    _export(ps, req, tmp_path / "a.hsnap", cc.POSITIONS[-1], kind=kind, pages="pages")
    assert len(list((tmp_path / "pages").glob("*.hpage"))) == cc.POSITIONS[-1]  # the pool's page size: 1
    assert not list((tmp_path / "pages" / "refs").iterdir())
    with open_chain(tmp_path / "a.hsnap") as chain:
        chain.verify()
    with pytest.raises(hf.PageError):  # a page store that is not beside the snapshot
        with page_store(tmp_path / "elsewhere" / "pages") as store:
            _export(ps, req, tmp_path / "b.hsnap", cc.POSITIONS[-1], kind=kind, pages=store)
    assert not (tmp_path / "b.hsnap").exists()


def test_export_refuses_a_taken_name_before_putting_any_page(tmp_path):
    kind = "mha"
    ps, req = cc.source(kind)
    (tmp_path / "a.hsnap").write_bytes(b"taken")
    with pytest.raises(hf.SnapshotExistsError):
        _export(ps, req, tmp_path / "a.hsnap", cc.POSITIONS[-1], kind=kind, pages="pages")
    assert not list(tmp_path.glob("pages/*.hpage"))


# ----------------------------------------------------------------------------- hostile pages: nothing allocated


@pytest.fixture
def paged_file(tmp_path):
    kind = "swa_mamba"
    ps, req = cc.source(kind)
    with page_store(tmp_path / "pages", page_size=PAGE) as store:
        _export(ps, req, tmp_path / "a.hsnap", cc.POSITIONS[-1], kind=kind, pages=store)
    with open_chain(tmp_path / "a.hsnap") as chain:
        refs = [Path(r.path) for r in chain.page_refs()]
    return tmp_path, refs, kind


def test_missing_page_refused_before_allocating(paged_file):
    d, refs, kind = paged_file
    refs[2].unlink()
    for verify in (True, "during", False):
        e = _refused(d / "a.hsnap", ic.target(kind, 1), hf.PageError, verify=verify)
        assert e.field == "pages.refs[2]" and "missing" in str(e)


def test_page_whose_bytes_do_not_match_refused_before_allocating(paged_file):
    """A flipped section byte: verify="before" hashes every page before allocating; the default (one pass) finds it
    while uploading, gives back every allocation and zeroes what it wrote."""
    d, refs, kind = paged_file
    data = bytearray(refs[1].read_bytes())
    with pg.open_page(str(refs[1])) as p:
        data[p.sections[0].offset + 3] ^= 0x10
    refs[1].write_bytes(bytes(data))
    e = _refused(d / "a.hsnap", ic.target(kind, 1), hf.DigestMismatchError, verify="before")
    assert e.field.startswith("sections[") and e.path == str(refs[1])
    t = ic.target(kind, 1)
    copied = sp.pool_state_copy(t)
    with pytest.raises(hf.DigestMismatchError) as info:
        _restore(d / "a.hsnap", t)
    assert info.value.field.startswith("sections[") and info.value.path == str(refs[1])
    assert sp.refusal_changes(copied, t) == []
    # read once (verify="during"): caught while uploading, every allocation given back, every byte too
    e = _refused(d / "a.hsnap", ic.target(kind, 1), hf.DigestMismatchError, verify="during", exact_rollback=True)
    assert e.path == str(refs[1])


def test_page_of_another_namespace_or_page_refused_before_allocating(paged_file):
    d, refs, kind = paged_file
    saved = refs[0].read_bytes()
    shutil.copy(refs[3], refs[0])  # another page's object under page 0's name
    for verify in (True, "during", False):
        e = _refused(d / "a.hsnap", ic.target(kind, 1), hf.DigestMismatchError, verify=verify)
        assert e.field == "pages.refs[0].root_digest (%s)" % refs[0]
    refs[0].write_bytes(saved)
    # another namespace, re-signed so it opens: its id no longer names its namespace
    other = craft.mutate_header(saved, lambda h: (h["namespace"].update(weights_version="w2"), None)[1])
    refs[0].write_bytes(other)
    e = _refused(d / "a.hsnap", ic.target(kind, 1), hf.DigestMismatchError)
    assert e.field == "page.namespace_id"
    refs[0].write_bytes(saved)


def test_references_whose_keys_are_not_the_tokens_refused_before_allocating(paged_file):
    """A re-signed snapshot whose first reference names page 1's object (a real page, the
    right namespace): its key is not the chain over the file's tokens (R-7.6-1)."""
    d, refs, kind = paged_file
    src = (d / "a.hsnap").read_bytes()
    with hf.open(d / "a.hsnap") as s:
        ref1 = list(s.pages.refs[1])

    def swap(h):
        h["pages"]["refs"][0] = ref1

    (d / "a.hsnap").write_bytes(craft.mutate_header(src, swap))
    e = _refused(d / "a.hsnap", ic.target(kind, 1), hf.DigestMismatchError)
    assert e.field == "pages.refs[0] (key of page 0)"


def test_resharding_a_set_that_references_pages_is_refused(tmp_path):
    """Its rows are split between rank files and page objects: compact first."""
    from hsnap_format.manifest import SetWriter
    from hsnap_io.reshard import TPModel, describe

    model = TPModel(kv_heads=2)
    kind = "mha"
    ps, req = cc.source(kind)
    sw = SetWriter(str(tmp_path / "set"), staging=None)
    with page_store(tmp_path / "pages", page_size=PAGE) as store:
        for r in range(2):
            ident = ic.identity(tp_size=2, tp_rank=r, snapshot_id="set")
            cc.export(ps, req, sw.rank_path(r), cc.POSITIONS[-1], snapshot_id="set", ident=ident, pages=store)
        sw.commit(tp_size=2)
    with open_chain(tmp_path / "set", rank=1) as chain:  # read as a rank of its set: pages beside the set
        chain.verify()
    t = ic.target(kind, 1)
    before = sp.pool_state_fingerprint(t)
    with pytest.raises(hf.UnsupportedFeatureError) as e:
        restore_request(tmp_path / "set", req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                        identity=ic.identity(), sharding=describe(model, tp=1, rank=0))
    assert "pages" in str(e.value) and sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []


# ----------------------------------------------------------------------------- an object store


def test_pages_stored_once_under_an_s3_prefix(s3server, tmp_path):
    opts = s3server.options()
    run = f"s3://{s3server.make_bucket()}/run"
    kind = "hybrid_linear"
    ps, reqs = _shared_prefix_requests(kind, 3, 40, 60)
    system = np.arange(5000, 5040, dtype=np.int32)
    with page_store(f"{run}/pages", page_size=PAGE, storage_options=opts) as store:
        for i, r in enumerate(reqs):
            cc.export(ps, r, f"{run}/r{i}.hsnap", 60, snapshot_id=f"r{i}", rec=_record(i, system, 60), pages=store, storage_options=opts)
        assert store.stats.pages_reused == 5 * 2
    for i, r in enumerate(reqs):
        cc.export(ps, r, tmp_path / f"plain{i}.hsnap", 60, snapshot_id=f"r{i}", rec=_record(i, system, 60))
        with open_chain(f"{run}/r{i}.hsnap", storage_options=opts) as chain:
            chain.verify()
            compact(chain, tmp_path / f"c{i}.hsnap")
        assert (tmp_path / f"c{i}.hsnap").read_bytes() == (tmp_path / f"plain{i}.hsnap").read_bytes()
    t1, t2 = ic.target(kind, 1), ic.target(kind, 1)
    a = _restore(f"{run}/r2.hsnap", t1, storage_options=opts)
    b = _restore(tmp_path / "plain2.hsnap", t2)
    assert cc.same_rows(cc.restored_rows(t1, a), cc.restored_rows(t2, b))
    # a missing page under the prefix: refused before allocating
    from hsnap_format.stores import store_for

    s = store_for(run, opts)
    with open_chain(f"{run}/r2.hsnap", storage_options=opts) as chain:
        victim = chain.page_refs()[-1].path
    s.remove(victim, version=next(e.version for e in s.list(f"{run}/pages") if e.path == victim))
    e = _refused(f"{run}/r2.hsnap", ic.target(kind, 1), hf.PageError, storage_options=opts)
    assert "missing" in str(e)


def test_a_live_req_snapshotted_with_pages_resumes_like_a_plain_one(tmp_path):
    """The engine's drain path: ``snapshot_req(..., pages=store)`` of a live SGLang Req, then
    ``resume_req`` in other pools — the same rows and Req as from a plain snapshot."""
    from hsnap_testing import reqs as sr
    from hsnap_sglang import req as hs

    ps = sp.build("hybrid_linear", size=512, page_size=1)
    sp.occupy(ps, 2, 37, seed=5)
    req, _ = sr.decode_req(ps, {**sr.random_case(3), "prompt": list(range(10, 40)), "output": [7, 8, 9, 11], "streamed": 2})
    kw = dict(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=ic.identity())
    with page_store(tmp_path / "pages", page_size=PAGE) as store:
        hs.snapshot_req(tmp_path / "paged.hsnap", req, pages=store, **kw)
        assert store.stats.pages_put == (30 + 4 - 1) // PAGE
    hs.snapshot_req(tmp_path / "plain.hsnap", req, **kw)
    out = []
    for name in ("paged.hsnap", "plain.hsnap"):
        t = ic.target("hybrid_linear", 1)
        r = hs.resume_req(tmp_path / name, req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                          identity=ic.identity(), tokenizer=sr.tokenizer())
        out.append((sr.req_rows(t, r), list(r.output_ids), r.rid))
    (rows_a, ids_a, rid_a), (rows_b, ids_b, rid_b) = out
    assert ids_a == ids_b == [7, 8, 9, 11] and rid_a == rid_b and cc.same_rows(rows_a, rows_b)
