"""The single-step commands of ``lmc``: typed functions whose docstrings are their ``--help``.

``lmc align`` and ``lmc interpolate`` read lmc checkpoints (written by ``lmc fit`` or ``lmc
run``), which carry their model's configuration: the model is built from the checkpoint itself,
and two checkpoints of different models are refused. Alignment settings are the fields of
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
    data: LMCDataModule | None = None,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Align SOURCE to TARGET and write the aligned (and merged) models into OUTPUT.

    Writes OUTPUT/aligned.ckpt (computes SOURCE's function, weights close to TARGET's),
    OUTPUT/report.json and, for each merge alpha a, OUTPUT/merged_<a>.ckpt holding
    (1 - a) * TARGET + a * aligned SOURCE. The outputs are lmc checkpoints like the inputs.

    Args:
        source: Checkpoint to transform (lmc fit / lmc run).
        target: Checkpoint to align to, of the same model.
        output: Folder for the outputs (required; created; never one of the inputs).
        scope: Symmetries to align; default: the re-initialization the checkpoints were fine-tuned with.
        merge_alpha: Also write the merge at each of these alphas in [0, 1].
        overwrite: Replace outputs that already exist.
        data: The DataModule whose training split calibrates data-aware settings (objective data,
            metric activation, unit_matching activation; required by them only): a
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
    data: LMCDataModule | None = None,
    output_dir: Path | None = None,
    scope: Scope | None = None,
    split: CurveSplit = "val",
    num_alphas: int = 25,
    batch_size: int | None = None,
    overwrite: bool = False,
    options: AlignOptions = AlignOptions(),
) -> None:
    """Naive and aligned interpolation curves between checkpoints A and B, with their barriers.

    B is aligned to A, then both curves theta(alpha) = (1 - alpha) A + alpha B are evaluated on
    the split of DATA. Writes lmc_results.json, .csv and a figure into OUTPUT_DIR; a killed
    sweep resumes where it stopped. Data-aware alignment settings calibrate on DATA's training
    split.

    Args:
        a: Checkpoint of end point A (alpha = 0).
        b: Checkpoint of end point B (alpha = 1), of the same model.
        data: The DataModule to evaluate on (required): a configs/data/*.yaml file, or a class
            path such as lmc.data.Digits.
        output_dir: Folder for the results (required).
        scope: Symmetries to align; default: the re-initialization the checkpoints were fine-tuned with.
        split: The split the curves are measured on.
        num_alphas: Points on each curve (at least 2).
        batch_size: Evaluation batch size (default: the DataModule's).
        overwrite: Replace results of another sweep in OUTPUT_DIR.
        options: Alignment settings.
    """
    from torch.utils.data import DataLoader

    from lmc.connectivity import (
        Evaluation,
        SweepHooks,
        data_identity,
        measure_connectivity,
        results_key,
        retire_stale_results,
        run_record,
        sweep_settings,
        training_calibration,
        write_results,
    )
    from lmc.interpolation import evenly_spaced
    from lmc.training.module import load_trained, require_same_model

    data, output_dir = _required(data, "--data FILE_OR_CLASS"), _required(output_dir, "--output_dir DIR")
    alphas = evenly_spaced(num_alphas)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch_size must be positive, got {batch_size}")
    _check_outputs([output_dir / "lmc_results.json"], inputs=[a, b], overwrite=True)
    module, hyperparameters = load_trained(a)
    reference, reference_hyperparameters = load_trained(b)
    require_same_model({a: hyperparameters, b: reference_hyperparameters})
    module.require_data(data)
    scope = scope or _trained_scope(hyperparameters)
    loader = DataLoader(data.split(split), batch_size=batch_size or data.batch_size)
    architecture = {k: hyperparameters.get(k) for k in ("model", "model_config")}
    evaluation = Evaluation(module.metric_sums, loader, split, data_identity(data), architecture)
    calibration = None
    if options.data_aware:
        calibration = training_calibration(data, module.model_loss, options.calibration_batches)
    settings = sweep_settings(scope, options, alphas, evaluation, calibration)
    record = run_record(module.model, str(a), [Path(b)], settings)
    earlier = results_key(output_dir)
    if earlier not in (None, record["key"]):
        if not overwrite:
            raise ValueError(
                f"{output_dir} holds the results of another sweep: pass --overwrite true (they move to "
                f"{output_dir / 'stale'}) or choose another --output_dir"
            )
        retire_stale_results(output_dir, record["key"])
    module.eval()
    hooks = SweepHooks(state_path=output_dir / "lmc_sweep_state_0.json")
    result = measure_connectivity(
        module.model, reference.model.eval(), scope, options, alphas, evaluation, hooks, calibration
    )
    write_results(output_dir, {"run": record, "references": {str(b): result}})
    for curve, values in result["curves"].items():
        loss, accuracy = values["loss_barrier"], values["accuracy_barrier"]
        print(f"{curve:8s} loss barrier {loss:.4f}  accuracy barrier {accuracy:.4f}")
    print(f"barrier ratio (aligned / naive, %): {result['barrier_ratio']}; results in {output_dir}")


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
    "demo": demo,
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
    """Refuse outputs that would replace an input, collide, or replace results without ``overwrite``."""
    resolved_inputs = {Path(p).resolve() for p in inputs}
    for path in outputs:
        if path.resolve() in resolved_inputs:
            raise ValueError(f"the output {path} would replace an input: choose another output folder")
        if path.parent.exists() and not path.parent.is_dir():
            raise ValueError(f"the output folder {path.parent} is a file: choose a folder")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"{', '.join(existing)} already exist: pass --overwrite true to replace them")


def _trained_scope(hyperparameters: dict[str, Any]) -> str:
    return hyperparameters.get("reinit") or "full_model"


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
