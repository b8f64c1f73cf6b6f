"""The demo's dense baselines: path-size models trained on the run's own tokens.

Two of `dipaco simulate`'s baselines (dipaco.simulate.baselines), trained by its
`fit_baseline`: the same model and inner optimiser from the weights every module starts
from, at the inner batch,

- at equal wall-clock (``dense-steps``): T·H AdamW steps, as many sequential steps as
  each path took (the DiPaCo paper's comparison), so it sees 1/(P·R) of the tokens;
- at equal tokens (``dense``): T·H·P·R steps, every token the workers trained on.

Each is trained with its own warm-up and cosine decay over its own length, so the shorter
is not a prefix of the longer: both are trained (the shorter costs 1/(P·R) of the longer).
Their data is the very token windows the run's work units train on
(rounds.services.data_window of every unit of every round), read as one shuffled stream
of sequences: at equal tokens both see each token once, at equal wall-clock the dense
model sees the first 1/(P·R) of that shuffle. Both are scored on the windows the server's
evaluation task scores (runs.evaluate.val_windows, the first windows of each path's
validation shard) with the same loss function, so their per-path figures sit beside the
run's ``val_loss`` points; the routed figure weighs paths by their validation tokens, as
the dashboard does.

Needs Django configured on the run's database (the demo process does: control.setup_django).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from dipaco.config import RunConfig
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
    """A run's tokens on local disk: what its units train on, what evaluation scores."""

    config: RunConfig
    units: list[Tensor]  # per unit (every round): its window, (H·B·T + 1,) int64
    val_windows: dict[int, Tensor]  # per path: (n, T + 1) int64, the server's eval windows
    val_tokens: dict[int, int]  # per path: its validation shard's tokens (routing weight)
    eval_batch_size: int


def fetch_run_data(run_id: int, work: Path) -> RunData:
    """Download the run's shards and cut the windows its units and evaluations use."""
    from dipaco.data.shards import ShardIndex, TokenShard
    from dipaco_server.rounds.services import data_window, unit_tokens
    from dipaco_server.runs import keys
    from dipaco_server.runs.evaluate import eval_settings, val_windows
    from dipaco_server.runs.models import Run
    from dipaco_server.runs.prepare import data_index_key
    from dipaco_server.storage import get_blob_store

    run = Run.objects.get(pk=run_id)
    config, store = run.run_config, get_blob_store()
    work.mkdir(parents=True, exist_ok=True)
    store.download_to(data_index_key(run_id), work / "index.json")
    dtype = ShardIndex.load(work).dtype
    settings = eval_settings(config)
    window = unit_tokens(config) + 1  # as rounds.services.open_round cuts them
    replicas = config.replicas_per_path
    units, val, weights = [], {}, {}
    for path in run.paths.order_by("index"):
        p = path.index
        for split in ("train", "val"):
            store.download_to(keys.data_key(run_id, p, split), work / f"{split}-{p}.bin")
        train = TokenShard(work / f"train-{p}.bin", dtype)
        for t in range(config.rounds):
            for r in range(replicas):
                offset, length = data_window(len(train), window, t, r, replicas)
                units.append(torch.from_numpy(train.read_window(offset, length)))
        if path.val_tokens > 1:
            shard = TokenShard(work / f"val-{p}.bin", dtype)
            count = settings.batches * settings.batch_size
            val[p] = val_windows(shard, config.model.seq_len, count)
            weights[p] = path.val_tokens
    shutil.rmtree(work, ignore_errors=True)
    return RunData(config, units, val, weights, settings.batch_size)


class UnitSequences:
    """dipaco.inner's TokenSource over every unit's sequences, in one seeded shuffle.

    Sequence i of a unit is tokens [i·T, i·T + T] of its window, as the worker reads it
    (worker_agent.trainer.WindowSource, wrapping in a window shorter than the unit).
    """

    def __init__(self, units: list[Tensor], sequences_per_unit: int, seq_len: int, seed: int):
        self.units, self.seq_len = units, seq_len
        count = len(units) * sequences_per_unit
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(count, generator=generator)  # (N,)
        self.unit = order // sequences_per_unit  # (N,)
        self.start = (order % sequences_per_unit) * seq_len  # (N,)

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        if seq_len != self.seq_len:
            raise ValueError(f"sequences cut for seq_len {self.seq_len}, asked for {seq_len}")
        rows = []
        for k in range(position, position + batch_size):
            k %= self.unit.numel()
            window = self.units[int(self.unit[k])]
            idx = (int(self.start[k]) + torch.arange(seq_len + 1)) % window.numel()  # (T+1,)
            rows.append(window[idx])
        return torch.stack(rows)  # (B, T+1)


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
    source = UnitSequences(
        data.units,
        config.inner.steps * config.inner.batch_size,
        config.model.seq_len,
        config.seed + SHUFFLE_SEED_OFFSET,
    )
    model, result = fit_baseline(
        config, source, baseline.name, on_step=on_step, should_stop=should_stop
    )
    if not result.completed:
        return None
    return DenseResult(
        baseline, model, dense_steps(config, baseline), result.tokens, result.losses[-1],
        time.perf_counter() - started,
    )  # fmt: skip


def path_losses(model: nn.Module, data: RunData) -> dict[int, float]:
    """Validation loss per path, exactly as the server's evaluation computes it."""
    from dipaco_server.runs.evaluate import mean_loss

    return {p: mean_loss(model, w, data.eval_batch_size) for p, w in data.val_windows.items()}


def initial_losses(data: RunData) -> dict[int, float]:
    """Every path before training: all start from the same seeded model (modular.init_modules)."""
    return path_losses(build_model(data.config.model, data.config.seed), data)


def routed(losses: dict[int, float], weights: dict[int, int]) -> float:
    """Mean of per-path losses weighted by validation tokens (the dashboard's routed loss)."""
    scored = [(loss, weights[p]) for p, loss in losses.items() if p in weights]
    total = sum(w for _, w in scored)
    if not total:
        return math.nan
    return sum(loss * w for loss, w in scored) / total


def window_tokens(windows: dict[int, Tensor]) -> int:
    return int(sum(np.prod(w[:, 1:].shape) for w in windows.values()))
