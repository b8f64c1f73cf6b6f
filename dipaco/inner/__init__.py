"""The inner loop: H AdamW steps on one path, returning the pseudo-gradient Δ = θ_old − θ_new.

One loop for the worker agent, `dipaco simulate` and the benches (dipaco.inner.loop):
linear warm-up then cosine decay, global-norm clipping, gradient accumulation, bf16
autocast over fp32 master weights and AdamW moments on CUDA; compiled, fused AdamW,
a chunked loss (dipaco.inner.loss) and no host synchronisation per step there.
Checkpoints (dipaco.inner.checkpoint) are taken by steps or by time, snapshotted to host
memory and written atomically in the background; resuming one on the CPU continues bit
for bit.

DiLoCo keeps each replica's inner AdamW state from one outer round to the next and never
sends it. `train_path` takes that state (an `InnerState`, or None for a fresh optimiser)
and returns the new one in `InnerResult.state`; the worker agent keeps one per (run, path)
on disk and the simulator one per (path, replica) in memory, through the same calls.
`InnerState` follows torchtitan's `Stateful` pattern (`state_dict` / `load_state_dict`)
and is keyed by parameter name, so it survives a change of micro-batch or device.
`PathTrainer` (dipaco.inner.trainer) keeps one model per run architecture resident on the
device across units; `ResidentTrainer` trains unit after unit on it with the micro-batch
fitted to the device (dipaco.inner.fit) and the out-of-memory fallback.
"""

from dipaco.inner.checkpoint import CHECKPOINT_FORMAT, checkpoint_identity
from dipaco.inner.fit import (
    DoesNotFit,
    Precision,
    fit_micro_batch,
    is_out_of_memory,
    precision_for,
    smaller_micro_batch,
)
from dipaco.inner.loop import REPORT_EVERY_CUDA, run_inner_loop
from dipaco.inner.state import (
    STATE_FORMAT,
    CheckpointMismatch,
    InMemoryTokenSource,
    InnerResult,
    InnerState,
    StepMetrics,
    TokenSource,
    lr_at,
    state_fingerprint,
)
from dipaco.inner.trainer import (
    CHECKPOINT_NAME,
    DEFAULT_CHECKPOINT_INTERVAL_S,
    PathTrainer,
    ResidentTrainer,
    UnitHooks,
    UnitWork,
    path_shift,
    train_path,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "DEFAULT_CHECKPOINT_INTERVAL_S",
    "REPORT_EVERY_CUDA",
    "STATE_FORMAT",
    "CheckpointMismatch",
    "DoesNotFit",
    "InMemoryTokenSource",
    "InnerResult",
    "InnerState",
    "PathTrainer",
    "Precision",
    "ResidentTrainer",
    "StepMetrics",
    "TokenSource",
    "UnitHooks",
    "UnitWork",
    "checkpoint_identity",
    "fit_micro_batch",
    "is_out_of_memory",
    "lr_at",
    "path_shift",
    "precision_for",
    "run_inner_loop",
    "smaller_micro_batch",
    "state_fingerprint",
    "train_path",
]
