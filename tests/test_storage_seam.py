"""One storage seam: local files and ``s3://`` objects behind one small
interface (:mod:`hsnap_format.stores`). No call site tells a URL from a path by itself,
the format classes import no store, and the primitives a chain,
a page store and gc build on keep the same promises on a disk and on a real SeaweedFS."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import hsnap_format as hf
from hsnap_format.source import Entry, Store
from hsnap_format.stores import LOCAL, store_for
from hsnap_format.stores.local import LocalStore
from hsnap_format.stores.s3 import S3Store

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module a file imports (relative ones as ``.name``), at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
            out.update("." * node.level + a.name for a in node.names if node.module is None)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_design_format_classes_import_no_store():
    """Snapshots, writers and sets take a byte source or sink; the stores import them, never the reverse."""
    for name in ("reader", "writer", "manifest", "source", "layout", "records", "spec", "errors", "canonical", "localfs"):
        imports = _imports(ROOT / "hsnap_format" / f"{name}.py")
        assert not {m for m in imports if "stores" in m or m.endswith("remote")}, (name, imports)
    assert "...manifest" in _imports(ROOT / "hsnap_format" / "stores" / "s3" / "__init__.py")  # a remote set is a set


def test_design_no_call_site_tells_a_url_from_a_path_by_itself():
    """Every place that tested ``is_url`` (or ``"://" in path``) asks the seam: only
    the stores package decides (and parses its own endpoint URLs)."""
    found = []
    for top in ("hsnap_format", "hsnap_io", "viewer"):  # (hsnap_sglang, being written now, is its author's to route)
        for p in (ROOT / top).rglob("*.py"):
            rel = p.relative_to(ROOT).as_posix()
            if rel.startswith("hsnap_format/stores/"):
                continue
            text = p.read_text(encoding="utf-8")
            if re.search(r"\bis_url\b", text):
                found.append(f"{rel}: is_url")
            for m in re.finditer(r'["\']://["\'] in (\w+)', text):
                found.append(f"{rel}: '://' in {m.group(1)}")
    assert not found, found


def test_design_stores_declare_the_protocol_and_store_for_picks_by_the_path():
    assert isinstance(LOCAL, Store) and isinstance(S3Store(), Store)
    assert LOCAL.local and not S3Store().local
    assert store_for("a/b.hsnap") is LOCAL and store_for(Path("a/b.hsnap")) is LOCAL
    assert isinstance(store_for("s3://bucket/key"), S3Store)
    assert store_for("s3://bucket/key").split("s3://bucket/run/link-2.hsnap") == ("s3://bucket/run", "link-2.hsnap")
    assert LOCAL.split("/x/run/set/") == ("/x/run", "set") and LOCAL.join("/x/run", "a") == "/x/run/a"
    assert hf.open_snapshot is hf.stores.open_snapshot  # one opener, re-exported


# ----------------------------------------------------------------------------- the primitives


@pytest.fixture(params=["local", "s3"])
def store_and_dir(request, tmp_path):
    if request.param == "local":
        return LocalStore(), str(tmp_path)
    server = request.getfixturevalue("s3server")
    bucket = server.make_bucket()
    return S3Store(server.options()), f"s3://{bucket}/pages"


def test_design_put_read_list_remove_keep_their_promises(store_and_dir, tmp_path):
    store, d = store_and_dir
    a, b = store.join(d, "a.blob"), store.join(d, "b.blob")
    va = store.put_bytes(a, b"first")
    with pytest.raises(hf.SnapshotExistsError):  # commit without overwrite
        store.put_bytes(a, b"second")
    assert store.read_bytes(a, 64) == (b"first", va)
    vb = store.put_bytes(b, b"other bytes")
    with pytest.raises(hf.HsnapError):  # bigger than the caller allows: refused, not truncated
        store.read_bytes(b, 4)
    listed = {e.path: e for e in store.list(d)}
    assert listed == {a: Entry(a, 5, va), b: Entry(b, 11, vb)}
    with pytest.raises(hf.DigestMismatchError):  # only the version named is removed
        store.remove(a, version=vb)
    assert store.exists(a) and store.read_bytes(a, 64)[0] == b"first"
    store.remove(a, version=va)
    assert not store.exists(a) and [e.path for e in store.list(d)] == [b]


def test_design_local_list_and_remove_follow_no_link(tmp_path):
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    (tmp_path / "sub").mkdir()
    assert [os.path.basename(e.path) for e in LOCAL.list(str(tmp_path))] == ["real"]
    with pytest.raises(hf.HsnapError):
        LOCAL.read_bytes(str(tmp_path / "link"), 10)
    version = LOCAL.list(str(tmp_path))[0].version
    with pytest.raises(hf.DigestMismatchError):
        LOCAL.remove(str(tmp_path / "link"), version=version)  # the link is not the version read: put back
    assert os.path.islink(tmp_path / "link") and sorted(os.listdir(tmp_path)) == ["link", "real", "sub"]


def test_design_local_remove_of_a_file_changed_since_it_was_read(tmp_path):
    p = str(tmp_path / "x")
    v = LOCAL.put_bytes(p, b"one")
    with open(p, "ab") as f:
        f.write(b" more")
    with pytest.raises(hf.DigestMismatchError):
        LOCAL.remove(p, version=v)
    assert open(p, "rb").read() == b"one more" and os.listdir(tmp_path) == ["x"]  # put back, nothing else left


def test_design_snapshots_open_write_and_copy_through_the_seam(s3server, tmp_path):
    """The snapshot operations every call site uses, on both stores: a writer's file opens
    through the store; cp goes through the stores' sinks and set writers."""
    from hsnap_format.tools.cli_remote import copy

    opts = s3server.options()
    url = f"s3://{s3server.make_bucket()}/x"
    vec = ROOT / "spec" / "vectors"
    assert copy(str(vec / "two-rank"), f"{url}/set", storage_options=opts) > 0
    assert copy(f"{url}/set", str(tmp_path / "set"), storage_options=opts) > 0
    for name in ("manifest.json", "rank-0.hsnap", "rank-1.hsnap"):
        assert (tmp_path / "set" / name).read_bytes() == (vec / "two-rank" / name).read_bytes()
    with store_for(f"{url}/set", opts).open(f"{url}/set") as s:
        assert isinstance(s, hf.SnapshotSet) and s.manifest.tp_size == 2


