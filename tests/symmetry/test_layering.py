"""Layers only point down: rotary <- symmetry <- adapters <- matching (issue #11)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmc

ROOT = Path(lmc.__file__).parent

# package -> the lmc packages it may import besides itself
ALLOWED = {
    "rotary": set(),
    "symmetry": {"rotary"},
    "models": {"rotary"},
    "adapters": {"rotary", "symmetry", "models"},
    "matching": {"symmetry", "adapters"},
}


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
    files = sorted((ROOT / package).glob("*.py")) if (ROOT / package).is_dir() else [ROOT / f"{package}.py"]
    for path in files:
        upward = lmc_imports(path) - ALLOWED[package] - {package}
        assert not upward, f"{path.relative_to(ROOT.parent)} imports {sorted(upward)}, a layer above {package}"
