"""A change made to a module right after it runs, before anything imports a name from it: what the test seam of the
off-thread jobs (tests/engine/linkgate) and the GPU machine's environment (scripts/gpu_machine) install from a
``sitecustomize``. Loaded that early, it imports nothing of hsnap."""

import importlib.abc
import importlib.machinery


class AfterImport(importlib.abc.MetaPathFinder):
    """A finder (first on ``sys.meta_path``) that runs ``changes[name](module)`` right after module ``name`` executed."""

    def __init__(self, changes: dict) -> None:
        self.changes = changes

    def find_spec(self, name, path, target=None):
        change = self.changes.get(name)
        if change is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            change(module)

        spec.loader.exec_module = exec_module
        return spec
