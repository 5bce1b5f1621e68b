"""``align``: bring a source model's weights next to a target's without changing its function.

Attention layers use the two-stage matcher of :mod:`lmc.matching.attention`; FFN hidden units
and the residual stream use weight matching (:mod:`lmc.matching.permutation`). For
``full_model`` the permutations are found by coordinate descent: the residual permutation is
started from the parameters whose other axes no symmetry moves (embeddings, norms, heads,
output biases), then FFN permutations, head orders and the residual permutation (now also read
through the aligned FFNs) are solved in turn until none changes. Stage 2 then runs on every
attention layer with all permutations fixed, so the distance to the target never rises from
``permutation`` to ``orthogonal`` to ``full``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from lmc.adapters import adapter_for
from lmc.matching.attention import (
    METRICS,
    LayerGrams,
    Stage2Options,
    assign_heads,
    attention_stages,
    head_cost,
    stage_distances,
)
from lmc.matching.options import AlignOptions
from lmc.matching.permutation import axis_correlation, best_permutation
from lmc.symmetry import (
    SCOPES,
    ModelTransform,
    SymmetrySpec,
    head_rows,
    model_spec,
    scope_blocks,
    scope_parameters,
)

METHODS = ("naive", "permutation", "orthogonal", "full")
STAGES = ("permutation", "orthogonal", "full")
_DEFAULT_CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3}


class AlignmentError(ValueError):
    """A pair of models that cannot be aligned, or an alignment that failed its own check."""


@dataclass
class LayerAlignment:
    """What alignment did to one layer.

    Attributes:
        name: Module path (attention, FFN) or ``"residual"``.
        kind: ``"attention"``, ``"feed_forward"`` or ``"residual"``.
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
        scope, method, metric: As requested.
        layers: One entry per aligned attention layer, FFN and the residual stream.
        transform: The group element mapping the source's weights to the aligned ones.
        distance: Distance to the target over the scope's parameters, ``naive`` and ``aligned``.
        probe_relative_error: ``||f_aligned(x) - f_source(x)|| / ||f_source(x)||`` on the probe.
        seconds: Wall time of the whole alignment.
    """

    scope: str
    method: str
    metric: str
    layers: list[LayerAlignment] = field(default_factory=list)
    transform: ModelTransform = field(default_factory=ModelTransform)
    distance: dict[str, float] = field(default_factory=dict)
    probe_relative_error: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the transform's matrices are left out)."""
        return {
            "scope": self.scope,
            "method": self.method,
            "metric": self.metric,
            "distance": self.distance,
            "probe_relative_error": self.probe_relative_error,
            "seconds": self.seconds,
            "layers": [vars(layer) for layer in self.layers],
        }


def _check_pair(source: nn.Module, target: nn.Module, scope: str) -> SymmetrySpec:
    """Raise :class:`AlignmentError` unless the two models can be aligned at ``scope``."""
    if scope not in SCOPES:
        raise AlignmentError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
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
    spec, target_spec = model_spec(source), model_spec(target)
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


