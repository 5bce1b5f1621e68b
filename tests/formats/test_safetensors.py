"""Safetensors checkpoints read with plain file reads: the same tensors as safetensors' own reader, one copy."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmc.checkpoints import CheckpointError
from lmc.formats.safetensors import STORED_DTYPES, SafetensorsCheckpoint


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(7, 3, 5, generator=generator, dtype=torch.float64)
    tensors = {f"{dtype}".removeprefix("torch."): floats.to(dtype) for dtype in STORED_DTYPES.values()}
    tensors["int64"] = torch.randint(-(2**40), 2**40, (9, 4), generator=generator)
    tensors["bool"] = torch.rand(6, 2, generator=generator) > 0.5
    tensors["scalar"] = torch.tensor(3.25, dtype=torch.bfloat16)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.float32)
    return tensors


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_rows_are_the_bytes_safetensors_reads_for_every_dtype_and_slice(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    shards = [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"]
    save_file({n: tensors[n] for n in names[::2]}, shards[0])
    save_file({n: tensors[n] for n in names[1::2]}, shards[1])
    checkpoint = SafetensorsCheckpoint(tmp_path, shards)
    for name in names:
        shard = shards[names.index(name) % 2]
        with safe_open(str(shard), framework="pt") as handle:
            whole = handle.get_tensor(name)
            stored = checkpoint[name]
            assert stored.dtype == whole.dtype and stored.shape == whole.shape
            assert torch.equal(_bits(stored), _bits(whole)), name
            if whole.dim() and len(whole):
                for begin, end in ((0, 1), (1, len(whole) - 1), (len(whole) - 1, len(whole)), (2, 2)):
                    expected = handle.get_slice(name)[begin:end]
                    assert torch.equal(_bits(checkpoint.rows(name, begin, end)), _bits(expected)), (name, begin)
    # A tensor saved under another name reads alike under the parameter's.
    view = checkpoint.renamed({"weight": "float32"})
    assert torch.equal(view["weight"], tensors["float32"]) and "float32" not in view
    # Rows beyond the end are cut off, as a slice of the tensor would be.
    assert torch.equal(checkpoint.rows("int64", 3, 100), tensors["int64"][3:100])
    assert torch.equal(checkpoint.rows("int64", 7, 5), tensors["int64"][7:5])


def test_a_header_that_disagrees_with_its_bytes_or_a_short_file_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4), "v": torch.ones(2)}, path)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["w"]["shape"] = [4, 5]  # 80 bytes where the offsets hold 64
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    with pytest.raises(CheckpointError, match="cannot read w from .*model.safetensors: truncated or corrupted"):
        SafetensorsCheckpoint(tmp_path, [path])["w"]
    save_file({"w": torch.ones(4, 4), "v": torch.ones(2)}, path)
    path.write_bytes(path.read_bytes()[:-4])  # the last tensor's last bytes are gone
    checkpoint = SafetensorsCheckpoint(tmp_path, [path])
    last = max(checkpoint.entries, key=lambda n: checkpoint.entries[n].offsets)
    with pytest.raises(
        CheckpointError, match=f"cannot read {last} from .*: truncated or corrupted .the file ends early"
    ):
        checkpoint[last]


# Reading a 256 MB tensor in a fresh interpreter: the peak RSS grows by the tensor, once. A memory map
# would add the pages it touched (file-backed, but resident and counted) and a copy out of it a second.
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from lmc.formats.safetensors import SafetensorsCheckpoint
    from pathlib import Path

    def peak():
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    path = Path(sys.argv[1])
    checkpoint = SafetensorsCheckpoint(path.parent, [path])
    checkpoint["small"]  # warm-up: the first read's own allocations
    before = peak()
    tensor = checkpoint["big"]
    print(json.dumps({"growth": peak() - before, "bytes": tensor.numel() * tensor.element_size()}))
    """
)


def test_a_read_holds_one_copy_of_the_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"big": torch.ones(8192, 8192, dtype=torch.float32), "small": torch.ones(8)}, path)
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path)], capture_output=True, text=True, check=True)
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["bytes"] == 8192 * 8192 * 4
    assert measured["growth"] < 1.15 * measured["bytes"], measured
