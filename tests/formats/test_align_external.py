"""`lmc align` on Hugging Face model directories and timm checkpoints: outputs load back with the
library's own loader, compute the source's function (aligned) or the merge (merged); every Hugging
Face family at every scope recovers a planted pair and keeps an independent pair's function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmc.adapters import adapter_for, random_symmetry, scope_parameters
from lmc.checkpoints import save_weights
from lmc.cli import main
from lmc.io import atomic_output_folder
from lmc.matching.results import PROBE_RTOL
from tests.architectures import FLOAT64_RTOL, float64_norms, relative_difference
from tests.cli import fails
from tests.formats.checkpoints import (
    FLOAT32_ATOL,
    FLOAT32_RTOL,
    HF_MODELS,
    TIMM_MODELS,
    at_every_scope,
    fine_tuned_pair,
    model,
    save_hf,
    save_timm,
)


def _logits(network: torch.nn.Module, seed: int = 3) -> torch.Tensor:
    adapter = adapter_for(network)
    inputs = adapter.example_inputs(network, 3, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return adapter.forward(network.eval(), inputs)


def _hf_load(folder: Path) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    return getattr(transformers, config.architectures[0]).from_pretrained(str(folder), local_files_only=True).eval()


def _timm_load(folder: Path) -> torch.nn.Module:
    import timm

    return timm.create_model(f"local-dir:{folder}", pretrained=True).eval()  # the load-back line of docs/checkpoints.md


def _check_merged(merged: torch.nn.Module, target: torch.nn.Module, aligned: torch.nn.Module, alpha: float) -> None:
    target_parameters, aligned_parameters = dict(target.named_parameters()), dict(aligned.named_parameters())
    for name, value in merged.named_parameters():
        expected = torch.lerp(target_parameters[name].float(), aligned_parameters[name].float(), alpha)
        torch.testing.assert_close(value, expected.to(value.dtype), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("key", list(HF_MODELS))
def test_hf_directories_align_and_merge_into_loadable_directories(key, tmp_path, capsys):
    name, overrides = HF_MODELS[key]
    source_dir = save_hf(model(name, overrides, seed=0), tmp_path / "source")
    target_dir = save_hf(model(name, overrides, seed=1), tmp_path / "target")
    output = tmp_path / "out"
    main(["align", str(source_dir), str(target_dir), "--output", str(output), "--merge-alpha", "[0.25]"])
    assert "distance to target" in capsys.readouterr().out

    source, target = _hf_load(source_dir), _hf_load(target_dir)
    aligned, merged = _hf_load(output / "aligned"), _hf_load(output / "merged_0.25")
    torch.testing.assert_close(_logits(aligned), _logits(source), rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)
    assert not torch.allclose(_logits(merged), _logits(source), rtol=1e-2)  # a merge, not a copy
    _check_merged(merged, target, aligned, 0.25)
    if source.get_output_embeddings() is not None and source.config.tie_word_embeddings:
        assert aligned.get_output_embeddings().weight is aligned.get_input_embeddings().weight
        assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    for folder in ("aligned", "merged_0.25"):
        assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (output / folder).iterdir()}
    report = json.loads((output / "report.json").read_text())
    assert report["format"] == "huggingface" and report["alignment"]["scope"] == "full_model"
    assert report["alignment"]["distance"]["aligned"] < report["alignment"]["distance"]["naive"]
    assert report["checks"]["written_and_read_back"]["relative_output_change"] <= PROBE_RTOL[torch.float32]
    assert not list(output.glob(".*"))  # no temporary folder left


@pytest.mark.parametrize(("key", "scope"), at_every_scope(list(HF_MODELS)))
def test_a_planted_pair_is_recovered_through_the_cli(key, scope, tmp_path):
    # The target is the source under a random symmetry of the scope: aligning must find the target's weights.
    source = model(*HF_MODELS[key], seed=0, dtype=torch.float64)
    target = random_symmetry(source, scope=scope, seed=5)
    source_dir, target_dir = save_hf(source, tmp_path / "s", False), save_hf(target, tmp_path / "t", False)
    main(["align", str(source_dir), str(target_dir), "--output", str(tmp_path / "out"), "--scope", scope])
    aligned = _hf_load(tmp_path / "out" / "aligned")
    assert next(aligned.parameters()).dtype == torch.float64
    # Float64 rounding only: entries of at most 1.5 off by 3.9e-16 (measured).
    for (name, value), expected in zip(aligned.named_parameters(), target.parameters()):
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-12, msg=name)
    distance = json.loads((tmp_path / "out" / "report.json").read_text())["alignment"]["distance"]
    assert distance["aligned"] < 1e-12 * distance["naive"]


@pytest.mark.parametrize(("key", "scope"), at_every_scope(list(HF_MODELS)))
def test_an_independent_pair_aligned_through_the_cli_computes_the_source_function(key, scope, tmp_path, monkeypatch):
    # Two fine-tunings of one model re-initialized at the scope: the aligned source moves toward the
    # target inside the scope, keeps every other weight and computes the source's function.
    source, target = fine_tuned_pair(*HF_MODELS[key], scope, torch.float64)
    float64_norms(source, monkeypatch)
    source_dir, target_dir = save_hf(source, tmp_path / "s", False), save_hf(target, tmp_path / "t", False)
    main(["align", str(source_dir), str(target_dir), "--output", str(tmp_path / "out"), "--scope", scope])
    # Both read back by from_pretrained: it computes buffers such as Gemma's embedding scale in float64,
    # where the zoo's model built in float32 and cast holds them rounded to float32.
    aligned, loaded_source = _hf_load(tmp_path / "out" / "aligned"), _hf_load(source_dir)
    # Float64 rounding of a group element and its inverse: at most 1.2e-15 relative (measured, Gemma).
    assert relative_difference(_logits(aligned), _logits(loaded_source)) < FLOAT64_RTOL
    inside = set(scope_parameters(source, scope))
    source_parameters = dict(source.named_parameters())
    for name, value in aligned.named_parameters():
        if name not in inside:
            assert torch.equal(value, source_parameters[name]), name
    distance = json.loads((tmp_path / "out" / "report.json").read_text())["alignment"]["distance"]
    assert distance["aligned"] < distance["naive"]


def test_sharded_directories_are_read_and_written_sharded(tmp_path):
    source_dir = save_hf(model("llama-tiny", {}, seed=0), tmp_path / "s", max_shard_size="20KB")
    target_dir = save_hf(model("llama-tiny", {}, seed=1), tmp_path / "t", max_shard_size="20KB")
    main(["align", str(source_dir), str(target_dir), "--output", str(tmp_path / "out")])
    written = tmp_path / "out" / "aligned"
    index = json.loads((written / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    largest = max(p.stat().st_size for p in source_dir.glob("model-*.safetensors"))
    assert all(p.stat().st_size <= largest for p in written.glob("model-*.safetensors"))
    torch.testing.assert_close(
        _logits(_hf_load(written)), _logits(_hf_load(source_dir)), rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL
    )


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_bf16_checkpoints_align_in_float32_and_are_written_back_in_bf16(name, tmp_path):
    source_dir = save_hf(model(name, {}, seed=0, dtype=torch.bfloat16), tmp_path / "s")
    target_dir = save_hf(model(name, {}, seed=1, dtype=torch.bfloat16), tmp_path / "t")
    output = tmp_path / "out"
    main(["align", str(source_dir), str(target_dir), "--output", str(output), "--merge-alpha", "[0.5]"])
    source, target = _hf_load(source_dir), _hf_load(target_dir)
    aligned, merged = _hf_load(output / "aligned"), _hf_load(output / "merged_0.5")
    assert {p.dtype for p in aligned.parameters()} == {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    report = json.loads((output / "report.json").read_text())
    assert (report["stored_dtype"], report["compute_dtype"], report["per_head_problem_dtype"]) == (
        "bfloat16",
        "float32",
        "float64",
    )
    rtol = PROBE_RTOL[torch.bfloat16]
    assert report["checks"]["aligned_model"]["rtol"] == report["checks"]["written_and_read_back"]["rtol"] == rtol
    expected, found = _logits(source).double(), _logits(aligned).double()
    assert float((found - expected).norm() / expected.norm()) <= rtol
    _check_merged(merged, target, aligned, 0.5)


@pytest.mark.parametrize("key", list(TIMM_MODELS))
def test_timm_folders_align_and_merge_into_loadable_folders(key, tmp_path):
    name, overrides = TIMM_MODELS[key]
    source_dir = save_timm(model(name, overrides, seed=0), tmp_path / "source")
    target_dir = save_timm(model(name, overrides, seed=1), tmp_path / "target")
    output = tmp_path / "out"
    main(["align", str(source_dir), str(target_dir), "--output", str(output), "--merge-alpha", "[0.5]"])
    source, target = _timm_load(source_dir), _timm_load(target_dir)
    aligned, merged = _timm_load(output / "aligned"), _timm_load(output / "merged_0.5")
    assert type(aligned) is type(source)
    torch.testing.assert_close(_logits(aligned), _logits(source), rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)
    _check_merged(merged, target, aligned, 0.5)
    assert json.loads((output / "report.json").read_text())["format"] == "timm"


def test_timm_state_dict_files_take_the_model_name_and_arguments(tmp_path):
    arguments = dict(embed_dim=32, depth=2, num_heads=4, img_size=8, patch_size=2, in_chans=1, num_classes=10)
    source, target = model("vit-tiny", {}, seed=0), model("vit-tiny", {}, seed=1)
    source_file, target_file = save_weights(source, tmp_path / "s.safetensors"), tmp_path / "t.pth"
    torch.save(target.state_dict(), target_file)
    flags = ["--timm-model", "vit_tiny_patch16_224", "--timm-args", json.dumps(arguments)]
    main(["align", str(source_file), str(target_file), "--output", str(tmp_path / "out"), *flags])
    aligned = _timm_load(tmp_path / "out" / "aligned")
    torch.testing.assert_close(_logits(aligned), _logits(source), rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)


def test_state_dict_files_and_lmc_checkpoints_are_told_apart_by_name(tmp_path, capsys):
    """A timm state dict without --timm-model, and an lmc checkpoint with it, used to end in key lists or worse."""
    from lmc.training import LMCModule
    from tests.runs import data

    vit = model("vit-tiny", {}, seed=0)
    state = tmp_path / "vit.pth"
    torch.save(vit.state_dict(), state)
    out = ["--output", str(tmp_path / "out")]
    assert "for a timm state dict add --timm_model NAME" in fails(["align", str(state), str(state), *out], capsys)
    module = LMCModule("reference-vit-tiny", {"pe": "rope"}, data().info)
    checkpoint = tmp_path / "lmc.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, checkpoint)
    error = fails(["align", str(checkpoint), str(checkpoint), *out, "--timm-model", "vit_tiny_patch16_224"], capsys)
    assert f"{checkpoint} is an lmc checkpoint" in error and "drop --timm_model" in error


def test_unsupported_architectures_and_mismatched_pairs_are_refused(tmp_path, capsys):
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, pad_token_id=0)
    unsupported = tmp_path / "classifier"
    transformers.GPT2ForSequenceClassification(config).save_pretrained(str(unsupported))
    gpt2 = save_hf(model("gpt2-tiny", {}, seed=0), tmp_path / "gpt2", tokenizer=False)
    deeper = save_hf(model("gpt2-tiny", {"n_layer": 3}, seed=1), tmp_path / "deeper", tokenizer=False)
    vit = save_timm(model("vit-tiny", {}, seed=0), tmp_path / "vit")
    out = str(tmp_path / "out")

    error = fails(["align", str(unsupported), str(unsupported), "--output", out], capsys)
    assert "no adapter for transformers:GPT2ForSequenceClassification" in error
    assert "n_layer is 2" in fails(["align", str(gpt2), str(deeper), "--output", out], capsys)
    assert "timm checkpoint" in fails(["align", str(gpt2), str(vit), "--output", out], capsys)
    llama = save_hf(model("llama-tiny", {}, seed=0), tmp_path / "llama", tokenizer=False)
    error = fails(["align", str(gpt2), str(llama), "--output", out], capsys)  # it used to name activation_function
    assert f"{gpt2} holds a GPT2LMHeadModel, {llama} a LlamaForCausalLM" in error
    lmc_checkpoint = tmp_path / "seed0.ckpt"
    lmc_checkpoint.write_bytes(b"weights")
    error = fails(["align", str(lmc_checkpoint), str(gpt2), "--output", out], capsys)
    assert "is an lmc checkpoint but" in error and "Hugging Face model directory" in error
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    assert "neither a Hugging Face" in fails(["align", str(not_a_model), str(gpt2), "--output", out], capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["align", "align-first-attention", "equivalent"])
def test_a_folder_missing_weights_is_named_with_the_fix(command, tmp_path, capsys):
    """A shard its index leaves out, or a tensor its files lack: named by folder, never 'different architectures'
    (streamed) nor initialized at random by from_pretrained (in memory)."""
    from safetensors.torch import load_file, save_file

    source_dir = save_hf(model("llama-tiny", {}, seed=0), tmp_path / "s", tokenizer=False, max_shard_size="20KB")
    target_dir = save_hf(model("llama-tiny", {}, seed=1), tmp_path / "t", tokenizer=False)
    argv = {
        "align": ["align", str(source_dir), str(target_dir), "--output", str(tmp_path / "out")],
        "align-first-attention": ["align", str(source_dir), str(target_dir), "--output", str(tmp_path / "out"),
                                  "--scope", "first_attention"],
        "equivalent": ["equivalent", str(source_dir), str(target_dir)],
    }[command]  # fmt: skip
    index_path = source_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    left_out = sorted(set(index["weight_map"].values()))[1]
    shortened = {**index, "weight_map": {k: v for k, v in index["weight_map"].items() if v != left_out}}
    index_path.write_text(json.dumps(shortened))
    error = fails(argv, capsys)
    assert f"{index_path} names no tensor of shard(s) ['{left_out}'], which {source_dir} holds" in error
    assert "write the folder again with save_pretrained" in error

    index_path.write_text(json.dumps(index))
    shard = source_dir / left_out
    state = load_file(shard)
    lost = sorted(state)[0]
    del state[lost]
    save_file(state, shard, metadata={"format": "pt"})
    index_path.write_text(
        json.dumps({**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != lost}})
    )
    error = fails(argv, capsys)
    assert f"{source_dir} does not fit its config.json's LlamaForCausalLM" in error and lost in error
    assert "save the model with save_pretrained" in error
    assert not (tmp_path / "out").exists()


def test_outputs_never_go_over_inputs_and_are_never_half_written(tmp_path, capsys, monkeypatch):
    source = save_hf(model("gpt2-tiny", {}, seed=0), tmp_path / "source", tokenizer=False)
    target = save_hf(model("gpt2-tiny", {}, seed=1), tmp_path / "target", tokenizer=False)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    error = fails(["align", str(source), str(target), "--output", str(source)], capsys)
    assert "would replace an input" in error
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before

    # An earlier aligned output used as the source: the new output would replace it.
    main(["align", str(source), str(target), "--output", str(tmp_path / "out")])
    earlier = tmp_path / "out" / "aligned"
    argv = ["align", str(earlier), str(target), "--output", str(tmp_path / "out"), "--overwrite", "true"]
    assert "would replace an input" in fails(argv, capsys)
    assert "already exist" in fails(["align", str(source), str(target), "--output", str(tmp_path / "out")], capsys)

    # A writer failing half-way leaves no output folder and no temporary folder behind (safetensors
    # folders are written streamed, tensor by tensor).
    import lmc.matching.streamed_write

    def broken(handle, tensor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lmc.matching.streamed_write, "write_tensor", broken)
    assert "No space left" in fails(["align", str(source), str(target), "--output", str(tmp_path / "o2")], capsys)
    assert not (tmp_path / "o2" / "aligned").exists() and not list((tmp_path / "o2").glob(".*"))


def test_an_atomic_output_folder_replaces_the_old_one_only_when_complete(tmp_path):
    folder = tmp_path / "result"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_output_folder(folder) as temporary:
        (temporary / "new.txt").write_text("new")
        raise RuntimeError("interrupted")
    assert [p.name for p in folder.iterdir()] == ["old.txt"]
    with atomic_output_folder(folder) as temporary:
        (temporary / "new.txt").write_text("new")
    assert [p.name for p in folder.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["result"]
    with pytest.raises(ValueError, match="over the input"):
        with atomic_output_folder(folder / "inside", inputs=[folder]):
            pass


@pytest.mark.parametrize("name", ["llama-tiny", "roformer-tiny", "rope-vit-tiny"])
def test_safetensors_folders_at_an_attention_scope_are_aligned_streamed(name, tmp_path, capsys, monkeypatch):
    # Fine-tuned under all_attention: everything else equal, as the streamed path requires.
    source = model(name, {}, seed=0)
    target, other = model(name, {}, seed=0), model(name, {}, seed=1)
    other_parameters = dict(other.named_parameters())
    with torch.no_grad():
        for parameter in scope_parameters(target, "all_attention"):
            dict(target.named_parameters())[parameter].copy_(other_parameters[parameter])
    timm = name == "rope-vit-tiny"
    save, load = (save_timm, _timm_load) if timm else (save_hf, _hf_load)
    source_dir, target_dir = save(source, tmp_path / "s"), save(target, tmp_path / "t")
    output = tmp_path / "out"
    reads, read_text = [], Path.read_text

    def counted(self, *args, **kwargs):
        reads.extend([self.parent] if self.name == "config.json" else [])
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    main(["align", str(source_dir), str(target_dir), "--output", str(output), "--scope", "all_attention",
          "--merge-alpha", "[0.5]"])  # fmt: skip
    monkeypatch.undo()
    assert "streamed" in capsys.readouterr().out
    assert sorted(reads) == [source_dir, target_dir]  # lmc parses each input's config.json once
    aligned, merged = load(output / "aligned"), load(output / "merged_0.5")
    torch.testing.assert_close(_logits(aligned), _logits(source), rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)
    _check_merged(merged, load(target_dir), aligned, 0.5)
    report = json.loads((output / "report.json").read_text())
    alignment = report["alignment"]
    assert alignment["scope"] == "all_attention" and alignment["distance"]["aligned"] < alignment["distance"]["naive"]


def test_written_model_files_get_the_mode_of_any_new_file(tmp_path):
    """safetensors writes 0o600; the outputs used to keep it, unreadable to the user's group."""
    import os

    source = save_hf(model("gpt2-tiny", {}, seed=0), tmp_path / "source", tokenizer=False)
    target = save_hf(model("gpt2-tiny", {}, seed=1), tmp_path / "target", tokenizer=False)
    previous = os.umask(0o022)
    try:
        main(["align", str(source), str(target), "--output", str(tmp_path / "out"), "--merge-alpha", "0.5"])
    finally:
        os.umask(previous)
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"model.safetensors", "config.json", "report.json"}
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o644)}


def test_device_cuda_without_a_gpu_and_device_for_in_memory_paths_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    source = save_hf(model("llama-tiny", {}, seed=0), tmp_path / "s", tokenizer=False)
    target = save_hf(model("llama-tiny", {}, seed=1), tmp_path / "t", tokenizer=False)
    error = fails(["align", str(source), str(target), "--output", str(tmp_path / "out"), "--device", "cuda"], capsys)
    assert "PyTorch sees no CUDA GPU here" in error and "--device cpu" in error
    checkpoint = tmp_path / "seed0.ckpt"
    checkpoint.write_bytes(b"weights")  # refused by --device before it is read
    argv = ["align", str(checkpoint), str(checkpoint), "--output", str(tmp_path / "out"), "--device", "cuda"]
    assert "only a streamed alignment" in fails(argv, capsys)
    assert not (tmp_path / "out").exists()
