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

from dipaco.evaluate import (
    EVAL_BATCH,
    PathLoss,
    ValWindows,
    evaluate_model,
    routed_mean,
    stream_windows,
    window_losses,
)
from dipaco.simulate.prepare import PreparedData

__all__ = ["EVAL_BATCH", "PathLoss", "ValWindows", "evaluate_model", "routed_mean",
           "val_windows", "window_losses"]  # fmt: skip


def val_windows(data: PreparedData, seq_len: int, budget: int) -> ValWindows:
    """At most about `budget` windows in all, spread over paths by their share of tokens."""
    if budget < 1:
        raise ValueError(f"eval windows = {budget}: need at least 1")
    every = [stream_windows(data.val_tokens(p), seq_len) for p in range(data.num_paths)]
    total = sum(int(w.shape[0]) for w in every)
    if total == 0:
        raise ValueError(
            f"validation text holds no window of {seq_len + 1} tokens; raise "
            "data.val_fraction (--val-fraction) or the budget (--max-docs)"
        )
    stride = max(1, math.ceil(total / budget))
    return ValWindows([w[::stride].contiguous() for w in every], seq_len)
