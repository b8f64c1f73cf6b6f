"""When workers come back, and how often they heartbeat: the jittered Retry-After of an idle
poll (`retry_after_s`), grants paced when a round opens, the heartbeat interval and lease
timeout that grow with the crowd, and the per-process cache of the open rounds' queued
units by path (`cached_groups`) that grants and pacing both read."""

from __future__ import annotations

import logging
import math
import random
import time
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Q
from django.utils import timezone

from dipaco_server.rounds.models import Round, WorkUnit
from dipaco_server.rounds.policy import SchedulerPolicy, current_policy
from dipaco_server.runs.models import Path, Run
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)


# Workers seen lately, counted at most every ACTIVE_WORKERS_TTL_S per process: (when, n).
_active_workers: tuple[float, int] = (-math.inf, 0)
ACTIVE_WORKERS_TTL_S = 15.0
ACTIVE_WORKERS_WINDOW = timedelta(minutes=2)  # four heartbeats of a live worker


def idle_retry_after_s(*, now: datetime | None = None) -> int:
    """How long a worker that found nothing queued should wait before asking again.

    Workers seen in the last ACTIVE_WORKERS_WINDOW / DIPACO_IDLE_POLL_RATE seconds,
    between 1 and 60: idle polls then add up to about that rate, whatever the crowd.
    """
    global _active_workers
    _active_workers = _recounted(_active_workers, ACTIVE_WORKERS_WINDOW, now)
    active = _active_workers[1]
    return int(min(60, max(1, math.ceil(active / current_policy().idle_poll_rate))))


def _recounted(
    cached: tuple[float, int], window: timedelta, now: datetime | None = None
) -> tuple[float, int]:
    """`cached` (when counted, workers seen), counted again when older than
    ACTIVE_WORKERS_TTL_S: the unrevoked workers seen within `window` of now."""
    clock = time.monotonic()
    if clock - cached[0] <= ACTIVE_WORKERS_TTL_S:
        return cached
    since = (now or timezone.now()) - window
    return clock, Worker.objects.filter(last_seen__gte=since, revoked=False).count()


# Workers seen within the lease timeout, counted at most every ACTIVE_WORKERS_TTL_S per
# process: (when, n). The window is a lease timeout, so every live worker, heartbeating once
# an interval, is in it however long the interval grows.
_heartbeating: tuple[float, int] = (-math.inf, 0)


def heartbeat_interval_s(policy: SchedulerPolicy | None = None) -> float:
    """How often agents should heartbeat: DIPACO_LEASE_TIMEOUT_S / 3, or (workers seen within
    a lease timeout / DIPACO_HEARTBEAT_RATE) seconds when that is longer, so heartbeats add up
    to about that rate whatever the crowd. Told in every lease and heartbeat answer."""
    global _heartbeating
    policy = policy or current_policy()

    def interval(workers: int) -> float:
        return max(policy.heartbeat_interval_s, workers / policy.heartbeat_rate)

    # The window: the lease timeout at the last count.
    window = timedelta(seconds=3 * interval(_heartbeating[1]))
    _heartbeating = _recounted(_heartbeating, window)
    return interval(_heartbeating[1])


def lease_timeout_s(policy: SchedulerPolicy | None = None) -> float:
    """How long a lease lives without a heartbeat: three heartbeat intervals, so one or two
    lost heartbeats are survivable (DIPACO_LEASE_TIMEOUT_S with few workers about)."""
    return 3 * heartbeat_interval_s(policy)


