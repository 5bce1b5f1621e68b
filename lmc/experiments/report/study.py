"""The report of a study (:mod:`lmc.experiments.study`): ``docs/results.md`` and its figures, beside the paper's.

Everything in the report is read from the run folders' ``summary.json`` files, so the same runs
give the same bytes. Numbers are means ± sample standard deviations over pairs of fine-tuned
seeds (the study's error bar); a ratio is ``aligned barrier / naive barrier * 100`` per pair.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lmc.configs import spelled
from lmc.connectivity import NO_BARRIER
from lmc.experiments.report.cells import cell, curve_alphas_text
from lmc.experiments.report.findings import findings_sections
from lmc.experiments.report.run_summary import no_barrier_lines, robustness_table
from lmc.experiments.report.sensitivity import TABLE1_DATA, sensitivity_section, table1_data
from lmc.experiments.report.table1 import appendix_k_section, table1_section
from lmc.experiments.stats.summary import ROBUSTNESS, AlignmentSummary, alignments_of
from lmc.experiments.study_config import FIRST_LAYER_INPUTS, MACHINE, TIMES, recorded
from lmc.io import atomic_write, atomic_write_json, atomic_write_text, nan_for_null

PAPER_STRATEGIES = {
    "first_attention": "LMC after alignment",
    "all_attention": "LMC after alignment",
    "first_block": "LMC after alignment (not ImageNet)",
    "full_model": "LMC on small data only",
}


def _curve_samples(runs: dict[str, dict[str, Any]]) -> str:
    """Where a family's curves are measured, e.g. ``val, 182 of 364 samples, evenly spaced`` (the same
    for every strategy: they share the family's experiment config)."""
    if not runs:
        return "n/a"
    protocol = next(iter(runs.values()))["protocol"]
    used, whole = protocol["curve_samples"], protocol["split_samples"]
    samples = f"{used} of {whole} samples, evenly spaced" if used < whole else f"{whole} samples"
    return f"{protocol['split']}, {samples}"


def _summaries(study) -> dict[str, dict[str, dict[str, Any]]]:
    """``family -> strategy -> summary.json`` of every finished run (missing ones are skipped)."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for family in study.families:
        for strategy in study.family_strategies(family):
            path = Path(study.output_dir) / family.name / strategy / "summary.json"
            if path.is_file():
                found.setdefault(family.name, {})[strategy] = nan_for_null(json.loads(path.read_text()))
    return found


def _runs(study, summaries, strategies: list[str] | None = None):
    """``(family, strategy, summary)`` of every finished run, in the study's order."""
    for family in study.families:
        for strategy in strategies or study.family_strategies(family):
            if summary := summaries.get(family.name, {}).get(strategy):
                yield family, strategy, summary


def _table1_runs(study, summaries):
    """``(family, summary)`` of the finished Table 1 runs."""
    for family, _, summary in _runs(study, summaries, ["first_attention"]):
        if family.table1 and "head_orders" in summary:
            yield family, summary


