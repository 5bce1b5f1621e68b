"""Packages whose public names load on first use (PEP 562).

A package's ``__init__`` that imported every name would import torch for its lightest one: the
``Scope`` literal or the ``AlignOptions`` dataclass that ``lmc COMMAND --help`` builds its parser
from. With :func:`lazy_exports` the package keeps its ``__all__`` and ``from package import name``
keeps working, but only the module that defines ``name`` is imported, when ``name`` is first read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` whose names are its submodules'.

    Args:
        package: The package's ``__name__``.
        exports: Submodule (relative to ``package``) -> the names it defines that ``package`` exports.
            No name may be a submodule's: importing that submodule would bind its name in the package.

    Returns:
        ``__getattr__`` (imports the submodule that defines the name and keeps the value in the
        package, so it is looked up once) and ``__dir__`` (the loaded names and every export).
    """
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *module_of})

    return __getattr__, __dir__
