"""Evaluation, one home for the server, the worker side, the simulator and the demo.

Validation windows are non-overlapping (seq_len + 1)-token slices of a held-out stream;
a path's loss is the mean next-token cross-entropy over every scored target; the routed
mean weighs each path by the tokens it scored, so it is the loss of the routed model on
a uniform sample of all validation text (DiPaCo: each document is scored by the path it
routes to).

One validation sample (`sample_plan`): a run scores the same windows every time, chosen
once from the paths' validation token counts and the run's seed, stratified by path (each
path's share of the sample is its share of the validation windows) and drawn at random
within each path. The server's per-round evaluation (dipaco_server.runs.evaluate), the
demo's start and dense baselines (dipaco_demo.baseline), `dipaco simulate` and the quality
bench (PreparedData.val_windows) all score that plan, so a curve and a summary never
disagree about the same weights.

Its size, SAMPLE_WINDOWS = 1024 in all. The same weights on the same sample score the same
loss exactly, wherever they are scored; the size decides how far the sample's loss may sit
from the loss over all validation text, and how far two samples of the same weights
(phase 1's dense windows, phase 2's routed ones) may disagree. Measured on the tiny model
after 300 base steps on held-out stdlib text (1,500 windows of 128 tokens): a window's loss
has a standard deviation of 1.01 nats at a mean of 6.48 (0.156 of it), so the mean of n
windows has a relative standard error of 0.156 / sqrt(n): 2.8% at the former 32 windows per
path, 0.49% at 1024, within 1% of the whole text's loss at two standard errors (95%); two
independent samples of 1024 agree within 1% at 1.4 standard errors (85%). 2048 would buy
1.0 standard error more at twice the evaluation time. A larger model gets fewer windows
when ``eval.flops`` buys fewer (dipaco.flops: 291 of 1,024 tokens at the 150M preset).

Rotation (`eval_plan`), when the budget is too small for every path. A round's evaluation
scores `sample_size` windows in all; split over every path, a large grid leaves each too
few to stop it early (291 windows over the 16x16 grid's 256 paths: one each, a standard
error of 16% of the loss). When every path cannot have ``eval.min_path_windows`` (16: 3.9%
of the loss at the tiny model's spread) within the budget, a round scores only a group of
the paths, each on at least that many windows, and the groups take turns: with
g = floor(budget / minimum) paths a round, the scored paths fall into K = ceil(paths / g)
groups (path i of them in group i mod K) and round t scores group t mod K, so every path is
scored every K rounds (at the 150M preset's 291 windows on 16x16: 17 or 18 paths a round on
16 to 18 windows each, all 291 windows, every path every 15 rounds). A path is scored on the same
windows each time, so its curve moves only when its weights do. When every path fits (the
tiny and capacity presets up to 64 paths), the plan is `sample_plan`'s and K = 1: every path
every round, exactly as without rotation. Early stopping reads a rotated curve in the
path's own evaluations (dipaco_server.runs.evaluate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from dipaco.flops import budget_windows

if TYPE_CHECKING:
    from torch import Tensor, nn

# torch and numpy are imported inside the functions that use them: the server's processes
# import this module (perplexity, weighted_mean) at their start, and torch takes seconds.

__all__ = [
    "EvalPlan",
    "PathLoss",
    "ValWindows",
    "eval_plan",
    "evaluate_model",
    "mean_loss",
    "perplexity",
    "routed_mean",
    "sample_plan",
    "sample_shard",
    "sample_size",
    "sample_streams",
    "standard_error",
    "stream_windows",
    "weighted_mean",
    "window_losses",
]

EVAL_BATCH = 16  # windows per forward pass; only memory depends on it
SAMPLE_WINDOWS = 1024  # the validation sample's windows in all (module docstring: why)
SAMPLE_SEED_OFFSET = 7907  # the sample's generator is its own, not the data order's
MIN_PATH_WINDOWS = 16  # eval.min_path_windows' default: windows a path needs to be scored


def perplexity(loss: float | None) -> float | None:
    """exp(loss), the one perplexity helper of the project. None stays None (a path without
    validation text), and so does a NaN loss; exp is capped at exp(700), which a float
    holds, so a diverged run still reports a number (JSON has no infinity)."""
    if loss is None or math.isnan(loss):
        return None
    return math.exp(min(loss, 700.0))


@dataclass(frozen=True)
class ValWindows:
    per_path: list[Tensor]  # per path: (n_p, seq_len + 1) int64, n_p may be 0
    seq_len: int

    @property
    def tokens(self) -> list[int]:
        """Tokens scored per path (every window scores seq_len targets)."""
        return [int(w.shape[0]) * self.seq_len for w in self.per_path]


@dataclass(frozen=True)
class PathLoss:
    path: int
    loss: float | None  # None when the path has no validation window
    tokens: int

    @property
    def perplexity(self) -> float | None:
        return perplexity(self.loss)


def stream_windows(stream: Tensor, seq_len: int) -> Tensor:
    """Every non-overlapping (seq_len + 1)-token window of a 1-D token tensor: (n, T+1)."""
    # torch and numpy: the note under the imports
    import torch

    count = max(0, (stream.numel() - 1) // seq_len)
    starts = torch.arange(count) * seq_len  # (n,)
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]  # (n, T+1)


def sample_size(config: Any) -> int:
    """Windows in a run's validation sample: SAMPLE_WINDOWS, or more when the run's
    ``eval.batches x eval.batch_size`` asks for more, or fewer when ``eval.flops`` buys
    fewer at its model's size (dipaco.flops)."""
    most = max(SAMPLE_WINDOWS, config.eval.batches * config.eval.batch_size)
    return budget_windows(config.eval.flops, config.model, most)


