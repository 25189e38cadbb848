"""torchvision on a CPU-only machine, for the imports SGLang's server makes (a text model never calls torchvision).

SGLang 0.5.23 imports torchvision at module level (``multimodal/internvl_utils.py``, ``configs/deepseek_ocr.py``;
transformers' image utilities when torchvision is installed).  PyPI has only CUDA builds of torchvision, and one
installed beside a CPU torch is worse than none: its ``_C`` library cannot load, ``torchvision/_meta_registrations.py``
then dies on ``register_fake("torchvision::nms")``, and in every process of that environment ``import sglang`` and
even ``from transformers.models.qwen3_next import Qwen3NextForCausalLM`` fail.  So hsnap does not install torchvision,
and in an opted-in process :class:`hsnap_sglang.cpu.finder.CpuPlatformFinder` handles both cases:

* torchvision absent: :func:`placeholder_spec` serves ``torchvision`` and its submodules as placeholder modules whose
  names can be imported and chained (``InterpolationMode.BICUBIC``) but raise :class:`TorchvisionUnavailable`, naming
  themselves, when called;
* a torchvision whose C extension cannot load (the CUDA wheel): :func:`prepare` defines the schemas of
  ``torchvision::nms`` / ``torchvision::qnms`` first (kernels that raise :class:`TorchvisionUnavailable`), so its
  pure-Python parts import;
* a working torchvision: nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import types

__all__ = ["SCHEMAS", "TorchvisionUnavailable", "placeholder_spec", "prepare"]

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_library = None


class TorchvisionUnavailable(ImportError):
    """A torchvision function used on hsnap's CPU platform, where torchvision is absent or its C extension unusable."""


# --------------------------------------------------------------------------------------------------------------
# torchvision absent: placeholder modules
# --------------------------------------------------------------------------------------------------------------


class _Missing:
    """A name imported from the torchvision placeholder: attribute chains work, calling it raises."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise TorchvisionUnavailable(
            f"{self._name} is unavailable: torchvision is not installed; hsnap's CPU platform serves placeholder "
            f"torchvision modules so that SGLang's text-model server imports (install a CPU torchvision to use it)"
        )

    def __repr__(self) -> str:
        return f"<hsnap torchvision placeholder {self._name}>"


class _PlaceholderModule(types.ModuleType):
    hsnap_placeholder = True

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module) -> None:
        module.__version__ = "0+hsnap.placeholder"


def placeholder_spec(fullname: str):
    """The spec of a placeholder module for ``torchvision`` or one of its submodules."""
    return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)


# --------------------------------------------------------------------------------------------------------------
# a CUDA torchvision beside a CPU torch: op schemas
# --------------------------------------------------------------------------------------------------------------


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


def prepare(package_dir: str) -> bool:
    """Define the missing schemas when torchvision's C extension in ``package_dir`` cannot load.

    Returns True when they are defined (now or earlier in this process), False when the extension loads.
    """
    global _library
    if _library is not None:
        return True
    if _extension_loads(package_dir):
        return False
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _unavailable_kernel(name), "CompositeExplicitAutograd")
    _library = lib
    return True
