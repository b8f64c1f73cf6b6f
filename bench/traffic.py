"""Traffic against data-parallel, and what int8 in both directions costs in quality.

    .venv/bin/python bench/traffic.py --json docs/figures/traffic.json

Two measurements, both through `dipaco.simulate` (the code behind `dipaco simulate`):

- **bytes at H = 500** (`--bytes-steps`): the quality benchmark's DiPaCo config (tiny
  model, 2 levels x 2 modules, one replica per path) with the int8 codec up *and* down
  (``comm.codec`` and ``comm.download_codec``), zstd-compressed (``comm.compression``) at
  ``comm.block_size``'s default, for ``--bytes-rounds`` rounds. The bytes counted are those
  on the wire: the compressed frames' sizes. Each unit
  downloads its path's modules in fp32 once (a new worker), then only the encoded outer
  updates; it uploads its encoded Δs. `less_than_dp` is data-parallel's bytes over
  DiPaCo's, per round once workers hold a version (the steady state: the rounds after the
  first); `less_than_dp_whole_run` counts the first round's fp32 downloads too.
  Data-parallel is dipaco.simulate.baselines.data_parallel_bytes: what each worker
  *sends* in a ring all-reduce of fp32 gradients, 2 x params x 4 bytes a step; a worker
  receives as much again, which `less_than_dp_both_directions` counts (DiPaCo's own count
  is downloads + uploads, i.e. both directions).
- **quality** (`int8_vs_fp32`): the quality benchmark's DiPaCo run (bench/quality.py
  defaults: 8 rounds of H = 25 from the same 300-step base model, same seed) with int8 in
  both directions, over the same run in fp32 both ways: the ratio of routed validation
  perplexities (goal <= 1.01).
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

import torch

from dipaco.config import LayoutConfig, RunConfig
from dipaco.simulate import DataBudget, SimulateOptions, simulate
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.baselines import data_parallel_bytes


def dipaco_config(args: argparse.Namespace, codec: str, rounds: int, steps: int) -> RunConfig:
    """bench/quality.py's DiPaCo config, with `codec` for Δs and for published updates."""
    layers = RunConfig.tiny().model.num_layers
    return RunConfig.tiny(
        name=f"traffic-{codec}-h{steps}",
        rounds=rounds,
        replicas_per_path=1,
        layout=LayoutConfig.grid(layers, 2, 2),
        comm={
            "codec": codec,
            "download_codec": codec,
            "compression": "zstd",
            **({"block_size": args.block_size} if args.block_size else {}),
        },
        inner={"lr": 3e-3, "warmup_steps": 20, "steps": steps},
        router={"featurizer": "base-lm"},
        data={"val_fraction": 0.05, "corpus": args.corpus},
        seed=args.seed,
    )


def run_job(job: tuple[str, str, str, int, int]) -> dict[str, Any]:
    name, config_json, work_dir, eval_windows, base_steps = job
    torch.set_num_threads(1)
    config = RunConfig.model_validate_json(config_json)
    started = time.perf_counter()
    options = SimulateOptions(
        budget=DataBudget(), work_dir=Path(work_dir), eval_windows=eval_windows,
        baselines=(), base_steps=base_steps,
    )  # fmt: skip
    result = simulate(config, options)
    rounds = [
        {"round": r.round, "upload_bytes": r.upload_bytes, "download_bytes": r.download_bytes}
        for r in result.run.rounds[1:]
    ]
    return {
        "name": name,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "inner_steps": config.inner.steps,
        "rounds": rounds,
        "bytes": result.bytes_total,
        "data_parallel_bytes": result.data_parallel_bytes,
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--corpus", default="stdlib")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bytes-steps", type=int, default=500, help="H of the bytes run")
    parser.add_argument("--bytes-rounds", type=int, default=2, help="rounds of the bytes run")
    parser.add_argument("--rounds", type=int, default=8, help="quality runs' T (as quality.py)")
    parser.add_argument("--inner-steps", type=int, default=25, help="quality runs' H")
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument(
        "--block-size", type=int, default=None, help="comm.block_size (default: the config's)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/dipaco/simulate")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    configs = {
        "bytes/int8": dipaco_config(args, "int8", args.bytes_rounds, args.bytes_steps),
        "quality/fp32": dipaco_config(args, "fp32", args.rounds, args.inner_steps),
        "quality/int8": dipaco_config(args, "int8", args.rounds, args.inner_steps),
    }
    for config in configs.values():  # the data and base model once, before the jobs
        prepare_with_base(config, DataBudget(), args.work_dir, args.base_steps)
    jobs = [
        (name, c.model_dump_json(), str(args.work_dir), args.eval_windows, args.base_steps)
        for name, c in configs.items()
    ]
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        results = {r["name"]: r for r in pool.map(run_job, jobs)}
    heavy = results["bytes/int8"]
    dp_round = data_parallel_bytes(configs["bytes/int8"]) / args.bytes_rounds
    later = heavy["rounds"][1:]  # workers hold the previous version: updates only
    steady = sum(r["upload_bytes"] + r["download_bytes"] for r in later) / len(later)
    figures: dict[str, Any] = {
        "inner_steps": args.bytes_steps,
        "less_than_dp": dp_round / steady,
        "int8_vs_fp32": results["quality/int8"]["perplexity"]
        / results["quality/fp32"]["perplexity"],
        "less_than_dp_whole_run": heavy["data_parallel_bytes"] / heavy["bytes"],
        "less_than_dp_both_directions": 2 * dp_round / steady,
        "comm": configs["bytes/int8"].comm.model_dump(mode="json"),
        "goals": {"less_than_dp": ">= 2000", "int8_vs_fp32": "<= 1.01"},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "jobs": results,
        "wall_seconds": time.perf_counter() - started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__},
    }  # fmt: skip
    print(
        f"H = {args.bytes_steps}, int8 both ways: {figures['less_than_dp']:,.0f}x less than "
        f"data-parallel per round (its sends only; "
        f"{figures['less_than_dp_both_directions']:,.0f}x counting what it receives too), "
        f"{figures['less_than_dp_whole_run']:,.0f}x over {args.bytes_rounds} rounds with the "
        f"first round's fp32 downloads; quality int8/fp32 both ways: "
        f"{figures['int8_vs_fp32']:.4f} (perplexity {results['quality/int8']['perplexity']:.2f}"
        f" vs {results['quality/fp32']['perplexity']:.2f}); {figures['wall_seconds']:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
