"""The library is reachable without the TUI (as harlequin's guard): importing
hsnap_format, its CLI, diff and stats pulls no textual, rich, torch or SGLang; the
viewer pulls no torch or SGLang. Checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_hsnap_format_imports_no_tui_and_no_torch():
    loaded = _modules_after("import hsnap_format, hsnap_format.tools.cli, hsnap_format.tools.diff, hsnap_format.tools.stats, hsnap_format.tools.viewmodel")
    assert not loaded & {"textual", "rich", "torch", "sglang", "transformers"}, loaded & {"textual", "rich", "torch", "sglang"}


def test_hsnap_diff_runs_without_the_tui():
    loaded = _modules_after("from hsnap_format.tools.cli import main\ntry:\n    main(['diff', '/nonexistent-a', '/nonexistent-b'])\nexcept SystemExit:\n    pass")
    assert not loaded & {"textual", "rich", "torch", "sglang"}


def test_hsnap_view_imports_no_torch_or_sglang():
    pytest.importorskip("textual")
    loaded = _modules_after("import hsnap_view.app, hsnap_view.compat, hsnap_view.tokenizer")
    assert "textual" in loaded
    assert not loaded & {"torch", "sglang", "transformers"}
