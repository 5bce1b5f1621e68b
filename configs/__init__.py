"""lmc's YAML configs, installed with the package as ``lmc.configs`` (this folder; see pyproject.toml).

``lmc demo`` and ``lmc repro`` read them from any working folder: a path written as in the
repository (``configs/study/repro.yaml``) is the user's file when the working folder has one,
and the packaged file otherwise.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

#: How paths to the packaged configs start: as seen from the repository root.
PREFIX = Path("configs")


def root() -> Path:
    """The folder of the packaged configs."""
    return Path(str(files(__name__)))


def config_file(path: str | Path) -> Path:
    """``path`` if it names a file; else, for ``configs/<group>/<name>.yaml``, the packaged config.

    Raises:
        FileNotFoundError: Neither exists (naming ``path`` and where it was looked for).
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_absolute() and path.parts[: len(PREFIX.parts)] == PREFIX.parts:
        packaged = root().joinpath(*path.parts[len(PREFIX.parts) :])
        if packaged.is_file():
            return packaged
    raise FileNotFoundError(
        f"config {path} does not exist (relative paths are read from the working folder {Path.cwd()}, "
        f"and configs/... also from lmc's packaged configs in {root()})"
    )


def spelled(path: str | Path) -> str:
    """How a report names a config: ``configs/<group>/<name>.yaml`` for a packaged one, else as given."""
    path = Path(path)
    if path.is_absolute() and path.resolve().is_relative_to(root().resolve()):
        return str(PREFIX / path.resolve().relative_to(root().resolve()))
    return str(path)
