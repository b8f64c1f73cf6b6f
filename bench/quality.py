"""Quality of DiPaCo, DiLoCo and pseudo-gradient codecs against the papers' baselines.

    .venv/bin/python bench/quality.py --json docs/figures/quality_tiny.json  # the full run
    .venv/bin/python bench/quality.py --quick                               # a smoke run
    .venv/bin/python bench/quality.py --corpus ~/texts                      # a directory, a .jsonl
    .venv/bin/python bench/corpus_docs.py --out /tmp/docs.jsonl             # prose, local files
    .venv/bin/python bench/quality.py --preset modular --corpus stdlib=stdlib \
        --corpus docs=/tmp/docs.jsonl --json /tmp/quality_modular.json     # two corpora

Every figure is a validation-perplexity ratio, ours / reference (below 1: ours is better),
keyed in --json as:
  dipaco_vs_dense_equal_steps   DiPaCo (routed; the preset's grid unless --grid) vs the
                                dense path-size model trained the same number of
                                sequential steps as each path: equal wall-clock, the
                                DiPaCo paper's setting;
  dipaco_vs_dense_equal_tokens  the same vs the dense model trained on all of DiPaCo's tokens
                                (a harder comparison than the paper's, reported without a goal
                                on the tiny preset);
  dipaco_vs_diloco_equal_tokens the same vs DiLoCo with P replicas of one path-size model, at
                                DiPaCo's H, rounds, batch, codec and outer optimiser, from the
                                same base: equal tokens, compute and communication (the DiPaCo
                                paper's 8x8 figure: 13.37 / 14.96 = 0.894);
  dipaco_vs_dense_total_equal_steps  the same vs one dense model with as many parameters as
                                all of DiPaCo's modules together (more blocks, the path's
                                width), trained as many sequential steps as each path, at the
                                same lr, warm-up and batch, from a base of its own size;
  reroute_vs_route_once         the same DiPaCo scored re-routing every --reroute-every tokens
                                from the text so far vs routing each document once
                                (bench/specialise.py; the paper re-routes every 64 tokens);
  path_specific_vs_dense_equal_steps  the paper's path-specific variant (every path owns its
                                embedding, final norm and head) vs dense-steps, and
  path_specific_vs_shared       that variant vs the shared-embedding DiPaCo;
  diloco_vs_dp                  DiLoCo, R = 4 replicas, vs synchronous data-parallel at equal
                                tokens, at a larger inner batch (--diloco-batch) and a
                                shorter H, where averaging replicas is not dominated by
                                a batch far below the critical batch size;
  int8_vs_fp32, int4_vs_fp32    DiPaCo with int8 / int4 pseudo-gradients (with error
                                feedback) vs fp32, at equal steps: the mean of the ratios
                                over --codec-seeds seeds (--seed, --seed + 1, ...; each its
                                own split, base model and data order), since one seed's
                                rounding moves a ratio by about +-1% (each seed's ratio is
                                in the JSON's summary);
  platform_vs_simulate          a short real platform run (server, Celery, two dipaco-worker
                                processes; bench/platform_run.py) vs `dipaco simulate` on the
                                same config, seed and data: final routed validation *loss*.

Everything runs through `dipaco.simulate` (the code behind `dipaco simulate`) with the
preset's paths (--preset: tiny's 2.84M, 1.26x a path in all; modular's 2.67M, 25 paths
holding 4.5x a path, with run sizes of its own: BENCH_DEFAULTS) and starts from one dense
base model (--base-steps at --batch, the paper's phase 1; the same base for DiLoCo, DiPaCo
and every baseline of a seed) whose tokens are not counted; every model is scored on one
seeded validation sample (--eval-windows, dipaco.evaluate.sample_plan), the platform's. How
much the paths specialise (oracle / routed, the router's agreement with the oracle,
per-domain losses) is measured on both DiPaCo variants after training (bench/specialise.py;
the JSON's "specialisation"). DiPaCo validates every --eval-every rounds and after the last.
Each method and each baseline is one job; jobs run in --jobs processes of --threads torch
threads each (on 2 cores, two one-thread processes finish ~1.7x sooner than one two-thread
process); the platform run comes last, alone (not with --preset modular). The script prints
ratios and the goals beside them, not verdicts. Figures and the command: docs/benchmarks.md.
--preset capacity, with bench/quality_gpu.sh, runs the same comparisons with
RunConfig.capacity() on one GPU; the JSON then also says each job's tokens per path
parameter, DiPaCo's capacity over a path's and which inner loop each job ran.

--corpus NAME=PATH, repeated, runs everything once per corpus in turn (each with its own
tokenizer, router and base, under --work-dir/NAME), and the JSON is {"corpora": {NAME: that
corpus's figures, keyed as a one-corpus run's}, "complete", "command", "machine", ...}. The
JSON is rewritten as each job ends ("complete": false until the last), and --time-budget
sizes the jobs from the base's measured tokens/s ("sizing" says how). (Over 500 lines: one
self-contained script a GPU machine runs from a clean checkout, with its jobs, figures and
report in one place.)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from dipaco.config import (
    LayoutConfig,
    RouterConfig,
    RunConfig,
    count_block_params,
    count_part_params,
)
from dipaco.evaluate import SAMPLE_WINDOWS
from dipaco.inner import StepMetrics
from dipaco.simulate import DataBudget, SimulateOptions, simulate
from dipaco.simulate.base import prepare_with_base, train_base
from dipaco.simulate.baselines import baseline_steps, data_parallel_bytes, train_baseline
from dipaco.simulate.prepare import prepare_data

# The goals: (low, high) bounds on each ratio.
GOALS: dict[str, tuple[float | None, float]] = {
    "dipaco_vs_dense_equal_steps": (None, 0.85),
    "dipaco_vs_diloco_equal_tokens": (None, 0.95),
    "dipaco_vs_dense_total_equal_steps": (None, 1.05),
    "reroute_vs_route_once": (None, 0.99),
    "diloco_vs_dp": (None, 1.05),
    "int8_vs_fp32": (None, 1.01),
    "int4_vs_fp32": (None, 1.01),
    "platform_vs_simulate": (0.98, 1.02),
}
# RunConfig.capacity() and .modular() exist to show DiPaCo's claim: at least as good as the dense
# path-size model on the same tokens, where tiny's shared embedding cannot; against DiLoCo,
# the paper's own 0.894.
CAPACITY_GOALS = {
    **GOALS,
    "dipaco_vs_dense_equal_tokens": (None, 1.00),
    "dipaco_vs_diloco_equal_tokens": (None, 0.90),
}
# Reported in the JSON's top level with the goals', without a goal of their own.
REPORTED = ("dipaco_vs_dense_equal_tokens", "path_specific_vs_dense_equal_steps",
            "path_specific_vs_shared")  # fmt: skip
LABELS = {
    "dipaco_vs_dense_equal_steps": "DiPaCo / dense, equal steps",
    "dipaco_vs_dense_equal_tokens": "DiPaCo / dense, equal tokens",
    "dipaco_vs_diloco_equal_tokens": "DiPaCo / DiLoCo R=P, equal tokens",
    "dipaco_vs_dense_total_equal_steps": "DiPaCo / dense of its total size, equal steps",
    "reroute_vs_route_once": "DiPaCo re-routing / routing once",
    "path_specific_vs_dense_equal_steps": "path-specific DiPaCo / dense, equal steps",
    "path_specific_vs_shared": "path-specific DiPaCo / shared embedding",
    "dipaco_vs_dp": "DiPaCo / data-parallel",
    "diloco_vs_dp": "DiLoCo R=4 / data-parallel",
    "int8_vs_fp32": "DiPaCo int8 / fp32",
    "int4_vs_fp32": "DiPaCo int4 / fp32",
    "platform_vs_simulate": "platform / simulate (loss)",
}


PRESETS = {"tiny": RunConfig.tiny, "capacity": RunConfig.capacity, "modular": RunConfig.modular}
# Each preset's run sizes, where its flags are not given. tiny's: 8 rounds of H = 25 over 4
# paths (69 min on 2 cores with 3 codec seeds, docs/figures/quality_tiny.json). modular's
# fit its 25 paths into an hour a corpus on 2 quiet cores: one codec seed, and each path's
# 48 steps (4 rounds of H = 12) make 0.61M DiPaCo tokens, 1.5x tiny's 0.41M, at tiny's cost
# a token or less (docs/benchmarks.md projects 43 min from measured tokens/s; loaded, more).
TINY_SIZES = {"rounds": 8, "inner_steps": 25, "batch": 4, "diloco_rounds": 8,
              "diloco_inner_steps": 16, "diloco_batch": 16, "codec_seeds": 3,
              "warmup_steps": 20}  # fmt: skip
BENCH_DEFAULTS: dict[str, dict[str, int]] = {
    "tiny": TINY_SIZES,
    "capacity": TINY_SIZES,  # bench/quality_gpu.sh gives its own
    "modular": {"rounds": 4, "inner_steps": 12, "batch": 4, "diloco_rounds": 4,
                "diloco_inner_steps": 16, "diloco_batch": 16, "codec_seeds": 1,
                "warmup_steps": 6},
}  # fmt: skip
CORPUS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def corpus_list(values: list[str] | None) -> list[tuple[str | None, str]]:
    """--corpus values as (name or None, path): "NAME=PATH" names one, a bare PATH does not."""
    out: list[tuple[str | None, str]] = []
    for value in values or ["stdlib"]:
        name, sep, path = value.partition("=")
        out.append((name, path) if sep and CORPUS_NAME.match(name) and path else (None, value))
    return out


@functools.cache
def corpus_sha256(path: str) -> str | None:
    """The sha256 of a corpus file, so two runs can tell whether they read the same text
    (bench/corpus_docs.py's output follows the machine's packages); None for a directory
    or "stdlib"."""
    file = Path(path)
    if not file.is_file():
        return None
    with file.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def corpus_names(corpora: list[tuple[str | None, str]]) -> list[tuple[str, str]]:
    """Every corpus named: an unnamed one by its file or folder (stdlib, docs.jsonl -> docs)."""
    named = []
    for name, path in corpora:
        stem = Path(path).name.split(".", 1)[0] or "corpus"
        named.append((name or re.sub(r"[^A-Za-z0-9_-]", "-", stem), path))
    return named


def _grid(text: str) -> tuple[int, int]:
    levels, _, modules = text.partition("x")
    if not (levels.isdigit() and modules.isdigit() and int(levels) > 0 and int(modules) > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: write LEVELSxMODULES, e.g. 2x4")
    return int(levels), int(modules)


def goal_text(key: str, goals: dict[str, tuple[float | None, float]] = GOALS) -> str:
    if key not in goals:
        return "-"
    low, high = goals[key]
    return f"<= {high}" if low is None else f"{low}-{high}"


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
    base_batch: int  # every job's base model trains at this batch: one base for the run
    device: str
    eval_every: int = 1  # DiPaCo validates every this many rounds (and after the last)
    reroute_every: int = 0  # > 0: measure specialisation and re-routing (bench/specialise.py)
    domains: bool = True  # with it, per-domain losses (reads the corpus again)
    # dense-total-steps: the DiPaCo config whose prepared data and base give the windows
    windows_config_json: str | None = None


class CompileWatch(logging.Handler):
    """Hears dipaco.inner's one warning that torch.compile failed and the loop went eager."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        self.failed = self.failed or "torch.compile failed" in record.getMessage()

    def loop(self, device: str) -> str:
        """Which inner loop the job ran: the library compiles on CUDA, never on the CPU."""
        if device == "cpu":
            return "eager"
        return "eager (torch.compile failed)" if self.failed else "compiled"


