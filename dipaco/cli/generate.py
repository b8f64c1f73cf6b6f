"""``dipaco generate``: continue a prompt with the path of a run that the prompt belongs to.

Routes the prompt through the server (or takes ``--path``), downloads only that path into
the cache (``--cache-dir``, default $DIPACO_CACHE or ~/.cache/dipaco; later calls reuse
it), and streams the continuation to standard output as it is generated.
"""

from __future__ import annotations

import argparse
import os
import sys

from dipaco.cli.command import Command
from dipaco.cli.download import ROUND_HELP, add_server_arguments, api_round, round_number
from dipaco.cli.route import route
from dipaco.client import DownloadError, cached_path_dir


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
    parser.add_argument("--cache-dir", help="where downloaded paths are kept")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")


def main(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.temperature < 0:
        print("dipaco generate: need --max-new-tokens >= 1 and --temperature >= 0", file=sys.stderr)
        return 2
    try:
        path = args.path
        if path is None:
            path = route(args.server, args.run, args.prompt, args.token)["path"]
            print(f"routed to path {path}", file=sys.stderr)
        directory = cached_path_dir(
            args.server,
            args.run,
            path,
            args.cache_dir,
            round=api_round(args.round),
            token=args.token,
        )
    except DownloadError as exc:
        print(f"dipaco generate: {exc}", file=sys.stderr)
        return 1
    generate(directory, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.device)
    return 0


def generate(
    directory: str | os.PathLike[str],
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    device: str,
) -> None:
    """Print the prompt, then stream the continuation (TextStreamer) to standard output."""
    # torch and transformers (seconds): only when generating, not for `dipaco --help`
    import torch
    from transformers import TextStreamer

    from dipaco.inference import open_path_dir

    model, tokenizer = open_path_dir(str(directory), device=device)
    # Training documents start with the separator (BOS), so prompts do too.
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(prompt)]], device=device)
    print(prompt, end="", flush=True)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {}
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
        **({"do_sample": False} | sampling),
    )


COMMAND = Command(
    "generate",
    "route a prompt to its path, download that path and generate text",
    __doc__ or "",
    add_arguments,
    main,
)
register = COMMAND.register
