"""A store around a store, for tests: faults and latency at the seam instead of patched
methods. ``FaultStore(inner, fault)`` calls ``fault(operation, path)`` before each operation
on ``inner`` — raise to make it fail, sleep to make it slow — and is ``inner`` otherwise.
Put one where the code under test finds its store (``hsnap_format.stores.LOCAL``, a
``SCHEMES`` entry)."""

from __future__ import annotations

import functools
from typing import Callable

OPERATIONS = frozenset({"exists", "read_bytes", "put_bytes", "list", "subdirs", "makedirs", "remove", "source", "open", "writer",
                        "set_writer", "sink", "collect"})


class FaultStore:
    def __init__(self, inner, fault: Callable[[str, str], None]) -> None:
        self.inner, self.fault = inner, fault

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in OPERATIONS:
            return attr

        @functools.wraps(attr)
        def operation(path, *args, **kw):
            self.fault(name, path)
            return attr(path, *args, **kw)

        return operation


__all__ = ["FaultStore", "OPERATIONS"]
