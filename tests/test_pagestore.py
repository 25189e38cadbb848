"""Pages stored once (spec 5.10, 5.11, 7.6, 8.2; format 1.3): page keys are
SGLang's own page hash chain under a namespace, snapshots of requests that share a prefix
store its pages once, every hostile page or reference is refused typed, and ``hsnap gc
--pages`` never drops a page a committed snapshot needs — also with writers racing it, on a
local directory and on SeaweedFS. Format level: no pools (tests/test_pagestore_io.py has
the restores into SGLang's pools)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import craft  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import layout, pages as pg  # noqa: E402
from hsnap_format.chain import compact, open_chain  # noqa: E402
from hsnap_format.records import AttentionGeometry, MambaGeometry  # noqa: E402
from hsnap_format.stores import store_for  # noqa: E402

S = 4  # page size of these tests
PROMPT = 6


# ----------------------------------------------------------------------------- helpers


def geometry(kind: str = "mha") -> hf.Geometry:
    att = {
        "mha": AttentionGeometry("mha", (1, 3), 2, 4, 4, "bfloat16", "bfloat16", S),
        "mla": AttentionGeometry("mla", (1, 3), 1, 6, 0, "bfloat16", "bfloat16", S, kv_lora_rank=4, qk_rope_head_dim=2),
    }[kind]
    return hf.Geometry(attention=att, mamba=MambaGeometry((0, 2), ((3, 4),), "bfloat16", (2, 2, 2), "float32"))


def identity(**over) -> hf.Identity:
    base = dict(model_id="tiny/hybrid", weights_version="w1", weights_hash="sha256:aa", engine=hf.Engine("sglang", "0.5.23", "t"),
                tp_size=1, tp_rank=0, snapshot_id="s", created_at="2026-12-01T00:00:00Z")
    base.update(over)
    return hf.Identity(**base)


def tokens_for(prefix: list[int], n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.asarray(prefix, dtype=np.int32), rng.integers(0, 150_000, n - len(prefix), dtype=np.int32)])


def record(tokens: np.ndarray, rid: str) -> hf.RequestRecord:
    out = len(tokens) - PROMPT
    return hf.RequestRecord(rid=rid, prompt_ids=tokens[:PROMPT], output_ids=tokens[PROMPT:], state_position=len(tokens) - 1,
                            output_logprobs=-np.linspace(0.1, 0.5, out, dtype=np.float32), max_new_tokens=64, streamed_tokens=out)


def row(tokens: np.ndarray, p: int, salt: str, shape) -> np.ndarray:
    """The KV of position p: a function of the token ids up to p (what a prefix shares)."""
    seed = int.from_bytes(hashlib.sha256(salt.encode() + tokens[: p + 1].astype("<i4").tobytes()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


def state(geom: hf.Geometry, tokens: np.ndarray, salt: str = "w1", seed: int = 0) -> dict:
    """A request's whole sections: attention rows from the token ids (so requests that share
    a prefix share its rows), recurrent state from ``seed``."""
    from hsnap_format.layout import state_sections
    from hsnap_format.spec import DTYPES

    P = len(tokens) - 1
    rng = np.random.default_rng(seed)
    out = {}
    for spec in state_sections(geom, P):
        if spec.kind in ("attn_k", "attn_v", "mla_kv"):
            out[spec.name] = np.stack([row(tokens, p, f"{salt}/{spec.name}", spec.shape[1:]) for p in range(P)])
        else:
            out[spec.name] = rng.standard_normal(spec.shape).astype(DTYPES[spec.dtype])
    return out


def write(path, store: pg.PageStore, tokens, rid="r", *, geom=None, ident=None, salt="w1", base=None):
    geom = geom or geometry()
    return pg.write_paged_snapshot(path, identity=ident or identity(snapshot_id=rid), geometry=geom, record=record(tokens, rid),
                                   state=state(geom, tokens, salt), pages=store, base=base,
                                   storage_options=None if store.store.local else store.store._given)


def write_plain(path, tokens, rid="r", *, geom=None, ident=None, salt="w1"):
    geom = geom or geometry()
    return hf.write_snapshot(path, identity=ident or identity(snapshot_id=rid), geometry=geom, record=record(tokens, rid),
                             state=state(geom, tokens, salt))


def page_files(d) -> list[str]:
    d = Path(d)
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".hpage")) if d.exists() else []


SYSTEM = list(range(1000, 1000 + 3 * S + 1))  # a system prompt: 3 full pages and one token more


# ----------------------------------------------------------------------------- keys and namespaces


def test_page_keys_are_sglangs_own_get_hash_str():
    """The pure chain (spec 5.10) equals SGLang 0.5.23's get_hash_str — HiCache's storage keys
    — and hsnap_io asks SGLang itself; ids up to 2**31 - 1, several page sizes."""
    sglang_utils = pytest.importorskip("sglang.srt.mem_cache.utils")
    from hsnap_io.pagestore import sglang_keys

    rng = np.random.default_rng(7)
    for page_size in (1, 2, 16, 64):
        toks = rng.integers(0, 2**31 - 1, 5 * page_size, dtype=np.int32)
        toks[0], toks[-1] = 2**31 - 1, 0
        try:
            theirs = sglang_utils.get_hash_str([int(t) for t in toks], None, page_size=page_size)
        except RuntimeError as e:  # its native extension did not build here
            pytest.skip(f"SGLang's native hash: {e}")
        assert pg.chain_keys(toks, page_size) == theirs == sglang_keys(toks, page_size)
        assert pg.chain_keys(toks, page_size)[0] == hashlib.sha256(toks[:page_size].astype("<u4").tobytes()).hexdigest()


NAMESPACE_CHANGES = [
    ("model_id", dict(ident=dict(model_id="other/model"))),
    ("weights_version", dict(ident=dict(weights_version="w2"))),
    ("weights_hash", dict(ident=dict(weights_hash="sha256:bb"))),
    ("engine.version", dict(ident=dict(engine=hf.Engine("sglang", "0.5.24", "t")))),
    ("engine.commit", dict(ident=dict(engine=hf.Engine("sglang", "0.5.23", "u")))),
    ("tp_size", dict(ident=dict(tp_size=2))),
    ("tp_rank", dict(ident=dict(tp_size=2, tp_rank=1))),
    ("attention.dtype", dict(att=dict(dtype="float16", storage_dtype="float16"))),
    ("attention.storage_dtype", dict(att=dict(dtype="float8_e4m3fn", storage_dtype="uint8"))),
    ("attention.heads", dict(att=dict(heads=1))),
    ("attention.k_head_dim", dict(att=dict(k_head_dim=8))),
    ("attention.layers", dict(att=dict(layers=(1,)))),
    ("attention.kind", dict(att=dict(kind="swa"))),
    ("page_size", dict(page_size=8)),
]


@pytest.mark.parametrize("field,change", NAMESPACE_CHANGES, ids=[c[0] for c in NAMESPACE_CHANGES])
def test_namespace_id_changes_with_every_field(field, change):
    """A key can never match a page of other weights, another engine, shard, layout or page
    size: each of them changes the namespace id that names every page object (spec 5.10)."""
    import dataclasses

    geom = geometry()
    base = layout.namespace_id(layout.namespace(identity(), geom, S))
    ident = identity(**change.get("ident", {}))
    att = dataclasses.replace(geom.attention, **change.get("att", {}))
    other = layout.namespace_id(layout.namespace(ident, dataclasses.replace(geom, attention=att), change.get("page_size", S)))
    assert other != base
    # informational fields are not in it: the same pages for every snapshot of a request
    assert layout.namespace_id(layout.namespace(identity(snapshot_id="x", created_at="y", device="z"), geom, S)) == base


def test_namespace_holds_the_sharding_description():
    from hsnap_format.records import ShardAxis, Sharding

    import dataclasses

    geom = geometry()
    a = dataclasses.replace(geom, sharding=Sharding(attention=ShardAxis(1, 4, ((0, 2, 1),))))
    b = dataclasses.replace(geom, sharding=Sharding(attention=ShardAxis(1, 4, ((2, 2, 1),))))
    ids = {layout.namespace_id(layout.namespace(identity(tp_size=2), g, S)) for g in (geom, a, b)}
    assert len(ids) == 3


# ----------------------------------------------------------------------------- stored once


def test_snapshots_sharing_a_prefix_store_its_pages_once(tmp_path):
    """Five requests after one system prompt of 3 full pages: its pages are put once and
    reused four times; each snapshot compacts into the file a plain write of it makes."""
    toks = [tokens_for(SYSTEM, 3 * S + 1 + 2 * S + i, seed=i) for i in range(5)]  # 5 or 6 full pages each
    with pg.PageStore(tmp_path / "pages") as store:
        for i, t in enumerate(toks):
            write(tmp_path / f"r{i}.hsnap", store, t, f"r{i}")
        stats = store.stats
    full_pages = [(len(t) - 1) // S for t in toks]
    assert stats.pages_reused == 3 * 4  # the shared prefix, for every snapshot but the first
    assert stats.pages_put == sum(full_pages) - 3 * 4
    assert len(page_files(tmp_path / "pages")) == stats.pages_put
    assert not list((tmp_path / "pages" / "refs").iterdir())  # the session's markers are gone
    for i, t in enumerate(toks):
        write_plain(tmp_path / f"plain{i}.hsnap", t, f"r{i}")
        with open_chain(tmp_path / f"r{i}.hsnap") as chain:
            assert chain.head.version == (1, 3) and chain.head.header["features"]["required"] == ["pages"]
            chain.verify()  # every page too (R-7.6-3)
            compact(chain, tmp_path / f"c{i}.hsnap")
        assert (tmp_path / f"c{i}.hsnap").read_bytes() == (tmp_path / f"plain{i}.hsnap").read_bytes()


def test_other_weights_or_shard_never_reuse_a_page(tmp_path):
    t = tokens_for(SYSTEM, 3 * S + 1 + S, seed=1)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
        write(tmp_path / "b.hsnap", store, t, "b", ident=identity(weights_hash="sha256:bb"), salt="w2")
        write(tmp_path / "c.hsnap", store, t, "c", ident=identity(tp_size=2, tp_rank=1), salt="r1")
        assert store.stats.pages_reused == 0
    names = page_files(tmp_path / "pages")
    assert len(names) == 3 * 4 and len({n.split("-")[0] for n in names}) == 3  # three namespaces
    assert len({n.split("-")[1] for n in names}) == 4  # the same four keys (SGLang's, no namespace in them)


def test_same_key_other_bytes_is_another_object(tmp_path):
    """KV of the same tokens that differs in its bytes (another batch) is stored as another
    object: every snapshot restores exactly its own bytes (spec 5.10, question 30)."""
    t = tokens_for(SYSTEM, 3 * S + 1, seed=2)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a", salt="batch-1")
        write(tmp_path / "b.hsnap", store, t, "b", salt="batch-2")
        assert store.stats.pages_reused == 0
    assert len(page_files(tmp_path / "pages")) == 6
    for name, salt in (("a", "batch-1"), ("b", "batch-2")):
        write_plain(tmp_path / f"{name}-plain.hsnap", t, name, salt=salt)
        with open_chain(tmp_path / f"{name}.hsnap") as chain:
            compact(chain, tmp_path / f"{name}-c.hsnap")
        assert (tmp_path / f"{name}-c.hsnap").read_bytes() == (tmp_path / f"{name}-plain.hsnap").read_bytes()


@pytest.mark.parametrize("where", ["section", "header"])
def test_a_damaged_existing_page_is_replaced_not_reused(tmp_path, where):
    """A bit flipped in a stored page object (a section byte only verify sees, or a header
    byte that fails the open) no longer blocks every later export of that page: the next
    writer replaces it with the page's bytes (its name is content-addressed), and the
    snapshots that referenced the damaged object verify again."""
    t = tokens_for(SYSTEM, 3 * S + 1, seed=3)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
    victim = tmp_path / "pages" / page_files(tmp_path / "pages")[0]
    good = victim.read_bytes()
    data = bytearray(good)
    with pg.open_page(str(victim)) as p:
        data[p.sections[0].offset if where == "section" else 100] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(hf.HsnapError):
        with open_chain(tmp_path / "a.hsnap") as chain:
            chain.verify()
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "b.hsnap", store, t, "b")
        assert store.stats.pages_replaced == 1 and store.stats.pages_reused == 2
    assert victim.read_bytes() == good and len(page_files(tmp_path / "pages")) == 3
    for name in ("a.hsnap", "b.hsnap"):
        with open_chain(tmp_path / name) as chain:
            chain.verify()


# ----------------------------------------------------------------------------- the format's rules


@pytest.fixture
def paged(tmp_path):
    t = tokens_for(SYSTEM, 3 * S + 1 + 2 * S, seed=4)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
    return tmp_path


def test_older_readers_refuse_a_paged_file_and_snapshot_readers_a_page(paged, monkeypatch):
    """Compatibility (spec 9): a 1.2 reader refuses a file that references pages by name; a
    page object is not a snapshot for any snapshot reader (7.1 step 13)."""
    from hsnap_format import reader

    monkeypatch.setattr(reader, "KNOWN_FEATURES", frozenset({"sampler-rng-state", "top-logprobs", "tp-sharding", "delta"}))
    with pytest.raises(hf.UnsupportedFeatureError) as e:
        hf.Snapshot(paged / "a.hsnap")
    assert e.value.field == "header.features.required" and e.value.found == ["pages"]
    monkeypatch.undo()
    page = paged / "pages" / page_files(paged / "pages")[0]
    with pytest.raises(hf.MalformedHeaderError) as e:
        hf.Snapshot(page)
    assert e.value.field == "header.format" and e.value.found == "hsnap-page"
    with pg.open_page(str(page)) as p:
        assert p.version == (1, 3) and p.name == page.name
        p.verify()


def _page_mutant(path: Path, fn) -> bytes:
    return craft.mutate_header(path.read_bytes(), lambda h: (fn(h), None)[1])


def first_page(d: Path) -> Path:
    """The page object of page 0 (names sort by namespace and key, not by page number)."""
    for name in page_files(d):
        with pg.open_page(str(d / name)) as p:
            if p.page.index == 0:
                return d / name
    raise AssertionError("no page 0")


PAGE_MUTATIONS = [
    ("format", lambda h: h.update(format="hsnap"), hf.MalformedHeaderError, "header.format"),
    ("extra top key", lambda h: h.pop("page"), hf.MalformedHeaderError, "header"),
    ("namespace key", lambda h: h["namespace"].update(extra=1), hf.MalformedHeaderError, "namespace"),
    ("namespace type", lambda h: h["namespace"]["attention"].update(heads="2"), hf.MalformedHeaderError, "namespace.attention.heads"),
    # found by python -m mutation --seed 6 (the independent reader had let it through to the digest)
    ("engine key", lambda h: h["namespace"]["engine"].update(extra="x"), hf.MalformedHeaderError, "namespace.engine"),
    ("tokens length", lambda h: h["page"]["tokens"].pop(), hf.MalformedHeaderError, "page.tokens"),
    ("negative token", lambda h: h["page"]["tokens"].__setitem__(0, -1), hf.MalformedHeaderError, "page.tokens"),
    ("prior at 0", lambda h: h["page"].update(prior="0" * 64), hf.MalformedHeaderError, "page.prior"),
    ("namespace id", lambda h: h["page"].update(namespace_id="0" * 64), hf.DigestMismatchError, "page.namespace_id"),
    ("namespace, id kept", lambda h: h["namespace"].update(weights_hash="sha256:bb"), hf.DigestMismatchError, "page.namespace_id"),
    ("tokens, key kept", lambda h: h["page"]["tokens"].__setitem__(0, 7), hf.DigestMismatchError, "page.key"),
    ("key", lambda h: h["page"].update(key="f" * 64), hf.DigestMismatchError, "page.key"),
    ("plan", lambda h: h["sections"][0].update(name="attn.2.k"), hf.MalformedHeaderError, "sections[0]"),
    # found by python -m mutation --mutants 20000 --seed 1: a page requiring a snapshot's feature was accepted,
    # and the independent reader let a malformed namespace.sharding through to the namespace id
    ("a snapshot's required feature", lambda h: h["features"].update(required=["sampler-rng-state"]),
     hf.UnsupportedFeatureError, "header.features.required"),
    ("namespace sharding", lambda h: h["namespace"].update(sharding="float32"),
     hf.MalformedHeaderError, "namespace.sharding"),
    # a page size whose page objects need not fit the 1 MiB header (spec 5.10: at most 2^16)
    ("namespace page size over 2^16", lambda h: h["namespace"].update(page_size=(1 << 16) + 1), hf.MalformedHeaderError, "namespace.page_size"),
    # "exactly its keys" holds at every level of the namespace, its sharding AXIS included
    ("namespace sharding unknown key", lambda h: h["namespace"].update(sharding={"axis": 1, "global": 2, "parts": [[0, 2, 1]], "zz": 1}),
     hf.MalformedHeaderError, "namespace.sharding"),
    # found by python -m mutation --seed 13: a layer listed twice (spec 5.6) was refused only by the namespace id
    ("namespace layer twice", lambda h: h["namespace"]["attention"]["layers"].insert(0, h["namespace"]["attention"]["layers"][0]),
     hf.MalformedHeaderError, "namespace.attention"),
]


@pytest.mark.parametrize("label,fn,exc,field", PAGE_MUTATIONS, ids=[m[0] for m in PAGE_MUTATIONS])
def test_hostile_page_objects_refused_at_open(paged, label, fn, exc, field):
    """Re-signed page objects (every digest honest again) reach the page rules of spec 5.11
    (R-5.11-1): each refused typed, naming the field."""
    page = first_page(paged / "pages")
    bad = craft.write(paged / "bad.hpage", _page_mutant(page, fn))
    with pytest.raises(exc) as e:
        pg.open_page(bad)
    assert e.value.field == field, e.value


HEADER_MUTATIONS = [
    ("pages without the feature", lambda h: h["features"].update(required=[]), "pages"),
    ("the feature without pages", lambda h: h.pop("pages"), "pages"),
    ("store a path", lambda h: h["pages"].update(store="../pages"), "pages.store"),
    ("page size 0", lambda h: h["pages"].update(page_size=0), "pages.page_size"),
    ("page size over 2^16", lambda h: h["pages"].update(page_size=(1 << 16) + 1), "pages.page_size"),
    ("ref not a pair", lambda h: h["pages"]["refs"].__setitem__(1, ["0" * 64]), "pages.refs[1]"),
    ("ref digest", lambda h: h["pages"]["refs"][0].__setitem__(1, "Z" * 32), "pages.refs[0]"),
    ("one ref fewer", lambda h: h["pages"]["refs"].pop(), "pages.refs"),
    ("namespace id", lambda h: h["pages"].update(namespace_id="0" * 64), "pages.namespace_id"),
    ("another page size", lambda h: h["pages"].update(page_size=2 * S), "pages.refs"),
]


@pytest.mark.parametrize("label,fn,field", HEADER_MUTATIONS, ids=[m[0] for m in HEADER_MUTATIONS])
def test_paged_header_rules(paged, label, fn, field):
    """R-5.10-1..3: a re-signed paged file with a broken ``pages`` is refused at open."""
    bad = craft.write(paged / "bad.hsnap", craft.mutate_header((paged / "a.hsnap").read_bytes(), lambda h: (fn(h), None)[1]))
    with pytest.raises(hf.MalformedHeaderError) as e:
        hf.Snapshot(bad)
    assert e.value.field == field, e.value


def _resign_ref(snapshot: Path, index: int, page_bytes: bytes, store: Path) -> Path:
    """Put ``page_bytes`` in the store under the name it has and point reference ``index`` of
    ``snapshot`` (re-signed) at it: a hostile pair whose every digest is honest."""
    root = craft.split(page_bytes).root_digest.hex()
    obj = craft.split(page_bytes).header_obj
    name = pg.page_name(obj["page"]["namespace_id"], obj["page"]["key"], root)
    craft.write(store / name, page_bytes)

    def point(h):
        h["pages"]["refs"][index][1] = root
        h["pages"]["refs"][index][0] = obj["page"]["key"]

    snapshot.write_bytes(craft.mutate_header(snapshot.read_bytes(), point))
    return store / name


def test_hostile_references_refused_before_anything_is_used(paged):
    """R-7.6-1/2: a missing page, a page whose bytes are not the ones named, a page of another
    page number, key or tokens (re-signed, every digest honest) — each refused typed by the
    chain's checks, which a restore runs before allocating (tests/test_pagestore_io.py)."""
    src = (paged / "a.hsnap").read_bytes()
    names = page_files(paged / "pages")
    with open_chain(paged / "a.hsnap") as chain:
        refs = chain.page_refs()
    first = Path(refs[0].path)

    def refused(exc, field_start):
        with open_chain(paged / "a.hsnap") as chain:
            with pytest.raises(exc) as e:
                chain.check_pages(verify=True)
        assert e.value.field.startswith(field_start), e.value
        (paged / "a.hsnap").write_bytes(src)
        return e.value

    saved = first.read_bytes()
    first.unlink()  # missing
    refused(hf.PageError, "pages.refs[0]")
    first.write_bytes(saved)
    data = bytearray(saved)
    with pg.open_page(str(first)) as p:
        data[p.sections[1].offset] ^= 4  # its bytes are not the ones named
    first.write_bytes(bytes(data))
    refused(hf.DigestMismatchError, "sections[")
    first.write_bytes(saved)
    shutil.copy(paged / "pages" / names[1], first)  # another page under this page's name
    refused(hf.DigestMismatchError, "pages.refs[0].root_digest")
    first.write_bytes(saved)
    # page 1's object put in as page 0 (re-signed snapshot): another page number and key
    with open_chain(paged / "a.hsnap") as chain:
        p1 = Path(chain.page_refs()[1].path).read_bytes()
    _resign_ref(paged / "a.hsnap", 0, p1, paged / "pages")
    refused(hf.DigestMismatchError, "pages.refs[0] (key of page 0)")  # the key is not the chain over its tokens
    # another namespace, re-signed, key kept: the page's own namespace id fails (R-5.11-1)
    other = craft.mutate_header(saved, lambda h: h["namespace"].update(model_id="x"))
    bad = craft.write(paged / "x.hpage", other)
    with pytest.raises(hf.DigestMismatchError) as e:
        pg.open_page(bad)
    assert e.value.field == "page.namespace_id"


