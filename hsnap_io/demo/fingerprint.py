"""A fingerprint of everything observable in a set of SGLang pools, to show that a refused restore left them untouched.

:func:`pool_fingerprint` walks the pool objects (request pool, its mamba pool / state / slot allocator, the KV pool
and its inner pools, the token allocator) and records

* every tensor attribute (and every tensor inside a list attribute) as a BLAKE2b digest of dtype, shape and every
  byte: KV buffers, conv / temporal state, ``req_to_token``, ``req_index_to_mamba_index_mapping``, free-page and
  free-slot tensors;
* every list of plain values (``free_slots`` of the request rows) and every scalar attribute, verbatim.

Two fingerprints are equal iff (up to BLAKE2b) nothing observable changed, free-list order included.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

_SCALARS = (int, float, bool, str, type(None))
_MAX_DEPTH = 4


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    h.update(b.numpy().tobytes())
    return h.hexdigest()


def _is_pool_object(v: Any) -> bool:
    return type(v).__module__.startswith("sglang.")


def _walk(obj: Any, prefix: str, out: dict[str, Any], seen: set[int], depth: int) -> None:
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    for name, v in sorted(vars(obj).items()):
        key = f"{prefix}.{name}"
        if isinstance(v, torch.Tensor):
            out[key] = tensor_digest(v)
        elif isinstance(v, (list, tuple)):
            if all(isinstance(x, torch.Tensor) for x in v) and v:
                for i, x in enumerate(v):
                    out[f"{key}[{i}]"] = tensor_digest(x)
            elif all(isinstance(x, _SCALARS) for x in v):
                out[key] = list(v)
        elif isinstance(v, dict):
            if all(isinstance(x, _SCALARS) for x in v.values()):
                out[key] = {str(k): x for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
        elif isinstance(v, _SCALARS):
            out[key] = v
        elif isinstance(v, torch.dtype):
            out[key] = str(v)
        elif _is_pool_object(v):
            _walk(v, key, out, seen, depth + 1)


def pool_fingerprint(req_to_token_pool, token_to_kv_pool_allocator) -> dict[str, Any]:
    """Flat ``{attribute path: digest or value}`` of the pools reachable from the request pool and the allocator."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    _walk(req_to_token_pool, "req_to_token_pool", out, seen, 0)
    _walk(token_to_kv_pool_allocator, "allocator", out, seen, 0)
    return out


def fingerprint_digest(fp: dict[str, Any]) -> str:
    """One short digest of a whole fingerprint (to print)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(sorted(fp.items())).encode())
    return h.hexdigest()


def fingerprint_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Attribute paths whose value or digest differs (or exists on one side only)."""
    return [k for k in sorted(set(a) | set(b)) if a.get(k, ...) != b.get(k, ...)]
