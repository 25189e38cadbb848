"""A Mamba2 snapshot (SGLang's ``Mamba2StateShape``: conv over ``x | B | C`` = heads * head_dim + 2 * n_groups *
state channels, kernel - 1 wide; temporal ``(heads, head_dim, state)``) restored into Mamba2 pools of another
geometry — another n_groups, another SSM state size, another conv kernel — is refused with a typed
``IncompatibleSnapshotError`` naming the differing geometry field, before anything is allocated: the target pools'
free lists and every buffer byte unchanged.  The same snapshot restores into pools of its own geometry (the control:
the refusals are about the geometry, not about the file).

The pools are SGLang's own (``HybridReqToTokenPool`` + ``HybridLinearKVPool`` on CPU, ``hsnap_testing.pools``), the
slot shapes SGLang's own state-shape class at TP 1 (``hsnap_io.reshard.state_shape``, as tests/test_families.py checks
against SGLang's model configs) — the tiny NemotronH / FalconH1 geometry of ``hsnap_sglang.tiny``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from io_cases import export_from, identity  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_io import reshard, restore_request  # noqa: E402
from hsnap_io.sglang_env import import_sglang  # noqa: E402

from hsnap_testing import pools as sp  # noqa: E402

# the tiny Mamba2 geometry of hsnap_sglang.tiny: 8 SSM heads of 16 channels, 2 groups, state 32, kernel 4
HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 8, 16, 2, 32, 4
N_TOKENS = 45

# case -> (the target's Mamba2 dims and kernel, the geometry fields that must be named)
OTHER = {
    "n_groups": (dict(n_groups=1), ["geometry.mamba.conv_shapes"]),
    "state_size": (dict(state_size=16), ["geometry.mamba.conv_shapes", "geometry.mamba.temporal_shape"]),
    "conv_kernel": (dict(kernel=3), ["geometry.mamba.conv_shapes"]),
}


def _params(n_groups=GROUPS, state_size=STATE, kernel=KERNEL, heads=HEADS):
    mu = import_sglang().mamba_utils
    dims = reshard.Mamba2Dims(intermediate=heads * HEAD_DIM, n_groups=n_groups, num_heads=heads, head_dim=HEAD_DIM,
                              state_size=state_size)
    shape = reshard.state_shape(dims, 1, kernel)
    assert isinstance(shape, mu.Mamba2StateShape)
    return mu.Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=mu.Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))


def _pools(seed: int, size: int, **dims):
    ps = sp.build("hybrid_linear", size=size, seed=seed, mamba_params=_params(**dims))
    sp.occupy(ps, 2, 37, seed=seed + 5)  # other requests' slots in use
    return ps


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mamba2-refusals") / "mamba2.hsnap")
    ps = _pools(1, 512)
    req = sp.alloc_request(ps, N_TOKENS, seed=3)
    export_from(ps, req, path)
    with hf.open_snapshot(path) as snap:
        g = snap.geometry.mamba
        conv, temporal = [list(s) for s in g.conv_shapes], list(g.temporal_shape)
    return {"path": path, "conv": conv, "temporal": temporal}


def _restore(path, ps):
    return restore_request(path, req_to_token_pool=ps.req_to_token_pool,
                           token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=identity())


def test_snapshot_carries_the_mamba2_slot_shapes(snapshot):
    # conv: x | B | C channels, kernel - 1 wide; temporal: (heads, head_dim, state)
    assert snapshot["conv"] == [[HEADS * HEAD_DIM + 2 * GROUPS * STATE, KERNEL - 1]]
    assert snapshot["temporal"] == [HEADS, HEAD_DIM, STATE]


def test_same_geometry_restores(snapshot):
    ps = _pools(9, 1024)
    restored = _restore(snapshot["path"], ps)
    assert restored.req_pool_idx is not None


@pytest.mark.parametrize("case", sorted(OTHER))
def test_other_mamba2_geometry_is_refused_by_field_before_allocating(snapshot, case):
    dims, fields = OTHER[case]
    ps = _pools(9, 1024, **dims)
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(hf.IncompatibleSnapshotError) as info:
        _restore(snapshot["path"], ps)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # nothing allocated, no byte written
    err = info.value
    assert isinstance(err, hf.HsnapError)
    # (field, what the target expects, what the snapshot has), every differing field and no other
    target = _params(**dims).shape
    expected = {"geometry.mamba.conv_shapes": ([list(s) for s in target.conv], snapshot["conv"]),
                "geometry.mamba.temporal_shape": (list(target.temporal), snapshot["temporal"])}
    assert err.differences == [(f, *expected[f]) for f in fields]
    assert all(f in str(err) for f in fields) and snapshot["path"] in str(err)