class _Aligner:
    """State of one alignment: the working copy, the target, the accumulated transform."""

    def __init__(self, source: nn.Module, target: nn.Module, spec: SymmetrySpec, report: AlignmentReport, options):
        shared = {}
        if options["share_frozen"] and report.scope != "full_model":
            # Parameters outside the scope never change (and equal the target's): share, don't copy.
            free = set(scope_parameters(source, report.scope, spec))
            shared = {id(p): p for name, p in source.named_parameters() if name not in free}
        self.working = copy.deepcopy(source, shared)
        self.parameters = dict(self.working.named_parameters())
        self.target = dict(target.named_parameters())
        self.original = dict(source.named_parameters())  # read only
        self.spec = spec
        self.report = report
        self.metric = options["metric"]
        self.stage2 = Stage2Options(options["steps"], options["lr"], options["tolerance"])

    def apply(self, transform: ModelTransform) -> None:
        with torch.no_grad():
            transform.apply_(self.parameters, self.spec)
        self.report.transform = self.report.transform.compose(transform, self.spec)

    def stage1(self, index: int) -> tuple[LayerGrams, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        layer = self.spec.blocks[index].attention
        seconds = {}
        start = time.perf_counter()
        grams = LayerGrams.compute(self.parameters, self.target, layer)
        seconds["grams"] = time.perf_counter() - start
        start = time.perf_counter()
        cost = head_cost(grams, layer, self.metric, self.report.method == "full", self.stage2)
        match, kv_match = assign_heads(cost, layer.queries_per_kv)
        seconds["stage1"] = time.perf_counter() - start
        return grams, cost, match, kv_match, seconds

    def permute_heads(self, index: int) -> bool:
        """Stage 1 only; returns whether the head order changed."""
        grams, _, match, kv_match, _ = self.stage1(index)
        if torch.equal(match, torch.arange(len(match))):
            return False
        layer = self.spec.blocks[index].attention
        stages = attention_stages(grams, layer, match, kv_match, "permutation", self.stage2)
        self.apply(ModelTransform(attention={index: stages["permutation"]}))
        return True

    def align_attention(self, index: int) -> None:
        """Both stages on one layer, recording distances after each stage."""
        layer = self.spec.blocks[index].attention
        grams, cost, match, kv_match, seconds = self.stage1(index)
        start = time.perf_counter()
        stages = attention_stages(grams, layer, match, kv_match, self.report.method, self.stage2)
        seconds["stage2"] = time.perf_counter() - start
        distance = {"naive": _layer_distance(self.original, self.target, layer)}
        distance.update(stage_distances(grams, layer, match, kv_match, stages))
        self.apply(ModelTransform(attention={index: stages[self.report.method]}))
        overall = self.report.transform.attention[index]
        self.report.layers.append(
            LayerAlignment(
                name=layer.name,
                kind="attention",
                assignment=torch.argsort(overall.query_permutation).tolist(),
                kv_assignment=torch.argsort(overall.kv_permutation).tolist(),
                stage1_cost=cost.tolist(),
                distance=distance,
                seconds=seconds,
            )
        )

    def permute_feed_forward(self, index: int) -> bool:
        hidden = self.spec.blocks[index].feed_forward.hidden
        perm = best_permutation(axis_correlation(self.parameters, self.target, hidden.axes, hidden.size))
        if torch.equal(perm, torch.arange(hidden.size)):
            return False
        self.apply(ModelTransform(feed_forward={index: perm}))
        return True

    def permute_residual(self, axes) -> bool:
        residual = self.spec.residual
        perm = best_permutation(axis_correlation(self.parameters, self.target, axes, residual.size))
        if torch.equal(perm, torch.arange(residual.size)):
            return False
        self.apply(ModelTransform(residual=perm))
        return True

    def record_permutation(self, name: str, kind: str, perm: torch.Tensor, axes, seconds: float) -> None:
        distance = {
            "naive": _axes_distance(self.original, self.target, axes),
            "permutation": _axes_distance(self.parameters, self.target, axes),
        }
        self.report.layers.append(
            LayerAlignment(name, kind, torch.argsort(perm).tolist(), distance=distance, seconds={"match": seconds})
        )


def _residual_axes(spec: SymmetrySpec) -> tuple[list, list]:
    """Residual axes of parameters no other symmetry moves (anchors), and those of FFN parameters."""
    moved = {slot.parameter for layer in spec.attention for slot in layer.slots}
    feed_forward = {name for block in spec.blocks if block.feed_forward for name, _ in block.feed_forward.hidden.axes}
    anchors = [(n, a) for n, a in spec.residual.axes if n not in moved and n not in feed_forward]
    through_ffn = [(n, a) for n, a in spec.residual.axes if n in feed_forward]
    return anchors, through_ffn


def _probe_error(source: nn.Module, aligned: nn.Module, batch_size: int, seed: int) -> float:
    adapter = adapter_for(source)
    inputs = adapter.example_inputs(source, batch_size, torch.Generator().manual_seed(seed))
    modes = source.training, aligned.training
    source.eval(), aligned.eval()
    try:
        with torch.no_grad():
            reference, output = adapter.forward(source, inputs), adapter.forward(aligned, inputs)
    finally:
        source.train(modes[0]), aligned.train(modes[1])
    return float((output - reference).double().norm() / reference.double().norm())


def align(
    source: nn.Module,
    target: nn.Module,
    scope: str = "first_attention",
    method: str = "full",
    options: AlignOptions | None = None,
    **settings: Any,
) -> tuple[nn.Module, AlignmentReport]:
    """Align ``source`` to ``target`` within the symmetry group of ``scope``.

    Args:
        source: The model to transform (never modified).
        target: The model to come close to (never modified); same architecture.
        scope: ``"first_attention"``, ``"all_attention"``, ``"first_block"`` or ``"full_model"``.
            Outside ``full_model`` every parameter outside the scope must be identical in both.
        method: ``"naive"`` (no change), ``"permutation"`` (Stage 1 only), ``"orthogonal"``
            (Stage 1 and the orthogonal start) or ``"full"`` (plus gradient refinement).
        options: All settings at once (stand-in: unpacked into ``method`` and ``**settings``).
        **settings: ``metric`` (Stage 1 cost: ``"invariant"``, ``"weight"``, ``"correlation"``),
            ``steps``, ``lr``, ``tolerance`` (Stage 2 L-BFGS), ``max_iterations`` (coordinate
            descent rounds for ``full_model``), ``check_rtol`` (probe tolerance; default 1e-6 in
            float64, 1e-3 in float32, 3e-2 below), ``probe_batch_size``, ``seed``,
            ``share_frozen`` (default ``True``: outside ``full_model`` the aligned module shares
            the parameters outside the scope with ``source`` instead of copying them; they are
            unchanged by construction. Pass ``False`` for a fully independent copy).

    Returns:
        ``(aligned, report)``: a new module computing the same function as ``source``.

    Raises:
        AlignmentError: The pair cannot be aligned (architectures, frozen parameters, NaN/Inf),
            or the result is not a symmetry of ``source`` on the probe (a bug, never a result).
    """
    if options is not None:
        method, settings = options.method, {f.name: getattr(options, f.name) for f in fields(options)[1:]}
    stage2 = Stage2Options()
    defaults = dict(metric="invariant", steps=stage2.steps, lr=stage2.lr, tolerance=stage2.tolerance, max_iterations=20)
    defaults.update(check_rtol=None, probe_batch_size=2, seed=0, share_frozen=True)
    unknown = settings.keys() - defaults.keys()
    if unknown:
        raise AlignmentError(f"unknown option(s) {sorted(unknown)}; valid options: {', '.join(defaults)}")
    options = {**defaults, **settings}
    if method not in METHODS:
        raise AlignmentError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if options["metric"] not in METRICS:
        raise AlignmentError(f"unknown metric {options['metric']!r}; choose one of {', '.join(METRICS)}")
    started = time.perf_counter()
    spec = _check_pair(source, target, scope)
    report = AlignmentReport(scope, method, options["metric"])
    aligner = _Aligner(source, target, spec, report, options)

    if method != "naive":
        attention, feed_forward, whole = scope_blocks(spec, scope)
        for index in feed_forward if not whole else []:
            start = time.perf_counter()
            aligner.permute_feed_forward(index)
            block = spec.blocks[index].feed_forward
            perm = report.transform.feed_forward.get(index, torch.arange(block.hidden.size))
            aligner.record_permutation(
                block.hidden.name, "feed_forward", perm, block.hidden.axes, time.perf_counter() - start
            )
        if whole:
            _coordinate_descent(aligner, spec, attention, feed_forward, options["max_iterations"])
        for index in attention:
            aligner.align_attention(index)

    scoped = scope_parameters(source, scope, spec)
    report.distance = {
        "naive": _axes_distance(aligner.original, aligner.target, [(n, 0) for n in scoped]),
        "aligned": _axes_distance(aligner.parameters, aligner.target, [(n, 0) for n in scoped]),
    }
    dtype = next(source.parameters()).dtype
    rtol = options["check_rtol"] or _DEFAULT_CHECK_RTOL.get(dtype, 3e-2)
    report.probe_relative_error = _probe_error(source, aligner.working, options["probe_batch_size"], options["seed"])
    if not report.probe_relative_error <= rtol:
        raise AlignmentError(
            f"the aligned model does not compute the source's function: relative output change "
            f"{report.probe_relative_error:.3g} > {rtol:g} on the probe input. This is a bug in lmc "
            f"(adapter for {type(source).__name__}, scope {scope!r}, method {method!r}); please report it."
        )
    report.seconds = time.perf_counter() - started
    return aligner.working, report


def _coordinate_descent(aligner: _Aligner, spec: SymmetrySpec, attention, feed_forward, max_iterations: int) -> None:
    """Residual, FFN and head permutations for ``full_model``, each solved with the rest fixed."""
    start = time.perf_counter()
    anchors, through_ffn = _residual_axes(spec) if spec.residual is not None else ([], [])
    if spec.residual is not None:
        aligner.permute_residual(anchors)
    for _ in range(max_iterations):
        changed = False
        for index in feed_forward:
            changed |= aligner.permute_feed_forward(index)
        for index in attention:
            changed |= aligner.permute_heads(index)
        if spec.residual is not None:
            changed |= aligner.permute_residual(anchors + through_ffn)
        if not changed:
            break
    seconds = time.perf_counter() - start
    for index in feed_forward:
        hidden = spec.blocks[index].feed_forward.hidden
        perm = aligner.report.transform.feed_forward.get(index, torch.arange(hidden.size))
        aligner.record_permutation(hidden.name, "feed_forward", perm, hidden.axes, seconds)
    if spec.residual is not None:
        perm = aligner.report.transform.residual
        perm = torch.arange(spec.residual.size) if perm is None else perm
        aligner.record_permutation("residual", "residual", perm, spec.residual.axes, seconds)
