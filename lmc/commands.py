"""The single-step commands of ``lmc``: typed functions whose docstrings are their ``--help``.

``lmc align`` and ``lmc interpolate`` read lmc checkpoints (written by ``lmc fit`` or ``lmc
run``), Hugging Face model directories (``save_pretrained``) and timm checkpoints
(:mod:`lmc.formats`). Each carries its model's configuration: the model is built from the
checkpoint itself, and two checkpoints of different models are refused. Alignment settings are the fields of
:class:`~lmc.matching.AlignOptions` (``--method``, ``--metric``, ``--steps``, ...). Flags take
``_`` or ``-`` between words (``--merge_alpha`` or ``--merge-alpha``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmc.connectivity import CurveSplit
from lmc.data import LMCDataModule
from lmc.matching import AlignOptions
from lmc.symmetry import Scope
from lmc.symmetry_demo import DEFAULT_MODELS


def align(
    source: Path,
    target: Path,
    output: Path | None = None,
    scope: Scope | None = None,
    merge_alpha: list[float] | None = None,
    overwrite: bool = False,
    timm_model: str | None = None,
    timm_args: dict[str, Any] | None = None,
    data: LMCDataModule | None = None,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Align SOURCE to TARGET and write the aligned (and merged) models into OUTPUT.

    Writes OUTPUT/aligned (computes SOURCE's function, weights close to TARGET's),
    OUTPUT/report.json and, for each merge alpha a, OUTPUT/merged_<a> holding
    (1 - a) * TARGET + a * aligned SOURCE, each in the inputs' own format: lmc checkpoints
    (aligned.ckpt, merged_<a>.ckpt), save_pretrained directories (with the tokenizer files), or
    timm folders (model.safetensors and config.json).

    Args:
        source: Checkpoint to transform: an lmc checkpoint, a Hugging Face model directory, a timm
            folder, or a timm state-dict file with --timm_model.
        target: Checkpoint to align to, of the same model and format.
        output: Folder for the outputs (required; created; never one of the inputs).
        scope: Symmetries to align; default: the re-initialization lmc checkpoints were fine-tuned
            with, full_model for other formats.
        merge_alpha: Also write the merge at each of these alphas in [0, 1].
        overwrite: Replace outputs that already exist.
        timm_model: The timm model name of state-dict files (timm.list_models()).
        timm_args: timm.create_model arguments of state-dict files, e.g. '{num_classes: 10}'.
        data: The DataModule whose training split calibrates data-aware settings (objective data,
            metric activation, unit_matching activation, method learned; required by them only): a
            configs/data/*.yaml file, or a class path such as lmc.data.Digits.
        options: Alignment settings.
    """
    import torch

    from lmc.checkpoints import atomic_write_json
    from lmc.connectivity import training_calibration
    from lmc.matching import align as align_models
    from lmc.training.module import load_trained, require_same_model, save_trained

    output = _required(output, "--output DIR")
    alphas = _checked_alphas(merge_alpha or [])
    if _external(source, target, timm_model):
        _refuse_data_aware_external(options)
        if _streamable(source, target, timm_model, scope):
            _align_streamed(source, target, output, scope, alphas, overwrite, options)
            return
        _align_external(source, target, output, scope, alphas, overwrite, timm_model, timm_args, options)
        return
    outputs = [output / "aligned.ckpt", output / "report.json", *(output / f"merged_{a:g}.ckpt" for a in alphas)]
    _check_outputs(outputs, inputs=[source, target], overwrite=overwrite)
    source_module, hyperparameters = load_trained(source)
    target_module, target_hyperparameters = load_trained(target)
    require_same_model({source: hyperparameters, target: target_hyperparameters})
    scope = scope or _trained_scope(hyperparameters)
    calibration = None
    if options.data_aware:
        data = _required(data, "--data FILE_OR_CLASS (the training data that calibrates data-aware options)")
        source_module.require_data(data)
        calibration = training_calibration(data, source_module.model_loss, options.calibration_batches)
    aligned, report = align_models(
        source_module.model, target_module.model, scope=scope, options=options, calibration=calibration
    )
    aligned_weights = aligned.state_dict()
    save_trained(aligned_weights, hyperparameters, outputs[0])
    atomic_write_json(outputs[1], report.to_dict())
    print(f"aligned {source} to {target} ({scope}, {options.method}): wrote {outputs[0]}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    target_weights = target_module.model.state_dict()
    for alpha, path in zip(alphas, outputs[2:]):
        merged = {name: torch.lerp(target_weights[name], value, alpha) for name, value in aligned_weights.items()}
        save_trained(merged, hyperparameters, path)
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {path}")


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
    from lmc.interpolation import evenly_spaced
    from lmc.training.module import load_trained, require_same_model

    data, output_dir = _required(data, "--data FILE_OR_CLASS"), _required(output_dir, "--output_dir DIR")
    alphas = evenly_spaced(num_alphas)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch_size must be positive, got {batch_size}")
    _check_outputs([output_dir / "lmc_results.json"], inputs=[a, b], overwrite=True)
    calibration = None
    if _external(a, b, timm_model):
        _refuse_data_aware_external(options)
        if not isinstance(data, Path):
            raise ValueError("--data of Hugging Face and timm models is a path to your data, not a DataModule")
        model, reference, evaluation, task = _external_evaluation(
            a, b, data, split, batch_size, text_column, label_column, sequence_length, timm_model, timm_args
        )
        scope = scope or "full_model"
    else:
        data = _data_module(data) if isinstance(data, Path) else data
        module, hyperparameters = load_trained(a)
        reference_module, reference_hyperparameters = load_trained(b)
        require_same_model({a: hyperparameters, b: reference_hyperparameters})
        module.require_data(data)
        scope = scope or _trained_scope(hyperparameters)
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
    from lmc.checkpoints import atomic_write_json
    from lmc.matching import equivalent as equivalent_models

    if output is not None:
        if output.is_dir():
            raise ValueError(f"--output {output} is a folder: give a file name such as {output / 'equivalence.json'}")
        _check_outputs([output], inputs=[a, b], overwrite=overwrite)
    model_a, model_b, hyperparameters = _load_pair(a, b)
    scope = scope or _trained_scope(hyperparameters)
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


def demo(output_dir: Path = Path("runs/demo"), epochs: int | None = None) -> None:
    """The main job: pre-train, fine-tune seeds, align and sweep on the embedded digits (offline, CPU).

    Args:
        output_dir: Where checkpoints, logs and results go.
        epochs: Pre-training and fine-tuning epochs (default: the main job's 40 and 60).
    """
    from lmc import demo as main_job

    if epochs is not None and epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")
    main_job.run(output_dir, epochs=epochs)


def repro(
    study: list[Path] = [Path("configs/study/repro.yaml")],
    quick: bool = False,
    jobs: int = 2,
) -> None:
    """The paper's study at small scale: every family and strategy, Table 1, then docs/results.md.

    Runs resume after a kill (finished fits and sweep points are kept). Each run computes in a worker
    with one thread, so the numbers do not depend on --jobs.

    Args:
        study: Study configs, later ones overriding earlier ones (configs/study/*.yaml).
        quick: The same pipeline in its tiny form (configs/study/quick.yaml: a few steps, 2 seeds;
            its numbers mean nothing; it writes runs/repro_quick/results.md, not docs/results.md).
        jobs: Runs at a time (one CPU thread each).
    """
    from lmc.study import repro as run_study

    run_study([*study, *([Path("configs/study/quick.yaml")] if quick else [])], jobs=jobs)


def symmetry(models: list[str] = list(DEFAULT_MODELS), seed: int = 0) -> None:
    """Random symmetries keep real models' outputs; groups that are too large break them.

    Args:
        models: Registered model names (lmc.models.list_models()).
        seed: Seed of the random group elements.
    """
    from lmc import symmetry_demo
    from lmc.models import list_models

    unknown = [m for m in models if m not in list_models()]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(list_models())}")
    symmetry_demo.run(tuple(models), seed=seed)


