"""``lmc repro``: the study's configs, its checks, and its quick form end to end (resumed to the same bytes)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from lmc.adapters import model_spec
from lmc.cli import main
from lmc.experiments.protocol import Schedule, alignment_labels, experiment_cli
from lmc.experiments.study import Family, Study, load_study, schedule
from tests.cli import error_lines

ROOT = Path(__file__).resolve().parents[2]
STUDY, QUICK = "configs/study/repro.yaml", "configs/study/quick.yaml"


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)  # study configs name their files relative to the repository


def test_every_family_is_the_papers_six_layers_and_four_heads():
    study = load_study([STUDY])
    assert [family.name for family in study.families] == [
        "mnist_vit_ape",
        "mnist_vit_rope",
        "gpt2_ape",
        "llama_rope",
        "bible_bert_ape",
    ]
    assert study.family_strategies(study.families[-1]) == ["first_attention"]  # Table 1 only
    assert study.strategies == ["first_attention", "all_attention", "first_block", "full_model"]
    for family in study.families:
        cli = experiment_cli(study.arguments(family, "first_attention"), run=False)
        layers = model_spec(cli.model.model).attention
        assert len(layers) == 6 and {layer.num_heads for layer in layers} == {4}, family.name
        protocol = study.protocol(family, "first_attention", cli)
        assert protocol.seeds == (5 if family.table1 else 3)
        assert bool(protocol.head_orders) == family.table1
    assert all(family.table1 for family in study.families)  # Table 1 on every family with a barrier (#18)


def test_each_runs_protocol_shares_the_pretrained_model_and_trains_full_model_from_scratch():
    study = dataclasses.replace(load_study([STUDY]), output_dir="runs/x")
    family = study.families[2]
    cli = experiment_cli(study.arguments(family, "first_block"), run=False)  # without Table 1's protocol
    first, block, full = (
        study.protocol(family, strategy, cli) for strategy in ("first_attention", "first_block", "full_model")
    )
    assert first.pretrained is None and block.pretrained == "runs/x/gpt2_ape/first_attention/pretrain/final.ckpt"
    assert (first.output_dir, first.reinit) == ("runs/x/gpt2_ape/first_attention", "first_attention")
    assert not first.robustness and block.robustness and full.robustness
    # Everything re-initialized: trained as long as the pre-training, at the model's learning rate.
    assert full.finetune == Schedule(max_epochs=4, lr=cli.config.model.lr) != first.finetune
    assert study.protocol(family, "first_attention", cli, pretraining=True).alignments is None  # no methods


def test_a_run_parses_its_configs_once_and_is_given_its_protocol_as_an_object(monkeypatch, tmp_path):
    """No protocol setting travels as a command-line string (AlignOptions dumped to JSON) to be parsed back."""
    import lmc.experiments.protocol
    import lmc.experiments.run
    import lmc.experiments.study
    import lmc.experiments.study_config

    study = dataclasses.replace(load_study([STUDY]), output_dir=str(tmp_path))
    parsed, protocols = [], {}
    real = lmc.experiments.protocol.experiment_cli

    def counted(args, run=True):
        parsed.append(args)
        return real(args, run=run)

    monkeypatch.setattr(lmc.experiments.protocol, "experiment_cli", counted)
    monkeypatch.setattr(lmc.experiments.study_config, "experiment_cli", counted)
    clusters = []

    def run(self, cluster=None):
        protocols[self.protocol.reinit] = self
        clusters.append(cluster)

    monkeypatch.setattr(lmc.experiments.run.Experiment, "run", run)
    monkeypatch.setattr(lmc.experiments.study, "first_layer_inputs", lambda experiment: {})
    family = study.families[2]
    for strategy in study.strategies:
        lmc.experiments.study.run_strategy(study, family, strategy)
    assert len(parsed) == len(study.strategies)  # one parse per run
    assert {cluster.executor for cluster in clusters} == {"inline"}  # a run's stages stay in its job
    assert not [arg for args in parsed for arg in args if arg.startswith("--protocol.")]
    full = protocols["full_model"]
    assert full.protocol.finetune.max_epochs == full.protocol.pretrain.max_epochs == 4
    assert full.config.protocol.finetune.max_epochs == 4  # and the stages' configs record it


def test_the_methods_join_each_runs_own_alignments_on_their_strategies(monkeypatch, tmp_path):
    import lmc.experiments.run
    import lmc.experiments.study

    study = dataclasses.replace(load_study([STUDY]), output_dir=str(tmp_path))
    assert study.methods_strategies == ["first_attention", "first_block"]
    assert study.method_labels == [
        "full",
        "full-metric=activation-objective=data-unit_matching=activation",
        "learned",
    ]
    runs = {}
    monkeypatch.setattr(
        lmc.experiments.run.Experiment, "run", lambda self, cluster=None: runs.update({self.protocol.reinit: self})
    )
    monkeypatch.setattr(lmc.experiments.study, "first_layer_inputs", lambda experiment: {})
    for strategy in study.strategies:
        lmc.experiments.study.run_strategy(study, study.families[0], strategy)  # a Table 1 family
    labels = {
        strategy: lmc.experiments.run.alignment_labels(run.protocol.alignment_options) for strategy, run in runs.items()
    }
    table1 = ["permutation", "orthogonal", "full", "full-metric=weight", "full-metric=correlation"]
    table1 += ["full-metric=weight-objective=data", "full-metric=activation", "full-metric=midpoint"]  # on data
    table1 += ["full-metric=midpoint-calibration_batches=all"]  # on the whole training split
    assert labels == {
        "first_attention": table1 + study.method_labels[1:],
        "all_attention": ["full"],
        "first_block": study.method_labels,
        "full_model": ["full"],
    }
    assert runs["full_model"].protocol.finetune.max_epochs == runs["full_model"].protocol.pretrain.max_epochs


def test_the_schedule_pretrains_first_then_runs_the_largest_runs_first():
    study = load_study([STUDY])
    tasks = schedule(study)
    names = [task.name for task in tasks]
    assert len(set(names)) == len(names) == sum(1 + len(study.family_strategies(f)) for f in study.families)
    families = len(study.families)
    assert names[:families] == [f"{family.name}/pretrain" for family in study.families]
    # The Table 1 runs first (every family's first_attention), the last family listed first.
    assert names[families : 2 * families] == [f"{family.name}/first_attention" for family in study.families[::-1]]
    runs = tasks[2 * families :]
    extras = [(task.strategy in study.methods_strategies) + (task.strategy in study.robustness) for task in runs]
    assert extras == sorted(extras, reverse=True)  # then the runs with more to measure
    assert tasks[-1].strategy == "all_attention"
    # Where the pre-training and its log go: the first strategy's run folder, which every run reads.
    assert tasks[0].log(study) == Path(study.output_dir) / "mnist_vit_ape" / "first_attention" / "log.txt"
    assert (
        study.pretrained(study.families[0])
        == Path(study.output_dir) / "mnist_vit_ape/first_attention/pretrain/final.ckpt"
    )


def test_a_family_runs_only_its_own_strategies_and_pretrains_in_the_studys_first():
    strategies = ["first_attention", "first_block", "full_model"]
    short = Family(
        "short", "ViT, Table 1 only", "configs/study/vit_ape.yaml", strategies=["full_model", "first_attention"]
    )
    whole = Family("whole", "ViT, RoPE", "configs/study/vit_rope.yaml")
    study = Study(families=[short, whole], strategies=strategies)
    assert study.family_strategies(short) == ["first_attention", "full_model"]  # the study's order
    assert study.family_strategies(whole) == strategies
    names = [task.name for task in schedule(study)]
    assert sorted(names) == sorted(
        ["short/pretrain", "whole/pretrain", "short/first_attention", "short/full_model"]
        + [f"whole/{strategy}" for strategy in strategies]
    )
    assert study.pretrained(short) == Path("runs/repro/short/first_attention/pretrain/final.ckpt")
    with pytest.raises(ValueError, match=r"strategies \['all_attention'\] are not the study's"):
        Study(
            families=[dataclasses.replace(short, strategies=["first_attention", "all_attention"])],
            strategies=strategies,
        )
    with pytest.raises(ValueError, match="leave out first_attention, the study's first strategy"):
        Study(families=[dataclasses.replace(short, strategies=["first_block"])], strategies=strategies)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strategies": ["first_layer"]}, "first_layer"),
        ({"seeds": 1}, "at least 2"),
        ({"families": []}, "at least one family"),
        ({"overlays": ["configs/study/missing.yaml"]}, "configs/study/missing.yaml does not exist"),
        ({"report": "configs/study/repro.yaml"}, "must be a Markdown file"),
        ({"methods_strategies": ["first_blocks"]}, "first_blocks"),
    ],
)
def test_bad_studies_are_refused_by_name(change, message):
    study = load_study([STUDY])
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        dataclasses.replace(study, **change)


def test_a_familys_configs_follow_its_experiment_config_and_must_exist(tmp_path):
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text("model: {model_config: {pe: learned, width: 16, head_dim: 16}}\n")
    family = Family("narrow", "ViT, width 16", "configs/study/vit_ape.yaml", configs=[str(narrow)])
    study = Study(families=[family], strategies=["first_attention"])
    layer = model_spec(experiment_cli(study.arguments(family, "first_attention"), run=False).model.model)
    assert {(a.width, a.num_heads, a.head_dim) for a in layer.attention} == {(16, 4, 16)}
    with pytest.raises(FileNotFoundError, match="missing.yaml does not exist"):
        Study(families=[dataclasses.replace(family, configs=["configs/study/missing.yaml"])])


def test_family_names_must_be_unique():
    family = Family("vit_ape", "ViT", "configs/study/vit_ape.yaml")
    with pytest.raises(ValueError, match="unique"):
        Study(families=[family, family])


QUICK_RUNS = "configs/study/quick_runs.yaml"


def _overlay(tmp_path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def _sharing(tmp_path, *extra: Family, **changes) -> Study:
    """A tiny study of two families of one pre-training: the whole fine-tuning half, and 64 of its samples."""
    fewer = _overlay(tmp_path, "fewer", "protocol: {finetune: {samples: 64}}\n")
    families = [
        Family("whole", "ViT, digits, RoPE", "configs/study/vit_rope.yaml"),
        Family(
            "fewer",
            "ViT, digits, RoPE, 64 samples",
            "configs/study/vit_rope.yaml",
            configs=[fewer],
            pretrained_by="whole",
        ),
        *extra,
    ]
    settings = dict(strategies=["first_attention"], seeds=2, overlays=[QUICK_RUNS], output_dir=str(tmp_path / "runs"))
    return Study(families=families, **{**settings, "report": str(tmp_path / "r.md"), **changes})


def test_a_family_pretrained_by_another_has_no_pretraining_and_its_runs_start_from_the_others(tmp_path):
    from lmc.experiments.study import _task_job

    study = _sharing(tmp_path, strategies=["first_attention", "full_model"])
    whole, fewer = study.families
    assert (
        study.pretrained(fewer)
        == study.pretrained(whole)
        == tmp_path / "runs/whole/first_attention/pretrain/final.ckpt"
    )
    tasks = schedule(study)
    assert [task.name for task in tasks if task.strategy is None] == ["whole/pretrain"]
    assert sorted(task.name for task in tasks if task.strategy) == sorted(
        f"{family}/{strategy}" for family in ("whole", "fewer") for strategy in ("first_attention", "full_model")
    )
    for task in tasks:
        assert _task_job(study, task, []).after == (() if task.strategy is None else ("whole/pretrain",))
    for strategy in study.strategies:  # every run of the sharing family, its first strategy's too
        cli = experiment_cli(study.arguments(fewer, strategy), run=False)
        assert study.protocol(fewer, strategy, cli).pretrained == str(study.pretrained(whole))
    first = experiment_cli(study.arguments(whole, "first_attention"), run=False)
    assert study.protocol(whole, "first_attention", first).pretrained is None


@pytest.mark.parametrize(
    ("families", "message"),
    [
        ([("a", None), ("b", "c")], "family b: pretrained_by 'c' is not a family of the study; choose one of a"),
        ([("a", None), ("b", "b")], "family b names itself in pretrained_by: drop the setting to pre-train it"),
        (
            [("a", None), ("b", "a"), ("c", "b")],
            "family c: pretrained_by 'b' names a family that does not pre-train itself (its pretrained_by is 'a'): "
            "name 'a' instead",
        ),
        (
            [("a", "b"), ("b", "a")],
            "family a: pretrained_by 'b' names a family that does not pre-train itself (its pretrained_by is 'a'): "
            "one of the two must pre-train: drop its pretrained_by",
        ),
    ],
)
def test_a_pretrained_by_that_names_no_pretraining_family_is_refused(families, message):
    made = [Family(name, name, "configs/study/vit_rope.yaml", pretrained_by=by) for name, by in families]
    with pytest.raises(ValueError, match=re.escape(message)):
        Study(families=made, strategies=["first_attention"])


@pytest.mark.parametrize(
    "change",
    ["protocol: {pretrain: {lr: 0.01}}", "model: {model_config: {width: 32}}", "data: {init_args: {seed: 3}}"],
)
def test_a_family_whose_pretraining_differs_from_the_one_it_reuses_is_refused_naming_both(tmp_path, change):
    other = Family(
        "other",
        "other",
        "configs/study/vit_rope.yaml",
        configs=[_overlay(tmp_path, "o", change)],
        pretrained_by="whole",
    )
    message = (
        "family other reuses the pre-trained model of whole, whose pre-training is another than its own (model, data, "
        "trainer or protocol.pretrain differ): make the two pre-train alike, or drop pretrained_by to pre-train other"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _sharing(tmp_path, other)
    _sharing(tmp_path)  # a fine-tuning of another size shares the pre-training


def test_a_shared_pretraining_is_trained_once_and_every_fine_tune_starts_from_it(tmp_path):
    from lmc.adapters import scope_parameters
    from lmc.checkpoints import read_state_dict
    from lmc.experiments.jobs import Cluster
    from lmc.experiments.study import run_study
    from lmc.training.cli import instantiate_data
    from lmc.training.module import load_trained

    study = _sharing(tmp_path)
    run_study(study, jobs=1, cluster=Cluster(executor="inline"))
    runs = tmp_path / "runs"
    trained = [path.relative_to(runs) for path in runs.rglob("pretrain/final.ckpt")]
    assert trained == [Path("whole/first_attention/pretrain/final.ckpt")]  # and no pretrain folder of fewer
    assert not list((runs / "fewer").rglob("pretrain")) and (runs / "fewer" / "first_attention" / "seed1").is_dir()
    pretrained = read_state_dict(study.pretrained(study.families[0]))
    for family in study.families:
        experiment = study.experiment(family, "first_attention")
        stages = experiment.finetune_stages()
        whole = len(instantiate_data(experiment.config).split("train"))  # the training split, part all
        samples = {"whole": whole - whole // 2, "fewer": 64}[family.name]  # half B, or 64 of its samples
        for stage in stages:
            module, _ = load_trained(stage.checkpoint(experiment.root))
            reinitialized = set(scope_parameters(module.model, "first_attention"))
            tuned = read_state_dict(stage.checkpoint(experiment.root))
            frozen = [name for name in tuned if name not in reinitialized]
            assert frozen and all(torch.equal(tuned[name], pretrained[name]) for name in frozen), family.name
            assert any(not torch.equal(tuned[name], pretrained[name]) for name in tuned if name not in frozen)
            assert len(instantiate_data(stage.config).split("train")) == samples, family.name
        assert (runs / family.name / "first_attention" / "summary.json").is_file()


SENSITIVITY, SENSITIVITY_QUICK = "configs/study/sensitivity.yaml", "configs/study/sensitivity_quick.yaml"


def test_the_sensitivity_study_spans_8x_in_fine_tuning_samples_and_length_on_each_family():
    from lmc.training.cli import instantiate_data

    study = load_study([SENSITIVITY])
    assert study.strategies == ["first_attention"] and study.table1_seeds == 5  # 10 pairs per point
    assert [task.name for task in schedule(study) if task.strategy is None] == [
        "mnist_vit_ape/pretrain", "gpt2_ape/pretrain"
    ]  # fmt: skip
    for base in ("mnist_vit_ape", "gpt2_ape"):
        points = [family for family in study.families if family.name == base or family.pretrained_by == base]
        settings = {}
        for family in points:
            assert family.table1 and family.experiment == study.family(base).experiment
            experiment = study.experiment(family, "first_attention")
            assert experiment.protocol.head_orders and experiment.protocol.seeds == 5
            assert alignment_labels(experiment.protocol.alignment_options) == ["permutation", "orthogonal", "full"]
            stage = experiment.finetune_stage(0, study.pretrained(family), "")
            samples = len(instantiate_data(stage.config).split("train"))
            epochs = stage.config.trainer.max_epochs
            settings[family.name] = (samples, epochs)
            assert f"{samples:,} fine-tuning samples, {epochs} epoch" in family.title, family.title
        half, default = settings[base]
        whole = len(instantiate_data(experiment.config).split("train"))  # part all
        assert half == whole - whole // 2  # half B
        sizes = sorted(samples for samples, epochs in settings.values() if epochs == default)
        lengths = sorted(epochs for samples, epochs in settings.values() if samples == half)
        assert sizes == [round(half * share) for share in (1 / 8, 1 / 4, 1 / 2, 1)], base
        assert len(lengths) == 4 and lengths[-1] == 8 * lengths[0] and default in lengths, base
        assert len(settings) == 7  # the default point once, three other sizes, three other lengths


def test_table1_has_a_column_only_for_the_variants_run():
    from lmc.experiments.report.table1 import table1_section

    stats = {"mean": 2.0, "std": 0.5, "min": 1.0, "max": 3.0, "count": 2}
    entry = {name: stats for name in ("rank", "rank_within_noise", "l_hat")} | {"ties": 1, "noise_pairs": 2}
    orders = {"orders": 8, "alignments": {"full": {"loss_barrier": entry, "accuracy_barrier": entry}}}
    ratio = {"barrier_ratio": {"loss_barrier": stats, "accuracy_barrier": stats}}
    alignments = {"full": ratio, "permutation": ratio}
    for label, alphas in (("full", 25), ("permutation", 13)):  # protocol.alignment_alphas: 13
        alignments[label] = {**ratio, "mean_curves": {"aligned": [{"alpha": k / (alphas - 1)} for k in range(alphas)]}}
    summary = {"pairs": ["0_1", "0_2"], "head_orders": orders, "alignments": alignments}
    family = Family("x", "Llama, 8 orders", "configs/study/llama_rope.yaml")
    lines = table1_section([(family, summary)])
    assert "Curves on 13 alphas: `permutation`; 25 alphas: `full` (each ratio against the naive barrier on the " in (
        "\n".join(lines)
    )
    header = next(line for line in lines if line.startswith("| family | pairs |"))
    assert "Variant 1 (Stage 1 only) | full |" in header and "Variant 2" not in header
    row = next(line for line in lines if line.startswith("| Llama, 8 orders | 2 | 8 | 2.0 ± 0.5 |"))
    assert row.count("|") == header.count("|") and row.endswith("| 2.0 ± 0.5 % | 2.0 ± 0.5 % |")
    assert (
        "| paper (ViT/BERT, 4 data sets) | 10 | 24 | low | n/a | n/a | near 0 | low | near 0 | 62-91 % | 7-12 % |"
        in lines
    )


def _stats(mean: float, std: float, count: int = 10) -> dict:
    return {"mean": mean, "std": std, "min": mean - std, "max": mean + std, "count": count}


def _stage1_run(title: str, name: str, **settings: tuple[float, float, float]) -> tuple:
    """A Table 1 run of 10 pairs whose Stage 1 settings (``invariant`` or ``metric=...``) have the given
    rank within noise, ``L_hat`` and difference from the held-out pick's ``L_hat`` (means; fixed stds)."""
    orders = {}
    for setting, (within, l_hat, difference) in settings.items():
        halves = {score: {"stage1": _stats(l_hat, 1.0), "held_out": _stats(l_hat - difference, 1.0),
                          "difference": _stats(difference, 3.0)} for score in ("rank", "l_hat")}  # fmt: skip
        loss = {"rank": _stats(within + 2, 1.0), "rank_within_noise": _stats(within, 0.5), "l_hat": _stats(l_hat, 2.0)}
        label = "full" if setting == "invariant" else f"full-{setting}"
        orders[label] = {"loss_barrier": loss | {"halves": {"pairs": 10, **halves}}}
    pairs = [f"0_{k}" for k in range(1, 11)]
    return Family(name, title, "configs/study/llama_rope.yaml"), {"pairs": pairs, "head_orders": {"alignments": orders}}


