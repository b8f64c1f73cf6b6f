"""One work unit's training: the library's inner loop plus what a volunteer machine needs.

`train_unit` wraps `dipaco.inner.train_path` with
- a resident trainer (`ResidentTrainer`): one `dipaco.inner.PathTrainer` per run
  architecture and compile choice, kept on the device across units (built again when a
  unit's config does not match it, and after an out-of-memory fallback);
- the unit's windows of its path's train shard, read in the path's seeded shuffled order
  from the unit's start position (dipaco.data.windows.ShardSource, as the simulator);
- warm inner state per (run, path): `InnerStates` keeps the `dipaco.inner.InnerState`
  that `train_path` returns (AdamW moments by parameter name, and the codec's
  error-feedback residual) in the agent's cache, and hands it to the path's next unit;
- checkpoints by time (and/or every N steps) in the unit's work directory, written in
  the background by the library, resumed after a crash (the library's own
  `checkpoint_path`, which takes precedence over the warm state);
- the out-of-memory fallback: half the micro-batch, twice the accumulation, so the
  effective batch (and the Δ's meaning) is unchanged; it resumes from the last
  checkpoint (whose identity names the batch, not its split) and logs why. At one
  sequence per micro-batch it gives up (OutOfMemory).

The agent saves a path's new state only once the unit's completion was accepted
(worker_agent.agent): an abandoned unit (stopped, lease lost, refused) leaves the path's
state as the last accepted unit left it. Its moments then never saw gradients whose Δ
the server did not apply, and the residual stays the error of the last Δ the server
received; keeping the abandoned unit's residual would drop that error for good.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dipaco.config import GiB, InnerConfig, RunConfig, estimate_path_memory
from dipaco.inner import (
    CheckpointMismatch,
    InnerResult,
    InnerState,
    PathTrainer,
    StepMetrics,
    state_fingerprint,
    train_path,
)
from worker_agent.errors import OutOfMemory

__all__ = [
    "InnerStates",
    "ResidentTrainer",
    "UnitWork",
    "fit_micro_batch",
    "is_out_of_memory",
    "train_unit",
]

log = logging.getLogger(__name__)
CHECKPOINT_NAME = "inner.safetensors"
Fault = Callable[[StepMetrics, InnerConfig], None]  # tests inject failures through this


class InnerStates:
    """The warm `InnerState` of each (run, path) under ``<root>/run-<id>/path-<p>.safetensors``.

    Written with `InnerState.save` (atomic) and read with `InnerState.load`, which returns
    None for a missing, torn or foreign file, or one made for another model or other betas
    (`dipaco.inner.state_fingerprint`): the unit then starts with fresh moments.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, run_id: int, path: int) -> Path:
        return self.root / f"run-{int(run_id)}" / f"path-{int(path)}.safetensors"

    def load(self, run_id: int, path: int, config: RunConfig) -> InnerState | None:
        return InnerState.load(self.path_for(run_id, path), state_fingerprint(config))

    def save(self, run_id: int, path: int, state: InnerState) -> None:
        if state.adam:  # a unit that never stepped has nothing worth keeping
            state.save(self.path_for(run_id, path))


class ResidentTrainer:
    """The agent's one `PathTrainer` on `device`: built (and compiled, per `compile`: None
    lets the library decide, on CUDA only) for the first unit, kept for the next ones while
    `PathTrainer.matches` their config, built again when it does not. `drop` frees it (an
    out-of-memory fallback: the next build starts from an empty device)."""

    def __init__(self, device: torch.device, compile: bool | None = None) -> None:
        self.device, self.compile = device, compile
        self.trainer: PathTrainer | None = None
        self.builds = 0  # how many PathTrainers it built (tests, logs)

    def for_config(self, config: RunConfig) -> PathTrainer:
        if self.trainer is None or not self.trainer.matches(config):
            if self.trainer is not None:
                log.info("a run of another architecture: building its model on %s", self.device)
                self.drop()
            self.trainer = PathTrainer(config, self.device, compile=self.compile)
            self.builds += 1
        return self.trainer

    def drop(self) -> None:
        self.trainer = None
        _free_memory(self.device)


