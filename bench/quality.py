"""Quality of DiLoCo, DiPaCo and pseudo-gradient codecs against their baselines (issue 4).

    .venv/bin/python bench/quality.py                   # the full run, ~13 min on 2 cores
    .venv/bin/python bench/quality.py --quick           # a smoke run, ~1.5 min
    .venv/bin/python bench/quality.py --json quality.json

(a) DiLoCo, R=4 replicas, H=50, vs synchronous data-parallel at equal tokens: perplexity
    ratio (issue 4's goal: <= 1.02);
(b) DiPaCo 2x2 (4 paths) vs the dense path-size model at equal total tokens, evaluated with
    routing: perplexity ratio (goal < 1.00);
(c) the run of (b) with int8 and with int4 pseudo-gradients vs fp32, at equal steps
    (goal <= 1.01).

Everything runs on the stdlib corpus with RunConfig.tiny()'s 2.84M-parameter paths through
`dipaco.simulate`, the code behind `dipaco simulate`, and starts from one dense base model
(--base-steps) whose tokens are not counted. Each method and each baseline is one
job; jobs run in --jobs processes of --threads torch threads each (on 2 cores, two
one-thread processes finish ~1.7x sooner than one two-thread process). The script prints
ratios and the goals beside them, not verdicts. Figures and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from dipaco.config import LayoutConfig, RunConfig
from dipaco.simulate import DataBudget, SimulateOptions, prepare_data, simulate
from dipaco.simulate.base import train_base
from dipaco.simulate.baselines import data_parallel_bytes, train_baseline
from dipaco.simulate.evaluate import val_windows

GOALS = {"a": 1.02, "b": 1.00, "c-int8": 1.01, "c-int4": 1.01}
GOAL_TEXT = {"a": "<= 1.02", "b": "< 1.00", "c-int8": "<= 1.01", "c-int4": "<= 1.01"}


@dataclass(frozen=True)
class Job:
    name: str  # "a/diloco", "a/data-parallel", "b/dipaco-fp32", ...
    config_json: str  # the RunConfig, as JSON (jobs cross process boundaries)
    baseline: str | None  # None: the simulated method itself
    budget: DataBudget
    work_dir: str
    eval_windows: int
    threads: int
    base_steps: int


def run_job(job: Job) -> dict[str, Any]:
    """One method or one baseline, in its own process."""
    torch.set_num_threads(job.threads)
    config = RunConfig.model_validate_json(job.config_json)
    started = time.perf_counter()
    if job.baseline is None:
        options = SimulateOptions(
            budget=job.budget, work_dir=Path(job.work_dir), eval_windows=job.eval_windows,
            baselines=(), base_steps=job.base_steps,
        )  # fmt: skip
        result = simulate(config, options)
        return {
            "name": job.name,
            "base_steps": result.base_steps,
            "loss": result.loss,
            "perplexity": result.perplexity,
            "curve": [r.routed_loss for r in result.run.rounds],
            "tokens": result.run.tokens,
            "bytes": result.bytes_total,
            "upload_bytes": result.run.upload_bytes,
            "data_parallel_bytes": result.data_parallel_bytes,
            "seconds": time.perf_counter() - started,
        }
    data = prepare_data(config, job.budget, Path(job.work_dir))
    windows = val_windows(data, config.model.seq_len, job.eval_windows)
    base = train_base(config, data, job.base_steps) if job.base_steps else None
    run = train_baseline(config, data, windows, job.baseline, base_state=base)
    return {
        "name": job.name,
        "base_steps": job.base_steps if base is not None else 0,
        "loss": run.loss,
        "perplexity": math.exp(run.loss),
        "tokens": run.tokens,
        "steps": run.steps,
        "batch_size": run.batch_size,
        "bytes": data_parallel_bytes(config) if job.baseline == "data-parallel" else 0,
        "seconds": time.perf_counter() - started,
    }


def configs(args: argparse.Namespace) -> dict[str, RunConfig]:
    """The three experiments' run configs (c reuses b's, with another codec)."""
    common: dict[str, Any] = {
        "inner": {"steps": args.inner_steps, "lr": args.inner_lr,
                  "warmup_steps": args.warmup_steps},
        "outer": {"lr": args.outer_lr, "momentum": args.outer_momentum},
        "data": {"val_fraction": args.val_fraction},
        "seed": args.seed,
    }  # fmt: skip
    layers = RunConfig.tiny().model.num_layers
    diloco = RunConfig.tiny(
        name="quality-a", rounds=args.rounds_a, replicas_per_path=4,
        layout=LayoutConfig.diloco(layers), comm={"codec": "fp32"}, **common,
    )  # fmt: skip
    dipaco = {
        codec: RunConfig.tiny(
            name=f"quality-{codec}",
            rounds=args.rounds_b,
            replicas_per_path=1,
            layout=LayoutConfig.grid(layers, 2, 2),
            comm={"codec": codec},
            **common,
        )
        for codec in ("fp32", "int8", "int4")
    }
    return {"a": diloco, **{f"b-{codec}": cfg for codec, cfg in dipaco.items()}}


def make_jobs(args: argparse.Namespace, cfgs: dict[str, RunConfig]) -> list[Job]:
    budget = DataBudget(max_docs=args.max_docs or None)

    def job(name: str, key: str, baseline: str | None) -> Job:
        return Job(name, cfgs[key].model_dump_json(), baseline, budget, str(args.work_dir),
                   args.eval_windows, args.threads, args.base_steps)  # fmt: skip

    # Longest first, so two processes finish together.
    return [
        job("a/diloco", "a", None),
        job("a/data-parallel", "a", "data-parallel"),
        job("b/dipaco-fp32", "b-fp32", None),
        job("b/dense", "b-fp32", "dense"),
        job("c/dipaco-int8", "b-int8", None),
        job("c/dipaco-int4", "b-int4", None),
        job("b/data-parallel", "b-fp32", "data-parallel"),
    ]


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pairs = {
        "a": ("a/diloco", "a/data-parallel"),
        "b": ("b/dipaco-fp32", "b/dense"),
        "b-dp": ("b/dipaco-fp32", "b/data-parallel"),
        "c-int8": ("c/dipaco-int8", "b/dipaco-fp32"),
        "c-int4": ("c/dipaco-int4", "b/dipaco-fp32"),
    }
    summary = {}
    for key, (ours, reference) in pairs.items():
        summary[key] = {
            "ours": ours,
            "reference": reference,
            "perplexity": results[ours]["perplexity"],
            "reference_perplexity": results[reference]["perplexity"],
            "ratio": results[ours]["perplexity"] / results[reference]["perplexity"],
            "goal": GOALS.get(key),
        }
    a, b = results["a/diloco"], results["b/dipaco-fp32"]
    summary["a"]["bytes_ratio_vs_data_parallel"] = a["bytes"] / a["data_parallel_bytes"]
    summary["b"]["bytes_ratio_vs_data_parallel"] = b["bytes"] / b["data_parallel_bytes"]
    summary["b-dp"]["bytes_ratio_vs_data_parallel"] = b["bytes"] / b["data_parallel_bytes"]
    for key in ("c-int8", "c-int4"):
        ours = results[summary[key]["ours"]]
        summary[key]["upload_ratio_vs_fp32"] = ours["upload_bytes"] / b["upload_bytes"]
    return summary


def print_tables(
    summary: dict[str, dict[str, Any]], results: dict[str, Any], console: Console
) -> None:
    labels = {
        "a": "(a) DiLoCo R=4 / data-parallel",
        "b": "(b) DiPaCo 2x2 / dense",
        "b-dp": "    DiPaCo 2x2 / data-parallel",
        "c-int8": "(c) DiPaCo int8 / fp32",
        "c-int4": "(c) DiPaCo int4 / fp32",
    }
    table = Table(
        title="Validation perplexity ratios (below 1: ours is better)",
        caption="(a), (b): equal training tokens; (c): equal steps; DiPaCo evaluated with routing",
    )
    for column in ("experiment", "ours", "reference", "ratio", "goal", "bytes"):
        table.add_column(column, justify="right")
    for key, row in summary.items():
        if "bytes_ratio_vs_data_parallel" in row:
            sent = f"{row['bytes_ratio_vs_data_parallel']:.4f} x DP"
        else:
            sent = f"{row['upload_ratio_vs_fp32']:.3f} x fp32 upload"
        table.add_row(
            labels[key], f"{row['perplexity']:.2f}", f"{row['reference_perplexity']:.2f}",
            f"{row['ratio']:.4f}", GOAL_TEXT.get(key, "-"), sent,
        )  # fmt: skip
    console.print(table)
    for name in ("a/diloco", "b/dipaco-fp32", "c/dipaco-int8", "c/dipaco-int4"):
        curve = " ".join(f"{loss:.3f}" for loss in results[name]["curve"])
        console.print(f"{name} routed val loss by round: {curve}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds and steps")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--rounds-a", type=int, default=4, help="T of (a) (default %(default)s)")
    parser.add_argument(
        "--rounds-b", type=int, default=4, help="T of (b), (c) (default %(default)s)"
    )
    parser.add_argument("--inner-steps", type=int, default=50, help="H (default %(default)s)")
    parser.add_argument("--inner-lr", type=float, default=3e-3, help="peak AdamW lr (%(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="inner warm-up (%(default)s)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer lr (%(default)s)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer μ (%(default)s)")
    parser.add_argument("--max-docs", type=int, default=0, help="corpus sample, 0: all of stdlib")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held out (%(default)s)")
    parser.add_argument("--eval-windows", type=int, default=256, help="val windows of 129 tokens")
    parser.add_argument(
        "--base-steps", type=int, default=300, help="dense warm-up before all (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes (default: %(default)s)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/dipaco/simulate")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds_a, args.rounds_b, args.inner_steps = 2, 2, 10
        args.max_docs, args.eval_windows, args.warmup_steps = 300, 64, 5
        args.base_steps = 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The base model trains here: more threads than cores-per-job spin against the jobs.
    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 110)
    started, load_before = time.perf_counter(), os.getloadavg()
    cfgs = configs(args)
    # Prepare (or reuse) both data layouts here, so the jobs never race to build them.
    budget = DataBudget(max_docs=args.max_docs or None)
    for key in ("a", "b-fp32"):
        data = prepare_data(cfgs[key], budget, args.work_dir, log=console.log)
        if args.base_steps:  # one base for both: it is keyed by the stream of all documents
            console.log(f"base model: {args.base_steps} steps (cached in {args.work_dir})")
            train_base(cfgs[key], data, args.base_steps)
    jobs = make_jobs(args, cfgs)
    results: dict[str, dict[str, Any]] = {}
    # spawn, not fork: a forked child of a process that ran torch's thread pool can hang.
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for result in pool.map(run_job, jobs):
            results[result["name"]] = result
            console.log(f"{result['name']}: loss {result['loss']:.4f} in {result['seconds']:.0f} s")
    starts = {name: r["base_steps"] for name, r in results.items()}
    if len(set(starts.values())) != 1:  # every comparison must share its starting point
        raise RuntimeError(f"jobs started from different base models: {starts}")
    summary = summarize(results)
    print_tables(summary, results, console)
    wall = time.perf_counter() - started
    console.print(
        f"wall time {wall / 60:.1f} min with {args.jobs} x {args.threads} threads; "
        f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    )
    if args.json is not None:
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "summary": summary,
            "jobs": results,
            "configs": {k: c.model_dump(mode="json") for k, c in cfgs.items()},
            "wall_seconds": wall,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__},
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
