"""Qwen3: per-head RMSNorms on queries and keys before RoPE (docs/spec.md, section 2, "Per-head QK-norm").

The generic tests (test_invariance.py, test_describe.py, test_decoders.py, tests/matching) run on
tests/architectures.QK_NORM; these check what the norms change: ``C`` is a sign flip of each rotary
pair (a finite group: dimension 0 against the numerically computed dimension of the model's own
Q/K symmetries), V/O keeps ``GL(d_h)``, Stage 2's sign search is exact, and elements of RoPE's
``H`` that are no sign flip break the function (unless the gains are equal on a pair).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lmc.adapters import apply_transform, model_spec
from lmc.matching.options import AlignOptions
from lmc.matching.stage2 import Stage2Problem, solve_stage2
from lmc.models import create_model, randomize_parameters_
from lmc.symmetry import AttentionTransform, ModelTransform, qk_group, rotary_commutant, sample_attention_transform
from tests.architectures import FLOAT64_RTOL, float64_rms_norm, relative_difference
from tests.symmetry.test_decoders import outputs as decoder_outputs
from tests.symmetry.test_gpt_neox import _null_dimension, _qk_tangent, _vo_tangent

BROKEN = 1e-4
PAIRS = 4  # head_dim 8, every coordinate rotates


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """Qwen3's RMSNorms without their float32 cast, so that equal functions agree to float64 rounding."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    monkeypatch.setattr(Qwen3RMSNorm, "forward", float64_rms_norm)


def qk_norm_decoder(tiny: str, equal_gains: bool = False, **overrides) -> nn.Module:
    """A tiny QK-norm decoder (``qwen3-tiny``, ``olmo2-tiny``) with biases and random weights; ``equal_gains``:
    every q_norm and k_norm gain is 1 (their init)."""
    model = randomize_parameters_(create_model(tiny, dtype=torch.float64, attention_bias=True, **overrides))
    if equal_gains:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.fill_(1.0)
    return model


def qwen3(equal_gains: bool = False, **overrides) -> nn.Module:
    """:func:`qk_norm_decoder` of ``qwen3-tiny``."""
    return qk_norm_decoder("qwen3-tiny", equal_gains, **overrides)


def _element(layer, qk: torch.Tensor) -> AttentionTransform:
    identity = AttentionTransform.identity(layer)
    return AttentionTransform(identity.query_permutation, identity.kv_permutation, qk, identity.vo)


def _pair_rotation(angle: float, pair: tuple[int, int], num_kv_heads: int) -> torch.Tensor:
    """``C`` turning one rotary pair by ``angle`` in every KV group: orthogonal, in H, no sign flip."""
    c = torch.eye(8, dtype=torch.float64).repeat(num_kv_heads, 1, 1)
    first, second = pair
    cos, sin = torch.cos(torch.tensor(angle, dtype=torch.float64)), torch.sin(torch.tensor(angle, dtype=torch.float64))
    c[:, first, first] = c[:, second, second] = cos
    c[:, first, second], c[:, second, first] = sin, -sin
    return c


def test_every_sign_flip_of_the_rotary_pairs_keeps_the_function_and_breaks_it_elsewhere():
    model = qwen3()
    layer = model_spec(model).blocks[0].attention
    group = qk_group(layer)
    assert (group.name, group.num_coordinates, group.num_blocks) == ("signs", 0, PAIRS)
    pairs = layer.rotary.pairs.tolist()  # half layout: (j, j + 4)
    reference = decoder_outputs(model)
    for signs in itertools.product((1.0, -1.0), repeat=PAIRS):
        c = group.elements(torch.tensor(signs, dtype=torch.float64)).expand(layer.num_kv_heads, -1, -1)
        kept = apply_transform(model, ModelTransform(attention={0: _element(layer, c)}))
        assert relative_difference(reference, decoder_outputs(kept)) < FLOAT64_RTOL, signs  # 0 measured
    one_coordinate = torch.eye(8, dtype=torch.float64).repeat(layer.num_kv_heads, 1, 1)
    one_coordinate[:, pairs[0][0], pairs[0][0]] = -1.0  # half a pair: a reflection, which turns R_t backwards
    near_misses = {
        "half a pair": one_coordinate,
        "a rotation of one pair": _pair_rotation(0.3, pairs[1], layer.num_kv_heads),
        "RoPE's H": rotary_commutant(8, layer.rotary).sample(layer.num_kv_heads, torch.Generator().manual_seed(3)),
    }
    for name, c in near_misses.items():
        broken = apply_transform(model, ModelTransform(attention={0: _element(layer, c)}))
        assert relative_difference(reference, decoder_outputs(broken)) > BROKEN, name


