"""The state of one in-memory alignment: the working copy, the target, the accumulated group element.

:func:`~lmc.matching.align` drives it: Stage 1 and 2 per attention layer, weight or activation
matching of FFN units, and for ``full_model`` the coordinate descent of :mod:`lmc.matching.descent` (the learned
tokens' by weight, whatever the unit matching).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

from lmc.adapters import adapter_for, scope_parameters
from lmc.matching.calibration import Calibration, paired_correlations, paired_moments
from lmc.matching.checks import all_finite
from lmc.matching.descent import WeightDescent
from lmc.matching.grams import LayerGrams
from lmc.matching.layers import layer_distance, signed_units, stacked_copies
from lmc.matching.learned import LearnedAlignment, learn_attention
from lmc.matching.midpoint import midpoint_cost
from lmc.matching.results import AlignmentError, AlignmentReport
from lmc.symmetry import AxisPermutation, ModelTransform, SymmetrySpec


class Aligner(WeightDescent):
    """State of one in-memory alignment: the working copy (a deep copy of the source), the target, the transform."""

    def __init__(
        self,
        source: nn.Module,
        target: nn.Module,
        spec: SymmetrySpec,
        report: AlignmentReport,
        calibration: Calibration | None = None,
    ):
        options = report.options
        shared = {}
        if options.share_frozen and report.scope != "full_model":
            # Parameters outside the scope never change (and equal the target's): share, don't copy.
            free = set(scope_parameters(source, report.scope, spec))
            shared = {id(p): p for name, p in source.named_parameters() if name not in free}
        self.working = copy.deepcopy(source, shared)
        super().__init__(
            dict(self.working.named_parameters()),
            dict(target.named_parameters()),
            dict(source.named_parameters()),
            spec,
            report,
            next(source.parameters()).dtype,
        )
        self.calibration = calibration
        self.target_model = target

    def transform_parameters(self, transform: ModelTransform) -> None:
        super().transform_parameters(transform)
        self.move_moments(transform)

    def stage1_cost(self, index: int) -> Callable[[LayerGrams], torch.Tensor] | None:
        if self.options.metric != "midpoint":
            return None
        layer = self.spec.blocks[index].attention
        return lambda grams: midpoint_cost(
            self.working, self.target_model, layer, grams, self.options, self.calibration
        )

    def capture(self, attention: list[int]) -> None:
        """The activation statistics the options read, from one calibration pass of both models.

        Per attention layer: its input (augmented with 1) for the data objective and the
        activation metric, and what ``W_O`` reads for the activation metric. Symmetries applied
        later move them exactly (:meth:`move_moments`), so one pass serves the whole alignment.
        """
        if self.calibration is None:
            return
        adapter, options = adapter_for(self.working), self.options
        modules, augment = {}, set()
        for index in attention:
            layer = self.spec.blocks[index].attention
            if options.objective == "data" or options.metric == "activation":
                key = f"input:{index}"
                modules[key] = tuple(
                    adapter.attention_input_module(m, layer) for m in (self.working, self.target_model)
                )
                augment.add(key)
            if options.metric == "activation":
                modules[f"output:{index}"] = tuple(
                    adapter.attention_output_module(m, layer) for m in (self.working, self.target_model)
                )
        if modules:
            self.moments = paired_moments(
                self.working, self.target_model, modules, self.calibration, frozenset(augment)
            )
            for key, moment in self.moments.items():
                self.require_finite(bool(torch.isfinite(moment.cross).all()), f"{key}: the calibration moments")

    def move_moments(self, transform: ModelTransform) -> None:
        """Keep the source's activation statistics those of the working copy after ``transform``.

        A residual permutation re-indexes every layer's input (the constant 1 stays last); an
        attention element permutes the heads' outputs and maps each head's by its ``B``.
        """
        if not self.moments:
            return
        if transform.residual is not None or transform.residual_signs is not None:
            width = self.spec.residual.size
            perm = torch.arange(width) if transform.residual is None else transform.residual.cpu()
            index = torch.cat([perm, torch.tensor([width])])
            signs = None
            if transform.residual_signs is not None:
                signs = torch.diag(torch.cat([transform.residual_signs.cpu().double(), torch.ones(1).double()]))
            for key in [k for k in self.moments if k.startswith("input:")]:
                self.moments[key] = self.moments[key].moved(index, signs)
        for layer_index, element in transform.attention.items():
            key = f"output:{layer_index}"
            if key in self.moments:
                d_h = element.vo.shape[-1]
                heads = element.query_permutation.cpu()
                index = (heads[:, None] * d_h + torch.arange(d_h)).flatten()
                per_head = element.vo.cpu().double().repeat_interleave(element.queries_per_kv, dim=0)
                self.moments[key] = self.moments[key].moved(index, torch.block_diag(*per_head))

    def learn(self, attention: list[int]) -> None:
        """``method="learned"``: descend the interpolation loss over the attention elements, from ``full``'s."""
        slots = {slot.parameter for index in attention for slot in self.spec.blocks[index].attention.slots}
        scoped = scope_parameters(self.working, self.report.scope, self.spec)
        moving = [name for name in scoped if name not in slots]
        learned: LearnedAlignment = learn_attention(
            self.working, self.target_model, self.spec, attention, moving, self.calibration, self.options
        )
        if learned.transforms:
            self.apply(ModelTransform(attention=learned.transforms))
        self.report.learned = learned.to_dict()
        layers = {layer.name: layer for layer in self.report.layers if layer.kind == "attention"}
        for index in attention:
            layer = self.spec.blocks[index].attention
            layers[layer.name].distance["learned"] = layer_distance(self.parameters, self.target, layer)
            layers[layer.name].seconds["learned"] = learned.seconds  # one descent over every layer

    def match_units(self, feed_forward: list[int], whole: bool) -> None:
        """Activation matching: the scope's FFN hidden units, and under ``full_model`` the task heads'
        hidden units and the residual stream, each permuted to maximize its summed correlation with
        the target's units over the calibration tokens (one pass of both models for all of them).

        A unit's activations do not change under any other symmetry, so each permutation is solved
        once, independently. Its correlations add up over every signal that carries the units: the
        inputs of the modules that read them (the residual stream: every norm on it) and the outputs
        of those that write them (an FFN's up and gate projections, each stacked copy alike).
        The learned tokens (``spec.tokens``) are parameters, the same for every input: they are
        matched by weight once the residual stream is.
        """
        start = time.perf_counter()
        permutations = {("feed_forward", i): self.spec.blocks[i].feed_forward.hidden for i in feed_forward}
        if whole:
            permutations |= {("task_head", i): head for i, head in enumerate(self.spec.task_heads)}
            if self.spec.residual is not None:
                permutations["residual", 0] = self.spec.residual
        if permutations:
            self.correlate_units(permutations, start)
        if whole and self.spec.tokens is not None:
            start = time.perf_counter()
            self.permute_tokens()
            self.record_tokens(time.perf_counter() - start)

    def correlate_units(self, permutations: dict[tuple[str, int], AxisPermutation], start: float) -> None:
        """Solve and apply ``permutations`` (``(kind, index) -> units``) by activation, timed from ``start``."""
        modules, outputs, signals = {}, set(), {}
        for key, permutation in permutations.items():
            if not permutation.readers + permutation.writers:
                raise AlignmentError(
                    f"{permutation.name}: the adapter for {type(self.working).__name__} names no module that reads "
                    "or writes these units, so they cannot be matched by activation; use unit_matching='weight'"
                )
            named = [(f"{permutation.name} reads {m}", m) for m in permutation.readers]
            named += [(f"{permutation.name} writes {m}", m) for m in permutation.writers]
            for signal, module in named:
                modules[signal] = (self.working.get_submodule(module), self.target_model.get_submodule(module))
            outputs.update(signal for signal, _ in named[len(permutation.readers) :])
            signals[key] = [signal for signal, _ in named]
        correlations = paired_correlations(
            self.working, self.target_model, modules, self.calibration, frozenset(outputs)
        )
        found = {}  # (kind, index) -> (perm, signs); every signal carries the units' signs
        for key, permutation in permutations.items():
            correlation = sum(stacked_copies(correlations[signal], permutation.size) for signal in signals[key])
            self.require_finite(all_finite(correlation), f"{permutation.name}: the activation correlation")
            found[key] = signed_units(correlation, None, permutation, self.dtype)
        residual, residual_signs = found.get(("residual", 0), (None, None))
        self.apply(
            ModelTransform(
                feed_forward={i: perm for (kind, i), (perm, _) in found.items() if kind == "feed_forward"},
                task_heads={i: perm for (kind, i), (perm, _) in found.items() if kind == "task_head"},
                residual=residual,
                residual_signs=residual_signs,
                task_head_signs={
                    i: signs for (kind, i), (_, signs) in found.items() if kind == "task_head" and signs is not None
                },
            )
        )
        seconds = time.perf_counter() - start
        for key, (perm, signs) in found.items():
            self.record_permutation(permutations[key], key[0], perm, seconds, signs)
