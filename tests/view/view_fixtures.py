"""Small snapshots for the viewer tests, written once per session under fixed names.

The viewer shows file basenames only, so snapshot SVGs never contain temp paths.
The golden vectors of spec/vectors are opened by test_app too; these add what
they lack (a corrupted copy, a changed copy, different geometries):

    hybrid.hsnap          2 attention (bf16) + 2 GDN layers, 9 prompt + 4 output tokens
    hybrid-b.hsnap        same request, one temporal state and one K row changed
    hybrid-corrupt.hsnap  hybrid.hsnap with one byte of mamba.1.temporal flipped
    fp8.hsnap             attention-only, float8_e4m3fn KV stored as uint8
    tp2/                  a 2-rank snapshot directory
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from hsnap_format import AttentionGeometry, Geometry, MambaGeometry, SetWriter, open_snapshot, write_snapshot
from hsnap_format import reference as ref

CORRUPT_SECTION = "mamba.1.temporal"
CHANGED_SECTIONS = ("attn.2.k", "mamba.3.temporal")


def hybrid_geometry(dtype: str = "bfloat16") -> Geometry:
    return Geometry(
        attention=AttentionGeometry(kind="mha", layers=(0, 2), heads=2, k_head_dim=8, v_head_dim=8,
                                    dtype=dtype, storage_dtype="bfloat16"),
        mamba=MambaGeometry(layers=(1, 3), conv_shapes=((16, 3),), conv_dtype="bfloat16",
                            temporal_shape=(2, 4, 4), temporal_dtype="float32"),
        num_layers=4,
    )


def fp8_geometry() -> Geometry:
    return Geometry(
        attention=AttentionGeometry(kind="mha", layers=(0, 1), heads=1, k_head_dim=16, v_head_dim=16,
                                    dtype="float8_e4m3fn", storage_dtype="uint8"),
        num_layers=2,
    )


def _record():
    rec = ref.record(state_position=12, outputs=4, seed=1)
    rec.rid = "req-7\x1b[31m"  # a control character the viewer must escape
    rec.stop_strings = ("</s>",)
    return rec


def _write(path, geom: Geometry, *, tp_rank: int = 0, tp_size: int = 1, seed: int = 0, edit=None) -> None:
    ident = ref.identity(tp_rank=tp_rank, snapshot_id="fixture")
    ident = type(ident)(**{**ident.__dict__, "tp_size": tp_size, "model_id": "tiny/hybrid-4L"})
    rec = _record()
    state = dict(ref.state_arrays(geom, rec.state_position, seed=seed))
    if edit:
        edit(state)
    write_snapshot(path, identity=ident, geometry=geom, record=rec, state=state)


def _edit_b(state) -> None:
    k = np.array(state["attn.2.k"])
    k[5, 1, 3] = k[5, 1, 3] + 1
    state["attn.2.k"] = k
    t = np.array(state["mamba.3.temporal"])
    t[1, 2, :] *= 1.5
    state["mamba.3.temporal"] = t


def flip_byte(path, section: str, at: int = 10) -> None:
    with open_snapshot(path) as snap:
        offset = snap.section(section).offset + at
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def build_fixtures(root) -> None:
    geom = hybrid_geometry()
    _write(os.path.join(root, "hybrid.hsnap"), geom)
    _write(os.path.join(root, "hybrid-b.hsnap"), geom, edit=_edit_b)
    shutil.copyfile(os.path.join(root, "hybrid.hsnap"), os.path.join(root, "hybrid-corrupt.hsnap"))
    flip_byte(os.path.join(root, "hybrid-corrupt.hsnap"), CORRUPT_SECTION)
    _write(os.path.join(root, "fp8.hsnap"), fp8_geometry())
    w = SetWriter(os.path.join(root, "tp2"))
    for r in range(2):
        _write(w.rank_path(r), geom, tp_rank=r, tp_size=2, seed=r)
    w.commit(tp_size=2, fsync=False)
