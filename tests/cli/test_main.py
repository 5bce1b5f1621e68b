"""The ``lmc`` entry point: its commands, one-line errors, and the files it never touches."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import lmc
from lmc.cli import main
from lmc.cli.parsing import underscored
from lmc.cli.symmetry_checks import run
from lmc.experiments.protocol import experiment_cli
from lmc.models import create_model
from tests.cli import fails

CONFIGS = Path(__file__).parents[2] / "configs"


def test_symmetry_demo_rows_show_exact_symmetries_and_broken_near_misses(capsys):
    rows = {row["model"]: row for row in run(("vit-tiny", "llama-tiny", "roformer-tiny", "gpt-neox-tiny"))}
    assert rows["vit-tiny"]["symmetry"] < 1e-12 and rows["vit-tiny"]["gl_on_qk"] < 1e-12
    assert rows["vit-tiny"]["other_h"] is None
    assert rows["roformer-tiny"]["symmetry"] < 1e-12
    assert rows["gpt-neox-tiny"]["symmetry"] < 1e-12  # LayerNorms compute in float64
    assert rows["gpt-neox-tiny"]["qk_group"] == "H(8) dim 20"  # 2 rotary pairs, GL(4) on the other half
    # 4 heads without GQA: 4! orders, and per head H(8)'s 20 on Q/K and GL(8)'s 64 on V/O.
    assert rows["gpt-neox-tiny"]["layer_group"] == f"24 orders, dim {4 * (20 + 64)}"
    # GQA 4/2: 2! KV orders times 2! inside each group, and per KV head H(8)'s 8 and GL(8)'s 64.
    assert rows["llama-tiny"]["layer_group"] == f"8 orders, dim {2 * (8 + 64)}"
    assert rows["llama-tiny"]["symmetry"] < 2e-6  # RMSNorm in float32
    # The first FFN's hidden units and the residual stream, from the models' own configs: width! and d! orders.
    llama = create_model("llama-tiny").config
    assert (rows["llama-tiny"]["ffn"], rows["llama-tiny"]["residual"]) == (
        f"{llama.intermediate_size}!",
        f"{llama.hidden_size}!",
    )
    vit = create_model("vit-tiny")
    assert (rows["vit-tiny"]["ffn"], rows["vit-tiny"]["residual"]) == (
        f"{vit.blocks[0].mlp.fc2.in_features}!",
        f"{vit.embed_dim}!",
    )
    for name in ("llama-tiny", "roformer-tiny", "gpt-neox-tiny"):
        assert rows[name]["gl_on_qk"] > 1e-4 and rows[name]["other_h"] > 1e-4
    assert all(row["weights"] > 0.5 for row in rows.values())
    assert all(row["unexplained_axes"] == [] for row in rows.values())
    # vit-tiny: cls_token (2 singleton axes), pos_embed (singleton, positions), the patch Conv2d's channels and
    # pixels (3), the head's classes (weight and bias)
    assert rows["vit-tiny"]["fixed_axes"] == 9
    assert "RoFormerForSequenceClassification" in capsys.readouterr().out


# model -> the Q/K group lmc symmetry reports for a head of 8 (docs/spec.md, section 2)
FAMILY_GROUPS = {
    "mistral-tiny": "H(8) dim 8",  # the window acts on positions
    "qwen2-tiny": "H(8) dim 8",  # biases move with the group
    "qwen3-tiny": "signs(8) dim 0",  # per-head QK-norm: sign flips of the rotary pairs
    "olmo2-tiny": "signs(8) dim 0",  # full-width QK-norm: the same, the gain slices moving with the heads
    "gemma-tiny": "H(8) dim 8",
    "gemma2-tiny": "H(8) dim 8",  # capping is injective
    "phi3-tiny": "H(8) dim 20",  # half rotary: 2 pairs of H, GL(4) on the rest
    "bert-mlm-tiny": "GL(8) dim 64",
    "bert-pretraining-tiny": "GL(8) dim 64",
    "hf-vit-tiny": "GL(8) dim 64",
}


def test_symmetry_reports_each_familys_group_and_a_random_element_keeps_it(capsys):
    rows = {row["model"]: row for row in run(tuple(FAMILY_GROUPS))}
    assert {name: row["qk_group"] for name, row in rows.items()} == FAMILY_GROUPS
    for name, row in rows.items():
        assert row["symmetry"] < (2e-6 if "bert" not in name and "vit" not in name else 1e-12), name
        assert row["weights"] > 0.5 and row["unexplained_axes"] == [], name
        if "H(" in row["qk_group"] or "signs" in row["qk_group"]:  # RoPE: a GL or the other H on Q/K breaks it
            assert row["gl_on_qk"] > 1e-4 and row["other_h"] > 1e-4, name
    assert "Qwen3ForCausalLM" in capsys.readouterr().out


def test_an_unknown_model_is_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["symmetry", "--models", "[resnet50]"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unknown model(s) ['resnet50']" in line and "llama-tiny" in line


def test_errors_show_the_traceback_on_request(monkeypatch):
    monkeypatch.setenv("LMC_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown model"):
        main(["symmetry", "--models", "[resnet50]"])


def test_python_dash_m_lmc_runs_the_symmetry_command():
    result = subprocess.run(
        [sys.executable, "-m", "lmc", "symmetry", "--models", "[reference-vit-tiny]"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("reference-vit-tiny"))
    assert "ReferenceTransformer" in row and "GL(8)" in row


def test_flags_take_dashes_or_underscores():
    argv = ["align", "a", "--merge-alpha", "[0.5]", "--num-alphas=3", "--overwrite", "x-y", "-h"]
    assert underscored(argv) == ["align", "a", "--merge_alpha", "[0.5]", "--num_alphas=3", "--overwrite", "x-y", "-h"]


def test_help_lists_each_command_once_in_one_block_and_ends_with_its_last_line(capsys):
    """The hand-written list used to be followed by jsonargparse's (which left out fit ... run)."""
    from lmc.cli import COMMANDS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: lmc [-h] [--version] COMMAND ...\n")
    assert set(COMMANDS) == {"fit", "validate", "test", "predict", "run", "align", "merge", "interpolate", "equivalent",
                             "demo", "repro", "symmetry"}  # fmt: skip
    block = text[text.index("\ncommands:\n") + 1 :].split("\n\n")[0]
    # an entry: two spaces, its commands, then two spaces or the end of the line before what it does
    listed = [
        name
        for line in block.splitlines()[1:]
        if not line.startswith("   ")
        for name in line.split("  ")[1].split(", ")
    ]
    assert sorted(listed) == sorted(COMMANDS)
    assert _listed_at_line_starts(text) == _listed_at_line_starts(block)  # and nowhere else
    assert text.endswith("LMC_DEBUG=1 shows the traceback.\n")