def run_job(job: Job) -> dict[str, Any]:
    """One method or one baseline, in its own process."""
    torch.set_num_threads(job.threads)
    watch = CompileWatch()
    logging.getLogger("dipaco.inner").addHandler(watch)
    result = _run_job(job)
    result["loop"] = watch.loop(job.device)
    return result


def _run_job(job: Job) -> dict[str, Any]:
    config = RunConfig.model_validate_json(job.config_json)
    started = time.perf_counter()
    if job.baseline is None:
        options = SimulateOptions(
            budget=job.budget, work_dir=Path(job.work_dir), eval_windows=job.eval_windows,
            baselines=(), base_steps=job.base_steps, device=job.device,
            base_batch=job.base_batch, eval_every=job.eval_every,
        )  # fmt: skip
        result = simulate(config, options)
        extra: dict[str, Any] = {}
        if job.reroute_every:
            analysed = time.perf_counter()
            extra["specialisation"] = specialisation(config, result, job)
            extra["specialisation"]["seconds"] = time.perf_counter() - analysed
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
            **extra,
        }
    if job.baseline == "dense-total-steps":
        return _dense_total(job, config, started)
    data, base = prepare_with_base(
        config, job.budget, Path(job.work_dir), job.base_steps, device=job.device,
        batch_size=job.base_batch,
    )  # fmt: skip
    windows = data.val_windows(config.model.seq_len, job.eval_windows, config.seed)
    run = train_baseline(config, data, windows, job.baseline, base_state=base, device=job.device)
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


