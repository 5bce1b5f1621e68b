"""GPT-NeoX (Pythia): fused per-head QKV, partial rotary, both residual forms (docs/spec.md, section 2).

The generic tests (test_invariance.py, test_groups.py, test_describe.py, tests/matching) run on
tests/architectures.GPT_NEOX; these check what is specific to the family: the storage of
``query_key_value``, that the group is exactly ``H(rotary) x GL(d_pass)`` for any ``rotary_pct``
(its dimension against the numerically computed dimension of the model's own symmetries), and
elements just outside it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.func import functional_call

from lmc.adapters import UnsupportedModelError, adapter_for, apply_transform, describe, model_spec, random_symmetry
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import (
    SCOPES,
    AttentionTransform,
    AttentionWeights,
    HeadSlot,
    ModelTransform,
    attention_parameters,
    qk_group,
    read_attention,
    sample_attention_transform,
    transform_attention,
    write_attention,
)
from tests.architectures import FLOAT64_RTOL, relative_difference

BROKEN = 1e-4
# rotary_pct -> (rotated coordinates of a head of 8, dimension of H(rotary) x GL(pass-through))
ROTARY = {0.25: (2, 2 + 6 * 6), 0.5: (4, 4 + 4 * 4), 1.0: (8, 8)}
SAVED_NAMES = {"lm_head.weight": "embed_out.weight"}


def neox(rotary_pct: float = 0.5, parallel: bool = True, seed: int = 0) -> nn.Module:
    model = create_model("gpt-neox-tiny", dtype=torch.float64, rotary_pct=rotary_pct, use_parallel_residual=parallel)
    return randomize_parameters_(model, seed=seed)


def probe(model: nn.Module) -> dict[str, torch.Tensor]:
    return adapter_for(model).example_inputs(model, 3, torch.Generator().manual_seed(0))


def outputs(model: nn.Module, parameters: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    adapter = adapter_for(model)
    inputs = adapter.model_inputs(model, {"inputs": probe(model)["input_ids"]})
    if parameters is None:
        with torch.no_grad():
            return adapter.forward(model, inputs)
    return functional_call(model, parameters, args=(), kwargs=inputs).logits


def test_the_view_reads_query_key_value_per_head_and_writes_it_back():
    model = neox()
    layer = model_spec(model).blocks[0].attention
    parameters = dict(model.named_parameters())
    weights = read_attention(parameters, layer)
    qkv = model.gpt_neox.layers[0].attention.query_key_value
    rows, bias = qkv.weight.view(4, 3, 8, 32), qkv.bias.view(4, 3, 8)  # transformers' view (h, 3, d_h)
    for i in range(4):
        for k, (w, b) in enumerate(
            [(weights.query, weights.query_bias), (weights.key, weights.key_bias), (weights.value, weights.value_bias)]
        ):
            assert torch.equal(w[i], rows[i, k].T) and torch.equal(b[i], bias[i, k])
        assert torch.equal(weights.out[i], model.gpt_neox.layers[0].attention.dense.weight[:, 8 * i : 8 * i + 8].T)
    marked = AttentionWeights(
        **{name: None if value is None else torch.full_like(value, 7.0) for name, value in vars(weights).items()}
    )
    write_attention(parameters, layer, marked)  # every entry of the fused Linear belongs to exactly one slot
    assert torch.equal(qkv.weight, torch.full_like(qkv.weight, 7.0)) and torch.equal(
        qkv.bias, torch.full_like(qkv.bias, 7.0)
    )


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("rotary_pct", list(ROTARY))
def test_random_elements_keep_the_function_at_every_scope(rotary_pct, parallel):
    model = neox(rotary_pct, parallel)
    layer = model_spec(model).blocks[0].attention
    assert layer.rotary.rotary_dim == ROTARY[rotary_pct][0]
    assert [(d["qk_group"], d["qk_group_dim"]) for d in describe(model)] == [("H", ROTARY[rotary_pct][1])] * 2
    for scope in SCOPES:
        transformed = random_symmetry(model, scope=scope, seed=1)
        # LayerNorms compute in float64: at most 7e-16 relative (measured).
        assert relative_difference(outputs(model), outputs(transformed)) < FLOAT64_RTOL, scope


@pytest.mark.parametrize("overrides", [{"attention_bias": False}, {"tie_word_embeddings": True}])
def test_without_biases_or_with_a_tied_head_the_group_is_the_same(overrides):
    model = randomize_parameters_(create_model("gpt-neox-tiny", dtype=torch.float64, **overrides), seed=0)
    layer = model_spec(model).blocks[0].attention
    assert (layer.query_bias is None) == ("attention_bias" in overrides)
    assert adapter_for(model).saved_names(model) == ({} if "tie_word_embeddings" in overrides else SAVED_NAMES)
    for scope in SCOPES:
        transformed = random_symmetry(model, scope=scope, seed=1)
        assert relative_difference(outputs(model), outputs(transformed)) < FLOAT64_RTOL, scope  # 6e-16 measured


def test_the_two_residual_forms_are_different_functions():
    assert relative_difference(outputs(neox(parallel=True)), outputs(neox(parallel=False))) > BROKEN


def _jacobian_singular_values(model: nn.Module, tangent) -> torch.Tensor:
    """Singular values of the Jacobian of the logits in ``A``, the per-head weights moved by ``tangent(weights, A)``.

    ``A`` is ``d_h x d_h``; the Jacobian is read through random projections of the logits.
    """
    layer = model_spec(model).blocks[0].attention
    parameters = {name: p.detach() for name, p in model.named_parameters()}
    d_h = layer.head_dim
    direction = torch.zeros(d_h, d_h, dtype=torch.float64, requires_grad=True)
    moved = attention_parameters(parameters, layer, tangent(read_attention(parameters, layer), direction))
    logits = outputs(model, {**parameters, **moved}).flatten()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(d_h * d_h + 16):
        projection = torch.randn(logits.shape, generator=generator, dtype=torch.float64)
        (gradient,) = torch.autograd.grad(logits, direction, projection, retain_graph=True)
        rows.append(gradient.flatten())
    return torch.linalg.svdvals(torch.stack(rows))


def _null_dimension(model: nn.Module, tangent) -> int:
    """Dimension of ``{A : d/dt f(theta + t * tangent(A)) = 0}``: the Lie algebra of a family of symmetries.

    Singular values count as zero below 1e-8 of the largest one for head 0's queries moved alone
    (no symmetry): the spectrum splits by more than 1e8, rounding sitting near 1e-16 of that scale.
    """
    scale = _jacobian_singular_values(model, _query_tangent)[0]
    singular = _jacobian_singular_values(model, tangent)
    return singular.numel() - int((singular > 1e-8 * scale).sum())


def _head0(tensor: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Head 0 of per-head rows (``(h, ..., d_h)``) times ``matrix``, the other heads unchanged."""
    return torch.cat([tensor[:1] @ matrix, tensor[1:]])


