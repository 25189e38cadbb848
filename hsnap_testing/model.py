"""A tiny random-weight hybrid LLM, an explicit decode loop, and cache <-> SGLang pool layout conversion.

* :func:`build_model` builds a tiny Qwen3.5 (``qwen3_5_text``, dense GDN hybrid) or Qwen3-Next model with random
  weights (nothing is downloaded) and returns it with its :class:`ModelGeometry`.
* :class:`Decoder` runs prefill / single-token steps / greedy or sampled generation with full control over what
  passes through ``forward`` (a hook on ``embed_tokens`` counts every position).
* :func:`cache_to_pool_tensors` / :func:`pool_tensors_to_cache` convert between the transformers 5.x cache
  (``DynamicCache`` with ``DynamicLayer`` / ``LinearAttentionLayer``) and SGLang's pool layouts, as plain per-layer
  tensors.
* :func:`build_pools`, :func:`write_to_pools`, :func:`read_from_pools` put those tensors into / take them out of real
  SGLang pools (:mod:`hsnap_testing.pools`, kind ``hybrid_linear``: ``HybridReqToTokenPool`` + ``HybridLinearKVPool``
  + token allocator).
* :class:`TinyModel` is the model as one serving process holds it (decoder, identity, pools with other requests);
  :func:`rank_geometry` / :func:`shard_tensors` give what each TP rank of it holds.

Layout facts (transformers 5.19 <-> SGLang 0.5.23), for one request (batch 1):

============  =====================================  ==============================  ===============================
state         transformers                           SGLang pool                     mapping
============  =====================================  ==============================  ===============================
attention K   ``layers[L].keys`` [1, H_kv, S, D]      ``get_key_buffer(L)[slots]``    ``keys[0].permute(1, 0, 2)``
              (after k_norm and RoPE)                 [S, H_kv, D]
attention V   ``layers[L].values`` [1, H_kv, S, D]    ``get_value_buffer(L)[slots]``  ``values[0].permute(1, 0, 2)``
GDN conv      ``conv_states[0]`` [1, conv_dim, K]     ``conv[0][m, slot]``            columns ``1..K-1`` (oldest
                                                      [conv_dim, K-1]                 first); column 0 never
                                                                                      influences the next output
GDN temporal  ``recurrent_states[0]``                 ``temporal[m, slot]``           ``.transpose(-1, -2)``
              [1, H_v, Dk, Dv]                        [H_v, Dv, Dk]
============  =====================================  ==============================  ===============================

``m`` is ``req_to_token_pool.mamba_map[L]`` (= position of ``L`` in the pool's ``mamba_layer_ids``); attention
buffers are addressed by the *global* layer id (``HybridLinearKVPool`` maps it to its dense index).  Conv channel
order is the same on both sides: q over all key heads, k over all key heads, v over all value heads.

Per-layer tensor dict used by the conversion helpers (layer ids are global model layer ids)::

    {"k": {L: [S, H_kv, D]}, "v": {L: [S, H_kv, D]},       # full-attention layers
     "conv": {L: [conv_dim, K-1]}, "temporal": {L: [H_v, Dv, Dk]}}   # GDN layers

Bit-exactness needs pool dtypes equal to the model's state dtypes (SGLang's default conv dtype is bf16; here the
pools are built with the model's, :func:`pool_geometry`) and the same torch thread count in the reference and the resumed run.
"""

from __future__ import annotations

import dataclasses
import math
import platform
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from hsnap_sglang.tiny import tiny_config

__all__ = [
    "TinyModel",
    "Decoder",
    "Generation",
    "ModelGeometry",
    "build_model",
    "build_pools",
    "cache_to_pool_tensors",
    "generator_from_state",
    "generator_state_bytes",
    "geometry_from_config",
    "numerics_environment",
    "pool_geometry",
    "pool_tensors_to_cache",
    "rank_geometry",
    "read_from_pools",
    "request_slots",
    "shard_tensors",
    "tp_model",
    "weights_digest",
    "write_to_pools",
]

