"""The first attention layer of a model at the midpoint of an alignment, head by head (float64): what
:mod:`benchmarks.stage2.refinement_data` measures with, and the planted control it measures against.

Per head ``i``, with ``P`` the attention probabilities and ``u = (x W_V + b_V) W_O`` what each token's
value writes into the residual stream, the head's output is ``P u`` (the module docstring of
:mod:`benchmarks.stage2.refinement_data` gives the exact split of the midpoint's deviation).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lmc.adapters import model_spec, scope_parameters
from lmc.symmetry import AttentionSpec, AttentionWeights, ModelTransform, read_attention, sample_attention_transform


@dataclass
class HeadActivity:
    """What one attention layer's heads compute on a set of inputs (no RoPE, no mask).

    Attributes:
        scores: ``(N, h, T, T)``, the pre-softmax scores ``q k^T / sqrt(d_h)``.
        probabilities: ``(N, h, T, T)``, their softmax over the keys.
        values: ``(N, h, T, d)``, ``(x W_V + b_V) W_O`` per head: what each token's value writes.
    """

    scores: torch.Tensor
    probabilities: torch.Tensor
    values: torch.Tensor

    @property
    def outputs(self) -> torch.Tensor:
        """``(N, h, T, d)``: each head's output ``P u`` (the layer's output is their sum plus ``b_O``)."""
        return self.probabilities @ self.values


def head_activity(weights: AttentionWeights, inputs: torch.Tensor) -> HeadActivity:
    """The heads of a layer (its per-head view, float64) on its inputs ``(N, T, d)``."""
    heads, group = len(weights.query), len(weights.query) // len(weights.key)
    kv = torch.arange(heads) // group

    def project(matrices: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # (n, d, d_h) -> (N, n, T, d_h)
        out = torch.einsum("ntd,hde->nhte", inputs, matrices)
        return out if bias is None else out + bias[None, :, None, :]

    q = project(weights.query, weights.query_bias)
    k = project(weights.key, weights.key_bias)[:, kv]
    v = project(weights.value, weights.value_bias)[:, kv]
    scores = q @ k.mT / weights.query.shape[-1] ** 0.5
    return HeadActivity(scores, scores.softmax(-1), v @ weights.out[None])


def midpoint_parts(a: HeadActivity, b: HeadActivity, mid: HeadActivity) -> dict[str, torch.Tensor]:
    """The midpoint's deviation from the end points' mean output, split exactly (module docstring).

    Returns:
        ``total``, ``qk_part``, ``vo_part``, ``fixed_part``, each ``(N, h, T, d)``, with
        ``total = qk_part + vo_part + fixed_part``.
    """
    mean_p, mean_u = (a.probabilities + b.probabilities) / 2, (a.values + b.values) / 2
    return {
        "total": mid.outputs - (a.outputs + b.outputs) / 2,
        "qk_part": (mid.probabilities - mean_p) @ mean_u,
        "vo_part": mid.probabilities @ (mid.values - mean_u),
        "fixed_part": -(a.probabilities - b.probabilities) @ (a.values - b.values) / 4,
    }


def squared(tensor: torch.Tensor) -> dict:
    """Mean squared norm per token of ``(N, h, T, d)``: per head, and of the heads' sum."""
    return {"heads": tensor.pow(2).sum(-1).mean((0, 2)).tolist(), "sum": float(tensor.sum(1).pow(2).sum(-1).mean())}


def per_head(tensor: torch.Tensor) -> dict:
    """Mean over samples and queries of ``(N, h, T)``: per head, and summed over heads."""
    heads = tensor.mean((0, 2))
    return {"heads": heads.tolist(), "sum": float(heads.sum())}


