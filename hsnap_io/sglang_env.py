"""Make SGLang importable on a CPU-only machine: hsnap's one shim for it.

For SGLang's memory-pool modules, ``import_sglang()`` is the single entry point (idempotent, thread-safe).  It
returns a namespace with the SGLang modules hsnap touches::

    sg = import_sglang()
    sg.memory_pool.MHATokenToKVPool(...)
    sg.swa_memory_pool.SWAKVPool(...)
    sg.allocator.TokenToKVPoolAllocator(...)
    sg.allocator_swa.SWATokenToKVPoolAllocator(...)   # not exported by allocator/__init__
    sg.allocator_mamba.MambaSlotAllocator(...)
    sg.mamba_utils.Mamba2CacheParams(...)
    sg.schedule_batch.ReqKvInfo()

What it does (see shared/research/sglang-pools.md, section 1 and 5):

* ``sglang.srt.configs`` imports every model config, and two of them
  (``multimodal/internvl_utils.py``, ``configs/deepseek_ocr.py``) import
  ``torchvision`` at module level.  The only torchvision wheel is a CUDA build
  whose import fails on CPU torch (``operator torchvision::nms does not
  exist``).  We first ask transformers ``is_torchvision_available()`` (an
  ``lru_cache``d check, so transformers keeps believing torchvision is absent),
  and then, *only if the real torchvision is missing or unusable*, register a
  ``sys.meta_path`` finder that serves placeholder modules for ``torchvision``
  and its submodules.  Placeholders only hand out names; using one (calling it)
  raises :class:`TorchvisionUnavailable` (an ``ImportError``).  No pool code path
  touches torchvision.
* Two import-time ``UserWarning``\\ s (AWQ and GGUF "only CUDA ... supports")
  are silenced with narrow filters (exact message, category and module).
* ``SGLANG_USE_CPU_ENGINE`` is never set: it makes ``memory_pool`` import the
  CPU ``sgl_kernel`` build, which is not on PyPI.

If SGLang (or one of its import-time dependencies) is not installed,
``SGLangUnavailableError`` (an ``ImportError``) is raised with an install hint.

For SGLang's server, hsnap's CPU platform (:mod:`hsnap_sglang.cpu.finder`) serves the
same placeholders (:func:`placeholder_spec`) where torchvision is absent and, beside a
CUDA torchvision whose C extension cannot load, first defines the op schemas its import
needs (:func:`prepare_torchvision`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
import warnings

__all__ = [
    "SGLangUnavailableError",
    "TorchvisionUnavailable",
    "import_sglang",
    "is_torchvision",
    "placeholder_spec",
    "prepare_torchvision",
    "sglang_available",
    "torchvision_placeholder_active",
]

INSTALL_HINT = (
    "install it with scripts/bootstrap (repo checkout) or "
    "`pip install hsnap[sglang]` (torch CPU build + `pip install --no-deps sglang==0.5.23` "
    "and its import-time deps)"
)

_lock = threading.RLock()
_namespace: types.SimpleNamespace | None = None
_placeholder_installed = False


class SGLangUnavailableError(ImportError):
    """SGLang (or one of its import-time dependencies) cannot be imported."""


def sglang_available() -> bool:
    """True when an ``sglang`` distribution is installed (does not import it)."""
    return importlib.util.find_spec("sglang") is not None


def torchvision_placeholder_active() -> bool:
    """True when ``torchvision`` is served by hsnap's placeholder finder."""
    return _placeholder_installed


# --------------------------------------------------------------------------
# torchvision: placeholder modules where it is absent (or unusable)
# --------------------------------------------------------------------------

_TV = "torchvision"


class TorchvisionUnavailable(ImportError):
    """A torchvision function used where torchvision is absent or its C extension unusable."""


def is_torchvision(fullname: str) -> bool:
    """Whether ``fullname`` is ``torchvision`` or one of its submodules."""
    return fullname == _TV or fullname.startswith(_TV + ".")


