"""``align``: bring a source model's weights next to a target's without changing its function.

Attention layers use the two-stage matcher (:mod:`lmc.matching.grams`, Stage 1 in
:mod:`lmc.matching.heads`, Stage 2 in :mod:`lmc.matching.stage2`); FFN and task-head hidden
units and the residual stream use weight matching (:mod:`lmc.matching.permutation`). For
``full_model`` the permutations are found by coordinate descent: the residual permutation is
started from the parameters whose other axes no symmetry moves (embeddings, norms, output
layers, output biases), then FFN and task-head permutations, head orders and the residual
permutation (now also read through the aligned hidden units) are solved in turn until none
changes. Stage 2 then runs on every attention layer with all permutations fixed, so the
distance to the target never rises from ``permutation`` to ``orthogonal`` to ``full``.
Activation matching (``unit_matching="activation"``) instead solves each unit permutation once
from the units' correlations on calibration batches, which no other symmetry changes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lmc.adapters import adapter_for, model_spec, scope_parameters
from lmc.matching.calibration import Calibration, PairedMoment, paired_correlations, paired_moments
from lmc.matching.grams import LayerGrams
from lmc.matching.heads import assign_heads, head_cost
from lmc.matching.learned import LearnedAlignment, learn_attention
from lmc.matching.options import AlignOptions
from lmc.matching.permutation import axis_correlation, best_permutation
from lmc.matching.stage2 import attention_stages, stage_distances
from lmc.symmetry import (
    AttentionSpec,
    AttentionTransform,
    AxisPermutation,
    ModelTransform,
    Scope,
    SymmetrySpec,
    check_scope,
    compute_dtype,
    head_rows,
    scope_blocks,
)

PROBE_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.bfloat16: 1e-1,
    torch.float16: 2e-2,
}
"""Default ``check_rtol`` per stored dtype: the relative output change on the probe that rounding
the aligned weights to that dtype can explain. Observed on the test models, planted and
independent pairs: ~1e-15 in float64, ~1e-6 in float32, at most 3e-3 in float16 and 2e-2 in
bfloat16 (a few units of each dtype's rounding error); the defaults leave a margin of 5x or more
for deeper models. A transform that is not a symmetry changes outputs by O(1)."""


class AlignmentError(ValueError):
    """A pair of models that cannot be aligned, or an alignment that failed its own check."""


@dataclass
class LayerAlignment:
    """What alignment did to one layer.

    Attributes:
        name: Module path (attention, FFN, task head) or ``"residual"``.
        kind: ``"attention"``, ``"feed_forward"``, ``"task_head"`` or ``"residual"``.
        assignment: Target index of each source head / hidden unit / coordinate.
        kv_assignment: Target KV head of each source KV head (attention only).
        stage1_cost: The ``h x h`` Stage 1 cost of the final pass (attention only).
        distance: Parameter distance to the target over this layer's transformed tensors,
            before (``naive``) and after each stage.
        seconds: Time spent per stage.
    """

    name: str
    kind: str
    assignment: list[int]
    kv_assignment: list[int] | None = None
    stage1_cost: list[list[float]] | None = None
    distance: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class AlignmentReport:
    """Result of :func:`align` besides the aligned model.

    Attributes:
        scope: As requested.
        options: As requested.
        dtype: The models' parameter dtype, e.g. ``"float32"`` (the aligned weights are written back in it).
        compute_dtype: The dtype of the Gram matrices and transforms (``float32`` for half-precision
            weights); Stage 1 costs and the per-head Stage 2 problems are solved in ``float64``.
        check_rtol: The probe tolerance applied: ``options.check_rtol``, or :data:`PROBE_RTOL` of ``dtype``.
        layers: One entry per aligned attention layer, FFN, task head and the residual stream.
        transform: The group element mapping the source's weights to the aligned ones.
        distance: Distance to the target over the scope's parameters, ``naive`` and ``aligned``.
        probe_relative_error: ``||f_aligned(x) - f_source(x)|| / ||f_source(x)||`` on the probe.
        seconds: Wall time of the whole alignment.
        calibration: What data-aware settings read (split, samples, batches, data identity);
            ``None`` for weight-only settings.
        calibration_seconds: Wall time of the calibration pass (part of ``seconds``).
        learned: What ``method="learned"`` did (:meth:`~lmc.matching.learned.LearnedAlignment.to_dict`:
            the fixed objective at ``full``'s element and at the returned one, its history, steps
            and seconds); ``None`` for the other methods.
    """

    scope: Scope
    options: AlignOptions
    dtype: str
    check_rtol: float
    compute_dtype: str = ""
    layers: list[LayerAlignment] = field(default_factory=list)
    transform: ModelTransform = field(default_factory=ModelTransform)
    distance: dict[str, float] = field(default_factory=dict)
    probe_relative_error: float = 0.0
    seconds: float = 0.0
    calibration: dict[str, Any] | None = None
    calibration_seconds: float = 0.0
    learned: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the transform's matrices are left out)."""
        return {
            "scope": self.scope,
            "options": asdict(self.options),
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
            "check_rtol": self.check_rtol,
            "distance": self.distance,
            "probe_relative_error": self.probe_relative_error,
            "seconds": self.seconds,
            "calibration": self.calibration,
            "calibration_seconds": self.calibration_seconds,
            "learned": self.learned,
            "layers": [vars(layer) for layer in self.layers],
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_storage(source: nn.Module, target: nn.Module) -> None:
    """Raise :class:`AlignmentError` unless both models are stored in one supported dtype on one device."""
    for what in ("dtype", "device"):
        found = {}
        for role, model in (("source", source), ("target", target)):
            values = {getattr(p, what) for p in model.parameters()}
            if len(values) > 1:
                raise AlignmentError(
                    f"the {role} model's parameters mix {what}s ({', '.join(sorted(map(str, values)))}); "
                    f"move the whole model to one with model.to(...)"
                )
            found[role] = values.pop()
        if found["source"] != found["target"]:
            raise AlignmentError(
                f"source and target differ in {what}: source is {found['source']}, target is {found['target']}; "
                f"put both on one with target.to({str(found['source'])!r})"
            )
    dtype = next(source.parameters()).dtype
    if dtype not in PROBE_RTOL:
        supported = ", ".join(_dtype_name(d) for d in PROBE_RTOL)
        raise AlignmentError(f"lmc aligns {supported} models, not {_dtype_name(dtype)}; cast both with model.to(...)")


def check_same_attention(spec: SymmetrySpec, target_spec: SymmetrySpec) -> None:
    """Raise :class:`AlignmentError` unless both specs' attention layers have one shape and one RoPE."""
    for layer, other in zip(spec.attention, target_spec.attention):
        fields = ("num_heads", "num_kv_heads", "head_dim", "width", "pe")
        if any(getattr(layer, f) != getattr(other, f) for f in fields):
            described = {f: (getattr(layer, f), getattr(other, f)) for f in fields}
            raise AlignmentError(f"{layer.name}: source and target attention differ (source, target): {described}")
        if layer.rotary is not None and not (
            torch.equal(layer.rotary.pairs, other.rotary.pairs)
            and torch.allclose(layer.rotary.angles, other.rotary.angles, atol=1e-6)
        ):
            raise AlignmentError(f"{layer.name}: source and target use different rotary positional encodings")


def _check_pair(source: nn.Module, target: nn.Module, scope: Scope) -> SymmetrySpec:
    """Raise :class:`AlignmentError` unless the two models can be aligned at ``scope``."""
    check_scope(scope)
    if type(source) is not type(target):
        raise AlignmentError(
            f"different architectures: source is {type(source).__name__}, target is {type(target).__name__}"
        )
    adapter_for(source)  # an unsupported model raises its own clear error
    shapes = {name: tuple(p.shape) for name, p in source.named_parameters()}
    target_shapes = {name: tuple(p.shape) for name, p in target.named_parameters()}
    if shapes != target_shapes:
        differing = sorted(set(shapes.items()) ^ set(target_shapes.items()))[:3]
        raise AlignmentError(
            f"different architectures: parameters differ in name or shape, e.g. {differing}; "
            "build both models from the same config"
        )
    _check_storage(source, target)
    spec = model_spec(source)
    check_same_attention(spec, model_spec(target))
    for role, model in (("source", source), ("target", target)):
        for name, parameter in model.named_parameters():
            if not _all_finite(parameter):
                raise AlignmentError(
                    f"the {role} model's {name} holds NaN or Inf values; align finite checkpoints only"
                )
    if scope != "full_model":
        free = set(scope_parameters(source, scope, spec))
        parameters = dict(target.named_parameters())
        for name, parameter in source.named_parameters():
            if name not in free and not _identical(parameter, parameters[name]):
                gap = float((parameter - parameters[name]).detach().abs().max())
                raise AlignmentError(
                    f"scope {scope!r} aligns only its re-initialized parameters, so everything else must be identical, "
                    f"but {name} differs (max abs difference {gap:.3g}). Use the scope the checkpoints were fine-tuned "
                    "with (a wider one, or 'full_model'), or check that both come from the same pre-trained model."
                )
    return spec


# Whole-tensor checks run in chunks: no temporary the size of an embedding matrix.
_CHUNK = 1 << 22


def _stacked_copies(correlation: torch.Tensor, size: int) -> torch.Tensor:
    """The ``(size, size)`` sum of the diagonal blocks of a ``(k * size, k * size)`` correlation
    (a fused projection's ``k`` stacked copies of the units, each copy matched with its own)."""
    copies = correlation.shape[0] // size
    if copies * size != correlation.shape[0]:
        raise AlignmentError(f"a watched signal has {correlation.shape[0]} units, not a multiple of {size}")
    return sum(correlation[c * size : (c + 1) * size, c * size : (c + 1) * size] for c in range(copies))


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return a.shape == b.shape and all(
        torch.equal(a[i : i + _CHUNK], b[i : i + _CHUNK]) for i in range(0, len(a), _CHUNK)
    )


def _all_finite(a: torch.Tensor) -> bool:
    a = a.detach().reshape(-1)
    return all(bool(torch.isfinite(a[i : i + _CHUNK]).all()) for i in range(0, len(a), _CHUNK))


def _layer_distance(source: dict, target: dict, layer) -> float:
    """Distance over the layer's per-head weights and biases (elementwise on views: no GEMM)."""
    total = 0.0
    for name in ("query", "key", "value", "out", "query_bias", "key_bias", "value_bias"):
        rows = head_rows(source, layer, name)
        if rows is not None:
            total += float((rows - head_rows(target, layer, name)).double().pow(2).sum())
    return total**0.5


def _axes_distance(source: dict, target: dict, axes) -> float:
    names = dict.fromkeys(name for name, _ in axes)
    return sum(float((source[n] - target[n]).detach().double().pow(2).sum()) for n in names) ** 0.5


def require_finite(finite: bool, what: str, dtype: torch.dtype) -> None:
    """Refuse a quantity that overflowed: the weights (stored in ``dtype``) are too large to align."""
    if not finite:
        fix = "cast both models to float64 (model.double())" if dtype != torch.float64 else "rescale them"
        raise AlignmentError(f"{what} overflows: the weights are too large to align in {_dtype_name(dtype)}; {fix}")


def attention_stage1(
    source: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    layer: AttentionSpec,
    options: AlignOptions,
    order: list[int] | None = None,
    input_moment: PairedMoment | None = None,
    output_moment: PairedMoment | None = None,
) -> tuple[LayerGrams, LayerGrams, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The Grams, the Stage 1 cost and head assignment of one layer pair, and the seconds each took.

    Args:
        source, target: Parameters holding (at least) the layer's tensors, by spec name.
        layer: The layer.
        options: Metric and Stage 2 settings (the ``weight`` metric runs Stage 2 per candidate pair).
        order: A head order to impose instead of Stage 1's (:func:`imposed_order`).
        input_moment: The layer input's paired moments (augmented with 1), for ``objective="data"``
            and ``metric="activation"``.
        output_moment: What ``W_O`` reads, paired, for ``metric="activation"``.

    Returns:
        ``(grams, stage2_grams, cost, match, kv_match, seconds)``: the weight Grams, the Grams
        Stage 2 fits (the data Grams under ``objective="data"``), ``cost`` ``(h, h)``, ``match``
        the target head of each source query head ``(h,)``, ``kv_match`` that of each KV head ``(h_kv,)``.
    """
    dtype = source[layer.query.parameter].dtype
    seconds = {}
    start = time.perf_counter()
    grams = LayerGrams.compute(source, target, layer)
    require_finite(grams.all_finite(), f"{layer.name}: the Gram matrices", dtype)
    data_grams = None
    if input_moment is not None:
        data_grams = LayerGrams.compute(source, target, layer, input_moment)
        require_finite(data_grams.all_finite(), f"{layer.name}: the data Gram matrices", dtype)
    stage2_grams = data_grams if options.objective == "data" else grams
    seconds["grams"] = time.perf_counter() - start
    start = time.perf_counter()
    cost_grams = data_grams if options.metric == "activation" else stage2_grams
    cost = head_cost(cost_grams, layer, options, output_moment)
    require_finite(bool(torch.isfinite(cost).all()), f"{layer.name}: the Stage 1 head cost", dtype)
    match, kv_match = assign_heads(cost, layer.queries_per_kv) if order is None else imposed_order(order, layer)
    seconds["stage1"] = time.perf_counter() - start
    return grams, stage2_grams, cost, match, kv_match, seconds


def align_attention_layer(
    source: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    layer: AttentionSpec,
    options: AlignOptions,
    order: list[int] | None = None,
    naive_distance: float | None = None,
    input_moment: PairedMoment | None = None,
    output_moment: PairedMoment | None = None,
) -> tuple[AttentionTransform, LayerAlignment]:
    """Both stages on one attention layer pair: the group element up to ``options.last_stage`` and its record.

    Reads only the layer's tensors, so a caller can hand it one layer of each model at a time.

    Args:
        source, target: Parameters holding (at least) the layer's tensors, by spec name.
        layer: The layer.
        options: Method, metric and Stage 2 settings (``options.method`` is not ``"naive"``).
        order: A head order to impose instead of Stage 1's.
        naive_distance: The distance before alignment, recorded first (default: from ``source``).
        input_moment, output_moment: Activation statistics of data-aware options (:func:`attention_stage1`).

    Returns:
        ``(element, record)``: ``element`` maps the source layer's weights to the aligned ones;
        ``record.assignment``/``kv_assignment`` describe this element alone.
    """
    grams, stage2_grams, cost, match, kv_match, seconds = attention_stage1(
        source, target, layer, options, order, input_moment, output_moment
    )
    start = time.perf_counter()
    stages = attention_stages(stage2_grams, layer, match, kv_match, options.last_stage, options)
    seconds["stage2"] = time.perf_counter() - start
    naive = _layer_distance(source, target, layer) if naive_distance is None else naive_distance
    distance = {"naive": naive, **stage_distances(grams, layer, match, kv_match, stages)}
    record = LayerAlignment(
        name=layer.name,
        kind="attention",
        assignment=match.tolist(),
        kv_assignment=kv_match.tolist(),
        stage1_cost=cost.tolist(),
        distance=distance,
        seconds=seconds,
    )
    return stages[options.last_stage], record


class _Aligner:
    """State of one alignment: the working copy, the target, the accumulated transform."""

    def __init__(
        self,
        source: nn.Module,
        target: nn.Module,
        spec: SymmetrySpec,
        report: AlignmentReport,
        calibration: Calibration | None = None,
    ):
        self.options = report.options
        self.calibration = calibration
        self.moments: dict[str, PairedMoment] = {}
        shared = {}
        if self.options.share_frozen and report.scope != "full_model":
            # Parameters outside the scope never change (and equal the target's): share, don't copy.
            free = set(scope_parameters(source, report.scope, spec))
            shared = {id(p): p for name, p in source.named_parameters() if name not in free}
        self.working = copy.deepcopy(source, shared)
        self.parameters = dict(self.working.named_parameters())
        self.target = dict(target.named_parameters())
        self.original = dict(source.named_parameters())  # read only
        self.target_model = target
        self.dtype = next(source.parameters()).dtype
        self.spec = spec
        self.report = report

    def require_finite(self, finite: bool, what: str) -> None:
        require_finite(finite, what, self.dtype)

    def apply(self, transform: ModelTransform) -> None:
        with torch.no_grad():
            transform.apply_(self.parameters, self.spec)
        self.report.transform = self.report.transform.compose(transform, self.spec)
        self.move_moments(transform)

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
        if transform.residual is not None:
            index = torch.cat([transform.residual.cpu(), torch.tensor([len(transform.residual)])])
            for key in [k for k in self.moments if k.startswith("input:")]:
                self.moments[key] = self.moments[key].moved(index)
        for layer_index, element in transform.attention.items():
            key = f"output:{layer_index}"
            if key in self.moments:
                d_h = element.vo.shape[-1]
                heads = element.query_permutation.cpu()
                index = (heads[:, None] * d_h + torch.arange(d_h)).flatten()
                per_head = element.vo.cpu().double().repeat_interleave(element.queries_per_kv, dim=0)
                self.moments[key] = self.moments[key].moved(index, torch.block_diag(*per_head))

    def layer_moments(self, index: int) -> tuple[PairedMoment | None, PairedMoment | None]:
        """The captured input and output moments of attention layer ``index`` (``None`` when not captured)."""
        return self.moments.get(f"input:{index}"), self.moments.get(f"output:{index}")

    def permute_heads(self, index: int) -> bool:
        """Stage 1 only; returns whether the head order changed."""
        layer = self.spec.blocks[index].attention
        order = (self.options.head_orders or {}).get(index)
        grams, _, _, match, kv_match, _ = attention_stage1(
            self.parameters, self.target, layer, self.options, order, *self.layer_moments(index)
        )
        if torch.equal(match, torch.arange(len(match))):
            return False
        stages = attention_stages(grams, layer, match, kv_match, "permutation", self.options)
        self.apply(ModelTransform(attention={index: stages["permutation"]}))
        return True

    def align_attention(self, index: int) -> None:
        """Both stages on one layer, recording distances after each stage."""
        layer = self.spec.blocks[index].attention
        order = (self.options.head_orders or {}).get(index)
        naive = _layer_distance(self.original, self.target, layer)
        element, record = align_attention_layer(
            self.parameters, self.target, layer, self.options, order, naive, *self.layer_moments(index)
        )
        self.apply(ModelTransform(attention={index: element}))
        overall = self.report.transform.attention[index]
        record.assignment = torch.argsort(overall.query_permutation).tolist()
        record.kv_assignment = torch.argsort(overall.kv_permutation).tolist()
        self.report.layers.append(record)

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
            layers[layer.name].distance["learned"] = _layer_distance(self.parameters, self.target, layer)
            layers[layer.name].seconds["learned"] = learned.seconds  # one descent over every layer

    def match_units(self, feed_forward: list[int], whole: bool) -> None:
        """Activation matching: the scope's FFN hidden units, and under ``full_model`` the task heads'
        hidden units and the residual stream, each permuted to maximize its summed correlation with
        the target's units over the calibration tokens (one pass of both models for all of them).

        A unit's activations do not change under any other symmetry, so each permutation is solved
        once, independently. Its correlations add up over every signal that carries the units: the
        inputs of the modules that read them (the residual stream: every norm on it) and the outputs
        of those that write them (an FFN's up and gate projections, each stacked copy alike).
        """
        start = time.perf_counter()
        permutations = {("feed_forward", i): self.spec.blocks[i].feed_forward.hidden for i in feed_forward}
        if whole:
            permutations |= {("task_head", i): head for i, head in enumerate(self.spec.task_heads)}
            if self.spec.residual is not None:
                permutations["residual", 0] = self.spec.residual
        if not permutations:
            return
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
        perms = {}
        for key, permutation in permutations.items():
            correlation = sum(_stacked_copies(correlations[signal], permutation.size) for signal in signals[key])
            self.require_finite(
                bool(torch.isfinite(correlation).all()), f"{permutation.name}: the activation correlation"
            )
            perms[key] = best_permutation(correlation)
        self.apply(
            ModelTransform(
                feed_forward={i: perm for (kind, i), perm in perms.items() if kind == "feed_forward"},
                task_heads={i: perm for (kind, i), perm in perms.items() if kind == "task_head"},
                residual=perms.get(("residual", 0)),
            )
        )
        seconds = time.perf_counter() - start
        for key, perm in perms.items():
            permutation = permutations[key]
            self.record_permutation(permutation.name, key[0], perm, permutation.axes, seconds)

    def best_permutation(self, permutation: AxisPermutation, axes) -> torch.Tensor | None:
        """The weight-matching permutation of ``permutation``'s axis read through ``axes``; ``None`` if identity."""
        correlation = axis_correlation(self.parameters, self.target, axes, permutation.size)
        self.require_finite(bool(torch.isfinite(correlation).all()), f"{permutation.name}: the weight correlation")
        perm = best_permutation(correlation)
        return None if torch.equal(perm, torch.arange(permutation.size)) else perm

    def permute_feed_forward(self, index: int) -> bool:
        hidden = self.spec.blocks[index].feed_forward.hidden
        perm = self.best_permutation(hidden, hidden.axes)
        if perm is not None:
            self.apply(ModelTransform(feed_forward={index: perm}))
        return perm is not None

    def permute_task_head(self, index: int) -> bool:
        hidden = self.spec.task_heads[index]
        perm = self.best_permutation(hidden, hidden.axes)
        if perm is not None:
            self.apply(ModelTransform(task_heads={index: perm}))
        return perm is not None

    def permute_residual(self, axes) -> bool:
        perm = self.best_permutation(self.spec.residual, axes)
        if perm is not None:
            self.apply(ModelTransform(residual=perm))
        return perm is not None

    def record_permutation(self, name: str, kind: str, perm: torch.Tensor, axes, seconds: float) -> None:
        """Report one permutation and the distance over ``axes`` before and after it."""
        distance = {
            "naive": _axes_distance(self.original, self.target, axes),
            "permutation": _axes_distance(self.parameters, self.target, axes),
        }
        self.report.layers.append(
            LayerAlignment(name, kind, torch.argsort(perm).tolist(), distance=distance, seconds={"match": seconds})
        )


def imposed_order(order: list[int], layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(match, kv_match)`` of a given head order, refused unless it keeps query heads with their KV head."""
    q = layer.queries_per_kv
    match = torch.as_tensor(order)
    if len(order) != layer.num_heads:
        raise AlignmentError(f"{layer.name}: a head order needs {layer.num_heads} entries, got {len(order)}")
    groups = match.view(-1, q) // q
    if not bool((groups == groups[:, :1]).all()):
        raise AlignmentError(f"{layer.name}: head order {order} splits the query heads of a key/value head")
    return match, groups[:, 0].clone()


def _residual_axes(spec: SymmetrySpec) -> tuple[list, list]:
    """Residual axes of parameters no other symmetry moves (anchors), and those of FFN and task-head parameters."""
    moved = {slot.parameter for layer in spec.attention for slot in layer.slots}
    hidden = [block.feed_forward.hidden for block in spec.blocks if block.feed_forward] + list(spec.task_heads)
    through_hidden = {name for permutation in hidden for name, _ in permutation.axes}
    anchors = [(n, a) for n, a in spec.residual.axes if n not in moved and n not in through_hidden]
    return anchors, [(n, a) for n, a in spec.residual.axes if n in through_hidden]


def _probe_error(source: nn.Module, aligned: nn.Module, batch_size: int, seed: int, role: str = "source") -> float:
    """``||f_aligned(x) - f_source(x)|| / ||f_source(x)||`` on the probe; ``role`` names ``source`` in errors."""
    adapter = adapter_for(source)
    inputs = adapter.example_inputs(source, batch_size, torch.Generator().manual_seed(seed))
    modes = source.training, aligned.training
    source.eval(), aligned.eval()
    try:
        with torch.no_grad():
            reference, output = adapter.forward(source, inputs), adapter.forward(aligned, inputs)
    finally:
        source.train(modes[0]), aligned.train(modes[1])
    if not _all_finite(reference):
        raise AlignmentError(
            f"the {role} model's outputs on the probe input are not finite in {_dtype_name(reference.dtype)}, so no "
            "alignment can be checked; its weights overflow the forward pass (cast both models to float64 or rescale)"
        )
    return float((output - reference).double().norm() / reference.double().norm())


def align(
    source: nn.Module,
    target: nn.Module,
    scope: Scope = "first_attention",
    options: AlignOptions | None = None,
    calibration: Calibration | None = None,
) -> tuple[nn.Module, AlignmentReport]:
    """Align ``source`` to ``target`` within the symmetry group of ``scope``.

    Float16 and bfloat16 models align too: Grams, Stage 2 and the transforms are computed in
    float32 or float64 and the aligned weights are written back in the models' dtype.

    Args:
        source: The model to transform (never modified).
        target: The model to come close to (never modified); same architecture, dtype and device.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` or ``"full_model"``.
            Outside ``full_model`` every parameter outside the scope must be identical in both.
        options: Method, head metric, Stage 2 and check settings (:class:`AlignOptions`);
            ``None`` takes the defaults.
        calibration: Training batches the data-aware settings (``method="learned"``, ``objective="data"``,
            ``metric="activation"``) read activations from; its
            first ``options.calibration_batches`` are used. Ignored by weight-only settings. The
            group element is still applied to the weights, so the function stays exact.

    Returns:
        ``(aligned, report)``: a new module computing the same function as ``source``.

    Raises:
        ValueError: Unknown ``scope``; data-aware options without a calibration (or with fewer
            batches than ``options.calibration_batches``).
        AlignmentError: The pair cannot be aligned (architectures, dtypes, devices, frozen
            parameters, NaN/Inf or overflowing weights), or the result is not a symmetry of
            ``source`` on the probe to ``report.check_rtol``.
    """
    options = AlignOptions() if options is None else options
    if not isinstance(options, AlignOptions):
        raise TypeError(f"options must be an lmc.matching.AlignOptions, got {type(options).__name__}")
    if options.data_aware:
        if calibration is None:
            raise ValueError(
                f"the alignment options {options.data_settings} read activations, so align needs calibration "
                "batches: pass calibration=lmc.matching.Calibration(...) (lmc.connectivity.training_calibration "
                "builds one from a DataModule's training split), or --data on the command line"
            )
        calibration = calibration.take(options.calibration_batches)
    started = time.perf_counter()
    spec = _check_pair(source, target, scope)
    dtype = next(source.parameters()).dtype
    rtol = PROBE_RTOL[dtype] if options.check_rtol is None else options.check_rtol
    report = AlignmentReport(scope, options, _dtype_name(dtype), rtol, _dtype_name(compute_dtype(dtype)))
    if options.data_aware:
        report.calibration = calibration.identity() | {"batches": len(calibration.batches)}
    aligner = _Aligner(source, target, spec, report, calibration if options.data_aware else None)

    if options.method != "naive":
        attention, feed_forward, whole = scope_blocks(spec, scope)
        start = time.perf_counter()
        aligner.capture(attention)
        report.calibration_seconds = time.perf_counter() - start
        if options.unit_matching == "activation":
            aligner.match_units(feed_forward, whole)
        elif whole:
            _coordinate_descent(aligner, spec, attention, feed_forward)
        else:
            for index in feed_forward:
                start = time.perf_counter()
                aligner.permute_feed_forward(index)
                hidden = spec.blocks[index].feed_forward.hidden
                perm = report.transform.feed_forward.get(index, torch.arange(hidden.size))
                aligner.record_permutation(hidden.name, "feed_forward", perm, hidden.axes, time.perf_counter() - start)
        for index in attention:
            aligner.align_attention(index)
        if options.method == "learned" and attention:
            aligner.learn(attention)

    scoped = [(name, 0) for name in scope_parameters(source, scope, spec)]
    report.distance = {
        "naive": _axes_distance(aligner.original, aligner.target, scoped),
        "aligned": _axes_distance(aligner.parameters, aligner.target, scoped),
    }
    report.probe_relative_error = _probe_error(source, aligner.working, options.probe_batch_size, options.seed)
    if not report.probe_relative_error <= rtol:
        change = f"relative output change {report.probe_relative_error:.3g} on the probe input"
        if options.check_rtol is None:
            raise AlignmentError(
                f"the aligned model does not compute the source's function: {change} > {rtol:g} (the "
                f"{report.dtype} tolerance). This is a bug in lmc (adapter for {type(source).__name__}, scope "
                f"{scope!r}, method {options.method!r}); please report it."
            )
        raise AlignmentError(
            f"the aligned model misses check_rtol={rtol:g}: {change}. Rounding in {report.dtype} alone reaches "
            f"about {PROBE_RTOL[dtype]:g} (the default); raise check_rtol or leave it None."
        )
    report.seconds = time.perf_counter() - started
    return aligner.working, report


def _coordinate_descent(aligner: _Aligner, spec: SymmetrySpec, attention: list[int], feed_forward: list[int]) -> None:
    """Residual, FFN, task-head and head permutations for ``full_model``, each solved with the rest fixed."""
    start = time.perf_counter()
    anchors, through_hidden = _residual_axes(spec) if spec.residual is not None else ([], [])
    if spec.residual is not None:
        aligner.permute_residual(anchors)
    for _ in range(aligner.options.max_iterations):
        changed = False
        for index in feed_forward:
            changed |= aligner.permute_feed_forward(index)
        for index in range(len(spec.task_heads)):
            changed |= aligner.permute_task_head(index)
        for index in attention:
            changed |= aligner.permute_heads(index)
        if spec.residual is not None:
            changed |= aligner.permute_residual(anchors + through_hidden)
        if not changed:
            break
    seconds = time.perf_counter() - start
    transform = aligner.report.transform
    for index in feed_forward:
        hidden = spec.blocks[index].feed_forward.hidden
        perm = transform.feed_forward.get(index, torch.arange(hidden.size))
        aligner.record_permutation(hidden.name, "feed_forward", perm, hidden.axes, seconds)
    for index, hidden in enumerate(spec.task_heads):
        perm = transform.task_heads.get(index, torch.arange(hidden.size))
        aligner.record_permutation(hidden.name, "task_head", perm, hidden.axes, seconds)
    if spec.residual is not None:
        perm = torch.arange(spec.residual.size) if transform.residual is None else transform.residual
        aligner.record_permutation("residual", "residual", perm, spec.residual.axes, seconds)