def midpoint_measures(a: HeadActivity, b: HeadActivity, mid: HeadActivity, residual: torch.Tensor) -> dict:
    """The midpoint's first attention layer against the end points' (per head, and summed over heads).

    Args:
        a, b, mid: The aligned source, the target and their midpoint on the same inputs.
        residual: ``(N, T, d)``, the residual stream the layer adds to (the same in the three models).
    """
    parts = midpoint_parts(a, b, mid)
    mean_p = (a.probabilities + b.probabilities) / 2
    mean_output = (a.outputs + b.outputs).sum(1) / 2
    entropy = -(mid.probabilities * mid.probabilities.clamp_min(1e-300).log()).sum(-1)
    return {
        "output": squared(parts["total"]),
        "qk_part": squared(parts["qk_part"]),
        "vo_part": squared(parts["vo_part"]),
        "fixed_part": squared(parts["fixed_part"]),
        "attention_tv": per_head((mid.probabilities - mean_p).abs().sum(-1) / 2),
        "score": per_head((mid.scores - (a.scores + b.scores) / 2).pow(2).sum(-1)),
        "value": per_head((mid.values - (a.values + b.values) / 2).pow(2).sum(-1)),
        "entropy": per_head(entropy),
        "first_token": float(parts["total"][:, :, 0].sum(1).pow(2).sum(-1).mean()),
        "fixed_alignment": float(
            (parts["fixed_part"].sum(1) * (parts["qk_part"] + parts["vo_part"]).sum(1)).sum(-1).mean()
        ),
        "output_norm_ratio": float(mid.outputs.sum(1).norm() / mean_output.norm()),
        "relative_to_residual": float(
            (parts["total"].sum(1).pow(2).sum(-1).mean() / (residual + mean_output).pow(2).sum(-1).mean()) ** 0.5
        ),
    }


def layer_io(module, model: nn.Module, layer: AttentionSpec, batches: list) -> tuple[torch.Tensor, ...]:
    """``(inputs, outputs, residual)`` of the attention layer on ``batches``, float64, each ``(N, T, d)``.

    ``residual`` is the input of the module that holds the layer (a pre-norm block: the stream the
    layer's output is added to).
    """
    attention = model.get_submodule(layer.name)
    block = model.get_submodule(layer.name.rpartition(".")[0])
    seen: dict[str, list[torch.Tensor]] = {"inputs": [], "outputs": [], "residual": []}

    def record(_, args: tuple, out: torch.Tensor) -> None:
        seen["inputs"].append(args[0].double())
        seen["outputs"].append(out.double())

    def record_residual(_, args: tuple) -> None:
        seen["residual"].append(args[0].double())

    hooks = [attention.register_forward_hook(record), block.register_forward_pre_hook(record_residual)]
    try:
        with torch.no_grad():
            for batch in batches:
                module.adapter.forward(model, module.adapter.model_inputs(model, batch))
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(torch.cat(seen[k]) for k in ("inputs", "outputs", "residual"))


def layer_weights(model: nn.Module, layer: AttentionSpec) -> AttentionWeights:
    """The layer's per-head view in float64."""
    return read_attention({n: p.detach().double() for n, p in model.named_parameters()}, layer)


def midpoint(a: nn.Module, b: nn.Module) -> nn.Module:
    """The model halfway between ``a`` and ``b``."""
    mid = copy.deepcopy(b)
    with torch.no_grad():
        for p, pa, pb in zip(mid.parameters(), a.parameters(), b.parameters()):
            p.copy_((pa + pb) / 2)
    return mid


def hybrid(qk_from: nn.Module, vo_from: nn.Module, layer: AttentionSpec) -> nn.Module:
    """``vo_from`` with the layer's query and key weights and biases of ``qk_from``.

    Two alignments with one head order differ by their ``C`` and ``B`` alone, so this is the
    element with the first's ``C`` and the second's ``B``: still an exact symmetry of the source.
    """
    result = copy.deepcopy(vo_from)
    ours, theirs = dict(result.named_parameters()), dict(qk_from.named_parameters())
    with torch.no_grad():
        for slot in (layer.query, layer.key, layer.query_bias, layer.key_bias):
            if slot is not None:
                ours[slot.parameter].copy_(theirs[slot.parameter])
    return result