# --------------------------------------------------------------------------------------------------------------------
# model + geometry
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelGeometry:
    """What the pools need to know about a hybrid model.  Shapes are per request (no batch / slot axis)."""

    arch: str
    model_type: str
    num_layers: int
    layer_types: tuple[str, ...]
    full_attention_layer_ids: tuple[int, ...]
    linear_layer_ids: tuple[int, ...]  # GDN layers (SGLang: mamba_layer_ids)
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    conv_kernel: int  # K
    conv_dim: int  # 2 * Hk * Dk + Hv * Dv
    conv_shard_groups: tuple[int, int, int]  # [key_dim, key_dim, value_dim]: q | k | v channel blocks
    kv_shape: tuple[int, int]  # SGLang per-token row: [kv_heads, head_dim]
    conv_shape: tuple[int, int]  # SGLang: [conv_dim, K-1]
    temporal_shape: tuple[int, int, int]  # SGLang: [H_v, Dv, Dk]
    vocab_size: int
    kv_dtype: torch.dtype
    conv_dtype: torch.dtype
    temporal_dtype: torch.dtype
    config: Any = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly description (dtypes as strings like ``"float32"``; the config is left out)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "config":
                continue
            v = getattr(self, f.name)
            if isinstance(v, torch.dtype):
                v = str(v).removeprefix("torch.")
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out


