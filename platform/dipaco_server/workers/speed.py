"""A worker's training speed (tokens/s), the number that sizes its units (rounds.protocol.leases).

The speed a worker reports is its own claim, so the scheduler never uses it alone
(docs/design.md §7: a worker is untrusted): a completion's speed is the smaller of the claim and what
the server measured itself, the unit's tokens over the wall time between the lease's
grant and its completion (which also counts downloads and uploads, so it errs slow), and
never above `MAX_TOKENS_PER_SECOND`. A claim of 1e308 tokens/s then sizes nothing: before
this, it was stored as the speed, every later lease of that worker was a 500 (inf x a
target time -> NaN -> int()), and the worker could never report a saner one.
"""

from __future__ import annotations

import math
from datetime import datetime

# No device trains faster: an H100's ~10^15 bf16 FLOP/s over 6 FLOPs per parameter and
# token trains a 1M-parameter model at ~1.7 x 10^8 tokens/s (the smallest model here has
# more); 10^10 leaves a factor of 60 for devices to come.
MAX_TOKENS_PER_SECOND = 1e10
SMOOTHING = 0.5  # weight of the newest unit's speed in the running estimate


def unit_speed(
    claimed: float | None, tokens: int, granted_at: datetime | None, completed_at: datetime
) -> float | None:
    """The speed one completed unit shows: min(claimed, tokens / wall time), clamped to
    (0, MAX_TOKENS_PER_SECOND]; None without a positive, finite claim."""
    if claimed is None or not math.isfinite(claimed) or claimed <= 0:
        return None
    speed = min(claimed, MAX_TOKENS_PER_SECOND)
    if granted_at is not None:
        wall_s = (completed_at - granted_at).total_seconds()
        if wall_s > 0:  # a clock that did not move (tests pass `now`) measures nothing
            speed = min(speed, tokens / wall_s)
    return speed if speed > 0 else None


def smoothed_speed(previous: float | None, speed: float | None) -> float | None:
    """`speed` folded into the running estimate `previous`; a missing one changes nothing."""
    if previous is not None and not (math.isfinite(previous) and previous > 0):
        previous = None  # a value stored before speeds were bounded
    if speed is None:
        return previous
    if previous is None:
        return speed
    return min(MAX_TOKENS_PER_SECOND, (1 - SMOOTHING) * previous + SMOOTHING * speed)


def plausible_speed(stored: float | None) -> float | None:
    """A stored speed as the scheduler may use it: finite, positive and clamped; else None
    (the worker calibrates again)."""
    if stored is None or not math.isfinite(stored) or stored <= 0:
        return None
    return min(stored, MAX_TOKENS_PER_SECOND)
