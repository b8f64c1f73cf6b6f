"""``dipaco simulate``: a whole DiPaCo or DiLoCo run in this process, against its baselines."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from dipaco.cli.command import Command
from dipaco.codecs.registry import CODECS

DESCRIPTION = """\
Train DiPaCo (P paths of modules) or DiLoCo (one path, R replicas) in one process, exactly
as the platform would split the work, and compare it with two baselines on the same data
and the same number of training tokens:
  data-parallel  one path-size model, T*H steps, each on P*R inner batches (all-reduce)
  dense          one path-size model trained alone, T*H*P*R steps of one inner batch

It follows the DiPaCo paper's recipe: prepare the data (corpus sample, byte-level BPE
tokenizer), train one dense path-size base model (--base-steps, phase 1), route every
document by the base model's features of its first tokens (k-means), write per-path token
streams, and start every module from the base model's layers; data and base are cached in
--work-dir, keyed by every input that matters (--router tfidf routes by hashed n-grams
instead, and needs no base model). Then each of T rounds trains P x R work units of H AdamW
steps, encodes every module's pseudo-gradient with --codec, and takes the outer step per
module. Every model is scored on one seeded validation sample (--eval-windows), the one
the platform's evaluation scores.

Printed: validation loss and perplexity per path and routed (each validation document is
scored by the path it routes to), both baselines on the same validation tokens, tokens,
and bytes communicated against a data-parallel ring all-reduce. --out writes all of it,
with the per-round curve, as JSON."""

EPILOG = """\
examples:
  dipaco simulate
      DiPaCo, 2 levels x 2 modules (4 paths), tiny 2.8M-parameter paths, stdlib corpus,
      from a base model of 200 steps whose features route the documents
  dipaco simulate --router tfidf --base-steps 0
      the fallback without phase 1: tf-idf routing, modules from random weights
  dipaco simulate --diloco --replicas 4 --inner-steps 50 --rounds 4 --codec int8
      DiLoCo with 4 replicas and int8 pseudo-gradients
  dipaco simulate --paths 2x4 --max-docs 4000 --out run.json
      16 paths on a larger sample; the JSON has every figure of the tables
  dipaco simulate --base-steps 300 --inner-steps 50 --rounds 4 --threads 1
      a longer phase 1: the base model trains 300 steps
  dipaco simulate --config run.json --rounds 2 --no-baselines
      a platform run config (its model, layout, optimisers), two rounds only