def _listed_at_line_starts(text: str) -> list[str]:
    from lmc.cli import COMMANDS

    return [word for word in re.findall(r"^ +([a-z]+)", text, flags=re.MULTILINE) if word in COMMANDS]


def test_version_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"lmc {lmc.__version__}\n"


#: Imported by a command, never by ``lmc --help``, ``--version`` or the help of these commands.
HEAVY = ("torch", "lightning", "transformers")


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["demo", "--help"],
        ["repro", "--help"],
        ["symmetry", "--help"],
        ["equivalent", "--help"],
        ["align", "--help"],
        ["interpolate", "-h"],
    ],
)
def test_help_and_version_import_no_torch(argv):
    """Every help took about 15 s: torch and Lightning were imported before the arguments were parsed.

    align's and interpolate's too: their --data was typed by LMCDataModule, a LightningDataModule.
    """
    code = f"import sys\nfrom lmc.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
    code += f"print(sorted(set({HEAVY!r}) & set(sys.modules)), file=sys.stderr)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout, result.stderr
    assert result.stderr.splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("argv", "description"),
    [
        (["run"], "lmc run: the paper's protocol from one experiment config."),
        (["fit"], "Runs the full optimization routine."),
        (["align"], "Align SOURCE to TARGET and write the aligned (and merged) models into OUTPUT."),
        (["demo"], "The main job: pre-train, fine-tune seeds, align and sweep on 5,000 real MNIST digits"),
    ],
)
def test_a_commands_help_opens_with_its_usage_and_description(argv, description, capsys):
    """lmc run --help was 658 lines: a usage line of 'lmc' and every flag, its description at line 69."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    usage, blank, first, *_ = capsys.readouterr().out.splitlines()
    assert usage.startswith(f"usage: lmc {argv[0]} [-h] ") and blank == "" and first.startswith(description)


@pytest.mark.parametrize("command", ["run", "fit"])
def test_a_commands_own_options_come_before_the_trainers_and_models(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    own = ["--protocol.seeds", "--cluster.executor"] if command == "run" else ["--ckpt_path", "--protocol.seeds"]
    order = [text.index(f"\n  {flag} ") for flag in [*own, "--trainer.max_epochs", "--model.model"]]
    assert order == sorted(order)


#: reStructuredText that docstrings use and plain-text help must not show.
MARKUP = ("``", ":mod:`", ":func:`", ":class:`", ":meth:`", ":data:`")


@pytest.mark.parametrize("command", [[], ["fit"], ["run"], ["align"], ["interpolate"], ["equivalent"], ["repro"]])
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) > 5 and not [markup for markup in MARKUP if markup in text]


def test_fit_never_writes_over_the_users_config(tmp_path, monkeypatch):
    # Issue #10, case 4: the debug config turns the logger off; the merged config used to land in the cwd.
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "config.yaml"
    mine.write_text((CONFIGS / "experiment" / "digits_vit_ape.yaml").read_text().replace("../", f"{CONFIGS}/"))
    before = mine.read_text()
    main(["fit", "--config", "config.yaml", "--config", str(CONFIGS / "debug" / "fast.yaml")])
    assert mine.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_explicit_arguments_do_not_trigger_lightnings_args_warning(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lmc", "run", "--config", "x.yaml"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        experiment_cli(["--config", str(CONFIGS / "experiment" / "digits_vit_ape.yaml")], run=False)
    assert not [w for w in caught if "args" in str(w.message) and "LightningCLI" in str(w.message)]
    assert sys.argv == ["lmc", "run", "--config", "x.yaml"]


@pytest.mark.parametrize("command", ["fit", "run"])
def test_a_yaml_syntax_error_names_the_file_and_line(command, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model: [unclosed\n")
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(bad)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{bad}: YAML syntax error at line 3" in line


def test_a_run_without_an_end_is_one_line(tmp_path, monkeypatch, capsys):
    """max_epochs -1 with max_steps -1 used to end in an OverflowError traceback from the schedule."""
    monkeypatch.chdir(tmp_path)
    argv = [
        "fit",
        "--config",
        str(CONFIGS / "experiment" / "digits_vit_ape.yaml"),
        "--config",
        str(CONFIGS / "debug" / "fast.yaml"),
    ]
    error = fails([*argv, "--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"], capsys)
    assert "has no end with trainer.max_epochs -1 and trainer.max_steps -1" in error


def test_fit_refuses_a_pretrained_checkpoint_of_another_rotary_layout(tmp_path, monkeypatch, capsys):
    """Same shapes, interleaved pairs where the model rotates halves: lmc fit used to train from it silently."""
    from lmc.data import Digits
    from lmc.training import LMCModule
    from lmc.training.module import save_trained

    monkeypatch.chdir(tmp_path)
    config = {"pe": "rope", "rope_layout": "interleaved", "width": 64}
    other = LMCModule("reference-vit", config, Digits().info)
    checkpoint = save_trained(other.model.state_dict(), dict(other.hparams), tmp_path / "interleaved.ckpt")
    argv = ["fit", "--config", str(CONFIGS / "experiment" / "digits_vit_rope.yaml")]
    error = fails(
        [*argv, "--config", str(CONFIGS / "debug" / "fast.yaml"), "--model.pretrained", str(checkpoint)], capsys
    )
    assert f"model.pretrained {checkpoint} is another model than this one (model_config" in error
    assert "'interleaved'" in error and "'half'" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["interleaved.ckpt"]  # nothing trained


def test_a_bad_value_inside_an_optional_list_is_one_line_with_its_reason(tmp_path, monkeypatch, capsys):
    """jsonargparse lists every Union subtype it tried; the reason used to come after 'Expected a NoneType'."""
    monkeypatch.chdir(tmp_path)
    argv = ["run", "--config", str(CONFIGS / "experiment" / "digits_vit_ape.yaml")]
    error = fails([*argv, "--protocol.alignments", "[{calibration_batches: 0}]"], capsys)
    assert error.startswith("lmc: error: calibration_batches must be an integer >= 1 or 'all', got 0")
    assert "NoneType" not in error and "Given value" not in error
