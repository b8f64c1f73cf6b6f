"""Leases: granting units to workers race-free, heartbeats, release, and the expiry sweep.

A grant claims one queued unit with a conditional UPDATE (``... WHERE state =
'queued'``), which is correct on every database: of two concurrent claims of
one unit exactly one updates a row. On PostgreSQL the candidate is also read
with ``SELECT ... FOR UPDATE SKIP LOCKED``, so concurrent grants take different
units instead of queueing behind one row. SQLite serialises writers (the
settings open transactions IMMEDIATE), so the conditional UPDATE suffices there.

Completion is in rounds.complete.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, F, Q, Value
from django.db.models.functions import Least
from django.utils import timezone

from dipaco.config import RunConfig
from dipaco.data.windows import step_tokens
from dipaco_server.core import tokens
from dipaco_server.rounds import replication
from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.policy import SchedulerPolicy, current_policy
from dipaco_server.runs.errors import (
    LeaseExpired,
    LeaseLimitReached,
    LeaseNotActive,
    LeaseNotFound,
    LeaseNotYours,
    LeaseSecretInvalid,
    RoundClosed,
    RunNotActive,
)
from dipaco_server.runs.models import Path, Run
from dipaco_server.runs.phases import phase_config
from dipaco_server.runs.services import TERMINAL
from dipaco_server.workers import trust
from dipaco_server.workers.errors import WorkerRevoked
from dipaco_server.workers.models import Worker
from dipaco_server.workers.speed import plausible_speed

logger = logging.getLogger(__name__)

# A claim loses only when another grant took the same unit in between; a few
# retries on the next candidate is plenty (each retry sees that unit as taken).
CLAIM_ATTEMPTS = 5
EXPIRE_BATCH = 500


@dataclass(frozen=True)
class LeaseGrant:
    """A granted lease and its secret: the plaintext exists only here, show it once."""

    lease: Lease
    secret: str

    @property
    def unit(self) -> WorkUnit:
        return self.lease.unit


def grant_lease(
    worker: Worker, *, now: datetime | None = None, handing_in: int | None = None
) -> LeaseGrant | None:
    """Lease one queued unit to `worker`, or None when no unit is waiting.

    `handing_in`: the id of the worker's lease whose trained Δ it is handing in (uploads,
    then completion) while it asks for its next unit (the agent overlaps a unit's edges).
    That one lease does not count against DIPACO_WORKER_MAX_LEASES, so a worker holds at
    most one lease more than the limit: one training, one handing in. The server cannot
    tell training from handing in; the bound holds whatever the worker claims. Its path
    ranks first among the warm ones, as if its completion had arrived.

    Preference (docs/design.md §4.2): a unit of a path the worker completed before (its
    AdamW state is warm there; the most recently completed first), then the path with
    the fewest units leased or done in its round, then the oldest round.

    Every path the worker trained lately counts, not only its last: a worker with two
    paths a round (fewer workers than units) otherwise gets its second path back only
    if it asks before the other workers, and trains someone else's with cold moments
    (bench/platform_run.py measured that drift from dipaco simulate).
    """
    now = now or timezone.now()
    policy = current_policy()
    trust.check_trusted(worker)  # work that failed verification too often: no more (issue 19)
    # Idle polls are common at round boundaries: when nothing is queued (one look at the
    # partial index of queued units), answer without a transaction.
    if not _anything_queued():
        # a worker at its limit hears so even then (or gets back a grant it never heard)
        return _check_lease_limit_or_reclaim(worker, policy, now, handing_in)
    groups, fresh = _cached_groups()
    if _pace_deficit_s(groups, now, policy) > 0:
        # A round just opened and grants are ahead of DIPACO_GRANT_RATE: this worker is
        # given a later slot (retry_after_s) instead of joining the stampede.
        return _check_lease_limit_or_reclaim(worker, policy, now, handing_in)
    warm_paths = _recent_paths(worker, handing_in)
    comeback = _comeback(worker)
    for _ in range(CLAIM_ATTEMPTS):
        with transaction.atomic():
            # Locking the worker row serialises one worker's grants, so its lease limit holds.
            locked = Worker.objects.select_for_update().filter(pk=worker.pk).first()
            if locked is None or locked.revoked:
                raise WorkerRevoked(f"worker {worker.pk} was revoked; it gets no more work")
            trust.check_trusted(locked)
            reclaimed = _check_lease_limit_or_reclaim(locked, policy, now, handing_in)
            if reclaimed is not None:
                return reclaimed
            unit, resumed_steps = _comeback_unit(comeback), 0
            if unit is not None and comeback is not None:
                resumed_steps = comeback[1]
            else:
                unit = _next_queued_unit(groups, warm_paths, locked)
            if unit is None and not fresh:  # the cached groups ran dry: count again
                groups, fresh = _cached_groups(refresh=True)
                unit = _next_queued_unit(groups, warm_paths, locked)
            if unit is None:
                return None
            claimed = WorkUnit.objects.filter(pk=unit.pk, state=WorkUnit.State.QUEUED).update(
                state=WorkUnit.State.LEASED, attempts=F("attempts") + 1, updated_at=now
            )
            if not claimed:  # another grant took it: count again before the next try
                groups, fresh = _cached_groups(refresh=True)
                comeback = None
                continue
            _count_grant(groups, unit)
            # The claimed unit with what the lease answer needs, in one read.
            unit = WorkUnit.objects.select_related("round__run", "path").get(pk=unit.pk)
            stale = not _grantable(unit)  # cached groups of a round, run or path stopped
            if stale:
                transaction.set_rollback(True)  # the claim is undone as the block ends
            else:
                secret = tokens.generate_token(tokens.LEASE_PREFIX)
                config = phase_config(unit.round.run.run_config, unit.path.phase)
                size = size_unit(
                    config, locked.measured_speed, resumed_steps=resumed_steps,
                    round_deadline=unit.round.deadline, now=now,
                    stop_margin_s=heartbeat_interval_s(policy),
                )  # fmt: skip
                budget = policy.lease_budget_s(
                    size.trained_steps * step_tokens(config), locked.measured_speed
                )
                if size.seconds is not None:  # time to stop, upload and complete
                    budget = max(budget, size.seconds + policy.lease_min_s)
                hard_deadline = now + timedelta(seconds=budget)
                timeout = timedelta(seconds=lease_timeout_s(policy))
                lease = Lease.objects.create(
                    unit=unit,
                    worker=locked,
                    secret_hash=tokens.hash_token(secret),
                    attempt=unit.attempts,
                    granted_at=now,
                    deadline=min(hard_deadline, now + timeout),
                    hard_deadline=hard_deadline,
                    steps=size.steps,
                    seconds_limit=size.seconds,
                    size_reason=size.reason[:240],
                )
                replication.maybe_replicate(unit, locked)  # sampled replication (issue 19)
        if stale:
            groups, fresh = _cached_groups(refresh=True)
            comeback = None
            continue
        logger.info(
            "lease %s: unit %s to worker %s, %d steps (%s)",
            lease.pk, unit.pk, worker.pk, lease.steps, lease.size_reason,
        )  # fmt: skip
        return LeaseGrant(lease=lease, secret=secret)
    return None


def lease_steps(lease: Lease, config: RunConfig) -> int:
    """The unit's length under `lease`, the one the lease answer names (`steps`: the
    agent's inner-loop bound, counted from the unit's start); H for leases granted before
    units were sized. It never changes the lr schedule, whose slot stays H steps."""
    return min(lease.steps, config.inner.steps) if lease.steps else config.inner.steps


def lease_tokens(lease: Lease, config: RunConfig) -> int:
    """The most tokens a Δ under `lease` may be weighted by: its steps x step tokens."""
    return lease_steps(lease, config) * step_tokens(config)


@dataclass(frozen=True)
class UnitSize:
    """How many steps a lease may train, and why (shown to the worker and the dashboard)."""

    steps: int  # counted from the unit's start: a resumed checkpoint's steps included
    trained_steps: int  # of those, the ones this lease is expected to train
    reason: str
    seconds: float | None = None  # a calibration unit stops after this long


def size_unit(
    config: RunConfig,
    speed: float | None,
    *,
    resumed_steps: int = 0,
    round_deadline: datetime | None = None,
    now: datetime | None = None,
    stop_margin_s: float = 0.0,
) -> UnitSize:
    """Steps for a unit on a worker of `speed` tokens/s, so that it takes about
    ``units.target_seconds`` (at most H, at least one step).

    A worker never measured gets the whole unit but stops after
    ``units.calibration_seconds`` and uploads the steps done: that completion reports the
    speed that sizes its next units, and a slow GPU loses no more than that time. A worker taking back a unit it held (`resumed_steps`:
    the steps its earlier lease allowed, which its checkpoint cannot exceed) may add a
    unit's worth to them. Before the round's deadline the unit is also cut to what the
    worker can train by then, `stop_margin_s` before it (agents stop a heartbeat interval
    early), so a slow worker's unit still ends in time and is not cut short again.
    """
    h, per_step = config.inner.steps, step_tokens(config)
    units = config.units
    limit = None
    # A stored speed is bounded (workers.speed) and so is every config field, but a row
    # written before they were must not turn into inf x seconds -> NaN -> int() here.
    speed = plausible_speed(speed)
    if speed is None:
        fresh, limit = h, units.calibration_seconds
        reason = (
            f"calibration: this worker's speed is unknown; it trains up to H = {h} steps "
            f"for at most {limit:g} s, which measures it"
        )
    else:
        fit = _steps_in(units.target_seconds, speed, per_step)
        fresh = max(1, min(h, fit))
        reason = (
            f"{speed:,.0f} tokens/s x {units.target_seconds:,.0f} s target = {fit:,} steps"
            + (f", capped at H = {h}" if fit > h else "")
            + (", raised to 1" if fit < 1 else "")
        )
        if round_deadline is not None and now is not None:
            left = max(0.0, (round_deadline - now).total_seconds() - stop_margin_s)
            by_deadline = _steps_in(left, speed, per_step)
            if by_deadline < fresh:
                fresh = max(1, by_deadline)
                reason += (
                    f"; {fresh} fit in the {left:,.0f} s left to train before the round's deadline"
                )
    steps = min(h, resumed_steps + fresh)
    if resumed_steps:
        reason += f"; resumes its checkpoint of up to {resumed_steps} steps"
    trained = max(1, steps - resumed_steps)
    return UnitSize(steps=steps, trained_steps=trained, reason=reason, seconds=limit)


def _steps_in(seconds: float, speed: float, per_step: int) -> int:
    """Whole steps of `per_step` tokens that `seconds` at `speed` tokens/s hold; a
    non-finite product (never from bounded inputs) counts as unbounded: 2^62."""
    steps = seconds * speed / per_step
    return int(steps) if math.isfinite(steps) and steps < 2**62 else 2**62


def _comeback(worker: Worker) -> tuple[int, int] | None:
    """(unit id, steps its lease allowed) of the worker's latest lease if that expired and
    its unit is queued again in an open round: after a crash, the worker takes that unit
    back and resumes its checkpoint (the agent keeps one per unit) instead of another."""
    row = (
        Lease.objects.filter(worker=worker)
        .order_by("-granted_at", "-pk")
        .values_list("state", "unit_id", "steps", "unit__state", "unit__round__state")
        .first()
    )
    if row is None:
        return None
    state, unit_id, steps, unit_state, round_state = row
    queued = unit_state == WorkUnit.State.QUEUED and round_state == Round.State.OPEN
    return (unit_id, steps) if state == Lease.State.EXPIRED and queued else None


def _comeback_unit(comeback: tuple[int, int] | None) -> WorkUnit | None:
    if comeback is None:
        return None
    units = WorkUnit.objects.filter(pk=comeback[0], state=WorkUnit.State.QUEUED)
    if connection.features.has_select_for_update_skip_locked:
        units = units.select_for_update(skip_locked=True)
    return units.first()


def _check_lease_limit(
    worker: Worker, policy: SchedulerPolicy, now: datetime, handing_in: int | None = None
) -> None:
    held = list(
        Lease.objects.filter(worker=worker, state=Lease.State.ACTIVE, deadline__gte=now)
        .exclude(pk=handing_in if handing_in is not None else -1)  # one lease, in hand-in
        .order_by("pk")
        .values_list("pk", flat=True)[: policy.worker_max_leases]
    )
    if len(held) >= policy.worker_max_leases:
        raise LeaseLimitReached(
            f"worker {worker.pk} already holds lease(s) {held}; complete or release them "
            "before asking for more work",
            leases=held,
        )


def _check_lease_limit_or_reclaim(
    worker: Worker, policy: SchedulerPolicy, now: datetime, handing_in: int | None = None
) -> LeaseGrant | None:
    """None when `worker` is below its lease limit; at the limit, a grant it never heard
    of given back (`_reclaim_unheard`), or LeaseLimitReached."""
    try:
        _check_lease_limit(worker, policy, now, handing_in)
    except LeaseLimitReached:
        with transaction.atomic():
            reclaimed = _reclaim_unheard(worker, now)
        if reclaimed is None:
            raise
        return reclaimed
    return None


def _reclaim_unheard(worker: Worker, now: datetime) -> LeaseGrant | None:
    """The worker's active lease that it never used, under a new secret; None if none.

    A grant whose answer was lost (a time-out at a round boundary, a dropped connection)
    leaves the worker at its lease limit holding a lease it does not know: it asks again
    and, before issue 23, heard 409 lease_limit_reached until the lease expired, holding
    its unit, and the round, for DIPACO_LEASE_TIMEOUT_S. A lease never heartbeated and
    whose manifest was never asked for cannot have been started, so asking again proves
    the answer was lost: the same lease is answered again, with a fresh secret (the old
    one is never shown twice, it is stored hashed; a stray process holding it loses it).
    """
    lease = (
        Lease.objects.select_for_update()
        .filter(
            worker=worker,
            state=Lease.State.ACTIVE,
            deadline__gte=now,
            heartbeat_at__isnull=True,
            download_bytes__isnull=True,
            unit__state=WorkUnit.State.LEASED,
        )
        .order_by("-granted_at", "-pk")
        .first()
    )
    if lease is None:
        return None
    secret = tokens.generate_token(tokens.LEASE_PREFIX)
    lease.secret_hash = tokens.hash_token(secret)
    lease.save(update_fields=["secret_hash"])
    lease = Lease.objects.select_related("unit__round__run", "unit__path").get(pk=lease.pk)
    logger.info(
        "lease %s: its grant was never heard; given again to worker %s", lease.pk, worker.pk
    )
    return LeaseGrant(lease=lease, secret=secret)


# Completed leases looked at for a worker's warm paths: more than the paths one worker
# trains in a round or two, few enough that the read stays one short index scan.
WARM_LOOKBACK = 64


def _recent_paths(worker: Worker, handing_in: int | None = None) -> dict[int, int]:
    """Path id -> rank (0: completed last) of the paths among the worker's latest
    completed units: the paths whose inner state it keeps warm. The path of the lease it
    is handing in (`handing_in`) ranks first: that completion is on its way."""
    latest = list(
        Lease.objects.filter(worker=worker, state=Lease.State.COMPLETED)
        .order_by("-ended_at", "-pk")
        .values_list("unit__path_id", flat=True)[:WARM_LOOKBACK]
    )
    if handing_in is not None:
        latest = [
            *Lease.objects.filter(pk=handing_in, worker=worker).values_list(
                "unit__path_id", flat=True
            ),
            *latest,
        ]
    ranks: dict[int, int] = {}
    for path_id in latest:
        ranks.setdefault(path_id, len(ranks))
    return ranks


def _anything_queued() -> bool:
    return WorkUnit.objects.filter(
        state=WorkUnit.State.QUEUED,
        round__state=Round.State.OPEN,
        round__run__state=Run.State.RUNNING,
    ).exists()


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


# --- round boundaries without a stampede (issue 23) ----------------------------------------
#
# When a round closes, every volunteer that finished its unit waits for the next one. Before
# issue 23 each 204 said "ask again in workers / DIPACO_IDLE_POLL_RATE seconds", the same
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
    deficit = _pace_deficit_s(_cached_groups()[0], now, policy)
    if deficit > 0:  # spread over as long again: the late ones keep about the pace
        return max(1, math.ceil(deficit + rng.uniform(0.0, max(1.0, deficit))))
    return max(1, math.ceil(base * rng.uniform(1.0, 1.5)))


_rng = random.Random()


def _waiting_workers() -> int:
    """Workers seen lately (the cached count of `idle_retry_after_s`): who may be waiting."""
    return _active_workers[1]


def _pace_deficit_s(groups: list[dict[str, Any]], now: datetime, policy: SchedulerPolicy) -> float:
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


def _cached_groups(*, refresh: bool = False) -> tuple[list[dict[str, Any]], bool]:
    """(groups, whether they were just counted)."""
    global _groups
    counted_at, groups = _groups
    if refresh or time.monotonic() - counted_at > GROUPS_TTL_S:
        groups = _open_groups()
        _groups = (time.monotonic(), groups)
        return groups, True
    return groups, False


def _grantable(unit: WorkUnit) -> bool:
    return (
        unit.round.state == Round.State.OPEN
        and unit.round.run.state == Run.State.RUNNING
        and unit.path.state == Path.State.ACTIVE
    )


def _count_grant(groups: list[dict[str, Any]], unit: WorkUnit) -> None:
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


def _next_queued_unit(
    groups: list[dict[str, Any]], warm_paths: dict[int, int], worker: Worker | None = None
) -> WorkUnit | None:
    """The queued unit to grant next, in the order of docs/design.md §4.2, or None.

    Two cheap queries instead of one that ranks every queued unit: first the groups
    (`_open_groups`); then, group by group in preference order, the first queued unit
    by the partial index ``unit_queued_next_idx``, locked with SKIP LOCKED where the
    database has it (no join here: joined rows would be sorted in full before the
    LIMIT). A correlated per-unit coverage subquery made a grant cost O(queued units²):
    3.3 s with 5,000 units queued in one path.
    """
    if worker is not None:  # probation and referees: a check copy first (rounds.replication)
        check = replication.preferred_check(worker, groups)
        if check is not None:
            return check
    ranked = sorted(
        groups,
        key=lambda g: (
            warm_paths.get(g["path_id"], len(warm_paths)),
            g["covered"],
            g["round_id"],
            g["path__index"],
        ),
    )
    for group in ranked:
        candidates = WorkUnit.objects.filter(
            state=WorkUnit.State.QUEUED, round_id=group["round_id"], path_id=group["path_id"]
        ).order_by("replica")  # unique within a (round, path): the partial index's order
        if worker is not None:  # never the check copy of a unit it trained (issue 19)
            candidates = candidates.filter(replication.not_own_check(worker))
        if connection.features.has_select_for_update_skip_locked:
            candidates = candidates.select_for_update(skip_locked=True)
        unit = candidates.first()
        if unit is not None:
            return unit
    return None


def fetch_lease(lease_id: int) -> Lease | None:
    """The lease with its unit, round, run and path, read afresh."""
    related = Lease.objects.select_related("unit__round__run", "unit__path", "worker")
    return related.filter(pk=lease_id).first()


def load_own_lease(worker: Worker, lease_id: int, secret: str) -> Lease:
    """The lease, if it exists, belongs to `worker` and `secret` is its secret."""
    if worker.revoked:
        raise WorkerRevoked(f"worker {worker.pk} was revoked")
    lease = fetch_lease(lease_id)
    if lease is None:
        raise LeaseNotFound(f"lease {lease_id} does not exist; ask for a new lease")
    if lease.worker_id != worker.pk:
        raise LeaseNotYours(f"lease {lease_id} belongs to another worker")
    if not tokens.token_matches(secret, lease.secret_hash):
        raise LeaseSecretInvalid(f"wrong secret for lease {lease_id}; use the one it came with")
    return lease


def check_lease_live(lease: Lease, now: datetime) -> None:
    """Refuse work under a lease that ended, ran out, or whose round or run stopped."""
    round_ = lease.unit.round
    if round_.run.state in TERMINAL:
        raise RunNotActive(f"run {round_.run.name!r} is {round_.run.state}; stop training")
    if round_.state != Round.State.OPEN:
        raise RoundClosed(f"round {round_.t} is {round_.state}; this work is no longer needed")
    if lease.state == Lease.State.EXPIRED or (
        lease.state == Lease.State.ACTIVE and lease.deadline < now
    ):
        raise LeaseExpired(
            f"lease {lease.pk} expired at {lease.deadline.isoformat()}; its unit went back "
            "to the queue, ask for a new lease",
            deadline=lease.deadline.isoformat(),
        )
    if lease.state != Lease.State.ACTIVE:
        raise LeaseNotActive(f"lease {lease.pk} is {lease.state}", state=lease.state)


def check_salvage(lease: Lease, now: datetime) -> bool:
    """False for a live lease; True for one whose Δ may still be salvaged: it ran out of
    time (or was expired) while its round is open and no other lease holds its unit.
    Raises, saying why, for any other lease (rounds.complete accepts the salvaged Δ)."""
    try:
        check_lease_live(lease, now)
        return False
    except LeaseExpired:
        others = Lease.objects.filter(unit_id=lease.unit_id, state=Lease.State.ACTIVE).exclude(
            pk=lease.pk
        )
        if lease.unit.state == WorkUnit.State.DONE or others.exists():
            raise
        return True


def authorize_upload(
    worker: Worker, lease_id: int, secret: str, *, now: datetime | None = None
) -> Lease:
    """Like `authorize_lease`, but an expired lease whose Δ can still be salvaged passes."""
    lease = load_own_lease(worker, lease_id, secret)
    check_salvage(lease, now or timezone.now())
    return lease


def authorize_lease(
    worker: Worker, lease_id: int, secret: str, *, now: datetime | None = None
) -> Lease:
    """The live lease `lease_id` of `worker`: the check before upload URLs or a manifest."""
    lease = load_own_lease(worker, lease_id, secret)
    check_lease_live(lease, now or timezone.now())
    return lease


def heartbeat(worker: Worker, lease_id: int, secret: str, *, now: datetime | None = None) -> Lease:
    """Extend a live lease to now + the heartbeat timeout, never past its hard deadline.

    Heartbeats are most of the worker API's traffic (every worker, every 30 s), so the
    usual case is one conditional UPDATE that checks everything `authorize_lease` checks
    (owner, secret, active and in time, round open, run live) and one narrow read of the
    new deadline. Only when it matches no row is the lease loaded in full, to raise the
    error that says why.
    """
    now = now or timezone.now()
    if worker.revoked:
        raise WorkerRevoked(f"worker {worker.pk} was revoked")
    timeout = timedelta(seconds=lease_timeout_s())
    renew = _renew_on_postgres if connection.vendor == "postgresql" else _renew_with_orm
    row = renew(worker.pk, lease_id, secret, now, now + timeout)
    if row is not None:
        renewed = Lease(
            pk=lease_id,
            worker_id=worker.pk,
            state=Lease.State.ACTIVE,
            heartbeat_at=now,
            deadline=row[0],
            hard_deadline=row[1],
        )
        renewed.round_deadline = row[2]  # may have moved up (rounds.close, adaptive)
        return renewed
    lease = authorize_lease(worker, lease_id, secret, now=now)  # raises: says why
    raise LeaseNotActive(f"lease {lease.pk} is {lease.state}", state=lease.state)


def _renew_with_orm(
    worker_id: int, lease_id: int, secret: str, now: datetime, until: datetime
) -> tuple[datetime, datetime, datetime | None] | None:
    """`_renew_on_postgres` for the other databases (SQLite: the embedded server)."""
    renewed = (
        Lease.objects.filter(
            pk=lease_id,
            worker_id=worker_id,
            secret_hash=tokens.hash_token(secret),
            state=Lease.State.ACTIVE,
            deadline__gte=now,
            unit__round__state=Round.State.OPEN,
        )
        .exclude(unit__round__run__state__in=TERMINAL)
        .update(deadline=Least(F("hard_deadline"), Value(until)), heartbeat_at=now)
    )
    if not renewed:
        return None
    return (
        Lease.objects.filter(pk=lease_id)
        .values_list("deadline", "hard_deadline", "unit__round__deadline")
        .first()
    )


def _renew_sql() -> str:
    """The heartbeat's UPDATE, written once from the models' own table and column names."""
    lease, unit, round_, run = (m._meta.db_table for m in (Lease, WorkUnit, Round, Run))
    return f"""
        UPDATE {lease} SET deadline = LEAST(hard_deadline, %(until)s), heartbeat_at = %(now)s
        WHERE id = %(lease)s AND worker_id = %(worker)s AND secret_hash = %(secret)s
          AND state = %(active)s AND deadline >= %(now)s
          AND unit_id IN (
            SELECT u.id FROM {unit} u
            JOIN {round_} r ON r.id = u.round_id JOIN {run} run ON run.id = r.run_id
            WHERE u.id = {lease}.unit_id AND r.state = %(open)s
              AND NOT (run.state = ANY(%(terminal)s)))
        RETURNING deadline, hard_deadline,
          (SELECT r.deadline FROM {unit} u JOIN {round_} r ON r.id = u.round_id
           WHERE u.id = {lease}.unit_id)
    """


def _renew_on_postgres(
    worker_id: int, lease_id: int, secret: str, now: datetime, until: datetime
) -> tuple[datetime, datetime, datetime | None] | None:
    """One statement for a heartbeat on PostgreSQL: (deadline, hard deadline, the round's
    deadline, which an adaptive close may have moved up), or None if
    the lease is not this worker's live lease under `secret` in an open round of a live run.

    Heartbeats are most of the worker API's traffic; building the ORM's UPDATE with its
    joined filter cost more CPU than the database spent running it.
    """
    params = {
        "until": until,
        "now": now,
        "lease": lease_id,
        "worker": worker_id,
        "secret": tokens.hash_token(secret),
        "active": Lease.State.ACTIVE.value,
        "open": Round.State.OPEN.value,
        "terminal": sorted(str(state) for state in TERMINAL),
    }
    with connection.cursor() as cursor:
        cursor.execute(_RENEW_SQL, params)
        row = cursor.fetchone()
    return None if row is None else (row[0], row[1], row[2])


_RENEW_SQL = _renew_sql()


def release(worker: Worker, lease_id: int, secret: str, *, now: datetime | None = None) -> Lease:
    """Give a unit back before finishing it; releasing twice is a no-op."""
    now = now or timezone.now()
    lease = load_own_lease(worker, lease_id, secret)
    if lease.state == Lease.State.RELEASED:
        return lease
    with transaction.atomic():
        ended = Lease.objects.filter(pk=lease.pk, state=Lease.State.ACTIVE).update(
            state=Lease.State.RELEASED, ended_at=now
        )
        if ended:
            _requeue(lease.unit_id, now)
    lease = fetch_lease(lease.pk) or lease
    if not ended:
        check_lease_live(lease, now)
        raise LeaseNotActive(f"lease {lease.pk} is {lease.state}", state=lease.state)
    return lease


def expire_leases(*, now: datetime | None = None) -> int:
    """Expire active leases past their deadline or held by revoked workers; requeue units.

    The beat task calls this periodically; returns how many leases it expired.
    """
    now = now or timezone.now()
    stale = Q(state=Lease.State.ACTIVE) & (Q(deadline__lt=now) | Q(worker__revoked=True))
    rows = list(
        Lease.objects.filter(stale).values_list("pk", "unit_id", "worker_id")[:EXPIRE_BATCH]
    )
    expired = 0
    for lease_id, unit_id, worker_id in rows:
        with transaction.atomic():
            # Re-checked in the UPDATE: a heartbeat may have saved the lease since the read.
            if not Lease.objects.filter(stale, pk=lease_id).update(
                state=Lease.State.EXPIRED, ended_at=now
            ):
                continue
            _requeue(unit_id, now)
            Worker.objects.filter(pk=worker_id).update(leases_expired=F("leases_expired") + 1)
        expired += 1
    if expired:
        logger.info("expired %d lease(s)", expired)
    return expired


def _requeue(unit_id: int, now: datetime) -> None:
    """A leased unit back to the queue, or given up after too many attempts."""
    leased = WorkUnit.objects.filter(pk=unit_id, state=WorkUnit.State.LEASED)
    limit = current_policy().unit_max_attempts
    if leased.filter(attempts__lt=limit).update(state=WorkUnit.State.QUEUED, updated_at=now):
        return
    if leased.update(state=WorkUnit.State.EXPIRED, updated_at=now):
        logger.warning(
            "unit %s given up after %d attempts (DIPACO_UNIT_MAX_ATTEMPTS)", unit_id, limit
        )