def geometry_from_config(config, dtype: torch.dtype = torch.float32, *, arch: str | None = None) -> ModelGeometry:
    """Derive the :class:`ModelGeometry` of a Qwen3.5 / Qwen3-Next style hybrid config (state dtypes = ``dtype``)."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = tuple(c.layer_types)
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    lin = tuple(i for i, t in enumerate(layer_types) if t == "linear_attention")
    if len(full) + len(lin) != len(layer_types):
        raise ValueError(f"unsupported layer types {sorted(set(layer_types))}")
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    k = c.linear_conv_kernel_dim
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    if arch is None:
        arch = {"qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next"}.get(c.model_type, c.model_type)
    return ModelGeometry(
        arch=arch,
        model_type=c.model_type,
        num_layers=len(layer_types),
        layer_types=layer_types,
        full_attention_layer_ids=full,
        linear_layer_ids=lin,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        conv_kernel=k,
        conv_dim=conv_dim,
        conv_shard_groups=(key_dim, key_dim, value_dim),
        kv_shape=(c.num_key_value_heads, c.head_dim),
        conv_shape=(conv_dim, k - 1),
        temporal_shape=(hv, dv, dk),
        vocab_size=c.vocab_size,
        kv_dtype=dtype,
        conv_dtype=dtype,
        temporal_dtype=dtype,
        config=c,
    )


def build_model(
    seed: int = 0,
    arch: str = "qwen3_5",
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    **config_overrides: Any,
):
    """Build the tiny random-weight model: returns ``(model, geometry)``.

    The weights depend only on ``seed`` (the global torch RNG is forked, so the caller's RNG state is untouched).
    The model is in eval mode, in ``dtype`` (float32 by default); nothing is downloaded.
    """
    cfg = tiny_config(arch, attn_implementation=attn_implementation, **config_overrides)
    if arch == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM as model_cls
    else:
        from transformers.models.qwen3_next import Qwen3NextForCausalLM as model_cls
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model, geometry_from_config(model.config, dtype, arch=arch)


def weights_digest(model) -> str:
    """SHA-256 over the model's ``state_dict`` (names, dtypes, shapes and every byte), in name order.

    Two processes that built the same weights get the same digest; any other weights (another seed, another
    config, one changed element) get another one.
    """
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def numerics_environment() -> dict[str, Any]:
    """What decides bit-exactness of a continuation (record it next to a snapshot)."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "num_threads": torch.get_num_threads(),
        "device": "cpu",
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------------------------------------------------


def generator_state_bytes(generator: torch.Generator) -> bytes:
    """Export a CPU ``torch.Generator``'s state (a uint8 tensor) as bytes."""
    return bytes(generator.get_state().numpy().tobytes())


def generator_from_state(state: bytes, device: str = "cpu") -> torch.Generator:
    """A fresh generator restored from :func:`generator_state_bytes` output."""
    g = torch.Generator(device=device)
    g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return g


@dataclass
class Generation:
    """Result of :meth:`Decoder.generate`.

    ``token_ids`` / ``logprobs`` cover all outputs, including ``start_outputs`` (their logprobs come from
    ``start_logprobs``; NaN where those were not given).  ``new_*`` cover the tokens selected in this call.
    ``positions`` / ``forward_calls`` count what passed through ``forward`` during this call.
    """

    token_ids: list[int]
    logprobs: list[float]
    new_token_ids: list[int]
    new_logprobs: list[float]
    cache: Any
    positions: int
    forward_calls: int
    generator_state: bytes | None  # state after the last draw (None for greedy)

    @property
    def seq_len(self) -> int:
        """Positions held by the cache (prompt + outputs[:-1]: the last output is pending, not yet fed)."""
        return self.cache.get_seq_length()


class Decoder:
    """Explicit decode loop around a causal LM.

    Semantics match a running SGLang request: after ``n`` outputs, the cache holds ``prompt + outputs[:-1]``; the
    last output is *pending* (not yet fed).  Resuming feeds it first, so every step consumes exactly one new
    position and nothing is recomputed.
    """

    def __init__(self, model, geom: ModelGeometry | None = None):
        self.model = model
        self.geom = geom if geom is not None else geometry_from_config(model.config, next(model.parameters()).dtype)
        self.positions_forwarded = 0
        self.forward_calls = 0
        # (first position, count) of every model forward, as the cache saw it: which positions were computed
        self.fed_ranges: list[tuple[int, int]] = []
        self._hook = model.get_input_embeddings().register_forward_hook(self._count)
        self._pre_hook = model.register_forward_pre_hook(self._log_positions, with_kwargs=True)

    def _count(self, module, args, output) -> None:
        ids = args[0]
        self.positions_forwarded += int(ids.numel())
        self.forward_calls += 1

    def _log_positions(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = 0 if ids is None else int(ids.shape[-1])
        pos = kwargs.get("position_ids")
        if pos is not None:
            start = int(pos.reshape(-1)[0])
        else:
            cache = kwargs.get("past_key_values")
            start = 0 if cache is None else int(cache.get_seq_length())
        self.fed_ranges.append((start, n))

    def positions_below(self, limit: int) -> int:
        """How many positions ``< limit`` went through forward (the history a resume must not recompute)."""
        return sum(max(0, min(start + n, limit) - start) for start, n in self.fed_ranges)

    def close(self) -> None:
        """Remove the counting hooks."""
        self._hook.remove()
        self._pre_hook.remove()

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def prefill(self, prompt_ids: Sequence[int]):
        """Run the whole prompt through a fresh cache: ``(cache, float32 logits of the last position)``."""
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        cache = self.new_cache()
        return cache, self._forward(ids, cache)

    def step(self, cache, token_id: int) -> torch.Tensor:
        """Feed one token at position ``cache.get_seq_length()``: float32 logits for the next one."""
        ids = torch.tensor([[int(token_id)]], dtype=torch.long)
        return self._forward(ids, cache)

    @staticmethod
    def select(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, float]:
        """Pick a token: argmax when ``temperature == 0`` else a multinomial draw from ``softmax(logits / T)``.

        Returns ``(token_id, logprob)``; the logprob is the float32 ``log_softmax`` of the raw logits at the token.
        """
        logits = logits.float()
        if temperature == 0.0:
            tok = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=generator)[0])
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])

    def generate(
        self,
        prompt_ids: Sequence[int] | None,
        n: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        generator_state: bytes | None = None,
        cache=None,
        start_outputs: Sequence[int] = (),
        start_logprobs: Sequence[float] | None = None,
    ) -> Generation:
        """Generate until there are ``n`` outputs in total.

        Fresh run: ``cache=None``; the prompt is prefilled.  Resume: pass ``cache`` (holding
        ``prompt + start_outputs[:-1]``) and the outputs so far; ``prompt_ids`` may be None, otherwise the cache
        length is checked against it.  Sampling (``temperature > 0``) draws from a CPU ``torch.Generator`` seeded
        with ``seed`` or restored from ``generator_state`` (bytes from a previous :class:`Generation`).
        """
        start_outputs = [int(t) for t in start_outputs]
        if start_logprobs is not None and len(start_logprobs) != len(start_outputs):
            raise ValueError("start_logprobs must match start_outputs")
        if temperature < 0.0 or not math.isfinite(temperature):
            raise ValueError(f"bad temperature {temperature}")
        gen: torch.Generator | None = None
        if temperature > 0.0:
            if generator_state is not None:
                gen = generator_from_state(generator_state)
            elif seed is not None:
                gen = torch.Generator().manual_seed(int(seed))
            else:
                raise ValueError("sampling needs seed= or generator_state=")
        pos0, calls0 = self.positions_forwarded, self.forward_calls
        outputs = list(start_outputs)
        logprobs = list(start_logprobs) if start_logprobs is not None else [float("nan")] * len(outputs)
        new_ids: list[int] = []
        new_lps: list[float] = []

        if cache is None:
            if start_outputs:
                raise ValueError("start_outputs without a cache")
            if prompt_ids is None:
                raise ValueError("a fresh run needs prompt_ids")
            if n <= 0:
                raise ValueError("n must be positive")
            cache, logits = self.prefill(prompt_ids)
        else:
            if not start_outputs:
                raise ValueError("resuming needs start_outputs (the last one is fed first)")
            if prompt_ids is not None:
                want = len(prompt_ids) + len(outputs) - 1
                if cache.get_seq_length() != want:
                    raise ValueError(f"cache holds {cache.get_seq_length()} positions, expected {want}")
            logits = None

        while len(outputs) < n:
            if logits is None:
                logits = self.step(cache, outputs[-1])
            tok, lp = self.select(logits, temperature, gen)
            logits = None
            outputs.append(tok)
            logprobs.append(lp)
            new_ids.append(tok)
            new_lps.append(lp)

        return Generation(
            token_ids=outputs,
            logprobs=logprobs,
            new_token_ids=new_ids,
            new_logprobs=new_lps,
            cache=cache,
            positions=self.positions_forwarded - pos0,
            forward_calls=self.forward_calls - calls0,
            generator_state=generator_state_bytes(gen) if gen is not None else None,
        )


