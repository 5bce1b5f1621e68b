"""The report's verdicts on the paper's Table 1 finding (``docs/results.md``): each Stage 1 setting's
verdict (:mod:`lmc.experiments.stats.verdicts`), where it was picked, and its comparison with an
order picked on held-out evaluation samples.
"""

from __future__ import annotations

import math
from typing import Any

from lmc.connectivity.interpolation import CLUSTER_SAMPLES
from lmc.experiments.report.cells import cell
from lmc.experiments.report.table1 import stage1_losses
from lmc.experiments.stats.spread import Spread
from lmc.experiments.stats.verdicts import (
    CONFIDENCE,
    PAPER_FINDING,
    confidence_bounds,
    counts_as_evidence,
    finding_verdict,
    held_out_comparison,
)
from lmc.experiments.table1 import HALVES

#: :func:`~lmc.experiments.stats.verdicts.held_out_comparison`'s outcomes, as the report prints them.
COMPARISONS = {
    "held_out_better": "held-out pick better",
    "stage1_better": "Stage 1 better",
    "not_told_apart": "not told apart",
    "unmeasured": "n/a",
}


def interval(stats: Spread | None, of: int, unit: str = "") -> str:
    """A cell ``mean ± std [low, high]``: the spread over pairs and the verdicts' confidence interval."""
    low, high = confidence_bounds(stats) if stats is not None else (math.nan, math.nan)
    bounds = f" [{low:.1f}, {high:.1f}]" if math.isfinite(low) else ""
    return cell(stats, unit=unit, of=of) + bounds


def _where(setting: str, picked_on: dict[str, str], titles: dict[str, str]) -> str:
    """Where a Stage 1 setting was picked: a family's title, or before the study."""
    family = picked_on.get(setting)
    return "before the study" if family is None else titles.get(family, family)


def findings_sections(runs: list[tuple[Any, dict[str, Any]]], picked_on: dict[str, str]) -> list[str]:
    """:func:`finding_section` and :func:`held_out_section`, each followed by an empty line; none where
    no run measured them."""
    sections = (finding_section(runs, picked_on), held_out_section(runs))
    return [line for section in sections if section for line in (*section, "")]


def finding_section(runs: list[tuple[Any, dict[str, Any]]], picked_on: dict[str, str]) -> list[str]:
    """Each Stage 1 setting's verdict on the paper's finding per Table 1 run, where the setting was
    picked (``picked_on``: setting -> family; a setting picked on a family is no evidence there), and
    a line per family on the paper's cost (``invariant``)."""
    titles = {family.name: family.title for family, _ in runs}
    rows, lines = [], []
    for family, summary in runs:
        settings = stage1_losses(summary)
        for setting, loss in settings.items():
            pairs, verdict = len(summary["pairs"]), finding_verdict(loss)["finding"]
            evidence = "" if counts_as_evidence(setting, family.name, picked_on) else " (picked here: no evidence)"
            rows.append(
                f"| {family.title} | `{setting}` | {_where(setting, picked_on, titles)} | {pairs} "
                f"| {cell(loss.rank, of=pairs)} | {interval(loss.rank_within_noise, pairs)} "
                f"| {interval(loss.l_hat, pairs, ' %')} | {verdict}{evidence} |"
            )
        if "invariant" in settings:
            lines.append(_paper_cost_line(family, settings, picked_on, titles))
    if not rows:
        return []
    return [
        "## The paper's Table 1 finding, Stage 1 setting by Stage 1 setting",
        "",
        "The paper finds Stage 1's head order near the best one (rank near 1, `L_hat` near 0). Checked here as "
        f"rank within noise under {PAPER_FINDING['rank_within_noise']:g} and `L_hat` under "
        f"{PAPER_FINDING['l_hat']:g} %, with the same burden of proof both ways: `met` only where the upper bound "
        f"of each one's {100 * CONFIDENCE:g} % interval over pairs (Student's t, in brackets) is under its threshold, "
        "`missed` only where a lower bound is over it, `unresolved` otherwise. The raw rank stands beside the "
        "rank within noise. A Stage 1 setting picked on one family counts as evidence only on the others "
        "(`picked on`).",
        "",
        "| family | Stage 1 setting | picked on | pairs | rank (loss) | within noise | L_hat loss | paper's finding |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *lines,
    ]


def _paper_cost_line(family: Any, settings: dict[str, Any], picked_on: dict[str, str], titles: dict[str, str]) -> str:
    """Whether the paper's cost meets the finding on a family, how it compares with the held-out
    pick, and which other Stage 1 settings meet it (those picked on this family apart)."""
    paper = settings["invariant"]
    verdict = finding_verdict(paper)["finding"]
    line = (
        f"- {family.title}: the paper's cost (`invariant`) {verdict} (raw rank {cell(paper.rank)}, within noise "
        f"{interval(paper.rank_within_noise, paper.rank_within_noise.count if paper.rank_within_noise else 0)})"
    )
    comparison = held_out_comparison(paper)
    if comparison != "unmeasured":
        line += f"; against the held-out pick: {COMPARISONS[comparison]}"
    met = [name for name, loss in settings.items() if name != "invariant" and finding_verdict(loss)["finding"] == "met"]
    evidence = [f"`{name}`" for name in met if counts_as_evidence(name, family.name, picked_on)]
    here = [f"`{name}`" for name in met if not counts_as_evidence(name, family.name, picked_on)]
    line += f"; met by {', '.join(evidence)}" if evidence else "; met by no other Stage 1 setting"
    if here:
        line += f" (also by {', '.join(here)}, picked on {titles.get(family.name, family.name)}: no evidence here)"
    return line + "."


def held_out_section(runs: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """The report's comparison of each Stage 1 setting with an order picked on held-out evaluation
    samples (:func:`~lmc.experiments.table1.held_out_orders`); empty where no run measured it."""
    rows = []
    for family, summary in runs:
        for setting, loss in stage1_losses(summary).items():
            if loss.halves is None:
                continue
            pairs, rank, l_hat = loss.halves.pairs, loss.halves.rank, loss.halves.l_hat
            rows.append(
                f"| {family.title} | `{setting}` | {pairs} | {cell(rank.stage1, of=pairs)} "
                f"| {cell(rank.held_out, of=pairs)} | {cell(l_hat.stage1, of=pairs)} "
                f"| {cell(l_hat.held_out, of=pairs)} | {interval(l_hat.difference, pairs)} "
                f"| {COMPARISONS[held_out_comparison(loss)]} |"
            )
    if not rows:
        return []
    return [
        "## Stage 1 against an order picked on held-out samples",
        "",
        f"The evaluated samples are cut into two random halves ({HALVES} cuts, in clusters of {CLUSTER_SAMPLES}, "
        "both directions): the order with the lowest loss barrier on one half is the held-out pick, and on the "
        "other half it and each Stage 1 setting's order (each followed by the full Stage 2) are scored: rank "
        "among the orders and `L_hat` against that half's best order. Stage 1 sees no evaluation data; the "
        "held-out pick sees as many samples as it is scored on. `difference` is Stage 1's `L_hat` minus the "
        f"held-out pick's, pair by pair, with its {100 * CONFIDENCE:g} % interval over pairs: the held-out pick is "
        "better where the interval lies above 0, Stage 1 where it lies below, and neither is told apart otherwise.",
        "",
        "| family | metric | pairs | rank on a half | held-out pick's rank | L_hat on a half "
        "| held-out pick's L_hat | difference | better |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