Flags that are not given take their value from --config, else from the tiny defaults.
The first run spends some seconds preparing data; later runs with the same corpus,
budget, vocabulary and paths reuse it."""

MODEL_SIZES: dict[str, dict[str, Any]] = {
    # RunConfig.tiny()'s model: 2.84M parameters, a CPU step in ~0.1-0.3 s.
    "tiny": {},
    # 8.6M parameters: a few times slower, for machines with more cores or a GPU.
    "small": {
        "hidden_size": 256, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
        "intermediate_size": 704, "vocab_size": 8192, "seq_len": 256,
    },
    # The papers' 150M path (RunConfig.paper_150m's model and 2x2 grid): a GPU's size.
    "150m": {"preset": "paper_150m"},
}  # fmt: skip
DILOCO_REPLICAS = 4
# dipaco.simulate.baselines.BASELINES, named here so --help needs no torch import
BASELINES = ("data-parallel", "dense", "dense-steps")
DEFAULT_ROUNDS = 5
DEFAULT_VAL_FRACTION = 0.05  # DataConfig's 0.01 is for full corpora; a sample needs more
# Phase 1 when --base-steps is not given and the base model routes: two thirds of the quality
# bench's 300 (bench/quality.py), for a first run of the default that ends sooner.
DEFAULT_BASE_STEPS = 200
ROUTERS = ("base-lm", "tfidf")


def _paths(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write LEVELSxMODULES, e.g. 2x2 or 2x16")
    return int(match.group(1)), int(match.group(2))


def _baselines(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown baselines {unknown}: use {', '.join(BASELINES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_shape_arguments(parser.add_argument_group("what to train"))
    _add_data_arguments(parser.add_argument_group("data"))
    _add_output_arguments(parser.add_argument_group("output"))


def _add_shape_arguments(shape: argparse._ArgumentGroup) -> None:
    shape.add_argument("--config", type=Path, metavar="FILE", help="a RunConfig JSON to start from")
    shape.add_argument(
        "--paths",
        type=_paths,
        metavar="LxK",
        help="L levels of K modules each: K**L paths (default 2x2)",
    )
    shape.add_argument(
        "--diloco",
        action="store_true",
        help=f"plain DiLoCo: one path (1x1), {DILOCO_REPLICAS} replicas unless "
        "--replicas says otherwise",
    )
    shape.add_argument("--replicas", type=int, metavar="R", help="R: units per path per round")
    shape.add_argument("--inner-steps", type=int, metavar="H", help="H: inner steps per round")
    shape.add_argument(
        "--rounds", type=int, metavar="T", help=f"T: outer rounds (default {DEFAULT_ROUNDS})"
    )
    shape.add_argument("--model-size", choices=sorted(MODEL_SIZES), help="path size (default tiny)")
    shape.add_argument(
        "--codec",
        choices=CODECS,
        help="pseudo-gradient encoding (default fp16)",
    )
    shape.add_argument("--inner-lr", type=float, metavar="LR", help="peak AdamW lr")
    shape.add_argument("--outer-lr", type=float, metavar="LR", help="outer Nesterov lr (0.7)")
    shape.add_argument("--outer-momentum", type=float, metavar="MU", help="outer momentum (0.9)")
    shape.add_argument(
        "--no-sqrt-rescale",
        action="store_true",
        help="do not rescale a module's Δ by √(paths through it)",
    )
    shape.add_argument(
        "--overlap",
        choices=["none", "delayed", "eager"],
        help="outer.overlap: delayed = one-step-delayed outer updates (no idle time); "
        "eager = delayed with the eager correction at outer.eager_at of each unit",
    )
    shape.add_argument(
        "--router",
        choices=ROUTERS,
        help="what routes each document: base-lm, the base model's mean last hidden state "
        "over its first tokens (the paper's recipe; the default without --config), or tfidf, "
        "hashed n-grams (no base model needed)",
    )
    shape.add_argument(
        "--router-method",
        choices=["kmeans", "product-kmeans"],
        help="the clustering over those features: one k-means over all paths (default), or "
        "one factor per level",
    )
    shape.add_argument(
        "--base-steps",
        type=int,
        metavar="N",
        help="first train one dense base model N steps (phase 1); every module and baseline "
        f"starts from it (default {DEFAULT_BASE_STEPS} with the base-lm router, else 0: "
        "start from random weights)",
    )
    shape.add_argument("--seed", type=int, help="seed of initialisation and data order (0)")


def _add_data_arguments(data: argparse._ArgumentGroup) -> None:
    data.add_argument("--corpus", help='"stdlib" (default), a directory of text, or a .jsonl')
    data.add_argument(
        "--max-docs",
        type=int,
        default=2000,
        metavar="N",
        help="documents sampled from the corpus (default %(default)s; 0: all)",
    )
    data.add_argument("--max-chars", type=int, metavar="N", help="characters sampled at most")
    data.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help=f"documents held out for validation (default {DEFAULT_VAL_FRACTION})",
    )
    data.add_argument(
        "--eval-windows",
        type=int,
        metavar="N",
        help="windows in the seeded validation sample every model is scored on (default: "
        "the platform's, 1024 or the config's eval.batches x eval.batch_size if more)",
    )
    data.add_argument(
        "--work-dir",
        type=Path,
        metavar="DIR",
        help="where prepared data is cached (default ~/.cache/dipaco/simulate)",
    )


def _add_output_arguments(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--out", type=Path, metavar="FILE", help="write the results as JSON")
    out.add_argument(
        "--baselines",
        type=_baselines,
        default=("data-parallel", "dense"),
        metavar="LIST",
        help="comma-separated baselines to run (default: data-parallel,dense); dense-steps "
        "is the dense model at equal sequential steps (equal wall-clock) instead of tokens",
    )
    out.add_argument("--no-baselines", action="store_true", help="skip both baselines")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: all cores); on a busy machine 1 is faster",
    )
    out.add_argument("--device", default="cpu", help="torch device (default %(default)s)")


def build_config(args: argparse.Namespace) -> Any:
    """The RunConfig the flags describe (raises pydantic's ValidationError on a bad one)."""
    # pydantic's schemas: when the command runs, not when `dipaco --help` lists it
    from dipaco.config import LayoutConfig, RunConfig

    if args.diloco and args.paths is not None:
        raise ValueError("--diloco is --paths 1x1: give one of them")
    if args.config is not None:
        base = json.loads(args.config.read_text("utf-8"))
    else:
        base = RunConfig.tiny(
            name="simulate",
            rounds=DEFAULT_ROUNDS,
            data={"val_fraction": DEFAULT_VAL_FRACTION},
            router={"featurizer": "base-lm"},  # the paper's recipe
        ).model_dump(mode="json")
    if args.model_size == "150m":
        base["model"] = RunConfig.paper_150m().model.model_dump(mode="json")
    elif args.model_size is not None:
        base["model"] = {
            **RunConfig.tiny().model.model_dump(mode="json"),
            **MODEL_SIZES[args.model_size],
        }
    layers = int(base["model"]["num_layers"])
    if args.diloco:
        base["layout"] = LayoutConfig.diloco(layers).model_dump(mode="json")
    elif args.paths is not None:
        levels, modules = args.paths
        base["layout"] = LayoutConfig.grid(layers, levels, modules).model_dump(mode="json")
    elif args.model_size is not None and args.config is None:
        base["layout"] = LayoutConfig.grid(layers, 2, 2).model_dump(mode="json")
    replicas = args.replicas if args.replicas is not None else (
        DILOCO_REPLICAS if args.diloco else None)  # fmt: skip
    top = {"rounds": args.rounds, "replicas_per_path": replicas, "seed": args.seed}
    base.update({k: v for k, v in top.items() if v is not None})
    sections = {
        "inner": {"steps": args.inner_steps, "lr": args.inner_lr},
        "outer": {"lr": args.outer_lr, "momentum": args.outer_momentum,
                  "sqrt_paths_rescale": False if args.no_sqrt_rescale else None,
                  "overlap": args.overlap},
        "comm": {"codec": args.codec},
        "data": {"corpus": args.corpus, "val_fraction": args.val_fraction},
        "router": {"featurizer": args.router, "method": args.router_method},
    }  # fmt: skip
    for section, values in sections.items():
        given = {k: v for k, v in values.items() if v is not None}
        base[section] = {**base.get(section, {}), **given}
    return RunConfig.model_validate(base)


def base_steps(args: argparse.Namespace, config: Any) -> int:
    """--base-steps, else phase 1's default when the base model routes (0 with tf-idf)."""
    if args.base_steps is not None:
        return int(args.base_steps)
    routes = config.router.featurizer == "base-lm" and config.num_paths > 1
    return DEFAULT_BASE_STEPS if routes else 0


def run(args: argparse.Namespace) -> int:
    # torch and the simulator (seconds): when the command runs, not for `dipaco --help`
    import torch
    from pydantic import ValidationError
    from rich.console import Console

    from dipaco.config import config_problems
    from dipaco.simulate import DataBudget, SimulateOptions, render, simulate

    err = Console(stderr=True)
    try:
        config = build_config(args)
    except ValidationError as error:
        for problem in config_problems(error):
            err.print(f"[red]config:[/] {problem.field} = {problem.value!r}: {problem.rule}")
        return 2
    except (ValueError, OSError) as error:
        err.print(f"[red]error:[/] {error}")
        return 2
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    options = SimulateOptions(
        budget=DataBudget(max_docs=args.max_docs or None, max_chars=args.max_chars),
        work_dir=args.work_dir,
        eval_windows=args.eval_windows,
        base_steps=base_steps(args, config),
        baselines=() if args.no_baselines else args.baselines,
        progress=not args.no_progress,
        device=args.device,
    )
    try:
        result = simulate(config, options, console=err)
    except (ValueError, FileNotFoundError) as error:
        err.print(f"[red]error:[/] {error}")
        return 1
    # Piped output gets a fixed width that fits the tables, not rich's default 80.
    render(result, Console(width=None if sys.stdout.isatty() else 110))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.to_json(), indent=2) + "\n", "utf-8")
        err.print(f"wrote {args.out}")
    return 0


COMMAND = Command(
    "simulate",
    "train DiPaCo/DiLoCo in one process and compare with baselines",
    DESCRIPTION,
    add_arguments,
    run,
    epilog=EPILOG,
)
register = COMMAND.register
# python -m dipaco.cli.simulate ...: without the `dipaco` dispatcher
main = COMMAND.main


if __name__ == "__main__":
    sys.exit(main())
