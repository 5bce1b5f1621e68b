"""`lmc equivalent A B`: exit status 0 when equivalent, 1 when not, 2 for bad input; the JSON report.

lmc checkpoints are judged in the dtype they store; Hugging Face and timm folders are read in
their own format."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmc.adapters import random_symmetry
from lmc.models import create_model, randomize_parameters_
from lmc.training import LMCModule
from lmc.training.module import save_trained
from tests.cli import exit_status, fails
from tests.formats.checkpoints import HF_MODELS, at_every_scope, fine_tuned_pair, model, save_hf, save_timm
from tests.runs import CONFIG, MODEL, data


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints of one model: A, B = a random symmetry of A, C = another initialization (float32);
    A16, B16: A in bfloat16 and a random symmetry of it, computed and stored in bfloat16."""
    root = tmp_path_factory.mktemp("equivalent")
    module = LMCModule(MODEL, CONFIG, data().info)
    hyperparameters = dict(module.hparams)
    models = {
        "a": randomize_parameters_(module.model, seed=0),
        "c": randomize_parameters_(LMCModule(MODEL, CONFIG, data().info).model, seed=1),
    }
    models["b"] = random_symmetry(models["a"], scope="full_model", seed=3)
    models["a16"] = copy.deepcopy(models["a"]).to(torch.bfloat16)
    models["b16"] = random_symmetry(models["a16"], scope="full_model", seed=3)
    models["a64"] = copy.deepcopy(models["a"]).double()
    models["a64"].blocks[0].attn.q_proj.weight.data[0, 0] += 1e-12  # not a float32 number
    models["b64"] = random_symmetry(models["a64"], scope="full_model", seed=3)
    return {
        key: save_trained(model.state_dict(), hyperparameters, root / f"{key}.ckpt") for key, model in models.items()
    }


