"""SGLang side of hsnap: export one request from SGLang's memory pools into a
snapshot, and restore it into fresh slots of other pools in another process.

    from hsnap_io import export_request, restore_request
    info = export_request("req.hsnap", req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                          req_pool_idx=req.req_pool_idx, record=record, identity=identity)
    # ... the file is durable: now free the source slots ...
    restored = restore_request("req.hsnap", req_to_token_pool=rtp2,
                               token_to_kv_pool_allocator=alloc2, identity=identity2)
"""

from .adapters import KV_ADAPTERS, UnsupportedPoolError, view_pools
from .export import export_request
from .restore import NumericsWarning, RestoredRequest, restore_request

__all__ = [
    "export_request",
    "restore_request",
    "RestoredRequest",
    "NumericsWarning",
    "UnsupportedPoolError",
    "view_pools",
    "KV_ADAPTERS",
]