def window_count(tokens: int, seq_len: int) -> int:
    """Non-overlapping (seq_len + 1)-token windows in a stream of `tokens` tokens."""
    return max(0, (tokens - 1) // seq_len)


def sample_plan(tokens: Sequence[int], seq_len: int, count: int, seed: int) -> list[list[int]]:
    """Per path, the sorted indices of the windows in the run's validation sample.

    `tokens` is each path's validation token count (the server's Path.val_tokens). Path
    p gets about count x n_p / N of its n_p windows (at least one when it has any, never
    more than it has, the rest by largest remainders), drawn without replacement by a
    generator seeded with `seed`: the same counts and seed give the same plan on the
    server, in the demo and in the simulator.
    """
    # torch and numpy: the note under the imports
    import torch

    if count < 1:
        raise ValueError(f"eval windows = {count}: need at least 1")
    have = [window_count(n, seq_len) for n in tokens]
    total = sum(have)
    if total == 0:
        raise ValueError(
            f"validation text holds no window of {seq_len + 1} tokens; raise "
            "data.val_fraction (--val-fraction) or the budget (--max-docs)"
        )
    exact = [count * n / total for n in have]
    # At least one window of every path that has any (a path without one has no curve).
    quota = [max(min(n, int(e)), 1) if n else 0 for n, e in zip(have, exact, strict=True)]
    by_remainder = sorted(range(len(have)), key=lambda p: (quota[p] - exact[p], p))
    for p in by_remainder:  # largest remainders first, until the sample is full
        if sum(quota) >= min(count, total):
            break
        if quota[p] < have[p]:
            quota[p] += 1
    generator = torch.Generator().manual_seed(seed + SAMPLE_SEED_OFFSET)
    plan = []
    for n, q in zip(have, quota, strict=True):
        chosen = torch.randperm(n, generator=generator)[:q] if n else torch.zeros(0)
        plan.append(sorted(int(i) for i in chosen))
    return plan


@dataclass(frozen=True)
class EvalPlan:
    """Which paths a round scores, and on which windows (`eval_plan`)."""

    windows: list[list[int]]  # per path: the sorted windows it is scored on, every time
    groups: list[list[int]]  # the paths scored together; round t scores groups[t % K]

    @property
    def every(self) -> int:
        """K: a path is scored every K rounds (1: every path every round)."""
        return len(self.groups)

    @property
    def rotated(self) -> bool:
        return self.every > 1

    def paths_at(self, t: int) -> list[int]:
        """The paths round t scores (those with windows)."""
        return [p for p in self.groups[t % self.every] if self.windows[p]]

    def round_windows(self, t: int) -> int:
        """Windows round t scores in all (at most the budget)."""
        return sum(len(self.windows[p]) for p in self.paths_at(t))


def rotation_every(tokens: Sequence[int], seq_len: int, count: int, minimum: int) -> int:
    """K of `eval_plan` without drawing a window: 1 when every path with a window can have
    `minimum` of the `count` a round, else ceil(paths / floor(count / minimum))."""
    scored = sum(1 for n in tokens if window_count(n, seq_len))
    per_round = max(1, count // max(1, minimum))
    return 1 if scored <= per_round else math.ceil(scored / per_round)


def eval_plan(tokens: Sequence[int], seq_len: int, count: int, minimum: int, seed: int) -> EvalPlan:
    """The paths each round scores and their windows, `count` windows a round at most
    (module docstring: Rotation).

    When every path with a window can have `minimum` of them (paths x minimum <= count),
    the windows are `sample_plan`'s and one group holds every path: each round scores every
    path, as the unrotated evaluation does. Otherwise the paths with windows are dealt into
    K groups (the i-th into group i mod K) of at most floor(count / minimum) paths, and each
    path of a group of s paths gets floor(count / s) windows (one more for the first
    count mod s of them), never more than it has, drawn without replacement by a generator
    seeded with `seed`: at least `minimum` each (all it has when it has fewer), and at most
    `count` in a round. A budget under `minimum` scores one path a round on all of it.
    """
    # torch and numpy: the note under the imports
    import torch

    every = rotation_every(tokens, seq_len, count, minimum)
    if every == 1:
        plan = sample_plan(tokens, seq_len, count, seed)
        return EvalPlan(plan, [list(range(len(tokens)))])
    have = [window_count(n, seq_len) for n in tokens]
    scored = [p for p, n in enumerate(have) if n]
    groups = [scored[g::every] for g in range(every)]
    quota = [0] * len(have)
    for group in groups:
        share, extra = divmod(count, len(group))
        for i, p in enumerate(group):
            quota[p] = min(have[p], share + (1 if i < extra else 0))
    generator = torch.Generator().manual_seed(seed + SAMPLE_SEED_OFFSET)
    windows = []
    for n, q in zip(have, quota, strict=True):
        chosen = torch.randperm(n, generator=generator)[:q] if n else torch.zeros(0)
        windows.append(sorted(int(i) for i in chosen))
    return EvalPlan(windows, groups)


def sample_streams(streams: Sequence[Tensor], seq_len: int, count: int, seed: int) -> ValWindows:
    """The validation sample (`sample_plan`) cut from per-path token streams in memory."""
    plan = sample_plan([int(s.numel()) for s in streams], seq_len, count, seed)
    per_path = []
    for stream, indices in zip(streams, plan, strict=True):
        every = stream_windows(stream, seq_len)  # (n, T+1)
        per_path.append(every[indices].contiguous())  # (q, T+1)
    return ValWindows(per_path, seq_len)


def sample_shard(shard: Any, seq_len: int, indices: Sequence[int]) -> Tensor:
    """(q, T+1) int64: the windows `indices` (a `sample_plan` row) of a validation shard
    (a dipaco.data.shards.TokenShard, or a dipaco.data.ranged.RangedShard read by ranges)."""
    # torch and numpy: the note under the imports
    import numpy as np
    import torch

    if not indices:
        return torch.zeros((0, seq_len + 1), dtype=torch.int64)
    rows = shard.read_windows([i * seq_len for i in indices], seq_len + 1)  # (q, T+1)
    return torch.from_numpy(np.ascontiguousarray(rows)).to(torch.int64)


def window_losses(model: nn.Module, windows: Tensor, batch_size: int = EVAL_BATCH) -> Tensor:
    """Mean next-token cross-entropy of each window, (n,) float64 on the CPU."""
    # torch and numpy: the note under the imports
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size].to(device)  # (B, T+1)
            inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)
            logits = cast(Any, model)(input_ids=inputs).logits.float()  # (B, T, V)
            loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T)
            out.append(loss.mean(dim=1).double().cpu())  # (B,)
    if was_training:
        model.train()
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def mean_loss(model: nn.Module, windows: Tensor, batch_size: int = EVAL_BATCH) -> float:
    """Mean next-token cross-entropy over every target of `windows` (every window scores
    the same seq_len targets, so this is the mean of the windows' means), in float64."""
    return float(window_losses(model, windows, batch_size).mean())


