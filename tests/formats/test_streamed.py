"""Streamed alignment of save_pretrained folders (lmc.checkpoint_alignment.align_directories) equals align()."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import lmc.formats.streamed
import lmc.matching.streamed
import lmc.matching.streamed_write
from lmc.adapters import adapter_for, model_spec
from lmc.checkpoint_alignment import align_directories
from lmc.formats import timm_files
from lmc.matching import PROBE_RTOL, AlignmentError, align
from lmc.matching.merge import interpolate
from lmc.models import create_model, randomize_parameters_
from tests.formats.checkpoints import ADDED_FAMILIES, HF_MODELS, at_every_scope, fine_tuned_pair

ROOT = Path(__file__).parents[2]


def save(model: nn.Module, folder: Path, sharded: bool) -> Path:
    """A ``save_pretrained`` folder of a Hugging Face model, or timm's folder layout of a timm model."""
    if is_timm(model):
        assert not sharded, "timm folders hold one model.safetensors"
        timm_files.save_model(model, folder)
        return folder
    model.save_pretrained(folder, max_shard_size="20KB" if sharded else "1GB")
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    return folder


def load(like: nn.Module, folder: Path, dtype: torch.dtype) -> nn.Module:
    if is_timm(like):
        return timm_files.load_model(folder)
    return type(like).from_pretrained(folder, dtype=dtype).eval()


def is_timm(model: nn.Module) -> bool:
    return type(model).__module__.startswith("timm.")


def outputs(model: nn.Module) -> torch.Tensor:
    adapter = adapter_for(model)
    with torch.no_grad():
        return adapter.forward(model, adapter.example_inputs(model, 3, torch.Generator().manual_seed(7))).double()


CASES = [
    ("llama-tiny", torch.bfloat16, True, "all_attention"),
    ("llama-tiny", torch.float32, False, "first_block"),
    ("gpt2-tiny", torch.float32, True, "first_block"),
    ("gpt2-tiny", torch.bfloat16, False, "all_attention"),
    ("bert-tiny", torch.float32, False, "first_block"),
    ("bert-tiny", torch.bfloat16, True, "first_attention"),
    ("roformer-tiny", torch.float32, True, "all_attention"),
    ("roformer-tiny", torch.bfloat16, False, "first_block"),
    ("vit-tiny", torch.float32, False, "first_block"),
    ("qwen3-tiny", torch.float32, True, "first_attention"),  # q_norm, k_norm in the scope, moved by nothing
    ("gemma-tiny", torch.float32, False, "first_block"),  # tied head
    ("phi3-tiny", torch.float32, True, "first_block"),  # fused [Q | K | V] blocks and [gate | up]
    ("bert-pretraining-tiny", torch.float32, True, "first_block"),  # MultiBERTs' heads, outside the scope
    ("bert-mlm-tiny", torch.bfloat16, False, "all_attention"),
    ("gpt-neox-tiny", torch.float32, True, "first_block"),  # embed_out.weight in the files is lm_head.weight
    ("gpt-neox-tiny", torch.bfloat16, False, "all_attention"),
    ("rope-vit-tiny", torch.bfloat16, False, "all_attention"),
    ("hf-vit-tiny", torch.float32, True, "first_block"),  # transformers' ViT, not timm's
    ("hf-vit-tiny", torch.bfloat16, False, "all_attention"),
    # Every tensor moves with the residual permutation: the coordinate descent over a view of the files.
    ("llama-tiny", torch.bfloat16, True, "full_model"),
    ("gpt2-tiny", torch.float32, False, "full_model"),
    ("bert-tiny", torch.float32, True, "full_model"),  # the pooler's hidden units: a task head
    ("roformer-tiny", torch.float32, False, "full_model"),  # no residual symmetry (a sinusoidal table)
    ("vit-tiny", torch.bfloat16, False, "full_model"),
    ("qwen2-tiny", torch.float32, True, "full_model"),
    ("mistral-tiny", torch.float32, False, "full_model"),
    ("olmo2-tiny", torch.float32, True, "all_attention"),  # full-width q_norm, k_norm: slices move with the heads
    ("olmo2-tiny", torch.bfloat16, False, "full_model"),  # sublayer output norms only: the stream reads raw
    ("gemma2-tiny", torch.float32, False, "full_model"),  # sublayer output norms on the stream
    ("bert-pretraining-tiny", torch.float32, False, "full_model"),  # the pooler's units with the NSP head
    ("hf-vit-tiny", torch.float32, False, "full_model"),  # the class token and patch projection on the stream
]


@pytest.mark.parametrize(("name", "dtype", "sharded", "scope"), CASES)
def test_streamed_alignment_equals_align_in_memory(tmp_path, name, dtype, sharded, scope):
    check_streamed_equals_in_memory(tmp_path, name, {}, dtype, sharded, scope)


@pytest.mark.parametrize(("key", "scope"), at_every_scope(ADDED_FAMILIES))
def test_every_added_family_streams_a_sharded_bf16_folder_at_every_scope(tmp_path, key, scope):
    # Both residual forms of GPT-NeoX, both BERT heads: the streamed reader sees each layout's own tensors.
    check_streamed_equals_in_memory(tmp_path, *HF_MODELS[key], torch.bfloat16, True, scope)


