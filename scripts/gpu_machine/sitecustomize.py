"""Device-run only (not part of hsnap): the modules named in HSNAP_DEVICE_PLACEHOLDERS (absent on the GPU machine,
imported by SGLang at import time but not used by the pool checks: sgl_kernel and other CUDA-build extras) are served
as inert placeholder modules, each said on stderr.  A placeholder that is *called* raises — except the few functions
of REAL, which SGLang's CUDA server calls where no switch avoids them (scripts/gpu_machine/README.md: step 6 without
sgl_kernel).  With sgl_kernel a placeholder, PATCHED also applies: module attributes replaced right after the module
runs (before anything imports a copy of them)."""
import importlib.abc
import importlib.machinery
import os
import sys
import types

NAMES = [n for n in os.environ.get("HSNAP_DEVICE_PLACEHOLDERS", "").split(",") if n]


def _pdl_supported() -> bool:  # SGLang's own rule (sglang.kernels.jit.utils.arch): Hopper or newer
    import torch

    return torch.cuda.get_device_capability()[0] >= 9


# module -> {name: a real function}: called by SGLang's CUDA server at start (TritonAttnBackend.__init__)
REAL = {"sgl_kernel.utils": {"is_arch_support_pdl": _pdl_supported}}
# module -> {name: value}: the KV store's JIT kernel cannot be built here (no nvcc); probing for it on every write
# logs a warning each time before SGLang falls back to plain indexing
PATCHED = {"sglang.kernels.ops.kvcache.kvcache": {"can_use_store_cache": lambda *a, **k: False}}


class _Missing(type):
    def __getattr__(cls, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{cls.__name__}.{attr}", (), {})

    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:  # used as a decorator at import time
            return a[0]
        raise RuntimeError(f"placeholder {cls.__name__} called (absent on this machine)")


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        real = REAL.get(self.__name__, {}).get(attr)
        if real is not None:
            return real
        return _Missing(f"{self.__name__}.{attr}", (), {})


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


class _Placeholders(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in NAMES:
            return None
        if "." not in fullname:
            print(f"[device-env] placeholder module for absent {fullname}", file=sys.stderr, flush=True)
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def _replace(fullname: str, names: dict):
    def change(module) -> None:
        for name, value in names.items():
            setattr(module, name, value)
        print(f"[device-env] {fullname}: {', '.join(names)} replaced", file=sys.stderr, flush=True)

    return change


sys.meta_path.append(_Placeholders())
if "sgl_kernel" in NAMES:
    from hsnap_testing.seams import AfterImport  # (hsnap's wheel is installed beside SGLang: scripts/gpu_machine/pack)

    sys.meta_path.insert(0, AfterImport({name: _replace(name, names) for name, names in PATCHED.items()}))