def standard_error(losses: Tensor) -> float | None:
    """The standard error of the mean of per-window losses (`window_losses`): their sample
    standard deviation over sqrt(n); None under two windows (no spread to measure)."""
    n = int(losses.numel())
    if n < 2:
        return None
    return float(losses.double().std(unbiased=True)) / math.sqrt(n)


def evaluate_model(
    model: nn.Module, windows: ValWindows, paths: Sequence[int] | None = None
) -> list[PathLoss]:
    """One model on the windows of `paths` (default all): a dense baseline scores every
    path's windows with the same weights; DiPaCo loads each path before calling this."""
    chosen = range(len(windows.per_path)) if paths is None else paths
    results = []
    for p in chosen:
        w = windows.per_path[p]
        loss = mean_loss(model, w) if w.shape[0] else None
        results.append(PathLoss(p, loss, int(w.shape[0]) * windows.seq_len))
    return results


def routed_mean(losses: Sequence[PathLoss]) -> float:
    """Token-weighted mean loss over paths (paths without validation windows weigh 0)."""
    return weighted_mean(
        {x.path: x.loss for x in losses if x.loss is not None}, {x.path: x.tokens for x in losses}
    )


def weighted_mean(losses: Mapping[int, float], weights: Mapping[int, int]) -> float:
    """Per-path losses weighted by each path's validation tokens: the routed loss (the
    dashboard's, the demo's); NaN when no path with a loss has a weight."""
    scored = [(loss, weights[p]) for p, loss in losses.items() if p in weights]
    total = sum(w for _, w in scored)
    if not total:
        return math.nan
    return sum(loss * w for loss, w in scored) / total
