"""A whole DiPaCo or DiLoCo training in one process, with its baselines (`dipaco simulate`).

    from dipaco.config import RunConfig
from dipaco.evaluate import sample_size
    from dipaco.simulate import SimulateOptions, simulate

    result = simulate(RunConfig.tiny(), SimulateOptions())
    print(result.perplexity, result.perplexity_ratio("dense"))

Stages: `prepare` (corpus sample, tokenizer, router, per-path shards, cached in a work
dir), `base` (an optional dense warm-up everything starts from), `train` (the outer
rounds), `baselines` (data-parallel and dense on the same tokens), `evaluate` (fixed
validation windows, routed), `report` (JSON and tables).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dipaco.config import RunConfig
from dipaco.evaluate import sample_size
from dipaco.inner import StepMetrics
from dipaco.simulate.base import prepare_with_base
from dipaco.simulate.baselines import BASELINES, BaselineRun, baseline_steps, train_baseline
from dipaco.simulate.prepare import DataBudget, PreparedData, default_work_dir, prepare_data
from dipaco.simulate.report import SimulationResult, render
from dipaco.simulate.train import train_dipaco

__all__ = [
    "BASELINES",
    "DataBudget",
    "PreparedData",
    "SimulateOptions",
    "SimulationResult",
    "default_work_dir",
    "prepare_data",
    "render",
    "simulate",
]


@dataclass(frozen=True)
class SimulateOptions:
    budget: DataBudget = field(default_factory=DataBudget)
    work_dir: Path | None = None  # default: ~/.cache/dipaco/simulate
    # The validation sample's windows (dipaco.evaluate.sample_plan); None: the platform's
    # (dipaco.evaluate.sample_size), so a simulation and a platform run score the same.
    eval_windows: int | None = None
    baselines: tuple[str, ...] = BASELINES
    base_steps: int = 0  # a dense warm-up phase everything starts from (simulate/base.py)
    base_batch: int | None = None  # the base's batch (default the run's): one base per bench
    progress: bool = False  # a rich progress bar on the console
    device: str = "cpu"
    eval_every: int = 1  # validate DiPaCo every this many rounds (and after the last)


@contextmanager
def _progress(console: Console | None, enabled: bool) -> Iterator[Progress]:
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    with progress:
        yield progress


def simulate(
    config: RunConfig, options: SimulateOptions | None = None, *, console: Console | None = None
) -> SimulationResult:
    """Prepare (or reuse) the data, train, run the baselines, evaluate; nothing is printed
    except log lines and the progress bar on `console`."""
    options = options if options is not None else SimulateOptions()
    unknown = set(options.baselines) - set(BASELINES)
    if unknown:
        raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {BASELINES}")
    log = console.log if console is not None else (lambda _: None)
    units = config.num_paths * config.replicas_per_path
    with _progress(console, options.progress) as progress:
        base_task = progress.add_task(
            "base model", total=options.base_steps or 1, visible=bool(options.base_steps)
        )

        def on_base_step(metrics: StepMetrics) -> None:
            progress.update(base_task, advance=1, description=f"base loss {metrics.loss:.3f}")

        # The paper's order: the dense base (phase 1) first, whose features may route.
        data, base_state = prepare_with_base(
            config, options.budget, options.work_dir, options.base_steps,
            log=log, on_step=on_base_step, device=options.device, batch_size=options.base_batch,
        )  # fmt: skip
        progress.update(base_task, completed=options.base_steps or 1)
        count = options.eval_windows or sample_size(config)
        windows = data.val_windows(config.model.seq_len, count, config.seed)
        name = "DiLoCo" if config.num_paths == 1 else "DiPaCo"
        task = progress.add_task(name, total=config.rounds * units * config.inner.steps)

        def on_unit_step(label: str, metrics: StepMetrics) -> None:
            progress.update(task, advance=1, description=f"{name} {label} loss {metrics.loss:.3f}")

        run = train_dipaco(
            config,
            data,
            windows,
            on_step=on_unit_step,
            device=options.device,
            base_state=base_state,
            eval_every=options.eval_every,
        )
        baselines: dict[str, BaselineRun] = {}
        for baseline in options.baselines:
            steps, _ = baseline_steps(config, baseline)
            b_task = progress.add_task(baseline, total=steps)

            def on_step(
                metrics: StepMetrics, b_task: TaskID = b_task, baseline: str = baseline
            ) -> None:
                progress.update(
                    b_task, advance=1, description=f"{baseline} loss {metrics.loss:.3f}"
                )

            baselines[baseline] = train_baseline(
                config,
                data,
                windows,
                baseline,
                on_step=on_step,
                device=options.device,
                base_state=base_state,
            )
    return SimulationResult(
        config=config,
        budget=options.budget,
        data=data,
        windows=windows,
        run=run,
        baselines=baselines,
        threads=torch.get_num_threads(),
        base_steps=options.base_steps,
    )
