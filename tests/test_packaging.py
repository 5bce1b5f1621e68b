"""What an installed lmc holds: every package and every config (pyproject.toml lists them), built without a warning."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import lmc

ROOT = Path(__file__).parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
#: The configs as the repository has them, relative to configs/.
CONFIGS = {path.relative_to(ROOT / "configs").as_posix() for path in (ROOT / "configs").rglob("*.yaml")}

#: Runs one PEP 517 hook of setuptools (what pip runs) and prints the wheel's name and every warning
#: on its last line; setuptools' own log goes before it.
_BUILD = """
import json, sys, warnings
from setuptools import build_meta
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    wheel = getattr(build_meta, sys.argv[1])(sys.argv[2])
print(json.dumps({"wheel": wheel, "warnings": [str(w.message) for w in caught]}))
"""


def _environment() -> dict[str, str]:
    """This process's environment without PYTHONPATH: the built lmc, not this checkout, is what is imported."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """A wheel and an editable wheel of a copy of the repository, built offline: hook -> (wheel, warnings)."""
    tree, wheels = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheels")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("lmc", "callbacks", "configs"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    result = {}
    for hook in ("build_wheel", "build_editable"):
        run = subprocess.run(
            [sys.executable, "-c", _BUILD, hook, str(wheels)],
            cwd=tree,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        answer = json.loads(run.stdout.splitlines()[-1])
        result[hook] = wheels / answer["wheel"], answer["warnings"]
    return result


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


def test_a_wheel_builds_without_a_warning_and_holds_every_config(built):
    """The configs' folders used to be taken for packages left out: one "Package would be ignored" each."""
    wheel, warnings = built["build_wheel"]
    assert warnings == []
    names = zipfile.ZipFile(wheel).namelist()
    assert CONFIGS and {name.removeprefix("lmc/configs/") for name in names if name.endswith(".yaml")} == CONFIGS
    metadata = zipfile.ZipFile(wheel).read(next(name for name in names if name.endswith(".dist-info/METADATA")))
    assert f"\nVersion: {lmc.__version__}\n" in metadata.decode()


def test_an_editable_build_warns_only_what_make_install_silences(built):
    """setuptools' notice on every editable install of a mapped folder, which the Makefile filters out."""
    (silenced,) = re.findall(r"PYTHONWARNINGS='ignore:([^']+)' \$\(BIN\)/pip install", (ROOT / "Makefile").read_text())
    _, warnings = built["build_editable"]
    assert [message for message in warnings if not message.startswith(silenced)] == []


@pytest.mark.parametrize("hook", ["build_wheel", "build_editable"])
def test_an_installed_lmc_reads_its_configs_from_any_working_folder(hook, built, tmp_path):
    """What lmc demo and lmc repro do: configs/... is lmc's own config where the working folder has none."""
    wheel, _ = built[hook]
    site, elsewhere = tmp_path / "site-packages", tmp_path / "elsewhere"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere.mkdir()
    # -S: without the site-packages of this environment, whose lmc is this checkout.
    code = f"import site; site.addsitedir({str(site)!r}); from lmc.configs import config_file; "
    code += "print(config_file('configs/study/repro.yaml'))"
    run = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=elsewhere, env=_environment(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    found = Path(run.stdout.strip())
    assert found.read_text() == (ROOT / "configs" / "study" / "repro.yaml").read_text()
    assert not found.is_relative_to(ROOT) and not found.is_relative_to(elsewhere)
