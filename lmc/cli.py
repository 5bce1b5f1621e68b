"""The ``lmc`` command (also ``python -m lmc``).

- ``lmc fit|validate|test|predict --config X.yaml [--config Y.yaml] [--key value ...]``: a
  LightningCLI over :class:`~lmc.training.LMCModule` and any :class:`~lmc.data.LMCDataModule`
  (Lightning 2.6 has no ``lightning run`` command; this is the YAML-config entry point).
- ``lmc align``: align one checkpoint to another and write the aligned (and merged) weights.
- ``lmc interpolate``: naive and aligned interpolation curves between two checkpoints.
- ``lmc demo``: the main job on the embedded digits (pre-train, fine-tune two seeds, align, sweep).
- ``lmc symmetry``: show that random symmetries keep real models' outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmc.tasks import DataInfo

TRAINING_COMMANDS = ("fit", "validate", "test", "predict")


def _describe(data) -> DataInfo:
    return data.info


def lightning_cli(args: list[str] | None = None, run: bool = True):
    """The LightningCLI of lmc: model ``LMCModule``, data any ``LMCDataModule`` subclass.

    ``args`` ``None`` reads the command line.

    The DataModule's ``info`` (task, classes, sizes) is linked into ``model.data`` so a
    model is always sized to its data.
    """
    from lightning.pytorch.cli import LightningCLI

    from lmc.data import LMCDataModule
    from lmc.training import LMCModule

    class LMCLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("data", "model.data", compute_fn=_describe, apply_on="instantiate")

    return LMCLightningCLI(
        LMCModule,
        LMCDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        auto_configure_optimizers=False,
    )


def _config_value(configs: list[str], dotted: str) -> Any:
    """A value of the merged YAML configs (later files win), ``None`` if unset."""
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.merge(*[OmegaConf.load(c) for c in configs]), dotted)


def _module_and_data(configs: list[str]):
    """The experiment's module (weights not loaded) and DataModule, from its config files."""
    for config in configs:
        if not Path(config).is_file():
            raise SystemExit(f"lmc: config {config} does not exist")
    args = [item for config in configs for item in ("--config", config)]
    cli = lightning_cli([*args, "--model.pretrained=null", "--model.strategy=null"], run=False)
    return cli.model, cli.datamodule


def _align_command(args: argparse.Namespace) -> None:
    import torch

    from lmc.checkpoints import atomic_write_json, load_weights, save_weights
    from lmc.matching import align

    module, _ = _module_and_data(args.config)
    scope = args.scope or _config_value(args.config, "model.strategy") or "full_model"
    source = load_weights(module.build_model().eval(), args.source)
    target = load_weights(module.build_model().eval(), args.target)
    aligned, report = align(source, target, scope=scope, method=args.method, metric=args.metric)
    save_weights(aligned, args.output)
    atomic_write_json(Path(args.output).with_suffix(".json"), report.to_dict())
    print(f"aligned {args.source} to {args.target} ({scope}, {args.method}): wrote {args.output}")
    print(f"distance to target over the scope: {report.distance['naive']:.4f} -> {report.distance['aligned']:.4f}")
    if args.merge_alpha is not None:
        with torch.no_grad():
            for merged, theirs in zip(aligned.parameters(), target.parameters()):
                merged.copy_(torch.lerp(theirs, merged, args.merge_alpha))
        output = args.merged_output or str(Path(args.output).with_name(f"merged_{args.merge_alpha:g}.safetensors"))
        save_weights(aligned, output)
        print(f"merged (1 - {args.merge_alpha:g}) * target + {args.merge_alpha:g} * aligned source: wrote {output}")


