"""Device-run only (not part of hsnap): the modules named in HSNAP_DEVICE_PLACEHOLDERS (absent on the GPU machine,
imported by SGLang at import time but not used by the pool checks: sgl_kernel and other CUDA-build extras) are served
as inert placeholder modules, each said on stderr.  A placeholder that is *called* raises."""
import importlib.abc
import importlib.machinery
import os
import sys
import types

NAMES = [n for n in os.environ.get("HSNAP_DEVICE_PLACEHOLDERS", "").split(",") if n]


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


sys.meta_path.append(_Placeholders())