# --------------------------------------------------------------------------------------------------------------------
# transformers cache <-> SGLang pool layouts
# --------------------------------------------------------------------------------------------------------------------


def cache_to_pool_tensors(cache, geom: ModelGeometry) -> dict[str, dict[int, torch.Tensor]]:
    """Copy one request's (batch 1) state out of a transformers cache, in SGLang pool layouts.

    Returns ``{"k": {L: [S, H_kv, D]}, "v": {...}, "conv": {L: [conv_dim, K-1]}, "temporal": {L: [H_v, Dv, Dk]}}``
    (contiguous copies, global layer ids).
    """
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    if len(cache.layers) != geom.num_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, geometry {geom.num_layers}")
    out: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "conv": {}, "temporal": {}}
    for lid in geom.full_attention_layer_ids:
        layer = cache.layers[lid]
        if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
            raise ValueError(f"layer {lid}: expected an initialized DynamicLayer, got {layer!r}")
        for name, t in (("k", layer.keys), ("v", layer.values)):
            if t.dim() != 4 or t.shape[0] != 1 or tuple(t.shape[1:2]) + tuple(t.shape[3:]) != geom.kv_shape:
                raise ValueError(f"layer {lid} {name}: unexpected shape {tuple(t.shape)}")
            out[name][lid] = t[0].permute(1, 0, 2).contiguous().clone()
    k = geom.conv_kernel
    for lid in geom.linear_layer_ids:
        layer = cache.layers[lid]
        if not isinstance(layer, LinearAttentionLayer) or not layer.is_conv_states_initialized[0]:
            raise ValueError(f"layer {lid}: expected an initialized LinearAttentionLayer, got {layer!r}")
        if not layer.has_previous_state[0]:
            raise ValueError(f"layer {lid}: has_previous_state is False (no prefill happened)")
        if layer.record_past:
            raise ValueError(f"layer {lid}: record_past caches are not supported")
        conv = layer.conv_states[0]
        rec = layer.recurrent_states[0]
        if tuple(conv.shape) != (1, geom.conv_dim, k):
            raise ValueError(f"layer {lid} conv: unexpected shape {tuple(conv.shape)}")
        hv, dv, dk = geom.temporal_shape
        if tuple(rec.shape) != (1, hv, dk, dv):
            raise ValueError(f"layer {lid} recurrent: unexpected shape {tuple(rec.shape)}")
        out["conv"][lid] = conv[0, :, 1:].contiguous().clone()  # drop column 0 (never read again)
        out["temporal"][lid] = rec[0].transpose(-1, -2).contiguous().clone()
    return out