def test_the_held_out_section_tells_the_held_out_pick_apart_only_beyond_the_interval_over_pairs():
    from lmc.experiments.report.findings import held_out_section

    # Differences' std 3.0 over 10 pairs: the 95 % interval is the mean ± 2.262 * 3.0 / sqrt(10) = ± 2.15.
    runs = [
        _stage1_run("A", "a", invariant=(1.0, 9.0, 6.0), **{"metric=weight": (1.0, 5.0, -6.0)}),
        _stage1_run("B", "b", invariant=(1.0, 9.0, 1.0)),
    ]
    lines = held_out_section(runs)
    # rank and L_hat on a half, Stage 1's then the held-out pick's (each with the std 1.0 of _stage1_run)
    pairs = ((9, 3), (5, 11), (9, 8))
    halves = [f"| {a:.1f} ± 1.0 | {b:.1f} ± 1.0 | {a:.1f} ± 1.0 | {b:.1f} ± 1.0 |" for a, b in pairs]
    rows = {
        f"| A | `invariant` | 10 {halves[0]} 6.0 ± 3.0 [3.9, 8.1] ": "held-out pick better",
        f"| A | `metric=weight` | 10 {halves[1]} -6.0 ± 3.0 [-8.1, -3.9] ": "Stage 1 better",
        f"| B | `invariant` | 10 {halves[2]} 1.0 ± 3.0 [-1.1, 3.1] ": "not told apart",
    }
    for row, better in rows.items():
        assert f"{row}| {better} |" in lines, row
    assert held_out_section([(runs[0][0], {"head_orders": {"alignments": {}}})]) == []  # nothing measured