def condition_numbers(aligned: nn.Module, source: nn.Module, layer: AttentionSpec) -> dict[str, list[float]]:
    """Per head, the condition number of the element's ``C`` (Q/K) and ``B`` (V/O), read from the weights:
    ``W_Q^aligned = W_Q^source[sigma] C`` solved by least squares (exact: the aligned model is a group element)."""
    moved, start = layer_weights(aligned, layer), layer_weights(source, layer)
    result = {}
    for name, field in (("C", "query"), ("B", "value")):
        after, before = getattr(moved, field), getattr(start, field)
        conditions = []
        for head in range(len(after)):
            # the head order: the source head whose span holds the aligned head's columns
            fits = [torch.linalg.lstsq(before[s], after[head]) for s in range(len(before))]
            s = min(range(len(before)), key=lambda s: float((before[s] @ fits[s].solution - after[head]).norm()))
            conditions.append(float(torch.linalg.cond(fits[s].solution)))
        result[name] = conditions
    return result


def inputs_match(module, model: nn.Module, layer: AttentionSpec, batches: list, inputs: torch.Tensor) -> None:
    """Refuse a model whose layer sees other inputs than ``inputs``, or whose layer :func:`head_activity`
    does not reproduce (RoPE, masks: this measurement covers neither)."""
    seen, outputs, _ = layer_io(module, model, layer, batches)
    if not torch.equal(seen, inputs):
        raise SystemExit(f"{layer.name}: the models' inputs to the layer differ; is the run a first_attention run?")
    weights = layer_weights(model, layer)
    bias = model.get_parameter(layer.out_bias).detach().double() if layer.out_bias else 0.0
    computed = head_activity(weights, inputs).outputs.sum(1) + bias
    error = float((computed - outputs).norm() / outputs.norm())
    if error > 1e-5:
        raise SystemExit(f"{layer.name}: the heads recomputed differ from the layer's output by {error:.1e}")


def patched_loss(module, layer: AttentionSpec, batches: list, outputs: torch.Tensor | None = None) -> float:
    """The mean loss of ``module`` on ``batches`` with the layer's output replaced by ``outputs`` ``(N, T, d)``
    (in the order of the batches; ``None``: the model as it is)."""
    return float(_patched(module, layer, batches, outputs, gradient=False)[0])


def loss_gradient(module, layer: AttentionSpec, batches: list, outputs: torch.Tensor) -> torch.Tensor:
    """``d mean loss / d outputs``, ``(N, T, d)`` float64, with the layer's output replaced by ``outputs``."""
    return _patched(module, layer, batches, outputs, gradient=True)[1]


def _patched(module, layer, batches, outputs, gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    attention = module.model.get_submodule(layer.name)
    leaf = None if outputs is None else outputs.detach().clone().requires_grad_(gradient)
    start = 0

    def replace(_, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        nonlocal start
        if leaf is None:
            return None
        chunk = leaf[start : start + len(out)]
        start += len(out)
        return chunk.to(out.dtype)

    hook = attention.register_forward_hook(replace)
    total, count = torch.zeros((), dtype=torch.float64), 0.0
    try:
        with torch.set_grad_enabled(gradient):
            for batch in batches:
                sums = module.sample_sums(batch)
                total = total + sums["loss"].sum()
                count += float(sums["count"].sum())
    finally:
        hook.remove()
    mean = total / count
    if not gradient:
        return mean.detach(), None
    (grad,) = torch.autograd.grad(mean, leaf)
    return mean.detach(), grad


def planted_module(module, seed: int, noise: float):
    """A copy of ``module`` whose model is moved by a random element of its first attention layer's group
    (head permutation, per-head ``GL`` on Q/K and on V/O), plus Gaussian noise of ``noise`` times each
    moved parameter's root mean square entry: a target whose best element the refinement must approach."""
    planted = copy.deepcopy(module)
    model = planted.model
    spec = model_spec(model)
    generator = torch.Generator().manual_seed(seed)
    parameters = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ModelTransform(attention={0: sample_attention_transform(spec.attention[0], generator)}).apply_(parameters, spec)
    with torch.no_grad():
        for name in scope_parameters(model, "first_attention", spec):
            value = parameters[name]
            rms = value.pow(2).mean().sqrt()
            parameters[name] = value + noise * rms * torch.randn(value.shape, generator=generator, dtype=value.dtype)
        for name, p in model.named_parameters():
            p.copy_(parameters[name].to(p.dtype))
    return planted
