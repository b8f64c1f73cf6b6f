"""One declaration per `dipaco` command: its parser as a subcommand and on its own.

Each command module declares ``COMMAND = Command(...)`` and exposes ``register`` (the
``dipaco.commands`` entry point) and, where it runs standalone (``python -m ...``),
``main``, so every command's parser is built by the same lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Command"]


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # its line in `dipaco --help`
    description: str  # its --help's text, verbatim (RawDescriptionHelpFormatter)
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str | None = None  # examples, after the options

    def register(
        self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
    ) -> argparse.ArgumentParser:
        """Add the command to the `dipaco` dispatcher's subcommands."""
        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        parser.set_defaults(func=self.run)
        return parser

    def main(self, argv: list[str] | None = None) -> int:
        """Run the command without the dispatcher (``prog`` still says ``dipaco NAME``)."""
        parser = argparse.ArgumentParser(
            prog=f"dipaco {self.name}",
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        return self.run(parser.parse_args(argv))
