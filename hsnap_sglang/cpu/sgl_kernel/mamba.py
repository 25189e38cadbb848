"""``sgl_kernel.mamba`` as SGLang's GDN backend imports it on CPU (``gdn_backend.py``, ``gdn_triton.py``,
``kda_backend.py``): the causal conv and the chunked gated delta rule, as reference math
(:mod:`hsnap_sglang.cpu.ops`), with the signatures of sgl_kernel's CPU wrappers."""

from hsnap_sglang.cpu import ops as _ops


def causal_conv1d_fn_cpu(mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu=None):
    """Prefill conv over a packed batch; conv_states updated in place (see hsnap_sglang.cpu.ops.causal_conv1d_fn)."""
    return _ops.causal_conv1d_fn(mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
                                 cache_indices, query_start_loc, seq_lens_cpu)


def causal_conv1d_update_cpu(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices,
                             intermediate_conv_window=None, intermediate_state_indices=None, retrieve_next_token=None,
                             retrieve_next_sibling=None, retrieve_parent_token=None):
    """Decode conv; conv_states updated in place (see hsnap_sglang.cpu.ops.causal_conv1d_update)."""
    return _ops.causal_conv1d_update(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices,
                                     intermediate_conv_window, intermediate_state_indices, retrieve_next_token,
                                     retrieve_next_sibling, retrieve_parent_token)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                               initial_state_indices):
    """Prefill GDN; the temporal pool updated in place (see hsnap_sglang.cpu.ops.chunk_gated_delta_rule)."""
    return _ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, head_first,
                                       use_qk_l2norm_in_kernel, initial_state_indices)
