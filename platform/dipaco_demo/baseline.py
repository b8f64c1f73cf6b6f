"""The demo's dense baselines: path-size models trained on the run's own tokens.

Two of `dipaco simulate`'s baselines (dipaco.simulate.baselines), trained by its
`fit_baseline`: the same model and inner optimiser from the weights every module of phase 2
starts from, at the inner batch,

- at equal wall-clock (``dense-steps``): T·H AdamW steps, as many sequential steps as
  each path took in phase 2 (the DiPaCo paper's comparison), so it sees 1/(P·R) of the
  tokens;
- at equal tokens (``dense``): T·H·P·R steps, every token the workers trained on in phase 2.

A head start for both sides. With a phase 1 (RunConfig.phase1) every DiPaCo module starts
from the dense model the volunteers trained first, and so do both baselines: they load that
model (the server's ``runs/<run>/base/model.safetensors``, runs.checkpoint) and train phase
2's step and token budgets from it. Phase 1's steps and tokens are then the same on both
sides, so leaving them out of both counts changes no ratio; the comparison is what DiPaCo's
phase 2 makes of the phase-1 model against what dense training makes of it (as `dipaco
simulate --base-steps` does). Without a phase 1 both start from the seeded initial weights.

Each is trained with its own warm-up and cosine decay over its own length, so the shorter
is not a prefix of the longer: both are trained (the shorter costs 1/(P·R) of the longer).
Their data is the very windows the run's phase-2 work units train on (dipaco.data.windows:
unit (t, r) of path p reads positions unit_start(t, r) onwards of the path's seeded
shuffled window order, as the worker does), read as one shuffled stream of sequences: at
equal tokens both see each token once, at equal wall-clock the dense model sees the first
1/(P·R) of that shuffle. Both are scored on the windows the server's evaluation task scores
(runs.evaluate.run_sample: the run's validation sample, as the server scores it) with the
same loss function, so their per-path figures sit beside the run's ``val_loss`` points; the
routed figure weighs paths by their validation tokens, as the dashboard does.

Needs Django configured on the run's database (the demo process does: control.setup_django).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from dipaco.config import RunConfig
from dipaco.data.shards import ShardIndex, TokenShard
from dipaco.data.windows import RowSource, ShardSource, unit_start, unit_windows
from dipaco.evaluate import mean_loss, sample_shard
from dipaco.inner import StepMetrics
from dipaco.model import build_model
from dipaco.simulate.baselines import baseline_steps, fit_baseline

SHUFFLE_SEED_OFFSET = 104729  # the baselines' own order of the sequences


@dataclass(frozen=True)
class DenseBaseline:
    """A dense model DiPaCo is compared with: what it shares with the run, and its name."""

    key: str  # in the summary's JSON
    equal: str  # what is the same as DiPaCo's, as the summary says it
    name: str  # in dipaco.simulate.baselines


EQUAL_WALL_CLOCK = DenseBaseline("equal_wall_clock", "wall-clock", "dense-steps")
EQUAL_TOKENS = DenseBaseline("equal_tokens", "tokens", "dense")
DENSE_BASELINES = (EQUAL_WALL_CLOCK, EQUAL_TOKENS)  # the order they are trained in


@dataclass
class RunData:
    """A run's phase-2 tokens on local disk: what its units train on, what evaluation scores."""

    config: RunConfig
    units: list[Tensor]  # per phase-2 unit (every round): its windows, (H·B, T+1) int64
    val_windows: dict[int, Tensor]  # per path: (n, T+1) int64, the server's eval windows
    val_tokens: dict[int, int]  # per path: its validation shard's tokens (routing weight)
    eval_batch_size: int
    # The dense model every phase-2 module starts from (phase 1's last weights), full state
    # dict; None when the modules start from the seeded initial weights.
    base_state: dict[str, Tensor] | None = None


