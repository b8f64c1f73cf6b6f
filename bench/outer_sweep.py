"""The sweep behind OuterConfig's defaults: one DiPaCo (or DiLoCo) run per outer setting.

    .venv/bin/python bench/outer_sweep.py                     # DiPaCo 2x2, T=8, H=25 (~15 min)
    .venv/bin/python bench/outer_sweep.py --diloco --batch 8 --inner-steps 16
    .venv/bin/python bench/outer_sweep.py --setting 1.0,0.7,0,0 --setting 0.7,0.9,1,0

Each --setting is LR,MOMENTUM,RESCALE(0/1),WARMUP_ROUNDS. Every run starts from the same
dense base model (--base-steps) and trains through dipaco.simulate.train.train_dipaco with
warm inner AdamW state; the dense model at equal sequential steps is printed as the
reference. Prints the routed validation loss after round 1 (where an overshooting outer
step shows) and after the last round, per setting; lower is better. Figures and the
command: docs/benchmarks.md, "Outer-step defaults".
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from dipaco.config import LayoutConfig, RunConfig
from dipaco.simulate import DataBudget
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.baselines import train_baseline
from dipaco.simulate.train import train_dipaco

# The sweep recorded in docs/benchmarks.md (lr, momentum, √ rescale, warm-up rounds).
DEFAULT_SETTINGS = [
    (0.7, 0.9, True, 0), (0.7, 0.9, False, 0), (0.7, 0.9, False, 2), (1.0, 0.0, False, 0),
    (0.7, 0.5, False, 0), (1.0, 0.5, True, 0), (1.0, 0.5, False, 0), (1.3, 0.5, False, 0),
    (1.0, 0.7, False, 0),
]  # fmt: skip


def setting(text: str) -> tuple[float, float, bool, int]:
    try:
        lr, momentum, rescale, warmup = text.split(",")
        return float(lr), float(momentum), bool(int(rescale)), int(warmup)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write LR,MOMENTUM,RESCALE,WARMUP, e.g. 1.0,0.7,0,0"
        ) from error


def add_preset_arguments(parser: argparse.ArgumentParser) -> None:
    """The preset's options (`config`), shared with bench/overlap_quality.py."""
    parser.add_argument("--diloco", action="store_true", help="DiLoCo R=4 instead of DiPaCo 2x2")
    parser.add_argument("--rounds", type=int, default=8, help="T (default %(default)s)")
    parser.add_argument("--inner-steps", type=int, default=25, help="H (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per inner step")
    parser.add_argument("--base-steps", type=int, default=300, help="dense base (%(default)s)")
    parser.add_argument("--corpus", default="stdlib", help="stdlib, a directory or a .jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/dipaco/simulate")


BASE_INNER_LR = 3e-3  # the base model's lr, whatever the runs' (--inner-lr)


def config(
    args: argparse.Namespace,
    outer: dict[str, Any],
    name: str = "outer-sweep",
    inner_lr: float = BASE_INNER_LR,
) -> RunConfig:
    layers = RunConfig.tiny().model.num_layers
    layout = LayoutConfig.diloco(layers) if args.diloco else LayoutConfig.grid(layers, 2, 2)
    return RunConfig.tiny(
        name=name, rounds=args.rounds, replicas_per_path=4 if args.diloco else 1,
        layout=layout, comm={"codec": "fp32"}, outer=outer, seed=args.seed,
        inner={"steps": args.inner_steps, "lr": inner_lr, "warmup_steps": 20,
               "micro_batch_size": args.batch},
        data={"val_fraction": 0.05, "corpus": args.corpus},
    )  # fmt: skip


def run(job: tuple[str, str, str | None, int, str]) -> tuple[str, float, list[float], float]:
    label, config_json, baseline, base_steps, work_dir = job
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = RunConfig.model_validate_json(config_json)
    # Every run starts from the same base, trained at BASE_INNER_LR whatever the run's lr.
    base_cfg = cfg.model_copy(update={"inner": cfg.inner.model_copy(update={"lr": BASE_INNER_LR})})
    data, base = prepare_with_base(base_cfg, DataBudget(), Path(work_dir), base_steps)
    windows = data.val_windows(cfg.model.seq_len, 256)
    if baseline is not None:
        result = train_baseline(cfg, data, windows, baseline, base_state=base)
        return label, result.loss, [], time.perf_counter() - started
    dipaco = train_dipaco(cfg, data, windows, base_state=base)
    curve = [r.routed_loss for r in dipaco.rounds]
    return label, curve[-1], curve, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--setting", type=setting, action="append", help="LR,MOMENTUM,RESCALE,WARMUP"
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the reference run (dense at equal steps / data-parallel at equal tokens)",
    )
    parser.add_argument(
        "--reference-loss",
        type=float,
        default=None,
        help="with --no-reference: the reference's loss, for the perplexity ratios",
    )
    parser.add_argument(
        "--inner-lr",
        type=float,
        default=BASE_INNER_LR,
        help="the runs' peak inner AdamW lr (default %(default)s); the base and the "
        "reference keep the default",
    )
    add_preset_arguments(parser)
    args = parser.parse_args(argv)
    settings = args.setting or DEFAULT_SETTINGS
    torch.set_num_threads(1)
    reference = config(args, {})
    prepare_with_base(reference, DataBudget(), args.work_dir, args.base_steps)  # once, here
    jobs = [("dense, equal steps", reference.model_dump_json(), "dense-steps", args.base_steps,
             str(args.work_dir))]  # fmt: skip
    if args.diloco:
        jobs[0] = ("data-parallel, equal tokens", *jobs[0][1:2], "data-parallel", *jobs[0][3:])
    if args.no_reference:
        jobs = []
    for lr, momentum, rescale, warmup in settings:
        outer = {"lr": lr, "momentum": momentum, "sqrt_paths_rescale": rescale,
                 "warmup_rounds": warmup}  # fmt: skip
        label = f"lr {lr} momentum {momentum} rescale {int(rescale)} warm-up {warmup}"
        if args.inner_lr != BASE_INNER_LR:
            label += f" inner lr {args.inner_lr:g}"
        jobs.append((label, config(args, outer, inner_lr=args.inner_lr).model_dump_json(), None,
                     args.base_steps,
                     str(args.work_dir)))  # fmt: skip
    reference_loss = args.reference_loss
    print(f"{'setting':45s} {'round 1':>8s} {'final':>8s} {'ppl ratio':>9s} {'seconds':>8s}")
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for label, loss, curve, seconds in pool.map(run, jobs):
            if not curve and reference_loss is None:
                reference_loss = loss  # the reference comes first
            first = f"{curve[1]:.3f}" if len(curve) > 1 else "-"
            ratio = f"{math.exp(loss - reference_loss):.3f}" if reference_loss else "-"
            print(f"{label:45s} {first:>8s} {loss:8.3f} {ratio:>9s} {seconds:8.0f}", flush=True)
            if curve:
                print("    by round: " + " ".join(f"{x:.3f}" for x in curve), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
