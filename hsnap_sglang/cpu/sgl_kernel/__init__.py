"""``sgl_kernel`` as SGLang's CPU platform imports it, served by hsnap (this file is loaded under the top-level name
``sgl_kernel`` by :mod:`hsnap_sglang.cpu.finder`, and only when the operator opted in and no real sgl_kernel is
installed).

SGLang 0.5.23 imports these names at module level under ``if _is_cpu:`` (an AST scan of the package for
``from sgl_kernel... import`` inside ``if ...cpu...:`` blocks outside try/except finds exactly them).
``assign_req_to_token_pool_cpu`` is real (reference math in :mod:`hsnap_sglang.cpu.ops`); the others belong to
speculative decoding and raw-pointer KV moves, which the supported path never calls: each raises
``UnsupportedKernelError`` naming itself.  Importing this module also registers the ``torch.ops.sgl_kernel.*``
operators (:mod:`hsnap_sglang.cpu.library`).  A name not listed here is absent (``from sgl_kernel import x``
raises ImportError, as with an sgl_kernel build that lacks it).
"""

from hsnap_sglang.cpu import library as _library
from hsnap_sglang.cpu import ops as _ops
from hsnap_sglang.cpu.unsupported import unsupported as _unsupported

_library.register()

__version__ = "0.0.0+hsnap.cpu"
HSNAP_CPU_PLATFORM = True


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's new KV slot ids into its req_to_token row (see hsnap_sglang.cpu.ops)."""
    _ops.assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len)


_SPECULATIVE = "speculative decoding (EAGLE / draft trees) is not supported"
UNSUPPORTED = {
    "assign_draft_cache_locs_contiguous_cpu": _SPECULATIVE,
    "assign_extend_cache_locs_cpu": _SPECULATIVE,
    "build_tree_kernel_efficient_cpu": _SPECULATIVE,
    "fill_accept_out_cache_loc_cpu": _SPECULATIVE,
    "fill_bonus_tokens_cpu": _SPECULATIVE,
    "rotate_input_ids_cpu": _SPECULATIVE,
    "verify_tree_greedy_cpu": _SPECULATIVE,
    "copy_all_layer_kv_cache_cpu": "KV moves by raw data pointer (KV-cache relocation) are not supported",
}
for _name, _why in UNSUPPORTED.items():
    globals()[_name] = _unsupported(f"sgl_kernel.{_name}", _why)
del _name, _why