def fetch_run_data(run_id: int, work: Path, *, units: bool = True) -> RunData:
    """Download phase 2's shards (and the base model, if any) and cut the windows its units
    and evaluations use; `units=False` skips the training windows (no baselines)."""
    # The server's models (once control.setup_django ran) and torch (seconds): only the
    # baselines need them.
    from dipaco_server.runs import keys
    from dipaco_server.runs.checkpoint import load_base_state
    from dipaco_server.runs.evaluate import eval_settings, run_sample
    from dipaco_server.runs.models import Run
    from dipaco_server.runs.phases import PATHS
    from dipaco_server.runs.prepare import data_index_key
    from dipaco_server.storage import get_blob_store

    run = Run.objects.get(pk=run_id)
    config, store = run.run_config, get_blob_store()
    work.mkdir(parents=True, exist_ok=True)
    store.download_to(data_index_key(run_id), work / "index.json")
    dtype = ShardIndex.load(work).dtype
    settings = eval_settings(config)
    windows, seq_len = unit_windows(config), config.model.seq_len
    found, val, weights = [], {}, {}
    try:
        paths = list(run.paths.filter(phase=PATHS).order_by("index"))
        # The server's validation sample (runs.evaluate.run_sample), path by path.
        plan = dict(
            zip(
                [x.index for x in paths],
                run_sample(config, [x.val_tokens for x in paths]),
                strict=True,
            )
        )
        for path in paths:
            p = path.index
            for split in ("train", "val") if units else ("val",):
                store.download_to(keys.data_key(run_id, p, split), work / f"{split}-{p}.bin")
            if units:
                source = ShardSource.for_path(TokenShard(work / f"train-{p}.bin", dtype), config, p)
                for t in range(config.rounds):  # phase 2's rounds, counted from 0 (as units)
                    for r in range(config.replicas_per_path):
                        start = unit_start(config, t, r)
                        found.append(source.batch(start, windows, seq_len).to(torch.int64))
            if plan[p]:
                val[p] = sample_shard(TokenShard(work / f"val-{p}.bin", dtype), seq_len, plan[p])
                weights[p] = path.val_tokens
        base = None
        if store.exists(keys.base_model_key(run_id)):
            base = load_base_state(store, run_id, config, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return RunData(config, found, val, weights, settings.batch_size, base)


@dataclass
class DenseResult:
    baseline: DenseBaseline
    model: nn.Module
    steps: int
    tokens: int
    train_loss: float
    seconds: float


def dense_steps(config: RunConfig, baseline: DenseBaseline) -> int:
    return baseline_steps(config, baseline.name)[0]


def train_dense(
    data: RunData,
    baseline: DenseBaseline,
    *,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> DenseResult | None:
    """One dense baseline, or None when `should_stop` ended it early."""
    config = data.config
    started = time.perf_counter()
    source = RowSource(torch.cat(data.units), config.seed + SHUFFLE_SEED_OFFSET)
    model, result = fit_baseline(
        config, source, baseline.name, on_step=on_step, should_stop=should_stop,
        base_state=data.base_state,
    )  # fmt: skip
    if not result.completed:
        return None
    return DenseResult(
        baseline, model, dense_steps(config, baseline), result.tokens, result.losses[-1],
        time.perf_counter() - started,
    )  # fmt: skip


def path_losses(model: nn.Module, data: RunData) -> dict[int, float]:
    """Validation loss per path, exactly as the server's evaluation computes it."""
    return {p: mean_loss(model, w, data.eval_batch_size) for p, w in data.val_windows.items()}


def initial_losses(data: RunData) -> dict[int, float]:
    """Every path before any training: the seeded model phase 1 (or, without one, every
    module) starts from (modular.init_modules)."""
    return path_losses(build_model(data.config.model, data.config.seed), data)


def start_losses(data: RunData) -> dict[int, float]:
    """Every path at the start of phase 2: the phase-1 model all modules are copied from
    (modular.init_modules_from_base), or the seeded model when there is no phase 1."""
    if data.base_state is None:
        return initial_losses(data)
    model = build_model(data.config.model, data.config.seed)
    model.load_state_dict(data.base_state)
    return path_losses(model, data)
