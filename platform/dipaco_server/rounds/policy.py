"""Scheduling settings: one block of defaults, one comment per setting.

Each can be overridden by a Django setting of the same name. They are read on
every call (never cached at import), so tests and a reloaded settings module
take effect at once. A bad value fails loudly, naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

DEFAULTS: dict[str, float] = {
    # A lease with no heartbeat for this long expires and its unit is queued again.
    # Agents heartbeat every third of it, so one lost request is survivable.
    "DIPACO_LEASE_TIMEOUT_S": 300,
    # Hard lease budget when the worker's speed is unknown (its first unit).
    "DIPACO_LEASE_DEFAULT_S": 3600,
    # The budget from a measured speed is expected time x this margin (slow data, retries)...
    "DIPACO_LEASE_SPEED_MARGIN": 3.0,
    # ...bounded below (startup, downloads) and above (a unit never blocks a round for days).
    "DIPACO_LEASE_MIN_S": 600,
    "DIPACO_LEASE_MAX_S": 6 * 3600,
    # Active leases one worker may hold at once; more lets one worker drain the queue.
    "DIPACO_WORKER_MAX_LEASES": 1,
    # A unit leased this many times without completing is given up (state expired).
    "DIPACO_UNIT_MAX_ATTEMPTS": 5,
    # A round's deadline, from its opening; after it a quorum of units suffices to close.
    "DIPACO_ROUND_DEADLINE_S": 3600,
    # Adaptive deadline (no round waits for its slowest unit): once a quorum is done, the round's deadline moves up to
    # the last unit's grant + the median + this many x the MAD (at least 10 % of the median)
    # of the done units' durations, + the heartbeat interval by which agents stop before a
    # deadline; units still out are then expected to hand in partial Δs.
    "DIPACO_ROUND_DEADLINE_MADS": 3.0,
    # After the deadline, units still leased get this long to upload what they trained
    # (agents stop a heartbeat interval before the deadline they last heard of).
    "DIPACO_ROUND_SALVAGE_GRACE_S": 120,
    # The quorum: this share of a round's units done (DiLoCo tolerates missing replicas).
    "DIPACO_ROUND_QUORUM": 0.5,
    # A round still closing this long after close_round sent its outer steps, and none of
    # whose modules stepped in that time, lost them (the broker's state went with a Redis
    # restart, say): the beat sweep sends close_round again. Steps already done are not
    # redone, so a slow step sent twice costs time (a second worker on it), not weights.
    "DIPACO_ROUND_CLOSE_RETRY_S": 900,
    # Idle lease polls per second the server aims for, all workers together: a lease
    # request that finds nothing queued answers 204 with Retry-After = workers seen in the
    # last minutes / this (1 s to 60 s), so 5,000 idle volunteers at a round boundary
    # do not ask a thousand times a second, and a handful still notice a new round at once.
    "DIPACO_IDLE_POLL_RATE": 100,
    # Lease grants per second the server aims for when a round opens (no stampede at a round boundary): waiting
    # workers are given Retry-After slots spread over (waiting workers / this) seconds
    # after the next round's expected opening, and grants ahead of that pace answer 204
    # with a later slot. At 10,000 volunteers that is 200 s instead of a stampede of every
    # waiting volunteer within one Retry-After (bench/control_plane.py, docs/deploy.md).
    "DIPACO_GRANT_RATE": 50,
    # Heartbeats per second the server aims for, all workers together (thousands of workers): agents are
    # told to heartbeat every DIPACO_LEASE_TIMEOUT_S / 3 seconds, or every (workers seen
    # lately / this) seconds when that is longer, and a lease then lives three such intervals
    # without one. At 10,000 volunteers: 200 s and 50 heartbeats a second instead of 100 s
    # and 100; a dead worker's unit is queued again after 10 minutes instead of 5.
    "DIPACO_HEARTBEAT_RATE": 50,
}


@dataclass(frozen=True)
class SchedulerPolicy:
    lease_timeout_s: float
    lease_default_s: float
    lease_speed_margin: float
    lease_min_s: float
    lease_max_s: float
    worker_max_leases: int
    unit_max_attempts: int
    round_deadline_s: float
    round_quorum: float
    round_deadline_mads: float
    round_salvage_grace_s: float
    round_close_retry_s: float
    idle_poll_rate: float
    grant_rate: float
    heartbeat_rate: float

    @property
    def heartbeat_interval_s(self) -> float:
        """How often an agent should heartbeat with few workers about; with many, the longer
        interval of rounds.protocol.pacing.heartbeat_interval_s (DIPACO_HEARTBEAT_RATE)."""
        return self.lease_timeout_s / 3

    def lease_budget_s(self, tokens: int, speed: float | None) -> float:
        """Seconds a unit of `tokens` may take on a worker of `speed` tokens/s at most."""
        if speed is None or speed <= 0:
            return self.lease_default_s
        expected = tokens / speed
        return min(self.lease_max_s, max(self.lease_min_s, expected * self.lease_speed_margin))


def _number(
    name: str, *, integer: bool = False, low: float = 0.0, high: float | None = None
) -> Any:
    value = getattr(settings, name, DEFAULTS[name])
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ImproperlyConfigured(f"{name}={value!r}: not a number; e.g. {DEFAULTS[name]}")
    if value <= low or (high is not None and value > high):
        bound = f"> {low}" + (f" and <= {high}" if high is not None else "")
        raise ImproperlyConfigured(f"{name}={value!r}: must be {bound}; e.g. {DEFAULTS[name]}")
    return value


def current_policy() -> SchedulerPolicy:
    policy = SchedulerPolicy(
        lease_timeout_s=_number("DIPACO_LEASE_TIMEOUT_S"),
        lease_default_s=_number("DIPACO_LEASE_DEFAULT_S"),
        lease_speed_margin=_number("DIPACO_LEASE_SPEED_MARGIN", low=0.0),
        lease_min_s=_number("DIPACO_LEASE_MIN_S"),
        lease_max_s=_number("DIPACO_LEASE_MAX_S"),
        worker_max_leases=_number("DIPACO_WORKER_MAX_LEASES", integer=True),
        unit_max_attempts=_number("DIPACO_UNIT_MAX_ATTEMPTS", integer=True),
        round_deadline_s=_number("DIPACO_ROUND_DEADLINE_S"),
        round_quorum=_number("DIPACO_ROUND_QUORUM", high=1.0),
        round_deadline_mads=_number("DIPACO_ROUND_DEADLINE_MADS"),
        round_salvage_grace_s=_number("DIPACO_ROUND_SALVAGE_GRACE_S"),
        round_close_retry_s=_number("DIPACO_ROUND_CLOSE_RETRY_S"),
        idle_poll_rate=_number("DIPACO_IDLE_POLL_RATE"),
        grant_rate=_number("DIPACO_GRANT_RATE"),
        heartbeat_rate=_number("DIPACO_HEARTBEAT_RATE"),
    )
    if policy.lease_min_s > policy.lease_max_s:
        raise ImproperlyConfigured(
            f"DIPACO_LEASE_MIN_S={policy.lease_min_s} exceeds DIPACO_LEASE_MAX_S="
            f"{policy.lease_max_s}; raise the maximum or lower the minimum"
        )
    return policy
