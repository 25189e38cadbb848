"""Pages stored once, from SGLang's pools (spec 5.10, 8.2; :mod:`hsnap_format.pages`).

The glue between a :class:`~hsnap_format.pages.PageStore` and the pools: the page keys
come from SGLang's own ``get_hash_str`` (``sglang.srt.mem_cache.utils``, HiCache's page
hash chain) when SGLang is importable — :func:`hsnap_format.pages.chain_keys` is the same
algorithm in pure Python, and a test holds the two equal — and each page's rows are read
from the pools with the export engine.

    from hsnap_format.pages import PageStore
    with PageStore("run/pages") as pages:          # one session: each shared page put once
        for req in requests:
            export_request(f"run/{req.rid}.hsnap", ..., pages=pages)
"""

from __future__ import annotations

import numpy as np

from hsnap_format.pages import PageStore, chain_keys

_NATIVE_FAILED = False


def sglang_keys(tokens, page_size: int) -> list[str]:
    """SGLang's page hash chain over the full pages of ``tokens``: ``get_hash_str(tokens,
    None, page_size)``, SGLang's own function when it imports and runs (its native
    extension); else the same algorithm here (:func:`hsnap_format.pages.chain_keys`)."""
    global _NATIVE_FAILED
    n = len(tokens) // page_size * page_size
    if not _NATIVE_FAILED:
        try:
            from sglang.srt.mem_cache.utils import get_hash_str

            return list(get_hash_str([int(t) for t in np.asarray(tokens[:n])], None, page_size=page_size)) if n else []
        except ImportError:
            _NATIVE_FAILED = True
        except RuntimeError:  # its native extension did not build here: the same chain, in Python
            _NATIVE_FAILED = True
    return chain_keys(tokens[:n], page_size)


def page_store(directory, **kw) -> PageStore:
    """A :class:`PageStore` whose keys are SGLang's own (:func:`sglang_keys`)."""
    kw.setdefault("keys", sglang_keys)
    return PageStore(directory, **kw)


def page_rows(view, token_slots, engine):
    """``rows(name, start, stop)`` for :meth:`~hsnap_format.pages.PageStore.put_pages`: the
    bytes of section ``name``'s rows of positions ``start .. stop - 1``, read from the pools."""
    by_name = {b.name: b for b in view.bindings}

    def rows(name: str, start: int, stop: int) -> bytes:
        out = bytearray()

        def sink(data, first: bool, last: bool) -> None:
            out.extend(memoryview(data).cast("B"))

        engine.export_section(by_name[name].buffer, token_slots[start:stop], sink, by_name[name].host_rows)
        engine.finish_export()
        return bytes(out)

    return rows


__all__ = ["sglang_keys", "page_store", "page_rows"]
