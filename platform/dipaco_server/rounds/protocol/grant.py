"""Granting a unit to a worker, race-free.

A grant claims one queued unit with a conditional UPDATE (``... WHERE state =
'queued'``), which is correct on every database: of two concurrent claims of
one unit exactly one updates a row. On PostgreSQL the candidate is also read
with ``SELECT ... FOR UPDATE SKIP LOCKED``, so concurrent grants take different
units instead of queueing behind one row. SQLite serialises writers (the
settings open transactions IMMEDIATE), so the conditional UPDATE suffices there.

How long the unit is: rounds.protocol.sizing; when to come back if none is granted:
rounds.protocol.pacing.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from dipaco.data.windows import step_tokens
from dipaco_server.core import tokens
from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.policy import SchedulerPolicy, current_policy
from dipaco_server.rounds.protocol.pacing import (
    cached_groups,
    count_grant,
    grantable,
    heartbeat_interval_s,
    lease_timeout_s,
    pace_deficit_s,
)
from dipaco_server.rounds.protocol.sizing import size_unit
from dipaco_server.rounds.signals import lease_granted
from dipaco_server.rounds.verification import replication
from dipaco_server.runs.errors import (
    LeaseLimitReached,
)
from dipaco_server.runs.models import Run
from dipaco_server.runs.phases import phase_config
from dipaco_server.workers import trust
from dipaco_server.workers.errors import WorkerRevoked
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)

# A claim loses only when another grant took the same unit in between; a few
# retries on the next candidate is plenty (each retry sees that unit as taken).
CLAIM_ATTEMPTS = 5


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
    trust.check_trusted(worker)  # work that failed verification too often: no more
    # Idle polls are common at round boundaries: when nothing is queued (one look at the
    # partial index of queued units), answer without a transaction.
    if not _anything_queued():
        # a worker at its limit hears so even then (or gets back a grant it never heard)
        return _check_lease_limit_or_reclaim(worker, policy, now, handing_in)
    groups, fresh = cached_groups()
    if pace_deficit_s(groups, now, policy) > 0:
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
                unit = _next_queued_unit(groups, warm_paths, locked, policy, now)
            if unit is None and not fresh:  # the cached groups ran dry: count again
                groups, fresh = cached_groups(refresh=True)
                unit = _next_queued_unit(groups, warm_paths, locked, policy, now)
            if unit is None:
                return None
            claimed = _claim(unit, groups, now)
            grant = None
            if claimed is not None:
                grant = _create_lease(claimed, locked, policy, now, resumed_steps)
        if grant is None:  # another grant took it, or it went stale: count again, try again
            groups, fresh = cached_groups(refresh=True)
            comeback = None
            continue
        logger.info(
            "lease %s: unit %s to worker %s, %d steps (%s)",
            grant.lease.pk, grant.unit.pk, worker.pk, grant.lease.steps, grant.lease.size_reason,
        )  # fmt: skip
        return grant
    return None


def _claim(unit: WorkUnit, groups: list[dict[str, Any]], now: datetime) -> WorkUnit | None:
    """`unit` moved queued -> leased by a conditional UPDATE, read again with what the lease
    answer needs; None when another grant took it first, or when it went stale (its round,
    run or path stopped since the groups were counted: the claim is then rolled back as the
    caller's transaction ends). Inside the caller's transaction."""
    claimed = WorkUnit.objects.filter(pk=unit.pk, state=WorkUnit.State.QUEUED).update(
        state=WorkUnit.State.LEASED, attempts=F("attempts") + 1, updated_at=now
    )
    if not claimed:
        return None
    count_grant(groups, unit)
    # The claimed unit with what the lease answer needs, in one read.
    unit = WorkUnit.objects.select_related("round__run", "path").get(pk=unit.pk)
    if not grantable(unit):  # cached groups of a round, run or path stopped
        transaction.set_rollback(True)  # the claim is undone as the block ends
        return None
    return unit


def _create_lease(
    unit: WorkUnit, worker: Worker, policy: SchedulerPolicy, now: datetime, resumed_steps: int
) -> LeaseGrant:
    """The lease of a claimed `unit`: its secret, its size (rounds.protocol.sizing) and its
    deadlines; maybe a check copy of the unit too (sampled replication)."""
    secret = tokens.generate_token(tokens.LEASE_PREFIX)
    config = phase_config(unit.round.run.run_config, unit.path.phase)
    size = size_unit(
        config, worker.measured_speed, resumed_steps=resumed_steps,
        round_deadline=unit.round.deadline, now=now,
        stop_margin_s=heartbeat_interval_s(policy),
    )  # fmt: skip
    budget = policy.lease_budget_s(size.trained_steps * step_tokens(config), worker.measured_speed)
    if size.seconds is not None:  # time to stop, upload and complete
        budget = max(budget, size.seconds + policy.lease_min_s)
    hard_deadline = now + timedelta(seconds=budget)
    timeout = timedelta(seconds=lease_timeout_s(policy))
    lease = Lease.objects.create(
        unit=unit,
        worker=worker,
        secret_hash=tokens.hash_token(secret),
        attempt=unit.attempts,
        granted_at=now,
        deadline=min(hard_deadline, now + timeout),
        hard_deadline=hard_deadline,
        steps=size.steps,
        seconds_limit=size.seconds,
        size_reason=size.reason[:240],
    )
    replication.maybe_replicate(unit, worker)  # sampled replication: untrusted work is checked
    # The round's life scores the unit's base losses while it trains (rounds.lifecycle.receivers).
    transaction.on_commit(lambda: lease_granted.send(Lease, lease=lease))
    return LeaseGrant(lease=lease, secret=secret)


def trains_cold(lease: Lease) -> bool:
    """Whether the lease's unit trains from fresh AdamW moments (its `cold`): every
    replicated unit (replication.replicated: two copies compare only when both start
    alike), and a share DIPACO_COLD_SHARE of the others, drawn by a hash of the lease keyed
    with the server's secret, so a worker cannot tell a drawn one from an audited one; at 1
    every lease is cold and `cold` says nothing about audits (workers.trust)."""
    if replication.replicated(lease.unit):
        return True
    share = trust.setting("DIPACO_COLD_SHARE")
    if share <= 0 or share >= 1:
        return share >= 1
    key = f"{settings.SECRET_KEY}:cold:{lease.pk}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") < share * 2**64


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
    and once heard 409 lease_limit_reached until the lease expired, holding
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


def _useless_check(unit: WorkUnit, worker: Worker, policy: SchedulerPolicy, now: datetime) -> bool:
    """Whether `unit` is a check copy `worker` should not take: one that pairs it with the
    same partner again (replication.repeats_partner), or one it could not train whole before
    the round's deadline. A cut copy (rounds.protocol.sizing) is no copy of its original:
    fewer steps from the same start make another Δ, which the comparison then refused in
    the original's place (bench/attacks_live.py: a 6-step copy against a 25-step original,
    norms 3.9 x apart), so it stays queued (dropped when the round closes)."""
    if not replication.is_check(unit):
        return False
    if replication.repeats_partner(worker, unit):
        return True
    unit = WorkUnit.objects.select_related("round__run", "path").get(pk=unit.pk)
    config = phase_config(unit.round.run.run_config, unit.path.phase)
    size = size_unit(
        config, worker.measured_speed, round_deadline=unit.round.deadline, now=now,
        stop_margin_s=heartbeat_interval_s(policy),
    )  # fmt: skip
    return size.steps < config.inner.steps


def _next_queued_unit(
    groups: list[dict[str, Any]],
    warm_paths: dict[int, int],
    worker: Worker,
    policy: SchedulerPolicy,
    now: datetime,
) -> WorkUnit | None:
    """The queued unit to grant next, in the order of docs/design.md §4.2, or None.

    Two cheap queries instead of one that ranks every queued unit: first the groups
    (`_open_groups`); then, group by group in preference order, the first queued unit
    by the partial index ``unit_queued_next_idx``, locked with SKIP LOCKED where the
    database has it (no join here: joined rows would be sorted in full before the
    LIMIT). A correlated per-unit coverage subquery made a grant cost O(queued units²):
    3.3 s with 5,000 units queued in one path.
    """
    # probation and referees: a check copy first (rounds.verification.replication)
    check = replication.preferred_check(worker, groups)
    if check is not None and not _useless_check(check, worker, policy, now):
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
        candidates = candidates.filter(replication.not_own_check(worker))  # never its own
        if connection.features.has_select_for_update_skip_locked:
            candidates = candidates.select_for_update(skip_locked=True)
        unit = candidates.first()
        if unit is not None and _useless_check(unit, worker, policy, now):
            continue  # a check copy it should leave queued
        if unit is not None:
            return unit
    return None