def test_a_reference_to_another_index_is_a_page_error(paged):
    """check_page's own comparisons (R-7.6-2): a page object that opens and has the root digest
    named, but another page number, or other tokens than the request's, is a PageError naming
    the field. (A re-signed page cannot reach them with the key named — SHA-256 binds the key
    to the tokens and the prior key — so they are exercised directly.)"""
    with open_chain(paged / "a.hsnap") as chain:
        ref = chain.page_refs()[0]
    page = Path(ref.path)
    with pg.open_page(str(page)) as p:
        tokens = np.arange(100, dtype=np.int32)
        with pytest.raises(hf.PageError) as e:
            pg.check_page(p, ref, tokens)
        assert e.value.field.startswith("pages.refs[0].tokens")
        bad = pg.PageRef(ref.link, ref.index, 5, ref.key, ref.root, ref.path)
        with pytest.raises(hf.PageError) as e:
            pg.check_page(p, bad)
        assert e.value.field.startswith("pages.refs[0].index")


# ----------------------------------------------------------------------------- gc: mark and sweep


def _store_url(tmp_path, request):
    """The directory snapshots and their page store live in: local, or an s3:// prefix."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    server = request.getfixturevalue("s3server")
    return f"s3://{server.make_bucket()}/run", server.options()


@pytest.fixture(params=["local", "s3"])
def where(tmp_path, request):
    return _store_url(tmp_path, request)


def _put(where_, name, data):
    d, opts = where_
    store = store_for(d, opts)
    store.makedirs(d)
    path = store.join(d, name)
    store.put_bytes(path, data)
    return path


def _paged_local_then_put(where_, tmp_path, names_tokens):
    """Write paged snapshots locally, then put every file into ``where_`` (the same bytes)."""
    local = tmp_path / "src"
    local.mkdir(exist_ok=True)
    with pg.PageStore(local / "pages") as store:
        for name, t in names_tokens:
            write(local / name, store, t, name)
    d, opts = where_
    s = store_for(d, opts)
    for name, _ in names_tokens:
        _put(where_, name, (local / name).read_bytes())
    s.makedirs(s.join(d, "pages"))
    for p in page_files(local / "pages"):
        s.put_bytes(s.join(s.join(d, "pages"), p), (local / "pages" / p).read_bytes())
    return local


def test_gc_sweeps_only_unreferenced_pages(where, tmp_path):
    d, opts = where
    toks = {f"r{i}.hsnap": tokens_for(SYSTEM, 3 * S + 1 + S * (i + 1), seed=10 + i) for i in range(3)}
    local = _paged_local_then_put(where, tmp_path, list(toks.items()))
    store = store_for(d, opts)
    with hf.open(local / "r2.hsnap") as gone:
        only_r2 = {pg.page_name(gone.pages.namespace_id, k, r) for k, r in gone.pages.refs[3:]}
    victim = store.join(d, "r2.hsnap")
    store.remove(victim, version=next(e.version for e in store.list(d) if e.path == victim))
    dry = pg.collect_pages(d, storage_options=opts)
    assert {os.path.basename(v.path) for v in dry.items if v.removable} == only_r2 and not dry.refused
    assert all(v.action == "would remove" for v in dry.items if v.removable)
    announced = []
    rep = pg.collect_pages(d, storage_options=opts, remove=True, announce=lambda p, n: announced.append((os.path.basename(p), n)))
    assert {n for n, _ in announced} == only_r2 and all(n > 0 for _, n in announced)
    assert {os.path.basename(v.path) for v in rep.items if v.action == "removed"} == only_r2
    left = {os.path.basename(e.path) for e in store.list(store.join(d, "pages"))}
    assert not (left & only_r2) and len(left) == 3 + 1 + 2  # the prefix, r0's own page, r1's two
    for name in ("r0.hsnap", "r1.hsnap"):  # every remaining snapshot still has every page
        with open_chain(store.join(d, name), storage_options=opts) as chain:
            chain.verify()
    assert not any(e.path.endswith(".sweep") for e in store.list(store.join(store.join(d, "pages"), "refs")))


def test_gc_keeps_pages_a_live_writer_protects(tmp_path):
    t = tokens_for(SYSTEM, 3 * S + 1, seed=20)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
        (tmp_path / "a.hsnap").unlink()  # unreferenced now, but this session's marker names its keys
        rep = pg.collect_pages(tmp_path, remove=True)
        assert not [v for v in rep.items if v.action == "removed"] and rep.protected == 3
    rep = pg.collect_pages(tmp_path, remove=True)  # the session closed: its marker is gone
    assert len([v for v in rep.items if v.action == "removed"]) == 3


def test_gc_ignores_a_stale_marker_of_a_writer_that_died(tmp_path):
    t = tokens_for(SYSTEM, 3 * S + 1, seed=21)
    store = pg.PageStore(tmp_path / "pages")
    write(tmp_path / "a.hsnap", store, t, "a")  # never closed: its marker stays, as a killed writer's
    (tmp_path / "a.hsnap").unlink()
    marker = next((tmp_path / "pages" / "refs").iterdir())
    old = time.time() - 7200
    os.utime(marker, (old, old))
    rep = pg.collect_pages(tmp_path, remove=True)
    stale = next(v for v in rep.items if v.path == str(marker))
    assert "protects nothing" in stale.reason and stale.action == "kept"
    assert len([v for v in rep.items if v.action == "removed"]) == 3


def test_gc_refuses_to_sweep_when_a_snapshot_cannot_be_read(tmp_path):
    t = tokens_for(SYSTEM, 3 * S + 1, seed=22)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
        write(tmp_path / "b.hsnap", store, tokens_for([5, 6, 7, 8, 9], 2 * S + 1, seed=1), "b")
    (tmp_path / "b.hsnap").unlink()  # b's pages are garbage now ...
    data = bytearray((tmp_path / "a.hsnap").read_bytes())
    data[100] ^= 1  # ... but a committed snapshot that cannot be read might reference them
    (tmp_path / "a.hsnap").write_bytes(bytes(data))
    before = page_files(tmp_path / "pages")
    rep = pg.collect_pages(tmp_path, remove=True)
    assert rep.refused and "a.hsnap" in rep.refused[0] and page_files(tmp_path / "pages") == before
    (tmp_path / "x.bin").write_bytes(b"not a snapshot at all")  # other files are no reason to refuse
    (tmp_path / "a.hsnap").unlink()
    rep = pg.collect_pages(tmp_path, remove=True)
    assert not rep.refused and page_files(tmp_path / "pages") == []


def test_gc_proves_each_page_by_its_content(tmp_path):
    t = tokens_for(SYSTEM, 3 * S + 1, seed=23)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
    names = page_files(tmp_path / "pages")
    fake = tmp_path / "pages" / pg.page_name("a" * 64, "b" * 64, "c" * 32)
    fake.write_bytes(b"a file named like a page")
    wrong = tmp_path / "pages" / pg.page_name("d" * 64, "e" * 64, "f" * 32)
    shutil.copy(tmp_path / "pages" / names[0], wrong)  # a real page under another page's name
    (tmp_path / "a.hsnap").unlink()
    rep = pg.collect_pages(tmp_path, remove=True)
    by = {os.path.basename(v.path): v for v in rep.items}
    assert by[fake.name].action == "kept" and "not a page object" in by[fake.name].reason
    assert by[wrong.name].action == "kept" and "names another page" in by[wrong.name].reason
    assert fake.exists() and wrong.exists() and all(by[n].action == "removed" for n in names)


def test_gc_removes_only_the_version_it_listed(tmp_path, monkeypatch):
    t = tokens_for(SYSTEM, 3 * S + 1, seed=24)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, t, "a")
    (tmp_path / "a.hsnap").unlink()
    victim = tmp_path / "pages" / page_files(tmp_path / "pages")[0]
    real = pg._sweep_one

    def touched_meanwhile(store, v, announce):  # the object changes between listing and removal
        if v.path == str(victim):
            os.utime(victim, ns=(1, 1))
        return real(store, v, announce)

    monkeypatch.setattr(pg, "_sweep_one", touched_meanwhile)
    rep = pg.collect_pages(tmp_path, remove=True)
    v = next(v for v in rep.items if v.path == str(victim))
    assert v.action == "failed" and victim.exists()


# ----------------------------------------------------------------------------- gc against writers


def _interleave(tmp_path, monkeypatch, *, writer_waits: bool) -> tuple[list, pg.PageStats]:
    """The race the protocol closes (spec 8.2): a gc has read the markers and the snapshots —
    a page P is unreferenced and protected by nobody — and is held right before removing it.
    A writer then starts a snapshot that reuses P; the gc is let go and removes P. Returns
    (pages missing after the writer committed, the writer's stats)."""
    t = tokens_for(SYSTEM, 3 * S + 1, seed=30)
    tmp_path.mkdir()
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "old.hsnap", store, t, "old")
    (tmp_path / "old.hsnap").unlink()  # its pages are garbage ... until the writer reuses them
    decided, release = threading.Event(), threading.Event()
    real = pg._sweep_one

    def held(*a, **k):  # gc between deciding what to remove and removing it
        decided.set()
        assert release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(pg, "_sweep_one", held)
    gc = threading.Thread(target=pg.collect_pages, args=(tmp_path,), kwargs=dict(remove=True))
    gc.start()
    assert decided.wait(30)
    store = pg.PageStore(tmp_path / "pages", poll_s=0.01)
    if not writer_waits:  # a writer without step 2 of spec 8.2
        monkeypatch.setattr(store, "wait_for_sweeps", lambda: None)
    real_verify = store._verify_existing

    def verify_then_let_gc_run(path, name):  # the writer found P; now the gc removes what it decided
        real_verify(path, name)
        release.set()
        gc.join(30)

    monkeypatch.setattr(store, "_verify_existing", verify_then_let_gc_run)
    w = threading.Thread(target=lambda: write(tmp_path / "new.hsnap", store, t, "new"))
    w.start()
    if writer_waits:  # the writer waits for the sweep it sees; let the gc finish
        time.sleep(0.3)
        release.set()
    w.join(60)
    gc.join(60)
    store.close()
    with open_chain(tmp_path / "new.hsnap") as chain:
        missing = [r.path for r in chain.page_refs() if not os.path.exists(r.path)]
    return missing, store.stats