COMMANDS: dict[str, Callable[..., None]] = {
    "align": align,
    "interpolate": interpolate,
    "equivalent": equivalent,
    "demo": demo,
    "repro": repro,
    "symmetry": symmetry,
}


def _required(value: Any, flag: str) -> Any:
    if value is None:
        raise ValueError(f"{flag} is required")
    return value


def _checked_alphas(alphas: list[float]) -> list[float]:
    bad = [a for a in alphas if not (math.isfinite(a) and 0 <= a <= 1)]
    if bad:
        raise ValueError(f"--merge_alpha values must lie in [0, 1], got {bad}")
    return list(dict.fromkeys(alphas))


def _check_outputs(outputs: list[Path], inputs: list[Path], overwrite: bool) -> None:
    """Refuse outputs that would replace (or lie inside, or hold) an input, collide, or replace results without
    ``overwrite``."""
    from lmc.formats import overlapping_input

    for path in outputs:
        clash = overlapping_input(path, inputs)
        if clash is not None:
            raise ValueError(f"the output {path} would replace an input ({clash}): choose another output folder")
        if path.parent.exists() and not path.parent.is_dir():
            raise ValueError(f"the output folder {path.parent} is a file: choose a folder")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"{', '.join(existing)} already exist: pass --overwrite true to replace them")