def _strategies(study, summaries) -> list[str]:
    lines = [
        "## The four re-initialization strategies",
        "",
        "Loss and accuracy barriers of the naive and the aligned (full method) interpolation, and the "
        "aligned barrier as % of the naive one; `aligned < naive` counts the pairs whose aligned loss "
        "barrier is below the naive one; `end points` is the validation accuracy of the two end points "
        "(alpha 0 and 1), mean over pairs. Every cell counts the row's `pairs`, but a ratio: a pair whose "
        f"naive barrier is below {NO_BARRIER['loss_barrier']:g} (nats, or accuracy) has nothing to remove, so its "
        "ratio is left out, the cell says how many pairs it counts, `(k of n)`, and the list below the table "
        "names the pairs left out.",
        "",
        "| family | strategy | pairs | end points | naive loss barrier | aligned loss barrier | loss ratio "
        "| naive acc barrier | aligned acc barrier | acc ratio | aligned < naive | paper |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    excluded = []
    for family, strategy, summary in _runs(study, summaries):
        if "full" in summary["alignments"]:
            entry, pairs = AlignmentSummary.from_json(summary["alignments"]["full"]), len(summary["pairs"])
            below = sum(pair.aligned["loss_barrier"] < pair.naive["loss_barrier"] for pair in entry.per_pair.values())
            ends = entry.mean_curves["naive"]
            lines.append(
                f"| {family.title} | {strategy} | {pairs} "
                f"| {ends[0]['accuracy']:.3f}, {ends[-1]['accuracy']:.3f} "
                f"| {cell(entry.naive['loss_barrier'], 3)} | {cell(entry.aligned['loss_barrier'], 3)} "
                f"| {cell(entry.barrier_ratio['loss_barrier'], unit=' %', of=pairs)} "
                f"| {cell(entry.naive['accuracy_barrier'], 3)} | {cell(entry.aligned['accuracy_barrier'], 3)} "
                f"| {cell(entry.barrier_ratio['accuracy_barrier'], unit=' %', of=pairs)} "
                f"| {below}/{len(entry.per_pair)} | {PAPER_STRATEGIES[strategy]} |"
            )
            excluded += no_barrier_lines(entry, f"{family.title}, {strategy}: ")
    return lines + ([""] + excluded if excluded else [])


#: What issue #8 aims for: the best method's aligned loss barrier, as % of the naive one.
METHODS_TARGET = 5.0


def _methods(study, summaries) -> tuple[list[str], list[str]]:
    """The methods table of ``docs/results.md``, and the wall times (which vary between runs) apart."""
    labels = study.method_labels
    batches = "/".join(str(n) for n in sorted({m.calibration_batches for m in study.methods if m.data_aware}, key=str))
    header = "| family | strategy | pairs | calibration | naive loss barrier | " + " | ".join(
        f"`{label}`" for label in labels
    )
    lines = [
        "## Beyond the paper: data-aware and learned alignment",
        "",
        "The aligned loss barrier as % of the naive one (mean ± std over pairs) for the paper's weight "
        "matcher (`full`) and lmc's data-aware and learned methods (`lmc.matching.AlignOptions`: "
        "`metric=activation` picks head orders from the heads' outputs and attention logits, "
        "`unit_matching=activation` matches FFN hidden units by the correlation of their activations (the up "
        "and gate projections' outputs and the down projection's input), `objective=data` fits "
        "Stage 2 to the projections' outputs on the inputs instead of to the weights, `learned` descends "
        "the interpolation loss from `full`'s element). Every method stays inside the symmetry group (the "
        f"probe check holds). Calibration: {batches} batches of the fine-tuning half's training split (the "
        "`calibration` column: the split and the samples the data-aware methods read); the curves are measured "
        f"where the family table says. Target: the best method at or below {METHODS_TARGET:g} % "
        "on average (the paper's full method: 7-12 %). The best mean of each row is in bold; "
        f"[the wall time of each alignment]({Path(study.report).with_suffix('').name}/alignment_seconds.md) "
        "is kept apart because it varies from run to run.",
        "",
        header + " | best |",
        "|---|---|---|---|---|" + "---|" * (len(labels) + 1),
    ]
    times = [
        "# Wall time of each alignment (seconds)",
        "",
        f"From the runs of `lmc repro` in `{study.output_dir}` (one thread per run): the alignment alone, "
        "not the sweep, mean ± std over pairs. It varies from run to run and machine to machine, so it "
        "is kept apart from `results.md`.",
        "",
        "| family | strategy | " + " | ".join(f"`{label}`" for label in labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    reached = rows = 0
    grids = []  # runs whose methods' curves have fewer alphas than the full method's (protocol.alignment_alphas)
    for family, strategy, summary in _runs(study, summaries, study.methods_strategies):
        alignments = alignments_of(summary)
        if not all(label in alignments for label in labels):
            continue
        if grid := curve_alphas_text([{label: alignments[label] for label in labels}]):
            grids.append(f"- {family.title}, {strategy}: {grid[0].lower()}{grid[1:]}")
        ratios = {label: alignments[label].barrier_ratio["loss_barrier"] for label in labels}
        naive, pairs = alignments["full"].naive["loss_barrier"], len(summary["pairs"])
        cells = [cell(ratios[label], of=pairs) for label in labels]
        if ratios["full"].count == 0:  # no pair has a barrier to remove: no method is best
            best = None
        else:
            best = min(labels, key=lambda label: ratios[label].mean)
            cells = [f"**{c}**" if label == best else c for label, c in zip(labels, cells)]
        lines.append(
            f"| {family.title} | {strategy} | {len(summary['pairs'])} | {_calibration(alignments)} "
            f"| {cell(naive, 3)} | " + " | ".join(cells) + (f" | `{best}` |" if best else " | no naive barrier |")
        )
        seconds = summary.get("alignment_seconds", {})
        times.append(
            f"| {family.title} | {strategy} | " + " | ".join(cell(seconds.get(label), 2) for label in labels) + " |"
        )
        if best:
            rows += 1
            reached += ratios[best].mean <= METHODS_TARGET
    lines += [
        "",
        f"The best method is at or below {METHODS_TARGET:g} % in {reached} of the {rows} runs with a naive "
        f"barrier (at least one pair with a naive loss barrier of {NO_BARRIER['loss_barrier']:g} nats or more).",
    ]
    return lines + ([""] + grids if grids else []), times


def _calibration(alignments: dict[str, AlignmentSummary]) -> str:
    """The split and sample counts the data-aware alignments of a run read, e.g. ``train, 256 samples``."""
    splits, samples = set(), set()
    for entry in alignments.values():
        if entry.calibration is not None:
            splits.update(entry.calibration.split)
            samples.update(entry.calibration.num_samples)
    if not splits:
        return "n/a"
    return f"{'/'.join(sorted(splits))}, {'/'.join(str(n) for n in sorted(samples))} samples"


def _robustness(study, summaries) -> list[str]:
    """The Appendix L section, or nothing where no run measured it."""
    if not any(ROBUSTNESS in summary for _, _, summary in _runs(study, summaries)):
        return []
    lines = [
        "## Robustness of the midpoints (Appendix L)",
        "",
        "Accuracy of both end points and of the naive and aligned (full method) midpoints on the "
        "validation split under input corruptions (images: Gaussian noise and blur; text: token "
        "dropout and substitution), mean ± std over pairs. The paper (Section 6.1) observes that models "
        "exhibiting LMC generalize better; its Appendix L settings are not in the text lmc has, so the "
        "corruptions and severities are lmc's (`lmc/data/corruptions.py`). `aligned > naive` counts the "
        "(pair, corruption, severity) cells where the aligned midpoint is more accurate than the naive one.",
    ]
    for family, strategy, summary in _runs(study, summaries):
        if ROBUSTNESS in summary:
            table = summary[ROBUSTNESS]
            aligned = "aligned_midpoint:full"
            wins = cells = 0
            for models in table["per_pair"].values() if aligned in table["models"] else []:
                for corruption in table["severities"]:
                    for naive, better in zip(models["naive_midpoint"][corruption], models[aligned][corruption]):
                        wins, cells = wins + (better["accuracy"] > naive["accuracy"]), cells + 1
            lines += ["", f"### {family.title}, {strategy}: aligned > naive in {wins}/{cells}", ""]
            lines += robustness_table(table)
    return lines


def _first_layer_inputs(study, summaries) -> list[str]:
    lines = [
        "## Where lmc's numbers differ from the paper's, and why",
        "",
        "Measured, not tuned: the first attention layer's inputs in seed 0 of each family "
        "(`lmc.experiments.study.first_layer_inputs`; 8 training batches of the fine-tuning half, all of it where it "
        "holds fewer). `rank` is the "
        "dimension of the span of its inputs (eigenvalues of `E[x x^T]` above 1e-10 of the largest, "
        "float64); `visible` is the share of each projection's squared norm on that span. The "
        "function depends only on the visible part; the rest is the re-initialization's random draw, "
        "which no gradient moves and which every weight-space cost of the matcher still counts.",
        "",
        "| family | width | input rank | visible W_Q | visible W_K | visible W_V |",
        "|---|---|---|---|---|---|",
    ]
    comparisons = []
    for family in study.families:
        path = Path(study.output_dir) / family.name / FIRST_LAYER_INPUTS
        if not path.is_file():
            continue
        inputs = nan_for_null(json.loads(path.read_text()))
        shares = " | ".join(f"{100 * inputs['visible'][name]:.1f} %" for name in ("query", "key", "value"))
        lines.append(f"| {family.title} | {inputs['width']} | {inputs['rank']} | {shares} |")
        summary = summaries.get(family.name, {}).get("first_attention")
        alignments = alignments_of(summary) if summary else {}
        if "full" in alignments:
            ratio, pairs = alignments["full"].barrier_ratio["loss_barrier"], len(summary["pairs"])
            where = (
                "no pair has a naive barrier to remove: not comparable with the paper's 7-12 %"
                if ratio.count == 0
                else f"{_position(ratio.mean, 7, 12)} the paper's 7-12 %"
            )
            others = [
                f"`{label}` {cell(alignments[label].barrier_ratio['loss_barrier'], unit=' %', of=pairs)}"
                for label in study.method_labels[1:]
                if label in alignments
            ]
            comparisons.append(
                f"- {family.title}: inputs span {inputs['rank']} of {inputs['width']} dimensions; the full "
                f"method leaves {cell(ratio, unit=' %', of=pairs)} of the naive loss barrier under `first_attention` "
                f"({where})" + (f"; the data-aware and learned methods leave {', '.join(others)}." if others else ".")
            )
    flat = [
        f"{family.title} {strategy} ({len(pairs)} of {len(summary['pairs'])} pairs)"
        for family, strategy, summary in _runs(study, summaries)
        if "full" in summary["alignments"]
        and (pairs := AlignmentSummary.from_json(summary["alignments"]["full"]).no_barrier["loss_barrier"])
    ]
    if flat:
        comparisons.append(
            f"- No barrier to remove (naive loss barrier below {NO_BARRIER['loss_barrier']:g} nats): "
            + "; ".join(flat)
            + ". Those pairs are linearly connected before any alignment, so their ratios would say nothing "
            "about the matcher; they are left out of every mean ratio."
        )
    comparisons.append(
        "- What the measurements beside this study (the input-span test, the head-order and sensitivity "
        "studies) say about these differences is discussed, citing each run by name, in `docs/discussion.md`."
    )
    return [*lines, "", *comparisons]


def _position(value: float, low: float, high: float) -> str:
    """Where a measured mean lies with respect to the paper's range."""
    if not math.isfinite(value):
        return "not comparable with"
    return "below" if value < low else "within" if value <= high else "above"


def _figure(family, strategies: dict[str, dict[str, Any]], path: Path) -> None:
    """Mean naive and aligned loss curves with a ±1 std band, one panel per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(strategies), figsize=(3.2 * len(strategies), 2.8), squeeze=False)
    for axis, (strategy, summary) in zip(axes[0], strategies.items()):
        for curve, color in (("naive", "tab:red"), ("aligned", "tab:blue")):
            points = AlignmentSummary.from_json(summary["alignments"]["full"]).mean_curves[curve]
            alphas = [p["alpha"] for p in points]
            mean = [p["loss"] for p in points]
            std = [p["loss_std"] for p in points]
            axis.plot(alphas, mean, color=color, label=curve)
            axis.fill_between(
                alphas, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color=color, alpha=0.2
            )
        axis.set_title(f"{strategy} ({len(summary['pairs'])} pairs)", fontsize=9)
        axis.set_xlabel("alpha")
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=8)
    figure.suptitle(family.title, fontsize=10)
    figure.tight_layout()
    atomic_write(path, lambda p: figure.savefig(p, format="png", dpi=90, metadata={"Software": None}))
    plt.close(figure)


def _machine(study) -> str:
    """Where the numbers were computed, and that another processor computes others."""
    machine = recorded(study.output_dir, MACHINE)
    if machine is None:
        return ""
    return (
        f" Computed on {machine['processor']} ({machine['kernels']} kernels, torch {machine['torch']}): another "
        "processor picks other floating-point kernels and, from the same seeds, trains other models: its numbers "
        "differ, most within their spread over pairs "
        "(`benchmarks/reproduction/results/reproducibility.md` compares two)."
    )


def write_report(study, sources: list[str]) -> dict[str, Any]:
    """Write ``study.report`` and its figures from the finished runs; returns the summaries read.

    Args:
        study: The :class:`~lmc.experiments.study.Study` that was run.
        sources: The study config files it was read from (named in the report).
    """
    summaries = _summaries(study)
    report = Path(study.report)
    figures = report.with_suffix("")
    lines = [
        f"# {study.title}",
        "",
        f"Written by `lmc repro` from the runs in `{study.output_dir}` (study: "
        + ", ".join(f"`{spelled(source)}`" for source in sources)
        + "); regenerate it by running its study again (`lmc repro --study`; `make repro` runs "
        "`configs/study/repro.yaml`) rather than editing it. Every cell is the mean ± standard "
        "deviation over pairs of fine-tuned seeds; `curves on` names the split and the samples every "
        "interpolation curve is measured on. Figures from the paper stand beside lmc's where it has one. "
        "Every run computes with one thread from fixed seeds, so the same command on the same machine "
        "prints the same numbers; the spread over pairs is the error bar, and only the alignments' wall "
        f"times vary from run to run (kept apart).{_machine(study)}",
        "",
        "| family | experiment config | strategies run | curves on |",
        "|---|---|---|---|",
    ]
    for family in study.families:
        runs = summaries.get(family.name, {})
        done = ", ".join(runs) or "none"
        configs = " + ".join(f"`{spelled(path)}`" for path in (family.experiment, *family.configs))
        lines.append(f"| {family.title} | {configs} | {done} | {_curve_samples(runs)} |")
    table1_runs = list(_table1_runs(study, summaries))
    if table1_runs:  # first: a study may lay out its own points (``study.sensitivity``)
        data = table1_data(
            table1_runs, sources, recorded(study.output_dir, MACHINE), recorded(study.output_dir, TIMES) or {}
        )
        atomic_write_json(figures / TABLE1_DATA, data)
    lines += [
        "",
        *table1_section(table1_runs),
        "",
        *appendix_k_section(table1_runs),
        "",
        *findings_sections(table1_runs, study.stage1_picked_on),
        *_strategies(study, summaries),
    ]
    # Another study's points, or this one's where its families share pre-trainings (the sensitivity study).
    points = study.sensitivity or (figures / TABLE1_DATA if any(f.pretrained_by for f in study.families) else None)
    if points:
        lines += ["", *sensitivity_section(points)]
    if study.methods and study.methods_strategies:
        methods, times = _methods(study, summaries)
        lines += ["", *methods]
        atomic_write_text(figures / "alignment_seconds.md", "\n".join(times) + "\n")
    if robustness := _robustness(study, summaries):
        lines += ["", *robustness]
    lines += ["", *_first_layer_inputs(study, summaries)]
    lines += ["", "### Interpolation curves", ""]
    for family in study.families:
        strategies = {s: v for s, v in summaries.get(family.name, {}).items() if "full" in v["alignments"]}
        if strategies:
            path = figures / f"{family.name}.png"
            _figure(family, strategies, path)
            lines += [f"![{family.title}]({figures.name}/{path.name})", ""]
    atomic_write_text(report, "\n".join(lines).rstrip() + "\n")
    return {"summaries": summaries}
