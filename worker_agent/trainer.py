"""One work unit's training: the library's inner loop plus what a volunteer machine needs.

`train_unit` wraps `dipaco.inner.train_path` with
- a token source over the downloaded data window (`WindowSource`);
- warm AdamW state per (run, path) (worker_agent.warm_start);
- a checkpoint every N steps in the unit's work directory, resumed after a crash;
- the out-of-memory fallback: half the micro-batch, twice the accumulation, so the
  effective batch (and the Δ's meaning) is unchanged; it resumes from the last
  checkpoint and logs why. At one sequence per micro-batch it gives up (OutOfMemory).
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dipaco.config import GiB, InnerConfig, RunConfig, estimate_path_memory
from dipaco.inner import CheckpointMismatch, InnerResult, StepMetrics, train_path
from dipaco.modular import assemble_path_state
from worker_agent.errors import OutOfMemory
from worker_agent.warm_start import (
    OptimizerStates,
    inner_identity,
    read_adam_state,
    retarget,
    write_seed,
)

__all__ = ["UnitWork", "WindowSource", "fit_micro_batch", "is_out_of_memory", "train_unit"]

log = logging.getLogger(__name__)
CHECKPOINT_NAME = "inner.safetensors"
Fault = Callable[[StepMetrics, InnerConfig], None]  # tests inject failures through this


class WindowSource:
    """The unit's token window as the inner loop's TokenSource (positions count sequences)."""

    def __init__(self, path: Path, dtype: str) -> None:
        from dipaco.data.shards import TokenShard

        self.shard = TokenShard(path, np.dtype(dtype))

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        # Sequence i starts at token i x T; TokenShard.batch takes a token offset. Its rows
        # view the read-only memory map, which torch warns about; they are only read.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return self.shard.batch(position * seq_len, batch_size, seq_len)  # (B, T + 1)


@dataclass
class UnitWork:
    config: RunConfig
    run_id: int
    path: int
    round_index: int
    modules: dict[str, dict[str, Tensor]]
    source: Any  # a dipaco.inner.TokenSource


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


def fit_micro_batch(config: RunConfig, budget_bytes: int | None) -> InnerConfig:
    """Shrink the micro-batch until the library's memory estimate fits the budget."""
    inner = config.inner
    if budget_bytes is None:
        return inner
    while estimate_path_memory(config.model, inner).total_bytes > budget_bytes:
        smaller = smaller_micro_batch(inner)
        if smaller is None:
            need = estimate_path_memory(config.model, inner).total_bytes / GiB
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
    optimizer_states: OptimizerStates | None,
    inner: InnerConfig | None = None,
    checkpoint_every: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
    on_fallback: Callable[[InnerConfig, InnerConfig], None] | None = None,
    fault: Fault | None = None,
) -> tuple[InnerResult, InnerConfig]:
    """Train the unit (resuming its checkpoint if any); returns the result and the inner
    config it finished with (the micro-batch may have shrunk)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / CHECKPOINT_NAME
    current = inner or work.config.inner
    if not checkpoint.exists() and optimizer_states is not None:
        adam = optimizer_states.load(work.run_id, work.path, work.config)
        if adam is not None:
            config = work.config.model_copy(update={"inner": current})
            write_seed(
                checkpoint, _parameters(work), adam, inner_identity(config, work.round_index)
            )
            log.info("path %d: continuing its AdamW state from the last unit", work.path)
    restarted = False
    while True:
        config = work.config.model_copy(update={"inner": current})
        step_hook = on_step
        if fault is not None:
            step_hook = _with_fault(on_step, fault, current)
        try:
            result = train_path(
                config, work.path, work.modules, work.source,
                round_index=work.round_index, device=device, checkpoint_path=checkpoint,
                checkpoint_every=checkpoint_every, should_stop=should_stop, on_step=step_hook,
            )  # fmt: skip
        except CheckpointMismatch as mismatch:
            if restarted:
                raise
            # Written with other settings (another --memory-cap, an older agent): start over.
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
        if checkpoint.exists():
            smaller_config = work.config.model_copy(update={"inner": smaller})
            retarget(checkpoint, inner_identity(smaller_config, work.round_index))
        current = smaller
    if result.completed and optimizer_states is not None:
        optimizer_states.save(work.run_id, work.path, work.config, read_adam_state(checkpoint))
    return result, current


def _parameters(work: UnitWork) -> dict[str, Tensor]:
    """The path's named parameters (a tied LM head is the embedding: not a parameter)."""
    state = assemble_path_state(work.config, work.path, work.modules)
    if work.config.model.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _with_fault(
    on_step: Callable[[StepMetrics], None] | None, fault: Fault, inner: InnerConfig
) -> Callable[[StepMetrics], None]:
    def hook(metrics: StepMetrics) -> None:
        fault(metrics, inner)
        if on_step is not None:
            on_step(metrics)

    return hook