def test_design_a_memory_store_reads_writes_and_sets_through_sources_and_sinks():
    """The format classes need nothing of a file: the memory store's sources and sinks carry a
    snapshot and a set through the same writers and readers, and the same refusals."""
    from hsnap_format.stores import memory

    memory.clear()
    vec = ROOT / "spec" / "vectors"
    with hf.open(str(vec / "two-rank")) as src:
        store = store_for("memory://t/set")
        assert isinstance(store, Store) and not store.local
        sw = store.set_writer("memory://t/set")
        for r, snap in src.ranks.items():
            with sw.rank_writer(r, identity=snap.identity, geometry=snap.geometry, record=snap.record(), swa_start=snap.swa_start,
                                features_optional=snap.header["features"]["optional"]) as w:
                for s in w.pending_state_sections():
                    w.write_section(s.name, snap.read(s.name))
                w.commit()
        sw.commit(tp_size=len(src.ranks))
        with hf.open("memory://t/set") as got:
            assert isinstance(got, hf.SnapshotSet) and got.manifest == src.manifest
            got.verify()
            for r, snap in src.ranks.items():
                assert got.ranks[r].root_digest == snap.root_digest
                for s in snap.sections:
                    assert bytes(got.ranks[r].raw(s.name)) == bytes(snap.raw(s.name))
        with pytest.raises(hf.SnapshotExistsError):
            store.writer("memory://t/set/rank-0.hsnap", identity=src.ranks[0].identity, geometry=src.ranks[0].geometry,
                         record=src.ranks[0].record())
    assert [e.path for e in store.list("memory://t/set")] == ["memory://t/set/manifest.json", "memory://t/set/rank-0.hsnap",
                                                              "memory://t/set/rank-1.hsnap"]
    memory.clear()


@pytest.mark.parametrize("version", ["", None])
def test_object_store_refuses_a_remove_without_a_version(version):
    """A listing or read without an ETag gives the version "": removing it would be a delete without If-Match, which
    removes whatever object is there now; the store refuses before any request is made (no endpoint here answers)."""
    from hsnap_format.stores.s3.client import RemoteIOError

    store = S3Store({"endpoint_url": "http://127.0.0.1:9", "attempts": 1})
    with pytest.raises(RemoteIOError, match="conditional"):
        store.remove("s3://bucket/prefix/leftover.tmp", version=version)
