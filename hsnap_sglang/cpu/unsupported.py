"""Stand-ins for ``sgl_kernel`` names that SGLang imports on its CPU platform but never calls on the path hsnap's
CPU platform supports (speculative decoding, KV moves by raw pointer).  Calling one raises
:class:`UnsupportedKernelError` naming it, instead of computing anything."""

from __future__ import annotations

__all__ = ["UnsupportedKernelError", "unsupported"]


class UnsupportedKernelError(NotImplementedError):
    """An sgl_kernel name that hsnap's CPU platform only declares (SGLang imports it) but does not implement."""


def unsupported(qualname: str, why: str):
    """A function named ``qualname`` that raises :class:`UnsupportedKernelError` when called."""

    def stand_in(*args, **kwargs):
        raise UnsupportedKernelError(
            f"{qualname} is not implemented by hsnap's CPU platform (hsnap_sglang.cpu): {why}; "
            f"SGLang imports it on CPU but the supported path never calls it"
        )

    stand_in.__name__ = stand_in.__qualname__ = qualname.rsplit(".", 1)[-1]
    stand_in.__doc__ = f"Not implemented on hsnap's CPU platform ({why}); raises UnsupportedKernelError."
    stand_in.hsnap_unsupported = True
    return stand_in