def specialisation(config: RunConfig, result: Any, job: Job) -> dict[str, Any]:
    """bench/specialise.py's figures for a trained DiPaCo (oracle, agreement, re-routing,
    per domain)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # a sibling script, importable once this directory is on sys.path (above)
    import specialise

    modules = result.run.modules
    figures = specialise.window_figures(
        config, result.data, modules, result.windows, job.reroute_every, job.device
    )
    figures["by_domain"] = (
        specialise.domain_figures(config, result.data, modules, job.budget, job.device)
        if job.domains
        else {}
    )
    return figures


def _dense_total(job: Job, config: RunConfig, started: float) -> dict[str, Any]:
    """One dense model of DiPaCo's total size, trained dense-steps (as many sequential
    steps as each path) from a base of its own size, on DiPaCo's validation windows."""
    assert job.windows_config_json is not None
    dipaco = RunConfig.model_validate_json(job.windows_config_json)
    data, _ = prepare_with_base(
        dipaco, job.budget, Path(job.work_dir), job.base_steps, device=job.device,
        batch_size=job.base_batch,
    )  # fmt: skip
    windows = data.val_windows(dipaco.model.seq_len, job.eval_windows, dipaco.seed)
    # Its base: the same steps, batch and stream of every document as DiPaCo's base.
    dense = config.model_copy(
        update={"layout": LayoutConfig.diloco(config.model.num_layers), "router": RouterConfig()}
    )
    dense_data = prepare_data(dense, job.budget, Path(job.work_dir))
    base = train_base(
        dense, dense_data, job.base_steps, device=job.device, batch_size=job.base_batch
    )
    run = train_baseline(config, data, windows, "dense-steps", base_state=base, device=job.device)
    return {
        "name": job.name,
        "base_steps": job.base_steps,
        "loss": run.loss,
        "perplexity": math.exp(run.loss),
        "tokens": run.tokens,
        "steps": run.steps,
        "batch_size": run.batch_size,
        "params": config.num_params(),
        "bytes": 0,
        "seconds": time.perf_counter() - started,
    }


def total_size_layers(config: RunConfig) -> int:
    """Blocks of a dense model of the path's width with about as many parameters as all of
    `config`'s modules together."""
    total = sum(config.module_param_counts().values())
    parts = sum(count_part_params(config.model).values())
    return max(1, round((total - parts) / count_block_params(config.model)))


