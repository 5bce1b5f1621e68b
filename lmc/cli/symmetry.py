"""``lmc symmetry``: show, on real architectures, that lmc's groups are exact and complete.

For each model: a random element of its full symmetry group keeps the outputs while moving
the weights; a generic ``GL(d_h)`` on Q/K keeps an APE model but breaks a RoPE one; an ``H``
built for the other rotary pair layout breaks a RoPE model too; and every parameter axis is moved
by a group or fixed for a reason (docs/spec.md, section 2, "Every axis explained"). The checks
are lmc.cli.symmetry_checks.
"""

from __future__ import annotations

#: The models checked unless --models names others: one of each architecture family.
DEFAULT_MODELS = (
    "rope-vit-tiny",
    "vit-tiny",
    "llama-tiny",
    "gpt-neox-tiny",
    "gpt2-tiny",
    "roformer-tiny",
    "bert-tiny",
)


def symmetry(models: list[str] = list(DEFAULT_MODELS), seed: int = 0) -> None:
    """Random symmetries keep real models' outputs; groups that are too large break them.

    Args:
        models: Registered model names (lmc.models.list_models()).
        seed: Seed of the random group elements.
    """
    from lmc.cli.symmetry_checks import run
    from lmc.models import list_models

    unknown = [m for m in models if m not in list_models()]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(list_models())}")
    run(tuple(models), seed=seed)