def check_streamed_equals_in_memory(
    tmp_path: Path, name: str, overrides: dict, dtype: torch.dtype, sharded: bool, scope: str
) -> None:
    """Align a fine-tuned pair of zoo model ``name`` streamed and in memory: the same solves, the same weights."""
    source, target = fine_tuned_pair(name, overrides, scope, dtype)
    source_dir, target_dir = save(source, tmp_path / "source", sharded), save(target, tmp_path / "target", False)

    report = align_directories(source_dir, target_dir, tmp_path / "out", scope, merge_alphas=[0.5, 1])
    aligned, expected = align(source, target, scope)

    # The same per-layer solves: every layer's assignments and distances, FFNs included.
    assert [(layer.name, layer.kind) for layer in report.layers] == [(e.name, e.kind) for e in expected.layers]
    assert any(layer.kind == "feed_forward" for layer in report.layers) == (scope in ("first_block", "full_model"))
    for layer, in_memory in zip(report.layers, expected.layers):
        assert layer.assignment == in_memory.assignment, layer.name
        assert layer.kv_assignment == in_memory.kv_assignment, layer.name
        assert layer.distance.keys() == in_memory.distance.keys(), layer.name
        for stage, distance in layer.distance.items():
            assert distance == pytest.approx(in_memory.distance[stage], rel=1e-12), (layer.name, stage)
    assert report.distance == pytest.approx(expected.distance, rel=1e-12)
    assert report.distance["aligned"] < report.distance["naive"]
    assert 0 < report.probe_relative_error <= PROBE_RTOL[dtype]
    written = load(source, tmp_path / "out" / "aligned", dtype)
    aligned_weights, target_weights = aligned.state_dict(), target.state_dict()
    for parameter_name, value in written.state_dict().items():
        assert value.dtype == aligned_weights[parameter_name].dtype
        assert torch.equal(value, aligned_weights[parameter_name]), parameter_name
    reference = outputs(source)
    assert float((outputs(written) - reference).norm() / reference.norm()) <= PROBE_RTOL[dtype]
    merged = load(source, tmp_path / "out" / "merged_0.5", dtype).state_dict()
    for parameter_name, value in merged.items():
        lerped = interpolate(target_weights[parameter_name], aligned_weights[parameter_name], 0.5)
        assert torch.equal(value, lerped), parameter_name
    end_point = load(source, tmp_path / "out" / "merged_1", dtype).state_dict()
    assert all(torch.equal(end_point[k], v) for k, v in written.state_dict().items())
    # Sharded like the source, with its index and config; the report beside them.
    assert sorted(p.name for p in (tmp_path / "out" / "aligned").iterdir()) == sorted(
        p.name for p in source_dir.iterdir()
    )
    document = json.loads((tmp_path / "out" / "report.json").read_text())
    assert document["alignment"]["scope"] == scope and document["format"] == (
        "timm" if is_timm(source) else "huggingface"
    )
    written_check = document["checks"]["written_and_read_back"]
    assert 0 < written_check["relative_output_change"] <= written_check["rtol"] == PROBE_RTOL[dtype]


def test_a_planted_pair_is_recovered_exactly(tmp_path):
    from lmc.adapters import random_symmetry

    source = randomize_parameters_(create_model("llama-tiny", dtype=torch.float64, attention_bias=True), seed=0)
    target = random_symmetry(source, scope="all_attention", seed=3)
    report = align_directories(
        save(source, tmp_path / "s", True), save(target, tmp_path / "t", True), tmp_path / "out", "all_attention"
    )
    # Float64 rounding only: 2.7e-16 of the naive distance; entries of at most 2.3 off by 7.8e-16 (measured).
    assert report.distance["aligned"] < 1e-12 * report.distance["naive"]
    written = type(source).from_pretrained(tmp_path / "out" / "aligned", dtype=torch.float64).state_dict()
    for parameter_name, value in target.state_dict().items():
        torch.testing.assert_close(written[parameter_name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "group"), [("llama-tiny", "each"), ("gpt-neox-tiny", "global")])
