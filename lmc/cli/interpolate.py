"""``lmc interpolate``: naive and aligned interpolation curves between two checkpoints, with their barriers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A lazy package: formats.Checkpoint, in annotations only, would load torch. No TYPE_CHECKING block: jsonargparse
# runs those of a command's module when it builds the parser, and --help loads no torch.
from lmc import formats
from lmc.cli.inputs import DataSource, data_module, required, user_data
from lmc.formats import EvaluationDataOptions
from lmc.matching import AlignOptions
from lmc.symmetry import Scope


def interpolate(
    a: Path,
    b: Path,
    data: DataSource | None = None,
    output_dir: Path | None = None,
    scope: Scope | None = None,
    num_alphas: int = 25,
    overwrite: bool = False,
    timm_model: str | None = None,
    timm_args: dict[str, Any] | None = None,
    data_options: EvaluationDataOptions = EvaluationDataOptions(),
    options: AlignOptions = AlignOptions(),
) -> None:
    """Naive and aligned interpolation curves between checkpoints A and B, with their barriers.

    B is aligned to A, then both curves theta(alpha) = (1 - alpha) A + alpha B are evaluated on
    DATA. Writes lmc_results.json, .csv, a figure and TensorBoard scalars (OUTPUT_DIR/tensorboard)
    into OUTPUT_DIR; a killed sweep resumes where it stopped. Causal language models also report
    perplexity = exp(loss). Data-aware alignment settings calibrate on DATA's training split
    (lmc checkpoints only).

    Args:
        a: Checkpoint of end point A (alpha = 0): an lmc checkpoint, a Hugging Face model
            directory, a timm folder, or a timm state-dict file with --timm_model.
        b: Checkpoint of end point B (alpha = 1), of the same model and format.
        data: What to evaluate on (required). lmc checkpoints: a DataModule, as a
            configs/data/*.yaml file, a class path such as lmc.data.Digits, or
            '{class_path: ..., init_args: {...}}'. Other formats: the
            user's own data: causal LMs a .txt file, a save_to_disk folder or a .json, .jsonl,
            .csv or .parquet file with a text column; sequence classifiers such a table with
            text and label columns; BERT masked-LM and pre-training models a .txt file (one
            text per line) or a table with a text column (and a pair column for sentence
            pairs), masked once with --mask_seed; timm models an image folder with one
            subfolder per class.
        output_dir: Folder for the results (required).
        scope: Symmetries to align; default: the re-initialization lmc checkpoints were
            fine-tuned with, full_model for other formats.
        num_alphas: Points on each curve (at least 2).
        overwrite: Replace results of another sweep in OUTPUT_DIR.
        timm_model: The timm model name of state-dict files (timm.list_models()).
        timm_args: timm.create_model arguments of state-dict files, e.g. '{num_classes: 10}'.
        data_options: How DATA is read and batched (split, batch size, columns, sequence length).
        options: Alignment settings.
    """
    from torch.utils.data import DataLoader

    from lmc.connectivity import Evaluation, data_identity, training_calibration
    from lmc.connectivity.interpolation import evenly_spaced
    from lmc.formats import detect
    from lmc.formats.external import external_pair
    from lmc.io import check_outputs
    from lmc.matching.checks import refuse_data_aware_external
    from lmc.training.module import load_trained, require_same_model, trained_scope

    data, output_dir = required(data, "--data FILE_OR_CLASS"), required(output_dir, "--output_dir DIR")
    alphas = evenly_spaced(num_alphas)
    check_outputs([output_dir / "lmc_results.json"], inputs=[a, b], overwrite=True)
    checkpoints = detect(a, timm_model, timm_args), detect(b, timm_model, timm_args)
    calibration = None
    if external_pair(*checkpoints):
        refuse_data_aware_external(options)
        model, reference, evaluation, task = _external_evaluation(*checkpoints, user_data(data), data_options)
        scope = scope or "full_model"
    else:
        data = data_module(data)
        module, hyperparameters = load_trained(a)
        reference_module, reference_hyperparameters = load_trained(b)
        require_same_model({a: hyperparameters, b: reference_hyperparameters})
        module.require_data(data)
        scope = scope or trained_scope(hyperparameters)
        options = options.for_scope(scope)
        split = data_options.split
        loader = DataLoader(data.split(split), batch_size=data_options.batch_size or data.batch_size)
        architecture = {k: hyperparameters.get(k) for k in ("model", "model_config")}
        evaluation = Evaluation(module.sample_sums, loader, split, data_identity(data), architecture)
        model, reference, task = module.model, reference_module.model, data.info.task
        if options.data_aware:
            calibration = training_calibration(data, module.model_loss, options.calibration_batches)
    language_model = task == "causal_lm"
    _sweep_and_report(
        model, reference, a, b, scope, options, alphas, evaluation, output_dir, overwrite, language_model, calibration
    )


def _external_evaluation(a: formats.Checkpoint, b: formats.Checkpoint, data: Path, data_options: EvaluationDataOptions):
    """End points A and B of Hugging Face or timm checkpoints and their evaluation on the user's data."""
    from torch.utils.data import DataLoader

    from lmc.adapters import adapter_for
    from lmc.connectivity import Evaluation
    from lmc.formats import evaluation_data, load_external, require_same_architecture
    from lmc.training.module import classification_sums, masked_lm_sums

    model, reference = load_external(a), load_external(b)
    require_same_architecture(model, reference)
    user = evaluation_data(data, model.model, a.path, data_options)
    if user.note is not None:
        print(user.note)
    adapter, dtype = adapter_for(model.model), model.dtype

    def metric_sums(batch):
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        inputs = adapter.model_inputs(model.model, batch)
        if user.task == "masked_lm":  # the heads' outputs by name: the loss is scored on the chosen tokens only
            return masked_lm_sums(model.model(**inputs), batch, per_sample=True)
        return classification_sums(adapter.forward(model.model, inputs), batch["labels"], per_sample=True)

    loader = DataLoader(user.dataset, batch_size=data_options.batch_size or 32)
    architecture = {"format": model.format, **model.architecture()}
    evaluation = Evaluation(metric_sums, loader, data_options.split, user.identity, architecture)
    return model.model, reference.model, evaluation, user.task


def _sweep_and_report(
    model,
    reference,
    a: Path,
    b: Path,
    scope,
    options,
    alphas,
    evaluation,
    output_dir: Path,
    overwrite: bool,
    language_model: bool,
    calibration=None,
) -> None:
    """Align B to A, sweep both curves with a progress bar, write results, figure and TensorBoard scalars."""
    from lmc.connectivity import OtherResultsError, ResultsOutput, sweep_and_write

    output = ResultsOutput(
        output_dir,
        checkpoint=str(a),
        other_results="retire" if overwrite else "refuse",
        perplexity=language_model,
        tensorboard=output_dir / "tensorboard",
        progress="Interpolate (naive, aligned)",
    )
    model.eval()
    try:
        results = sweep_and_write(
            output, model, {b: reference.eval}, scope, options, alphas, evaluation, calibration=calibration
        )
    except OtherResultsError:
        raise ValueError(
            f"{output_dir} holds the results of another sweep: pass --overwrite true (they move to "
            f"{output_dir / 'stale'}) or choose another --output_dir"
        ) from None
    result = results["references"][str(b)]
    for curve, values in result["curves"].items():
        loss, accuracy = values["loss_barrier"], values["accuracy_barrier"]
        ends = values["points"][0], values["points"][-1]
        perplexity = (
            f"  perplexity {ends[0]['perplexity']:.3f} -> {ends[1]['perplexity']:.3f}" if language_model else ""
        )
        print(f"{curve:8s} loss barrier {loss:.4f}  accuracy barrier {accuracy:.4f}{perplexity}")
    print(f"barrier ratio (aligned / naive, %): {result['barrier_ratio']}; results in {output_dir}")
