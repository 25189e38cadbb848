"""The reference geometry: one TP rank of Qwen3.5-35B-A3B at TP 2, as SGLang holds it.

10 full-attention layers (every 4th: 3, 7, ..., 39) with 1 KV head per rank, head
dim 256, bf16 K and V; 30 Gated-DeltaNet layers with conv state [4096, 3] bf16
and temporal state [16, 128, 128] fp32 per slot. At 53 committed tokens one rank
holds 32,737,280 payload bytes (the figure of the draft SGLang PR).
"""

from __future__ import annotations

import numpy as np

from .records import AttentionGeometry, Engine, Geometry, Identity, MambaGeometry, RequestRecord
from .spec import DTYPES

NUM_LAYERS = 40
FULL_ATTENTION_LAYERS = tuple(range(3, NUM_LAYERS, 4))
GDN_LAYERS = tuple(i for i in range(NUM_LAYERS) if i not in FULL_ATTENTION_LAYERS)


def geometry(page_size: int = 1) -> Geometry:
    return Geometry(
        attention=AttentionGeometry(
            kind="mha", layers=FULL_ATTENTION_LAYERS, heads=1, k_head_dim=256, v_head_dim=256,
            dtype="bfloat16", storage_dtype="bfloat16", page_size=page_size,
        ),
        mamba=MambaGeometry(
            layers=GDN_LAYERS, conv_shapes=((4096, 3),), conv_dtype="bfloat16",
            temporal_shape=(16, 128, 128), temporal_dtype="float32", conv_slice_axis=0,
        ),
        start_layer=0,
        num_layers=NUM_LAYERS,
    )


def identity(tp_rank: int = 0, snapshot_id: str = "reference", created_at: str = "2026-01-01T00:00:00Z") -> Identity:
    return Identity(
        model_id="Qwen/Qwen3.5-35B-A3B",
        weights_version="reference",
        engine=Engine("sglang", "0.5.23", "unknown"),
        tp_size=2,
        tp_rank=tp_rank,
        device="cpu",
        snapshot_id=snapshot_id,
        created_at=created_at,
        hsnap_version="1.0.0",
    )


def record(state_position: int = 53, outputs: int = 10, seed: int = 0) -> RequestRecord:
    rng = np.random.default_rng(seed)
    prompt = state_position + 1 - outputs
    return RequestRecord(
        rid="reference",
        prompt_ids=rng.integers(0, 151_000, prompt, dtype=np.int32),
        output_ids=rng.integers(0, 151_000, outputs, dtype=np.int32),
        output_logprobs=-rng.random(outputs, dtype=np.float32),
        state_position=state_position,
        sampling={"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
        max_new_tokens=128,
        streamed_tokens=outputs,
    )


def state_arrays(geom: Geometry, state_position: int, seed: int = 0):
    """Yield (section name, array) with seeded random contents, one section at a time."""
    from .layout import state_sections

    rng = np.random.default_rng(seed)
    for spec in state_sections(geom, state_position):
        dt = DTYPES[spec.dtype]
        yield spec.name, rng.standard_normal(spec.shape, dtype=np.float32).astype(dt)