def test_gc_protocol_closes_the_reuse_race(tmp_path, monkeypatch):
    """With spec 8.2's step 2 the writer waits for the sweep, then finds the pages gc removed
    missing and puts them again: its committed snapshot has every page. The same interleaving
    without step 2 loses them — the race this protocol exists for (the test can fail)."""
    missing, stats = _interleave(tmp_path / "with", monkeypatch, writer_waits=True)
    assert missing == [] and stats.sweep_waits > 0 and stats.pages_put == 3
    monkeypatch.undo()
    missing, stats = _interleave(tmp_path / "without", monkeypatch, writer_waits=False)
    assert len(missing) == 1 and stats.pages_reused >= 1  # the page it reused before the gc removed it


def _race(d, opts, tmp_path, rounds: int, writers: int = 2) -> dict:
    """Writers keep writing snapshots that share a prefix and deleting older ones; a gc keeps
    sweeping. Every committed snapshot's pages must exist: checked after each commit (while
    gc runs) and at the end."""
    store_ = store_for(d, opts)
    store_.makedirs(d)
    stop = threading.Event()
    problems: list[str] = []
    counts = {"snapshots": 0, "sweeps": 0, "removed": 0}
    lock = threading.Lock()

    def check(path):
        with open_chain(path, storage_options=opts) as chain:
            for r in chain.page_refs():
                if not store_.exists(r.path):
                    problems.append(f"{path}: page {r.page} missing")

    def writer(k):
        rng = np.random.default_rng(k)
        kept: list[str] = []
        for i in range(rounds):
            t = tokens_for(SYSTEM, 3 * S + 1 + S * int(rng.integers(0, 3)), seed=int(rng.integers(0, 4)))  # pages shared across writers
            name = store_.join(d, f"w{k}-{i}.hsnap")
            with pg.PageStore(store_.join(d, "pages"), storage_options=opts, poll_s=0.005) as ps:
                write(name, ps, t, f"w{k}-{i}")
            check(name)
            with lock:
                counts["snapshots"] += 1
            kept.append(name)
            if len(kept) > 2:  # the oldest goes: its pages become garbage unless shared
                old = kept.pop(0)
                check(old)
                store_.remove(old, version=next(e.version for e in store_.list(d) if e.path == old))
        for name in kept:
            check(name)

    def gc():
        while not stop.is_set():
            rep = pg.collect_pages(d, storage_options=opts, remove=True)
            with lock:
                counts["sweeps"] += 1
                counts["removed"] += sum(v.action == "removed" for v in rep.items)

    g = threading.Thread(target=gc)
    ws = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    g.start()
    for w in ws:
        w.start()
    for w in ws:
        w.join(600)
    stop.set()
    g.join(600)
    assert not problems, problems[:5]
    return counts


