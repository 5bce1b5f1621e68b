"""What an installed lmc holds: every package and every config (pyproject.toml lists them)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_of_the_repository_is_installed():
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for top in ("lmc", "callbacks")
        for path in (ROOT / top).rglob("__init__.py")
    }
    assert set(SETUPTOOLS["packages"]) == found | {"lmc.configs"}


def test_the_configs_ship_as_lmc_configs():
    import lmc.configs

    assert SETUPTOOLS["package-dir"] == {"lmc.configs": "configs"}
    assert Path(lmc.configs.__file__).parent.resolve() == (ROOT / "configs").resolve()
    yaml_files = {path.relative_to(ROOT / "configs") for path in (ROOT / "configs").rglob("*.yaml")}
    patterns = SETUPTOOLS["package-data"]["lmc.configs"]
    shipped = {path for path in yaml_files if any(path.match(pattern) for pattern in patterns)}
    assert yaml_files and shipped == yaml_files
