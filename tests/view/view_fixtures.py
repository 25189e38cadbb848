"""Small snapshots for the viewer tests, written once per session under fixed names.

The viewer shows file basenames only, so snapshot SVGs never contain temp paths.
The golden vectors of spec/vectors are opened by test_app too; these add what
they lack (a corrupted copy, a changed copy, different geometries):

    hybrid.hsnap          2 attention (bf16) + 2 GDN layers, 9 prompt + 4 output tokens
    hybrid-b.hsnap        same request, one temporal state and one K row changed
    hybrid-corrupt.hsnap  hybrid.hsnap with one byte of mamba.1.temporal flipped
    zeroed.hsnap          hybrid.hsnap's request with layer 3's temporal state all zero
                          and token 7 of attn.2.v zero (what the Map tab must show)
    long.hsnap            150 prompt + 10 output tokens and the demo's 34 sampling and
                          51 engine fields: the Request tab's summary is long
    fp8.hsnap             attention-only, float8_e4m3fn KV stored as uint8
    tp2/                  a 2-rank snapshot directory

``build_big`` writes a two-rank directory of 10,006 sections (performance tests).
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from hsnap_format import AttentionGeometry, Geometry, MambaGeometry, SetWriter, open_snapshot, write_snapshot
from hsnap_format import reference as ref
from hsnap_format.spec import DTYPES

CORRUPT_SECTION = "mamba.1.temporal"
CHANGED_SECTIONS = ("attn.2.k", "mamba.3.temporal")
ZEROED_SECTION, ZEROED_ROW = "mamba.3.temporal", ("attn.2.v", 7)


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


def _edit_zeroed(state) -> None:
    state[ZEROED_SECTION] = np.zeros_like(np.array(state[ZEROED_SECTION]))
    v = np.array(state[ZEROED_ROW[0]])
    v[ZEROED_ROW[1]] = 0
    state[ZEROED_ROW[0]] = v


def flip_byte(path, section: str, at: int = 10) -> None:
    with open_snapshot(path) as snap:
        offset = snap.section(section).offset + at
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _write_long(path) -> None:
    geom = Geometry(attention=AttentionGeometry(kind="mha", layers=(0, 1), heads=1, k_head_dim=4, v_head_dim=4,
                                                dtype="bfloat16", storage_dtype="bfloat16"), num_layers=2)
    rec = ref.record(state_position=159, outputs=10, seed=2)
    rec.sampling = {f"sampling_field_{i:02d}": i for i in range(34)}
    rec.extra = {f"sglang.Req.field_{i:02d}": f"value {i}" for i in range(51)}
    ident = ref.identity(snapshot_id="fixture")
    ident = type(ident)(**{**ident.__dict__, "tp_size": 1, "model_id": "tiny/long-history"})
    write_snapshot(path, identity=ident, geometry=geom, record=rec, state=dict(ref.state_arrays(geom, rec.state_position)))


BIG_LAYERS = 2500  # per rank: 2 x (2 x 2500 + 3) = 10,006 sections


def build_big(root) -> str:
    """A snapshot directory of 10,006 tiny sections (two ranks: one rank's header caps near 6,000)."""
    geom = Geometry(attention=AttentionGeometry(kind="mha", layers=tuple(range(BIG_LAYERS)), heads=1, k_head_dim=4,
                                                v_head_dim=4, dtype="bfloat16", storage_dtype="bfloat16"), num_layers=BIG_LAYERS)
    path = os.path.join(root, "big")
    w = SetWriter(path)
    for r in range(2):
        ident = ref.identity(tp_rank=r, snapshot_id="big")
        ident = type(ident)(**{**ident.__dict__, "tp_size": 2})
        rec = ref.record(state_position=4, outputs=2, seed=1)
        state = {name: np.zeros((4, 1, 4), dtype=DTYPES["bfloat16"]) for name, _ in _big_names(geom)}
        write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    w.commit(tp_size=2, fsync=False)
    return path


def _big_names(geom):
    from hsnap_format.layout import state_sections

    return [(s.name, s.shape) for s in state_sections(geom, 4)]


def build_fixtures(root) -> None:
    geom = hybrid_geometry()
    _write(os.path.join(root, "hybrid.hsnap"), geom)
    _write(os.path.join(root, "hybrid-b.hsnap"), geom, edit=_edit_b)
    shutil.copyfile(os.path.join(root, "hybrid.hsnap"), os.path.join(root, "hybrid-corrupt.hsnap"))
    flip_byte(os.path.join(root, "hybrid-corrupt.hsnap"), CORRUPT_SECTION)
    _write(os.path.join(root, "zeroed.hsnap"), geom, edit=_edit_zeroed)
    _write_long(os.path.join(root, "long.hsnap"))
    _write(os.path.join(root, "fp8.hsnap"), fp8_geometry())
    w = SetWriter(os.path.join(root, "tp2"))
    for r in range(2):
        _write(w.rank_path(r), geom, tp_rank=r, tp_size=2, seed=r)
    w.commit(tp_size=2, fsync=False)
