"""`lmc align` and `lmc interpolate` on trained checkpoints, and what they do with bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmc.adapters import adapter_for
from lmc.cli import main
from lmc.connectivity import training_calibration
from lmc.data import Digits
from lmc.training import LMCModule
from lmc.training.module import load_trained
from tests.cli import fails
from tests.path_objective import check_learned_not_above_full, cross_entropy
from tests.runs import MODEL, data, finetuned, pretrain_and_first_seed, trainer

DIGITS = "--data=lmc.data.Digits"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    pretrained, seed0 = pretrain_and_first_seed(root)
    run = trainer(root / "seed1", steps=15)
    run.fit(finetuned(pretrained, 1), data())
    seed1 = root / "seed1.ckpt"
    run.save_checkpoint(seed1)
    return {"root": root, "pretrained": pretrained, "seed0": seed0, "seed1": seed1}


def _outputs(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    adapter = adapter_for(model)
    inputs = adapter.example_inputs(model, 4, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return adapter.forward(model.eval(), inputs)


@pytest.mark.parametrize("merge_alpha", ["0.5", "[0.5]"])  # a number, or a list of them
def test_align_writes_loadable_aligned_and_merged_checkpoints(merge_alpha, checkpoints, tmp_path, capsys):
    output = tmp_path / "out"
    main(
        [
            "align",
            str(checkpoints["seed0"]),
            str(checkpoints["seed1"]),
            "--output",
            str(output),
            "--merge-alpha",
            merge_alpha,
        ]
    )
    assert "distance to target" in capsys.readouterr().out
    assert sorted(p.name for p in output.iterdir()) == ["aligned.ckpt", "merged_0.5.ckpt", "report.json"]
    source, _ = load_trained(checkpoints["seed0"])
    target, _ = load_trained(checkpoints["seed1"])
    aligned, hyperparameters = load_trained(output / "aligned.ckpt")
    assert hyperparameters["model"] == MODEL
    torch.testing.assert_close(_outputs(aligned.model), _outputs(source.model), rtol=1e-4, atol=1e-5)
    report = json.loads((output / "report.json").read_text())
    assert report["scope"] == "first_attention"  # the checkpoints' own re-initialization
    assert report["distance"]["aligned"] < report["distance"]["naive"]
    merged, _ = load_trained(output / "merged_0.5.ckpt")
    target_weights = target.model.state_dict()
    for name, value in aligned.model.state_dict().items():
        expected = 0.5 * target_weights[name] + 0.5 * value
        torch.testing.assert_close(merged.model.state_dict()[name], expected, rtol=1e-6, atol=1e-7)


def test_checkpoints_of_different_models_are_refused(checkpoints, tmp_path, capsys):
    # Same shapes, another rotary layout: the weights fit, the function does not (issue #10, case 2).
    other = LMCModule(MODEL, {"pe": "rope", "rope_layout": "interleaved"}, data().info)
    path = tmp_path / "interleaved.ckpt"
    trainer(tmp_path, steps=1).strategy.connect(other)
    torch.save({"state_dict": other.state_dict(), "hyper_parameters": dict(other.hparams)}, path)
    error = fails(["align", str(checkpoints["seed0"]), str(path), "--output", str(tmp_path / "out")], capsys)
    assert "different models" in error and "interleaved" in error
    assert not (tmp_path / "out").exists()


def test_outputs_never_replace_inputs_and_need_overwrite(checkpoints, tmp_path, capsys):
    source, target = str(checkpoints["seed0"]), str(checkpoints["seed1"])
    # An output folder holding the source under an output's name.
    folder = tmp_path / "out"
    folder.mkdir()
    copy = folder / "aligned.ckpt"
    copy.write_bytes(checkpoints["seed0"].read_bytes())
    before = copy.read_bytes()
    assert "would replace an input" in fails(
        ["align", str(copy), target, f"--output={folder}", "--overwrite=true"], capsys
    )
    assert copy.read_bytes() == before
    assert "already exist" in fails(["align", source, target, f"--output={folder}"], capsys)
    for alpha in ("[.nan]", "[1.5]", "[-0.1]", "1.5", "-0.1"):
        assert "in [0, 1]" in fails(
            ["align", source, target, f"--output={tmp_path / 'o2'}", f"--merge_alpha={alpha}"], capsys
        )
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is a file" in fails(["align", source, target, f"--output={a_file}"], capsys)
    assert "does not exist" in fails(
        ["align", str(tmp_path / "nope.ckpt"), target, f"--output={tmp_path / 'o3'}"], capsys
    )
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_interpolate_writes_curves_and_never_mixes_sweeps(checkpoints, tmp_path, capsys):
    a, b, output = str(checkpoints["seed1"]), str(checkpoints["seed0"]), tmp_path / "lmc"
    main(["interpolate", a, b, DIGITS, f"--output-dir={output}", "--num-alphas", "5"])
    assert "barrier ratio" in capsys.readouterr().out
    validation = json.loads((output / "lmc_results.json").read_text())
    (result,) = validation["references"].values()
    naive, aligned = result["curves"]["naive"]["points"], result["curves"]["aligned"]["points"]
    assert [p["alpha"] for p in naive] == [0, 0.25, 0.5, 0.75, 1.0]
    assert naive[0] == aligned[0] and aligned[-1]["loss"] == pytest.approx(naive[-1]["loss"], rel=1e-5)
    assert result["settings"]["split"] == "val"

    # Another split into the same folder (issue #10, case 1): refused, then done apart with --overwrite.
    test_split = ["interpolate", a, b, DIGITS, f"--output-dir={output}", "--num-alphas", "5", "--split", "test"]
    assert "another sweep" in fails(test_split, capsys)
    main([*test_split, "--overwrite", "true"])
    tested = json.loads((output / "lmc_results.json").read_text())
    (result,) = tested["references"].values()
    assert result["settings"]["split"] == "test"
    assert result["curves"]["naive"]["points"][0] != naive[0]  # measured on the test split, not reused
    assert json.loads((output / "stale" / "lmc_results.json").read_text()) == validation

    # The same sweep again resumes (nothing to evaluate) and gives the same curves.
    main([*test_split])
    (again,) = json.loads((output / "lmc_results.json").read_text())["references"].values()
    assert again["key"] == result["key"] and again["curves"] == result["curves"]


def test_interpolate_refuses_data_the_model_was_not_built_for(checkpoints, tmp_path, capsys):
    data_config = Path(__file__).parents[2] / "configs" / "data" / "python_text_kinds.yaml"  # a config file works too
    argv = ["interpolate", str(checkpoints["seed1"]), str(checkpoints["seed0"]), "--data", str(data_config)]
    error = fails([*argv, f"--output_dir={tmp_path / 'lmc'}"], capsys)
    assert "does not fit the model" in error


def test_bad_values_fail_before_any_work(checkpoints, tmp_path, capsys):
    a, b = str(checkpoints["seed1"]), str(checkpoints["seed0"])
    assert "at least 2" in fails(["interpolate", a, b, DIGITS, f"--output_dir={tmp_path}", "--num_alphas", "1"], capsys)
    assert "probe_batch_size" in fails(["align", a, b, f"--output={tmp_path / 'o'}", "--probe_batch_size", "0"], capsys)
    assert "--epochs must be at least 1" in fails(["demo", "--epochs", "0"], capsys)
    assert "--epochs must be at least 1" in fails(["demo", "--epochs", "-1"], capsys)
    assert "--output DIR is required" in fails(["align", a, b], capsys)
    assert "--data FILE_OR_CLASS is required" in fails(["interpolate", a, b, f"--output_dir={tmp_path}"], capsys)
    assert not list(tmp_path.iterdir())


def test_data_aware_align_needs_data_and_records_its_calibration(checkpoints, tmp_path, capsys):
    source, target, output = str(checkpoints["seed0"]), str(checkpoints["seed1"]), tmp_path / "out"
    data_aware = ["--objective", "data", "--metric", "activation", "--calibration-batches", "2"]
    assert "--data FILE_OR_CLASS" in fails(["align", source, target, "--output", str(output), *data_aware], capsys)
    main(["align", source, target, "--output", str(output), *data_aware, DIGITS])
    report = json.loads((output / "report.json").read_text())
    assert report["calibration"]["split"] == "train" and report["calibration"]["num_samples"] == 64
    assert report["calibration"]["data"]["class"] == "lmc.data.embedded.Digits"
    aligned, _ = load_trained(output / "aligned.ckpt")
    original, _ = load_trained(checkpoints["seed0"])
    torch.testing.assert_close(_outputs(aligned.model), _outputs(original.model), rtol=1e-4, atol=1e-5)


def test_data_aware_interpolate_keys_its_sweep_by_the_calibration(checkpoints, tmp_path, capsys):
    a, b, output = str(checkpoints["seed1"]), str(checkpoints["seed0"]), tmp_path / "lmc"
    command = ["interpolate", a, b, DIGITS, f"--output-dir={output}", "--num-alphas", "3", "--objective", "data"]
    main([*command, "--calibration-batches", "2"])
    capsys.readouterr()  # the sweep's progress bar
    (result,) = json.loads((output / "lmc_results.json").read_text())["references"].values()
    assert result["settings"]["calibration"]["num_samples"] == 64
    assert result["alignment"]["calibration"]["split"] == "train"
    # Another calibration is another sweep: refused without --overwrite, never resumed from the old points.
    assert "another sweep" in fails([*command, "--calibration-batches", "3"], capsys)


def test_learned_align_and_interpolate_never_end_above_full(checkpoints, tmp_path, capsys):
    source, target, output = str(checkpoints["seed0"]), str(checkpoints["seed1"]), tmp_path / "out"
    learned = ["--method", "learned", "--learned-steps", "4", "--calibration-batches", "2"]
    assert "--data FILE_OR_CLASS" in fails(["align", source, target, "--output", str(output), *learned], capsys)
    main(["align", source, target, "--output", str(output), *learned, DIGITS])
    main(["align", source, target, "--output", str(tmp_path / "full"), "--method", "full"])
    report = json.loads((output / "report.json").read_text())
    assert report["learned"]["steps"] == 4 and report["calibration"]["num_samples"] == 64
    aligned, _ = load_trained(output / "aligned.ckpt")
    original, _ = load_trained(checkpoints["seed0"])
    # Never above full: the calibration loss of both written models' paths at alphas 0.25, 0.5, 0.75,
    # recomputed on the command's calibration batches (float32 models: rounding ~1e-7).
    calibration = training_calibration(Digits(), cross_entropy, 2)
    assert json.loads(json.dumps(calibration.identity())).items() <= report["calibration"].items()
    full, _ = load_trained(tmp_path / "full" / "aligned.ckpt")
    target_model = load_trained(checkpoints["seed1"])[0].model
    batches, objective = calibration.batches, report["learned"]["objective"]
    check_learned_not_above_full(target_model, full.model, aligned.model, batches, cross_entropy, objective, 1e-5)
    torch.testing.assert_close(_outputs(aligned.model), _outputs(original.model), rtol=1e-4, atol=1e-5)
    sweep = tmp_path / "lmc"
    main(["interpolate", target, source, DIGITS, f"--output-dir={sweep}", "--num-alphas", "3", *learned])
    capsys.readouterr()  # the sweep's progress bar
    (result,) = json.loads((sweep / "lmc_results.json").read_text())["references"].values()
    assert result["settings"]["options"]["learned_steps"] == 4
    assert result["alignment"]["learned"]["objective"] == report["learned"]["objective"]


def test_overwriting_an_alignment_leaves_none_of_its_old_merges(checkpoints, tmp_path, capsys):
    source, target, output = str(checkpoints["seed0"]), str(checkpoints["seed1"]), tmp_path / "out"
    main(["align", source, target, "--output", str(output), "--merge-alpha", "[0.25, 0.5]"])
    main(["align", source, target, "--output", str(output), "--merge-alpha", "0.75", "--overwrite", "true"])
    # The old merges used to stay beside the new aligned model and report, unmarked.
    assert sorted(p.name for p in output.iterdir()) == ["aligned.ckpt", "merged_0.75.ckpt", "report.json"]


def test_unit_matching_by_activation_needs_no_data_where_no_unit_is_aligned(checkpoints, tmp_path, capsys):
    """The checkpoints' scope is first_attention: no FFN unit moves, so --unit-matching activation reads nothing."""
    source, target, output = str(checkpoints["seed0"]), str(checkpoints["seed1"]), tmp_path / "out"
    main(["align", source, target, "--output", str(output), "--unit-matching", "activation"])
    report = json.loads((output / "report.json").read_text())
    assert report["scope"] == "first_attention" and report["calibration"] is None
    assert report["options"]["unit_matching"] == "weight"  # what was done, recorded as such
    error = fails(["align", source, target, "--output", str(tmp_path / "o2"), "--metric", "activation"], capsys)
    assert "--data" in error  # settings that do read activations there still need the data