def test_the_finding_section_gives_each_verdict_its_interval_and_counts_a_setting_only_off_its_family():
    from lmc.experiments.report.findings import finding_section

    # L_hat's std 2.0 over 10 pairs: the interval is the mean ± 1.43; rank within noise's 0.5: ± 0.36.
    picked = "metric=midpoint-calibration_batches=all"
    runs = [
        _stage1_run("A", "a", invariant=(1.0, 5.0, 0.0), **{picked: (1.0, 5.0, 0.0)}),  # met, both
        _stage1_run("B", "b", invariant=(1.0, 9.0, 0.0), **{picked: (1.0, 5.0, 0.0)}),  # 9 + 1.43 holds 10 %
        _stage1_run("C", "c", invariant=(1.0, 12.0, 0.0)),  # 12 - 1.43 is over 10 %: missed
    ]
    lines = finding_section(runs, {picked: "b"})
    met = "| 3.0 ± 1.0 | 1.0 ± 0.5 [0.6, 1.4] | 5.0 ± 2.0 % [3.6, 6.4] | met |"
    assert f"| A | `invariant` | before the study | 10 {met}" in lines
    assert f"| A | `{picked}` | B | 10 |" in "\n".join(lines)
    here = [line for line in lines if line.startswith(f"| B | `{picked}` | B |")]
    assert len(here) == 1 and here[0].endswith("| met (picked here: no evidence) |")
    assert any(line.startswith("| B | `invariant` |") and line.endswith("| unresolved |") for line in lines)
    assert any(line.startswith("| C | `invariant` |") and line.endswith("| missed |") for line in lines)
    assert (
        "- A: the paper's cost (`invariant`) met (raw rank 3.0 ± 1.0, within noise 1.0 ± 0.5 [0.6, 1.4]); against "
        f"the held-out pick: not told apart; met by `{picked}`." in lines
    )
    assert (
        "- B: the paper's cost (`invariant`) unresolved (raw rank 3.0 ± 1.0, within noise 1.0 ± 0.5 [0.6, 1.4]); "
        f"against the held-out pick: not told apart; met by no other Stage 1 setting (also by `{picked}`, picked "
        "on B: no evidence here)." in lines
    )