@dataclass
class UnitWork:
    config: RunConfig
    run_id: int
    path: int
    round_index: int
    modules: dict[str, dict[str, Tensor]]
    source: Any  # a dipaco.inner.TokenSource: the path's ShardSource on the platform
    start_position: int = 0  # the unit's first window in the source (dipaco.data.windows)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def smaller_micro_batch(inner: InnerConfig) -> InnerConfig | None:
    """The largest micro-batch below half that divides the current one; None at 1."""
    micro = inner.micro_batch_size
    smaller = next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)
    if smaller is None:
        return None
    accum = inner.grad_accum_steps * (micro // smaller)
    return inner.model_copy(update={"micro_batch_size": smaller, "grad_accum_steps": accum})


def fit_micro_batch(
    config: RunConfig, budget_bytes: int | None, device: str = "cpu"
) -> InnerConfig:
    """Shrink the micro-batch until the library's memory estimate for `device` (its type:
    "cuda" trains in bf16 with a chunked loss) fits the budget."""
    inner = config.inner
    if budget_bytes is None:
        return inner
    while estimate_path_memory(config.model, inner, device=device).total_bytes > budget_bytes:
        smaller = smaller_micro_batch(inner)
        if smaller is None:
            need = estimate_path_memory(config.model, inner, device=device).total_bytes / GiB
            raise OutOfMemory(
                f"this run needs about {need:.1f} GiB even with one sequence per micro-batch; "
                f"the memory budget is {budget_bytes / GiB:.1f} GiB (raise --memory-cap or "
                "use a bigger device)"
            )
        inner = smaller
    if inner != config.inner:
        log.info("micro-batch %d -> %d to fit the memory budget (same effective batch)",
                 config.inner.micro_batch_size, inner.micro_batch_size)  # fmt: skip
    return inner


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def train_unit(
    work: UnitWork,
    *,
    device: torch.device,
    work_dir: Path,
    state: InnerState | None = None,
    inner: InnerConfig | None = None,
    stop_at: int | None = None,
    checkpoint_every: int | None = None,
    checkpoint_interval_s: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
    on_fallback: Callable[[InnerConfig, InnerConfig], None] | None = None,
    fault: Fault | None = None,
    rebase: Callable[[int], Mapping[str, Tensor] | None] | None = None,
    trainer: ResidentTrainer | PathTrainer | None = None,
) -> tuple[InnerResult, InnerConfig]:
    """Train the unit (resuming its checkpoint if any) from the path's warm `state` (None:
    fresh AdamW); returns the result, whose `state` is the path's next one, and the inner
    config it finished with (the micro-batch may have shrunk). `stop_at`: the unit's
    length, the loop's bound counted from its start (the lease's `steps`; None: H).
    `rebase`: outer.overlap
    eager's hook (worker_agent.rebase), `dipaco.inner.run_inner_loop`'s. `trainer`: the
    agent's resident trainer (on `device`), or a PathTrainer to use as it is (benches);
    None builds a model for this unit alone."""
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / CHECKPOINT_NAME
    current = inner or work.config.inner
    if state is not None and not checkpoint.exists():
        log.info("path %d: continuing its inner state from its last unit", work.path)
    restarted = False
    while True:
        config = work.config.model_copy(update={"inner": current})
        step_hook = on_step
        if fault is not None:
            step_hook = _with_fault(on_step, fault, current)
        try:
            resident = (
                trainer.for_config(config) if isinstance(trainer, ResidentTrainer) else trainer
            )
            result = train_path(
                config, work.path, work.modules, work.source,
                round_index=work.round_index, start_position=work.start_position,
                stop_at=stop_at, device=device, checkpoint_path=checkpoint,
                checkpoint_every=checkpoint_every, checkpoint_interval_s=checkpoint_interval_s,
                should_stop=should_stop,
                on_step=step_hook, state=state, rebase=rebase, trainer=resident,
            )  # fmt: skip
        except CheckpointMismatch as mismatch:
            if restarted:
                raise
            # Written with other settings (an older agent, another run config): start over.
            log.warning("discarding the unit's checkpoint and starting it over: %s", mismatch)
            checkpoint.unlink()
            restarted = True
            continue
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            oom = str(error).splitlines()[0]
        else:
            break
        smaller = smaller_micro_batch(current)  # outside `except`: its frames hold tensors
        resident = None
        if isinstance(trainer, ResidentTrainer):
            trainer.drop()  # its optimizer state and compiled graphs: built again, smaller
        _free_memory(device)
        if smaller is None:
            raise OutOfMemory(
                f"out of memory on {device} even with one sequence per micro-batch ({oom}); "
                "this run needs a bigger device, or free the GPU of other processes"
            )
        log.warning("out of memory on %s (%s): micro-batch %d -> %d, accumulation %d -> %d",
                    device, oom, current.micro_batch_size, smaller.micro_batch_size,
                    current.grad_accum_steps, smaller.grad_accum_steps)  # fmt: skip
        if on_fallback is not None:
            on_fallback(current, smaller)
        current = smaller  # the checkpoint names the batch, not its split: it resumes as is
    return result, current


def _with_fault(
    on_step: Callable[[StepMetrics], None] | None, fault: Fault, inner: InnerConfig
) -> Callable[[StepMetrics], None]:
    def hook(metrics: StepMetrics) -> None:
        fault(metrics, inner)
        if on_step is not None:
            on_step(metrics)

    return hook
