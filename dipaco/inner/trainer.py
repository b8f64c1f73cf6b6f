"""One work unit on one path: `train_path`, `PathTrainer`, which keeps the model resident,
and `ResidentTrainer`, which keeps one fitted to the device from unit to unit.

A work unit assembles path p from its modules, trains H steps and splits Δ per module.
Building the model, moving it to the device and compiling it cost seconds at 150M
parameters (about 2 s to build and move, more to compile), every unit, while the unit
itself may be a minute: `PathTrainer` does that once per run architecture and keeps the
model, its compiled body, the AdamW optimizer and the checkpoint buffers on the device;
each unit copies its path's weights and warm AdamW state into them in place.

`ResidentTrainer.train` is what a machine that trains unit after unit needs around that
(the worker agent, and the benches that measure it): the PathTrainer built again for
another architecture, the unit's checkpoint in its work directory (resumed after a crash,
started over when it belongs to other settings), and the out-of-memory fallback: half the
micro-batch, twice the accumulation (the same batch, so the same Δ), resumed from the last
checkpoint, whose identity names the batch and not its split. At one sequence per
micro-batch it gives up (`DoesNotFit`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dipaco.config import InnerConfig, RunConfig
from dipaco.inner.engine import Engine
from dipaco.inner.fit import DoesNotFit, Precision, is_out_of_memory, smaller_micro_batch
from dipaco.inner.loop import train_steps
from dipaco.inner.state import (
    CheckpointMismatch,
    InnerResult,
    InnerState,
    StepMetrics,
    TokenSource,
    state_fingerprint,
)
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, split_path_state

# The worker's checkpoint interval. A volunteer whose machine stops loses at most the steps
# since the last checkpoint: 2 minutes of a unit sized for ~10-30 minutes (the platform's
# target wall time). A checkpoint blocks the loop only for its snapshot (at 150M on an
# H100, about 2 GB of weights, moments and θ_old over PCIe: a fraction of a second), so
# every 2 minutes keeps the stall well under 1% of training time, where a checkpoint every
# 50 steps (as measured on the GPU worker) halved the loop.
DEFAULT_CHECKPOINT_INTERVAL_S = 120.0

log = logging.getLogger(__name__)
StepHook = Callable[[StepMetrics], None]
Rebase = Callable[[int], Mapping[str, Tensor] | None]
Fault = Callable[[StepMetrics, InnerConfig], None]  # tests inject failures through this
CHECKPOINT_NAME = "inner.safetensors"  # a unit's checkpoint in its work directory


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
        precision: Precision | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.fingerprint = state_fingerprint(config)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.report_every = report_every
        model = build_model(config.model, config.seed)
        self.engine = Engine.build(model, config.inner, self.device, self.compile, precision)
        self.model = self.engine.model
        # The moments the optimizer holds now, as the last unit returned them (None: none
        # known). A path's next unit whose warm state is these very tensors starts from
        # the resident ones instead of copying them in again.
        self._resident: Mapping[str, Tensor] | None = None

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
        finish_write: bool = True,
    ) -> InnerResult:
        """One work unit (see `dipaco.inner.train_path`). `modules` must not be changed in
        place while it runs: θ_old is read from them, also by the checkpoint writer.

        A warm `state` whose moments are those this trainer's last unit returned (the same
        tensors: the path's next unit, its completion accepted) starts from the moments
        still resident in the optimizer; any other is copied in. `finish_write` False
        returns while the last checkpoint is written (`InnerResult.checkpoint_written`)."""
        started = time.perf_counter()
        if not self.matches(config):
            raise ValueError(
                "this PathTrainer was built for another model, layout or inner.betas; "
                "build a new PathTrainer for this run (PathTrainer.matches tells)"
            )
        fingerprint = self.fingerprint
        warm = state.adam if state is not None and state.fingerprint == fingerprint else None
        resident, self._resident = self._holds(warm), None  # unknown if this unit fails
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
        load_s = time.perf_counter() - started
        result = train_steps(
            self.engine, source, config.inner, seq_len=config.model.seq_len,
            theta_old=theta_old, start_position=start_position, first_step=round_index * h,
            total_steps=config.rounds * h, stop_at=stop_at, checkpoint_path=checkpoint_path,
            checkpoint_every=checkpoint_every, checkpoint_interval_s=checkpoint_interval_s,
            resume=resume, on_step=on_step, should_stop=should_stop, adam=warm, rebase=rebase,
            report_every=self.report_every, keep_moments=resident, finish_write=finish_write,
        )  # fmt: skip
        split_started = time.perf_counter()
        residual = state.residual if state is not None and warm is not None else {}
        # The residual as it is (a lazy one stays on disk): a hand-in replaces it, never
        # changes it in place (worker_agent.payload.encode_deltas).
        result.state = InnerState(adam=result.adam, residual=residual, fingerprint=fingerprint)
        self._resident = result.adam
        if result.delta:  # also a stopped unit's partial Δ, which the agent may salvage
            result.module_deltas = split_path_state(config, p, result.delta)
        result.timings.update(load_s=load_s, split_s=time.perf_counter() - split_started)
        return result

    def _holds(self, adam: Mapping[str, Tensor] | None) -> bool:
        """Whether the optimizer holds `adam` already (the very tensors it last returned)."""
        last = self._resident
        if adam is not None and adam is last:  # the very mapping (a lazy one: its file)
            return True
        if not adam or last is None or adam.keys() != last.keys():
            return False
        return all(adam[key] is last[key] for key in last)


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


@dataclass
class UnitWork:
    """One unit of a path: what `ResidentTrainer.train` trains."""

    config: RunConfig
    run_id: int
    path: int
    round_index: int
    modules: Mapping[str, Mapping[str, Tensor]]
    source: TokenSource  # the path's ShardSource on the platform
    start_position: int = 0  # the unit's first window in the source (dipaco.data.windows)


@dataclass
class UnitHooks:
    """What the caller plugs into a unit's loop (all optional)."""

    should_stop: Callable[[], bool] | None = None
    on_step: StepHook | None = None
    # (old split, new split): the out-of-memory fallback shrank the micro-batch
    on_fallback: Callable[[InnerConfig, InnerConfig], None] | None = None
    rebase: Rebase | None = None  # outer.overlap eager's hook (worker_agent.rebase)
    fault: Fault | None = None


