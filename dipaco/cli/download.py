"""``dipaco download``: one path of a run as a Hugging Face model directory.

It reads the path's manifest, fetches the small files and the path's module blobs in
parallel (each checked against its sha256), assembles model.safetensors locally with the
library, and checks that against the server's sha256 too. A file already there with the
right sha256 is kept, so running the command again after an interruption fetches only
what is missing. The HTTP client is dipaco.client (also behind ``dipaco.load_path``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dipaco.cli.command import Command
from dipaco.client import (
    DEFAULT_SERVER,
    Client,
    DownloadError,
    download_path,
    fetch_manifest,
    stderr,
)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get("DIPACO_SERVER", DEFAULT_SERVER),
        help="the dipaco server (default: $DIPACO_SERVER or %(default)s)",
    )
    parser.add_argument("--run", type=int, required=True, help="the run's id")
    parser.add_argument(
        "--token",
        default=os.environ.get("DIPACO_TOKEN"),
        help="a staff token, when the server is not public (default: $DIPACO_TOKEN)",
    )


def round_number(text: str) -> int:
    """``--round N``: a round as the dashboard, the terminal and folder names count it (the
    first is 1); the API's ``round`` is the 0-based index, so N - 1 is sent."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value}: rounds are counted from 1, as on the dashboard; give 1 or more"
        )
    return value


def api_round(number: int | None) -> int | None:
    """The API's 0-based round index of round `number` (counted from 1); None stays None."""
    return None if number is None else number - 1


ROUND_HELP = "the weights after round N, counted from 1 as on the dashboard (default: the last)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--path", type=int, required=True, help="the path's index")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--round", type=round_number, metavar="N", help=ROUND_HELP)
    parser.add_argument("--jobs", type=int, default=4, help="parallel downloads (default: 4)")


def main(args: argparse.Namespace) -> int:
    try:
        with Client(args.server, args.token) as client:
            manifest = fetch_manifest(client, args.run, args.path, api_round(args.round))
            download_path(client, manifest, args.out, jobs=args.jobs)
    except DownloadError as exc:
        stderr(f"dipaco download: {exc}")
        return 1
    return 0


COMMAND = Command(
    "download",
    "download one path of a run as a Hugging Face model directory",
    __doc__ or "",
    add_arguments,
    main,
)
register = COMMAND.register
