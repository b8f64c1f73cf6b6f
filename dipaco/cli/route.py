"""``dipaco route``: which path of a run a text belongs to, by the run's own router.

Prints the path, its module per level and the best-scoring paths; ``--json`` prints the
server's answer whole. The text ``-`` reads it from standard input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dipaco.cli.command import Command
from dipaco.cli.download import add_server_arguments
from dipaco.client import Client, DownloadError

SHOWN_SCORES = 8


def route(server: str, run: int, text: str, token: str | None = None) -> dict[str, Any]:
    """The server's answer: {"path", "modules", "scores"}."""
    with Client(server, token) as client:
        answer: dict[str, Any] = client.post_json(f"/api/v1/runs/{run}/route", {"text": text})
    return answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("text", help="the text, or - to read standard input")
    parser.add_argument("--json", action="store_true", help="print the server's JSON answer")


def main(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        answer = route(args.server, args.run, text, args.token)
    except DownloadError as exc:
        print(f"dipaco route: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    modules = ", ".join(f"level {i}: {k}" for i, k in enumerate(answer["modules"]))
    print(f"path {answer['path']} ({modules})")
    ranked = sorted(enumerate(answer["scores"]), key=lambda item: -item[1])
    for p, score in ranked[:SHOWN_SCORES]:
        print(f"  path {p:>4}  score {score:.6g}")
    if len(ranked) > SHOWN_SCORES:
        print(f"  ... {len(ranked) - SHOWN_SCORES} more paths (--json shows all)")
    return 0


COMMAND = Command(
    "route", "show which path of a run a text is routed to", __doc__ or "", add_arguments, main
)
register = COMMAND.register
