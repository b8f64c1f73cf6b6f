"""The ``dipaco`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func``. Subcommands
that need the server side (Django) import it lazily, so a worker-only install
still has ``dipaco download``/``route``/``generate``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dipaco import __version__

# Module names under dipaco.cli, in the order --help lists them.
SUBCOMMANDS = ["demo", "server", "simulate", "admin", "download", "route", "generate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dipaco",
        description=(
            "Train language models on volunteer compute with DiPaCo and DiLoCo.\n\n"
            "Start here:  dipaco demo        (everything on this machine)\n"
            "             dipaco server      (the control plane alone)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dipaco {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"dipaco.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
