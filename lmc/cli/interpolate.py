"""``lmc interpolate``: naive and aligned interpolation curves between two checkpoints, with their barriers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmc.cli.inputs import (
    check_outputs,
    data_module,
    external_pair,
    refuse_data_aware_external,
    required,
    trained_scope,
)
from lmc.connectivity import CurveSplit
from lmc.data import LMCDataModule
from lmc.matching import AlignOptions
from lmc.symmetry import Scope


def interpolate(
    a: Path,
    b: Path,
    data: LMCDataModule | Path | None = None,
    output_dir: Path | None = None,
    scope: Scope | None = None,
    split: CurveSplit = "val",
    num_alphas: int = 25,
    batch_size: int | None = None,
    overwrite: bool = False,
    text_column: str = "text",
    label_column: str = "label",
    sequence_length: int = 128,
    timm_model: str | None = None,
    timm_args: dict[str, Any] | None = None,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Naive and aligned interpolation curves between checkpoints A and B, with their barriers.

    B is aligned to A, then both curves theta(alpha) = (1 - alpha) A + alpha B are evaluated on
    DATA. Writes lmc_results.json, .csv, a figure and TensorBoard scalars (OUTPUT_DIR/tensorboard)
    into OUTPUT_DIR; a killed sweep resumes where it stopped. Language models also report
    perplexity = exp(loss). Data-aware alignment settings calibrate on DATA's training split
    (lmc checkpoints only).

    Args:
        a: Checkpoint of end point A (alpha = 0): an lmc checkpoint, a Hugging Face model
            directory, a timm folder, or a timm state-dict file with --timm_model.
        b: Checkpoint of end point B (alpha = 1), of the same model and format.
        data: What to evaluate on (required). lmc checkpoints: a DataModule, as a
            configs/data/*.yaml file or a class path such as lmc.data.Digits. Other formats: the
            user's own data: causal LMs a .txt file, a save_to_disk folder or a .json, .jsonl,
            .csv or .parquet file with a text column; sequence classifiers such a table with
            text and label columns; timm models an image folder with one subfolder per class.
        output_dir: Folder for the results (required).
        scope: Symmetries to align; default: the re-initialization lmc checkpoints were
            fine-tuned with, full_model for other formats.
        split: The split the curves are measured on (of a DataModule, or of a save_to_disk DatasetDict).
        num_alphas: Points on each curve (at least 2).
        batch_size: Evaluation batch size (default: the DataModule's, 32 for the user's data).
        overwrite: Replace results of another sweep in OUTPUT_DIR.
        text_column: The text column of the user's tables.
        label_column: The label column of the user's tables (sequence classifiers).
        sequence_length: Tokens per sequence of the user's text (windows for causal LMs, the
            longest text for classifiers).
        timm_model: The timm model name of state-dict files (timm.list_models()).
        timm_args: timm.create_model arguments of state-dict files, e.g. '{num_classes: 10}'.
        options: Alignment settings.
    """
    from torch.utils.data import DataLoader

    from lmc.connectivity import Evaluation, data_identity, training_calibration
    from lmc.connectivity.interpolation import evenly_spaced
    from lmc.training.module import load_trained, require_same_model

    data, output_dir = required(data, "--data FILE_OR_CLASS"), required(output_dir, "--output_dir DIR")
    alphas = evenly_spaced(num_alphas)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch_size must be positive, got {batch_size}")
    check_outputs([output_dir / "lmc_results.json"], inputs=[a, b], overwrite=True)
    calibration = None
    if external_pair(a, b, timm_model):
        refuse_data_aware_external(options)
        if not isinstance(data, Path):
            raise ValueError("--data of Hugging Face and timm models is a path to your data, not a DataModule")
        model, reference, evaluation, task = _external_evaluation(
            a, b, data, split, batch_size, text_column, label_column, sequence_length, timm_model, timm_args
        )
        scope = scope or "full_model"
    else:
        data = data_module(data) if isinstance(data, Path) else data
        module, hyperparameters = load_trained(a)
        reference_module, reference_hyperparameters = load_trained(b)
        require_same_model({a: hyperparameters, b: reference_hyperparameters})
        module.require_data(data)
        scope = scope or trained_scope(hyperparameters)
        loader = DataLoader(data.split(split), batch_size=batch_size or data.batch_size)
        architecture = {k: hyperparameters.get(k) for k in ("model", "model_config")}
        evaluation = Evaluation(module.metric_sums, loader, split, data_identity(data), architecture)
        model, reference, task = module.model, reference_module.model, data.info.task
        if options.data_aware:
            calibration = training_calibration(data, module.model_loss, options.calibration_batches)
    language_model = task == "causal_lm"
    _sweep_and_report(
        model, reference, a, b, scope, options, alphas, evaluation, output_dir, overwrite, language_model, calibration
    )


