"""Evaluation, one home for the server, the worker side, the simulator and the demo.

Validation windows are non-overlapping (seq_len + 1)-token slices of a held-out stream;
a path's loss is the mean next-token cross-entropy over every scored target; the routed
mean weighs each path by the tokens it scored, so it is the loss of the routed model on
a uniform sample of all validation text (DiPaCo: each document is scored by the path it
routes to). The server's per-round evaluation (dipaco_server.runs.evaluate), `dipaco
simulate` (dipaco.simulate.evaluate picks windows from its prepared data) and the demo's
dense baselines all score through these functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PathLoss",
    "ValWindows",
    "evaluate_model",
    "mean_loss",
    "perplexity",
    "routed_mean",
    "shard_windows",
    "stream_windows",
    "window_losses",
]

EVAL_BATCH = 16  # windows per forward pass; only memory depends on it


def perplexity(loss: float | None) -> float | None:
    """exp(loss); None stays None (a path without validation text)."""
    return None if loss is None else math.exp(loss)


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
        return None if self.loss is None else math.exp(self.loss)


def stream_windows(stream: Tensor, seq_len: int) -> Tensor:
    """Every non-overlapping (seq_len + 1)-token window of a 1-D token tensor: (n, T+1)."""
    count = max(0, (stream.numel() - 1) // seq_len)
    starts = torch.arange(count) * seq_len  # (n,)
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]  # (n, T+1)


def shard_windows(shard: Any, seq_len: int, count: int) -> Tensor:
    """(n, T+1) int64: the first n <= count non-overlapping windows of a validation shard
    (a dipaco.data.shards.TokenShard; one wrapping window when it is shorter than T + 1)."""
    available = max(1, (len(shard) - 1) // seq_len)
    rows = [shard.read_window(i * seq_len, seq_len + 1) for i in range(min(count, available))]
    return torch.from_numpy(np.stack(rows)).to(torch.int64)


@torch.no_grad()
def window_losses(model: nn.Module, windows: Tensor, batch_size: int = EVAL_BATCH) -> Tensor:
    """Mean next-token cross-entropy of each window, (n,) float64 on the CPU."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
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
    scored = [(x.loss, x.tokens) for x in losses if x.loss is not None]
    total = sum(tokens for _, tokens in scored)
    return sum(loss * tokens for loss, tokens in scored) / total
