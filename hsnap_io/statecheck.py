"""Exact rollback for a restore that fails after it started allocating.

``PoolCheckpoint`` remembers (1) the allocators' free lists and mappings — every
tensor, list and scalar attribute of the request pool, the token allocator (and
its sub-allocators) and the mamba slot allocator — and (2) the previous bytes of
every slot row a restore is about to overwrite. ``rollback()`` puts all of it
back, so the pools are byte-identical to before, free lists included.
"""

from __future__ import annotations

import torch

from .adapters import PoolView

_SCALARS = (int, float, bool, str, type(None))


def _is_allocator(value) -> bool:
    return hasattr(value, "alloc") and hasattr(value, "free") and hasattr(value, "available_size")


class PoolCheckpoint:
    def __init__(self, view: PoolView) -> None:
        self._attrs: list[tuple[object, str, object, object]] = []
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        rtp = view.req_to_token_pool
        self._capture(rtp, skip={"req_to_token", "req_index_to_mamba_index_mapping", "mamba_pool", "mamba_allocator"})
        self._capture(view.allocator, skip={"_kvcache"}, recurse=True)
        mamba_alloc = getattr(rtp, "mamba_allocator", None)
        if view.mamba_pool is not None and mamba_alloc is not None:
            self._capture(mamba_alloc)

    def _capture(self, obj, skip=frozenset(), recurse=False, depth=0) -> None:
        for name, value in list(vars(obj).items()):
            if name in skip:
                continue
            if isinstance(value, torch.Tensor):
                self._attrs.append((obj, name, value, value.clone()))
            elif isinstance(value, list):
                self._attrs.append((obj, name, value, list(value)))
            elif isinstance(value, _SCALARS):
                self._attrs.append((obj, name, value, value))
            elif recurse and depth < 2 and _is_allocator(value):
                self._capture(value, skip={"_kvcache"}, recurse=True, depth=depth + 1)

    def remember_rows(self, buffer: torch.Tensor, rows: torch.Tensor) -> None:
        """Call before overwriting ``buffer[rows]``."""
        rows = rows.to(buffer.device)
        self._rows.append((buffer, rows, buffer.index_select(0, rows)))

    def rollback(self) -> None:
        for buffer, rows, saved in reversed(self._rows):
            buffer.index_copy_(0, rows, saved)
        for obj, name, original, saved in self._attrs:
            if isinstance(original, torch.Tensor):
                original.copy_(saved)  # in place: other holders (e.g. the KV pool's mapping) share it
                setattr(obj, name, original)
            elif isinstance(original, list):
                original[:] = saved
                setattr(obj, name, original)
            else:
                setattr(obj, name, saved)
        self._rows.clear()
        self._attrs.clear()
