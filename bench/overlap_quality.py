"""The quality cost of overlapping the outer step with the next round (outer.overlap).

    .venv/bin/python bench/overlap_quality.py                  # DiPaCo 2x2, T=8, H=25 (~6 min)
    .venv/bin/python bench/overlap_quality.py --diloco --seed 1 --json /tmp/overlap.json

Two `dipaco simulate` runs (dipaco.simulate.train.train_dipaco) with the same seed, config,
dense base model (--base-steps) and data, which differ only in ``outer.overlap``:
"none" (round t + 1 trains from round t's published versions) and "delayed" (one-step
delayed: round t + 1 trains from the versions before round t's step, and its Δs are applied
onto round t's versions, as the platform does so that workers never wait for an outer step).
Prints the routed validation loss after each round and the ratio of the final losses,
delayed / none (1.0: no cost; higher is worse). Figures and the command: docs/benchmarks.md,
"Overlapped outer steps".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import outer_sweep
import torch

from dipaco.config import RunConfig
from dipaco.simulate import DataBudget
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.train import train_dipaco

MODES = ("none", "delayed")


def config(
    args: argparse.Namespace, overlap: str, outer: dict[str, Any] | None = None
) -> RunConfig:
    """The outer-step sweep's preset (bench/outer_sweep.py), with `overlap` (and `outer`)."""
    return outer_sweep.config(args, {"overlap": overlap, **(outer or {})}, name="overlap")


def setting(text: str) -> tuple[float, float]:
    try:
        lr, momentum = text.split(",")
        return float(lr), float(momentum)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: write LR,MU, e.g. 0.5,0.0") from error


Job = tuple[str, str, int, str, float | None]


def run(job: Job) -> tuple[str, list[float], float]:
    """(label, routed validation loss before training and after each round, seconds)."""
    overlap, config_json, base_steps, work_dir, eager_at = job
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = RunConfig.model_validate_json(config_json)
    data, base = prepare_with_base(cfg, DataBudget(), Path(work_dir), base_steps)
    windows = data.val_windows(cfg.model.seq_len, 256)
    result = train_dipaco(cfg, data, windows, base_state=base, eager_at=eager_at)
    return overlap, [r.routed_loss for r in result.rounds], time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    outer_sweep.add_preset_arguments(parser)
    parser.add_argument(
        "--delayed-outer",
        type=setting,
        action="append",
        default=[],
        metavar="LR,MU",
        help="also run delayed with this outer lr and momentum (the none run keeps defaults)",
    )
    parser.add_argument(
        "--eager-at",
        type=float,
        action="append",
        default=[],
        metavar="F",
        help="also run delayed with the eager correction (simulator only): the new version "
        "lands after this fraction of each unit's steps, which adds it and rebases",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    reference = config(args, "none")
    prepare_with_base(reference, DataBudget(), args.work_dir, args.base_steps)  # once, here
    jobs: list[Job] = [
        (mode, config(args, mode).model_dump_json(), args.base_steps, str(args.work_dir), None)
        for mode in MODES
    ]
    for lr, momentum in args.delayed_outer:
        tuned = config(args, "delayed", {"lr": lr, "momentum": momentum})
        label = f"delayed lr {lr} momentum {momentum}"
        jobs.append((label, tuned.model_dump_json(), args.base_steps, str(args.work_dir), None))
    for eager_at in args.eager_at:
        label = f"delayed, eager at {eager_at:g} of a unit"
        delayed = config(args, "delayed").model_dump_json()
        jobs.append((label, delayed, args.base_steps, str(args.work_dir), eager_at))
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        curves = {mode: (curve, seconds) for mode, curve, seconds in pool.map(run, jobs)}
    print(f"{'overlap':32s} " + " ".join(f"{f'r{t}':>6s}" for t in range(args.rounds + 1)))
    for mode, (curve, _) in curves.items():
        print(f"{mode:32s} " + " ".join(f"{loss:6.3f}" for loss in curve))
    final = curves["none"][0][-1]
    ratio = curves["delayed"][0][-1] / final
    print(f"final validation loss, delayed / none: {ratio:.4f}")
    tuned_ratios = {mode: c[-1] / final for mode, (c, _) in curves.items() if mode not in MODES}
    for mode, value in tuned_ratios.items():
        print(f"final validation loss, {mode} / none: {value:.4f}")
    figures: dict[str, Any] = {
        "delayed_vs_none": ratio,
        "delayed_outer_vs_none": tuned_ratios,
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "setup": "DiLoCo R=4" if args.diloco else "DiPaCo 2x2",
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "batch": args.batch,
        "base_steps": args.base_steps,
        "seed": args.seed,
        "curves": {mode: curve for mode, (curve, _) in curves.items()},
        "seconds": time.perf_counter() - started,
        "load": list(os.getloadavg()),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