def test_the_refinement_line_weighs_each_rise_against_the_evaluation_noise():
    from lmc.experiments.report.table1 import refinement_lines

    def alignment(loss_barriers: dict[str, float]) -> dict:
        return {"per_pair": {pair: {"aligned": {"loss_barrier": b}} for pair, b in loss_barriers.items()}}

    start = alignment({"0_1": 0.50, "0_2": 0.40, "1_2": 0.30})
    refined = alignment({"0_1": 0.60, "0_2": 0.401, "1_2": 0.20})  # 0_1 and 0_2 raised, 1_2 lowered
    family = Family("x", "ViT, digits", "configs/study/vit_ape.yaml")
    summary = {"alignments": {"orthogonal": start, "full": refined}}
    before = "- ViT, digits: the refinement (full) raised the loss barrier of its orthogonal start (Variant 2) "
    assert refinement_lines([(family, summary)]) == [before + "in 2 of 3 pairs (0_1, 0_2)."]

    def noise(gap: float, std: float, raised: bool, lowered: bool) -> dict:
        return {"loss_barrier": {"gap": gap, "gap_std": std, "raised": raised, "lowered": lowered}}

    measured = {"0_1": noise(0.1, 0.02, True, False), "0_2": noise(0.001, 0.01, False, False)}
    summary["refinement"] = {"per_pair": measured | {"1_2": noise(-0.1, 0.02, False, True)}}
    beyond = (
        ", of which 1 beyond the evaluation noise (higher in at least 97.5% of 1000 bootstrap draws of the "
        "evaluated samples: 0_1 +0.100 ± 0.020 nats), and lowered it beyond the noise in 1 of 3."
    )
    assert refinement_lines([(family, summary)]) == [before + "in 2 of 3 pairs (0_1, 0_2)" + beyond]
    summary["refinement"] = {"per_pair": measured}  # 1_2's batches were not recorded
    assert refinement_lines([(family, summary)]) == [
        before + "in 2 of 3 pairs (0_1, 0_2)" + beyond.replace("1 of 3.", "0 of 2 (noise measured in 2 of 3 pairs).")
    ]
    # Nothing raised: only the falls are weighed.
    summary["alignments"]["full"] = alignment({"0_1": 0.40, "0_2": 0.30, "1_2": 0.20})
    summary["refinement"] = {"per_pair": {pair: noise(-0.1, 0.02, False, pair != "0_2") for pair in start["per_pair"]}}
    assert refinement_lines([(family, summary)]) == [
        before + "in 0 of 3 pairs, and lowered it beyond the evaluation noise (lower in at least 97.5% of 1000 "
        "bootstrap draws of the evaluated samples) in 2 of 3."
    ]