def _load_pair(a: Path, b: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The models of checkpoints A and B (refused unless of one model), and A's hyper-parameters."""
    from lmc.training.module import load_trained, require_same_model

    module_a, hyperparameters = load_trained(a)
    module_b, hyperparameters_b = load_trained(b)
    require_same_model({a: hyperparameters, b: hyperparameters_b})
    return module_a.model, module_b.model, hyperparameters


def _trained_scope(hyperparameters: dict[str, Any]) -> str:
    return hyperparameters.get("reinit") or "full_model"


def _external(a: Path, b: Path, timm_model: str | None) -> bool:
    """Whether A and B are Hugging Face or timm checkpoints (``False``: lmc checkpoints); mixed formats are refused."""
    from lmc.checkpoints import CheckpointError
    from lmc.formats import detect_format
    from lmc.formats.external import FORMAT_NAMES

    kinds = [detect_format(path, timm_model) for path in (a, b)]
    if (kinds[0] == "lmc") != (kinds[1] == "lmc"):
        raise CheckpointError(
            f"{a} is {FORMAT_NAMES[kinds[0]]} but {b} is {FORMAT_NAMES[kinds[1]]}: give two checkpoints of one format"
        )
    return kinds[0] != "lmc"


def _refuse_data_aware_external(options: AlignOptions) -> None:
    if options.data_aware:
        raise ValueError(
            f"data-aware alignment settings ({options.data_settings}) calibrate on an lmc DataModule's training "
            "split, which Hugging Face and timm checkpoints do not have here: use the weight settings (the defaults) "
            "for them"
        )


def _streamable(source: Path, target: Path, timm_model: str | None, scope: Scope | None) -> bool:
    """Whether ``lmc align`` streams: two Hugging Face safetensors folders at a scope that streams."""
    from lmc.formats import detect_format
    from lmc.formats.huggingface import weight_files
    from lmc.streaming import STREAMED_SCOPES

    if scope not in STREAMED_SCOPES:
        return False
    folders = [path for path in (source, target) if detect_format(path, timm_model) == "huggingface"]
    return len(folders) == 2 and all(f.suffix == ".safetensors" for path in folders for f in weight_files(path))


def _align_streamed(
    source: Path, target: Path, output: Path, scope: Scope, alphas: list[float], overwrite: bool, options: AlignOptions
) -> None:
    """``lmc align`` of two safetensors folders, layer by layer and shard by shard (lmc.streaming)."""
    from lmc.streaming import align_directories

    report = align_directories(source, target, output, scope, options, alphas, overwrite)
    print(f"aligned {source} to {target} ({scope}, {options.method}, streamed): wrote {output / 'aligned'}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    for alpha in alphas:
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {output / f'merged_{alpha:g}'}")


def _align_external(
    source: Path,
    target: Path,
    output: Path,
    scope: Scope | None,
    alphas: list[float],
    overwrite: bool,
    timm_model: str | None,
    timm_args: dict[str, Any] | None,
    options: AlignOptions,
) -> None:
    """``lmc align`` of Hugging Face or timm checkpoints: outputs in the inputs' own format, checked when read back."""
    import copy

    import torch

    from lmc.checkpoints import atomic_write_json
    from lmc.formats import atomic_output_folder, load_external, require_same_architecture
    from lmc.matching import AlignmentError
    from lmc.matching import align as align_models

    outputs = [output / "aligned", output / "report.json", *(output / f"merged_{a:g}" for a in alphas)]
    _check_outputs(outputs, inputs=[source, target], overwrite=overwrite)
    source_model = load_external(source, timm_model, timm_args)
    target_model = load_external(target, timm_model, timm_args)
    require_same_architecture(source_model, target_model)
    scope = scope or "full_model"
    aligned, report = align_models(source_model.model, target_model.model, scope=scope, options=options)
    with atomic_output_folder(outputs[0], inputs=[source, target]) as folder:
        source_model.write(aligned, folder)
        written_error = _relative_output_error(source_model.model, source_model.reload(folder), options)
        if not written_error <= report.check_rtol:
            raise AlignmentError(
                f"the aligned model written to {outputs[0]} and read back changes the source's outputs by "
                f"{written_error:.3g} > {report.check_rtol:g} (the {report.dtype} tolerance): a bug in lmc's "
                f"{source_model.format} writer; please report it"
            )
    print(f"aligned {source} to {target} ({scope}, {options.method}): wrote {outputs[0]}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    target_parameters = dict(target_model.model.named_parameters())
    compute = getattr(torch, report.compute_dtype)  # half-precision merges are rounded once, from float32
    for alpha, path in zip(alphas, outputs[2:]):
        merged = copy.deepcopy(target_model.model)
        merged_parameters = dict(merged.named_parameters())
        with torch.no_grad():
            for name, parameter in aligned.named_parameters():
                end_points = target_parameters[name].to(compute), parameter.to(compute)
                merged_parameters[name].copy_(torch.lerp(*end_points, alpha))
        with atomic_output_folder(path, inputs=[source, target]) as folder:
            source_model.write(merged, folder)
        del merged
        print(f"merged (1 - {alpha:g}) * target + {alpha:g} * aligned source: wrote {path}")
    checks = {
        "aligned_model": {"relative_output_change": report.probe_relative_error, "rtol": report.check_rtol},
        "written_and_read_back": {"relative_output_change": written_error, "rtol": report.check_rtol},
    }
    atomic_write_json(
        outputs[1],
        {
            "source": str(source),
            "target": str(target),
            "format": source_model.format,
            "stored_dtype": report.dtype,
            "compute_dtype": report.compute_dtype,
            "per_head_problem_dtype": "float64",
            "checks": checks,
            "outputs": {"aligned": str(outputs[0]), **{f"merged_{a:g}": str(p) for a, p in zip(alphas, outputs[2:])}},
            "alignment": report.to_dict(),
        },
    )


def _relative_output_error(reference, model, options: AlignOptions) -> float:
    """``||f(x) - f_ref(x)|| / ||f_ref(x)||`` on the alignment's probe input (in float64)."""
    import torch

    from lmc.adapters import adapter_for

    adapter = adapter_for(reference)
    inputs = adapter.example_inputs(reference, options.probe_batch_size, torch.Generator().manual_seed(options.seed))
    with torch.no_grad():
        expected, found = adapter.forward(reference.eval(), inputs), adapter.forward(model.eval(), inputs)
    return float((found - expected).double().norm() / expected.double().norm())


def _data_module(path: Path) -> LMCDataModule:
    """The DataModule of a ``configs/data/*.yaml`` group file."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LMCDataModule, "data")
    try:
        return parser.instantiate_classes(parser.parse_args(["--data", str(path)])).data
    except Exception as error:  # jsonargparse's ArgumentError and whatever the DataModule raises
        first = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(
            f"--data {path}: not a DataModule config ({first}); lmc checkpoints evaluate on a DataModule "
            "(configs/data/*.yaml or a class path such as lmc.data.Digits)"
        ) from error


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


def summary(function: Callable[..., None]) -> str:
    """The first line of a command's docstring."""
    return inspect.getdoc(function).splitlines()[0]


def parser_for(function: Callable[..., None]):
    """A jsonargparse parser of ``function``: required parameters positional, AlignOptions flattened."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    description = inspect.getdoc(function).split("\n\nArgs:")[0]
    parser = ArgumentParser(description=description, formatter_class=help_formatter())
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments")
    takes_options = "options" in inspect.signature(function).parameters
    parser.add_function_arguments(function, as_positional=True, skip={"options"}, as_group=False, sub_configs=True)
    if takes_options:
        parser.add_class_arguments(AlignOptions, None, instantiate=False)
    return parser


def help_formatter():
    """jsonargparse's help formatter, keeping the line breaks of descriptions (docstrings)."""
    import argparse

    from jsonargparse import DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    return Formatter


def call(function: Callable[..., None], parser, config, name: str) -> None:
    """Instantiate the parsed arguments of ``name`` and call ``function`` with them."""
    from dataclasses import fields

    arguments = parser.instantiate_classes(config)[name]
    parameters = inspect.signature(function).parameters
    kwargs = {k: arguments[k] for k in parameters if k != "options"}
    if "options" in parameters:
        kwargs["options"] = AlignOptions(**{f.name: arguments[f.name] for f in fields(AlignOptions)})
    function(**kwargs)


def underscored(argv: list[str]) -> list[str]:
    """``--merge-alpha 0.5`` -> ``--merge_alpha 0.5``: flags are Python names; both spellings work."""
    result = []
    for token in argv:
        if token.startswith("--"):
            flag, equals, value = token.partition("=")
            token = "--" + flag[2:].replace("-", "_") + equals + value
        result.append(token)
    return result
