"""A lease after its grant: finding it and checking its secret, whether it is live or
salvageable, heartbeats, release, and the expiry sweep.

Granting is rounds.protocol.grant; completion is rounds.protocol.complete.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Least
from django.utils import timezone

from dipaco_server.core import tokens
from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.protocol.pacing import lease_timeout_s
from dipaco_server.runs.errors import (
    LeaseExpired,
    LeaseNotActive,
    LeaseNotFound,
    LeaseNotYours,
    LeaseSecretInvalid,
    RoundClosed,
    RunNotActive,
)
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import TERMINAL
from dipaco_server.workers.errors import WorkerRevoked
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)
EXPIRE_BATCH = 500


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
    Raises, saying why, for any other lease (rounds.protocol.complete accepts the salvaged Δ)."""
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


def authorize_lease(
    worker: Worker,
    lease_id: int,
    secret: str,
    *,
    salvage: bool = False,
    now: datetime | None = None,
) -> Lease:
    """The lease `lease_id` of `worker`, checked by its secret: live (before a manifest,
    upload URLs or a rebase); with `salvage`, also an expired one whose Δ may still be
    salvaged (upload URLs for a partial Δ, rounds.protocol.complete)."""
    lease = load_own_lease(worker, lease_id, secret)
    check = check_salvage if salvage else check_lease_live
    check(lease, now or timezone.now())
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
        renewed.round_deadline = row[2]  # may have moved up (rounds.lifecycle.close, adaptive)
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