def test_a_planted_pair_with_residual_signs_is_recovered_exactly(tmp_path, name, group):
    from lmc.adapters import apply_transform
    from lmc.symmetry import sample_transform

    source = randomize_parameters_(create_model(name, dtype=torch.float64), seed=0)
    spec = model_spec(source)
    assert spec.residual.signs == group
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(3))
    flips = torch.ones(spec.residual.size, dtype=torch.float64)
    flips[::2] = -1.0 if group == "each" else 1.0
    transform.residual_signs = flips if group == "each" else -flips
    target = apply_transform(source, transform, spec)

    report = align_directories(
        save(source, tmp_path / "s", True), save(target, tmp_path / "t", False), tmp_path / "out", "full_model"
    )

    assert report.distance["aligned"] < 1e-12 * report.distance["naive"]
    (residual,) = [layer for layer in report.layers if layer.kind == "residual"]
    assert residual.flipped == int((transform.residual_signs < 0).sum())
    written = type(source).from_pretrained(tmp_path / "out" / "aligned", dtype=torch.float64).state_dict()
    for parameter_name, value in target.state_dict().items():
        torch.testing.assert_close(written[parameter_name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-neox-tiny", "phi3-tiny"])
def test_the_extended_group_streams_as_in_memory(tmp_path, name):
    """residual='orthogonal' with unit scales on two folders: both read folded (FoldedCheckpoint), the rotation
    found as in memory, the written model the folded source transformed; a planted rotated, scaled twin comes back
    to the folded target (O(d) for Llama and Phi-3's fused [gate | up], O(d-1) x Z2 for GPT-NeoX's LayerNorms)."""
    from lmc.adapters import apply_transform, fold_norms
    from lmc.matching import AlignOptions
    from lmc.symmetry import residual_group, sample_transform

    source = randomize_parameters_(create_model(name, dtype=torch.float64), seed=0)
    spec = model_spec(source)
    transform = sample_transform(spec, "full_model", torch.Generator().manual_seed(3), rotate=True, scale=True)
    twin = apply_transform(fold_norms(source), transform, spec)
    options = AlignOptions(residual="orthogonal", unit_scales=spec.blocks[0].feed_forward.scales is not None)

    report = align_directories(
        save(twin, tmp_path / "s", True), save(source, tmp_path / "t", False), tmp_path / "out", "full_model",
        options, merge_alphas=[0.5],
    )  # fmt: skip
    _, expected = align(twin, source, "full_model", options)

    assert report.residual_group == expected.residual_group == residual_group(spec).name
    assert report.folded == expected.folded and report.folded
    assert report.distance["aligned"] < 1e-10 * report.distance["naive"]
    assert report.distance == pytest.approx(expected.distance, rel=1e-6, abs=1e-9)
    written = type(source).from_pretrained(tmp_path / "out" / "aligned", dtype=torch.float64).state_dict()
    merged = type(source).from_pretrained(tmp_path / "out" / "merged_0.5", dtype=torch.float64).state_dict()
    folded = fold_norms(source).state_dict()
    for parameter_name, value in folded.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(written[parameter_name], value, rtol=0, atol=1e-10 * scale)
        torch.testing.assert_close(merged[parameter_name], value, rtol=0, atol=1e-10 * scale)


def test_register_tokens_with_their_position_rows_are_streamed_like_in_memory(tmp_path):
    from lmc.adapters import apply_transform, model_spec
    from lmc.symmetry import sample_transform

    source = randomize_parameters_(create_model("vit-tiny", dtype=torch.float64, reg_tokens=3), seed=0)
    spec = model_spec(source)
    planted = sample_transform(spec, "full_model", torch.Generator().manual_seed(5))
    planted.tokens = torch.tensor([1, 2, 0])  # rows 1-3 of pos_embed move with them, row 0 is the class token's
    target = apply_transform(source, planted, spec)
    report = align_directories(
        save(source, tmp_path / "s", False), save(target, tmp_path / "t", False), tmp_path / "out", "full_model"
    )
    _, expected = align(source, target, "full_model")
    assert [(layer.name, layer.kind, layer.assignment) for layer in report.layers] == [
        (e.name, e.kind, e.assignment) for e in expected.layers
    ]
    assert torch.equal(report.transform.tokens, planted.tokens)
    written = load(source, tmp_path / "out" / "aligned", torch.float64).state_dict()
    for parameter_name, value in target.state_dict().items():  # float64 rounding only
        torch.testing.assert_close(written[parameter_name], value, rtol=0, atol=1e-12)


def _pythia_config(folder: Path) -> None:
    """Rewrite a GPT-NeoX folder's config.json as the Pythia checkpoints on the Hub have it (transformers 4.24)."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    config.update(torch_dtype=config.pop("dtype"), transformers_version="4.24.0")
    (folder / "config.json").write_text(json.dumps(config))


def test_gpt_neox_folders_are_read_by_parameter_name(tmp_path):
    """Pythia's files store lm_head.weight as embed_out.weight: read under its name, written back under the file's."""
    from lmc.adapters import random_symmetry

    source = randomize_parameters_(create_model("gpt-neox-tiny", dtype=torch.float64), seed=0)
    target = random_symmetry(source, scope="first_block", seed=3)
    source_dir, target_dir = save(source, tmp_path / "s", True), save(target, tmp_path / "t", False)
    for folder in (source_dir, target_dir):
        _pythia_config(folder)
    assert lmc.formats.streamed.skeleton(source_dir).config.rope_parameters["partial_rotary_factor"] == 0.5
    report = align_directories(source_dir, target_dir, tmp_path / "out", "first_block")
    # Float64 rounding only (measured 3e-16 of the naive distance).
    assert report.distance["aligned"] < 1e-12 * report.distance["naive"]
    index = json.loads((tmp_path / "out" / "aligned" / "model.safetensors.index.json").read_text())
    assert "embed_out.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    written = type(source).from_pretrained(tmp_path / "out" / "aligned", dtype=torch.float64).state_dict()
    for parameter_name, value in target.state_dict().items():
        torch.testing.assert_close(written[parameter_name], value, rtol=0, atol=1e-12)

    with torch.no_grad():
        target.lm_head.weight[0, 0] += 1.0  # outside the scope, under its file name
    save(target, tmp_path / "t2", False)
    with pytest.raises(AlignmentError, match="everything else must be identical, but lm_head.weight differs"):
        align_directories(source_dir, tmp_path / "t2", tmp_path / "out2", "first_block")


def store_head(folder: Path, apart: bool) -> None:
    """Store ``lm_head.weight`` in a folder whose config ties it, as many exported checkpoints do: a copy of
    the embedding, or (``apart``) other values."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in state
    embedding = next(value for name, value in state.items() if name.endswith(("wte.weight", "embed_tokens.weight")))
    noise = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0)).to(embedding.dtype)
    state["lm_head.weight"] = embedding + 0.1 * noise if apart else embedding.clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("apart", [False, True], ids=["stored-equal", "stored-apart"])