def _empty_cache(geom: ModelGeometry):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    if geom.config is not None:
        return DynamicCache(config=geom.config)
    cache = DynamicCache()
    cache.layers = [DynamicLayer() if t == "full_attention" else LinearAttentionLayer() for t in geom.layer_types]
    cache.layer_class_to_replicate = None
    return cache


def pool_tensors_to_cache(tensors: Mapping[str, Mapping[int, torch.Tensor]], geom: ModelGeometry, seq_len: int):
    """Inverse of :func:`cache_to_pool_tensors`: a fresh ``DynamicCache`` that continues the request.

    Conv column 0 (dropped by SGLang) is restored as zeros; it never influences an output and is shifted out by
    the next step.  ``has_previous_state`` is set so the next forward takes the cached-decode path.
    """
    expected = {
        "k": set(geom.full_attention_layer_ids),
        "v": set(geom.full_attention_layer_ids),
        "conv": set(geom.linear_layer_ids),
        "temporal": set(geom.linear_layer_ids),
    }
    for name, ids in expected.items():
        got = set(tensors.get(name, {}))
        if got != ids:
            raise ValueError(f"{name}: layers {sorted(got)} given, expected {sorted(ids)}")
    cache = _empty_cache(geom)
    for lid in geom.full_attention_layer_ids:
        k, v = tensors["k"][lid], tensors["v"][lid]
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (seq_len, *geom.kv_shape):
                raise ValueError(f"layer {lid} {name}: shape {tuple(t.shape)}, expected {(seq_len, *geom.kv_shape)}")
        cache.layers[lid].update(
            k.permute(1, 0, 2).unsqueeze(0).contiguous().clone(),
            v.permute(1, 0, 2).unsqueeze(0).contiguous().clone(),
        )
    for lid in geom.linear_layer_ids:
        conv, temporal = tensors["conv"][lid], tensors["temporal"][lid]
        if tuple(conv.shape) != geom.conv_shape:
            raise ValueError(f"layer {lid} conv: shape {tuple(conv.shape)}, expected {geom.conv_shape}")
        if tuple(temporal.shape) != geom.temporal_shape:
            raise ValueError(f"layer {lid} temporal: shape {tuple(temporal.shape)}, expected {geom.temporal_shape}")
        layer = cache.layers[lid]
        conv_full = conv.new_zeros((1, geom.conv_dim, geom.conv_kernel))
        conv_full[0, :, 1:] = conv
        rec = temporal.transpose(-1, -2).unsqueeze(0).contiguous()
        layer.lazy_initialization(conv_states=conv_full, conv_kernel_size=geom.conv_kernel)
        layer.lazy_initialization(recurrent_states=rec)
        layer.conv_states[0].copy_(conv_full)
        layer.recurrent_states[0].copy_(rec)
        layer.has_previous_state[0] = True
    if cache.get_seq_length() != seq_len:
        raise AssertionError(f"rebuilt cache reports {cache.get_seq_length()} positions, expected {seq_len}")
    return cache


# --------------------------------------------------------------------------------------------------------------------
# real SGLang pools
# --------------------------------------------------------------------------------------------------------------------


