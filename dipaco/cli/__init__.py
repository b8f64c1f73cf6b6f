"""The ``dipaco`` command line.

Commands are found through the ``dipaco.commands`` entry-point group (pyproject.toml):
each names a ``register(subparsers)`` that adds its parser and sets ``func``. The
library's commands (``simulate``, ``download``, ``route``, ``generate``) live in this
package; ``server`` and ``admin`` belong to the control plane (``dipaco_server.cli``) and
``demo`` to ``dipaco_demo``. An entry point that names an extra (``[server]``) is offered
only when that extra's requirements are installed; otherwise ``--help`` says how to get
it and running it prints the same hint, instead of a command that fails on import.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement

from dipaco import __version__

GROUP = "dipaco.commands"
DISTRIBUTION = "dipaco"
# The order --help lists the commands in; a command not named here (a plug-in) follows.
ORDER = ["demo", "server", "simulate", "admin", "download", "route", "generate"]


@dataclass(frozen=True)
class Missing:
    """A command whose extra is not installed: what to install, and what is absent."""

    name: str
    extra: str
    absent: tuple[str, ...]

    @property
    def hint(self) -> str:
        return (
            f"`dipaco {self.name}` needs the {self.extra!r} extra "
            f"(missing: {', '.join(self.absent)}); install it with: "
            f"pip install 'dipaco[{self.extra}]'"
        )


def missing_requirements(extra: str, distribution: str = DISTRIBUTION) -> list[str]:
    """The requirements of `distribution`'s `extra` that are not installed (or too old)."""
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return [distribution]
    absent = []
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue
        if requirement.marker.evaluate({"extra": ""}):
            continue  # a base requirement under a platform marker, not this extra's
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            absent.append(requirement.name)
            continue
        if requirement.specifier and installed not in requirement.specifier:
            absent.append(f"{requirement.name}{requirement.specifier} (have {installed})")
    return absent


def discover(
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> tuple[list[metadata.EntryPoint], list[Missing]]:
    """The group's commands split into those that can run here and those missing an extra."""
    if entry_points is None:
        entry_points = metadata.entry_points(group=GROUP)
    found: dict[str, metadata.EntryPoint] = {}
    for entry_point in entry_points:
        found.setdefault(entry_point.name, entry_point)  # the first distribution wins
    rank = {name: i for i, name in enumerate(ORDER)}
    ready, missing = [], []
    for name in sorted(found, key=lambda n: (rank.get(n, len(ORDER)), n)):
        entry_point = found[name]
        absent = [a for extra in entry_point.extras for a in missing_requirements(extra)]
        if absent:
            missing.append(Missing(name, ",".join(entry_point.extras), tuple(absent)))
        else:
            ready.append(entry_point)
    return ready, missing


def build_parser(
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> tuple[argparse.ArgumentParser, list[Missing]]:
    ready, missing = discover(entry_points)
    epilog = None
    if missing:
        names = ", ".join(m.name for m in missing)
        extras = sorted({m.extra for m in missing})
        install = " ".join(f"'dipaco[{e}]'" for e in extras)
        epilog = f"Not installed here: {names}. They need: pip install {install}"
    start = "dipaco demo" if any(e.name == "demo" for e in ready) else "dipaco simulate"
    parser = argparse.ArgumentParser(
        prog="dipaco",
        description=(
            "Train language models on volunteer compute with DiPaCo and DiLoCo.\n\n"
            f"Start here:  {start}\n"
            "Lend a GPU:  dipaco-worker --help"
        ),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dipaco {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for entry_point in ready:
        entry_point.load()(subparsers)
    return parser, missing


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, missing = build_parser()
    if argv:
        for command in missing:
            if argv[0] == command.name:
                print(f"dipaco: {command.hint}", file=sys.stderr)
                return 2
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
