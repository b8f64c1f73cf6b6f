"""The two baselines a simulation is compared with, on the same data and token budget.

- ``data-parallel``: synchronous data-parallel training of one path-size dense model, what
  P·R workers would do with an all-reduce every step: T·H AdamW steps, each on a batch
  P·R times the inner batch (the mean gradient of P·R workers' batches).
- ``dense``: the same path-size model trained alone at the inner batch size for T·H·P·R
  steps: the same tokens in more, smaller steps.

Both start from the weights every module starts from (the base model, if any), use the inner optimiser settings
(warm-up, then cosine over their own length), read the i.i.d. stream of every training
document, and are scored on the validation windows of every path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dipaco.config import RunConfig
from dipaco.evaluate import PathLoss, ValWindows, evaluate_model, routed_mean
from dipaco.inner import InnerResult, StepMetrics, TokenSource, run_inner_loop
from dipaco.model import build_model
from dipaco.simulate.prepare import PreparedData

__all__ = [
    "BASELINES",
    "BaselineRun",
    "baseline_steps",
    "data_parallel_bytes",
    "fit_baseline",
    "train_baseline",
]

BASELINES = ("data-parallel", "dense", "dense-steps")
ALL_REDUCE_FORMULA = "2 x params x 4 bytes x steps x workers"


@dataclass
class BaselineRun:
    name: str
    steps: int
    batch_size: int  # sequences per optimiser step
    tokens: int
    paths: list[PathLoss]  # the one model on each path's validation windows
    loss: float  # token-weighted over all windows: the same tokens as DiPaCo's routed mean
    train_loss: float
    seconds: float


def baseline_steps(config: RunConfig, name: str) -> tuple[int, int]:
    """(optimiser steps, grad_accum_steps) of a baseline with the simulation's token budget."""
    workers = config.num_paths * config.replicas_per_path
    steps = config.rounds * config.inner.steps
    if name == "data-parallel":
        return steps, config.inner.grad_accum_steps * workers
    if name == "dense":  # equal tokens: every unit's steps, one after another
        return steps * workers, config.inner.grad_accum_steps
    if name == "dense-steps":  # equal sequential steps (wall-clock): as many as one path
        return steps, config.inner.grad_accum_steps
    raise ValueError(f"unknown baseline {name!r}; choose from {BASELINES}")


def data_parallel_bytes(config: RunConfig) -> int:
    """What a ring all-reduce of fp32 gradients sends for the data-parallel baseline: about
    2 x params x 4 bytes per worker per step (reduce-scatter, then all-gather)."""
    steps, _ = baseline_steps(config, "data-parallel")
    workers = config.num_paths * config.replicas_per_path
    return 2 * config.num_params() * 4 * steps * workers


def train_baseline(
    config: RunConfig,
    data: PreparedData,
    windows: ValWindows,
    name: str,
    *,
    on_step: Callable[[StepMetrics], None] | None = None,
    device: torch.device | str = "cpu",
    base_state: Mapping[str, Tensor] | None = None,
) -> BaselineRun:
    started = time.perf_counter()
    steps, accum = baseline_steps(config, name)
    source = data.train_source(None, config.model.seq_len, config.seed)
    model, result = fit_baseline(
        config, source, name, on_step=on_step, device=device, base_state=base_state
    )
    losses = evaluate_model(model, windows)
    return BaselineRun(
        name=name,
        steps=steps,
        batch_size=config.inner.micro_batch_size * accum,
        tokens=result.tokens,
        paths=losses,
        loss=routed_mean(losses),
        train_loss=result.losses[-1],
        seconds=time.perf_counter() - started,
    )


def fit_baseline(
    config: RunConfig,
    source: TokenSource,
    name: str,
    *,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    device: torch.device | str = "cpu",
    base_state: Mapping[str, Tensor] | None = None,
) -> tuple[nn.Module, InnerResult]:
    """Baseline `name`'s model trained on `source`: the simulation's i.i.d. stream, or
    `dipaco demo`'s run units (dipaco_demo.baseline). ``result.completed`` is False when
    `should_stop` ended it early."""
    steps, accum = baseline_steps(config, name)
    inner = config.inner.model_copy(update={"steps": steps, "grad_accum_steps": accum})
    model = build_model(config.model, config.seed)  # = the modules' initial weights
    if base_state is not None:
        model.load_state_dict(base_state)
    result = run_inner_loop(
        model, source, inner, seq_len=config.model.seq_len, device=device,
        on_step=on_step, should_stop=should_stop,
    )  # fmt: skip
    return model, result