class _Missing:
    """A name imported from the torchvision placeholder: attribute chains work
    (``InterpolationMode.BICUBIC``), calling it raises."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise TorchvisionUnavailable(
            f"{self._name} is unavailable: torchvision is not installed (or unusable with this torch build); hsnap "
            f"serves placeholder torchvision modules so that SGLang imports on CPU (install a CPU torchvision to use it)"
        )

    def __repr__(self) -> str:
        return f"<hsnap torchvision placeholder {self._name}>"


class _PlaceholderModule(types.ModuleType):
    __hsnap_placeholder__ = True

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module) -> None:
        module.__version__ = "0+hsnap.placeholder"


def placeholder_spec(fullname: str) -> importlib.machinery.ModuleSpec:
    """The spec of a placeholder module for ``torchvision`` or one of its submodules."""
    return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)


class _TorchvisionPlaceholderFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        return placeholder_spec(fullname) if is_torchvision(fullname) else None


def _real_torchvision_usable() -> bool:
    if importlib.util.find_spec(_TV) is None:
        return False
    try:
        importlib.import_module(_TV)
        return True
    except Exception:  # noqa: BLE001 - e.g. RuntimeError "operator torchvision::nms does not exist"
        for name in [m for m in sys.modules if is_torchvision(m)]:
            del sys.modules[name]
        return False


def _prime_transformers_torchvision_check() -> None:
    # Must run before the placeholder finder exists: the check is lru_cached, so
    # transformers keeps the honest answer instead of seeing our placeholder.
    try:
        from transformers.utils.import_utils import is_torchvision_available
    except ImportError as exc:  # transformers is an import-time dep of sglang.srt.configs
        raise SGLangUnavailableError(
            f"SGLang's import-time dependency 'transformers' is missing ({exc}); {INSTALL_HINT}"
        ) from exc
    is_torchvision_available()


def _install_torchvision_placeholder() -> None:
    global _placeholder_installed
    if _placeholder_installed:
        return
    existing = sys.modules.get(_TV)
    if existing is not None and not getattr(existing, "__hsnap_placeholder__", False):
        return  # the real one is already imported and evidently works
    if _real_torchvision_usable():
        return
    sys.meta_path.insert(0, _TorchvisionPlaceholderFinder())
    _placeholder_installed = True


# --------------------------------------------------------------------------
# torchvision: a CUDA build beside a CPU torch (its C extension cannot load)
# --------------------------------------------------------------------------

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_schemas_library = None


def _extension_loads(package_dir: str) -> bool:
    import torch

    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(package_dir, "_C" + suffix)
        if os.path.exists(path):
            try:
                torch.ops.load_library(path)
                return True
            except OSError:
                return False
    return False


def _unavailable_kernel(name: str):
    def kernel(*args, **kwargs):
        raise TorchvisionUnavailable(
            f"torchvision::{name} is unavailable: torchvision's C extension does not load with this torch build "
            f"(a CUDA torchvision wheel beside a CPU torch); hsnap's CPU platform defined only its schema"
        )

    return kernel


def prepare_torchvision(package_dir: str) -> bool:
    """Define the ``torchvision::nms`` / ``qnms`` schemas that torchvision's
    ``_meta_registrations.py`` needs at import, with kernels that raise
    :class:`TorchvisionUnavailable`, when its C extension in ``package_dir`` cannot load
    (so that its pure-Python parts import). Returns True when they are defined (now or
    earlier in this process), False when the extension loads."""
    global _schemas_library
    if _schemas_library is not None:
        return True
    if _extension_loads(package_dir):
        return False
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _unavailable_kernel(name), "CompositeExplicitAutograd")
    _schemas_library = lib
    return True


# --------------------------------------------------------------------------
# warnings
# --------------------------------------------------------------------------

_KNOWN_WARNINGS = (
    (r"Only CUDA, HIP and XPU support AWQ currently\.", r"sglang\.srt\.layers\.quantization\.awq"),
    (r"Only CUDA, MUSA and NPU support GGUF quantization currently\.", r"sglang\.srt\.layers\.quantization\.gguf"),
)


def _silence_known_warnings() -> None:
    for message, module in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)


# --------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------

_MODULES = {
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "swa_memory_pool": "sglang.srt.mem_cache.swa_memory_pool",
    "allocator": "sglang.srt.mem_cache.allocator",
    "allocator_swa": "sglang.srt.mem_cache.allocator.swa",
    "allocator_mamba": "sglang.srt.mem_cache.allocator.mamba",
    "mamba_utils": "sglang.srt.configs.mamba_utils",
    "schedule_batch": "sglang.srt.managers.schedule_batch",
}


def import_sglang() -> types.SimpleNamespace:
    """Import SGLang's memory-pool modules (CPU-safe); return them as a namespace.

    Idempotent: later calls return the same namespace without re-importing.
    Raises ``SGLangUnavailableError`` (an ImportError) when SGLang or one of its
    import-time dependencies is missing.
    """
    global _namespace
    if _namespace is not None:
        return _namespace
    with _lock:
        if _namespace is not None:
            return _namespace
        if not sglang_available():
            raise SGLangUnavailableError(f"SGLang is not installed; {INSTALL_HINT}")
        _prime_transformers_torchvision_check()
        _install_torchvision_placeholder()
        _silence_known_warnings()
        mods = {}
        before = set(sys.modules)
        for key, name in _MODULES.items():
            try:
                mods[key] = importlib.import_module(name)
            except ImportError as exc:
                if isinstance(exc, SGLangUnavailableError):
                    raise
                hint = INSTALL_HINT
                if exc.name and exc.name.split(".")[0] in ("sgl_kernel", "sglang_kernel"):
                    flag = os.environ.get("SGLANG_USE_CPU_ENGINE")
                    if flag:
                        hint = (
                            f"SGLANG_USE_CPU_ENGINE={flag!r} is set; it makes SGLang import the "
                            f"CPU sgl_kernel build (not on PyPI). Unset it. ({INSTALL_HINT})"
                        )
                what = f"missing module {exc.name!r}" if exc.name else str(exc)
                raise SGLangUnavailableError(f"cannot import {name}: {what}; {hint}") from exc
        _drop_kept_tracebacks(set(sys.modules) - before)
        _namespace = types.SimpleNamespace(**mods)
        return _namespace


def _drop_kept_tracebacks(names) -> None:
    """A module that keeps an exception it met at import (SGLang's ``torch_memory_saver_adapter`` keeps its
    ImportError, to raise when the saver is asked for) keeps the exception's traceback, whose frames chain back through
    the import to whoever called :func:`import_sglang` first — with their locals (a pool set, a request's record) for
    the life of the process. The exceptions stay (raising one again gives it a traceback of its own); their tracebacks
    go."""
    for name in names:
        module = sys.modules.get(name)
        chained = [v for v in list(getattr(module, "__dict__", {}).values()) if isinstance(v, BaseException)]
        seen: set[int] = set()
        while chained:  # each exception kept, and those it chains to
            e = chained.pop()
            if isinstance(e, BaseException) and id(e) not in seen:
                seen.add(id(e))
                e.__traceback__ = None
                chained += [e.__cause__, e.__context__]