@pytest.mark.slow
def test_the_sensitivity_study_runs_in_its_tiny_form(tmp_path):
    from lmc.experiments.jobs import Cluster
    from lmc.experiments.study import repro
    from lmc.training.cli import instantiate_data

    study = load_study([SENSITIVITY, SENSITIVITY_QUICK])
    names = [
        "mnist_vit_ape",
        "mnist_vit_ape_samples_219",
        "mnist_vit_ape_epochs_80",
        "gpt2_ape",
        "gpt2_ape_samples_410",
    ]
    families = [study.family(name) for name in names]
    outputs = {"output_dir": str(tmp_path / "runs"), "report": str(tmp_path / "r.md")}
    repro([SENSITIVITY, SENSITIVITY_QUICK], 1, {"families": families, **outputs}, Cluster(executor="inline"))
    trained = sorted(path.relative_to(tmp_path / "runs") for path in (tmp_path / "runs").rglob("pretrain/final.ckpt"))
    assert trained == [Path(f"{name}/first_attention/pretrain/final.ckpt") for name in ("gpt2_ape", "mnist_vit_ape")]
    report = (tmp_path / "r.md").read_text()
    assert report.startswith("# Sensitivity: the first attention layer against the fine-tuning data and length\n")
    table1 = report.split("## Table 1")[1].split("## Appendix K")[0]
    for family in families:  # one pair per point; 4! head orders
        assert f"| {family.title} | 1 | 24 | " in table1, family.title
    assert "| Variant 1 (Stage 1 only) | Variant 2 (orthogonal start) | full |" in table1
    fewer = dataclasses.replace(study, families=families, **outputs).experiment(families[1], "first_attention")
    assert [len(instantiate_data(stage.config).split("train")) for stage in fewer.finetune_stages()] == [219, 219]
    # The report's data file records what each point fine-tuned on; another study's report lays it out.
    data = json.loads((tmp_path / "r" / "table1.json").read_text())
    points = {p["name"]: (p["group"], p["finetune_samples"], p["finetune_epochs"]) for p in data["families"]}
    assert points == {
        "mnist_vit_ape": ("mnist_vit_ape", 1750, 1),
        "mnist_vit_ape_samples_219": ("mnist_vit_ape", 219, 1),
        "mnist_vit_ape_epochs_80": ("mnist_vit_ape", 1750, 1),  # the tiny form trains 1 epoch
        "gpt2_ape": ("gpt2_ape", 3278, 1),
        "gpt2_ape_samples_410": ("gpt2_ape", 410, 1),
    }
    assert data["tasks"] == len(json.loads((tmp_path / "runs" / "times.json").read_text()))
    # ... and its own report lays its points out (they share pre-trainings), by samples and by length
    assert "## Sensitivity: fine-tuning data and length" in report
    assert "| fine-tuning samples (at 1 epoch) | pairs |" in report and "\n| 219 | 1 | " in report
    assert "## Robustness" not in report  # no run of the study measured it