def outer_settings(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """The outer settings the flags give: DiPaCo's, and DiLoCo's (its own flags over them)."""
    outer = {
        **args.outer,
        **{
            k: v
            for k, v in (("lr", args.outer_lr), ("momentum", args.outer_momentum))
            if v is not None
        },
    }
    diloco_outer = {
        **outer,
        **{
            k: v
            for k, v in (("lr", args.diloco_outer_lr), ("momentum", args.diloco_outer_momentum))
            if v is not None
        },
    }
    return outer, diloco_outer


def configs(args: argparse.Namespace) -> dict[str, RunConfig]:
    """The run configs: DiLoCo (its own batch and H), DiPaCo with each codec.

    Outer settings are RunConfig's defaults unless --outer-lr / --outer-momentum are given;
    --diloco-outer-lr / --diloco-outer-momentum override them for the DiLoCo run alone.
    """
    outer, diloco_outer = outer_settings(args)
    common: dict[str, Any] = {
        "outer": outer,
        "data": {"val_fraction": args.val_fraction, "corpus": args.corpus},
        "seed": args.seed,
    }
    inner = {"lr": args.inner_lr, "warmup_steps": args.warmup_steps}
    preset = PRESETS[args.preset]
    model = {} if args.model is None else json.loads(args.model)  # e.g. a dry run's sizes
    common["model"] = model
    layers = int(model.get("num_layers", preset().model.num_layers))
    # DiPaCo's grid: --grid, else the preset's (2x2 for tiny, 2 levels x 4 for capacity).
    levels = args.grid or (len(preset().layout.levels), preset().layout.levels[0].modules)
    grid = LayoutConfig.grid(layers, *levels)
    block = {} if args.block_size is None else {"block_size": args.block_size}  # int8/int4
    # The paper's router: the base model's features of each document's first tokens.
    router = {"featurizer": "base-lm" if args.base_steps else "tfidf", **args.router}
    diloco = preset(
        name="quality-diloco", rounds=args.diloco_rounds, replicas_per_path=4,
        layout=LayoutConfig.diloco(layers), comm={"codec": "fp32"},
        inner={**inner, "steps": args.diloco_inner_steps,
               "micro_batch_size": args.diloco_batch},
        **{**common, "outer": diloco_outer},
    )  # fmt: skip
    dipaco = {
        codec: preset(
            name=f"quality-{codec}",
            rounds=args.rounds,
            replicas_per_path=1,
            layout=grid,
            comm={"codec": codec, **block},
            inner={**inner, "steps": args.inner_steps, "micro_batch_size": args.batch},
            router=router,
            **common,
        )
        for codec in ("fp32", "int8", "int4")
    }
    fp32 = dipaco["fp32"]
    # DiLoCo at DiPaCo's every setting, P replicas of one path-size model: equal tokens.
    diloco_p = fp32.model_copy(
        update={"name": "quality-diloco-p", "layout": LayoutConfig.diloco(layers),
                "replicas_per_path": fp32.num_paths, "router": RouterConfig()}
    )  # fmt: skip
    # The paper's path-specific variant: every path owns its embedding, final norm and head.
    specific = preset(
        name="quality-path-specific", rounds=args.rounds, replicas_per_path=1,
        layout=LayoutConfig.grid(layers, *levels,
                                 path_specific=("embeddings", "final_norm", "lm_head")),
        comm={"codec": "fp32"},
        inner={**inner, "steps": args.inner_steps, "micro_batch_size": args.batch},
        router=router, **common,
    )  # fmt: skip
    # A dense model of DiPaCo's total size: the path's width, more blocks.
    deep = total_size_layers(fp32)
    total = preset(
        name="quality-dense-total", rounds=args.rounds, replicas_per_path=1,
        layout=LayoutConfig.diloco(deep), comm={"codec": "fp32"},
        inner={**inner, "steps": args.inner_steps, "micro_batch_size": args.batch},
        **{**common, "model": {**model, "num_layers": deep}},
    )  # fmt: skip
    out = {
        "a": diloco, **{f"b-{codec}": cfg for codec, cfg in dipaco.items()},
        "d": RunConfig.model_validate(diloco_p.model_dump()), "e": total, "f": specific,
        # The same dense model at a third of the lr: a deeper model may want a lower one,
        # and the baseline gets the better of the two (the same care as DiPaCo, or more).
        "e-low-lr": total.model_copy(
            update={"inner": total.inner.model_copy(update={"lr": total.inner.lr / 3})}
        ),
    }  # fmt: skip
    for k in range(1, args.codec_seeds):  # the codec comparison's further seeds
        for codec, cfg in dipaco.items():
            out[f"s{k}-{codec}"] = cfg.model_copy(update={"seed": args.seed + k})
    return out


def codec_job_names(codec: str, k: int) -> tuple[str, str]:
    """(job name, config key) of DiPaCo with `codec` at the codec comparison's seed k."""
    if k == 0:
        return ("b/dipaco-fp32" if codec == "fp32" else f"c/dipaco-{codec}"), f"b-{codec}"
    return f"c{k}/dipaco-{codec}", f"s{k}-{codec}"


def make_jobs(args: argparse.Namespace, cfgs: dict[str, RunConfig]) -> list[Job]:
    budget = DataBudget(max_docs=args.max_docs or None)

    def job(name: str, key: str, baseline: str | None, analyse: bool = False) -> Job:
        return Job(
            name, cfgs[key].model_dump_json(), baseline, budget, str(args.work_dir),
            args.eval_windows, args.threads, args.base_steps, args.batch, args.device,
            eval_every=args.eval_every, reroute_every=args.reroute_every if analyse else 0,
            domains=not args.no_domains,
            windows_config_json=cfgs["b-fp32"].model_dump_json() if key.startswith("e") else None,
        )  # fmt: skip

    # The DiPaCo paper's comparisons first, so a run cut short (the JSON is rewritten after
    # every job) has them; then the longest first, so two processes finish together.
    jobs = [
        job("b/dipaco-fp32", "b-fp32", None, analyse=True),
        job("d/diloco-p", "d", None),
        job("e/dense-total-steps", "e", "dense-total-steps"),
        job("e/dense-total-steps-low-lr", "e-low-lr", "dense-total-steps"),
        job("b/dense-steps", "b-fp32", "dense-steps"),
        job("f/dipaco-path-specific", "f", None, analyse=True),
        job("b/dense", "b-fp32", "dense"),
        job("a/diloco", "a", None),
        job("a/data-parallel", "a", "data-parallel"),
        job("c/dipaco-int8", "b-int8", None),
        job("c/dipaco-int4", "b-int4", None),
        job("b/data-parallel", "b-fp32", "data-parallel"),
        *(
            job(*codec_job_names(codec, k), None)
            for k in range(1, args.codec_seeds)
            for codec in ("fp32", "int8", "int4")
        ),
    ]
    if args.only:
        unknown = set(args.only) - {j.name for j in jobs}
        if unknown:
            raise SystemExit(
                f"--only: unknown jobs {sorted(unknown)}; known: {[j.name for j in jobs]}"
            )
        jobs = [j for j in jobs if j.name in args.only]
    return jobs


# Which config each job runs (make_jobs's second column), so --only prepares only those.
JOB_CONFIG = {
    "a/diloco": "a", "a/data-parallel": "a", "b/dipaco-fp32": "b-fp32", "b/dense": "b-fp32",
    "c/dipaco-int8": "b-int8", "c/dipaco-int4": "b-int4", "b/data-parallel": "b-fp32",
    "b/dense-steps": "b-fp32", "d/diloco-p": "d", "e/dense-total-steps": "e",
    "e/dense-total-steps-low-lr": "e-low-lr",
    "f/dipaco-path-specific": "f",
    **{codec_job_names(c, k)[0]: codec_job_names(c, k)[1]
       for k in range(1, 10) for c in ("fp32", "int8", "int4")},
}  # fmt: skip


def planned_tokens(name: str, config: RunConfig) -> int:
    """The tokens job `name` will train on with `config` (make_jobs's pairing)."""
    per_step = config.inner.micro_batch_size * config.model.seq_len
    baseline = name.split("/", 1)[1].removesuffix("-low-lr")
    if baseline in ("dense", "dense-steps", "data-parallel", "dense-total-steps"):
        steps, accum = baseline_steps(config, baseline.replace("-total", ""))
        return steps * accum * per_step
    units = config.rounds * config.num_paths * config.replicas_per_path
    return units * config.inner.steps * config.inner.grad_accum_steps * per_step


class Throughput:
    """The base model's training speed, read from its steps after the first `skip` (the
    compilation and warm-up): what sizes the jobs under --time-budget."""

    def __init__(self, skip: int = 50) -> None:
        self.skip = skip
        self.first: StepMetrics | None = None
        self.last: StepMetrics | None = None

    def __call__(self, metrics: StepMetrics) -> None:
        if metrics.step == self.skip:
            self.first = metrics
        elif metrics.step > self.skip:
            self.last = metrics

    def tokens_per_s(self) -> float | None:
        if self.first is None or self.last is None or self.last.seconds <= self.first.seconds:
            return None
        return (self.last.tokens - self.first.tokens) / (self.last.seconds - self.first.seconds)


# Under --time-budget, what the jobs cost beyond their training tokens: spawning, compiling
# (the base's compilation is cached for the jobs' identical shapes), evaluations; and the
# share of the base's tokens/s the jobs are counted on together, since they time-slice one
# device. Measured on one H100 (docs/figures/quality_gpu.json): five jobs trained 300M
# tokens in 182 s, start-up included, where the base alone would take 145 s; these bounds
# predict 215 s for that.
JOB_RESERVE_S = 45.0
SHARED_RATE = 0.85


def fit_budget(
    args: argparse.Namespace, cfgs: dict[str, RunConfig], rate: float | None, elapsed: float
) -> tuple[dict[str, RunConfig], dict[str, Any]]:
    """Scale DiPaCo's and DiLoCo's H (and so every baseline's steps, which follow them) down
    so the jobs' tokens fit the time left at `rate` tokens/s, all jobs sharing one device."""
    names = [job.name for job in make_jobs(args, cfgs)]
    tokens = sum(planned_tokens(n, cfgs[JOB_CONFIG[n]]) for n in names)
    params = cfgs["e"].num_params() / cfgs["b-fp32"].num_params()
    for name in names:  # the dense-total jobs' own bases train in the job, at their size's cost
        if name.startswith("e/"):
            tokens += round(args.base_steps * args.batch * cfgs["e"].model.seq_len * params)
    sizing: dict[str, Any] = {
        "time_budget_s": args.time_budget, "elapsed_before_jobs_s": elapsed,
        "base_tokens_per_s": rate, "shared_rate": SHARED_RATE, "planned_job_tokens": tokens,
        "scale": 1.0,
    }  # fmt: skip
    if rate is None:  # a cached or short base: nothing measured, the sizes stay
        return cfgs, sizing
    rate *= SHARED_RATE
    left = args.time_budget - elapsed - JOB_RESERVE_S
    scale = min(1.0, max(left, 0.0) * rate / tokens)
    sizing["predicted_job_s"] = JOB_RESERVE_S + tokens / rate
    if scale >= 1.0:
        return cfgs, sizing
    scaled = {
        key: cfg.model_copy(
            update={"inner": cfg.inner.model_copy(
                update={"steps": max(1, math.floor(cfg.inner.steps * scale))}
            )}
        )
        for key, cfg in cfgs.items()
    }  # fmt: skip
    sizing["scale"] = scale
    sizing["predicted_scaled_job_s"] = left + JOB_RESERVE_S
    sizing["inner_steps"] = {key: cfg.inner.steps for key, cfg in scaled.items()}
    sizing["scaled_job_tokens"] = sum(planned_tokens(n, scaled[JOB_CONFIG[n]]) for n in names)
    return scaled, sizing


def summarize(
    results: dict[str, dict[str, Any]], goals: dict[str, tuple[float | None, float]] = GOALS
) -> dict[str, dict[str, Any]]:
    pairs = {
        "dipaco_vs_dense_equal_steps": ("b/dipaco-fp32", "b/dense-steps"),
        "dipaco_vs_dense_equal_tokens": ("b/dipaco-fp32", "b/dense"),
        "dipaco_vs_diloco_equal_tokens": ("b/dipaco-fp32", "d/diloco-p"),
        "dipaco_vs_dense_total_equal_steps": ("b/dipaco-fp32", "e/dense-total-steps"),
        "path_specific_vs_dense_equal_steps": ("f/dipaco-path-specific", "b/dense-steps"),
        "path_specific_vs_shared": ("f/dipaco-path-specific", "b/dipaco-fp32"),
        "dipaco_vs_dp": ("b/dipaco-fp32", "b/data-parallel"),
        "diloco_vs_dp": ("a/diloco", "a/data-parallel"),
        "int8_vs_fp32": ("c/dipaco-int8", "b/dipaco-fp32"),
        "int4_vs_fp32": ("c/dipaco-int4", "b/dipaco-fp32"),
    }
    # The dense model of DiPaCo's total size: the better of its learning rates.
    sweep = {n: r["perplexity"] for n, r in results.items() if n.startswith("e/")}
    if sweep:
        pairs["dipaco_vs_dense_total_equal_steps"] = ("b/dipaco-fp32", min(sweep, key=sweep.get))
    summary = {}
    for key, (ours, reference) in pairs.items():
        if ours not in results or reference not in results:
            continue  # --only left one of them out
        summary[key] = {
            "ours": ours,
            "reference": reference,
            "perplexity": results[ours]["perplexity"],
            "reference_perplexity": results[reference]["perplexity"],
            "ratio": results[ours]["perplexity"] / results[reference]["perplexity"],
            "goal": goal_text(key, goals),
        }
    if "dipaco_vs_dense_total_equal_steps" in summary:
        summary["dipaco_vs_dense_total_equal_steps"]["lr_sweep"] = sweep
    a, b = results.get("a/diloco"), results.get("b/dipaco-fp32")
    if "diloco_vs_dp" in summary and a is not None:
        summary["diloco_vs_dp"]["bytes_ratio_vs_data_parallel"] = (
            a["bytes"] / a["data_parallel_bytes"]
        )
    for key in ("dipaco_vs_dense_equal_steps", "dipaco_vs_dense_equal_tokens", "dipaco_vs_dp"):
        if key in summary and b is not None:
            summary[key]["bytes_ratio_vs_data_parallel"] = b["bytes"] / b["data_parallel_bytes"]
    for key in ("int8_vs_fp32", "int4_vs_fp32"):
        if key not in summary or b is None:
            continue
        ours = results[summary[key]["ours"]]
        summary[key]["upload_ratio_vs_fp32"] = ours["upload_bytes"] / b["upload_bytes"]
        # Further seeds (--codec-seeds): the figure is the mean of the per-seed ratios.
        codec, per_seed = key.split("_")[0], [summary[key]["ratio"]]
        for k in range(1, 10):
            mine, fp32 = codec_job_names(codec, k)[0], codec_job_names("fp32", k)[0]
            if mine not in results or fp32 not in results:
                break
            per_seed.append(results[mine]["perplexity"] / results[fp32]["perplexity"])
        summary[key]["ratio_per_seed"] = per_seed
        summary[key]["ratio"] = sum(per_seed) / len(per_seed)
    analysed = (b or {}).get("specialisation")
    if analysed is not None:
        summary["reroute_vs_route_once"] = {
            "ours": "b/dipaco-fp32 re-routed", "reference": "b/dipaco-fp32 routed once",
            "perplexity": math.exp(analysed["rerouted_loss"]),
            "reference_perplexity": math.exp(analysed["routed_loss"]),
            "ratio": analysed["reroute_vs_route_once"],
            "goal": goal_text("reroute_vs_route_once", goals),
            "reroute_every": analysed["reroute_every"],
        }  # fmt: skip
    platform = results.get("p/platform")
    if platform is not None:
        summary["platform_vs_simulate"] = {
            "ours": "p/platform",
            "reference": "p/simulate",
            "loss": platform["platform_loss"],
            "reference_loss": platform["simulate_loss"],
            "ratio": platform["platform_vs_simulate"],
            "goal": goal_text("platform_vs_simulate"),
        }
    return summary


def print_tables(
    summary: dict[str, dict[str, Any]], results: dict[str, Any], console: Console, grid: str
) -> None:
    table = Table(
        title="Validation perplexity ratios (below 1: ours is better)",
        caption=f"DiPaCo ({grid}) evaluated with routing; platform / simulate compares losses",
    )
    for column in ("key", "experiment", "ours", "reference", "ratio", "goal", "bytes"):
        table.add_column(column, justify="right")
    for key, row in summary.items():
        if "bytes_ratio_vs_data_parallel" in row:
            sent = f"{row['bytes_ratio_vs_data_parallel']:.4f} x DP"
        elif "upload_ratio_vs_fp32" in row:
            sent = f"{row['upload_ratio_vs_fp32']:.3f} x fp32 upload"
        else:
            sent = "-"
        ours = row.get("perplexity", row.get("loss"))
        reference = row.get("reference_perplexity", row.get("reference_loss"))
        seeds = len(row.get("ratio_per_seed", [])) or 1
        label = LABELS[key] + (f" (mean of {seeds} seeds; seed 0 ppl)" if seeds > 1 else "")
        table.add_row(
            key, label, f"{ours:.3f}", f"{reference:.3f}",
            f"{row['ratio']:.4f}", row["goal"], sent,
        )  # fmt: skip
    console.print(table)
    for key, row in summary.items():
        if len(row.get("ratio_per_seed", [])) > 1:
            each = " ".join(f"{r:.4f}" for r in row["ratio_per_seed"])
            console.print(f"{key} per seed: {each}")
    for name in ("a/diloco", "d/diloco-p", "b/dipaco-fp32", "f/dipaco-path-specific"):
        if name not in results:
            continue
        curve = " ".join(f"{loss:.3f}" for loss in results[name]["curve"])
        console.print(f"{name} routed val loss at validated rounds: {curve}")
    for name, figures in specialisation_summary(results).items():
        purity = "-" if figures["domain_purity"] is None else f"{figures['domain_purity']:.2f}"
        console.print(
            f"{name} specialisation: oracle / routed {figures['oracle_vs_routed']:.3f}, router "
            f"agrees with the oracle on {figures['router_agreement']:.0%} of windows (chance "
            f"{figures['chance_agreement']:.0%}), domain purity {purity}, "
            f"re-routed {figures['windows_rerouted']:.0%} of windows"
        )
        if figures.get("discriminative_vs_kmeans") is not None:
            console.print(
                f"{name} discriminative router (window-level, cross-fitted): "
                f"perplexity {figures['discriminative_vs_kmeans']:.3f} x k-means', "
                f"agrees with the oracle on {figures['discriminative_agreement']:.0%} "
                f"(k-means {figures['kmeans_agreement']:.0%})"
            )


def specialisation_summary(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per analysed DiPaCo job: the few figures that say how much its paths specialise."""
    out = {}
    for name, result in results.items():
        figures = result.get("specialisation")
        if figures is None:
            continue
        keep = ("oracle_vs_routed", "router_agreement", "chance_agreement",
                "reroute_vs_route_once", "windows_rerouted", "reroute_every")  # fmt: skip
        out[name] = {key: figures[key] for key in keep}
        out[name]["domain_purity"] = figures["by_domain"].get("purity")  # None: not measured
        fitted = figures.get("discriminative", {})
        for key in ("discriminative_vs_kmeans", "discriminative_agreement",
                    "kmeans_agreement", "oracle_vs_discriminative"):  # fmt: skip
            out[name][key] = fitted.get(key)
    return out


def run_platform(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """platform_vs_simulate (bench/platform_run.py) on the DiPaCo config's corpus and seed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # a sibling script, importable once this directory is on sys.path (above)
    from platform_run import default_config, platform_vs_simulate

    console.log("platform_vs_simulate: a real server, Celery and two dipaco-worker processes")
    started = time.perf_counter()
    sizes = {"rounds": 2, "inner_steps": 5} if args.quick else {}
    config = default_config(seed=args.seed, **sizes)
    result = platform_vs_simulate(config, corpus=args.corpus, log=console.log)
    result["name"], result["seconds"] = "p/platform", time.perf_counter() - started
    console.log(
        f"platform loss {result['platform_loss']:.4f}, simulate {result['simulate_loss']:.4f} "
        f"in {result['seconds']:.0f} s"
    )
    return result


def scale(
    args: argparse.Namespace, cfgs: dict[str, RunConfig], results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """What the figures mean at this size: parameters, DiPaCo's capacity over a path's, each
    job's tokens (and the base's) per path parameter, the device and each job's inner loop."""
    dipaco = cfgs["b-fp32"]
    path = dipaco.num_params()
    total = sum(dipaco.module_param_counts().values())
    info = machine(args.device)
    return {
        "device": info.get("gpu", args.device),
        "preset": args.preset,
        "base_tokens": args.base_steps * args.batch * dipaco.model.seq_len,
        "path_params": path,
        "dipaco_params": total,
        "capacity_ratio": total / path,
        "dense_total_params": cfgs["e"].num_params(),
        "path_specific_params": sum(cfgs["f"].module_param_counts().values()),
        "grid": [level.modules for level in dipaco.layout.levels],
        "tokens": {name: r["tokens"] for name, r in results.items() if "tokens" in r},
        "tokens_per_param": {
            name: r["tokens"] / path for name, r in results.items() if "tokens" in r
        },
        "loop": {name: r["loop"] for name, r in results.items() if "loop" in r},
    }


def machine(device: str) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
        "python": platform.python_version(), "device": device,
    }  # fmt: skip
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds and steps")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    _add_training_arguments(parser)
    _add_job_arguments(parser)
    args = parser.parse_args(argv)
    for key, value in BENCH_DEFAULTS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.corpora = corpus_list(args.corpus)
    args.corpus = args.corpora[0][1]  # each corpus's run sets its own
    names = [name for name, _ in corpus_names(args.corpora)]
    if len(set(names)) < len(names):
        parser.error(f"--corpus: two corpora named alike ({names}); name each, NAME=PATH")
    if args.quick:
        args.rounds, args.inner_steps, args.diloco_rounds, args.diloco_inner_steps = 2, 10, 2, 5
        args.max_docs, args.eval_windows, args.warmup_steps = 300, 64, 5
        args.base_steps, args.diloco_batch = 20, 4
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: this torch has no CUDA device (torch.cuda.is_available() is "
            "False); install a CUDA build of torch or use --device cpu"
        )
    if args.eval_every < 1 or args.reroute_every < 1:
        parser.error("--eval-every and --reroute-every: give 1 or more")
    if not 1 <= args.codec_seeds <= 9:
        parser.error(f"--codec-seeds {args.codec_seeds}: give 1 to 9")
    return args


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """What DiPaCo, DiLoCo and the baselines train on, and for how long."""
    parser.add_argument(
        "--corpus", action="append", metavar="[NAME=]PATH",
        help='"stdlib" (this Python\'s standard library, the default), a directory of text '
        "files, or a .jsonl file with a text field (bench/corpus_jsonl.py, bench/corpus_docs.py)"
        '. Repeat it, or name it (docs=/tmp/docs.jsonl), for one run per corpus in turn: '
        '--json then holds {"corpora": {NAME: figures}}',
    )  # fmt: skip
    sizes = ", ".join(
        f"{name} {s['rounds']} x {s['inner_steps']}" for name, s in BENCH_DEFAULTS.items()
    )
    parser.add_argument("--rounds", type=int, help=f"DiPaCo's T (the preset's: {sizes})")
    parser.add_argument("--inner-steps", type=int, help="DiPaCo's H (the preset's, as above)")
    parser.add_argument(
        "--batch", type=int,
        help="DiPaCo's sequences per inner step and path; the dense baselines take the same, "
        "data-parallel P x (the preset's: 4)",
    )  # fmt: skip
    parser.add_argument("--diloco-rounds", type=int, help="DiLoCo's T (the preset's: 8, 4)")
    parser.add_argument("--diloco-inner-steps", type=int, help="DiLoCo's H (the preset's: 16)")
    parser.add_argument(
        "--diloco-batch", type=int,
        help="DiLoCo's sequences per inner step and replica; data-parallel takes 4x "
        "(the preset's: 16)",
    )  # fmt: skip
    parser.add_argument("--inner-lr", type=float, default=3e-3, help="peak AdamW lr (%(default)s)")
    parser.add_argument("--warmup-steps", type=int, help="inner warm-up (the preset's: 20, 6)")
    parser.add_argument("--outer-lr", type=float, default=None, help="outer lr (RunConfig's)")
    parser.add_argument("--outer-momentum", type=float, default=None, help="outer μ (RunConfig's)")
    parser.add_argument(
        "--router", type=json.loads, default={}, metavar="JSON",
        help='router fields over the DiPaCo jobs\' (RouterConfig), e.g. \'{"method": '
        '"product-kmeans", "prefix_tokens": 64}\'',
    )  # fmt: skip
    parser.add_argument(
        "--outer", type=json.loads, default={}, metavar="JSON",
        help='outer fields over every job\'s (OuterConfig), e.g. \'{"sqrt_paths_rescale": '
        "true}' (DiPaCo's sqrt(paths) on a module's mean; one path's jobs are unchanged by it)",
    )  # fmt: skip
    parser.add_argument(
        "--diloco-outer-lr", type=float, default=None, help="DiLoCo's outer lr (--outer-lr's)"
    )
    parser.add_argument(
        "--diloco-outer-momentum", type=float, default=None,
        help="DiLoCo's outer μ (--outer-momentum's)",
    )  # fmt: skip


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The data sample, the preset, what is measured, which jobs run and where."""
    parser.add_argument(
        "--no-platform", action="store_true", help="skip platform_vs_simulate (no server run)"
    )
    parser.add_argument("--max-docs", type=int, default=0, help="corpus sample, 0: all of it")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held out (%(default)s)")
    parser.add_argument(
        "--eval-windows", type=int, default=SAMPLE_WINDOWS,
        help="windows of 129 tokens in the seeded validation sample (dipaco.evaluate."
        "sample_plan, the platform's; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--base-steps", type=int, default=300,
        help="the phase-1 base every job starts from, trained at --batch (%(default)s)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny",
        help="the run preset every job starts from: tiny (RunConfig.tiny, 2.84M-parameter "
        "paths, 2x2), modular (RunConfig.modular, 2.67M-parameter paths, 88%% of them "
        "modules, 2 levels x 5 for the CPU) or capacity (RunConfig.capacity, 8.5M-parameter "
        "paths, 2 levels x 4, for one GPU) (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--grid", type=_grid, default=None, metavar="LxK",
        help="DiPaCo's levels x modules per level (default 2x2, or the preset's own)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=None, metavar="JSON",
        help='model fields over the preset\'s, e.g. \'{"hidden_size": 64, "num_layers": 4}\' '
        "for a dry run",
    )  # fmt: skip
    parser.add_argument(
        "--only", type=lambda text: [name for name in text.split(",") if name], default=None,
        metavar="JOB,JOB", help="run only these jobs (e.g. b/dipaco-fp32,c/dipaco-int4); "
        "figures whose two jobs both ran are reported; no platform run",
    )  # fmt: skip
    parser.add_argument(
        "--codec-seeds", type=int,
        help="seeds of the fp32/int8/int4 comparison; its figures are the mean ratio "
        "(the preset's: tiny 3, modular 1)",
    )  # fmt: skip
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="comm.block_size of the int8/int4 runs (default: CommConfig's)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=4,
        help="DiPaCo and DiLoCo validate every this many rounds and after the last; the "
        "figures use the last (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--reroute-every", type=int, default=32,
        help="reroute_vs_route_once: re-route every this many tokens of a validation "
        "window (the paper: 64 of 1,024-token sequences; default %(default)s of 128)",
    )  # fmt: skip
    parser.add_argument(
        "--no-domains", action="store_true",
        help="skip the per-domain losses (they read the corpus again: seconds for the "
        "standard library, minutes for a GPU run's 300M characters)",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes (default: %(default)s)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--time-budget", type=float, default=0.0, metavar="SECONDS",
        help="fit the run into SECONDS of wall time (0: no limit): after the base trains, "
        "its measured tokens/s sizes the jobs, scaling DiPaCo's and DiLoCo's H down if the "
        f"planned tokens would not fit ({JOB_RESERVE_S:.0f} s kept for the jobs' start-up); "
        "the JSON's sizing says what was measured and chosen",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="where every job trains; cuda trains in bf16 autocast, as dipaco-worker does on "
        "a GPU, and several --jobs share the one GPU (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/dipaco/simulate")


def figures(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    goals: dict[str, tuple[float | None, float]],
    sizing: dict[str, Any] | None,
    cfgs: dict[str, RunConfig],
    start: tuple[float, tuple[float, float, float]],
    done: bool,
) -> dict[str, Any]:
    """Every figure of one corpus's run so far, as the JSON holds them."""
    started, load_before = start
    summary = summarize(results, goals)
    shown = {*goals, *REPORTED}
    return {
        # The keys first, each the ratio its summary row explains.
        **{key: row["ratio"] for key, row in summary.items() if key in shown},
        "goals": {key: goal_text(key, goals) for key in goals},
        "complete": done,
        "corpus": args.corpus,
        "corpus_sha256": corpus_sha256(args.corpus),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "sizing": sizing,
        "summary": summary,
        "specialisation": specialisation_summary(results),
        "jobs": results,
        "configs": {k: c.model_dump(mode="json") for k, c in cfgs.items()},
        "wall_seconds": time.perf_counter() - started,
        **scale(args, cfgs, results),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": machine(args.device),
    }  # fmt: skip


class Report:
    """--json, rewritten whole (a temporary file, then a rename) whenever a job ends, so a
    run cut short keeps its figures: one corpus's figures, or with several corpora
    {"corpora": {name: figures}, ...} filled in as each corpus's run goes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started, self.load_before = time.perf_counter(), os.getloadavg()
        self.several = len(args.corpora) > 1 or args.corpora[0][0] is not None
        self.corpora: dict[str, dict[str, Any]] = {}

    def write(self, name: str, data: dict[str, Any], done: bool) -> None:
        if self.args.json is None:
            return
        if self.several:
            self.corpora[name] = data
            data = {
                "corpora": self.corpora,
                "complete": done and len(self.corpora) == len(self.args.corpora),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "preset": self.args.preset,
                "wall_seconds": time.perf_counter() - self.started,
                "load_average_before": self.load_before,
                "load_average_after": os.getloadavg(),
                "machine": machine(self.args.device),
            }  # fmt: skip
        tmp = self.args.json.with_name(f".{self.args.json.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.args.json)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The base model trains here: more threads than cores-per-job spin against the jobs.
    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 140)
    report = Report(args)
    for name, path in corpus_names(args.corpora):
        one = argparse.Namespace(**vars(args))
        one.corpus = path
        if report.several:  # each corpus prepares and caches its own data and base
            one.work_dir = args.work_dir / name
            console.rule(f"corpus {name}: {path}")
        run_corpus(one, console, lambda data, done, name=name: report.write(name, data, done))
    if args.json is not None:
        console.print(f"wrote {args.json}")
    return 0


def run_corpus(
    args: argparse.Namespace, console: Console, write: Callable[[dict[str, Any], bool], None]
) -> None:
    """Every job on args.corpus, then the platform run; `write` takes the figures so far."""
    started, load_before = time.perf_counter(), os.getloadavg()
    cfgs = configs(args)
    goals = CAPACITY_GOALS if args.preset in ("capacity", "modular") else GOALS
    # Prepare (or reuse) both data layouts here, so the jobs never race to build them.
    budget = DataBudget(max_docs=args.max_docs or None)
    # One base for all: it is keyed by the stream of all documents, which every layout
    # shares, and trains at --batch whatever the job's own batch (DiLoCo's is larger).
    console.log(f"base model: {args.base_steps} steps (cached in {args.work_dir})")
    needed = {JOB_CONFIG[name] for name in args.only} if args.only else set(cfgs)
    throughput = Throughput()
    # e (the dense model of DiPaCo's total size) trains its own bases in its jobs, in parallel.
    for key in sorted(k for k in needed if not k.startswith("e")):
        prepare_with_base(
            cfgs[key], budget, args.work_dir, args.base_steps, log=console.log,
            device=args.device, batch_size=args.batch, on_step=throughput,
        )  # fmt: skip
    sizing: dict[str, Any] | None = None
    if args.time_budget:
        rate = throughput.tokens_per_s()
        cfgs, sizing = fit_budget(args, cfgs, rate, time.perf_counter() - started)
        measured = "not measured (cached, or 50 steps or fewer)"
        console.log(
            f"time budget {args.time_budget:.0f} s: base at "
            + (measured if rate is None else f"{rate:,.0f} tokens/s")
            + f", {sizing['planned_job_tokens'] / 1e6:.1f}M job tokens planned, H scaled by "
            f"{sizing['scale']:.3f}"
        )
    jobs = make_jobs(args, cfgs)
    results: dict[str, dict[str, Any]] = {}

    def report(done: bool) -> None:
        write(figures(args, results, goals, sizing, cfgs, (started, load_before), done), done)

    # spawn, not fork: a forked child of a process that ran torch's thread pool can hang.
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(run_job, job) for job in jobs]
        for future in as_completed(futures):
            result = future.result()
            results[result["name"]] = result
            console.log(f"{result['name']}: loss {result['loss']:.4f} in {result['seconds']:.0f} s")
            report(False)
    results = {job.name: results[job.name] for job in jobs}  # make_jobs's order
    starts = {name: r["base_steps"] for name, r in results.items()}
    if len(set(starts.values())) != 1:  # every comparison must share its starting point
        raise RuntimeError(f"jobs started from different base models: {starts}")
    # last and alone: it runs a server, Celery and two workers; --only skips it, and so does
    # modular, whose 25 paths it would not run: it trains bench/platform_run.py's tiny config.
    if not args.no_platform and not args.only and args.preset != "modular":
        results["p/platform"] = run_platform(args, console)
    levels = cfgs["b-fp32"].layout.levels
    grid = f"{len(levels)} levels of {'/'.join(str(level.modules) for level in levels)} modules"
    print_tables(summarize(results, goals), results, console, grid)
    wall = time.perf_counter() - started
    console.print(
        f"{args.corpus}: wall time {wall / 60:.1f} min with {args.jobs} x {args.threads} "
        f"threads; load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    )
    report(True)


if __name__ == "__main__":
    sys.exit(main())
