"""Module-level names SGLang 0.5.23 binds only for cuda / npu / xpu, given on hsnap's CPU platform right after the
module executes (by :mod:`hsnap_sglang.cpu.finder`, which wraps the module's loader; a name the module did bind is
left alone), and one it binds that cannot load a layout on CPU, wrapped (:data:`WRAP`: the Mamba2 weight loader for
one SSM group replicated across TP ranks, :func:`replicated_groups_loader`).

``sglang/srt/layers/attention/mamba/mamba.py`` (``MambaMixer2``, the Mamba2 layer of NemotronH, FalconH1 and
GraniteMoeHybrid) imports its causal conv under ``if is_cuda(): ... elif is_npu(): ... elif is_xpu(): ...``, so on
CPU ``causal_conv1d_fn`` / ``causal_conv1d_update`` and their ``_triton`` twins (the ones NemotronH and
GraniteMoeHybrid ask for, ``use_triton_causal_conv=True``) are unbound names: ``NameError`` at the first forward.
They are given here with the signatures of the functions they stand for (``layers/attention/mamba/causal_conv1d.py``
and ``kernels/ops/mamba/causal_conv1d_triton.py``), backed by the same reference conv as GDN's
(:func:`hsnap_sglang.cpu.ops.causal_conv1d_fn` / :func:`~hsnap_sglang.cpu.ops.causal_conv1d_update`: float32 tap
sums, one sequence at a time, conv state ``[dim, K - 1]`` oldest first, padded rows neither read nor written).
The two ``_triton`` twins also replace the Triton causal conv itself (:mod:`hsnap_sglang.cpu.triton_free`: LFM2's
short conv reaches it through ``causal_conv1d.py``'s non-CUDA path).

Only the standard library is imported until a listed module executes.
"""

from __future__ import annotations

__all__ = ["FILL_IN", "WRAP", "fill", "replicated_groups_loader"]

PAD_SLOT_ID = -1
MAMBA2_MIXER = "sglang.srt.layers.attention.mamba.mamba"


def causal_conv1d_fn(x, weight, bias=None, query_start_loc=None, cache_indices=None, has_initial_state=None,
                     conv_states=None, activation="silu", pad_slot_id=PAD_SLOT_ID, **kwargs):
    """Prefill conv over a packed batch, ``x`` [dim, total tokens]; conv_states updated in place."""
    return _prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                    pad_slot_id)


def causal_conv1d_fn_triton(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu, cache_indices=None,
                            has_initial_state=None, activation="silu", pad_slot_id=PAD_SLOT_ID, validate_data=False,
                            block_table=None, **kwargs):
    """The same, with the Triton function's signature."""
    if block_table is not None:
        raise NotImplementedError("causal_conv1d_fn: a paged conv state (block_table) is not supported by hsnap's CPU platform")
    return _prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                    pad_slot_id)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, pad_slot_id=PAD_SLOT_ID):
    """Decode conv, ``x`` [batch, dim] (or [batch, dim, T]); conv_state updated in place."""
    return _update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, pad_slot_id)


def causal_conv1d_update_triton(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                                conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None,
                                intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                                retrieve_parent_token=None, pad_slot_id=PAD_SLOT_ID, metadata=None,
                                validate_data=False):
    """The same, with the Triton function's signature (speculative verify is refused by the reference op)."""
    if num_accept_tokens is not None:
        raise NotImplementedError("causal_conv1d_update: num_accept_tokens (speculative decoding) is not supported by hsnap's CPU platform")
    from . import ops

    _check_pad(pad_slot_id)
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update: a circular conv state (cache_seqlens) is not supported by hsnap's CPU platform")
    return ops.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices,
                                    intermediate_conv_window, intermediate_state_indices, retrieve_next_token,
                                    retrieve_next_sibling, retrieve_parent_token)


def _check_pad(pad_slot_id):
    if pad_slot_id != PAD_SLOT_ID:
        raise NotImplementedError(f"causal conv: pad_slot_id {pad_slot_id} (hsnap's CPU ops treat every negative index as padding)")


def _prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation, pad_slot_id):
    from . import ops

    _check_pad(pad_slot_id)
    if conv_states is None:
        raise NotImplementedError("causal_conv1d_fn without conv_states is not supported by hsnap's CPU platform")
    return ops.causal_conv1d_fn(x, weight, bias, activation, conv_states, has_initial_state, cache_indices,
                                query_start_loc)


def _update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, pad_slot_id):
    from . import ops

    _check_pad(pad_slot_id)
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update: a circular conv state (cache_seqlens) is not supported by hsnap's CPU platform")
    return ops.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)


# module -> {name: value} set on it after it executes, where it left the name unbound
FILL_IN = {
    MAMBA2_MIXER: {
        "causal_conv1d_fn": causal_conv1d_fn,
        "causal_conv1d_update": causal_conv1d_update,
        "causal_conv1d_fn_triton": causal_conv1d_fn_triton,
        "causal_conv1d_update_triton": causal_conv1d_update_triton,
    },
}


def replicated_groups_loader(cpu_loader):
    """``mamba_v2_sharded_weight_loader`` for a Mamba2 layer whose one SSM group is replicated on every TP rank
    (``n_groups`` 1 < tp: GraniteMoeHybrid, Granite 4.0-H): SGLang's own loop, without the ``is_cpu()`` branch that pads
    a checkpoint tensor shorter than the sharded size as Qwen3-Next's q/k/v (a replicated group makes it shorter by
    design, and that branch indexes a second and third axis the one-dimensional conv bias does not have: IndexError
    while loading).  Every other shard spec keeps SGLang's loader, CPU branch included."""
    def make(shard_spec, tp_size: int, tp_rank: int):
        if not any(duplicate for _, _, duplicate in shard_spec):
            return cpu_loader(shard_spec, tp_size, tp_rank)

        def loader(param, loaded_weight) -> None:
            boundary, loaded_boundary = 0, 0
            for full_dim, extra, duplicate in shard_spec:
                shard_size = full_dim // tp_size
                loaded_skip = (0 if duplicate else tp_rank) * shard_size  # a replicated group: every rank reads rank 0's
                start = loaded_boundary + loaded_skip
                take = min(shard_size, full_dim - extra - loaded_skip)
                param.data[boundary : boundary + take, ...] = loaded_weight[start : start + take]
                boundary += shard_size
                loaded_boundary += full_dim - extra

        return loader

    return make


# module -> {name: wrapper}: a name the module binds, replaced by wrapper(the module's own) after it executes
WRAP = {
    MAMBA2_MIXER: {"mamba_v2_sharded_weight_loader": replicated_groups_loader},
}


def fill(module) -> list[str]:
    """Bind the names :data:`FILL_IN` lists for ``module`` that it left unbound, and wrap the names :data:`WRAP` lists
    that it bound; returns the names given or wrapped."""
    bound = []
    for name, value in FILL_IN.get(module.__name__, {}).items():
        if name not in vars(module):
            setattr(module, name, value)
            bound.append(name)
    for name, wrapper in WRAP.get(module.__name__, {}).items():
        if name in vars(module):
            setattr(module, name, wrapper(vars(module)[name]))
            bound.append(name)
    return bound
