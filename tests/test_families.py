"""Every hybrid family SGLang 0.5.23 keeps in a MambaPool slot, at the library level: Mamba2
(n_groups 1 < tp, and n_groups 2), Mamba-1 (full-rank state), Kimi-Linear KDA (conv slot stored transposed, sharded
along axis 1), LFM2's short conv (no SSM state: a zero-element temporal) and lightning
attention (no conv: a zero-element conv slot).

The slot shapes come from SGLang's own state-shape classes — checked here against SGLang's
own model configs (``mamba2_cache_params``) — the pools are SGLang's own (``HybridReqToTokenPool``
+ ``HybridLinearKVPool`` on CPU, ``hsnap_testing.tp_pools``), and the conv channel each
rank holds comes out of the family's own weight loader. Each family: export, restore into
fresh pools at the same TP size and re-shard between TP sizes, byte for byte, with the
plan proven to cover every target element exactly once from a source element of the same
global index, and no byte written outside the request's slots."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hsnap_format as hf
from hsnap_format.records import Sharding
from hsnap_io import reshard, restore_request
from hsnap_io.adapters import view_pools
from hsnap_io.sglang_env import import_sglang

from hsnap_testing import tp_pools as rp

FAMILIES = {"mamba2": rp.MODELS["mamba2"], **rp.FAMILIES}  # mamba2: n_groups 1 < tp, beside MQA
TPS = {name: (1, 2) if name == "mamba2-g2" else (1, 2, 4) for name in FAMILIES}  # n_groups 2: no TP 4 split
# the same size (the plain restore), 2 -> 1, 1 -> 2, and 4 -> 2, 2 -> 4 where the family splits 4 ways
PAIRS = [(name, src, dst) for name in FAMILIES for src, dst in ((1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4))
         if {src, dst} <= set(TPS[name])]
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def states():
    return {name: rp.global_state(m) for name, m in FAMILIES.items()}


@pytest.fixture(scope="module")
def sets(tmp_path_factory, states):
    root = tmp_path_factory.mktemp("families")
    out: dict = {}

    def get(name, tp):
        if (name, tp) not in out:
            out[name, tp] = rp.export_set(FAMILIES[name], tp, states[name], root / f"{name}-tp{tp}")
        return out[name, tp]

    return get


# ----------------------------------------------------------------------------- SGLang's own shapes


def _config_params(name: str, tp: int, monkeypatch):
    """``mamba2_cache_params`` of the SGLang model config of the family, as rank 0 of ``tp``
    builds it (its ``get_parallel()`` answering ``tp``)."""
    import_sglang()
    parallel = SimpleNamespace(tp_size=tp, attn_tp_size=tp, tp_rank=0, attn_tp_rank=0)
    m = FAMILIES[name].tp
    d = m.mamba
    if name.startswith("mamba2"):
        mod = importlib.import_module("sglang.srt.configs.mamba2")
        monkeypatch.setattr(importlib.import_module("sglang.srt.runtime_context"), "get_parallel", lambda: parallel)
        # intermediate_size as a checkpoint's config.json gives it: SGLang reads it, this
        # transformers' Mamba2Config does not derive it from expand * hidden_size
        cfg = mod.Mamba2Config(hidden_size=d.intermediate // 2, expand=2, intermediate_size=d.intermediate, n_groups=d.n_groups,
                               num_heads=d.num_heads, head_dim=d.head_dim, state_size=d.state_size, conv_kernel=m.conv_kernel,
                               num_hidden_layers=3)
    elif name == "mamba1":
        mod = importlib.import_module("sglang.srt.configs.mamba")
        monkeypatch.setattr(importlib.import_module("sglang.srt.runtime_context"), "get_parallel", lambda: parallel)
        cfg = mod.MambaConfig(hidden_size=d.intermediate // 2, expand=2, state_size=d.state_size, conv_kernel=m.conv_kernel,
                              num_hidden_layers=3)
    elif name == "kda":
        mod = importlib.import_module("sglang.srt.configs.kimi_linear")
        cfg = mod.KimiLinearConfig(hidden_size=8, num_hidden_layers=3, num_attention_heads=2, linear_attn_config={
            "num_heads": d.num_heads, "head_dim": d.head_dim, "short_conv_kernel_size": m.conv_kernel, "kda_layers": [1, 3],
            "full_attn_layers": [2]})
    elif name == "lfm2":
        mod = importlib.import_module("sglang.srt.configs.lfm2")
        cfg = mod.Lfm2Config(hidden_size=d.hidden, conv_L_cache=m.conv_kernel, num_hidden_layers=3, num_attention_heads=2,
                             num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"])
    else:  # lightning: Bailing hybrid's seg_la layers (num_linear_key_value_heads = num_attention_heads)
        mod = importlib.import_module("sglang.srt.configs.bailing_hybrid")
        cfg = mod.BailingHybridConfig(hidden_size=8, num_hidden_layers=4, num_attention_heads=d.num_heads, head_dim=d.head_dim,
                                      layer_group_size=2)
    if hasattr(mod, "get_parallel"):
        monkeypatch.setattr(mod, "get_parallel", lambda: parallel)
    return cfg.mamba2_cache_params


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_slot_shapes_are_sglangs_model_configs(name, tp, monkeypatch):
    """The family's dims give, through SGLang's own state-shape class, the slot SGLang's own
    model config asks for at that TP size (conv, temporal, the conv axis TP slices, and the
    cache-params class: KimiLinearCacheParams for KDA), and the pools built with it hold it."""
    m = FAMILIES[name]
    params = _config_params(name, tp, monkeypatch)
    mine = reshard.state_shape(m.tp.mamba, tp, m.tp.conv_kernel)
    assert (type(mine), list(mine.conv), tuple(mine.temporal)) == (type(params.shape), list(params.shape.conv), tuple(params.shape.temporal))
    axis = getattr(params.shape, "conv_slice_axis", 0)
    assert reshard.conv_slice_axis(m.tp.mamba, m.tp.conv_kernel) == axis == (1 if name == "kda" else 0)
    assert type(params).__name__ == ("KimiLinearCacheParams" if name == "kda" else "Mamba2CacheParams")
    if tp not in TPS[name]:
        return
    ps = rp.build(m, tp, 0)
    g = view_pools(ps.rtp, ps.alloc).geometry.mamba
    assert (g.conv_shapes, g.temporal_shape, g.conv_slice_axis) == ((tuple(params.shape.conv[0]),), tuple(params.shape.temporal), axis)
    assert type(ps.rtp.mamba_pool).__name__ == "MambaPool"


# ----------------------------------------------------------------------------- the description


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_description_holds_every_global_element_replicas_times(name):
    """At every TP size the family splits: each rank's description has the local extents of
    SGLang's pools of that rank (the reader's own rule), and over the group every global
    element is held by exactly ``replicas`` ranks."""
    m = FAMILIES[name]
    for tp in TPS[name]:
        held: dict[str, dict[int, list[int]]] = {}
        globals_: dict[str, int] = {}
        for r in range(tp):
            ps = rp.build(m, tp, r)
            geom = view_pools(ps.rtp, ps.alloc).geometry
            desc = reshard.describe(m.tp, tp, r)
            Sharding.from_header(desc.to_header(), geom.attention, geom.mamba)  # raises on an extent that differs
            for key, ax in (("attention", desc.attention), ("temporal", desc.temporal), ("conv", (desc.conv or (None,))[0])):
                if ax is None:
                    continue
                globals_.setdefault(key, ax.global_size)
                for g, n, rep in ax.parts:
                    for x in range(g, g + n):
                        held.setdefault(key, {}).setdefault(x, []).append(rep)
        assert set(held) == ({"attention", "temporal"} if name == "lightning" else {"attention", "temporal", "conv"})
        for key, counts in held.items():
            assert sorted(counts) == list(range(globals_[key])), (name, tp, key)
            assert all(len(reps) == reps[0] for reps in counts.values()), (name, tp, key, counts)


def test_description_of_known_layouts():
    """Worked out by hand from SGLang's rules (a flat split of the packed channels fails each)."""
    kda = rp.FAMILIES["kda"].tp  # q | k | v of 8 channels each, stored (K-1, 24)
    d = reshard.describe(kda, 2, 1)
    assert d.conv[0].axis == 1 and d.conv[0].parts == ((4, 4, 1), (12, 4, 1), (20, 4, 1))
    assert d.temporal.parts == ((2, 2, 1),)
    assert reshard.describe(kda, 4, 3).conv[0].parts == ((6, 2, 1), (14, 2, 1), (22, 2, 1))
    # Mamba2 n_groups 2 at TP 2: x 4..7, and group 1 of B (10, 11) and of C (14, 15)
    assert reshard.describe(rp.FAMILIES["mamba2-g2"].tp, 2, 1).conv[0].parts == ((4, 4, 1), (10, 2, 1), (14, 2, 1))
    # Mamba2 n_groups 1 at TP 2: the one group's B (8, 9) and C (10, 11) on both ranks
    assert reshard.describe(rp.MODELS["mamba2"].tp, 2, 0).conv[0].parts == ((0, 4, 1), (8, 2, 2), (10, 2, 2))
    # Mamba-1: intermediate channels split flat, the full-rank temporal by channel
    mamba1 = reshard.describe(rp.FAMILIES["mamba1"].tp, 2, 1)
    assert mamba1.conv[0].parts == ((4, 4, 1),) and mamba1.temporal.parts == ((4, 4, 1),)
    # LFM2: hidden channels split flat; the zero-element temporal "head" on every rank
    lfm2 = reshard.describe(rp.FAMILIES["lfm2"].tp, 4, 2)
    assert lfm2.conv[0].parts == ((4, 2, 1),) and lfm2.temporal.parts == ((0, 1, 4),)
    # lightning: no conv element, so no conv AXIS (global >= 1); heads split
    light = reshard.describe(rp.FAMILIES["lightning"].tp, 4, 3)
    assert light.conv is None and light.temporal.parts == ((3, 1, 1),)
    # SGLang's own PD-transfer sub-blocks (conv_shard_groups) are the description's parts at TP 1
    shape = reshard.state_shape(rp.FAMILIES["kda"].tp.mamba, 1, 4)
    assert [n for _, n, _ in reshard.describe(kda, 1, 0).conv[0].parts] == shape.conv_shard_groups == [8, 8, 8]


