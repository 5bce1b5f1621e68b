"""Reading checkpoints and writing files: every failure names the file and what is wrong."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lmc.checkpoints import CheckpointError, read_state_dict, save_weights
from lmc.io import WriteError, atomic_output_folder, atomic_write, atomic_write_text, check_output_folder


@pytest.fixture
def umask():
    """Sets the process umask for one test and restores it."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_respect_the_umask(tmp_path, umask, mask):
    umask(mask)
    atomic_write_text(tmp_path / "results.json", "{}")
    save_weights(nn.Linear(2, 2), tmp_path / "weights.safetensors")
    for name in ("results.json", "weights.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_a_full_disk_is_reported_with_the_real_path(tmp_path):
    def full_disk(path):
        path.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    target = tmp_path / "lmc_results.json"
    with pytest.raises(WriteError) as caught:
        atomic_write(target, full_disk)
    assert str(caught.value) == f"cannot write {target}: No space left on device"
    assert isinstance(caught.value, OSError)
    assert list(tmp_path.iterdir()) == []  # neither the file nor the temporary one


def test_a_file_in_place_of_a_folder_is_named(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("not a folder")
    target = blocker / "run" / "lmc_results.json"
    with pytest.raises(WriteError, match=f"^cannot write {target}: {blocker} is a file, not a folder$"):
        atomic_write_text(target, "{}")
    with pytest.raises(WriteError, match=f"cannot write into {blocker / 'run'}: {blocker} is a file"):
        check_output_folder(blocker / "run")
    assert check_output_folder(tmp_path / "new" / "folder") == tmp_path / "new" / "folder"
    assert not (tmp_path / "new").exists()  # checking creates nothing


KILLED_WRITER = """
import sys, time
from pathlib import Path
from lmc.io import atomic_output_folder, atomic_write

out = Path(sys.argv[1])
with atomic_output_folder(out / "aligned") as temporary:
    (temporary / "model.safetensors").write_bytes(bytes(4096))

    def write_then_wait(path):
        path.write_text("half")
        print("midway", flush=True)
        time.sleep(600)

    atomic_write(out / "report.json", write_then_wait)
"""


def _writer_at_midway(out) -> subprocess.Popen:
    """A process inside an atomic output folder and an atomic file write, waiting to be killed."""
    root = Path(__file__).parents[1]
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert child.stdout.readline().strip() == "midway"
    return child


def test_the_temporaries_a_kill_leaves_are_removed_by_the_next_write_and_a_live_writers_are_not(tmp_path):
    def temporaries() -> set[str]:
        return {p.name for p in tmp_path.iterdir() if p.name.startswith(".")}

    killed = _writer_at_midway(tmp_path)
    killed.kill()  # SIGKILL: no cleanup runs
    killed.wait()
    left = temporaries()
    assert len(left) == 2 and not (tmp_path / "aligned").exists()  # the folder's and the file's
    running = _writer_at_midway(tmp_path)
    try:
        live = temporaries() - left
        with atomic_output_folder(tmp_path / "aligned") as temporary:
            (temporary / "model.safetensors").write_bytes(bytes(8))
        atomic_write_text(tmp_path / "report.json", "{}")
        assert temporaries() == live  # the killed writer's are gone, the running writer's kept
    finally:
        running.kill()
        running.wait()
    atomic_write_text(tmp_path / "report.json", "{}")
    with atomic_output_folder(tmp_path / "aligned"):
        pass
    assert temporaries() == set() and sorted(p.name for p in tmp_path.iterdir()) == ["aligned", "report.json"]


@pytest.fixture
def weights(tmp_path):
    module = nn.Linear(3, 2)
    path = tmp_path / "good.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in module.state_dict().items()}}, path)
    return path, module.state_dict()


def test_a_good_checkpoint_reads_back(weights):
    path, state = weights
    loaded = read_state_dict(path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_a_truncated_checkpoint_is_named(weights, keep):
    path, _ = weights
    data = path.read_bytes()
    truncated = path.with_name("truncated.ckpt")
    truncated.write_bytes(data[: int(keep * len(data))])
    with pytest.raises(CheckpointError, match=f"^cannot read checkpoint {truncated}: truncated or not a PyTorch") as e:
        read_state_dict(truncated)
    assert "weights_only=False" not in str(e.value)


def test_garbage_is_named_as_not_a_checkpoint(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"hello world garbage")  # torch alone says only "101"
    with pytest.raises(CheckpointError, match=f"^cannot read checkpoint {garbage}: truncated or not a PyTorch"):
        read_state_dict(garbage)


def test_a_checkpoint_holding_code_is_refused_without_unsafe_advice(tmp_path):
    path = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {"weight": torch.zeros(2)}, "callback": _Unsafe()}, path)
    with pytest.raises(CheckpointError, match=f"^checkpoint {path} holds Python objects besides weights") as e:
        read_state_dict(path)
    assert "_Unsafe" in str(e.value) and "weights_only=False" not in str(e.value)


class _Unsafe:
    pass


def test_garbage_safetensors_are_named(tmp_path):
    garbage = tmp_path / "weights.safetensors"
    garbage.write_bytes(os.urandom(64))
    with pytest.raises(CheckpointError, match=f"^cannot read {garbage}: truncated or not a safetensors file"):
        read_state_dict(garbage)
    good = tmp_path / "good.safetensors"
    save_file({"weight": torch.ones(4, 4)}, str(good))
    half = tmp_path / "half.safetensors"
    half.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"^cannot read {half}: truncated or not a safetensors file"):
        read_state_dict(half)


@pytest.mark.parametrize("suffix", [".ckpt", ".safetensors"])
def test_an_empty_file_is_named(tmp_path, suffix):
    empty = tmp_path / f"empty{suffix}"
    empty.touch()
    with pytest.raises(CheckpointError, match=f"^checkpoint {empty} is empty \\(0 bytes\\)"):
        read_state_dict(empty)


def test_a_folder_is_not_called_missing(tmp_path):
    folder = tmp_path / "run.ckpt"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=f"^checkpoint {folder} is a folder: give the .ckpt"):
        read_state_dict(folder)
    with pytest.raises(CheckpointError, match=f"^checkpoint {tmp_path / 'missing.ckpt'} does not exist$"):
        read_state_dict(tmp_path / "missing.ckpt")


def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_files_are_strict_json_and_their_numbers_come_back(tmp_path):
    """summary.json and lmc_results.json used to hold bare NaN (a ratio without a naive barrier): not JSON."""
    import math

    import numpy as np

    from lmc.io import atomic_write_json, nan_for_null

    data = {"ratio": float("nan"), "curve": [float("inf"), 0.5, -float("inf")], "scalar": np.float64(0.25), "n": 3}
    path = atomic_write_json(tmp_path / "summary.json", data)
    written = _strict(path.read_text())
    assert written == {"ratio": None, "curve": [None, 0.5, None], "scalar": 0.25, "n": 3}
    back = nan_for_null(written)
    assert math.isnan(back["ratio"]) and back["curve"][1:2] == [0.5] and back["n"] == 3
    assert all(math.isnan(value) for value in (back["curve"][0], back["curve"][2]))
