"""The identity a running server stamps on its snapshots and demands of the snapshots it resumes.

Strict (must be equal, spec 5.3): the model (``--served-model-name``, else ``--model-path``), the weights version
(SGLang's ``--weight-version``), the weights hash, the engine (``sglang`` and its version), TP size and rank.
Advisory (``numerics``: a difference makes the restore warn that bit-exactness is not expected): torch version,
torch threads, model dtype, attention and sampling backends, ``--enable-deterministic-inference``, the device.

The weights hash is xxh3-128 over the model directory's top-level regular files (name and bytes, sorted by name:
weights, config, tokenizer), computed once per process, or ``HSNAP_WEIGHTS_HASH`` when set (an operator's value for
a large model, whose hashing would take minutes).  A model that is not a local directory hashes to ``""``.
"""

from __future__ import annotations

import functools
import os

import xxhash

from hsnap_format import Engine, Identity

__all__ = ["WEIGHTS_HASH_ENV", "weights_hash", "server_identity"]

WEIGHTS_HASH_ENV = "HSNAP_WEIGHTS_HASH"
_CHUNK = 4 << 20


@functools.lru_cache(maxsize=4)
def _hash_dir(path: str) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full) or os.path.islink(full):
            continue
        h.update(name.encode() + b"\0")
        with open(full, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def weights_hash(model_path: str) -> str:
    given = os.environ.get(WEIGHTS_HASH_ENV)
    if given:
        return given
    return _hash_dir(os.path.realpath(model_path)) if os.path.isdir(model_path) else ""


def server_identity(server_args, *, tp_size: int, tp_rank: int) -> Identity:
    """This server's identity (rank ``tp_rank`` of ``tp_size``), from its ServerArgs."""
    import sglang
    import torch

    from sglang.srt.runtime_context import get_exec, get_serving

    model_path = str(server_args.model_path)
    device = str(getattr(server_args, "device", "") or "cpu")
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.get_device_name()}"
    numerics = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(server_args.dtype),
        "attention_backend": str(server_args.attention_backend),
        "sampling_backend": str(server_args.sampling_backend),
        # SGLang honours a request's sampling_seed only with it: a seeded request resumed without it samples anew
        "deterministic_inference": bool(get_exec().deterministic.enable_deterministic_inference),
    }
    return Identity(
        model_id=str(server_args.served_model_name or model_path),
        weights_version=str(get_serving().weight_version or ""),
        weights_hash=weights_hash(model_path),
        engine=Engine("sglang", sglang.__version__, ""),
        tp_size=tp_size,
        tp_rank=tp_rank,
        device=device,
        numerics=numerics,
    )
