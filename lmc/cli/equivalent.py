"""``lmc equivalent``: whether two checkpoints compute the same function up to the symmetry group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmc.matching import AlignOptions
from lmc.symmetry import Scope

# The models below are typed Any, not torch's nn.Module: building the parser of --help, jsonargparse
# runs this module's imports, those under TYPE_CHECKING too, and --help loads no torch.


def equivalent(
    a: Path,
    b: Path,
    scope: Scope | None = None,
    rtol: float | None = None,
    output: Path | None = None,
    overwrite: bool = False,
    timm_model: str | None = None,
    timm_args: dict[str, Any] | None = None,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Whether checkpoints A and B compute the same function up to the symmetry group.

    A is aligned to B within the group of SCOPE, in the dtype the checkpoints store. They are
    equivalent when every entry then equals B's bitwise (parameters outside the scope as they
    are), except the entries the continuous Q/K and V/O elements compute, which may differ by
    what rounding explains (RTOL); when every buffer is bitwise equal and every setting of the
    models' configs agrees; and when their outputs agree on a probe input to --check_rtol. Prints
    the verdict and what it rests on. Exit status: 0 when equivalent, 1 when not, 2 for bad input.

    Args:
        a: Checkpoint to align: an lmc checkpoint (lmc fit / lmc run / lmc align), a Hugging Face
            model directory, a timm folder, or a timm state-dict file with --timm_model.
        b: Checkpoint to compare with, of the same model and format.
        scope: The group asked about; default: the re-initialization lmc checkpoints were
            fine-tuned with, full_model for the other formats.
        rtol: Per-entry tolerance of the computed entries, |a_i - b_i| <= rtol (|b_i| + (1 + n u_c / u) s);
            default per dtype (lmc.matching.EQUIVALENCE_RTOL: 32 roundings, 1.9e-6, in float32); 0: bitwise.
        output: Also write the verdict, residuals, tolerances and alignment report to this JSON file.
        overwrite: Replace OUTPUT if it exists.
        timm_model: The timm model name of state-dict files (timm.list_models()).
        timm_args: timm.create_model arguments of state-dict files, e.g. '{num_classes: 10}'.
        options: Alignment settings (weight settings only); --check_rtol is the output tolerance
            (default per dtype).
    """
    from lmc.formats import detect
    from lmc.formats.external import external_pair
    from lmc.io import atomic_write_json, check_outputs
    from lmc.matching import equivalent as equivalent_models

    if output is not None:
        if output.is_dir():
            raise ValueError(f"--output {output} is a folder: give a file name such as {output / 'equivalence.json'}")
        check_outputs([output], inputs=[a, b], overwrite=overwrite)
    if options.data_aware:
        raise ValueError(
            f"lmc equivalent compares weights and reads no data, so the data-aware settings {options.data_settings} "
            "cannot run: use the weight settings (the defaults)"
        )
    checkpoints = detect(a, timm_model, timm_args), detect(b, timm_model, timm_args)
    if external_pair(*checkpoints):
        model_a, model_b = _external_models(*checkpoints)
        scope = scope or "full_model"
    else:
        from lmc.training.module import trained_scope

        model_a, model_b, hyperparameters = _lmc_models(a, b)
        scope = scope or trained_scope(hyperparameters)
    result = equivalent_models(model_a, model_b, scope=scope, options=options, rtol=rtol)
    if output is not None:
        atomic_write_json(output, result.to_dict())
    tolerance = result.tolerance
    verdict = "equivalent" if result.equivalent else "NOT equivalent"
    print(f"{a} and {b} are {verdict} under the {scope} group ({result.report.dtype})")
    beyond = sum(result.beyond_bound.values())
    ratios = result.rounding_ratio
    largest = max(ratios, key=ratios.__getitem__) if ratios else None
    ratio = f"; largest rounding ratio {ratios[largest]:.3g} ({largest})" if ratios else ""
    print(
        f"weights after alignment: {beyond} entries beyond their bound; computed entries within rtol "
        f"{tolerance.weight:.3g} = {tolerance.roundings:.3g} roundings ({tolerance.weight_origin}), every other "
        f"entry bitwise{ratio}"
    )
    differing = [*result.setting_differences, *result.buffer_differences]
    shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
    print(f"settings and buffers: {'differ: ' + shown if differing else 'equal'}")
    outputs = f"{result.output_residual:.3g}; tolerance {tolerance.output:g} ({tolerance.output_origin})"
    print(f"output residual on the probe: {outputs}")
    print(f"reason: {result.reason}")
    if output is not None:
        print(f"wrote {output}")
    if not result.equivalent:
        raise SystemExit(1)


def _lmc_models(a: Path, b: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The models of lmc checkpoints A and B in the dtype they store, and A's hyper-parameters."""
    from lmc.checkpoints import CheckpointError
    from lmc.training.module import load_trained, require_same_model

    for path in (a, b):
        if path.suffix == ".safetensors" and path.is_file():
            raise CheckpointError(
                f"{path} is a bare safetensors file, without its model's configuration: give the Hugging Face or "
                "timm folder that holds it, a timm state dict with --timm_model NAME, or an lmc checkpoint (.ckpt)"
            )
    (module_a, hyperparameters), (module_b, other) = load_trained(a), load_trained(b)
    model_a, model_b = (_in_stored_dtype(module.model, path) for module, path in ((module_a, a), (module_b, b)))
    _require_comparable(a, b, model_a, model_b, lambda: require_same_model({a: hyperparameters, b: other}))
    return model_a, model_b, hyperparameters


def _in_stored_dtype(model: Any, path: Path) -> Any:
    """``model`` in the one dtype ``path`` stores its parameters in, holding exactly the stored values.

    lmc builds a checkpoint's model in float32 and loads the weights into it, so a bfloat16
    checkpoint would be judged with float32's rounding and a float64 one rounded. Mixed dtypes stay.
    """
    from lmc.checkpoints import load_weights, read_state_dict

    state = read_state_dict(path)
    stored = {state[name].dtype for name, _ in model.named_parameters() if name in state}
    if len(stored) != 1 or stored == {next(model.parameters()).dtype}:
        return model
    return load_weights(model.to(stored.pop()), path)


def _external_models(*checkpoints: Any) -> tuple[Any, Any]:
    """The models of two Hugging Face or timm checkpoints, in their stored dtype."""
    from lmc.formats import load_external, require_same_architecture

    first, second = (load_external(checkpoint) for checkpoint in checkpoints)
    paths = first.path, second.path
    _require_comparable(*paths, first.model, second.model, lambda: require_same_architecture(first, second))
    return first.model, second.model


def _require_comparable(a: Path, b: Path, model_a: Any, model_b: Any, refuse: Callable[[], None]) -> None:
    """Refuse (exit 2) a pair that no group element could relate: other dtypes, architectures or shapes.

    Models that can be compared but differ in a setting (an eps, the GELU variant) are not refused:
    the verdict names the setting. ``refuse`` raises naming the differing config field, if any.
    """
    from lmc.checkpoints import CheckpointError
    from lmc.matching import AlignmentError
    from lmc.matching.checks import check_pair
    from lmc.matching.results import dtype_name

    dtypes = [dtype_name(next(model.parameters()).dtype) for model in (model_a, model_b)]
    if dtypes[0] != dtypes[1]:
        raise CheckpointError(
            f"{a} stores its weights in {dtypes[0]} but {b} in {dtypes[1]}: lmc equivalent compares two checkpoints "
            "stored in one dtype, since each dtype rounds differently; save both in one"
        )
    try:
        check_pair(model_a, model_b, "full_model")
    except AlignmentError:
        refuse()
        raise