@pytest.mark.parametrize(
    ("name", "overrides"),
    [("gemma2-tiny", {}), ("qwen3-tiny", {"tie_word_embeddings": True}), ("gpt2-tiny", {})],
)
def test_a_stored_head_of_a_tied_config_is_aligned_as_from_pretrained_loads_it(tmp_path, name, overrides, apart):
    # from_pretrained ties a stored copy of the embedding, and loads a head stored apart untied: either way the
    # aligned folder, loaded so, computes the source's function and equals the alignment of the loaded models.
    source, target = fine_tuned_pair(name, overrides, "full_model")
    assert source.config.tie_word_embeddings
    folders = [save(model, tmp_path / role, False) for model, role in ((source, "source"), (target, "target"))]
    for folder in folders:
        store_head(folder, apart)
    loaded = [load(source, folder, torch.float32) for folder in folders]
    assert (loaded[0].lm_head.weight is not loaded[0].get_input_embeddings().weight) == apart

    report = align_directories(*folders, tmp_path / "out", "full_model")
    aligned, expected = align(*loaded, "full_model")
    # Rounding only: with the files' tensors in save_file's order, not save_pretrained's, the sums run in another
    # order (Stage 2's V/O solves of gemma2-tiny differ by 1e-7, a head stored or not).
    assert report.distance == pytest.approx(expected.distance, rel=1e-9)
    written = load(source, tmp_path / "out" / "aligned", torch.float32)
    assert written.state_dict().keys() == aligned.state_dict().keys()
    for key, value in aligned.state_dict().items():
        torch.testing.assert_close(written.state_dict()[key], value, msg=key)
    reference = outputs(loaded[0])
    assert float((outputs(written) - reference).norm() / reference.norm()) <= PROBE_RTOL[torch.float32]


def test_a_head_stored_tied_in_one_folder_and_apart_in_the_other_is_refused(tmp_path):
    source, target = fine_tuned_pair("gemma-tiny", {}, "full_model")
    folders = [save(model, tmp_path / role, False) for model, role in ((source, "source"), (target, "target"))]
    store_head(folders[1], apart=True)
    with pytest.raises(lmc.checkpoints.CheckpointError, match="loads one model tied and the other untied"):
        align_directories(*folders, tmp_path / "out", "full_model")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def llama_pair(tmp_path) -> tuple[Path, Path]:
    source, target = fine_tuned_pair("llama-tiny", {}, "all_attention", torch.float32)
    return save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)


def test_a_failure_midway_leaves_no_output(tmp_path, llama_pair, monkeypatch):
    written = []

    def failing_write(handle, tensor):
        written.append(tensor)
        if len(written) == 7:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(lmc.matching.streamed_write, "write_tensor", failing_write)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(OSError, match="No space left"):
        align_directories(*llama_pair, tmp_path / "out", "all_attention", merge_alphas=[0.5])
    assert sorted(os.listdir(tmp_path)) == before  # neither the output nor its temporary folder