def test_splits_sglang_cannot_make_are_refused_by_name():
    with pytest.raises(reshard.ReshardError, match="mamba n_groups"):
        reshard.describe(rp.FAMILIES["mamba2-g2"].tp, 4, 0)  # MambaMixer2: a multiple of tp, or 1
    for dims in (reshard.KDADims(3, 2), reshard.LightningDims(3, 2), reshard.ShortConvDims(6)):
        with pytest.raises(reshard.ReshardError, match="mamba heads"):
            reshard.describe(reshard.TPModel(mamba=dims), 4, 0)


# ----------------------------------------------------------------------------- byte level


def _covered_once(plan, target_axis, source_axes) -> None:
    """Independent of the planner's own proof: every element of the target's extent is
    written by exactly one run, from a source element of the same global index."""
    def globals_of(ax):
        return [g + i for g, n, _ in ax.parts for i in range(n)]

    want = globals_of(target_axis)
    hits = [0] * len(want)
    for run in plan.runs:
        src = globals_of(source_axes[run.src])
        for i in range(run.count):
            hits[run.dst_start + i] += 1
            assert src[run.src_start + i] == want[run.dst_start + i], (plan.name, run)
    assert hits == [1] * len(want), (plan.name, hits)
    assert plan.dst_shape[plan.axis] == len(want)


