"""The ``lmc`` command (also ``python -m lmc``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lmc`` console script."""
    from lmc.models import list_models
    from lmc.symmetry_demo import DEFAULT_MODELS

    parser = argparse.ArgumentParser(prog="lmc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("demo", "the main job on the embedded default (currently: the symmetry demo)"),
        ("symmetry", "show that random symmetries keep real models' outputs and wrong groups break them"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list_models(), metavar="NAME")
        command.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from lmc import symmetry_demo

    symmetry_demo.run(tuple(args.models), seed=args.seed)


if __name__ == "__main__":
    main(sys.argv[1:])
