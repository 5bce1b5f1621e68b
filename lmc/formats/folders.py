"""Output folders written whole or not at all, and never over an input."""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from lmc.checkpoints import WriteError, unwritable_reason


def overlapping_input(output: str | Path, inputs: Sequence[str | Path]) -> Path | None:
    """The input that ``output`` is, lies inside, or holds (writing or replacing it would touch it); else ``None``."""
    output = Path(output).resolve()
    for path in inputs:
        resolved = Path(path).resolve()
        if output == resolved or output.is_relative_to(resolved) or resolved.is_relative_to(output):
            return Path(path)
    return None


@contextlib.contextmanager
def atomic_output_folder(folder: str | Path, inputs: Sequence[str | Path] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``folder``; when the block ends, it becomes ``folder``.

    A reader never sees a half-written ``folder``: the block writes into ``.<name>.<random>.tmp``,
    which is renamed into place only when the block succeeds (an existing ``folder`` is replaced;
    callers decide whether that is allowed). On an error the temporary folder is removed and
    ``folder`` is left as it was.

    Raises:
        ValueError: ``folder`` is an input, lies inside one or holds one.
        WriteError: The folder cannot be created (naming ``folder``, not the temporary one).
    """
    folder = Path(folder)
    clash = overlapping_input(folder, inputs)
    if clash is not None:
        raise ValueError(f"the output {folder} would write over the input {clash}: choose another output folder")
    temporary = folder.with_name(f".{folder.name}.{secrets.token_hex(6)}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        temporary.mkdir()
    except OSError as error:
        reason = unwritable_reason(folder.parent) or error.strerror or str(error)
        raise WriteError(f"cannot write {folder}: {reason}") from error
    try:
        yield temporary
        if folder.exists():
            retired = folder.with_name(f".{folder.name}.{secrets.token_hex(6)}.old")
            folder.replace(retired)
            temporary.replace(folder)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            temporary.replace(folder)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            reason = unwritable_reason(folder.parent) or error.strerror or str(error)
            raise WriteError(f"cannot write {folder}: {reason}") from error
        raise