class ResidentTrainer:
    """One `PathTrainer` on `device`, kept from unit to unit while `PathTrainer.matches`
    their config, built again when it does not, dropped after an out-of-memory error (the
    next build starts from an empty device). `compile` None compiles on CUDA only;
    `precision` None: the device's (dipaco.inner.fit.precision_for)."""

    def __init__(
        self,
        device: torch.device | str,
        compile: bool | None = None,
        *,
        precision: Precision | None = None,
    ) -> None:
        self.device, self.compile, self.precision = torch.device(device), compile, precision
        self.trainer: PathTrainer | None = None
        self.builds = 0  # how many PathTrainers it built (tests, logs)

    def for_config(self, config: RunConfig) -> PathTrainer:
        if self.trainer is None or not self.trainer.matches(config):
            if self.trainer is not None:
                log.info("a run of another architecture: building its model on %s", self.device)
                self.drop()
            self.trainer = PathTrainer(
                config, self.device, compile=self.compile, precision=self.precision
            )
            self.builds += 1
        return self.trainer

    def drop(self) -> None:
        self.trainer = None
        free_memory(self.device)

    def train(
        self,
        work: UnitWork,
        *,
        work_dir: Path,
        state: InnerState | None = None,
        inner: InnerConfig | None = None,
        stop_at: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_interval_s: float | None = None,
        hooks: UnitHooks | None = None,
        finish_write: bool = True,
    ) -> tuple[InnerResult, InnerConfig]:
        """Train the unit (resuming its checkpoint if any) from the path's warm `state`
        (None: fresh AdamW) with the split `inner` (None: the run's); returns the result,
        whose `state` is the path's next one, and the split it finished with. `stop_at`:
        the unit's length, counted from its start (None: H). `finish_write` False: see
        `PathTrainer.train_path`."""
        hooks = hooks or UnitHooks()
        work_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = work_dir / CHECKPOINT_NAME
        current = inner or work.config.inner
        if state is not None and not checkpoint.exists():
            log.info("path %d: continuing its inner state from its last unit", work.path)
        restarted = False
        while True:
            config = work.config.model_copy(update={"inner": current})
            try:
                result = self.for_config(config).train_path(
                    config, work.path, work.modules, work.source,
                    round_index=work.round_index, start_position=work.start_position,
                    stop_at=stop_at, checkpoint_path=checkpoint,
                    checkpoint_every=checkpoint_every,
                    checkpoint_interval_s=checkpoint_interval_s,
                    should_stop=hooks.should_stop, on_step=_step_hook(hooks, current),
                    state=state, rebase=hooks.rebase, finish_write=finish_write,
                )  # fmt: skip
                return result, current
            except CheckpointMismatch as mismatch:
                if restarted:
                    raise
                # Written with other settings (an older agent, another run config): over.
                log.warning("discarding the unit's checkpoint and starting it over: %s", mismatch)
                checkpoint.unlink()
                restarted = True
                continue
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                oom = str(error).splitlines()[0]
            current = self._fall_back(current, oom, hooks)  # outside `except`: frames hold tensors

    def _fall_back(self, current: InnerConfig, oom: str, hooks: UnitHooks) -> InnerConfig:
        """The out-of-memory fallback: a smaller split of the same batch, on a model built
        again from an empty device."""
        smaller = smaller_micro_batch(current)
        self.drop()  # its optimizer state and compiled graphs: built again, smaller
        if smaller is None:
            raise DoesNotFit(
                f"out of memory on {self.device} even with one sequence per micro-batch "
                f"({oom}); this run needs a bigger device, or free the GPU of other processes"
            )
        log.warning("out of memory on %s (%s): micro-batch %d -> %d, accumulation %d -> %d",
                    self.device, oom, current.micro_batch_size, smaller.micro_batch_size,
                    current.grad_accum_steps, smaller.grad_accum_steps)  # fmt: skip
        if hooks.on_fallback is not None:
            hooks.on_fallback(current, smaller)
        return smaller  # the checkpoint names the batch, not its split: it resumes as is


def _step_hook(hooks: UnitHooks, inner: InnerConfig) -> StepHook | None:
    fault, on_step = hooks.fault, hooks.on_step
    if fault is None:
        return on_step

    def hook(metrics: StepMetrics) -> None:
        fault(metrics, inner)
        if on_step is not None:
            on_step(metrics)

    return hook


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()
