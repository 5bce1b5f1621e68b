"""``lmc equivalent``: whether two checkpoints compute the same function up to the symmetry group."""

from __future__ import annotations

from pathlib import Path

from lmc.cli.inputs import check_outputs, load_pair, trained_scope
from lmc.matching import AlignOptions
from lmc.symmetry import Scope


def equivalent(
    a: Path,
    b: Path,
    scope: Scope | None = None,
    rtol: float | None = None,
    output: Path | None = None,
    overwrite: bool = False,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Whether checkpoints A and B compute the same function up to the symmetry group.

    A is aligned to B within the group of SCOPE. They are equivalent when every parameter then
    equals B's to RTOL (relative to its norm; parameters outside the scope must be equal as they
    are) and their outputs agree on a probe input to --check_rtol. Prints the verdict, the
    residuals and the tolerances. Exit status: 0 when equivalent, 1 when not, 2 for bad input.

    Args:
        a: Checkpoint to align (lmc fit / lmc run / lmc align).
        b: Checkpoint to compare with, of the same model.
        scope: The group asked about; default: the re-initialization the checkpoints were fine-tuned with.
        rtol: Weight tolerance; default per dtype (lmc.matching.EQUIVALENCE_RTOL: 1e-4 in float32).
        output: Also write the verdict, residuals, tolerances and alignment report to this JSON file.
        overwrite: Replace OUTPUT if it exists.
        options: Alignment settings; --check_rtol is the output tolerance (default per dtype).
    """
    from lmc.io import atomic_write_json
    from lmc.matching import equivalent as equivalent_models

    if output is not None:
        if output.is_dir():
            raise ValueError(f"--output {output} is a folder: give a file name such as {output / 'equivalence.json'}")
        check_outputs([output], inputs=[a, b], overwrite=overwrite)
    model_a, model_b, hyperparameters = load_pair(a, b)
    scope = scope or trained_scope(hyperparameters)
    result = equivalent_models(model_a, model_b, scope=scope, options=options, rtol=rtol)
    if output is not None:
        atomic_write_json(output, result.to_dict())
    tolerance, residual = result.tolerance, result.weight_residual
    verdict = "equivalent" if result.equivalent else "NOT equivalent"
    print(f"{a} and {b} are {verdict} under the {scope} group ({result.report.dtype})")
    print(
        f"weight residual after alignment: {residual['scope']:.3g} over the scope, {residual['all']:.3g} over all "
        f"parameters; largest {result.parameter_residual[result.worst_parameter]:.3g} ({result.worst_parameter}); "
        f"rtol {tolerance.weight:g} ({tolerance.weight_origin})"
    )
    outputs = f"{result.output_residual:.3g}; tolerance {tolerance.output:g} ({tolerance.output_origin})"
    print(f"output residual on the probe: {outputs}")
    print(f"reason: {result.reason}")
    if output is not None:
        print(f"wrote {output}")
    if not result.equivalent:
        raise SystemExit(1)