def test_gc_never_drops_a_needed_page_under_concurrent_writers(tmp_path):
    counts = _race(str(tmp_path / "run"), None, tmp_path, rounds=60)
    assert counts["snapshots"] == 120 and counts["sweeps"] > 5 and counts["removed"] > 0  # gc did remove garbage meanwhile


def test_gc_never_drops_a_needed_page_under_concurrent_writers_s3(s3server, tmp_path):
    d = f"s3://{s3server.make_bucket()}/run"
    counts = _race(d, s3server.options(), tmp_path, rounds=15)
    assert counts["snapshots"] == 30 and counts["sweeps"] > 1


# ----------------------------------------------------------------------------- the storage seam under concurrency


def test_a_listing_skips_an_entry_removed_meanwhile(tmp_path, monkeypatch):
    """A file removed (or renamed) between the directory read and its stat is not in the
    listing — it was reported as the whole directory missing, which gc read as "no markers"
    and "no snapshots" and so removed pages a committed snapshot needed (found by the race
    test above)."""
    from hsnap_format.stores import LOCAL

    for n in ("a", "b", "c"):
        (tmp_path / n).write_bytes(n.encode())
    real = os.scandir

    class Gone:
        def __init__(self, e):
            self._e, self.name, self.path = e, e.name, e.path

        def is_file(self, follow_symlinks=True):
            return True

        def stat(self, follow_symlinks=True):
            raise FileNotFoundError(2, "No such file or directory", self.path)

    class Listing:
        def __init__(self, path):
            self._it = real(path)

        def __iter__(self):
            return (Gone(e) if e.name == "b" else e for e in self._it)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

    monkeypatch.setattr(os, "scandir", Listing)
    assert [os.path.basename(e.path) for e in LOCAL.list(str(tmp_path))] == ["a", "c"]
    monkeypatch.undo()
    with pytest.raises(hf.HsnapIOError) as e:
        LOCAL.list(str(tmp_path / "missing"))
    assert e.value.path == str(tmp_path / "missing")
    assert pg._list_quiet(LOCAL, str(tmp_path / "missing")) == []