def test_existing_output_is_replaced_only_when_asked_and_only_when_complete(tmp_path, llama_pair, monkeypatch):
    output = tmp_path / "out"
    (output / "aligned").mkdir(parents=True)  # an earlier alignment's outputs
    (output / "aligned" / "old.txt").write_text("old")
    (output / "report.json").write_text("old")
    with pytest.raises(ValueError, match="already exist"):
        align_directories(*llama_pair, output, "all_attention")
    monkeypatch.setattr(lmc.matching.streamed_write, "write_tensor", lambda handle, tensor: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        align_directories(*llama_pair, output, "all_attention", overwrite=True)
    assert sorted(os.listdir(output)) == ["aligned", "report.json"]
    assert os.listdir(output / "aligned") == ["old.txt"] and (output / "report.json").read_text() == "old"
    monkeypatch.undo()
    align_directories(*llama_pair, output, "all_attention", overwrite=True)
    assert sorted(os.listdir(output)) == ["aligned", "report.json"]
    assert "old.txt" not in os.listdir(output / "aligned")
    assert sorted(os.listdir(tmp_path)) == ["out", "source", "target"]


def test_bad_pairs_and_outputs_are_refused(tmp_path, llama_pair):
    source_dir, target_dir = llama_pair
    with pytest.raises(AlignmentError, match="everything else must be identical, but model.layers.1"):
        align_directories(source_dir, target_dir, tmp_path / "out", "first_attention")
    with pytest.raises(ValueError, match="would replace an input"):
        align_directories(source_dir, target_dir, source_dir / "aligned", "all_attention")
    with pytest.raises(ValueError, match=r"merge alphas must lie in \[0, 1\]"):
        align_directories(source_dir, target_dir, tmp_path / "out", "all_attention", merge_alphas=[1.5])
    other = save(create_model("llama-tiny", hidden_size=64), tmp_path / "wider", False)
    with pytest.raises(lmc.checkpoints.CheckpointError, match="different models: head_dim is 8"):
        align_directories(source_dir, other, tmp_path / "out", "all_attention")
    with pytest.raises(lmc.checkpoints.CheckpointError, match="neither a Hugging Face model directory"):
        align_directories(source_dir, tmp_path, tmp_path / "out", "all_attention")
    assert sorted(os.listdir(tmp_path)) == ["source", "target", "wider"]


def test_non_finite_weights_are_refused(tmp_path, llama_pair):
    source_dir, target_dir = llama_pair
    model = type(create_model("llama-tiny")).from_pretrained(source_dir)
    with torch.no_grad():
        model.model.norm.weight[0] = torch.nan
    save(model, tmp_path / "nan", False)
    with pytest.raises(AlignmentError, match="model.norm.weight holds NaN or Inf"):
        align_directories(tmp_path / "nan", target_dir, tmp_path / "out", "all_attention")


# The memory bound: a bf16 Llama of ~57 M parameters (113 MB, 16 layers of width 512) is aligned in a
# fresh interpreter, after a warm-up on a one-layer pair that loads every library the alignment
# touches. At all_attention the growth of the peak RSS must stay under a quarter of ONE model, where
# loading both models whole would add twice a model. Unless the third argument is "default-chunks",
# chunks are shrunk to 1 MB (and the float32 and float64 pieces of correlations and distances to 2^18
# entries) so that the embeddings and FFN matrices are copied in pieces, as an 8B model's are.
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import lmc.formats.safetensors, lmc.matching.permutation
    from lmc.matching import AlignOptions
    from lmc.checkpoint_alignment import align_directories

    def peak():  # VmHWM: ru_maxrss would start at the parent's resident memory when it forked us
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    if sys.argv[3] != "default-chunks":
        lmc.formats.safetensors.CHUNK_BYTES = 1 << 20
        lmc.matching.permutation.CHUNK_ENTRIES = 1 << 18
    root, scope, options = sys.argv[1], sys.argv[2], AlignOptions(method="orthogonal")
    align_directories(f"{root}/warm-source", f"{root}/warm-target", f"{root}/warm-out", scope, options)
    before = peak()
    report = align_directories(f"{root}/big-source", f"{root}/big-target", f"{root}/big-out", scope, options)
    after = peak()
    print(json.dumps({"before": before, "growth": after - before, "layers": len(report.layers)}))
    """
)


def write_random_llama_pair(
    root: Path,
    name: str,
    layers: int,
    differ: str = "self_attn",
    vocab_size: int = 8192,
    intermediate_size: int = 1536,
) -> int:
    """``root/<name>-source`` and ``-target``: bf16 Llamas of width 512 differing in the tensors whose names
    hold ``differ`` (``""``: independent models); returns one's bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=512, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=intermediate_size, vocab_size=vocab_size, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(layers)
    folders = [root / f"{name}-source", root / f"{name}-target"]
    for folder in folders:
        config.save_pretrained(folder)
    state = {
        n: (torch.randn(p.shape, generator=generator) * 0.05).bfloat16()
        for n, p in lmc.formats.streamed.skeleton(folders[0]).named_parameters()
    }
    save_file(state, folders[0] / "model.safetensors", metadata={"format": "pt"})
    for n in state:
        if differ in n:
            state[n] = (torch.randn(state[n].shape, generator=generator) * 0.05).bfloat16()
    save_file(state, folders[1] / "model.safetensors", metadata={"format": "pt"})
    return sum(v.numel() * v.element_size() for v in state.values())


def peak_growth(root: Path, scope: str, chunks: str = "small-chunks") -> dict:
    # A fixed mmap threshold makes glibc hand every freed block of 64 KB or more back at once, so the
    # peak measures what the alignment holds rather than the allocator's slack (measured: 4 to 80 MB
    # without it, run to run, on the same full_model pair; 14 MB with it, three runs alike).
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(root), scope, chunks],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


