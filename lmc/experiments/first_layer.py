"""How much of the width the first attention layer's inputs span, in a finished run (``docs/results.md``'s
section on where lmc's numbers differ from the paper's)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # lmc.experiments.run imports Lightning
    from lmc.experiments.run import Experiment


def first_layer_inputs(experiment: Experiment, batches: int = 8) -> dict[str, Any]:
    """How much of the width the first attention layer's inputs span, and how much of its Q/K/V
    weights they reach, in seed 0 of a finished ``lmc run`` (a fine-tuned model).

    A weight-space cost counts every direction of ``W_Q, W_K, W_V``, but the function only
    depends on their action on the inputs the layer receives: with inputs confined to a subspace,
    the rest of the weights is the untouched initialization and weighs on the matcher without
    bearing on the barrier. Measured on ``batches`` training batches of the fine-tuning half (all
    of them where it holds fewer: a run fine-tuned on a few samples).

    Args:
        experiment: The finished run (its folder holds ``seed0/final.ckpt``).
        batches: Calibration batches.

    Returns:
        ``{"width", "rank", "tokens", "visible": {"query", "key", "value"}}``: the numerical rank of
        the inputs' second moment ``E[x x^T]`` (float64, eigenvalues above 1e-10 of the largest)
        and each projection's squared norm share on that span.
    """
    import torch

    from lmc.adapters import adapter_for, model_spec
    from lmc.connectivity import training_calibration
    from lmc.matching.calibration import paired_moments
    from lmc.symmetry import head_rows

    folder = experiment.root
    pretrained = experiment.protocol.pretrained or folder / "pretrain" / "final.ckpt"
    stage = experiment.finetune_stage(0, Path(pretrained), "")
    module, datamodule = experiment.trained(stage, folder / "seed0" / "final.ckpt")
    model = module.model
    layer = model_spec(model).attention[0]
    twin = copy.deepcopy(model)  # paired moments read two models; both are this one
    adapter = adapter_for(model)
    watched = {"input": (adapter.attention_input_module(model, layer), adapter.attention_input_module(twin, layer))}
    held = math.ceil(len(datamodule.split("train")) / datamodule.batch_size)
    calibration = training_calibration(datamodule, module.model_loss, min(batches, held))
    moment = paired_moments(model, twin, watched, calibration)["input"]
    values, vectors = torch.linalg.eigh(moment.source)
    span = vectors[:, values > 1e-10 * values[-1]]
    parameters = dict(model.named_parameters())
    visible = {}
    for name in ("query", "key", "value"):
        rows = head_rows(parameters, layer, name).double()
        visible[name] = float((rows @ span).square().sum() / rows.square().sum())
    return {"width": layer.width, "rank": span.shape[1], "tokens": moment.tokens, "visible": visible}
