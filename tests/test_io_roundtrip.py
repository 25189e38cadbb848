"""Export from real SGLang pools, restore in a FRESH process into pools of another
capacity with other slots in use, compare every restored row byte for byte."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
from io_cases import CASES, case_id, export_from, record, rows_as_bytes, source  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_testing import zygote

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Export every case once; restore all of them in one fresh child process."""
    root = tmp_path_factory.mktemp("io")
    items, expected, fingerprints = [], {}, {}
    for kind, page in CASES:
        cid = case_id(kind, page)
        ps, req = source(kind, page)
        before = sp.pool_state_fingerprint(ps)
        path = str(root / f"{cid}.hsnap")
        export_from(ps, req, path)
        fingerprints[cid] = (before, sp.pool_state_fingerprint(ps))
        expected[cid] = rows_as_bytes(sp.request_rows(ps, req))
        items.append({"kind": kind, "page": page, "path": path, "out": str(root / f"{cid}.out")})
    spec = root / "spec.json"
    spec.write_text(json.dumps({"items": items}))
    proc = zygote.run([sys.executable, os.path.join(HERE, "io_cases.py"), "restore", str(spec)], text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {i["kind"] + "-p" + str(i["page"]): i for i in items}, expected, fingerprints


@pytest.mark.parametrize("kind,page", CASES, ids=[case_id(*c) for c in CASES])
def test_fresh_process_restore_is_byte_identical(exported, kind, page):
    items, expected, _ = exported
    cid = case_id(kind, page)
    out = items[cid]["out"]
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["pid"] != os.getpid()
    assert meta["output_ids"] == record().output_ids.tolist()
    exp = expected[cid]
    got = {f[:-4]: np.load(os.path.join(out, f), allow_pickle=False) for f in os.listdir(out) if f.endswith(".npy")}
    assert sorted(got) == sorted(exp)
    for name in exp:
        assert got[name].dtype == exp[name].dtype and np.array_equal(got[name], exp[name]), name


@pytest.mark.parametrize("kind,page", CASES, ids=[case_id(*c) for c in CASES])
def test_export_leaves_source_untouched(exported, kind, page):
    before, after = exported[2][case_id(kind, page)]
    assert sp.diff_fingerprints(before, after) == []


@pytest.mark.parametrize("kind,page", CASES, ids=[case_id(*c) for c in CASES])
def test_snapshot_sections_match_pool_geometry(exported, kind, page):
    items, _, _ = exported
    with hf.open(items[case_id(kind, page)]["path"]) as snap:
        snap.verify()
        kinds = [s.kind for s in snap.sections if s.is_state]
        layers = snap.geometry
        if kind in ("hybrid_linear", "swa_mamba"):
            # Mamba state exactly once per mamba layer, whichever pool carries it
            assert kinds.count("temporal") == len(layers.mamba.layers)
            assert kinds.count("conv") == len(layers.mamba.layers) * len(layers.mamba.conv_shapes)
        else:
            assert layers.mamba is None and "temporal" not in kinds
        if kind == "mha_fp8":
            assert layers.attention.dtype == "float8_e4m3fn" and layers.attention.storage_dtype == "uint8"
        if kind in ("swa", "swa_mamba"):
            assert snap.swa_start == 8
            assert snap.section(f"swa.{layers.attention.swa_layers[0]}.k").shape[0] == snap.state_position - 8
        assert layers.attention.page_size == page
