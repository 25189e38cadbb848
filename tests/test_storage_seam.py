"""One storage seam (issue 20, Design): local files and ``s3://`` objects behind one small
interface (:mod:`hsnap_format.storage`). No call site tells a URL from a path by itself,
``manifest.py`` and ``remote.py`` no longer import each other, and the primitives a chain,
a page store and gc build on keep the same promises on a disk and on a real SeaweedFS."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import hsnap_format as hf
from hsnap_format.storage import LOCAL, Entry, LocalStore, S3Store, Store, store_for

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


def test_design_manifest_and_remote_no_longer_import_each_other():
    manifest = _imports(ROOT / "hsnap_format" / "manifest.py")
    assert not {m for m in manifest if m.endswith("remote")}, manifest
    assert ".manifest" in _imports(ROOT / "hsnap_format" / "remote.py")  # one direction only: a remote set is a set


def test_design_no_call_site_tells_a_url_from_a_path_by_itself():
    """Every place that tested ``is_url`` (or ``"://" in path``) asks the seam: only
    storage.py decides, and remote.py parses its own endpoint URLs."""
    found = []
    for top in ("hsnap_format", "hsnap_io", "viewer"):  # (hsnap_sglang, being written now, is its author's to route)
        for p in (ROOT / top).rglob("*.py"):
            rel = p.relative_to(ROOT).as_posix()
            if rel in ("hsnap_format/storage.py",):
                continue
            text = p.read_text(encoding="utf-8")
            if re.search(r"\bis_url\b", text):
                found.append(f"{rel}: is_url")
            for m in re.finditer(r'["\']://["\'] in (\w+)', text):
                if not (rel == "hsnap_format/remote.py" and m.group(1) == "value"):  # an endpoint, not a snapshot path
                    found.append(f"{rel}: '://' in {m.group(1)}")
    assert not found, found


def test_design_stores_declare_the_protocol_and_store_for_picks_by_the_path():
    assert isinstance(LOCAL, Store) and isinstance(S3Store(), Store)
    assert LOCAL.local and not S3Store().local
    assert store_for("a/b.hsnap") is LOCAL and store_for(Path("a/b.hsnap")) is LOCAL
    assert isinstance(store_for("s3://bucket/key"), S3Store)
    assert store_for("s3://bucket/key").split("s3://bucket/run/link-2.hsnap") == ("s3://bucket/run", "link-2.hsnap")
    assert LOCAL.split("/x/run/set/") == ("/x/run", "set") and LOCAL.join("/x/run", "a") == "/x/run/a"
    assert hf.open_snapshot is hf.manifest.open_snapshot  # one opener, re-exported


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
