"""Which windows score a unit's Δ (proof of useful work): drawn after the upload.

The server scores a unit's Δ on `score_windows(config)` of the unit's own training windows
and as many held-out windows of its path's validation split. Which ones is drawn here:

- the training windows are a uniform sample, without repeats, of the unit's positions
  ``first .. first + windows - 1`` of its path's order (the rows it trained on:
  dipaco.data.rows), not its first few, which it reads first and could train on alone;
- the held-out windows are a uniform sample of the path's validation windows, drawn
  afresh each round, not the same last windows every round.

Both draws are seeded by `draw_seed`: an HMAC of the unit's identity under a secret only
the server holds (never sent to a worker, in no response), so a worker cannot tell before
its upload which of its windows will be read, nor which held-out windows a round checks.
A unit's replicas (the same round, path and first position) get the same draw, so their
scores stay comparable. The draws come back sorted: the rows are read in ranged reads in
file order (`dipaco.data.rows.StoreRows.read_at`).

What the drawn training windows must show is `majority_gain`: the relative loss gain that
a strict majority of them reach, not their mean. A worker that trains on a few of its
windows only (memorising them) has one or two of them in a draw of 8; their gains carried
a mean past the bar, they cannot carry a majority.

`first_windows` and `last_windows` are the rule before this one (the unit's first windows
and the split's last ones), kept for bench/attacks.py to show what it let through.
Pure numpy and the standard library: the server, the simulator and the bench share it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import numpy as np

__all__ = [
    "draw",
    "draw_seed",
    "first_windows",
    "heldout_seed",
    "heldout_windows",
    "last_windows",
    "majority_gain",
    "unit_seed",
    "unit_windows_scored",
]


def draw_seed(secret: bytes | str, *identity: object) -> int:
    """A 63-bit seed from `secret` and the parts of an identity (HMAC-SHA256): the same on
    every machine that holds the secret, unpredictable to one that does not."""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("a draw needs a secret: without one a worker could compute it")
    message = "\x1f".join(str(part) for part in identity).encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def unit_seed(secret: bytes | str, run: object, phase: object, round_t: int, path: int,
              first: int) -> int:  # fmt: skip
    """The seed of a unit's scored training windows: its run, phase, round, path and first
    position (what its replicas share; the replica index is left out on purpose)."""
    return draw_seed(secret, "dipaco-score-train-1", run, phase, round_t, path, first)


def heldout_seed(secret: bytes | str, run: object, phase: object, round_t: int,
                 path: int) -> int:  # fmt: skip
    """The seed of a round's held-out windows of one path."""
    return draw_seed(secret, "dipaco-score-heldout-1", run, phase, round_t, path)


def _ranking(population: int, seed: int) -> np.ndarray:
    """(population,) 0 .. population - 1 in an order seeded by `seed`."""
    if population < 0:
        raise ValueError(f"cannot rank {population} windows")
    return np.random.Generator(np.random.PCG64(seed)).permutation(population).astype(np.int64)


def draw(population: int, count: int, seed: int) -> np.ndarray:
    """(min(count, population),) distinct indices of 0 .. population - 1, uniformly
    drawn with `seed`, sorted."""
    if count < 0:
        raise ValueError(f"cannot draw {count} of {population}")
    return np.sort(_ranking(population, seed)[:count])


def unit_windows_scored(
    first: int, windows: int, count: int, seed: int, trained: int | None = None
) -> np.ndarray:
    """(up to count,) the positions of a unit's scored training windows, sorted: drawn
    from its positions first .. first + windows - 1.

    `trained`: the windows its lease covered from the start (a lease sized down to fewer
    steps reads only the first of its unit's windows; None: all). The unit's windows are
    ranked once by `seed` and the first `count` of the ranking that the lease covered are
    scored: two replicas of a unit covering the same windows get the same draw, and a
    shorter one keeps as much of the longer one's draw as lies in what it trained."""
    if count < 0:
        raise ValueError(f"cannot draw {count} of {windows}")
    covered = windows if trained is None else max(0, min(trained, windows))
    ranking = _ranking(windows, seed)
    return first + np.sort(ranking[ranking < covered][:count])


def heldout_windows(total: int, count: int, seed: int) -> np.ndarray:
    """(min(count, total),) the held-out windows (indices into the split's `total`
    windows) a round scores on, sorted."""
    return draw(total, count, seed)


def first_windows(first: int, count: int) -> np.ndarray:
    """The old training draw: the unit's first `count` positions (read first by the worker)."""
    return np.arange(first, first + count, dtype=np.int64)


def last_windows(total: int, count: int) -> np.ndarray:
    """The old held-out draw: the split's last `count` windows, the same every round."""
    return np.arange(max(0, total - count), total, dtype=np.int64)


def majority_gain(before: Sequence[float], after: Sequence[float]) -> float:
    """The relative loss gain that a strict majority of the windows reach: each window's
    (before - after) / before, and of those the (floor(n / 2) + 1)-th largest (the lower
    median; for 1 window its own, for 2 the smaller). Fewer than half of the windows
    cannot carry it however much they gain: a Δ that memorised k of the drawn windows
    shows their gain only when k > n / 2. 0.0 without windows.

    `before`, `after`: each window's mean loss with the path's base and with the Δ applied.
    """
    if len(before) != len(after):
        raise ValueError(f"{len(before)} losses before and {len(after)} after")
    gains = sorted(
        (b - a) / b if b > 0 else 0.0 for b, a in zip(before, after, strict=True)
    )  # ascending
    if not gains:
        return 0.0
    return float(gains[(len(gains) - 1) // 2])