def _external_evaluation(
    a: Path,
    b: Path,
    data: Path,
    split: str,
    batch_size: int | None,
    text_column: str,
    label_column: str,
    sequence_length: int,
    timm_model: str | None,
    timm_args: dict[str, Any] | None,
):
    """End points A and B of Hugging Face or timm checkpoints and their evaluation on the user's data."""
    from torch.utils.data import DataLoader

    from lmc.adapters import adapter_for
    from lmc.connectivity import Evaluation
    from lmc.formats import evaluation_data, load_external, require_same_architecture
    from lmc.training.module import classification_sums

    model, reference = load_external(a, timm_model, timm_args), load_external(b, timm_model, timm_args)
    require_same_architecture(model, reference)
    user = evaluation_data(data, model.model, a, split, text_column, label_column, sequence_length)
    adapter, dtype = adapter_for(model.model), model.dtype

    def metric_sums(batch):
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        return classification_sums(
            adapter.forward(model.model, adapter.model_inputs(model.model, batch)), batch["labels"]
        )

    loader = DataLoader(user.dataset, batch_size=batch_size or 32)
    architecture = {"format": model.format, **model.architecture()}
    evaluation = Evaluation(metric_sums, loader, split, user.identity, architecture)
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
    from tqdm.auto import tqdm

    from lmc.connectivity import (
        SweepHooks,
        measure_connectivity,
        results_key,
        retire_stale_results,
        run_record,
        sweep_settings,
        with_perplexity,
        write_results,
    )

    record = run_record(model, str(a), [Path(b)], sweep_settings(scope, options, alphas, evaluation, calibration))
    earlier = results_key(output_dir)
    if earlier not in (None, record["key"]):
        if not overwrite:
            raise ValueError(
                f"{output_dir} holds the results of another sweep: pass --overwrite true (they move to "
                f"{output_dir / 'stale'}) or choose another --output_dir"
            )
        retire_stale_results(output_dir, record["key"])
    model.eval()
    bar = tqdm(total=2 * len(alphas), desc="Interpolate (naive, aligned)")
    hooks = SweepHooks(state_path=output_dir / "lmc_sweep_state_0.json", progress=lambda message: bar.update(1))
    try:
        result = measure_connectivity(model, reference.eval(), scope, options, alphas, evaluation, hooks, calibration)
    finally:
        bar.close()
    if language_model:
        result = with_perplexity(result)
    results = {"run": record, "references": {str(b): result}}
    write_results(output_dir, results)
    _write_tensorboard(output_dir / "tensorboard", results)
    for curve, values in result["curves"].items():
        loss, accuracy = values["loss_barrier"], values["accuracy_barrier"]
        ends = values["points"][0], values["points"][-1]
        perplexity = (
            f"  perplexity {ends[0]['perplexity']:.3f} -> {ends[1]['perplexity']:.3f}" if language_model else ""
        )
        print(f"{curve:8s} loss barrier {loss:.4f}  accuracy barrier {accuracy:.4f}{perplexity}")
    print(f"barrier ratio (aligned / naive, %): {result['barrier_ratio']}; results in {output_dir}")


def _write_tensorboard(folder: Path, results) -> None:
    """The sweep's TensorBoard scalars in ``folder`` (replaced: a rerun does not stack copies)."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    from lmc.connectivity import log_to_tensorboard

    shutil.rmtree(folder, ignore_errors=True)
    writer = SummaryWriter(str(folder))
    try:
        log_to_tensorboard(writer, results)
    finally:
        writer.close()


# -- parsing -------------------------------------------------------------------------------------
