"""``dipaco-worker``: lend this machine's accelerator to a dipaco run."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="dipaco-worker",
        description="Lend this machine's GPU (or CPU) to a dipaco training run.",
    )


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print(
        "dipaco-worker: the training loop is not part of this release yet "
        "(the worker agent is under construction).",
        file=sys.stderr,
    )
    return 2