def _bias_head0(bias: torch.Tensor | None, matrix: torch.Tensor) -> torch.Tensor | None:
    """Per-head biases (``(h, d_h)``) with head 0's times ``matrix``; a model without them has none to move."""
    return None if bias is None else _head0(bias[:, None], matrix)[:, 0]


def _query_tangent(weights: AttentionWeights, a: torch.Tensor) -> AttentionWeights:
    """Head 0's queries by ``I + A``, nothing else: no symmetry, the scale of the Jacobians."""
    eye = torch.eye(a.shape[0], dtype=a.dtype)
    moved = _head0(weights.query, eye + a), _bias_head0(weights.query_bias, eye + a)
    return dataclasses.replace(weights, query=moved[0], query_bias=moved[1])


def _qk_tangent(weights: AttentionWeights, a: torch.Tensor) -> AttentionWeights:
    """Head 0's queries by ``I + A`` and keys by ``I - A^T``: the first order of ``(C, C^-T)``."""
    eye = torch.eye(a.shape[0], dtype=a.dtype)
    return dataclasses.replace(
        weights,
        query=_head0(weights.query, eye + a),
        key=_head0(weights.key, eye - a.T),
        query_bias=_bias_head0(weights.query_bias, eye + a),
        key_bias=_bias_head0(weights.key_bias, eye - a.T),
    )