RELEASE_SCRIPT = textwrap.dedent(
    """
    import json, re
    from pathlib import Path

    import torch

    from lmc.matching.streamed import release_freed_memory

    def resident():
        return int(re.search(r"RssAnon:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

    start = resident()
    kept = []
    for layer in range(8):  # a streamed layer's pattern: 8-32 MB tensors and a 117 MB one freed, a small one kept
        freed = [torch.ones(1024 * 4096) for _ in range(4)] + [torch.ones(4096 * 4096, dtype=torch.bfloat16)] * 4
        freed.append(torch.ones(14336 * 4096, dtype=torch.bfloat16))
        kept.append(torch.ones(128 * 128 * 8))
        del freed
    before = resident()
    release_freed_memory()
    print(json.dumps({"kept": before - start, "released": before - resident()}))
    """
)


@pytest.mark.skipif(lmc.matching.streamed._MALLOC_TRIM is None, reason="glibc's malloc_trim (Linux)")
def test_the_memory_freed_between_steps_is_handed_back():
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    kept = 8 * 128 * 128 * 8 * 4  # the small tensors still held: 4 MB
    # glibc keeps the freed 8-32 MB blocks resident (measured: 68 MB); released, at most the kept ones stay.
    assert measured["kept"] > 8 * kept, measured
    assert measured["kept"] - measured["released"] < 4 * kept, measured


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
def test_streamed_alignment_stays_far_below_two_models_in_memory(tmp_path):
    write_random_llama_pair(tmp_path, "warm", 1)
    model_bytes = write_random_llama_pair(tmp_path, "big", 16)
    measured = peak_growth(tmp_path, "all_attention")
    assert measured["layers"] == 16
    assert measured["growth"] < model_bytes / 4, measured  # loading both whole adds 2 * model_bytes
    with safe_open(str(tmp_path / "big-out" / "aligned" / "model.safetensors"), framework="pt") as handle:
        assert len(list(handle.keys())) == 16 * 9 + 3


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
def test_a_whole_model_pair_is_aligned_under_a_bound_that_two_loaded_models_exceed(tmp_path):
    # Independent models: every tensor differs and moves (residual, FFN units, heads). The bound is a
    # quarter of ONE model (measured: 14 MB of 113 MB); loading both whole would add twice a model.
    # The warm-up pair has a small vocabulary, so that its peak stays below what the big pair needs.
    write_random_llama_pair(tmp_path, "warm", 1, differ="", vocab_size=256)
    model_bytes = write_random_llama_pair(tmp_path, "big", 16, differ="")
    measured = peak_growth(tmp_path, "full_model")
    assert measured["layers"] == 2 * 16 + 1  # every FFN, the residual stream, every attention layer
    assert 0 < measured["growth"] < model_bytes / 4, measured
    with safe_open(str(tmp_path / "big-out" / "aligned" / "model.safetensors"), framework="pt") as handle:
        assert len(list(handle.keys())) == 16 * 9 + 3


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
def test_a_whole_model_pair_with_a_large_vocabulary_reads_its_embeddings_in_blocks_of_rows(tmp_path):
    # At the library's own chunk sizes, one layer and a 131,072-token vocabulary: the embedding and the
    # LM head are 97% of the model (268 MB of 276 MB bf16). Beyond the warm-up pair's peak (the FFN's
    # float32 correlation, 2048 units: 17 MB, is in both) full_model adds a few blocks of rows of the
    # embeddings and pieces of the write pass: measured 35 MB. Reading the embeddings whole for the
    # residual correlation and distances, and pieces of 64 MB in the write pass, added 570 MB (2.1 models);
    # holding the previous write piece of each tensor while reading the next, and 32 MB float64
    # differences for the distances, added 84 MB.
    write_random_llama_pair(tmp_path, "warm", 1, differ="", vocab_size=256, intermediate_size=2048)
    model_bytes = write_random_llama_pair(tmp_path, "big", 1, differ="", vocab_size=1 << 17, intermediate_size=2048)
    measured = peak_growth(tmp_path, "full_model", "default-chunks")
    assert measured["layers"] == 2 + 1  # the FFN, the residual stream, the attention layer
    assert 0 < measured["growth"] < model_bytes / 4, measured