@pytest.mark.slow
def test_quick_study_writes_the_report_and_a_rerun_reproduces_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: the packaged configs, the outputs where asked
    outputs = ["--output_dir", str(tmp_path / "runs"), "--report", str(tmp_path / "r.md")]
    args = ["repro", "--study", STUDY, "--quick", "true", "--jobs", "2", *outputs]  # one study file, not a list
    main(args)
    assert not (tmp_path / "runs" / "repro_quick").exists() and not (tmp_path / "docs").exists()
    report = (tmp_path / "r.md").read_text()
    assert report.startswith("# Results: the paper's study at small scale\n")
    machine = json.loads((tmp_path / "runs" / "machine.json").read_text())  # where the numbers come from
    assert machine["threads"] == 1 and f" Computed on {machine['processor']} ({machine['kernels']} kernels" in report
    # The quick form's curves use 8 samples of each validation split, and the report says so.
    for config, split_samples in (("vit_rope", 269), ("llama_rope", 364)):
        curves_on = f"val, 8 of {split_samples} samples, evenly spaced"
        assert f"| `configs/study/{config}.yaml` | first_attention, full_model | {curves_on} |" in report
    # Table 1 of both families, over the head orders that keep GQA groups (4! of the ViT's heads; 2! * 2! * 2! of
    # the Llama's 4 query heads on 2 key/value heads); both strategies of both families; robustness of full_model.
    table1 = report.split("## Table 1")[1].split("## Appendix K")[0]
    assert "| ViT, digits, RoPE | 1 | 24 |" in table1 and "| Llama, byte LM, RoPE (GQA 4/2) | 1 | 8 |" in table1
    assert "| paper (ViT/BERT, 4 data sets) | 10 | 24 |" in table1
    strategies = report.split("## The four re-initialization strategies")[1].split("## Robustness")[0]
    for name, title in (("vit_rope", "ViT, digits, RoPE"), ("llama_rope", "Llama, byte LM, RoPE (GQA 4/2)")):
        for strategy in ("first_attention", "full_model"):
            assert f"| {title} | {strategy} | 1 |" in strategies
        assert f"### {title}, full_model: aligned > naive in " in report
        assert (tmp_path / "r" / f"{name}.png").is_file()
    methods = report.split("## Beyond the paper")[1].split("## Robustness")[0]
    labels = "| `full` | `full-metric=activation-objective=data-unit_matching=activation-calibration_batches=2` |"
    assert labels in methods
    for title in ("ViT, digits, RoPE", "Llama, byte LM, RoPE (GQA 4/2)"):
        assert f"| {title} | first_attention | 1 | train, " in methods
    # 2 batches of 32 (the methods), 8 (the Table 1 run's data-aware Stage 1 settings, at their default) and the
    # whole training split (the midpoint metric on all batches: the fine-tuning half's 630 digits)
    assert "| ViT, digits, RoPE | first_attention | 1 | train, 64/256/630 samples |" in methods
    assert "The best method is at or below 5 % in " in methods and " runs with a naive barrier" in methods
    times = (tmp_path / "r" / "alignment_seconds.md").read_text()
    assert "| ViT, digits, RoPE | first_attention | " in times
    checkpoints = sorted((tmp_path / "runs").rglob("final.ckpt"))
    stamps = [path.stat().st_mtime_ns for path in checkpoints]
    # Pre-trained once per family, then 2 seeds per strategy.
    assert len(checkpoints) == 2 * (1 + 2 * 2)

    times = json.loads((tmp_path / "runs" / "times.json").read_text())
    assert len(times) == 2 + 2 * 2  # every pre-training and run

    (tmp_path / "r.md").unlink()
    main(args)  # resumes: nothing is trained again, and the same runs give the same report
    assert [path.stat().st_mtime_ns for path in checkpoints] == stamps
    assert (tmp_path / "r.md").read_text() == report
    assert json.loads((tmp_path / "runs" / "times.json").read_text()) == times  # the skipped tasks keep theirs

    # Summarized again, running nothing (a newer lmc's measures reach finished runs): the same
    # summaries and report, no fit again, and the runs keep their recorded times.
    summaries = {path: path.read_bytes() for path in (tmp_path / "runs").rglob("summary.json")}
    for path in summaries:
        path.unlink()
    (tmp_path / "r.md").unlink()
    main([*args, "--summarize", "true"])
    assert {path: path.read_bytes() for path in summaries if path.is_file()} == summaries
    assert (tmp_path / "r.md").read_text() == report and [p.stat().st_mtime_ns for p in checkpoints] == stamps
    assert json.loads((tmp_path / "runs" / "times.json").read_text()) == times
    # A run with a pair not finished is not summarized: it names the pair and the fix.
    pair = next((tmp_path / "runs").rglob("pairs/0_1"))
    shutil.rmtree(pair)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*args, "--summarize", "true"])
    assert "pair0_1 not finished, so there is nothing to summarize again: run it first" in capsys.readouterr().err
    main(args)  # resumes that pair: its run adds the time it took to its recorded one, the others keep theirs
    resumed = json.loads((tmp_path / "runs" / "times.json").read_text())
    task = str(pair.parents[1].relative_to(tmp_path / "runs"))
    assert resumed[task] > times[task] and {k: v for k, v in resumed.items() if k != task} == {
        k: v for k, v in times.items() if k != task
    }


