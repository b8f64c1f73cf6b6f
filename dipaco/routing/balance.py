"""Balanced routing through per-path biases.

k-means alone can give one path five times the data of another, or none. Like
the bias of DiPaCo's discriminative router, we add a bias b_p to each path's
score and route by ``argmax_p (score_ip + b_p)``; `fit_biases` chooses b so that
on the training documents every path holds between mean / ``max_imbalance``
and ``max_imbalance`` x mean documents (never none). Because routing stays an
argmax with saved biases, a training document routed again later lands exactly
where the shard builder put it, which a capacity-constrained greedy assignment
would not give.

The biases are the dual potentials of the balanced assignment problem, found by
annealed Sinkhorn iterations and finished, where needed, by exact per-path
steps (see `fit_biases`). Exact steps alone (coordinate descent on the dual)
jam: on 1,778 stdlib documents over 8x8 paths they needed >10k updates for a
1.25 bound, where the annealed Sinkhorn takes 250 iterations (0.2 s).

Documents whose prefixes are identical have identical features and could never
be split by any bias. `tie_break` adds a tiny deterministic per-(text, path)
term derived from a hash of the full text (below 1e-6, against squared
distances of order 1 between unit vectors) that only orders exact ties.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch

from dipaco.routing.featurize import splitmix64

TIE_BREAK_SCALE = 1e-6


def load_bounds(num_docs: int, num_paths: int, max_imbalance: float) -> tuple[int, int]:
    """(fewest, most) documents one path may hold: the mean divided and multiplied
    by ``max_imbalance``, widened to whole documents so an assignment always
    exists, and never fewer than one."""
    if max_imbalance < 1.0:
        raise ValueError(
            f"max_imbalance must be >= 1.0 (1.0 = perfectly even), got {max_imbalance}"
        )
    mean = num_docs / num_paths
    low = max(1, min(math.floor(mean), math.ceil(mean / max_imbalance - 1e-9)))
    high = max(math.ceil(mean), math.floor(max_imbalance * mean + 1e-9))
    return low, high


def tie_break(texts: Sequence[str], num_paths: int) -> torch.Tensor:
    """(N, P) float64 in [0, TIE_BREAK_SCALE): a fixed function of each text."""
    digests = [
        hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest() for t in texts
    ]
    h = np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, 1)  # (N, 1)
    salt = splitmix64(np.arange(1, num_paths + 1, dtype=np.uint64))[None, :]  # (1, P)
    bits = splitmix64(h ^ salt) >> np.uint64(11)  # (N, P) 53 random bits each
    unit = bits.astype(np.float64) / float(2**53)
    return torch.from_numpy(unit * TIE_BREAK_SCALE).reshape(len(texts), num_paths)


def fit_biases(
    scores: torch.Tensor,
    max_imbalance: float,
    *,
    sinkhorn_iters: int = 50,
    max_stages: int = 16,
    max_updates: int | None = None,
) -> torch.Tensor:
    """Biases (P,) so that argmax(scores + bias) gives every path a load within
    `load_bounds` on the N documents. ``scores`` (N, P) float64, higher is better.

    1. Annealed Sinkhorn: the biases are the dual potentials of an entropic
       optimal transport of documents onto paths with equal loads; the
       temperature starts at the median best-vs-second-best score gap and
       shrinks 0.3x per stage until the hard (argmax) loads are within bounds.
    2. If some path is still out of bounds, exact coordinate steps: that path
       gets the bias that gives it the reachable load nearest the mean.
    """
    n, p = scores.shape
    if n < p:
        raise ValueError(
            f"{n} documents cannot fill {p} paths; use more data or fewer modules per level"
        )
    low, high = load_bounds(n, p, max_imbalance)
    if p == 1:
        return torch.zeros(1, dtype=torch.float64)

    def out_of_bounds(bias: torch.Tensor) -> torch.Tensor:
        loads = torch.bincount((scores + bias).argmax(dim=1), minlength=p)  # (P,)
        return (loads - high).clamp_min(0) + (low - loads).clamp_min(0)  # (P,)

    bias = torch.zeros(p, dtype=torch.float64)
    top2 = scores.topk(2, dim=1).values  # (N, 2)
    tau = max(float((top2[:, 0] - top2[:, 1]).median()), TIE_BREAK_SCALE)
    log_mean = math.log(n / p)
    for _ in range(max_stages):
        if int(out_of_bounds(bias).max()) == 0:
            return bias
        for _ in range(sinkhorn_iters):
            log_plan = torch.log_softmax((scores + bias) / tau, dim=1)  # (N, P), rows sum to 1
            bias += tau * (log_mean - torch.logsumexp(log_plan, dim=0))  # columns to n/p
        bias -= bias.mean()  # argmax is shift-invariant; keep the numbers small
        tau *= 0.3
    target = min(max(round(n / p), low), high)
    for _ in range(max_updates or 50 * p):
        excess = out_of_bounds(bias)
        if int(excess.max()) == 0:
            return bias
        path = int(excess.argmax())  # the worst path first
        bias[path] = _coordinate_bias(scores + bias, bias, path, target)
    raise RuntimeError(
        f"could not balance {n} documents over {p} paths with max_imbalance={max_imbalance}; "
        "raise routing.max_imbalance or add documents (or remove duplicate documents)"
    )


def _coordinate_bias(adj: torch.Tensor, bias: torch.Tensor, path: int, target: int) -> float:
    """The bias of ``path`` that gives it the reachable load nearest ``target``,
    the other biases fixed."""
    top2 = adj.topk(2, dim=1)  # values, indices: (N, 2) each
    best_other = torch.where(top2.indices[:, 0] == path, top2.values[:, 1], top2.values[:, 0])
    # Document i joins ``path`` iff reach_i + bias_path > 0.
    reach = (adj[:, path] - bias[path] - best_other).sort(descending=True).values  # (N,)
    # k documents join when the threshold sits half-way between the k-th and
    # (k+1)-th reach, provided those differ (identical texts tie and move together).
    n = len(reach)
    reachable = torch.ones(n, dtype=torch.bool)
    reachable[:-1] = reach[:-1] > reach[1:]
    loads = torch.arange(1, n + 1)[reachable]  # (M,) ascending
    k = int(loads[(loads - target).abs().argmin()])
    upper = float(reach[k - 1])
    lower = float(reach[k]) if k < n else upper - 1.0
    return -(upper + lower) / 2.0
