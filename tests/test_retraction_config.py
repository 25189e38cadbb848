"""Retraction to disk is the operator's choice (``HSNAP_RETRACT_DIR``) and is on only where a retracted request's
state can be captured at a committed boundary: TP 1, no PD disaggregation, no overlap scheduler (said once at start,
SGLang then recomputes retracted requests as without the plug-in).  The server path itself: tests/engine/
test_hsnap_mamba2.py."""

from __future__ import annotations

import enum
import logging
import os
import stat
import types

import pytest

pytest.importorskip("sglang")

from hsnap_sglang import retraction  # noqa: E402


# SGLang's scheduler holds sglang.srt.disaggregation.utils.DisaggregationMode (whose module needs torchvision here)
DisaggregationMode = enum.Enum("DisaggregationMode", {"NULL": "null", "PREFILL": "prefill", "DECODE": "decode"})


def _hs(tp_size: int = 1, overlap: bool = False, pd: str = "null"):
    """What from_env reads of the plug-in's scheduler: its TP size, and SGLang's scheduler's overlap switch and PD mode."""
    return types.SimpleNamespace(tp_size=tp_size, sched=types.SimpleNamespace(enable_overlap=overlap, disaggregation_mode=DisaggregationMode(pd)))


def test_off_unless_the_operator_names_a_directory(monkeypatch):
    monkeypatch.delenv(retraction.RETRACT_DIR_ENV, raising=False)
    assert retraction.from_env(_hs()) is None


def test_on_at_tp1_without_overlap_the_directory_made_private(monkeypatch, tmp_path):
    d = tmp_path / "retracted"
    monkeypatch.setenv(retraction.RETRACT_DIR_ENV, str(d))
    rt = retraction.from_env(_hs())
    assert isinstance(rt, retraction.RetractionToDisk) and rt.directory == str(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert rt.state()["held"] == {} and not rt.busy()


@pytest.mark.parametrize("hs,why", [(_hs(overlap=True), "overlap scheduler"), (_hs(tp_size=2), "TP > 1"),
                                    (_hs(pd="decode"), "PD disaggregation")])
def test_refused_where_the_state_cannot_be_captured_at_a_boundary(monkeypatch, tmp_path, caplog, hs, why):
    monkeypatch.setenv(retraction.RETRACT_DIR_ENV, str(tmp_path / "retracted"))
    with caplog.at_level(logging.WARNING, logger="hsnap_sglang"):
        assert retraction.from_env(hs) is None
    assert why in caplog.text and "recomputes" in caplog.text
    assert not (tmp_path / "retracted").exists()