def _vo_tangent(weights: AttentionWeights, b: torch.Tensor) -> AttentionWeights:
    """Head 0's values by ``I + B`` and its output rows by ``I - B``: the first order of ``(B, B^-1)``."""
    eye = torch.eye(b.shape[0], dtype=b.dtype)
    return dataclasses.replace(
        weights,
        value=_head0(weights.value, eye + b),
        out=torch.cat([(eye - b) @ weights.out[:1], weights.out[1:]]),
        value_bias=_bias_head0(weights.value_bias, eye + b),
    )


@pytest.mark.parametrize("rotary_pct", list(ROTARY))
def test_the_group_has_the_dimension_of_the_models_own_symmetries(rotary_pct):
    """Complete, not a subgroup: every first-order Q/K symmetry of a head is in H(rotary) x GL(pass)."""
    model = neox(rotary_pct)
    layer = model_spec(model).blocks[0].attention
    assert _null_dimension(model, _qk_tangent) == qk_group(layer).num_coordinates == ROTARY[rotary_pct][1]
    assert _null_dimension(model, _vo_tangent) == layer.head_dim**2  # GL(d_h) on V/O


def _with_qk(element: AttentionTransform, qk: torch.Tensor) -> AttentionTransform:
    return AttentionTransform(element.query_permutation, element.kv_permutation, qk, element.vo)


def test_mixing_rotary_and_pass_through_coordinates_breaks_the_function():
    model = neox(0.5)
    layer = model_spec(model).blocks[0].attention
    element = sample_attention_transform(layer, torch.Generator().manual_seed(2))
    kept = apply_transform(model, ModelTransform(attention={0: element}))
    assert relative_difference(outputs(model), outputs(kept)) < FLOAT64_RTOL
    for row, column in ((0, 5), (5, 0), (6, 3)):  # rotary -> pass-through, back, and between blocks
        qk = element.qk.clone()
        qk[:, row, column] += 0.1
        broken = apply_transform(model, ModelTransform(attention={0: _with_qk(element, qk)}))
        assert relative_difference(outputs(model), outputs(broken)) > BROKEN, (row, column)


def test_reading_query_key_value_as_three_blocks_breaks_the_function():
    """The [Q | K | V] layout of GPT-2 and timm, applied to GPT-NeoX's rows, moves the wrong ones."""
    model = neox(0.5)
    layer = model_spec(model).blocks[0].attention
    name = "gpt_neox.layers.0.attention.query_key_value"
    blocks = {
        field: HeadSlot(f"{name}.{kind}", 0, k * 32)
        for kind, fields in (("weight", ("query", "key", "value")), ("bias", ("query_bias", "key_bias", "value_bias")))
        for k, field in enumerate(fields)
    }
    wrong = type(layer)(**{**vars(layer), **blocks})
    element = sample_attention_transform(layer, torch.Generator().manual_seed(2))
    broken = randomize_parameters_(create_model("gpt-neox-tiny", dtype=torch.float64), seed=0)
    parameters = dict(broken.named_parameters())
    write_attention(parameters, wrong, transform_attention(read_attention(parameters, wrong), element))
    assert relative_difference(outputs(model), outputs(broken)) > BROKEN


def test_an_odd_rotary_width_is_refused():
    model = create_model("gpt-neox-tiny", dtype=torch.float64, rotary_pct=0.375)  # 3 of 8: the module turns 4
    with pytest.raises(UnsupportedModelError, match=r"GPTNeoX rotary width 4 != 3 \(rotary_fraction 0.375"):
        model_spec(model)


def test_saved_names_map_the_head_to_the_name_in_its_files(tmp_path):
    model = neox()
    assert adapter_for(model).saved_names(model) == SAVED_NAMES
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert "embed_out.weight" in handle.keys() and "lm_head.weight" not in handle.keys()
