"""hsnap_sglang.confine: every client-named path resolves beneath the snapshot root, every URL beneath an allowed
prefix; nothing outside is opened, no symlink beneath the root is followed (no server needed)."""

from __future__ import annotations

import os

import pytest

from hsnap_sglang import confine
from hsnap_sglang.confine import DIR, FILE, READ, ConfinementError, resolve
from hsnap_sglang.errors import error_dict


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    return r


def env_of(root, urls: str = "") -> dict:
    return {confine.ROOT_ENV: str(root), confine.ALLOWED_URLS_ENV: urls}


def test_relative_path_lands_under_the_root(root):
    assert resolve("a.hsnap", "path", FILE, env=env_of(root)) == str(root / "a.hsnap")
    assert resolve("./x/./y", "dir", DIR, create=True, env=env_of(root)) == str(root / "x" / "y")
    assert (root / "x" / "y").is_dir() and (root / "x" / "y").stat().st_mode & 0o777 == 0o700


def test_absolute_path_inside_the_root_is_accepted_as_configured_or_real(root, tmp_path):
    link = tmp_path / "root-link"
    link.symlink_to(root)  # the operator's own root may be named through a link
    env = env_of(link)
    assert resolve(str(link / "a.hsnap"), "path", FILE, env=env) == str(root / "a.hsnap")
    assert resolve(str(root / "a.hsnap"), "path", FILE, env=env) == str(root / "a.hsnap")


@pytest.mark.parametrize("path", ["/etc/passwd", "/tmp", "/", "/proc/self/environ"])
def test_absolute_path_outside_the_root_is_refused_before_any_lookup(root, path, monkeypatch):
    looked: list = []
    for name in ("open", "stat", "lstat", "mkdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda p, *a, _real=real, **k: (looked.append(p), _real(p, *a, **k))[1])
    with pytest.raises(ConfinementError, match="beneath the snapshot root") as e:
        resolve(path, "path", READ, env=env_of(root))
    assert error_dict(e.value)["status"] == 403
    # only the root itself was looked at (its real path): nothing the client named
    assert all(isinstance(p, str) and (str(root).startswith(p) or p.startswith(str(root))) for p in looked), looked


@pytest.mark.parametrize("path", ["../x.hsnap", "a/../../x", "a/..", "{root}/../x.hsnap", "{root}/a/../b"])
def test_dot_dot_component_is_refused(root, path):
    with pytest.raises(ConfinementError, match=r"no '\.\.' component"):
        resolve(path.format(root=root), "path", FILE, env=env_of(root))


def test_planted_symlinked_directory_is_not_followed(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "evil").symlink_to(outside)
    for kind, path, create in ((FILE, "evil/x.hsnap", False), (DIR, "evil", True), (DIR, "evil/sub", True), (READ, "evil/x", False)):
        with pytest.raises(ConfinementError, match="evil is a symlink"):
            resolve(path, "path", kind, create=create, env=env_of(root))
    assert list(outside.iterdir()) == []


def test_symlink_in_the_last_component_is_refused(root):
    (root / "snap.hsnap").symlink_to("/etc/passwd")
    with pytest.raises(ConfinementError, match="snap.hsnap is a symlink"):
        resolve("snap.hsnap", "path", READ, env=env_of(root))


def test_file_in_place_of_a_directory_is_refused(root):
    (root / "f").write_bytes(b"")
    with pytest.raises(ConfinementError, match="f is not a directory"):
        resolve("f/x", "dir", DIR, create=True, env=env_of(root))


def test_no_root_configured_names_the_setting(tmp_path):
    with pytest.raises(ConfinementError) as e:
        resolve(str(tmp_path / "x.hsnap"), "path", FILE, env={})
    assert "--hsnap-root" in str(e.value) and "HSNAP_ROOT" in str(e.value)
    assert error_dict(e.value)["status"] == 403


@pytest.mark.parametrize("path", ["a\x00b", "a\ud800b"])
def test_unencodable_path_is_a_typed_refusal(root, path):
    with pytest.raises(ConfinementError):
        resolve(path, "path", FILE, env=env_of(root))


@pytest.mark.parametrize("url", [
    "s3://b/snaps/x.hsnap", "s3://b/snaps", "s3://b/snaps/", "s3://b/snaps/sub/y", "s3://open/anything",
])
def test_url_beneath_an_allowed_prefix_is_accepted(root, url):
    assert resolve(url, "path", FILE, env=env_of(root, "s3://b/snaps, s3://open")) == url


@pytest.mark.parametrize("url", [
    "s3://b/snapsX/x", "s3://b/other", "s3://bb/snaps/x", "s3://B/snaps/x", "s3://b/snaps/../other/x", "s3://b//snaps/x",
    "s3://b/snaps//x", "s3://b/snaps/./x", "s3://k:s@b/snaps/x", "http://b/snaps/x", "s3://b/snaps\\..\\x", "s3://b",
])
def test_url_outside_the_allowed_prefixes_is_refused(root, url):
    with pytest.raises(ConfinementError) as e:
        resolve(url, "path", FILE, env=env_of(root, "s3://b/snaps,s3://c"))
    assert "s3://k:s@" not in str(e.value)


def test_no_allowed_prefix_refuses_every_url(root):
    with pytest.raises(ConfinementError, match="--hsnap-allow-url"):
        resolve("s3://b/x", "path", FILE, env=env_of(root))


def test_malformed_allowed_entries_widen_nothing(root):
    assert confine.allowed_urls(env_of(root, "s3://b/../, s3://, s3://k@b/x, ,s3://ok/p/")) == [("ok", ("p",))]


def _scheduler_side(answers: list):
    """What migration.on_migrate / on_follow use of the scheduler's plug-in state (no SGLang)."""
    from types import SimpleNamespace

    return SimpleNamespace(locate=lambda rid: (None, None), tp_size=1, busy=lambda rid: False, migrations={}, follows={}, arrived={},
                           checkpoints={}, sched=SimpleNamespace(req_to_token_pool=None, token_to_kv_pool_allocator=None),
                           identity=lambda: None, answer=lambda msg, **kw: answers.append(kw),
                           answer_once_told=lambda told, msg, **kw: answers.append(dict(kw, ok=False)))


@pytest.mark.parametrize("handler", ["on_migrate", "on_follow"])
def test_scheduler_rechecks_a_container_outside_the_root_and_writes_nothing_there(tmp_path, monkeypatch, handler):
    from types import SimpleNamespace

    from hsnap_sglang import migration

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    monkeypatch.setenv(confine.ROOT_ENV, str(root))
    answers: list = []
    msg = SimpleNamespace(rid="r", dir=str(outside / "mig"), op_id="op", tail=4, max_rounds=2, timeout_s=1.0, fsync=False)
    getattr(migration, handler)(_scheduler_side(answers), msg)
    assert answers and answers[0]["ok"] is False and answers[0]["error"]["type"] == "ConfinementError", answers
    assert not outside.exists()  # not even abandoned.json for a target that might follow it
