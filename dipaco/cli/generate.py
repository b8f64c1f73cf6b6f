"""``dipaco generate``: continue a prompt with the path of a run that the prompt belongs to.

Routes the prompt through the server (or takes ``--path``), downloads only that path into
the cache (``--cache-dir``, default $DIPACO_CACHE or ~/.cache/dipaco; later calls reuse
it), and streams the continuation to standard output as it is generated. With
``--reroute-every K`` the server's router reads the last ``router.prefix_tokens`` tokens
so far every K new tokens, and the path it picks (downloaded on first use) goes on with a
fresh prefill (dipaco.generation); the path changes are said on standard error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dipaco.cli.command import Command
from dipaco.cli.download import ROUND_HELP, add_server_arguments, api_round, round_number
from dipaco.cli.route import route
from dipaco.client import DownloadError, cached_path_dir
from dipaco.config import RouterConfig
from dipaco.generation import generate as generate_tokens
from dipaco.inference import RUN_FILE, open_path_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("prompt", help="the text to continue")
    parser.add_argument("--path", type=int, help="use this path instead of routing the prompt")
    parser.add_argument("--round", type=round_number, metavar="N", help=ROUND_HELP)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--reroute-every", type=int, default=0, metavar="K",
        help="re-route every K new tokens: the server's router reads the last "
        "router.prefix_tokens tokens so far and that path (downloaded once) goes on; the "
        "DiPaCo paper re-routes every 64 (default 0: route the prompt once; ignored with "
        "--path)",
    )  # fmt: skip
    parser.add_argument("--cache-dir", help="where downloaded paths are kept")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")


def main(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.temperature < 0 or args.reroute_every < 0:
        print(
            "dipaco generate: need --max-new-tokens >= 1, --temperature >= 0 and "
            "--reroute-every >= 0",
            file=sys.stderr,
        )
        return 2

    def fetch(path: int) -> str:
        return str(
            cached_path_dir(
                args.server, args.run, path, args.cache_dir, round=api_round(args.round),
                token=args.token,
            )
        )  # fmt: skip

    try:
        path = args.path
        if path is None:
            path = route(args.server, args.run, args.prompt, args.token)["path"]
            print(f"routed to path {path}", file=sys.stderr)
        directory = fetch(path)
        # A path asked for writes everything on its own, as a downloaded path does.
        router = None if args.path is not None or not args.reroute_every else fetch
        generate(directory, args, path, router)
    except DownloadError as exc:
        print(f"dipaco generate: {exc}", file=sys.stderr)
        return 1
    return 0


def _prefix_tokens(directory: str) -> int:
    """The run's router.prefix_tokens, from the path directory's dipaco.json."""
    facts = json.loads((Path(directory) / RUN_FILE).read_text("utf-8"))
    router = facts.get("config", {}).get("router", {})
    return int(router.get("prefix_tokens", RouterConfig().prefix_tokens))


def generate(
    directory: str, args: argparse.Namespace, path: int, fetch: Callable[[int], str] | None
) -> None:
    """Print the prompt, then stream the continuation to standard output; with `fetch`
    (re-routing), every --reroute-every tokens the server's router picks the path for the
    last router.prefix_tokens tokens so far, and that path (downloaded once) goes on."""
    model, tokenizer = open_path_dir(directory, device=args.device)
    models = {path: model}
    prefix = _prefix_tokens(directory)

    def open_path(p: int) -> Any:
        if p not in models:
            assert fetch is not None
            models[p] = open_path_dir(fetch(p), device=args.device)[0]
        return models[p]

    current = [path]

    def route_tail(ids: list[int]) -> int:
        text = tokenizer.decode(ids[-prefix:], skip_special_tokens=True)
        if text.strip():  # the server routes text that is not only whitespace
            current[0] = int(route(args.server, args.run, text, args.token)["path"])
        return current[0]

    new: list[int] = []
    shown = [""]

    def on_token(token: int, writer: int) -> None:
        new.append(token)
        text = tokenizer.decode(new, skip_special_tokens=True)
        print(text[len(shown[0]) :], end="", flush=True)
        shown[0] = text

    # Training documents start with the separator (BOS), so prompts do too.
    ids = [tokenizer.bos_token_id, *tokenizer.encode(args.prompt)]
    print(args.prompt, end="", flush=True)
    done = generate_tokens(
        open_path, ids, path, args.max_new_tokens,
        route_tail=route_tail if fetch is not None else None,
        reroute_every=args.reroute_every, temperature=args.temperature, seed=args.seed,
        stop=tokenizer.eos_token_id, on_token=on_token,
    )  # fmt: skip
    print()
    for switch in done.switches:
        print(
            f"re-routed after {switch['at']} new tokens: path {switch['from_path']} -> "
            f"{switch['to_path']}",
            file=sys.stderr,
        )
    if fetch is not None:
        print(f"paths used: {', '.join(map(str, done.paths))}", file=sys.stderr)


COMMAND = Command(
    "generate",
    "route a prompt to its path, download that path and generate text",
    __doc__ or "",
    add_arguments,
    main,
)
register = COMMAND.register
