"""Layers only point down: from the contracts and the maths (lazy, rotary, tasks, io, symmetry) to the commands."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lmc

ROOT = Path(lmc.__file__).parent

# package or module -> the lmc packages and modules it may import besides itself
ALLOWED = {
    "lazy": set(),
    "rotary": set(),
    "tasks": set(),
    "io": set(),
    "configs": set(),  # the YAML files, mapped from the repository's configs/ (pyproject.toml)
    "checkpoints": {"io"},
    "symmetry": {"lazy", "rotary"},
    "models": {"rotary", "tasks"},
    "adapters": {"rotary", "symmetry", "models"},
    "matching": {"lazy", "symmetry", "adapters", "checkpoints", "formats", "io"},
    "data": {"tasks"},
    "training": {"adapters", "checkpoints", "data", "io", "lazy", "models", "symmetry", "tasks"},
    "connectivity": {"data", "io", "matching", "symmetry", "tasks"},
    "formats": {"adapters", "checkpoints", "data", "io", "lazy", "symmetry", "tasks"},
    "checkpoint_alignment": {
        "checkpoints", "connectivity", "data", "formats", "io", "matching", "symmetry", "training",
    },
    "checkpoint_merge": {"formats", "io", "matching", "symmetry", "training"},
    "experiments": {"adapters", "checkpoints", "configs", "connectivity", "io", "matching", "symmetry", "training"},
    "cli": {
        "adapters", "checkpoint_alignment", "checkpoint_merge", "checkpoints", "configs", "connectivity", "data",
        "experiments", "formats", "io", "matching", "models", "symmetry", "training",
    },
    "__main__": {"cli"},
}  # fmt: skip


def test_every_module_has_a_layer():
    modules = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert modules - {"__init__"} | {"configs"} == set(ALLOWED)


def test_lmc_never_imports_the_top_level_callbacks_package():
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not any(name.split(".")[0] == "callbacks" for name in names), path


def lmc_imports(path: Path) -> set[str]:
    """The lmc packages a file imports, at any depth (``lmc.x.y`` -> ``x``)."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names if node.module == "lmc"]
        packages |= {name.split(".")[1] for name in names if name.startswith("lmc.")}
    return packages


@pytest.mark.parametrize("package", list(ALLOWED))
def test_each_layer_imports_only_the_layers_below(package):
    folder = Path(importlib.import_module(f"lmc.{package}").__file__).parent if package == "configs" else ROOT / package
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else [ROOT / f"{package}.py"]
    for path in files:
        upward = lmc_imports(path) - ALLOWED[package] - {package}
        assert not upward, f"{path.relative_to(ROOT.parent)} imports {sorted(upward)}, a layer above {package}"
