"""Which sections a request snapshot has, in which order: a pure function of the
geometry and the request record, used by the writer to plan and by the reader to
check that a file's section table is exactly what its header implies."""

from __future__ import annotations

from dataclasses import dataclass

from .records import Geometry

# section kind of the request record -> (dtype, trailing shape or None for 1-D)
_RECORD_DTYPES = {
    "prompt_ids": "int32",
    "output_ids": "int32",
    "output_logprobs": "float32",
    "top_logprob_ids": "int32",
    "top_logprob_values": "float32",
    "rng_state": "uint8",
}


@dataclass(frozen=True)
class SectionSpec:
    """A planned section: everything but its offset and digest."""

    name: str
    kind: str
    layer: int | None
    dtype: str
    shape: tuple[int, ...]


_NAMES = {  # f-strings: an open builds every state section's name (str.format was 40% of it)
    "attn_k": lambda layer, c: f"attn.{layer}.k",
    "attn_v": lambda layer, c: f"attn.{layer}.v",
    "swa_k": lambda layer, c: f"swa.{layer}.k",
    "swa_v": lambda layer, c: f"swa.{layer}.v",
    "mla_kv": lambda layer, c: f"mla.{layer}.kv",
    "conv": lambda layer, c: f"mamba.{layer}.conv.{c}",
    "temporal": lambda layer, c: f"mamba.{layer}.temporal",
}


def section_name(kind: str, layer: int, component: int = 0) -> str:
    """The name of a state section (spec: Section names)."""
    return _NAMES[kind](layer, component)


def state_section_rows(geometry: Geometry, state_position: int, swa_start: int = 0) -> list[tuple]:
    """:func:`state_sections` as plain ``(name, kind, layer, dtype, shape)`` tuples: what
    the reader compares a file's table with on every open (tuples are ~10x cheaper to
    build and compare than frozen dataclasses)."""
    att, mam = geometry.attention, geometry.mamba
    per_layer: dict[int, list[tuple]] = {}

    def add(layer, kind, dtype, shape, component=0):
        per_layer.setdefault(layer, []).append((_NAMES[kind](layer, component), kind, layer, dtype, tuple(shape)))

    if att is not None:
        for L in att.layers:
            if att.kind == "mla":
                add(L, "mla_kv", att.dtype, (state_position, 1, att.k_head_dim))
            else:
                add(L, "attn_k", att.dtype, (state_position, att.heads, att.k_head_dim))
                add(L, "attn_v", att.dtype, (state_position, att.heads, att.v_head_dim))
        for L in att.swa_layers:
            rows = state_position - swa_start
            add(L, "swa_k", att.dtype, (rows, att.heads, att.k_head_dim))
            add(L, "swa_v", att.dtype, (rows, att.heads, att.v_head_dim))
    if mam is not None:
        for L in mam.layers:
            for i, shape in enumerate(mam.conv_shapes):
                add(L, "conv", mam.conv_dtype, shape, i)
            add(L, "temporal", mam.temporal_dtype, mam.temporal_shape)
    return [r for L in sorted(per_layer) for r in per_layer[L]]


def state_sections(geometry: Geometry, state_position: int, swa_start: int = 0) -> list[SectionSpec]:
    return [SectionSpec(*r) for r in state_section_rows(geometry, state_position, swa_start)]


def record_sections(prompt_tokens: int, output_tokens: int, has_logprobs: bool, top_k: int, rng_bytes: int | None) -> list[SectionSpec]:
    specs = [
        SectionSpec("request.prompt_ids", "prompt_ids", None, "int32", (prompt_tokens,)),
        SectionSpec("request.output_ids", "output_ids", None, "int32", (output_tokens,)),
    ]
    if has_logprobs:
        specs.append(SectionSpec("request.output_logprobs", "output_logprobs", None, "float32", (output_tokens,)))
    if top_k:
        specs.append(SectionSpec("request.top_logprob_ids", "top_logprob_ids", None, "int32", (output_tokens, top_k)))
        specs.append(SectionSpec("request.top_logprob_values", "top_logprob_values", None, "float32", (output_tokens, top_k)))
    if rng_bytes is not None:
        specs.append(SectionSpec("request.rng_state", "rng_state", None, "uint8", (rng_bytes,)))
    return specs