# A streamed alignment killed (SIGKILL, no cleanup runs) once it has written part of the output.
KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import lmc.matching.streamed_write
    from lmc.checkpoint_alignment import align_directories

    write, count = lmc.matching.streamed_write.write_tensor, [0]

    def write_then_wait(handle, tensor):
        write(handle, tensor)
        count[0] += 1
        if count[0] == 20:
            handle.flush()
            print("midway", flush=True)
            time.sleep(600)

    lmc.matching.streamed_write.write_tensor = write_then_wait
    align_directories(sys.argv[1], sys.argv[2], sys.argv[3], "full_model", merge_alphas=[0.5])
    """
)


def test_a_kill_midway_leaves_no_half_written_output(tmp_path):
    source, target = (randomize_parameters_(create_model("llama-tiny"), seed=seed) for seed in (0, 1))
    source_dir, target_dir = save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(source_dir), str(target_dir), str(tmp_path / "out")],
        stdout=subprocess.PIPE, text=True, env=environment, cwd=ROOT,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "midway"
        temporary = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
        assert len(temporary) == 1 and any(p.stat().st_size for p in (temporary[0] / "aligned").iterdir())
    finally:
        child.kill()
        child.wait()
    assert not (tmp_path / "out").exists()  # only the hidden temporary folder, never a partial output
    report = align_directories(source_dir, target_dir, tmp_path / "out", "full_model")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # the rerun removed the killed one's
    aligned, expected = align(source, target, "full_model")
    assert report.distance == pytest.approx(expected.distance, rel=1e-12)
    written = load(source, tmp_path / "out" / "aligned", torch.float32).state_dict()
    assert all(torch.equal(written[name], value) for name, value in aligned.state_dict().items())


def test_a_corrupted_shard_is_named(tmp_path, llama_pair):
    source_dir, target_dir = llama_pair
    shard = sorted(source_dir.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # the header survives, the data does not
    with pytest.raises(lmc.checkpoints.CheckpointError, match=f"{shard.name}: truncated or corrupted"):
        align_directories(source_dir, target_dir, tmp_path / "out", "all_attention")
    assert not (tmp_path / "out").exists()


def test_tensors_moved_a_chunk_at_a_time_equal_the_in_memory_alignment(tmp_path, monkeypatch):
    # Tiny chunks: the embeddings and LM head are written a few rows at a time, the correlations and
    # distances summed over pieces of 64 entries, as an 8B model's are. In memory sums the same pieces.
    import lmc.formats.safetensors
    import lmc.matching.permutation

    monkeypatch.setattr(lmc.formats.safetensors, "CHUNK_BYTES", 1 << 10)
    monkeypatch.setattr(lmc.matching.permutation, "CHUNK_ENTRIES", 64)
    source, target = (randomize_parameters_(create_model("llama-tiny"), seed=seed) for seed in (0, 1))
    source_dir, target_dir = save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)
    report = align_directories(source_dir, target_dir, tmp_path / "out", "full_model", merge_alphas=[0.5])
    aligned, expected = align(source, target, "full_model")
    assert [layer.assignment for layer in report.layers] == [layer.assignment for layer in expected.layers]
    assert report.distance == pytest.approx(expected.distance, rel=1e-12)
    written = load(source, tmp_path / "out" / "aligned", torch.float32).state_dict()
    assert all(torch.equal(written[name], value) for name, value in aligned.state_dict().items())
    merged, target_weights = (
        load(source, tmp_path / "out" / "merged_0.5", torch.float32).state_dict(),
        target.state_dict(),
    )
    for name, value in aligned.state_dict().items():
        assert torch.equal(merged[name], interpolate(target_weights[name], value, 0.5)), name


def test_a_descent_round_reads_each_tensor_once_from_each_model_an_ffn_twice(tmp_path, monkeypatch):
    # A block's head and residual steps share one read (in memory's order in effect, the alignment above
    # equal to align's); its FFN is read once more, one pair at a time into its units' correlation, so
    # that the correlation is never held beside the whole FFN of both models.
    from collections import Counter

    import lmc.formats.safetensors

    rows, descent_round = (
        lmc.formats.safetensors.SafetensorsCheckpoint.rows,
        lmc.matching.streamed._StreamedDescent.descent_round,
    )
    reads, rounds = Counter(), []

    def counted(checkpoint, name, start, stop):
        if rounds and rounds[-1] is None:
            reads[len(rounds), checkpoint.folder.name, name] += 1
        return rows(checkpoint, name, start, stop)

    def watched(descent, *args):
        rounds.append(None)
        try:
            return descent_round(descent, *args)
        finally:
            rounds[-1] = True

    monkeypatch.setattr(lmc.formats.safetensors.SafetensorsCheckpoint, "rows", counted)
    monkeypatch.setattr(lmc.matching.streamed._StreamedDescent, "descent_round", watched)
    source, target = (randomize_parameters_(create_model("llama-tiny"), seed=seed) for seed in (0, 1))
    source_dir, target_dir = save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)
    align_directories(source_dir, target_dir, tmp_path / "out", "full_model")
    stored = set(source.state_dict())
    feed_forward = {name for block in model_spec(source).blocks for name, _ in block.feed_forward.hidden.axes}
    assert len(rounds) >= 2 and feed_forward < stored
    for round_number in range(1, len(rounds) + 1):
        for folder in ("source", "target"):
            counts = {name: reads[round_number, folder, name] for name in stored}
            assert counts == {name: 2 if name in feed_forward else 1 for name in stored}, (round_number, folder)
    assert len(reads) == 2 * len(rounds) * len(stored)  # nothing else read in a round


def test_an_ffn_step_holds_one_tensor_pair_while_correlating_and_none_while_assigning(tmp_path, monkeypatch):
    # The correlation of an FFN's units is its step's largest allocation (822 MB at 8B widths): beside it
    # the streamed view keeps at most one tensor of the other model while reading one, never both models'
    # FFN, and nothing read at all while the assignment runs.
    streamed = lmc.matching.streamed
    read, unit_correlation = streamed._Checked.read, streamed._StreamedDescent.unit_correlation
    best_units = streamed._StreamedDescent.best_units
    beside_reads, beside_assignments, correlating = [], [], []

    def kept(descent) -> list[str]:
        source, original, target = descent.parameters, descent.original, descent.target
        names = [*source.held, *source.kept, *original.held, *target.held]
        return names + [name for name in (original.kept[0], target.kept[0]) if name]

    def watched_read(mapping, name):
        if correlating:
            beside_reads.append((name, kept(correlating[-1])))
        return read(mapping, name)

    def watched_unit_correlation(descent, permutation):
        correlating.append(descent)
        try:
            return unit_correlation(descent, permutation)
        finally:
            correlating.clear()

    def watched_best_units(descent, permutation, correlation, unsigned=None):
        if permutation in hidden:
            beside_assignments.append(kept(descent))
        return best_units(descent, permutation, correlation, unsigned)

    source, target = (randomize_parameters_(create_model("llama-tiny"), seed=seed) for seed in (0, 1))
    hidden = [block.feed_forward.hidden for block in model_spec(source).blocks]
    monkeypatch.setattr(streamed._Checked, "read", watched_read)
    monkeypatch.setattr(streamed._StreamedDescent, "unit_correlation", watched_unit_correlation)
    monkeypatch.setattr(streamed._StreamedDescent, "best_units", watched_best_units)
    source_dir, target_dir = save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)
    align_directories(source_dir, target_dir, tmp_path / "out", "full_model")
    feed_forward = {name for permutation in hidden for name, _ in permutation.axes}
    assert {name for name, _ in beside_reads} == feed_forward
    assert len(beside_assignments) >= 2 * len(hidden)  # every FFN in every round
    assert max(len(names) for _, names in beside_reads) == 1, beside_reads
    assert not any(beside_assignments), beside_assignments


@pytest.mark.parametrize("scope", ["first_attention", "all_attention"])
def test_an_attention_scope_reads_each_tensor_of_both_models_once(tmp_path, monkeypatch, scope):
    # Each attention layer is aligned when the write pass reaches it, from the same read that writes it:
    # one pass over both models; then the written attention layers are read back for their check (the
    # probe of each layer as written, against the source layer's output kept from the first pass).
    from collections import Counter

    import lmc.formats.safetensors

    rows, reads = lmc.formats.safetensors.SafetensorsCheckpoint.rows, Counter()

    def counted(checkpoint, name, start, stop):
        reads[checkpoint.folder.name, name] += 1
        return rows(checkpoint, name, start, stop)

    monkeypatch.setattr(lmc.formats.safetensors.SafetensorsCheckpoint, "rows", counted)
    source = randomize_parameters_(create_model("llama-tiny"), seed=0)
    target = copy.deepcopy(source)
    differ = ".layers.0.self_attn" if scope == "first_attention" else "self_attn"
    for name, parameter in randomize_parameters_(create_model("llama-tiny"), seed=1).named_parameters():
        if differ in name:
            target.get_parameter(name).data.copy_(parameter)
    source_dir, target_dir = save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)
    report = align_directories(source_dir, target_dir, tmp_path / "out", scope)
    expected = align(source, target, scope=scope)[1]
    assert [record.assignment for record in report.layers] == [record.assignment for record in expected.layers]
    stored = set(source.state_dict())
    checked = {name for name in stored if differ in name}
    assert {name for f, name in reads if f == "aligned"} == checked
    assert {name: reads["target", name] for name in stored} == dict.fromkeys(stored, 1)
    assert {name: reads["source", name] for name in stored} == dict.fromkeys(stored, 1)
    assert len(reads) == 2 * len(stored) + len(checked)  # nothing else read


def test_a_device_without_a_gpu_is_refused_before_anything_is_read(tmp_path, llama_pair, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': PyTorch sees no CUDA GPU here .* use device 'cpu'"):
        align_directories(*llama_pair, tmp_path / "out", "full_model", device="cuda")
    with pytest.raises(ValueError, match="'gpu' is not a device name"):
        align_directories(*llama_pair, tmp_path / "out", "full_model", device="gpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_search_runs_there_and_finds_the_cpu_alignment(tmp_path, monkeypatch):
    import lmc.matching.layers
    import lmc.matching.permutation

    devices, correlation = set(), lmc.matching.permutation.axis_correlation

    def watched(source, target, permutation):
        devices.update(source[name].device.type for name, _ in permutation.axes)
        return correlation(source, target, permutation)

    monkeypatch.setattr(lmc.matching.layers, "axis_correlation", watched)
    source, target = (randomize_parameters_(create_model("llama-tiny", dtype=torch.float64), seed=s) for s in (0, 1))
    source_dir, target_dir = save(source, tmp_path / "source", True), save(target, tmp_path / "target", False)
    on_gpu = align_directories(source_dir, target_dir, tmp_path / "gpu", "full_model", device="cuda")
    assert devices == {"cuda"}
    on_cpu = align_directories(source_dir, target_dir, tmp_path / "cpu", "full_model")
    # Float64 GEMMs summed in another order: the same assignments, distances to float64 rounding.
    assert [layer.assignment for layer in on_gpu.layers] == [layer.assignment for layer in on_cpu.layers]
    assert on_gpu.distance == pytest.approx(on_cpu.distance, rel=1e-12)