def test_put_bytes_of_a_name_taken_meanwhile_is_snapshot_exists(tmp_path, monkeypatch):
    """Two writers putting the same page: the one that loses gets SnapshotExistsError (and
    verifies the winner's page), not an HsnapIOError that failed its export."""
    from hsnap_format.stores import LOCAL

    target = tmp_path / "p"
    real = os.path.lexists

    def taken_after_check(path):
        found = real(path)
        if os.fspath(path) == str(target) and not found:
            target.write_bytes(b"the other writer's")
        return found

    monkeypatch.setattr(os.path, "lexists", taken_after_check)
    with pytest.raises(hf.SnapshotExistsError):
        LOCAL.put_bytes(str(target), b"mine")
    assert target.read_bytes() == b"the other writer's" and os.listdir(tmp_path) == ["p"]  # no temporary left


# ----------------------------------------------------------------------------- the golden vectors (spec 12)

VEC = Path(__file__).resolve().parent.parent / "spec" / "vectors"


def test_page_vectors_read_the_same_by_both_readers(tmp_path):
    """spec/vectors/pages.json: two snapshots sharing a prefix, three page objects (pages 0
    and 1 shared). hsnap_format and the independent reader (spec alone) assemble the same
    sections, which are the whole sections the description gives as input."""
    import independent_reader as ir
    import json

    desc = json.loads((VEC / "pages.json").read_text())
    assert len(page_files(VEC / "pages")) == 3
    refs = {}
    for snap_desc in desc["snapshots"]:
        path = VEC / snap_desc["file"]
        with open_chain(path) as chain:
            chain.verify()
            refs[snap_desc["file"]] = [os.path.basename(r.path) for r in chain.page_refs()]
            compact(chain, tmp_path / snap_desc["file"])
        theirs = ir.read_chain(path).sections
        with hf.open(tmp_path / snap_desc["file"]) as plain:
            for name, values in snap_desc["state"].items():
                ours = plain.read(name)
                assert ours.astype(np.float64).reshape(-1).tolist() == values
                assert np.asarray(theirs[name], dtype=np.float64).reshape(-1).tolist() == values
    assert refs["paged-a.hsnap"] == refs["paged-b.hsnap"][:2] and len(refs["paged-b.hsnap"]) == 3


