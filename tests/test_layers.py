"""No module reaches into another module's private names: what two modules share gets a public name in the lower
one. A `_name` belongs to the module that defines it, a `_module` to its package (import-linter's contracts in
.importlinter check the direction of the imports themselves)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hsnap_format": "hsnap_format", "hsnap_io": "hsnap_io", "hsnap_sglang": "hsnap_sglang",
            "hsnap_view": "viewer", "hsnap_testing": "hsnap_testing"}  # import name: folder


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
    return ".".join(base + [node.module] if node.module else base)


def _reaches(importer: str, owner: str, name: str, modules: dict[str, Path]) -> bool:
    """True when `importer` may not use `owner`'s `name`: a private module is open to its own package only,
    any other private name to its own module only."""
    if f"{owner}.{name}" in modules:
        return importer != owner and not importer.startswith(owner + ".")
    return importer != owner


def private_reaches(module: str, path: Path, modules: dict[str, Path] = MODULES) -> list[str]:
    """`file:line: module uses owner._name` for every private name `module` takes from another of our modules:
    imported (`from owner import _name`, `import owner._name`) or read off an imported module (`owner._name`)."""
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # local name: the module of ours it names

    def check(owner: str, name: str, line: int) -> None:
        if owner.split(".")[0] in PACKAGES and _private(name) and _reaches(module, owner, name, modules):
            found.append((line, f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: "
                                f"{module} uses {owner}.{name}"))

    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            owner = _absolute(module, path, node)
            for alias in node.names:
                check(owner, alias.name, node.lineno)
                if f"{owner}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{owner}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                *parents, name = alias.name.split(".")
                if parents:
                    check(".".join(parents), name, node.lineno)
                if alias.name in modules:
                    bound[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            check(bound[node.value.id], node.attr, node.lineno)
    return [text for _, text in sorted(found)]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_uses_another_modules_private_names(package):
    found = [line for module, path in MODULES.items() if module.split(".")[0] == package
             for line in private_reaches(module, path)]
    assert not found, "make these names public in the module that defines them:\n" + "\n".join(found)


def test_the_check_sees_each_way_of_reaching_in(tmp_path):
    code = "from .restore import _allocate\nfrom hsnap_io import reshard as r\nimport hsnap_format._fs\nr._storage_differs\n"
    probe = tmp_path / "probe.py"
    probe.write_text(code)
    modules = {"hsnap_io.probe": probe, "hsnap_io.reshard": probe, "hsnap_format._fs": probe}
    found = private_reaches("hsnap_io.probe", probe, modules)
    assert [line.split(": ", 1)[1] for line in found] == [
        "hsnap_io.probe uses hsnap_io.restore._allocate", "hsnap_io.probe uses hsnap_format._fs",
        "hsnap_io.probe uses hsnap_io.reshard._storage_differs"]


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages a wheel installs; a sub-package missing there imports in the editable checkout
    and is absent from `pip install .` (as `hsnap_format.stores` would be)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = set()
    for package, folder in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            folders.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - folders == set(), "no such package folder"