def _interpolate_command(args: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader

    from lmc.checkpoints import load_weights
    from lmc.connectivity import measure_connectivity, write_results
    from lmc.interpolation import evaluate, evenly_spaced

    module, datamodule = _module_and_data(args.config)
    scope = args.scope or _config_value(args.config, "model.strategy") or "full_model"
    load_weights(module.model, args.a)
    module.eval()
    reference = load_weights(module.build_model().eval(), args.b)
    loader = DataLoader(datamodule.split(args.split), batch_size=args.batch_size or datamodule.batch_size)
    output = Path(args.output_dir)
    result = measure_connectivity(
        module.model,
        reference,
        lambda: evaluate(module.loss_sums, loader, module.device),
        evenly_spaced(args.num_alphas),
        scope,
        args.method,
        args.metric,
        state_path=output / "lmc_sweep_state_0.json",
    )
    write_results(output, {"scope": scope, "method": args.method, "split": args.split, "references": {args.b: result}})
    print(
        json.dumps(
            {curve: {k: v for k, v in data.items() if k != "points"} for curve, data in result["curves"].items()}
        )
    )
    print(f"barrier ratio (aligned / naive, %): {result['barrier_ratio']}; results in {output}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lmc`` console script."""
    from_command_line = argv is None
    argv = sys.argv[1:] if from_command_line else list(argv)
    if argv and argv[0] in TRAINING_COMMANDS:
        lightning_cli(None if from_command_line else argv)
        return

    from lmc.matching import METHODS, METRICS
    from lmc.models import list_models
    from lmc.symmetry import SCOPES
    from lmc.symmetry_demo import DEFAULT_MODELS

    parser = argparse.ArgumentParser(
        prog="lmc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{fit,validate,test,predict,align,...}")
    for name in TRAINING_COMMANDS:
        commands.add_parser(name, help=f"LightningCLI {name} (see lmc {name} --help)")

    demo = commands.add_parser("demo", help="the main job on the embedded digits (offline, CPU, minutes)")
    demo.add_argument("--output-dir", default="runs/demo", help="where checkpoints, logs and results go")
    demo.add_argument("--epochs", type=int, default=None, help="override the pre-training/fine-tuning epochs")

    symmetry = commands.add_parser("symmetry", help="random symmetries keep outputs; wrong groups break them")
    symmetry.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list_models(), metavar="NAME")
    symmetry.add_argument("--seed", type=int, default=0)

    for name, help_text in (
        ("align", "align SOURCE to TARGET and write the aligned weights (safetensors)"),
        ("interpolate", "naive and aligned interpolation curves between checkpoints A and B"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--config", action="append", required=True, help="experiment config(s) of both runs")
        command.add_argument("--scope", choices=SCOPES, default=None, help="default: the config's model.strategy")
        command.add_argument("--method", choices=METHODS, default="full")
        command.add_argument("--metric", choices=METRICS, default="invariant")
    align_parser = commands.choices["align"]
    align_parser.add_argument("--source", required=True, help="checkpoint to transform")
    align_parser.add_argument("--target", required=True, help="checkpoint to align to")
    align_parser.add_argument("--output", required=True, help="aligned weights (.safetensors); a .json report beside")
    align_parser.add_argument("--merge-alpha", type=float, default=None, help="also write (1-a)*target + a*aligned")
    align_parser.add_argument("--merged-output", default=None)
    interpolate = commands.choices["interpolate"]
    interpolate.add_argument("--a", required=True, help="checkpoint of end point A (alpha = 0)")
    interpolate.add_argument("--b", required=True, help="checkpoint of end point B (alpha = 1), aligned to A")
    interpolate.add_argument("--num-alphas", type=int, default=25)
    interpolate.add_argument("--split", choices=("val", "test"), default="val")
    interpolate.add_argument("--batch-size", type=int, default=None)
    interpolate.add_argument("--output-dir", required=True)

    args = parser.parse_args(argv)
    if args.command == "symmetry":
        from lmc import symmetry_demo

        symmetry_demo.run(tuple(args.models), seed=args.seed)
    elif args.command == "demo":
        from lmc import demo as main_job

        main_job.run(Path(args.output_dir), epochs=args.epochs)
    elif args.command == "align":
        _align_command(args)
    elif args.command == "interpolate":
        _interpolate_command(args)


if __name__ == "__main__":
    main()
