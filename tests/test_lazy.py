"""Packages whose names load on first use (lmc.lazy): each exported name resolves, a light one loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

LAZY_PACKAGES = ("lmc.formats", "lmc.matching", "lmc.symmetry", "lmc.training")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_resolves_and_is_listed(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package} exports {missing} but cannot load them"
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'not_exported'"):
        module.not_exported  # noqa: B018


def test_the_light_names_that_the_commands_help_reads_load_no_torch():
    code = "import sys\nfrom lmc.matching import AlignOptions, METHODS\nfrom lmc.symmetry import Scope, SCOPES\n"
    code += "from lmc.formats import EvaluationDataOptions\n"
    code += "print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
