"""Which sections a request snapshot has, in which order: a pure function of the
geometry and the request record, used by the writer to plan and by the reader to
check that a file's section table is exactly what its header implies; and the namespace
a paged file's page references are keyed in (spec 5.10), checked by both."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import canonical
from .errors import MalformedHeaderError, Phrase
from .records import Geometry, Identity, PagesRef
from .spec import NAMESPACE_DOMAIN

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


# Attention kinds are append-only: a delta (spec 5.9) holds their rows after its base's
# position; recurrent state (conv, temporal) is overwritten every token: always whole.
ROW_KINDS = frozenset({"attn_k", "attn_v", "mla_kv", "swa_k", "swa_v"})
SWA_KINDS = frozenset({"swa_k", "swa_v"})


# Full attention is prefix-addressable: a snapshot that stores its pages once (spec 5.10)
# takes these kinds' rows of every full page from page objects. Sliding-window rows leave
# the window, recurrent state is overwritten every token: they stay in the snapshot.
PAGED_KINDS = frozenset({"attn_k", "attn_v", "mla_kv"})


def page_range(base_position: int, state_position: int, page_size: int) -> tuple[int, int]:
    """``(first, count)``: the full pages of ``page_size`` positions inside a file's rows
    ``base_position .. state_position - 1`` (spec 5.10): pages ``first .. first + count - 1``."""
    first = -(-base_position // page_size)
    return first, max(0, state_position // page_size - first)


def inline_runs(base_position: int, state_position: int, page_size: int) -> list[tuple[int, int]]:
    """The position runs ``[a, b)`` whose rows a paged file's ``attn_*``/``mla_kv`` sections
    hold, in order (spec 5.10): before its first page and after its last; all its rows
    when no full page fits."""
    first, count = page_range(base_position, state_position, page_size)
    if not count:
        return [(base_position, state_position)]
    a, f = first * page_size, (first + count) * page_size
    return [r for r in ((base_position, a), (f, state_position)) if r[1] > r[0]]


def first_position(kind: str, swa_start: int = 0, base_position: int = 0) -> int:
    """The position of row 0 of a section of ``kind`` (spec 5.4, 5.9): ``base_position``
    for full attention, ``max(base_position, swa_start)`` for sliding-window sections.
    (Only for kinds in :data:`ROW_KINDS`.)"""
    return max(base_position, swa_start) if kind in SWA_KINDS else base_position


def state_section_rows(geometry: Geometry, state_position: int, swa_start: int = 0, base_position: int = 0,
                       paged_rows: int = 0) -> list[tuple]:
    """:func:`state_sections` as plain ``(name, kind, layer, dtype, shape)`` tuples: what
    the reader compares a file's table with on every open (tuples are ~10x cheaper to
    build and compare than frozen dataclasses). ``base_position``: a delta's base position
    (spec 5.9; 0 for a plain snapshot): attention sections hold the rows after it.
    ``paged_rows``: the rows of full pages a paged file takes from its page store (spec
    5.10), which its ``attn_*``/``mla_kv`` sections do not hold."""
    att, mam = geometry.attention, geometry.mamba
    per_layer: dict[int, list[tuple]] = {}

    def add(layer, kind, dtype, shape, component=0):
        per_layer.setdefault(layer, []).append((_NAMES[kind](layer, component), kind, layer, dtype, tuple(shape)))

    if att is not None:
        full = state_position - base_position - paged_rows
        for L in att.layers:
            if att.kind == "mla":
                add(L, "mla_kv", att.dtype, (full, 1, att.k_head_dim))
            else:
                add(L, "attn_k", att.dtype, (full, att.heads, att.k_head_dim))
                add(L, "attn_v", att.dtype, (full, att.heads, att.v_head_dim))
        for L in att.swa_layers:
            rows = state_position - max(swa_start, base_position)
            add(L, "swa_k", att.dtype, (rows, att.heads, att.k_head_dim))
            add(L, "swa_v", att.dtype, (rows, att.heads, att.v_head_dim))
    if mam is not None:
        for L in mam.layers:
            for i, shape in enumerate(mam.conv_shapes):
                add(L, "conv", mam.conv_dtype, shape, i)
            add(L, "temporal", mam.temporal_dtype, mam.temporal_shape)
    return [r for L in sorted(per_layer) for r in per_layer[L]]


def state_sections(geometry: Geometry, state_position: int, swa_start: int = 0, base_position: int = 0,
                   paged_rows: int = 0) -> list[SectionSpec]:
    return [SectionSpec(*r) for r in state_section_rows(geometry, state_position, swa_start, base_position, paged_rows)]


def page_sections(geometry: Geometry, page_size: int) -> list[SectionSpec]:
    """The section plan of a page object (spec 5.11): for each full-attention layer in
    ascending order, its rows of one page (``attn.L.k``, ``attn.L.v``, or ``mla.L.kv``)."""
    att = geometry.attention
    assert att is not None, "pages hold full-attention rows: the callers check the geometry has some"
    out = []
    for L in sorted(att.layers):
        if att.kind == "mla":
            out.append(SectionSpec(_NAMES["mla_kv"](L, 0), "mla_kv", L, att.dtype, (page_size, 1, att.k_head_dim)))
        else:
            out.append(SectionSpec(_NAMES["attn_k"](L, 0), "attn_k", L, att.dtype, (page_size, att.heads, att.k_head_dim)))
            out.append(SectionSpec(_NAMES["attn_v"](L, 0), "attn_v", L, att.dtype, (page_size, att.heads, att.v_head_dim)))
    return out


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


# ------------------------------------------------------------------------- page namespaces (spec 5.10)


def namespace(identity: Identity, geometry: Geometry, page_size: int) -> dict:
    """The namespace of a rank's pages (spec 5.10): every binding field of ``identity``
    (5.1), the attention geometry a page holds, its sharding, and the page size — what a
    page's bytes depend on besides its tokens."""
    att = geometry.attention
    assert att is not None, "pages hold full-attention rows: the callers check the geometry has some"
    sh = geometry.sharding
    return {
        "attention": {"dtype": att.dtype, "heads": att.heads, "k_head_dim": att.k_head_dim, "kind": att.kind,
                      "kv_lora_rank": att.kv_lora_rank, "layers": sorted(att.layers), "qk_rope_head_dim": att.qk_rope_head_dim,
                      "storage_dtype": att.storage_dtype, "v_head_dim": att.v_head_dim},
        "engine": {"commit": identity.engine.commit, "name": identity.engine.name, "version": identity.engine.version},
        "model_id": identity.model_id,
        "page_size": page_size,
        "sharding": None if sh is None or sh.attention is None else sh.attention.to_header(),
        "tp_rank": identity.tp_rank,
        "tp_size": identity.tp_size,
        "weights_hash": identity.weights_hash,
        "weights_version": identity.weights_version,
    }