def pool_geometry(geom: ModelGeometry) -> dict[str, Any]:
    """The ``hybrid_linear`` pool geometry (:func:`hsnap_testing.pools.build` keywords) that holds ``geom``'s state,
    in the model's own state dtypes (SGLang's default conv dtype, bf16, would round an fp32 conv state)."""
    return dict(
        head_num=geom.num_kv_heads,
        head_dim=geom.head_dim,
        dtype=geom.kv_dtype,
        full_attention_layer_ids=list(geom.full_attention_layer_ids),
        mamba_layer_ids=list(geom.linear_layer_ids),
        gdn_k_heads=geom.linear_num_key_heads,
        gdn_v_heads=geom.linear_num_value_heads,
        gdn_k_dim=geom.linear_key_head_dim,
        gdn_v_dim=geom.linear_value_head_dim,
        gdn_conv_kernel=geom.conv_kernel,
        mamba_conv_dtype=geom.conv_dtype,
        mamba_temporal_dtype=geom.temporal_dtype,
    )


def build_pools(geom: ModelGeometry, *, size: int, mamba_size: int, page_size: int = 1, seed: int | None = None):
    """Real SGLang pools for ``geom`` (``HybridReqToTokenPool`` + ``HybridLinearKVPool`` + a token allocator):
    :func:`hsnap_testing.pools.build` of kind ``hybrid_linear``, one request row per mamba slot; zeros unless
    ``seed`` fills every state byte with noise."""
    from . import pools

    return pools.build("hybrid_linear", size=size, page_size=page_size, seed=seed, max_reqs=mamba_size,
                       mamba_size=mamba_size, **pool_geometry(geom))


def request_slots(req_to_token_pool, req_pool_idx: int, seq_len: int) -> tuple[torch.Tensor, int]:
    """``(token_indices int64 [seq_len], mamba_idx)`` of a request, read through the pool's own indirection
    (``req_to_token[row, :seq_len]`` and ``req_index_to_mamba_index_mapping[row]``)."""
    tok = req_to_token_pool.req_to_token[req_pool_idx, :seq_len].to(torch.int64).clone()
    mid = int(req_to_token_pool.req_index_to_mamba_index_mapping[req_pool_idx])
    return tok, mid


def _mamba_layer_index(req_to_token_pool, layer_id: int) -> int:
    # HybridReqToTokenPool.mamba_map = {global layer id: i for i, id in enumerate(mamba_layer_ids)}
    try:
        return req_to_token_pool.mamba_map[layer_id]
    except KeyError:
        known = sorted(req_to_token_pool.mamba_map)
        raise ValueError(f"layer {layer_id} is not a mamba layer of this pool ({known})") from None


def _slot(mamba_idx) -> int:
    if isinstance(mamba_idx, torch.Tensor):
        if mamba_idx.numel() != 1:
            raise ValueError("one mamba slot per request")
        return int(mamba_idx.reshape(-1)[0])
    return int(mamba_idx)


def _check_dtype(what: str, pool_t: torch.Tensor, t: torch.Tensor) -> None:
    if pool_t.dtype != t.dtype:
        raise TypeError(f"{what}: pool dtype {pool_t.dtype} != tensor dtype {t.dtype} (a cast would not be exact)")


