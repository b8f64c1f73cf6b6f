"""Evaluation, one home for the server, the worker side, the simulator and the demo.

Validation windows are non-overlapping (seq_len + 1)-token slices of a held-out stream;
a path's loss is the mean next-token cross-entropy over every scored target; the routed
mean weighs each path by the tokens it scored, so it is the loss of the routed model on
a uniform sample of all validation text (DiPaCo: each document is scored by the path it
routes to). The server's per-round evaluation (dipaco_server.runs.evaluate), `dipaco
simulate` (spread_windows over its prepared data) and the demo's
dense baselines all score through these functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch import Tensor, nn

# torch and numpy are imported inside the functions that use them: the server's processes
# import this module (perplexity, weighted_mean) at their start, and torch takes seconds.

__all__ = [
    "PathLoss",
    "ValWindows",
    "evaluate_model",
    "mean_loss",
    "perplexity",
    "routed_mean",
    "shard_windows",
    "spread_windows",
    "stream_windows",
    "weighted_mean",
    "window_losses",
]

EVAL_BATCH = 16  # windows per forward pass; only memory depends on it


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
    import torch

    count = max(0, (stream.numel() - 1) // seq_len)
    starts = torch.arange(count) * seq_len  # (n,)
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]  # (n, T+1)


def spread_windows(streams: Sequence[Tensor], seq_len: int, budget: int) -> ValWindows:
    """At most about `budget` windows in all from per-path validation token streams, spread
    over paths by their share of tokens: non-overlapping windows taken at one global stride,
    so every path keeps its share (and at least one window when it has any) and the routed
    mean is the loss of the routed model on a uniform sample of all validation text."""
    if budget < 1:
        raise ValueError(f"eval windows = {budget}: need at least 1")
    every = [stream_windows(stream, seq_len) for stream in streams]
    total = sum(int(w.shape[0]) for w in every)
    if total == 0:
        raise ValueError(
            f"validation text holds no window of {seq_len + 1} tokens; raise "
            "data.val_fraction (--val-fraction) or the budget (--max-docs)"
        )
    stride = max(1, math.ceil(total / budget))
    return ValWindows([w[::stride].contiguous() for w in every], seq_len)


def shard_windows(shard: Any, seq_len: int, count: int) -> Tensor:
    """(n, T+1) int64: the first n <= count non-overlapping windows of a validation shard
    (a dipaco.data.shards.TokenShard; one wrapping window when it is shorter than T + 1)."""
    import numpy as np
    import torch

    available = max(1, (len(shard) - 1) // seq_len)
    rows = [shard.read_window(i * seq_len, seq_len + 1) for i in range(min(count, available))]
    return torch.from_numpy(np.stack(rows)).to(torch.int64)


def window_losses(model: nn.Module, windows: Tensor, batch_size: int = EVAL_BATCH) -> Tensor:
    """Mean next-token cross-entropy of each window, (n,) float64 on the CPU."""
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
