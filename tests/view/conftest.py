"""Fixtures of the viewer tests: the snapshots of view_fixtures.py, once per
session, and no blinking cursors."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from textual.widgets import Input  # noqa: E402

from view_fixtures import build_big, build_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsnap-view")
    build_fixtures(str(root))
    return root


@pytest.fixture(scope="session")
def big_snapshot(tmp_path_factory) -> str:
    """10,006 sections in two rank files, written once per session (about 1-2 s)."""
    return build_big(str(tmp_path_factory.mktemp("hsnap-view-big")))


@pytest.fixture
def in_fixtures(fixtures_dir, monkeypatch):
    """chdir into the fixtures so paths are plain relative names."""
    monkeypatch.chdir(fixtures_dir)
    return fixtures_dir


@pytest.fixture(autouse=True)
def no_cursor_blink(monkeypatch):
    """A blinking cursor makes snapshots random (command palette, inputs)."""
    monkeypatch.setattr(Input, "_toggle_cursor", lambda self: None, raising=False)