def write_to_pools(
    req_to_token_pool,
    token_to_kv_pool_allocator,
    token_indices,
    mamba_idx,
    tensors: Mapping[str, Mapping[int, torch.Tensor]],
    *,
    req_pool_idx: int | None = None,
) -> None:
    """Write per-layer tensors (:func:`cache_to_pool_tensors` layout) into real pools.

    KV rows go to ``kv.get_key_buffer(L)[token_indices]`` / ``get_value_buffer(L)[...]`` (global layer id L);
    GDN state to ``mamba_cache.conv[0][m, slot]`` / ``.temporal[m, slot]`` with ``m = mamba_map[L]``.  With
    ``req_pool_idx`` the req_to_token row and the req -> mamba mapping are written too.  Dtypes must match exactly.
    """
    kv = token_to_kv_pool_allocator.get_kvcache()
    idx = torch.as_tensor(token_indices, dtype=torch.int64).reshape(-1)
    n = int(idx.numel())
    for name, get in (("k", kv.get_key_buffer), ("v", kv.get_value_buffer)):
        for lid, t in tensors.get(name, {}).items():
            buf = get(lid)
            _check_dtype(f"{name}[{lid}]", buf, t)
            if t.shape[0] != n or tuple(t.shape[1:]) != tuple(buf.shape[1:]):
                raise ValueError(f"{name}[{lid}]: shape {tuple(t.shape)} vs {n} x {tuple(buf.shape[1:])}")
            buf[idx] = t.to(buf.device)
    state = req_to_token_pool.mamba_pool.mamba_cache
    slot = _slot(mamba_idx)
    for lid, t in tensors.get("conv", {}).items():
        m = _mamba_layer_index(req_to_token_pool, lid)
        dst = state.conv[0][m, slot]
        _check_dtype(f"conv[{lid}]", dst, t)
        if dst.shape != t.shape:
            raise ValueError(f"conv[{lid}]: shape {tuple(t.shape)} vs pool {tuple(dst.shape)}")
        dst.copy_(t)
    for lid, t in tensors.get("temporal", {}).items():
        m = _mamba_layer_index(req_to_token_pool, lid)
        dst = state.temporal[m, slot]
        _check_dtype(f"temporal[{lid}]", dst, t)
        if dst.shape != t.shape:
            raise ValueError(f"temporal[{lid}]: shape {tuple(t.shape)} vs pool {tuple(dst.shape)}")
        dst.copy_(t)
    if req_pool_idx is not None:
        req_to_token_pool.write((int(req_pool_idx), slice(0, n)), idx.to(torch.int32))
        req_to_token_pool.req_index_to_mamba_index_mapping[int(req_pool_idx)] = slot


def read_from_pools(
    req_to_token_pool,
    token_to_kv_pool_allocator,
    token_indices,
    mamba_idx,
    geom: ModelGeometry | None = None,
) -> dict[str, dict[int, torch.Tensor]]:
    """Read one request's per-layer tensors (copies) out of real pools; inverse of :func:`write_to_pools`.

    Layer ids come from ``geom`` or, without it, from the pools' own maps
    (``full_attention_layer_id_mapping`` and ``mamba_map``).
    """
    kv = token_to_kv_pool_allocator.get_kvcache()
    idx = torch.as_tensor(token_indices, dtype=torch.int64).reshape(-1)
    full: Iterable[int] = geom.full_attention_layer_ids if geom else sorted(kv.full_attention_layer_id_mapping)
    lin: Iterable[int] = geom.linear_layer_ids if geom else sorted(req_to_token_pool.mamba_map)
    out: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "conv": {}, "temporal": {}}
    for lid in full:
        out["k"][lid] = kv.get_key_buffer(lid)[idx].clone()
        out["v"][lid] = kv.get_value_buffer(lid)[idx].clone()
    state = req_to_token_pool.mamba_pool.mamba_cache
    slot = _slot(mamba_idx)
    for lid in lin:
        m = _mamba_layer_index(req_to_token_pool, lid)
        out["conv"][lid] = state.conv[0][m, slot].clone()
        out["temporal"][lid] = state.temporal[m, slot].clone()
    return out


# --------------------------------------------------------------------------------------------------------------------
# one serving process of the tiny model
# --------------------------------------------------------------------------------------------------------------------


class TinyModel:
    """The tiny model as one serving process holds it: weights, decoder, identity, pools with other requests."""

    def __init__(self, arch: str = "qwen3_5", model_seed: int = 0) -> None:
        self.arch, self.model_seed = arch, model_seed
        self.model, self.geom = build_model(seed=model_seed, arch=arch)
        self.dec = Decoder(self.model, self.geom)
        self.weights = weights_digest(self.model)

    def numerics(self) -> dict[str, Any]:
        env = numerics_environment()
        env["attn_implementation"] = self.model.config._attn_implementation
        env["dtype"] = str(self.geom.kv_dtype).removeprefix("torch.")
        return env

    def identity(self, **over):
        import importlib.metadata
        import uuid
        from datetime import datetime, timezone

        import hsnap_format as hf

        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        base = dict(
            model_id=f"hsnap-tiny/{self.arch}",
            weights_version=f"sha256:{self.weights[:16]}",
            weights_hash=f"sha256:{self.weights}",
            engine=hf.Engine("sglang", version, ""),
            tp_size=1,
            tp_rank=0,
            device="cpu",
            snapshot_id=f"tiny-{uuid.uuid4().hex[:16]}",
            created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            hsnap_version=hf.__version__,
            numerics=self.numerics(),
        )
        base.update(over)
        return hf.Identity(**base)

    def pools(self, *, size: int, mamba_size: int, others: Sequence[int] = (), noise_seed: int = 0, geom=None):
        """Real SGLang pools, every state byte noise, ``others`` requests (token counts) occupying slots first."""
        from . import pools

        ps = build_pools(geom or self.geom, size=size, mamba_size=mamba_size, seed=noise_seed)
        return ps, [pools.alloc_request(ps, n, seed=noise_seed + i) for i, n in enumerate(others)]


