"""One work unit on one path: `train_path`, and `PathTrainer`, which keeps the model resident.

A work unit assembles path p from its modules, trains H steps and splits Δ per module.
Building the model, moving it to the device and compiling it cost seconds at 150M
parameters (about 2 s to build and move, more to compile), every unit, while the unit
itself may be a minute: `PathTrainer` does that once per run architecture and keeps the
model, its compiled body, the AdamW optimizer and the checkpoint buffers on the device;
each unit copies its path's weights and warm AdamW state into them in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from dipaco.config import RunConfig
from dipaco.inner.engine import Engine
from dipaco.inner.loop import train_steps
from dipaco.inner.state import InnerResult, InnerState, StepMetrics, TokenSource, state_fingerprint
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, split_path_state

# The worker's checkpoint interval. A volunteer whose machine stops loses at most the steps
# since the last checkpoint: 2 minutes of a unit sized for ~10-30 minutes (the platform's
# target wall time). A checkpoint blocks the loop only for its snapshot (at 150M on an
# H100, about 2 GB of weights, moments and θ_old over PCIe: a fraction of a second), so
# every 2 minutes keeps the stall well under 1% of training time, where a checkpoint every
# 50 steps (issue 33's measurement) halved the loop.
DEFAULT_CHECKPOINT_INTERVAL_S = 120.0

StepHook = Callable[[StepMetrics], None]
Rebase = Callable[[int], Mapping[str, Tensor] | None]


def path_shift(
    config: RunConfig,
    p: int,
    old: Mapping[str, Mapping[str, Tensor]],
    new: Mapping[str, Mapping[str, Tensor]],
) -> dict[str, Tensor]:
    """Path p's state-dict shift from modules `old` to modules `new` (θ_new − θ_old per
    name): what `run_inner_loop(rebase=)` adds for outer.overlap's eager correction. One
    home for the simulator (`train_dipaco(eager_at=)`) and the worker agent
    (worker_agent.rebase), so both rebase by the same float arithmetic."""
    before = assemble_path_state(config, p, old)
    after = assemble_path_state(config, p, new)
    return {name: after[name] - before[name] for name in after}


class PathTrainer:
    """A model of one run architecture, resident on `device`, that trains any of its paths.

    Built once (config.model, the layout and AdamW's betas: what `state_fingerprint`
    covers; `matches` says whether another config fits); `compile` None compiles on CUDA
    only. `train_path` loads the unit's path weights and warm AdamW state into the
    resident model and optimizer in place and returns what `dipaco.inner.train_path`
    does, bit for bit on the CPU. One unit at a time: the trainer is not thread-safe.
    """

    def __init__(
        self,
        config: RunConfig,
        device: torch.device | str = "cpu",
        *,
        compile: bool | None = None,
        report_every: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.fingerprint = state_fingerprint(config)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.report_every = report_every
        model = build_model(config.model, config.seed)
        self.engine = Engine.build(model, config.inner, self.device, self.compile)
        self.model = self.engine.model

    def matches(self, config: RunConfig) -> bool:
        """Whether `config`'s paths fit this trainer's model and optimizer."""
        return state_fingerprint(config) == self.fingerprint

    def train_path(
        self,
        config: RunConfig,
        p: int,
        modules: Mapping[str, Mapping[str, Tensor]],
        source: TokenSource,
        *,
        round_index: int = 0,
        start_position: int = 0,
        stop_at: int | None = None,
        checkpoint_path: str | Path | None = None,
        checkpoint_every: int | None = None,
        checkpoint_interval_s: float | None = None,
        resume: bool = True,
        on_step: StepHook | None = None,
        should_stop: Callable[[], bool] | None = None,
        state: InnerState | None = None,
        rebase: Rebase | None = None,
    ) -> InnerResult:
        """One work unit (see `dipaco.inner.train_path`). `modules` must not be changed in
        place while it runs: θ_old is read from them, also by the checkpoint writer."""
        if not self.matches(config):
            raise ValueError(
                "this PathTrainer was built for another model, layout or inner.betas; "
                "build a new PathTrainer for this run (PathTrainer.matches tells)"
            )
        fingerprint = self.fingerprint
        warm = state.adam if state is not None and state.fingerprint == fingerprint else None
        weights = assemble_path_state(config, p, modules)
        model = self.model
        expected = set(model.state_dict())
        if set(weights) != expected:
            missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
            raise ValueError(f"path {p}'s weights do not fit the model: missing {missing}, "
                             f"unexpected {extra}")  # fmt: skip
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name], non_blocking=True)
        # θ_old: the path's fp32 weights as the model now holds them (no device round trip).
        theta_old = {
            name: weights[name].to(torch.float32).contiguous()
            for name, _ in model.named_parameters()
        }
        h = config.inner.steps
        result = train_steps(
            self.engine, source, config.inner, seq_len=config.model.seq_len,
            theta_old=theta_old, start_position=start_position, first_step=round_index * h,
            total_steps=config.rounds * h, stop_at=stop_at, checkpoint_path=checkpoint_path,
            checkpoint_every=checkpoint_every, checkpoint_interval_s=checkpoint_interval_s,
            resume=resume, on_step=on_step, should_stop=should_stop, adam=warm, rebase=rebase,
            report_every=self.report_every,
        )  # fmt: skip
        residual = state.residual if state is not None and warm is not None else {}
        result.state = InnerState(
            adam=result.adam, residual=dict(residual), fingerprint=fingerprint
        )
        if result.delta:  # also a stopped unit's partial Δ, which the agent may salvage
            result.module_deltas = split_path_state(config, p, result.delta)
        return result


def train_path(
    config: RunConfig,
    p: int,
    modules: Mapping[str, Mapping[str, Tensor]],
    source: TokenSource,
    *,
    round_index: int = 0,
    device: torch.device | str | None = None,
    start_position: int = 0,
    stop_at: int | None = None,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    checkpoint_interval_s: float | None = None,
    resume: bool = True,
    on_step: StepHook | None = None,
    should_stop: Callable[[], bool] | None = None,
    state: InnerState | None = None,
    rebase: Rebase | None = None,
    trainer: PathTrainer | None = None,
    compile: bool | None = None,
) -> InnerResult:
    """One work unit: assemble path p from `modules`, train H steps, Δ split per module.

    `stop_at` (None: H): the unit's length when it is sized to fewer steps, the loop's
    bound counted from the unit's start; its learning rates stay those of the first
    `stop_at` steps of round `round_index`'s H-step slot (`dipaco.inner.run_inner_loop`).

    `state` is the path's inner state from its previous unit on this worker (None: fresh
    AdamW); moments made for another model or other betas are ignored, not misapplied.
    The result's `state` carries the new moments (and `state`'s error-feedback residual,
    which dipaco.codecs.encode_with_feedback updates) to the path's next unit.

    `trainer`: a resident PathTrainer to train on (its device; `device`, if given, must be
    the same); None builds one for this unit on `device` (default the CPU), with `compile`.
    """
    if trainer is None:
        trainer = PathTrainer(config, "cpu" if device is None else device, compile=compile)
    elif device is not None and not _same_device(torch.device(device), trainer.device):
        raise ValueError(f"device {device} differs from the trainer's {trainer.device}")
    return trainer.train_path(
        config, p, modules, source, round_index=round_index, start_position=start_position,
        stop_at=stop_at, checkpoint_path=checkpoint_path, checkpoint_every=checkpoint_every,
        checkpoint_interval_s=checkpoint_interval_s, resume=resume, on_step=on_step,
        should_stop=should_stop, state=state, rebase=rebase,
    )  # fmt: skip


def _same_device(a: torch.device, b: torch.device) -> bool:
    """ "cuda" and "cuda:0" are the same device to a caller that names no index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
