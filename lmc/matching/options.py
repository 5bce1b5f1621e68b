"""The options of :func:`lmc.matching.align`, typed once for Python callers, YAML configs and the CLI.

``Method`` and ``Metric`` are ``Literal`` types so that jsonargparse rejects a bad choice while
parsing; :class:`AlignOptions` validates every field itself too, because ``align`` is also a
Python API. The attribute docstrings are the command-line help.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

Method = Literal["naive", "permutation", "orthogonal", "full", "learned"]
Metric = Literal["invariant", "weight", "correlation", "activation", "midpoint", "balanced", "rotary"]
Objective = Literal["weight", "data"]
UnitMatching = Literal["weight", "activation"]
Residual = Literal["unsigned", "permutation", "orthogonal"]
METHODS: tuple[str, ...] = get_args(Method)
METRICS: tuple[str, ...] = get_args(Metric)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
UNIT_MATCHINGS: tuple[str, ...] = get_args(UnitMatching)
RESIDUALS: tuple[str, ...] = get_args(Residual)
#: The fields that matter only to a data-aware alignment (see :attr:`AlignOptions.data_aware`).
DATA_FIELDS: tuple[str, ...] = ("objective", "unit_matching", "calibration_batches")
#: ``calibration_batches`` that reads every batch of the calibration.
ALL_BATCHES = "all"
#: The fields that matter only to ``method="learned"``.
LEARNED_FIELDS: tuple[str, ...] = ("learned_steps", "learned_lr")


@dataclass(frozen=True)
class AlignOptions:
    """How :func:`lmc.matching.align` aligns a pair (paper Section 5; docs/spec.md, section 3)."""

    method: Method = "full"
    """Stages to run: ``naive`` (no change), ``permutation`` (Stage 1: head, FFN and residual
    permutations), ``orthogonal`` (plus the best orthogonal group element per head) or ``full``
    (plus L-BFGS on the exact objective) or ``learned`` (from ``full``'s element, Adam on the attention
    layers' group coordinates against the calibration loss of the interpolated models at random
    alphas; keeps the element with the lowest loss at alphas 0.25, 0.5, 0.75 over the calibration,
    ``full``'s if none is lower; needs a calibration)."""

    metric: Metric = "invariant"
    """Stage 1 head cost: ``invariant`` (distances of the group-invariant products ``Q K^T`` and
    ``V O``), ``balanced`` (those two distances, each in units of its heads' mean squared norm),
    ``rotary`` (``invariant`` with the Q/K term, under RoPE, on the complete invariants of ``H``: per class of
    rotary pairs turning alike, ``Q_p K_p^T`` and ``Q_p J K_p^T``; equal to ``invariant`` without RoPE),
    ``weight`` (the weight distance left after Stage 2 for each candidate pair) or
    ``correlation`` (cosine similarities of the invariant products) or ``activation`` (cosine
    similarities of each head's output through ``W_O`` on the calibration batches, plus those of its
    attention logits, ``x_m W_Q W_K^T x_n^T`` over calibration tokens; needs a calibration) or
    ``midpoint`` (the calibration loss of the target with head ``j`` replaced by the midpoint of its
    weights and source head ``i``'s after Stage 2, one head at a time: ``h`` Stage 2 solves and
    ``h^2`` passes over the calibration batches per layer; needs a calibration and the models in memory).
    The weight-based metrics and ``midpoint``'s Stage 2 read the Grams ``objective`` selects."""

    objective: Objective = "weight"
    """What Stage 1's weight-based metrics and Stage 2 measure: ``weight`` (the raw weights,
    ``||W_Q C - W_Q'||^2 + ...``) or ``data`` (the projections' activations on the calibration
    batches: ``E||x W_Q C - x' W_Q'||^2`` over paired tokens, ``x`` and ``x'`` the source's and
    the target's input to the layer, biases included; the same for ``W_K C^{-T}`` and ``W_V B``,
    i.e. ``W^T Sigma W'`` with the inputs' second moments in place of ``W^T W'``; ``W_O`` reads the
    attention's output, not ``x``, and stays on weights). Needs a calibration."""

    unit_matching: UnitMatching = "weight"
    """How the permutations of FFN hidden units (``first_block``, ``full_model``), task-head hidden
    units and the residual stream (``full_model``) are found: ``weight`` (Git Re-Basin's weight
    matching; under ``full_model`` by coordinate descent with the head orders) or ``activation``
    (Git Re-Basin's activation matching: each permutation maximizes the summed Pearson correlation
    of the source's and the target's units on the calibration batches, over every signal that
    carries them: an FFN's units at the output of its up and gate projections and at the input of
    its down projection, the residual stream at the input of every norm on it; units of different
    permutations do not interact, so each is solved once). Needs a calibration; the other scopes
    have no such units and ignore it."""

    residual: Residual = "permutation"
    """The residual stream's group under ``full_model``: ``unsigned`` (permutations of the coordinates only: the
    paper's group), ``permutation`` (the model as stored: permutations with the signs the norms allow) or
    ``orthogonal`` (both models' foldable norms folded first,
    ``lmc.adapters.fold_norms``, then the rotations the family allows: ``O(d)`` for RMSNorm streams, the ``Q``
    with ``Q 1 = +-1`` for LayerNorm ones, the signed permutations where a gain that does not fold forbids a
    rotation; solved by orthogonal Procrustes in the coordinate descent; the aligned model is the folded
    source transformed). docs/spec.md, section 2, "Rotations of the stream"."""

    unit_scales: bool = False
    """Under ``full_model``, also align the FFN units' scales where they keep the function (a gated unit's value
    branch times ``a``, the down projection's column over ``a``; docs/spec.md, section 2, "FFN unit scales"): the
    signs in the units' assignment, the magnitudes in closed form after it, inside the coordinate descent."""

    calibration_batches: int | Literal["all"] = 8
    """Calibration batches (from the training split) that data-aware settings read; ``"all"``: every
    batch of the calibration (``lmc run``, ``lmc align``: the whole training split)."""

    steps: int = 30
    """Most L-BFGS iterations of Stage 2 (0 stops after the orthogonal start). Independent pairs
    gain little after a few dozen (see ``benchmarks/``); planted pairs converge well before."""

    lr: float = 1.0
    """L-BFGS step size (1 is the natural quasi-Newton step)."""

    tolerance: float = 1e-12
    """Stop Stage 2 when the largest gradient entry falls below this (each objective is scaled by
    its target's squared norm)."""

    max_iterations: int = 20
    """Most coordinate-descent rounds over the FFN, task-head, head and residual permutations of
    ``full_model`` (0: the residual permutation from the anchors alone)."""

    check_rtol: float | None = None
    """Largest relative output change allowed between the source and the aligned model on the
    probe input; ``None`` uses the stored dtype's default (``lmc.matching.PROBE_RTOL``). 0 demands
    bitwise-equal outputs."""

    learned_steps: int = 40
    """Adam steps of ``method="learned"`` (one calibration batch and two random alphas each)."""

    learned_lr: float = 1e-2
    """Adam step size of ``method="learned"``, in group coordinates (``full``'s element is the origin, so
    each entry of ``C`` and ``B`` moves by about this much per step)."""

    probe_batch_size: int = 2
    """Random inputs in the probe that checks the aligned model computes the source's function."""

    seed: int = 0
    """Seed of the probe input."""

    share_frozen: bool = True
    """Outside ``full_model``, let the aligned model share the parameters outside the scope with
    the source instead of copying them (they are unchanged by construction). ``False`` returns a
    fully independent copy."""

    head_orders: dict[int, list[int]] | None = None
    """Head orders to impose instead of Stage 1's: attention layer index (0 = the first) -> the
    target head of each source query head. Stage 2 then runs on that order, which is how every
    head order of a layer is scored against the one Stage 1 picks (the paper's Table 1)."""

    @property
    def data_aware(self) -> bool:
        """Whether these settings read activations, so that :func:`~lmc.matching.align` needs a calibration."""
        return (
            self.method == "learned"
            or self.objective == "data"
            or self.metric in ("activation", "midpoint")
            or self.unit_matching == "activation"
        )

    def for_scope(self, scope: str) -> AlignOptions:
        """These settings as they act at ``scope``: the attention scopes align no unit, so unit matching
        there is weight matching and reads no data."""
        if scope in ("first_attention", "all_attention") and self.unit_matching != "weight":
            return dataclasses.replace(self, unit_matching="weight")
        return self

    @property
    def data_settings(self) -> str:
        """The chosen settings that read activations, e.g. ``"objective=data, metric=activation"``."""
        chosen = [
            ("method", "learned"),
            ("objective", "data"),
            ("metric", "activation"),
            ("metric", "midpoint"),
            ("unit_matching", "activation"),
        ]
        return ", ".join(f"{name}={value}" for name, value in chosen if getattr(self, name) == value)

    @property
    def last_stage(self) -> Method:
        """The last matching stage the method runs (``learned`` starts from ``full``'s element)."""
        return "full" if self.method == "learned" else self.method

    def __post_init__(self) -> None:
        for name, choices in (
            ("method", METHODS),
            ("metric", METRICS),
            ("objective", OBJECTIVES),
            ("unit_matching", UNIT_MATCHINGS),
            ("residual", RESIDUALS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(choices)}")
        if self.residual == "orthogonal" and self.unit_matching == "activation":
            # activation matching correlates the stream's coordinates one by one: a permutation, not a rotation
            raise ValueError(
                "residual='orthogonal' rotates the residual stream by weight, which unit_matching='activation' does "
                "not do: use unit_matching='weight' with it, or residual='permutation'"
            )
        if self.unit_scales and self.unit_matching == "activation":
            raise ValueError(
                "unit_scales=True scales the FFN units by weight, which unit_matching='activation' does not do: use "
                "unit_matching='weight' with it, or unit_scales=False"
            )
        for name, least in (
            ("steps", 0),
            ("max_iterations", 0),
            ("probe_batch_size", 1),
            ("learned_steps", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        batches = self.calibration_batches
        if batches != ALL_BATCHES and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
            raise ValueError(f"calibration_batches must be an integer >= 1 or {ALL_BATCHES!r}, got {batches!r}")
        for name in ("lr", "learned_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.tolerance, int | float) and 0 <= self.tolerance < math.inf):
            raise ValueError(f"tolerance must be a finite number >= 0, got {self.tolerance!r}")
        for layer, order in (self.head_orders or {}).items():
            if sorted(order) != list(range(len(order))):
                raise ValueError(f"head_orders[{layer}] = {order} is not a permutation of 0..{len(order) - 1}")
        if self.check_rtol is not None and not (
            isinstance(self.check_rtol, int | float) and 0 <= self.check_rtol < math.inf
        ):
            raise ValueError(
                f"check_rtol must be None (the dtype's default) or a finite number >= 0, got {self.check_rtol!r}"
            )


def checked_options(options: AlignOptions | None) -> AlignOptions:
    """``options``, or the defaults for ``None``; refuses anything that is not an :class:`AlignOptions`."""
    options = AlignOptions() if options is None else options
    if not isinstance(options, AlignOptions):
        raise TypeError(f"options must be an lmc.matching.AlignOptions, got {type(options).__name__}")
    return options