def test_merge_writes_each_aligned_lmc_checkpoint_and_their_average(checkpoints, tmp_path, capsys):
    """Three lmc checkpoints of one run (the pre-trained model as a member): each aligned one keeps its model's
    function, the merge is the uniform average of the aligned weights."""
    output = tmp_path / "out"
    members = [checkpoints["seed0"], checkpoints["seed1"], checkpoints["seed0"]]
    main(["merge", *map(str, members), "--output", str(output)])
    assert "merged with weights [0.333, 0.333, 0.333]" in capsys.readouterr().out
    names = ["aligned_0.ckpt", "aligned_1.ckpt", "aligned_2.ckpt", "merged.ckpt", "report.json"]
    assert sorted(p.name for p in output.iterdir()) == names
    aligned = [load_trained(output / name)[0] for name in names[:3]]
    for member, module in zip(members, aligned):
        source, _ = load_trained(member)
        torch.testing.assert_close(_outputs(module.model), _outputs(source.model), rtol=1e-4, atol=1e-5)
    merged, _ = load_trained(output / "merged.ckpt")
    states = [module.model.state_dict() for module in aligned]
    for name, value in merged.model.state_dict().items():
        if value.is_floating_point():
            expected = sum(state[name].double() for state in states) / 3
            torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-7)
    assert json.loads((output / "report.json").read_text())["scope"] == "first_attention"
