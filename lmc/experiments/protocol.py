"""The settings of ``lmc run``: the paper's protocol (:class:`Protocol`) and its training schedules.

The ``protocol`` group of an experiment config (``configs/protocol/*.yaml``); ``lmc fit`` and the
other single steps ignore it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lmc.connectivity import CurveSplit, check_curve_split
from lmc.connectivity.interpolation import evenly_spaced
from lmc.experiments.jobs import Cluster
from lmc.matching import AlignOptions
from lmc.symmetry import Scope


class RunError(ValueError):
    """A run folder or protocol that cannot be used as asked; the message says how to fix it."""


@dataclass(frozen=True)
class Schedule:
    """Length, learning rate and training data of one training phase.

    Attributes:
        max_epochs: Epochs of this phase (``None``: the experiment's ``trainer.max_epochs``).
        lr: AdamW learning rate of this phase (``None``: the experiment's ``model.lr``).
        samples: Train on only this many samples of the phase's half of the training split (the
            DataModule's ``train_samples``: a seeded subset, a smaller one inside a larger one;
            ``None``: the experiment's data as it is).
    """

    max_epochs: int | None = None
    lr: float | None = None
    samples: int | None = None

    def __post_init__(self):
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ValueError(f"max_epochs must be at least 1, got {self.max_epochs}")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be at least 1 (None: the whole half), got {self.samples}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")


@dataclass(frozen=True)
class Protocol:
    """The paper's protocol, run by ``lmc run`` (``lmc fit`` and the other single steps ignore it).

    Attributes:
        output_dir: The run folder (checkpoints, sweeps, logs, summary).
        reinit: The re-initialization strategy of the fine-tuning runs.
        seeds: Fine-tuned seeds (``0 .. seeds - 1``); every pair of them is aligned and swept.
        pretrained: A pre-trained checkpoint to start from instead of pre-training.
        pretrain: Schedule of the pre-training on half A (its length, learning rate, samples).
        finetune: Schedule of each fine-tuning run on half B (its length, learning rate, samples).
        alignments: Alignment settings to compare, each giving one aligned curve per pair
            (``None``: the default :class:`~lmc.matching.AlignOptions`, the full method).
            Data-aware settings calibrate on the first ``calibration_batches`` batches of a
            seeded shuffle of the fine-tuning half B's training split.
        num_alphas: Points on each interpolation curve.
        split: Where the curves are measured.
        eval_batch_size: Evaluation batch size (``None``: the DataModule's).
        eval_samples: Measure the curves on this many samples of ``split`` only, evenly spaced
            over it (``None``: all of it): splits are stored in order (by class, by position in a
            text), so the first samples would be one class or one passage.
        head_orders: Also align every pair with each order of the first attention layer's heads,
            each followed by the full Stage 2, to rank the order each alignment picks and report
            ``L_hat`` (the paper's Table 1; ``h!`` more sweeps per pair, at most 6 heads).
        head_order_alphas: Points on each head order's curve (``None``: ``num_alphas``): evenly
            spaced alphas that are among the curves' own (``num_alphas - 1`` a multiple of
            ``head_order_alphas - 1``), so that ranks and ``L_hat`` compare every order, method and
            naive curve on the same alphas (docs/experiments.md, "Table 1").
        alignment_alphas: Points on each listed alignment's curve except the full method's (the
            default settings, the run's headline and figure curve, which keeps ``num_alphas``;
            ``None``: ``num_alphas``): evenly spaced alphas among the curves' own, and holding the
            head orders' where those are scored. A variant's barrier ratio is then against the naive
            barrier on the same alphas; Table 1 ranks every curve on the head orders' alphas anyway.
        robustness: Also measure the accuracy of both end points, the naive midpoint and each
            alignment's aligned midpoint on clean and corrupted data, three severities per
            corruption (paper Appendix L; :mod:`lmc.connectivity.robustness`): ``pairs/<i>_<j>/robustness.json``
            and a section of the summary.
        overwrite: Recompute stages whose folder holds results of another configuration.
    """

    output_dir: str = "runs/experiment"
    reinit: Scope = "first_attention"
    seeds: int = 3
    pretrained: str | None = None
    pretrain: Schedule = field(default_factory=Schedule)
    finetune: Schedule = field(default_factory=Schedule)
    alignments: list[AlignOptions] | None = None
    num_alphas: int = 25
    split: CurveSplit = "val"
    eval_batch_size: int | None = None
    eval_samples: int | None = None
    head_orders: bool = False
    head_order_alphas: int | None = None
    alignment_alphas: int | None = None
    robustness: bool = False
    overwrite: bool = False

    def __post_init__(self):
        if self.seeds < 2:
            raise ValueError(f"protocol.seeds must be at least 2 (a pair of fine-tuned runs), got {self.seeds}")
        if self.num_alphas < 2:
            raise ValueError(f"protocol.num_alphas must be at least 2, got {self.num_alphas}")
        if self.alignments is not None and not self.alignments:
            raise ValueError("protocol.alignments is empty: list at least one, e.g. [{method: full}]")
        labels = alignment_labels(self.alignment_options)
        if len(set(labels)) != len(labels):
            raise ValueError(f"protocol.alignments lists the same settings twice: {labels}")
        check_curve_split(self.split)
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"protocol.eval_batch_size must be positive, got {self.eval_batch_size}")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"protocol.eval_samples must be positive, got {self.eval_samples}")
        for name in ("head_order_alphas", "alignment_alphas"):
            count = getattr(self, name)
            if count is not None and not _among(count, self.num_alphas):
                raise ValueError(
                    f"protocol.{name}={count} alphas are not among the curves' {self.num_alphas}: pick a count n "
                    f"whose n - 1 gaps divide num_alphas - 1 = {self.num_alphas - 1} (13 of 25: every other alpha), "
                    "or leave it unset"
                )
        order_alphas = self.head_order_alphas or self.num_alphas
        if self.head_orders and self.alignment_alphas is not None and not _among(order_alphas, self.alignment_alphas):
            raise ValueError(
                f"protocol.alignment_alphas={self.alignment_alphas} alphas do not hold the head orders' "
                f"{order_alphas}, on which Table 1 ranks every alignment: set alignment_alphas to head_order_alphas "
                "or to a count that holds them"
            )

    @property
    def order_alphas(self) -> list[float]:
        """The alphas of each head order's curve (:attr:`head_order_alphas`), a subset of the curves'."""
        return evenly_spaced(self.head_order_alphas or self.num_alphas)

    @property
    def alignment_options(self) -> list[AlignOptions]:
        return self.alignments if self.alignments is not None else [AlignOptions()]

    def alphas_of(self, options: AlignOptions) -> list[float]:
        """The alphas of an alignment's curves (:attr:`alignment_alphas`; the full method: all ``num_alphas``)."""
        whole = options == AlignOptions() or self.alignment_alphas is None
        return evenly_spaced(self.num_alphas if whole else self.alignment_alphas)


def _among(count: int, of: int) -> bool:
    """Whether ``count`` evenly spaced alphas are among ``of`` evenly spaced ones (the same floats)."""
    return count >= 2 and (of - 1) % (count - 1) == 0


def alignment_labels(alignments: list[AlignOptions]) -> list[str]:
    """Short names of alignment settings: the method, plus every field that differs from the defaults."""
    default = asdict(AlignOptions())
    labels = []
    for options in alignments:
        changed = [f"{k}={v}" for k, v in asdict(options).items() if k != "method" and v != default[k]]
        labels.append("-".join([options.method, *changed]))
    return labels


def experiment_cli(args: list[str] | None = None, run: bool = True):
    """The LightningCLI of an experiment config: :func:`~lmc.training.cli.lightning_cli` with the
    ``protocol`` group and the ``cluster`` group (where the jobs run, :class:`~lmc.experiments.jobs.Cluster`).

    ``lmc run`` parses with ``run=False``; ``lmc fit`` and the other single steps run a subcommand
    and ignore both.
    """
    from lmc.training.cli import lightning_cli

    groups = {"protocol": Protocol, "cluster": Cluster}
    description = (
        "lmc run: the paper's protocol from one experiment config. The stages' progress goes to standard "
        "error; --quiet shows none."
    )
    return lightning_cli(args, run, groups, description)
