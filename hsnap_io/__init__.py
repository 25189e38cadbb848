"""SGLang side of hsnap: export one request from SGLang's memory pools into a
snapshot, and restore it into fresh slots of other pools in another process.

    from hsnap_io import export_request, restore_request
    info = export_request("req.hsnap", req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                          req_pool_idx=req.req_pool_idx, record=record, identity=identity)
    # ... the file is durable: now free the source slots ...
    restored = restore_request("req.hsnap", req_to_token_pool=rtp2,
                               token_to_kv_pool_allocator=alloc2, identity=identity2)

Names are imported lazily, so ``hsnap demo``'s parent process does not pay for
importing torch.
"""

import importlib

_EXPORTS = {
    "export_request": "export",
    "capture_request": "export",
    "write_captured": "export",
    "CapturedRequest": "export",
    "WrittenLink": "export",
    "restore_request": "restore",
    "RestoredRequest": "slots",
    "NumericsWarning": "checks",
    "UnsupportedPoolError": "adapters",
    "view_pools": "adapters",
    "KV_ADAPTERS": "adapters",
    "export_request_tp": "tp",
    "restore_request_tp": "tp",
    "MigrationSource": "migrate",
    "MigrationTarget": "migrate",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hsnap_io' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