def test_page_vectors_and_the_one_two_rules(monkeypatch):
    """Spec 9: a 1.2 reader refuses a file that references pages by name (a required feature
    it does not know) — the independent reader with 1.2's features, and the reference."""
    import independent_reader as ir
    from hsnap_format import reader

    monkeypatch.setattr(ir, "KNOWN_FEATURES", ir.KNOWN_FEATURES - {"pages"})
    monkeypatch.setattr(reader, "KNOWN_FEATURES", reader.KNOWN_FEATURES - {"pages"})
    for name in ("paged-a.hsnap", "paged-b.hsnap"):
        with pytest.raises(ir.HsnapSpecError) as e:
            ir.read_snapshot(VEC / name)
        assert e.value.kind == "UnsupportedFeatureError"
        with pytest.raises(hf.UnsupportedFeatureError):
            hf.Snapshot(VEC / name)
    with hf.open(VEC / "chain-base.hsnap") as s:  # every other file as before
        s.verify()


@pytest.mark.parametrize("label,fn,exc,field", PAGE_MUTATIONS, ids=[m[0] for m in PAGE_MUTATIONS])
def test_hostile_page_objects_same_verdict_from_the_spec_alone(tmp_path, label, fn, exc, field):
    """Each hostile page object of the table above: the independent reader refuses it with
    the same class (spec 5.11)."""
    import independent_reader as ir

    page = first_page(VEC / "pages")
    bad = craft.write(tmp_path / "bad.hpage", _page_mutant(page, fn))
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.read_page(bad)
    assert e.value.kind == exc.__name__, e.value


def test_hsnap_gc_pages_command(tmp_path):
    """``hsnap gc DIR --pages [--remove] [--json]``: lists, then removes, each unreferenced
    page with its size; exit 3 and nothing removed when a committed snapshot cannot be read."""
    import contextlib
    import io
    import json

    from hsnap_format.tools import cli

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main([str(a) for a in argv])
        return rc, out.getvalue(), err.getvalue()

    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, tokens_for(SYSTEM, 3 * S + 1 + S, seed=40), "a")
        write(tmp_path / "b.hsnap", store, tokens_for(SYSTEM, 3 * S + 1 + S, seed=41), "b")
    (tmp_path / "b.hsnap").unlink()
    rc, out, _ = run("gc", tmp_path, "--pages")
    assert rc == 0 and out.count("would remove") == 1 and "1 committed snapshot read" in out
    rc, out, _ = run("gc", tmp_path, "--pages", "--json")
    doc = json.loads(out)
    assert rc == 0 and [os.path.basename(i["path"]) for i in doc["items"] if i["removable"]] and doc["referenced"] == 4
    (tmp_path / "x.hsnap").write_bytes((tmp_path / "a.hsnap").read_bytes()[:100])  # starts like a snapshot, unreadable
    rc, out, _ = run("gc", tmp_path, "--pages", "--remove")
    assert rc == 3 and "sweep refused" in out and len(page_files(tmp_path / "pages")) == 5
    (tmp_path / "x.hsnap").unlink()
    rc, out, err = run("gc", tmp_path, "--pages", "--remove")
    assert rc == 0 and out.count("removing ") == 1 and len(page_files(tmp_path / "pages")) == 4


