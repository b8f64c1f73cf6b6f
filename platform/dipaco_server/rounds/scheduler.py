"""Leases: granting units to workers race-free, heartbeats, release, and the expiry sweep.

A grant claims one queued unit with a conditional UPDATE (``... WHERE state =
'queued'``), which is correct on every database: of two concurrent claims of
one unit exactly one updates a row. On PostgreSQL the candidate is also read
with ``SELECT ... FOR UPDATE SKIP LOCKED``, so concurrent grants take different
units instead of queueing behind one row. SQLite serialises writers (the
settings open transactions IMMEDIATE), so the conditional UPDATE suffices there.

Completion is in rounds.completion.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count, F, Q, Value
from django.db.models.functions import Least
from django.utils import timezone

from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.policy import SchedulerPolicy, current_policy
from dipaco_server.rounds.services import unit_tokens
from dipaco_server.runs.errors import (
    LeaseExpired,
    LeaseLimitReached,
    LeaseNotActive,
    LeaseNotFound,
    LeaseNotYours,
    LeaseSecretInvalid,
    RoundClosed,
    RunNotActive,
    WorkerRevoked,
)
from dipaco_server.runs.models import Path, Run
from dipaco_server.runs.phases import phase_config
from dipaco_server.runs.services import TERMINAL
from dipaco_server.workers import tokens
from dipaco_server.workers.models import Worker

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


def grant_lease(worker: Worker, *, now: datetime | None = None) -> LeaseGrant | None:
    """Lease one queued unit to `worker`, or None when no unit is waiting.

    Preference (DESIGN §4.2): a unit of a path the worker completed before (its
    AdamW state is warm there; the most recently completed first), then the path with
    the fewest units leased or done in its round, then the oldest round.

    Every path the worker trained lately counts, not only its last: a worker with two
    paths a round (fewer workers than units) otherwise gets its second path back only
    if it asks before the other workers, and trains someone else's with cold moments
    (bench/platform_run.py measured that drift from dipaco simulate).
    """
    now = now or timezone.now()
    policy = current_policy()
    # Idle polls are common at round boundaries: when nothing is queued (one look at the
    # partial index of queued units), answer without a transaction.
    if not _anything_queued():
        _check_lease_limit(worker, policy, now)  # a worker at its limit hears so even then
        return None
    groups, fresh = _cached_groups()
    warm_paths = _recent_paths(worker)
    for _ in range(CLAIM_ATTEMPTS):
        with transaction.atomic():
            # Locking the worker row serialises one worker's grants, so its lease limit holds.
            locked = Worker.objects.select_for_update().filter(pk=worker.pk).first()
            if locked is None or locked.revoked:
                raise WorkerRevoked(f"worker {worker.pk} was revoked; it gets no more work")
            _check_lease_limit(locked, policy, now)
            unit = _next_queued_unit(groups, warm_paths)
            if unit is None and not fresh:  # the cached groups ran dry: count again
                groups, fresh = _cached_groups(refresh=True)
                unit = _next_queued_unit(groups, warm_paths)
            if unit is None:
                return None
            claimed = WorkUnit.objects.filter(pk=unit.pk, state=WorkUnit.State.QUEUED).update(
                state=WorkUnit.State.LEASED, attempts=F("attempts") + 1, updated_at=now
            )
            if not claimed:  # another grant took it: count again before the next try
                groups, fresh = _cached_groups(refresh=True)
                continue
            _count_grant(groups, unit)
            # The claimed unit with what the lease answer needs, in one read.
            unit = WorkUnit.objects.select_related("round__run", "path").get(pk=unit.pk)
            stale = not _grantable(unit)  # cached groups of a round, run or path stopped
            if stale:
                transaction.set_rollback(True)  # the claim is undone as the block ends
            else:
                secret = tokens.generate_token(tokens.LEASE_PREFIX)
                budget = policy.lease_budget_s(
                    unit_tokens(phase_config(unit.round.run.run_config, unit.path.phase)),
                    locked.measured_speed,
                )
                hard_deadline = now + timedelta(seconds=budget)
                timeout = timedelta(seconds=policy.lease_timeout_s)
                lease = Lease.objects.create(
                    unit=unit,
                    worker=locked,
                    secret_hash=tokens.hash_token(secret),
                    attempt=unit.attempts,
                    granted_at=now,
                    deadline=min(hard_deadline, now + timeout),
                    hard_deadline=hard_deadline,
                )
        if stale:
            groups, fresh = _cached_groups(refresh=True)
            continue
        logger.info("lease %s: unit %s to worker %s", lease.pk, unit.pk, worker.pk)
        return LeaseGrant(lease=lease, secret=secret)
    return None


def _check_lease_limit(worker: Worker, policy: SchedulerPolicy, now: datetime) -> None:
    held = list(
        Lease.objects.filter(worker=worker, state=Lease.State.ACTIVE, deadline__gte=now)
        .order_by("pk")
        .values_list("pk", flat=True)[: policy.worker_max_leases]
    )
    if len(held) >= policy.worker_max_leases:
        raise LeaseLimitReached(
            f"worker {worker.pk} already holds lease(s) {held}; complete or release them "
            "before asking for more work",
            leases=held,
        )


# Completed leases looked at for a worker's warm paths: more than the paths one worker
# trains in a round or two, few enough that the read stays one short index scan.
WARM_LOOKBACK = 64


def _recent_paths(worker: Worker) -> dict[int, int]:
    """Path id -> rank (0: completed last) of the paths among the worker's latest
    completed units: the paths whose inner state it keeps warm."""
    latest = (
        Lease.objects.filter(worker=worker, state=Lease.State.COMPLETED)
        .order_by("-ended_at", "-pk")
        .values_list("unit__path_id", flat=True)[:WARM_LOOKBACK]
    )
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
    counted_at, active = _active_workers
    clock = time.monotonic()
    if clock - counted_at > ACTIVE_WORKERS_TTL_S:
        since = (now or timezone.now()) - ACTIVE_WORKERS_WINDOW
        active = Worker.objects.filter(last_seen__gte=since, revoked=False).count()
        _active_workers = (clock, active)
    return int(min(60, max(1, math.ceil(active / current_policy().idle_poll_rate))))


# The groups, counted at most every GROUPS_TTL_S per process. When a round opens, every
# volunteer asks for a unit within a minute; counting every unit of the round for each
# grant made that O(units) per grant and O(units²) per round. Between counts, each grant
# updates the cached counts itself, so paths stay balanced; a stale group only costs an
# empty look, after which the groups are counted again.
GROUPS_TTL_S = 1.0
_groups: tuple[float, list[dict[str, int]]] = (-math.inf, [])


def _cached_groups(*, refresh: bool = False) -> tuple[list[dict[str, int]], bool]:
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


def _count_grant(groups: list[dict[str, int]], unit: WorkUnit) -> None:
    for group in groups:
        if group["round_id"] == unit.round_id and group["path_id"] == unit.path_id:
            group["queued"] -= 1
            group["covered"] += 1


def _open_groups() -> list[dict[str, int]]:
    """The (round, path) groups of open rounds with queued units, with their queued and
    covered (leased or done) counts: one grouped scan of the units index."""
    return list(
        WorkUnit.objects.filter(
            round__state=Round.State.OPEN,
            round__run__state=Run.State.RUNNING,
            path__state=Path.State.ACTIVE,
        )
        .values("round_id", "path_id", "path__index")
        .annotate(
            queued=Count("pk", filter=Q(state=WorkUnit.State.QUEUED)),
            covered=Count("pk", filter=Q(state__in=[WorkUnit.State.LEASED, WorkUnit.State.DONE])),
        )
        .filter(queued__gt=0)
        .order_by()
    )


def _next_queued_unit(groups: list[dict[str, int]], warm_paths: dict[int, int]) -> WorkUnit | None:
    """The queued unit to grant next, in the order of DESIGN §4.2, or None.

    Two cheap queries instead of one that ranks every queued unit: first the groups
    (`_open_groups`); then, group by group in preference order, the first queued unit
    by the partial index ``unit_queued_next_idx``, locked with SKIP LOCKED where the
    database has it (no join here: joined rows would be sorted in full before the
    LIMIT). A correlated per-unit coverage subquery made a grant cost O(queued units²):
    3.3 s with 5,000 units queued in one path.
    """
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
    timeout = timedelta(seconds=current_policy().lease_timeout_s)
    renew = _renew_on_postgres if connection.vendor == "postgresql" else _renew_with_orm
    row = renew(worker.pk, lease_id, secret, now, now + timeout)
    if row is not None:
        return Lease(
            pk=lease_id,
            worker_id=worker.pk,
            state=Lease.State.ACTIVE,
            heartbeat_at=now,
            deadline=row[0],
            hard_deadline=row[1],
        )
    lease = authorize_lease(worker, lease_id, secret, now=now)  # raises: says why
    raise LeaseNotActive(f"lease {lease.pk} is {lease.state}", state=lease.state)


def _renew_with_orm(
    worker_id: int, lease_id: int, secret: str, now: datetime, until: datetime
) -> tuple[datetime, datetime] | None:
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
    return Lease.objects.filter(pk=lease_id).values_list("deadline", "hard_deadline").first()


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
        RETURNING deadline, hard_deadline
    """


def _renew_on_postgres(
    worker_id: int, lease_id: int, secret: str, now: datetime, until: datetime
) -> tuple[datetime, datetime] | None:
    """One statement for a heartbeat on PostgreSQL: (deadline, hard deadline), or None if
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
    return None if row is None else (row[0], row[1])


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
