"""Files lmc writes: always atomically, so no reader sees half a file or half a folder, never over an input."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


class WriteError(OSError):
    """A file lmc writes could not be written (disk full, read-only folder, a file where a folder should be)."""


def unwritable_reason(folder: str | Path) -> str | None:
    """Why files cannot be created in ``folder`` (or in the folders that would be made for it), else ``None``."""
    existing = Path(folder)
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def check_output_folder(folder: str | Path) -> Path:
    """``folder`` if files can be written into it (it need not exist yet); else a :class:`WriteError`."""
    reason = unwritable_reason(folder)
    if reason is not None:
        raise WriteError(f"cannot write into {folder}: {reason}; choose another output folder")
    return Path(folder)


def _temporary_beside(path: Path, suffix: str = "tmp") -> Path:
    """A hidden name beside ``path`` for a temporary of it: ``.<name>.<random>.<suffix>``."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.{suffix}")


@contextlib.contextmanager
def _writing(temporary: Path) -> Iterator[None]:
    """Hold an ``flock`` on ``temporary`` (a file or a folder) while it is written: the kernel releases it when
    the writer exits, killed or not, so :func:`remove_stale_temporaries` tells a live write from a dead one."""
    handle = os.open(temporary, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporaries of ``path`` that a killed writer left (:func:`atomic_write`,
    :func:`atomic_output_folder`); returns them.

    A kill (``SIGKILL``, the machine going down) runs no cleanup, and a temporary folder is as
    large as the output: the next write of the same path removes it. A temporary whose writer
    still runs (it holds its ``flock``) is left alone.
    """
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{12}}\.(tmp|old)")
    if not path.parent.is_dir():
        return []
    removed = []
    for candidate in path.parent.iterdir():
        if not pattern.fullmatch(candidate.name) or candidate.is_symlink():
            continue
        try:
            handle = os.open(candidate, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to read
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its writer is running
        finally:
            os.close(handle)
        if candidate.is_dir():
            shutil.rmtree(candidate, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                candidate.unlink()
        removed.append(candidate)
    return removed


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary_path)`` then move the file into place, so no reader sees half a file.

    The file gets the permissions of any new file (``0o666`` less the umask), as the files
    Lightning writes beside it do.

    Raises:
        WriteError: The file could not be written (naming ``path``, not the temporary file).
    """
    path = Path(path)
    temporary, created = _temporary_beside(path), False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        # open(2) with mode 0o666 lets the kernel apply the umask: the mode any new file gets here.
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        created, mode = True, os.fstat(handle).st_mode & 0o777
        os.close(handle)
        with _writing(temporary):
            write(temporary)
            os.chmod(temporary, mode)  # writers may set their own (safetensors writes 0o600)
            os.replace(temporary, path)
    except BaseException as error:
        if created:
            with contextlib.suppress(OSError):  # the writer may have removed it already
                temporary.unlink()
        if isinstance(error, OSError):
            reason = unwritable_reason(path.parent) or error.strerror or str(error)
            raise WriteError(f"cannot write {path}: {reason}") from error
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def strict_json(value: object) -> object:
    """``value`` with every NaN and infinity as ``None``: JSON has no such numbers (``null`` stands for them)."""
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    if value is None or isinstance(value, str | bool | int):
        return value
    number = float(value)  # floats, and the numpy and torch scalars results hold
    return number if math.isfinite(number) else None


def atomic_write_json(path: str | Path, data: object) -> Path:
    """``data`` as strict JSON (NaN and infinities written as ``null``; see :func:`nan_for_null`), atomically."""
    return atomic_write_text(path, json.dumps(strict_json(data), indent=2, allow_nan=False) + "\n")


def nan_for_null(value: object) -> object:
    """JSON read back where every number may be NaN: each ``null`` becomes NaN again.

    Only for data that holds numbers alone (curve points, tables, summaries), where ``null`` can
    only be a number :func:`atomic_write_json` could not write.
    """
    if isinstance(value, dict):
        return {key: nan_for_null(item) for key, item in value.items()}
    if isinstance(value, list):
        return [nan_for_null(item) for item in value]
    return math.nan if value is None else value


def overlapping_input(output: str | Path, inputs: Sequence[str | Path]) -> Path | None:
    """The input that ``output`` is, lies inside, or holds (writing or replacing it would touch it); else ``None``."""
    output = Path(output).resolve()
    for path in inputs:
        resolved = Path(path).resolve()
        if output == resolved or output.is_relative_to(resolved) or resolved.is_relative_to(output):
            return Path(path)
    return None


def check_outputs(outputs: Sequence[str | Path], inputs: Sequence[str | Path], overwrite: bool) -> None:
    """Refuse outputs that would replace (or lie inside, or hold) an input, lie in a file, or replace results
    without ``overwrite``: the one check of every command's outputs, before any work."""
    for path in map(Path, outputs):
        clash = overlapping_input(path, inputs)
        if clash is not None:
            raise ValueError(f"the output {path} would replace an input ({clash}): choose another output folder")
        if path.parent.exists() and not path.parent.is_dir():
            raise ValueError(f"the output folder {path.parent} is a file: choose a folder")
    existing = [str(path) for path in outputs if Path(path).exists()]
    if existing and not overwrite:
        raise ValueError(f"{', '.join(existing)} already exist: pass --overwrite true to replace them")


def _give_new_file_modes(folder: Path) -> None:
    """Every file under ``folder`` gets the mode any new file gets here (``0o666`` less the umask):
    some writers set their own (safetensors writes ``0o600``)."""
    probe = folder / f".mode.{secrets.token_hex(6)}"
    handle = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    mode = os.fstat(handle).st_mode & 0o777
    os.close(handle)
    probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


@contextlib.contextmanager
def atomic_output_folder(folder: str | Path, inputs: Sequence[str | Path] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``folder``; when the block ends, it becomes ``folder``.

    A reader never sees a half-written ``folder``: the block writes into ``.<name>.<random>.tmp``,
    which is renamed into place only when the block succeeds (an existing ``folder`` is replaced;
    callers decide whether that is allowed). On an error the temporary folder is removed and
    ``folder`` is left as it was; one a kill left is removed by the next write of ``folder``
    (:func:`remove_stale_temporaries`).

    Raises:
        ValueError: ``folder`` is an input, lies inside one or holds one.
        WriteError: The folder cannot be created (naming ``folder``, not the temporary one).
    """
    folder = Path(folder)
    clash = overlapping_input(folder, inputs)
    if clash is not None:
        raise ValueError(f"the output {folder} would write over the input {clash}: choose another output folder")
    temporary = _temporary_beside(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(folder)
        temporary.mkdir()
    except OSError as error:
        reason = unwritable_reason(folder.parent) or error.strerror or str(error)
        raise WriteError(f"cannot write {folder}: {reason}") from error
    try:
        with _writing(temporary):
            yield temporary
            _give_new_file_modes(temporary)
            if folder.exists():
                retired = _temporary_beside(folder, "old")
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


def _move_into_place(entry: Path, path: Path) -> None:
    """``entry`` (a file or a folder) renamed to ``path``; an existing ``path`` is retired first, then removed."""
    remove_stale_temporaries(path)
    if not (path.exists() or path.is_symlink()):
        entry.replace(path)
        return
    retired = _temporary_beside(path, "old")
    path.replace(retired)
    entry.replace(path)
    shutil.rmtree(retired, ignore_errors=True) if retired.is_dir() else retired.unlink()


@contextlib.contextmanager
def atomic_outputs(folder: str | Path, inputs: Sequence[str | Path] = (), stale: str | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder; when the block ends, each file and folder written there replaces the one of
    its name in ``folder``.

    Every output of a command is built before any is moved into place, so a failure or a kill
    leaves ``folder`` as it was, and no reader sees a half-written output. A new ``folder`` is
    written as ``.<name>.<random>.tmp`` beside it and renamed into place whole; into an existing
    one, the temporary folder lies inside it and each output is renamed into place. Other files of
    ``folder`` stay, except the entries matching ``stale`` that the block did not write (the merges
    of an earlier run at other alphas), removed once the new outputs are in place; an input is
    never removed. A temporary folder a kill left is removed by the next write of ``folder``.

    Raises:
        WriteError: ``folder`` cannot be created or written (naming ``folder``, not the temporary one).
    """
    folder = Path(folder)
    inside = folder / "outputs"  # the temporary of an existing folder: .outputs.<random>.tmp inside it
    temporary = _temporary_beside(inside if folder.is_dir() else folder)
    try:
        temporary.parent.mkdir(parents=True, exist_ok=True)
        for killed in (folder, inside):
            remove_stale_temporaries(killed)
        temporary.mkdir()
    except OSError as error:
        reason = unwritable_reason(temporary.parent) or error.strerror or str(error)
        raise WriteError(f"cannot write {folder}: {reason}") from error
    try:
        with _writing(temporary):
            yield temporary
            _give_new_file_modes(temporary)
            written = {entry.name for entry in temporary.iterdir()}
            if temporary.parent == folder:
                for name in sorted(written):
                    _move_into_place(temporary / name, folder / name)
                temporary.rmdir()
            else:
                temporary.replace(folder)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            reason = unwritable_reason(temporary.parent) or error.strerror or str(error)
            raise WriteError(f"cannot write {folder}: {reason}") from error
        raise
    for path in sorted(folder.glob(stale)) if stale else []:
        if path.name not in written and overlapping_input(path, inputs) is None:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


class FolderInUseError(OSError):
    """Another process holds the lock of a folder lmc writes into (:func:`folder_lock`)."""


#: The lock file :func:`folder_lock` takes inside its folder.
LOCK_FILE = ".lmc.lock"


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str) -> Iterator[Path]:
    """Hold ``folder``'s lock for the block: a second process that asks for it is refused, not queued.

    The lock is an ``flock`` on ``folder/.lmc.lock``: the kernel releases it when its holder
    exits, killed or not, so a lock is never left behind. The file records the holder's pid.

    Args:
        folder: The folder (created if needed).
        what: What holds it, for the message (``"lmc run"``).

    Raises:
        FolderInUseError: Another process holds it (naming the process).
    """
    folder = Path(folder)
    check_output_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise FolderInUseError(
                f"{folder} is in use by another {what} (process {holder}): wait for it to finish, or give this one "
                "another folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield folder
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