def test_hsnap_gc_pages_counts_what_it_keeps_and_removes_and_names_only_what_goes(tmp_path):
    """``hsnap gc --pages`` counts kept, removable and removed pages with their bytes — the counts of what the sweep
    then removed — and names at most 10 of the pages that go (never a kept one; --verbose: every object)."""
    import contextlib
    import io
    import json
    import re

    from hsnap_format.tools import cli

    def run(*argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main([str(a) for a in argv])
        return rc, out.getvalue()

    def totals(out: str) -> dict:
        return {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^  (kept|removable|removed|failed|gone) +(\d+) +(\d+) ", out, re.M)}

    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, tokens_for(SYSTEM, 3 * S + 1 + S, seed=50), "a")  # the 3 shared pages and 1 own
        for i in range(4):  # 3 own pages each, garbage once their snapshots are gone
            write(tmp_path / f"g{i}.hsnap", store, tokens_for(SYSTEM, 3 * S + 1 + 3 * S, seed=51 + i), f"g{i}")
    for i in range(4):
        (tmp_path / f"g{i}.hsnap").unlink()
    size = {n: (tmp_path / "pages" / n).stat().st_size for n in page_files(tmp_path / "pages")}
    with hf.open(tmp_path / "a.hsnap") as a:
        kept = {pg.page_name(a.pages.namespace_id, k, r) for k, r in a.pages.refs}
    assert len(size) == 16 and len(kept) == 4
    garbage = sum(n for name, n in size.items() if name not in kept)

    rc, out = run("gc", tmp_path, "--pages")
    assert rc == 0 and max(map(len, out.splitlines())) <= 80, out
    assert totals(out) == {"kept": (4, sum(size[n] for n in kept)), "removable": (12, garbage), "removed": (0, 0)}
    assert len(re.findall(r"^would remove ", out, re.M)) == 10 and "… and 2 more (--verbose lists all)" in out
    assert not re.search(r"^kept ", out, re.M) and "--remove removes the 12 removable pages" in " ".join(out.split())
    rc, out = run("gc", tmp_path, "--pages", "--json")
    assert json.loads(out)["totals"] == {"kept": {"count": 4, "bytes": sum(size[n] for n in kept)}, "removable": {"count": 12, "bytes": garbage},
                                         "removed": {"count": 0, "bytes": 0}, "failed": {"count": 0, "bytes": 0}, "gone": {"count": 0, "bytes": 0}}
    rc, out = run("gc", tmp_path, "--pages", "--verbose")
    assert len(re.findall(r"^kept ", out, re.M)) == 4 and len(re.findall(r"^would remove ", out, re.M)) == 12

    rc, out = run("gc", tmp_path, "--pages", "--remove")
    left = set(page_files(tmp_path / "pages"))
    removed = set(size) - left
    assert rc == 0 and left == kept and out.count("removing ") == 12
    assert totals(out) == {"kept": (4, sum(size[n] for n in left)), "removable": (12, sum(size[n] for n in removed)),
                           "removed": (12, sum(size[n] for n in removed))}
    assert len(re.findall(r"^removed ", out, re.M)) == 10 and "… and 2 more" in out and "dry run" not in out
    rc, out = run("gc", tmp_path, "--pages", "--remove")  # nothing left to remove: nothing named
    assert totals(out) == {"kept": (4, sum(size[n] for n in left)), "removable": (0, 0), "removed": (0, 0)}
    assert not re.search(r"^(removed|would remove|kept) ", out, re.M)


def test_mutation_run_seed6_manifest_checked_in_the_specs_order(tmp_path):
    """Found by ``python -m mutation --mutants 10000 --seed 6`` (run after adding the page
    vectors): a manifest without ``tp_size`` whose version has another major is refused by
    both readers as UnsupportedVersionError (spec 10.2: version is checked before tp_size);
    the independent reader had checked every key's presence first."""
    import independent_reader as ir
    from hsnap_format import canonical

    shutil.copytree(VEC / "two-rank", tmp_path / "two-rank")
    m = tmp_path / "two-rank" / "manifest.json"
    obj = canonical.loads(m.read_bytes().split(b"\n")[0])
    del obj["tp_size"]
    obj["version"] = [0, 0]
    m.write_bytes(craft.resign_manifest(canonical.dumps(obj) + b"\n" + m.read_bytes().split(b"\n", 1)[1]))
    with pytest.raises(hf.UnsupportedVersionError):
        hf.open(tmp_path / "two-rank")
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.read_directory(tmp_path / "two-rank")
    assert e.value.kind == "UnsupportedVersionError"


# ----------------------------------------------------------------------------- bounds, damage, files that are not snapshots


def test_gc_pages_skips_and_reports_a_file_too_short_for_the_magic(tmp_path):
    """An empty file (or a few bytes of the magic) beside a page store is not a snapshot (spec 8.2 step 4: it does
    not start with the magic): ``hsnap gc --pages`` says so and sweeps, instead of refusing with exit 3."""
    import contextlib
    import io

    from hsnap_format.tools import cli

    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, tokens_for(SYSTEM, 3 * S + 1 + S, seed=40), "a")
        write(tmp_path / "b.hsnap", store, tokens_for(SYSTEM, 3 * S + 1 + S, seed=41), "b")
    (tmp_path / "b.hsnap").unlink()
    (tmp_path / "empty.hsnap").write_bytes(b"")
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "rank-0.hsnap").write_bytes(b"\x89HSN")
    rep = pg.collect_pages(tmp_path)
    assert not rep.refused and sorted(os.path.basename(s.split(":")[0]) for s in rep.skipped) == ["empty.hsnap", "rank-0.hsnap"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["gc", str(tmp_path), "--pages", "--remove"])
    assert rc == 0 and "skipped: " in out.getvalue() and out.getvalue().count("removing ") == 1
    assert len(page_files(tmp_path / "pages")) == 4
    (tmp_path / "x.hsnap").write_bytes((tmp_path / "a.hsnap").read_bytes()[:40])  # the magic, then cut: still refused
    assert pg.collect_pages(tmp_path).refused


def test_gc_pages_verify_lists_a_damaged_page_object(tmp_path):
    """``hsnap gc --pages --verify`` reads every page object and lists each that fails (exit 1), referenced or not."""
    import contextlib
    import io

    from hsnap_format.tools import cli

    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "a.hsnap", store, tokens_for(SYSTEM, 3 * S + 1, seed=42), "a")
    victim = tmp_path / "pages" / page_files(tmp_path / "pages")[1]
    data = bytearray(victim.read_bytes())
    with pg.open_page(str(victim)) as p:
        data[p.sections[-1].offset] ^= 4
    victim.write_bytes(bytes(data))
    rep = pg.collect_pages(tmp_path, verify=True)
    assert len(rep.damaged) == 1 and str(victim) in rep.damaged[0] and "DigestMismatchError" in rep.damaged[0]
    assert next(v for v in rep.items if v.path == str(victim)).reason.startswith("damaged")
    assert not pg.collect_pages(tmp_path).damaged  # without --verify no page is read
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["gc", str(tmp_path), "--pages", "--verify"])
    assert rc == 1 and "damaged: " in out.getvalue()


def _one_layer_paged(tmp_path, S_: int, token: int, layers: int = 1):
    """A request of S_ + 1 positions, every token id ``token``, on ``layers`` tiny full-attention layers."""
    from hsnap_format.layout import state_sections
    from hsnap_format.spec import DTYPES

    geom = hf.Geometry(attention=AttentionGeometry("mha", tuple(range(layers)), 1, 1, 1, "bfloat16", "bfloat16", 1))
    t = np.full(S_ + 1, token, dtype=np.int32)
    rec = hf.RequestRecord(rid="r", prompt_ids=t[:1], output_ids=t[1:], state_position=S_, output_logprobs=np.zeros(S_, np.float32),
                           max_new_tokens=None, streamed_tokens=S_)
    st = {s.name: np.zeros(s.shape, DTYPES[s.dtype]) for s in state_sections(geom, S_)}
    return geom, rec, st


def test_page_size_is_bounded_so_every_page_object_opens(tmp_path):
    """A page of 2^18 positions has a header over the 1 MiB a reader reads (spec 7.1 step 8): the writer refuses
    such a page size typed before putting anything, readers refuse a ``pages.page_size`` above 2^16, and the
    largest legal page, every token id at its longest, writes and verifies."""
    from hsnap_format.spec import MAX_PAGE_SIZE

    assert MAX_PAGE_SIZE == 1 << 16
    with pytest.raises(hf.PageError) as e:
        pg.PageStore(tmp_path / "pages", page_size=1 << 18)
    assert e.value.field == "page_size"
    geom, rec, st = _one_layer_paged(tmp_path, 1 << 18, 7)
    geom = hf.Geometry(attention=AttentionGeometry("mha", (0,), 1, 1, 1, "bfloat16", "bfloat16", 1 << 18))
    with pg.PageStore(tmp_path / "pages") as store:  # the pool's page size, taken as the page size
        with pytest.raises(hf.MalformedHeaderError) as e:
            pg.write_paged_snapshot(tmp_path / "big.hsnap", identity=identity(), geometry=geom, record=rec, state=st, pages=store)
    assert e.value.field == "pages.page_size" and not (tmp_path / "big.hsnap").exists() and page_files(tmp_path / "pages") == []
    geom, rec, st = _one_layer_paged(tmp_path, MAX_PAGE_SIZE, (1 << 31) - 1)
    with pg.PageStore(tmp_path / "pages", page_size=MAX_PAGE_SIZE) as store:
        pg.write_paged_snapshot(tmp_path / "max.hsnap", identity=identity(), geometry=geom, record=rec, state=st, pages=store)
    with open_chain(tmp_path / "max.hsnap") as chain:
        chain.verify()
    geom, rec, st = _one_layer_paged(tmp_path, MAX_PAGE_SIZE, 5, layers=2000)  # a namespace whose worst page would not fit
    with pg.PageStore(tmp_path / "pages2", page_size=MAX_PAGE_SIZE) as store:
        with pytest.raises(hf.MalformedHeaderError) as e:
            pg.write_paged_snapshot(tmp_path / "wide.hsnap", identity=identity(), geometry=geom, record=rec, state=st, pages=store)
    assert e.value.field == "pages.page_size" and page_files(tmp_path / "pages2") == []