# --- round boundaries without a stampede ----------------------------------------------------
#
# When a round closes, every volunteer that finished its unit waits for the next one. Once
# each 204 said "ask again in workers / DIPACO_IDLE_POLL_RATE seconds", the same
# number for everyone, so the crowd came back within one Retry-After of the new round's
# opening: at 5,000 volunteers, 95 grants a second on two saturated cores for a minute
# (p99 1.6 s, docs/benchmarks.md). Now:
#
# - every Retry-After is jittered, so waiters that asked together do not return together;
# - while a round is closing (its outer step runs), a waiter is given a slot drawn uniformly
#   over [expected opening, + waiting workers / DIPACO_GRANT_RATE]: the expected opening is
#   the closing time plus how long the previous outer step took (closing -> next opening);
# - after an opening, grants are paced: at most GRANT_BURST_S x rate + rate x (seconds since
#   the opening) units of the round are out; a request ahead of that pace gets a 204 with a
#   slot after the backlog, also jittered. The count comes from the cached groups, so the
#   pace costs no query.

GRANT_BURST_S = 2.0  # grants allowed at once when a round opens, in seconds of the rate
# The expected outer step before any round of the run has closed. Low rather than high: a
# waiter told too little asks again (its next answer spreads it over the crowd as before),
# one told too much idles; at 10 s a small run's volunteers idled ~6 s after its first round
# (the demo's first close takes ~4 s), and a crowd's slots are spread over waiters /
# DIPACO_GRANT_RATE seconds after it anyway.
DEFAULT_OUTER_S = 3.0
CLOSING_TTL_S = 2.0
# (when counted, (closing_at, expected outer step seconds) of the newest closing round)
_closing: tuple[float, tuple[datetime, float] | None] = (-math.inf, None)


def retry_after_s(*, now: datetime | None = None, rng: random.Random | None = None) -> int:
    """The Retry-After of a lease request answered 204: a jittered slot, spread over time.

    Three cases, in order: a round is closing (slot after its expected next opening, spread
    over waiting workers / DIPACO_GRANT_RATE; past that opening, asks again at that rate),
    grants are ahead of the pace of an opening (slot after the backlog, spread over as long
    again), or nothing is queued (the idle wait of `idle_retry_after_s`, up to 1.5 times
    longer so that waiters drift apart).
    """
    now = now or timezone.now()
    rng = rng or _rng
    policy = current_policy()
    base = idle_retry_after_s(now=now)
    spread = _waiting_workers() / policy.grant_rate
    closing = _closing_round()
    if closing is not None:
        closing_at, outer_s = closing
        opens_in = (closing_at - now).total_seconds() + outer_s
        if opens_in > 0:
            return max(1, math.ceil(opens_in + rng.uniform(0.0, max(1.0, spread))))
        # Later than expected: this outer step is slower than the last (or than round 0's
        # prior). Each waiter asks again after `spread` seconds on average, so that their
        # asks add up to DIPACO_GRANT_RATE, the most the opening will grant (the pace), not
        # twice that: at 10,000 waiters, 50 polls a second instead of 100 on the cores the
        # outer step is using (docs/benchmarks.md).
        return max(1, math.ceil(rng.uniform(0.0, 2 * max(1.0, spread))))
    deficit = pace_deficit_s(cached_groups()[0], now, policy)
    if deficit > 0:  # spread over as long again: the late ones keep about the pace
        return max(1, math.ceil(deficit + rng.uniform(0.0, max(1.0, deficit))))
    return max(1, math.ceil(base * rng.uniform(1.0, 1.5)))


_rng = random.Random()


def _waiting_workers() -> int:
    """Workers seen lately (the cached count of `idle_retry_after_s`): who may be waiting."""
    return _active_workers[1]


def pace_deficit_s(groups: list[dict[str, Any]], now: datetime, policy: SchedulerPolicy) -> float:
    """Seconds until the next grant is within DIPACO_GRANT_RATE of its round's opening; 0 when
    it is (or the round opened long enough ago that the pace no longer binds)."""
    rate, deficit = policy.grant_rate, 0.0
    covered: dict[int, int] = {}
    opened: dict[int, datetime] = {}
    for group in groups:
        covered[group["round_id"]] = covered.get(group["round_id"], 0) + group["covered"]
        opened[group["round_id"]] = group["round__opened_at"]
    for round_id, out in covered.items():
        # A clock behind the opening (another process's) counts as the opening itself.
        since = max(0.0, (now - opened[round_id]).total_seconds())
        allowed = rate * (GRANT_BURST_S + since)
        if out >= allowed:
            deficit = max(deficit, (out + 1 - allowed) / rate)
    return deficit