@pytest.mark.parametrize("name,src,dst", PAIRS, ids=[f"{n}-{a}to{b}" for n, a, b in PAIRS])
def test_export_restore_and_reshard_byte_for_byte(sets, states, name, src, dst):
    """TP ``src`` set into fresh pools of each TP ``dst`` rank (the same size: the plain
    restore; another: the re-sharding one): every section is the target rank's shard of the
    global state, byte for byte; nothing is written outside the request's slots; and every
    re-sharding plan covers each target element once, from the same global element."""
    m, state, path = FAMILIES[name], states[name], sets(name, src)
    for r in range(dst):
        ps = rp.build(m, dst, r)
        for b in view_pools(ps.rtp, ps.alloc).bindings:
            b.buffer.view(-1).view(torch.uint8).fill_(SENTINEL)
        target = reshard.describe(m.tp, dst, r)
        res = restore_request(path, req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(dst, r),
                              sharding=target, tp_size=dst, rank=r)
        for sec, got in rp.restored_rows(ps, res).items():
            assert rp.as_bytes(got) == rp.as_bytes(rp.shard_of(m, dst, r, sec, state[sec])), (name, src, dst, r, sec)
        assert res.state_position == rp.N_TOKENS and list(res.record.output_ids) == [7, 8, 9]
        for b in view_pools(ps.rtp, ps.alloc).bindings:
            keep = torch.ones(b.buffer.shape[0], dtype=torch.bool)
            keep[res.token_indices if b.space == "token" else torch.tensor([res.mamba_pool_idx])] = False
            assert bool((b.buffer[keep].contiguous().view(-1).view(torch.uint8) == SENTINEL).all()), (name, r, b.name)
        if src == dst:
            assert res.source_bytes_read == 0  # the plain restore: no re-sharding plan
            continue
        with hf.open_snapshot(path) as s:
            plans = reshard.build_plans(s, view_pools(ps.rtp, ps.alloc), target, path)
            for p in plans:
                kind = p.name.split(".")[0]
                key = "attention" if kind == "attn" else "temporal" if p.name.endswith(".temporal") else "conv"
                if key == "conv" and target.conv is None:  # lightning's (0, 0): nothing to place
                    assert name == "lightning" and p.runs == [] and p.nbytes == 0
                    continue
                tgt = target.conv[0] if key == "conv" else getattr(target, key)
                srcs = [s.ranks[k].geometry.sharding.conv[0] if key == "conv" else getattr(s.ranks[k].geometry.sharding, key)
                        for k in range(src)]
                _covered_once(p, tgt, srcs)
            assert res.source_bytes_read == sum(s.ranks[k].section(p.name).length for p in plans for k in p.sources)