def namespace_id(ns: dict) -> str:
    """SHA-256 over ``NAMESPACE_DOMAIN`` and the namespace's canonical JSON (spec 4), hex."""
    return hashlib.sha256(NAMESPACE_DOMAIN + canonical.dumps(ns)).hexdigest()


def check_pages_ref(ref: PagesRef, identity: Identity, geometry: Geometry, base_position: int, state_position: int, path=None) -> PagesRef:
    """What a reader checks of a ``pages`` header at open (R-5.10-2, R-5.10-3), for a writer
    that must not write what a reader refuses (R-8-1)."""
    ref = PagesRef.from_header(ref.to_header(), path)
    att = geometry.attention
    if att is None or not att.layers:
        raise MalformedHeaderError(path, "pages", Phrase("a geometry with full-attention layers (what pages hold)"), Phrase("no full-attention layer"))
    first, count = page_range(base_position, state_position, ref.page_size)
    if ref.count != count:
        raise MalformedHeaderError(path, "pages.refs", Phrase(f"{count} references"), Phrase(f"{ref.count}"))
    nid = namespace_id(namespace(identity, geometry, ref.page_size))
    if ref.namespace_id != nid:
        raise MalformedHeaderError(path, "pages.namespace_id", nid, ref.namespace_id)
    return ref