def test_a_study_file_that_does_not_parse_is_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("study:\n  strategies: [first_layer]\n")
    for study, message in ((f'["{STUDY}", "{bad}"]', "first_layer"), ('["configs/study/nope.yaml"]', "nope.yaml")):
        with pytest.raises(SystemExit) as exit_info:
            main(["repro", "--study", study])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and error.startswith("lmc: error: study ") and message in error, error


def test_a_task_whose_config_its_parser_refuses_is_one_line_naming_it_and_its_log(tmp_path, capsys):
    bad = tmp_path / "bad_key.yaml"
    bad.write_text("model: {model_konfig: {width: 16}}\n")
    study = tmp_path / "study.yaml"
    family = {"name": "v", "title": "V", "experiment": "configs/study/vit_ape.yaml", "configs": [str(bad)]}
    runs = {"output_dir": str(tmp_path / "runs"), "report": str(tmp_path / "r.md")}
    study.write_text(yaml.safe_dump({"study": {"families": [family], "strategies": ["first_attention"], **runs}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["repro", "--study", f'["{study}"]', "--jobs", "1"])
    assert exit_info.value.code == 2
    error = error_lines(capsys.readouterr().err)
    log = tmp_path / "runs" / "v" / "first_attention" / "log.txt"
    assert len(error.splitlines()) == 1 and error.startswith("lmc: error: v/pretrain stopped with status 2: "), error
    assert "model_konfig" in error and str(log) in error and not (tmp_path / "r.md").exists()


@pytest.mark.parametrize(
    ("protocol", "problem"),
    [
        ({"finetune": {"samples": 5000}}, "protocol.finetune.samples: train_samples=5000 is more than the "),
        (
            {"alignments": [{"method": "full", "head_orders": {3: [0, 1, 2, 3]}}]},
            "head_orders names attention layer(s) [3], but scope 'first_attention' aligns layers [0]",
        ),
    ],
    ids=["finetune-samples", "head-order-of-an-unaligned-layer"],
)
def test_every_runs_settings_are_checked_before_any_job(tmp_path, capsys, protocol, problem):
    """lmc run refused them before any training; lmc repro pre-trained first, and its run failed after."""
    overlay = _overlay(tmp_path, "bad_protocol", yaml.safe_dump({"protocol": protocol}))
    family = {"name": "v", "title": "V", "experiment": "configs/study/vit_rope.yaml", "configs": [overlay]}
    runs = {"output_dir": str(tmp_path / "runs"), "report": str(tmp_path / "r.md"), "overlays": [QUICK_RUNS]}
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({"study": {"families": [family], "strategies": ["first_attention"], **runs}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["repro", "--study", f'["{study}"]', "--jobs", "1"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("lmc: error: run v/first_attention (configs "), error
    assert overlay in error and problem in error
    assert not (tmp_path / "runs").exists()


def test_a_study_reads_the_packaged_configs_from_any_working_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    study = load_study([STUDY, QUICK])
    packaged = ROOT / "configs" / "study"
    assert [Path(family.experiment).resolve() for family in study.families] == [
        (packaged / f"{family.name}.yaml").resolve() for family in study.families
    ]
    assert Path(study.table1).resolve() == (ROOT / "configs" / "protocol" / "table1.yaml").resolve()
    # A file of the working folder comes first: the user's own quick form.
    own = tmp_path / "configs" / "study" / "quick.yaml"
    own.parent.mkdir(parents=True)
    own.write_text(yaml.safe_dump({"study": {"seeds": 4, "output_dir": str(tmp_path / "mine")}}))
    mine = load_study([STUDY, QUICK])
    assert (mine.seeds, mine.output_dir) == (4, str(tmp_path / "mine"))
    with pytest.raises(FileNotFoundError, match="configs/study/missing.yaml does not exist"):
        load_study([STUDY, "configs/study/missing.yaml"])


ORPHAN_SCRIPT = """
import functools, os, sys, time
from pathlib import Path
from lmc.experiments.jobs import Cluster, Job, run_jobs

def report_pid_then_sleep(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    job = Job("sleeper", functools.partial(report_pid_then_sleep, sys.argv[1]))
    run_jobs([job], Cluster(executor="local"), Path(sys.argv[2]), threads=1)
"""


def test_a_killed_study_leaves_no_worker_behind(tmp_path):
    """kill -9 of lmc repro used to leave its workers running as orphans, writing into the run folders;
    a local job now ends with the command that submitted it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script, pid_file = tmp_path / "study.py", tmp_path / "worker.pid"
    script.write_text(ORPHAN_SCRIPT)
    command = [sys.executable, str(script), str(pid_file), str(tmp_path / "jobs")]
    parent = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = int(pid_file.read_text())
        os.kill(worker, 0)  # running
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError(f"worker {worker} outlived its killed parent by 10 s")
    finally:
        parent.kill()


def test_two_studies_never_share_an_output_folder(tmp_path, monkeypatch):
    from lmc.experiments.study import run_study
    from lmc.io import FolderInUseError, folder_lock

    study = dataclasses.replace(load_study([STUDY, QUICK]), output_dir=str(tmp_path / "study"))
    with folder_lock(tmp_path / "study", "lmc repro"), pytest.raises(FolderInUseError, match="another lmc repro"):
        run_study(study, jobs=1)


def test_a_study_gives_each_job_one_gpu(tmp_path, monkeypatch):
    import lmc.experiments.study
    from lmc.experiments.jobs import Cluster

    submitted = {}
    monkeypatch.setattr(
        lmc.experiments.study,
        "run_jobs",
        lambda jobs, cluster, *args, **kwargs: submitted.update(cluster=cluster) or {},
    )
    study = dataclasses.replace(load_study([STUDY, QUICK]), output_dir=str(tmp_path / "study"))
    lmc.experiments.study.run_study(study, jobs=1, cluster=Cluster(executor="slurm", gpus_per_job=1))
    assert submitted["cluster"].fit_tasks == 1 and submitted["cluster"].gpus_per_job == 1