def test_lightning_set_is_refused_by_short_conv_pools(sets):
    """Two families with a zero-element state each are not interchangeable: the geometry differs."""
    m = rp.FAMILIES["lfm2"]
    ps = rp.build(m, 2, 0)
    with pytest.raises(hf.IncompatibleSnapshotError, match="geometry"):
        restore_request(sets("lightning", 1), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc,
                        identity=rp.identity(2, 0), sharding=reshard.describe(m.tp, 2, 0), tp_size=2, rank=0)


@pytest.mark.parametrize("name,section", [("lightning", "mamba.0.conv.0"), ("lfm2", "mamba.0.temporal")])
def test_sections_of_no_element_are_read_by_the_spec_alone(sets, name, section):
    """Lightning's conv (0, 0) and LFM2's temporal (1, 8, 0) are sections of length 0: the
    reader written from the spec alone (tests/independent_reader.py) decodes the TP 2 set,
    and rebuilds LFM2's described-but-empty temporal like any other."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import independent_reader as ir

    res = ir.read_directory(sets(name, 2))
    for snap in res.ranks:
        sec = snap.section(section)
        assert sec["length"] == 0 and sec["values"].size == 0 and 0 in sec["shape"]
    if name == "lfm2":
        assert ir.reassemble_global(res, section).shape == (1, 8, 0)
        assert ir.reassemble_global(res, "mamba.0.conv.0").shape == (8, 2)
    else:
        assert all(snap.header["geometry"]["sharding"]["conv"] is None for snap in res.ranks)


# ----------------------------------------------------------------------------- the golden vectors


@pytest.mark.parametrize("vector,model", [
    ("mamba2-tp2", reshard.TPModel(kv_heads=1, mamba=reshard.Mamba2Dims(2, 1, 2, 1, 1), conv_kernel=3)),
    ("kda-tp2", reshard.TPModel(mla=True, mamba=reshard.KDADims(2, 2), conv_kernel=3)),
])
def test_vectors_carry_sglangs_description_and_shapes(vector, model):
    """spec/vectors/mamba2-tp2 and kda-tp2 hold, rank by rank, what the library derives for
    their model from SGLang's own code: the description and the conv/temporal slot shapes."""
    with hf.open_snapshot(Path(__file__).resolve().parents[1] / "spec" / "vectors" / vector) as s:
        for r in range(2):
            g = s.ranks[r].geometry
            assert g.sharding == reshard.describe(model, 2, r)
            shape = reshard.state_shape(model.mamba, 2, model.conv_kernel)
            assert (g.mamba.conv_shapes, g.mamba.temporal_shape) == ((tuple(shape.conv[0]),), tuple(shape.temporal))
            assert g.mamba.conv_slice_axis == reshard.conv_slice_axis(model.mamba, model.conv_kernel)
