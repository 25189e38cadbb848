"""The import-time part of hsnap's CPU platform: one ``sys.meta_path`` finder, installed in every process of an
opted-in SGLang server by :func:`hsnap_sglang._autoload.torch_autoload` (torch's ``torch.backends`` entry point,
which runs at the end of ``import torch``) or by :func:`hsnap_sglang.cpu.activate`.

It acts on two top-level packages and on the SGLang modules :data:`hsnap_sglang.cpu.fill_in.FILL_IN` lists:

* ``sgl_kernel`` — when no real sgl_kernel is installed, the package :mod:`hsnap_sglang.cpu.sgl_kernel` is loaded
  under that name (its submodules, e.g. ``sgl_kernel.mamba``, are found in it as usual).  A real sgl_kernel always
  wins: the finder then steps aside.
* ``torchvision`` — SGLang imports it at module level though a text model never calls it.  Absent (hsnap does not
  install it: PyPI has only CUDA builds), it is served as placeholder modules whose names raise when called; present
  but with a C extension that cannot load (the CUDA wheel beside a CPU torch), the two op schemas its
  ``_meta_registrations.py`` needs are defined before it imports.  Both come from :mod:`hsnap_io.sglang_env`, hsnap's
  one "import SGLang on CPU" shim.
* a module of :data:`~hsnap_sglang.cpu.fill_in.FILL_IN` (``sglang.srt.layers.attention.mamba.mamba``) — loaded by
  its own loader as usual; right after it executes, the names it binds only for cuda / npu / xpu (the Mamba2 causal
  conv) are given to it (:func:`hsnap_sglang.cpu.fill_in.fill`).

Nothing but the standard library (and that shim, itself standard library only) is imported until one of these
imports happens.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import threading

from hsnap_io.sglang_env import is_torchvision, placeholder_spec, prepare_torchvision

from . import fill_in

__all__ = ["CpuPlatformFinder", "FillInLoader", "install", "installed"]

logger = logging.getLogger("hsnap_sglang.cpu")

_SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sgl_kernel")
_lock = threading.RLock()


def _other_finders_spec(finder, name: str, path=None, target=None):
    """The spec another meta-path finder gives ``name`` (a real installation), or None."""
    for other in list(sys.meta_path):
        if other is finder or not hasattr(other, "find_spec"):
            continue
        try:
            spec = other.find_spec(name, path, target)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            return spec
    return None


class FillInLoader(importlib.abc.Loader):
    """A module's own loader, followed by :func:`hsnap_sglang.cpu.fill_in.fill` once the module has executed."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        bound = fill_in.fill(module)
        if bound:
            logger.debug("hsnap CPU platform: bound %s in %s", ", ".join(bound), module.__name__)

    def __getattr__(self, name):  # get_source, get_code, get_filename, ...: the module's own loader
        if name == "loader":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class CpuPlatformFinder(importlib.abc.MetaPathFinder):
    """See the module docstring.  ``find_spec`` answers only for ``sgl_kernel`` (the shim, unless a real one is
    installed), where torchvision is not installed, for ``torchvision`` and its submodules (placeholders), and for the
    modules of :data:`~hsnap_sglang.cpu.fill_in.FILL_IN` (their own spec, its loader wrapped in :class:`FillInLoader`)."""

    def __init__(self) -> None:
        self._torchvision: str | None = None  # None: not looked at yet; "real" or "placeholder"
        self.real_sgl_kernel = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel":
            return self._sgl_kernel_spec()
        if is_torchvision(fullname):
            return self._torchvision_spec(fullname)
        if fullname in fill_in.FILL_IN:
            return self._fill_in_spec(fullname, path, target)
        return None

    def _fill_in_spec(self, fullname, path, target):
        spec = _other_finders_spec(self, fullname, path, target)
        if spec is None or spec.loader is None or isinstance(spec.loader, FillInLoader):
            return spec
        spec.loader = FillInLoader(spec.loader)
        return spec

    def _sgl_kernel_spec(self):
        with _lock:
            if _other_finders_spec(self, "sgl_kernel") is not None:
                if not self.real_sgl_kernel:
                    logger.warning("hsnap CPU platform: a real sgl_kernel is installed; using it, not hsnap's CPU kernels")
                self.real_sgl_kernel = True
                return None
            return importlib.util.spec_from_file_location(
                "sgl_kernel", os.path.join(_SHIM_DIR, "__init__.py"), submodule_search_locations=[_SHIM_DIR]
            )

    def _torchvision_spec(self, fullname: str):
        with _lock:
            if self._torchvision is None:
                spec = _other_finders_spec(self, "torchvision")
                if spec is None:
                    self._torchvision = "placeholder"
                else:
                    self._torchvision = "real"
                    if spec.submodule_search_locations:
                        prepare_torchvision(list(spec.submodule_search_locations)[0])
            if self._torchvision == "placeholder":
                return placeholder_spec(fullname)
            return None


_finder: CpuPlatformFinder | None = None


def install() -> CpuPlatformFinder:
    """Put the finder first on ``sys.meta_path`` (once per process); returns it."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = CpuPlatformFinder()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return _finder


def installed() -> bool:
    """Whether this process has the finder on ``sys.meta_path``."""
    return _finder is not None and _finder in sys.meta_path