def _closing_round() -> tuple[datetime, float] | None:
    """(when it began closing, expected outer step seconds) of the newest closing round of a
    running run, counted at most every CLOSING_TTL_S per process; None when none is closing."""
    global _closing
    counted_at, closing = _closing
    clock = time.monotonic()
    if clock - counted_at <= CLOSING_TTL_S:
        return closing
    row = (
        Round.objects.filter(state=Round.State.CLOSING, run__state=Run.State.RUNNING)
        .exclude(closing_started_at=None)
        .order_by("-closing_started_at")
        .values("run_id", "t", "closing_started_at")
        .first()
    )
    closing = None
    if row is not None:
        closing = (row["closing_started_at"], _last_outer_step_s(row["run_id"], row["t"]))
    _closing = (clock, closing)
    return closing


def _last_outer_step_s(run_id: int, t: int) -> float:
    """How long round t - 1's close took: its closing's start to round t's opening (outer
    step, evaluation when it comes first, opening); DEFAULT_OUTER_S for a run's first round."""
    rows = {
        row[0]: row[1:]
        for row in Round.objects.filter(run_id=run_id, t__in=[t - 1, t]).values_list(
            "t", "opened_at", "closing_started_at"
        )
    }
    started = rows.get(t - 1, (None, None))[1]
    if started is None or t not in rows:
        return DEFAULT_OUTER_S
    return max(0.0, (rows[t][0] - started).total_seconds())


# The groups, counted at most every GROUPS_TTL_S per process. When a round opens, every
# volunteer asks for a unit within a minute; counting every unit of the round for each
# grant made that O(units) per grant and O(units²) per round. Between counts, each grant
# updates the cached counts itself, so paths stay balanced; a stale group only costs an
# empty look, after which the groups are counted again.
GROUPS_TTL_S = 1.0
_groups: tuple[float, list[dict[str, Any]]] = (-math.inf, [])


def cached_groups(*, refresh: bool = False) -> tuple[list[dict[str, Any]], bool]:
    """(groups, whether they were just counted)."""
    global _groups
    counted_at, groups = _groups
    if refresh or time.monotonic() - counted_at > GROUPS_TTL_S:
        groups = _open_groups()
        _groups = (time.monotonic(), groups)
        return groups, True
    return groups, False


def grantable(unit: WorkUnit) -> bool:
    return (
        unit.round.state == Round.State.OPEN
        and unit.round.run.state == Run.State.RUNNING
        and unit.path.state == Path.State.ACTIVE
    )


def count_grant(groups: list[dict[str, Any]], unit: WorkUnit) -> None:
    for group in groups:
        if group["round_id"] == unit.round_id and group["path_id"] == unit.path_id:
            group["queued"] -= 1
            group["covered"] += 1


def _open_groups() -> list[dict[str, Any]]:
    """The (round, path) groups of open rounds with queued units, with their queued and
    covered (leased or done) counts: one grouped scan of the units index."""
    return list(
        WorkUnit.objects.filter(
            round__state=Round.State.OPEN,
            round__run__state=Run.State.RUNNING,
            path__state=Path.State.ACTIVE,
        )
        .values("round_id", "path_id", "path__index", "round__opened_at")
        .annotate(
            queued=Count("pk", filter=Q(state=WorkUnit.State.QUEUED)),
            covered=Count("pk", filter=Q(state__in=[WorkUnit.State.LEASED, WorkUnit.State.DONE])),
        )
        .filter(queued__gt=0)
        .order_by()
    )
