"""How this server's model splits its state across TP ranks (:class:`hsnap_io.reshard.TPModel`), read from SGLang's own
config of the model: with it, a snapshot set written at another TP size is re-sharded as it is resumed (each rank
reads the source sections it depends on, hashed whole, and takes its own heads and channels), instead of refused.

One row per family, naming the config fields SGLang's ``mamba2_cache_params`` (or LFM2's conv shape) is built from,
so the re-sharding describes the same layout the pools were sized with; the restore checks the geometry it derives
against the pools all the same.  A family without a row: a set of another TP size is refused, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hsnap_io.reshard import GDNDims, Mamba2Dims, ShortConvDims, TPModel

__all__ = ["FAMILIES", "tp_model"]


def _gdn(c: Any) -> tuple[Any, int]:
    """Qwen3-Next / Qwen3.5 Gated DeltaNet (qwen3_next.py, qwen3_5.py)."""
    return GDNDims(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), c.linear_conv_kernel_dim


def _nemotron_h(c: Any) -> tuple[Any, int]:
    return Mamba2Dims(c.mamba_num_heads * c.mamba_head_dim, c.n_groups, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size), c.conv_kernel


def _falcon_h1(c: Any) -> tuple[Any, int]:
    return Mamba2Dims(c.mamba_intermediate, c.mamba_n_groups, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state), c.mamba_d_conv


def _granitemoehybrid(c: Any) -> tuple[Any, int]:
    return Mamba2Dims(c.mamba_intermediate_size, c.mamba_n_groups, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state), c.mamba_d_conv


def _lfm2(c: Any) -> tuple[Any, int]:
    return ShortConvDims(c.hidden_size), int(c.conv_L_cache)


# the config's model_type -> (linear-layer dims, conv kernel)
FAMILIES: dict[str, Callable[[Any], tuple[Any, int]]] = {
    "qwen3_next": _gdn, "qwen3_5": _gdn, "qwen3_5_text": _gdn, "qwen3_5_moe": _gdn, "qwen3_5_moe_text": _gdn,
    "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1, "granitemoehybrid": _granitemoehybrid, "lfm2": _lfm2,
}


def tp_model(text_config: Any) -> TPModel | None:
    """The TP description of the model whose (text) config SGLang serves, or None for a family without a row."""
    family = FAMILIES.get(getattr(text_config, "model_type", None) or "")
    if family is None:
        return None
    mamba, kernel = family(text_config)
    return TPModel(kv_heads=text_config.num_key_value_heads, mamba=mamba, conv_kernel=kernel)