def test_a_planted_pair_is_equivalent_exit_0_with_the_report(checkpoints, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert exit_status(["equivalent", str(checkpoints["a"]), str(checkpoints["b"]), "--output", str(report)]) == 0
    out = capsys.readouterr().out
    assert "are equivalent under the full_model group (float32)" in out
    assert "weights after alignment: 0 entries beyond their bound" in out
    assert "rtol 1.91e-06 = 32 roundings (float32 default)" in out and "tolerance 0.001 (float32 default)" in out
    assert "settings and buffers: equal" in out
    written = json.loads(report.read_text())
    assert written["equivalent"] is True and written["reason"].startswith("related by the full_model group")
    assert written["dtype"] == "float32" and written["scope"] == "full_model"
    assert written["weight_residual"]["all"] < 1e-6 and written["output_residual"] < 1e-5  # rounding of float32
    assert written["tolerance"] == {
        "weight": 32 * 2.0**-24,
        "output": 1e-3,
        "weight_origin": "float32 default",
        "output_origin": "float32 default",
        "roundings": 32.0,
    }
    assert 0 < max(written["rounding_ratio"].values()) <= 2.18  # the float32 ratio measured on planted pairs
    assert written["worst_parameter"] in written["parameter_residual"]
    assert written["alignment"]["options"]["method"] == "full"


def test_independent_and_narrower_scope_pairs_exit_1(checkpoints, tmp_path, capsys):
    a, b, c = (str(checkpoints[k]) for k in "abc")
    report = tmp_path / "report.json"
    assert exit_status(["equivalent", a, c, "--output", str(report)]) == 1
    assert "are NOT equivalent under the full_model group" in capsys.readouterr().out
    written = json.loads(report.read_text())
    assert written["equivalent"] is False and written["reason"].startswith("different functions")

    # B is A moved by the whole model's group: the first attention layer's group alone cannot reach it.
    assert exit_status(["equivalent", a, b, "--scope", "first_attention"]) == 1
    assert "(outside scope 'first_attention', so never aligned: it must be bitwise equal)" in capsys.readouterr().out
    # rtol 0 asks for bit-equal weights, which float32 rounding of the planted symmetry denies.
    assert exit_status(["equivalent", a, b, "--rtol", "0", "--output", str(report), "--overwrite", "true"]) == 1
    assert json.loads(report.read_text())["tolerance"]["weight_origin"] == "given"


def test_a_checkpoint_is_equivalent_to_itself_at_rtol_0(checkpoints, capsys):
    a = str(checkpoints["a"])
    assert exit_status(["equivalent", a, a, "--rtol", "0"]) == 0
    assert "are equivalent under the full_model group" in capsys.readouterr().out


def test_bad_input_exits_2_before_writing(checkpoints, tmp_path, capsys):
    a, b = str(checkpoints["a"]), str(checkpoints["b"])
    assert "rtol must be None" in fails(["equivalent", a, b, "--rtol", "-1"], capsys)
    assert "would replace an input" in fails(["equivalent", a, b, "--output", b, "--overwrite", "true"], capsys)
    existing = tmp_path / "report.json"
    existing.write_text("{}")
    assert "already exist" in fails(["equivalent", a, b, "--output", str(existing)], capsys)
    assert existing.read_text() == "{}"
    assert "is a folder" in fails(["equivalent", a, b, "--output", str(tmp_path)], capsys)
    assert "does not exist" in fails(["equivalent", a, str(tmp_path / "nope.ckpt")], capsys)
    assert exit_status(["equivalent", a, b, "--scope", "everything"]) == 2  # refused by the parser, with the choices
    assert "first_attention" in capsys.readouterr().err
    other = LMCModule(MODEL, {"pe": "rope", "rope_layout": "interleaved"}, data().info)
    other_path = save_trained(other.model.state_dict(), dict(other.hparams), tmp_path / "other.ckpt")
    assert "different models" in fails(["equivalent", a, str(other_path)], capsys)


def test_bf16_checkpoints_are_judged_in_bf16(checkpoints, tmp_path, capsys):
    """lmc builds the model in float32 and loads the checkpoint into it: the pair is judged in the stored dtype."""
    report = tmp_path / "report.json"
    a16, b16 = str(checkpoints["a16"]), str(checkpoints["b16"])
    assert exit_status(["equivalent", a16, b16, "--output", str(report)]) == 0
    assert "are equivalent under the full_model group (bfloat16)" in capsys.readouterr().out
    written = json.loads(report.read_text())
    assert written["dtype"] == "bfloat16" and written["tolerance"]["weight"] == 4 * 2.0**-8
    assert 0 < max(written["rounding_ratio"].values()) <= 1.47  # the bfloat16 ratio measured on planted pairs
    assert exit_status(["equivalent", str(checkpoints["a64"]), str(checkpoints["b64"]), "--rtol", "0"]) == 1
    assert "are NOT equivalent under the full_model group (float64)" in capsys.readouterr().out
    assert exit_status(["equivalent", str(checkpoints["a64"]), str(checkpoints["b64"])]) == 0
    assert "are equivalent under the full_model group (float64)" in capsys.readouterr().out
    assert exit_status(["equivalent", a16, str(checkpoints["c"])]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert f"{a16} stores its weights in bfloat16 but {checkpoints['c']} in float32" in error


def test_data_aware_settings_are_refused_in_one_line(checkpoints, capsys):
    a, b = str(checkpoints["a"]), str(checkpoints["b"])
    error = fails(["equivalent", a, b, "--method", "learned"], capsys)
    assert "lmc equivalent compares weights and reads no data" in error and "use the weight settings" in error


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Hugging Face GPT-2 folders: A, B = a random symmetry of A, EPS = A's weights with another
    layer_norm_epsilon; timm ViT folders: VIT and its random symmetry VIT_B."""
    root = tmp_path_factory.mktemp("equivalent_folders")
    network = model("gpt2-tiny", {}, seed=0)
    other = create_model("gpt2-tiny", layer_norm_epsilon=1e-3)
    other.load_state_dict(network.state_dict())
    vit = model("vit-tiny", {}, seed=0)
    return {
        "a": save_hf(network, root / "a"),
        "b": save_hf(random_symmetry(network, scope="full_model", seed=3), root / "b"),
        "eps": save_hf(other.eval(), root / "eps"),
        "vit": save_timm(vit, root / "vit"),
        "vit_b": save_timm(random_symmetry(vit, scope="full_model", seed=3), root / "vit_b"),
    }


def test_hugging_face_and_timm_folders_are_compared(folders, capsys):
    a, b = str(folders["a"]), str(folders["b"])
    assert exit_status(["equivalent", a, b]) == 0
    assert "are equivalent under the full_model group (float32)" in capsys.readouterr().out
    assert exit_status(["equivalent", str(folders["vit"]), str(folders["vit_b"])]) == 0
    assert "are equivalent under the full_model group (float32)" in capsys.readouterr().out
    # Equal weights, another LayerNorm eps: not equivalent, the setting named, no tolerance advised.
    assert exit_status(["equivalent", a, str(folders["eps"])]) == 1
    out = capsys.readouterr().out
    assert "settings and buffers: differ: config.layer_norm_epsilon" in out
    reason = next(line for line in out.splitlines() if line.startswith("reason: "))
    assert "config.layer_norm_epsilon (1e-05 in a, 0.001 in b)" in reason
    assert "no tolerance makes them equivalent" in reason and "lower" not in reason


@pytest.mark.parametrize(("key", "scope"), at_every_scope(list(HF_MODELS)))
def test_every_hugging_face_family_is_judged_equivalent_to_its_symmetry_and_not_to_another_fine_tuning(
    key, scope, tmp_path, capsys
):
    # C is A fine-tuned again under the scope's re-initialization: equal outside the scope, another function.
    network, other = fine_tuned_pair(*HF_MODELS[key], scope)
    a = str(save_hf(network, tmp_path / "a", tokenizer=False))
    b = str(save_hf(random_symmetry(network, scope=scope, seed=3), tmp_path / "b", tokenizer=False))
    c = str(save_hf(other, tmp_path / "c", tokenizer=False))
    assert exit_status(["equivalent", a, b, "--scope", scope]) == 0
    assert f"are equivalent under the {scope} group (float32)" in capsys.readouterr().out
    assert exit_status(["equivalent", a, c, "--scope", scope]) == 1
    out = capsys.readouterr().out
    assert f"are NOT equivalent under the {scope} group" in out and "reason: different functions" in out


def test_pythia_folders_are_compared_with_their_residual_form(tmp_path, capsys):
    """GPT-NeoX folders (embed_out in the files): a symmetry is equivalent; the other residual form is not."""
    network = model("gpt-neox-tiny", {}, seed=0)
    a = str(save_hf(network, tmp_path / "a", tokenizer=False))
    b = str(save_hf(random_symmetry(network, scope="full_model", seed=3), tmp_path / "b", tokenizer=False))
    assert exit_status(["equivalent", a, b]) == 0
    assert "are equivalent under the full_model group (float32)" in capsys.readouterr().out
    sequential = create_model("gpt-neox-tiny", use_parallel_residual=False)
    sequential.load_state_dict(network.state_dict())
    assert exit_status(["equivalent", a, str(save_hf(sequential, tmp_path / "seq", tokenizer=False))]) == 1
    assert "config.use_parallel_residual (True in a, False in b)" in capsys.readouterr().out


def test_hugging_face_vit_folders_are_compared_on_images(tmp_path, capsys):
    """ViTForImageClassification: a symmetry is equivalent; the class token moved off the stream's order is not."""
    network = model("hf-vit-tiny", {}, seed=0)
    a = str(save_hf(network, tmp_path / "a", tokenizer=False))
    b = str(save_hf(random_symmetry(network, scope="full_model", seed=3), tmp_path / "b", tokenizer=False))
    assert exit_status(["equivalent", a, b]) == 0
    assert "are equivalent under the full_model group (float32)" in capsys.readouterr().out
    with torch.no_grad():
        network.vit.embeddings.cls_token.copy_(network.vit.embeddings.cls_token.roll(1, dims=2))
    assert exit_status(["equivalent", a, str(save_hf(network, tmp_path / "c", tokenizer=False))]) == 1


def test_multibert_folders_are_compared_with_both_heads(tmp_path, capsys):
    """BertForPreTraining: a symmetry is equivalent; the pooler's units moved without the next-sentence head are not."""
    network = model("bert-pretraining-tiny", {}, seed=0)
    a = str(save_hf(network, tmp_path / "a", tokenizer=False))
    b = str(save_hf(random_symmetry(network, scope="full_model", seed=3), tmp_path / "b", tokenizer=False))
    assert exit_status(["equivalent", a, b]) == 0
    assert "are equivalent under the full_model group (float32)" in capsys.readouterr().out
    with torch.no_grad():
        network.bert.pooler.dense.weight.copy_(network.bert.pooler.dense.weight.roll(1, 0))
        network.bert.pooler.dense.bias.copy_(network.bert.pooler.dense.bias.roll(1, 0))
    assert exit_status(["equivalent", a, str(save_hf(network, tmp_path / "c", tokenizer=False))]) == 1
    assert "are NOT equivalent under the full_model group" in capsys.readouterr().out


def test_bad_folder_input_is_one_line_that_leads_nowhere_else(folders, checkpoints, capsys):
    a = str(folders["a"])
    bare = str(folders["a"] / "model.safetensors")
    error = fails(["equivalent", bare, str(folders["b"] / "model.safetensors")], capsys)
    assert f"{bare} is a bare safetensors file, without its model's configuration" in error
    assert "is an lmc checkpoint" in fails(["equivalent", a, str(checkpoints["a"])], capsys)
    assert "is a Hugging Face model directory but" in fails(["equivalent", a, str(folders["vit"])], capsys)
