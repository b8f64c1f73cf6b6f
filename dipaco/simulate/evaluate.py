"""Validation: fixed windows of each path's held-out documents, losses per path and routed.

Each validation document is evaluated by the path it routes to, so a path's windows come
from its own validation stream. Windows are non-overlapping, taken at one global stride so
that every path keeps its share of the validation tokens (and at least one window when it
has any): the routed mean, a token-weighted mean over paths, is then the loss of the
routed model on a uniform sample of all validation text. The baselines see the very same
windows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dipaco.simulate.prepare import PreparedData

__all__ = ["PathLoss", "ValWindows", "evaluate_model", "routed_mean", "val_windows"]

EVAL_BATCH = 16  # windows per forward pass; only memory depends on it


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


def _windows(stream: Tensor, seq_len: int) -> Tensor:
    count = max(0, (stream.numel() - 1) // seq_len)
    starts = torch.arange(count) * seq_len  # (n,)
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]  # (n, T+1)


def val_windows(data: PreparedData, seq_len: int, budget: int) -> ValWindows:
    """At most about `budget` windows in all, spread over paths by their share of tokens."""
    if budget < 1:
        raise ValueError(f"eval windows = {budget}: need at least 1")
    every = [_windows(data.val_tokens(p), seq_len) for p in range(data.num_paths)]
    total = sum(int(w.shape[0]) for w in every)
    if total == 0:
        raise ValueError(
            f"validation text holds no window of {seq_len + 1} tokens; raise "
            "data.val_fraction (--val-fraction) or the budget (--max-docs)"
        )
    stride = max(1, math.ceil(total / budget))
    return ValWindows([w[::stride].contiguous() for w in every], seq_len)


@torch.no_grad()
def window_losses(model: nn.Module, windows: Tensor) -> Tensor:
    """Mean next-token cross-entropy of each window, (n,) float64 on the CPU."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, windows.shape[0], EVAL_BATCH):
        batch = windows[start : start + EVAL_BATCH].to(device)  # (B, T+1)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)
        logits = cast(Any, model)(input_ids=inputs).logits.float()  # (B, T, V)
        loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T)
        out.append(loss.mean(dim=1).double().cpu())  # (B,)
    if was_training:
        model.train()
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def evaluate_model(
    model: nn.Module, windows: ValWindows, paths: Sequence[int] | None = None
) -> list[PathLoss]:
    """One model on the windows of `paths` (default all): a dense baseline scores every
    path's windows with the same weights; DiPaCo loads each path before calling this."""
    chosen = range(len(windows.per_path)) if paths is None else paths
    results = []
    for p in chosen:
        w = windows.per_path[p]
        loss = float(window_losses(model, w).mean()) if w.shape[0] else None
        results.append(PathLoss(p, loss, int(w.shape[0]) * windows.seq_len))
    return results


def routed_mean(losses: Sequence[PathLoss]) -> float:
    """Token-weighted mean loss over paths (paths without validation windows weigh 0)."""
    scored = [(x.loss, x.tokens) for x in losses if x.loss is not None]
    total = sum(tokens for _, tokens in scored)
    return sum(loss * tokens for loss, tokens in scored) / total