# --------------------------------------------------------------------------------------------------------------------
# tensor-parallel ranks of the tiny model
# --------------------------------------------------------------------------------------------------------------------


def tp_model(geom: ModelGeometry):
    """The model's TP description for :mod:`hsnap_io.reshard` (KV heads, GDN dimensions, conv kernel)."""
    from hsnap_io import reshard

    return reshard.TPModel(
        kv_heads=geom.num_kv_heads,
        mamba=reshard.GDNDims(geom.linear_num_key_heads, geom.linear_num_value_heads, geom.linear_key_head_dim,
                              geom.linear_value_head_dim),
        conv_kernel=geom.conv_kernel,
    )


def rank_geometry(geom: ModelGeometry, tp: int, rank: int) -> ModelGeometry:
    """The per-rank pool geometry at ``tp``: head counts from SGLang's rules, checked against
    ``Mamba2StateShape.create(tp_world_size=tp)``."""
    from hsnap_io import reshard
    from hsnap_io.sglang_env import import_sglang

    heads, _ = reshard.kv_head_map(geom.num_kv_heads, tp, rank)
    chans, _ = reshard.conv_channel_map(tp_model(geom).mamba, tp, rank, geom.conv_kernel)
    hk, hv = geom.linear_num_key_heads // tp, geom.linear_num_value_heads // tp
    g = dataclasses.replace(
        geom, num_kv_heads=len(heads), kv_shape=(len(heads), geom.head_dim), linear_num_key_heads=hk,
        linear_num_value_heads=hv, conv_dim=len(chans), conv_shape=(len(chans), geom.conv_kernel - 1),
        conv_shard_groups=tuple(x // tp for x in geom.conv_shard_groups),
        temporal_shape=(hv, geom.linear_value_head_dim, geom.linear_key_head_dim),
    )
    shape = import_sglang().mamba_utils.Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=geom.linear_num_value_heads * geom.linear_value_head_dim,
        n_groups=geom.linear_num_key_heads, num_heads=geom.linear_num_value_heads, head_dim=geom.linear_value_head_dim,
        state_size=geom.linear_key_head_dim, conv_kernel=geom.conv_kernel,
    )
    if (tuple(shape.conv[0]), tuple(shape.temporal)) != (g.conv_shape, g.temporal_shape):
        raise AssertionError(f"rank shapes {g.conv_shape} {g.temporal_shape} differ from SGLang's {shape.conv} {shape.temporal}")
    return g


def shard_tensors(tensors, geom: ModelGeometry, tp: int, rank: int):
    """The TP 1 pool tensors of one request (:func:`cache_to_pool_tensors`), cut to what rank ``rank`` of ``tp`` holds."""
    from hsnap_io import reshard

    heads, _ = reshard.kv_head_map(geom.num_kv_heads, tp, rank)
    chans, _ = reshard.conv_channel_map(tp_model(geom).mamba, tp, rank, geom.conv_kernel)
    hv = geom.linear_num_value_heads // tp
    return {
        "k": {L: t[:, heads].contiguous() for L, t in tensors["k"].items()},
        "v": {L: t[:, heads].contiguous() for L, t in tensors["v"].items()},
        "conv": {L: t[chans].contiguous() for L, t in tensors["conv"].items()},
        "temporal": {L: t[rank * hv : (rank + 1) * hv].contiguous() for L, t in tensors["temporal"].items()},
    }
