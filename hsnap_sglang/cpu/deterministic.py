"""``--enable-deterministic-inference`` on hsnap's CPU platform: what SGLang 0.5.23 needs from a platform to run it,
supplied through SGLang's own extension points (no SGLang file is changed).

The flag is what makes SGLang honour a request's ``sampling_seed`` (``sampling/sampling_batch_info.py``: the seed
tensor exists only with it); without it a sampled request draws from the process's global torch generator
(``layers/sampler.py``), so not even an uninterrupted run repeats.  With it, a sampled token is the argmax of
``logprob + gumbel(murmur_hash32(seed, position, column))`` (``multinomial_with_seed``): a function of the request's
own seed, position and distribution only, which a resumed request has too.  Three things stand in its way on CPU:

1. ``arg_groups/overrides.py::_deterministic_attention_backend`` refuses every attention backend outside
   ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` (GPU backends only), ``torch_native`` included.  SGLang exports
   ``add_deterministic_attention_backend_choices`` for platforms to extend that list: ``torch_native`` is added.
   What the list certifies -- a request's numbers do not depend on its batch -- holds on this platform in
   bfloat16: the GDN ops compute one sequence at a time (:mod:`.ops`), the torch_native attention runs SDPA per
   request, and CPU bfloat16 GEMMs were observed to give each row the same bits alone or batched
   (hsnap_sglang/README.md, "Numerics").  Not in float32: there a one-row matmul rounds differently from a
   batched one (warned below).  ``torch_native`` is *not* added to the radix-cache list
   (``add_radix_supported_deterministic_attention_backend_choices``): a cached prefix is not recomputed, so a hit
   changes a request's prefill rounding; SGLang then turns the radix cache off, as for any backend not on it.
2. ``ModelRunner.maybe_enable_batch_invariant_mode`` calls ``batch_invariant_ops.enable_batch_invariant_mode``,
   which overrides ``aten::mm`` / ``addmm`` / ``bmm`` / ``_log_softmax`` / ``mean.dim`` / ``rms_norm`` for the
   device's dispatch key with Triton (or DeepGEMM) kernels -- on CPU that would send every matmul to Triton, which
   has no CPU driver.  It is replaced (``HookRegistry``, ``HookType.REPLACE``) by :func:`enable_batch_invariant_mode`,
   which leaves torch's CPU kernels in place: see 1. for why they suffice in bfloat16.
3. The seeded sampler calls ``torch.ops.sgl_kernel.murmur_hash32_cpu`` for CPU tensors: supplied by
   :mod:`.library` (reference math in :func:`hsnap_sglang.cpu.ops.murmur_hash32`, bit-exact with SGLang's Triton
   kernel).
"""

from __future__ import annotations

import logging

__all__ = ["ATTENTION_BACKENDS", "REPLACEMENTS", "enable_batch_invariant_mode", "register"]

logger = logging.getLogger("hsnap_sglang.cpu")

# attention backends of this platform whose results do not depend on the batch (see the module docstring, 1.)
ATTENTION_BACKENDS = ("torch_native",)

_warned = False


def enable_batch_invariant_mode(enable_bmm: bool = True) -> None:
    """hsnap's CPU platform in place of SGLang's ``enable_batch_invariant_mode`` (Triton overrides of ``aten::mm``
    and friends, which cannot run on CPU): keeps torch's CPU kernels, batch invariant in bfloat16 here (module
    docstring).  Logs once what that means for float32."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "hsnap CPU platform: --enable-deterministic-inference without SGLang's Triton batch-invariant kernels "
            "(no CPU driver); torch's CPU kernels are batch invariant in bfloat16 here, not in float32 (a one-row "
            "matmul rounds differently from a batched one): use --dtype bfloat16 for batch-independent results"
        )


# SGLang target (module.attr) -> replacement with the same signature
REPLACEMENTS = {
    # model_runner.py imports it from the package at call time: replacing the package attribute is enough
    "sglang.srt.batch_invariant_ops.enable_batch_invariant_mode": enable_batch_invariant_mode,
}

_registered = False


def register() -> None:
    """Extend SGLang's deterministic attention-backend list and register the replacement (once per process).

    Runs from ``load_plugins()``, which ``launch_server`` and ``Engine`` call before they build their ServerArgs,
    so the list is extended before the server arguments are resolved."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import (
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        add_deterministic_attention_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    add_deterministic_attention_backend_choices([b for b in ATTENTION_BACKENDS if b not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES])
    for target, replacement in REPLACEMENTS.items():
        HookRegistry.register(target, replacement, HookType.REPLACE)
    _registered = True