def test_too_many_page_references_are_refused_before_any_key_is_computed(tmp_path):
    """2^20 full pages cannot be referenced from a 1 MiB header: refused at once (no key built, no page put), typed,
    instead of tens of seconds and a gigabyte spent on keys and a header that is then refused."""
    import tracemalloc

    n = (1 << 20) + 1
    t = np.arange(n, dtype=np.int32) % 1000
    rec = hf.RequestRecord(rid="r", prompt_ids=t[:1], output_ids=t[1:], state_position=n - 1, output_logprobs=np.zeros(n - 1, np.float32),
                           max_new_tokens=None, streamed_tokens=n - 1)
    geom = hf.Geometry(attention=AttentionGeometry("mha", (0,), 1, 1, 1, "bfloat16", "bfloat16", 1))

    def no_keys(tokens, size):
        raise AssertionError("keys computed")

    store = pg.PageStore(tmp_path / "pages", page_size=1, keys=no_keys)
    tracemalloc.start()
    t0 = time.monotonic()
    with pytest.raises(hf.MalformedHeaderError) as e:
        store.plan_pages(path=str(tmp_path / "big.hsnap"), identity=identity(), geometry=geom, record=rec, base_position=0)
    took, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert e.value.field == "pages.refs" and took < 2 and peak < 64 << 20 and not (tmp_path / "pages").exists()


def test_a_page_size_over_the_bound_same_verdict_from_the_spec_alone(paged):
    """The reader written from the spec alone refuses ``pages.page_size`` above 2^16 as the reference does."""
    import independent_reader as ir

    bad = craft.write(paged / "bad.hsnap", craft.mutate_header((paged / "a.hsnap").read_bytes(),
                                                               lambda h: (h["pages"].update(page_size=(1 << 16) + 1), None)[1]))
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.read_snapshot(bad)
    assert (e.value.kind, e.value.field) == ("MalformedHeaderError", "pages.page_size")


def test_a_symbolic_link_in_place_of_a_page_object_is_not_followed_by_either_reader(paged, tmp_path):
    """Spec 7.6 with 7.1 step 1: a page object found by name is opened as any path a reader is given — a symbolic
    link there, even to the very page, is refused (``HsnapIOError``, ``open``) by both readers."""
    import independent_reader as ir

    victim = paged / "pages" / page_files(paged / "pages")[0]
    real = tmp_path / "real.hpage"
    victim.rename(real)
    victim.symlink_to(real)
    with pytest.raises(hf.HsnapIOError) as e:
        with open_chain(paged / "a.hsnap") as chain:
            chain.verify()
    assert e.value.field == "open"
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_chain(paged / "a.hsnap")
    assert (e2.value.kind, e2.value.field) == ("HsnapIOError", "open")


def test_unknown_keys_of_the_attention_axis_stay_out_of_the_namespace(paged):
    """Spec 5.10: the namespace's ``sharding`` is the AXIS's ``axis``, ``global`` and ``parts``; unknown keys a
    writer put beside them (5.6: ignored) do not enter the namespace id — both readers accept such a file whose
    ``pages.namespace_id`` is computed without them, and refuse it computed with them."""
    import independent_reader as ir

    axis = {"axis": 1, "global": 2, "parts": [[0, 2, 1]]}
    with pg.open_page(str(first_page(paged / "pages"))) as p:
        ns = dict(p.header["namespace"])

    def edit(nid_of):
        def fn(h):
            h["geometry"]["sharding"] = {"attention": {**axis, "zz": 1}, "conv": None, "temporal": None}
            h["pages"]["namespace_id"] = layout.namespace_id({**ns, "sharding": nid_of})
        return craft.mutate_header((paged / "a.hsnap").read_bytes(), lambda h: (fn(h), None)[1])

    good = craft.write(paged / "good.hsnap", edit(axis))
    with hf.Snapshot(good):
        pass
    ir.read_snapshot(good)
    bad = craft.write(paged / "bad.hsnap", edit({**axis, "zz": 1}))
    with pytest.raises(hf.MalformedHeaderError) as e:
        hf.Snapshot(bad)
    assert e.value.field == "pages.namespace_id"
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_snapshot(bad)
    assert (e2.value.kind, e2.value.field) == ("MalformedHeaderError", "pages.namespace_id")


def test_a_negative_token_id_in_a_paged_position_has_no_key_for_either_reader(paged):
    """Spec 5.10/7.6: keys are over token ids as u32; a request section holding an int32 below 0 at a paged position
    gives no key: R-7.6-1 refuses the first reference it reaches, ``DigestMismatchError`` (``pages.refs[0] (key of
    page 0)``), by both readers — never an untyped error."""
    import independent_reader as ir

    data = bytearray((paged / "a.hsnap").read_bytes())
    with hf.open(paged / "a.hsnap") as snap:
        off = snap.section("request.prompt_ids").offset
    data[off + 8 : off + 12] = np.int32(-5).tobytes()  # token 2 of the prompt, in page 0
    bad = craft.write(paged / "neg.hsnap", craft.resign(bytes(data)))
    with pytest.raises(hf.DigestMismatchError) as e:
        with open_chain(bad) as chain:
            chain.verify()
    assert e.value.field == "pages.refs[0] (key of page 0)" and "-5" in str(e.value)
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_chain(bad)
    assert (e2.value.kind, e2.value.field) == ("DigestMismatchError", "pages.refs[0] (key of page 0)")


def test_zero_full_pages_reads_as_a_file_holding_all_its_rows_in_both_readers(tmp_path):
    """Spec 5.10: a writer writes ``pages`` only when a full page fits, but a file whose ``pages`` has ``count`` 0
    (an empty ``refs``) is not refused: it holds all its rows (G = 0), names no page object, and both readers open,
    verify and read it as one snapshot."""
    import independent_reader as ir

    t = tokens_for([], PROMPT + 2, seed=9)  # positions 0..6: no full page of 8
    write_plain(tmp_path / "plain.hsnap", t, "z")
    with hf.open(tmp_path / "plain.hsnap") as snap:
        nid = layout.namespace_id(layout.namespace(snap.identity, snap.geometry, 8))

    def fn(h):
        h["features"]["required"] = sorted(h["features"]["required"] + ["pages"])
        h["pages"] = {"namespace_id": nid, "page_size": 8, "refs": [], "store": "pages"}

    f = craft.write(tmp_path / "zero.hsnap", craft.mutate_header((tmp_path / "plain.hsnap").read_bytes(), lambda h: (fn(h), None)[1]))
    with open_chain(f) as chain:
        assert chain.head.pages.count == 0
        chain.verify()
    assert ir.read_chain(f).links[0].header["pages"]["refs"] == []