def test_with_equal_gains_on_a_pair_its_rotations_keep_the_function():
    """The continuous part lmc leaves out: at equal gains (their init) each pair turns freely (spec.md)."""
    model = qwen3(equal_gains=True)
    layer = model_spec(model).blocks[0].attention
    rotated = ModelTransform(attention={0: _element(layer, _pair_rotation(0.3, (1, 5), layer.num_kv_heads))})
    assert relative_difference(decoder_outputs(model), decoder_outputs(apply_transform(model, rotated))) < 1e-12


# (gains equal on every pair, the norms' epsilon) -> first-order Q/K symmetries of head 0 (measured).
QK_DIMENSIONS = {(False, 1e-3): 0, (True, 1e-3): PAIRS, (False, 0.0): 1, (True, 0.0): PAIRS + 1}


@pytest.mark.parametrize(("equal_gains", "eps"), list(QK_DIMENSIONS))
def test_the_group_has_the_dimension_of_the_models_own_symmetries(equal_gains, eps):
    """Generic gains: no first-order Q/K symmetry (the signs are discrete); equal gains: a rotation per pair.

    One query head per KV head, so that head 0's ``(C, C^-T)`` moves nothing else. A scale ``C = cI``
    is a symmetry only without the norms' epsilon (one more dimension at ``eps = 0``); with it, its
    singular value is about ``eps`` times 0.02 of the scale (2.4e-5 at 1e-3, 2.3e-8 at Qwen3's 1e-6,
    measured), so the test takes ``eps = 1e-3`` to keep it far above the 1e-8 cut.
    """
    model = qwen3(equal_gains, num_key_value_heads=4, rms_norm_eps=eps)
    qk_dimension = QK_DIMENSIONS[equal_gains, eps]
    layer = model_spec(model).blocks[0].attention
    assert _null_dimension(model, _qk_tangent) == qk_dimension
    assert qk_group(layer).num_coordinates == 0  # lmc's group: the signs, exact for every gain
    assert _null_dimension(model, _vo_tangent) == layer.head_dim**2  # GL(d_h) on V/O


def test_stage2_picks_the_best_of_every_sign_flip():
    """The finite search: the orthogonal start over the signs is the exact minimum, and nothing refines it."""
    layer = model_spec(qwen3()).blocks[0].attention
    group = qk_group(layer)
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randn(5, 12, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    x_target, y_target = (torch.randn(5, 12, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    problem = Stage2Problem(
        x.mT @ x, x.mT @ x_target, y.mT @ y, y.mT @ y_target, (x_target**2).sum((1, 2)) + (y_target**2).sum((1, 2))
    )
    solved = solve_stage2(problem, group, AlignOptions(method="full"))
    every = group.elements(torch.tensor(list(itertools.product((1.0, -1.0), repeat=PAIRS)), dtype=torch.float64))
    values = torch.stack([problem.objective(c.expand(5, -1, -1)) for c in every])  # (16, 5)
    torch.testing.assert_close(problem.objective(solved), values.min(dim=0).values, rtol=1e-14, atol=0)
    assert group.contains(solved)


def test_sampled_elements_are_sign_flips_and_validate():
    layer = model_spec(qwen3()).blocks[0].attention
    element = sample_attention_transform(layer, torch.Generator().manual_seed(1))
    element.validate(layer)
    assert set(element.qk.unique().tolist()) <= {-1.0, 0.0, 1.0}
    with pytest.raises(ValueError, match=r"qk is not in the layer's signs\(8\) group"):
        _element(layer, _pair_rotation(0.3, (1, 5), layer.num_kv_heads)).validate(layer)


def test_rescaling_the_gains_pair_by_pair_is_exact_and_one_coordinate_alone_is_not():
    """The symmetry outside the per-head view that lmc leaves out (spec.md): g_q c, g_k / c, c equal on each pair."""
    model = qwen3()
    pairs = model_spec(model).blocks[0].attention.rotary.pairs
    norms = model.model.layers[0].self_attn
    c = torch.tensor([0.5, -2.0, 3.0, 1.5], dtype=torch.float64)
    per_coordinate = torch.ones(8, dtype=torch.float64)
    per_coordinate[pairs[:, 0]] = per_coordinate[pairs[:, 1]] = c
    reference = decoder_outputs(model)
    for scale, exact in ((per_coordinate, True), (per_coordinate * torch.tensor([2.0] + [1.0] * 7), False)):
        moved = apply_transform(model, ModelTransform())
        attention = moved.model.layers[0].self_attn
        with torch.no_grad():
            attention.q_norm.weight.copy_(norms.q_norm.weight * scale)
            attention.k_norm.weight.copy_(norms.k_norm.weight / scale)
        change = relative_difference(reference, decoder_outputs(moved))
        assert change < FLOAT64_RTOL if exact else change > BROKEN, (change, exact)
