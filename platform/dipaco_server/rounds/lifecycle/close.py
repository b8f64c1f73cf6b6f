"""Closing a round: deciding when it may close, then open → closing → closed.

Protocol step 3 of docs/design.md: a round closes when every unit is settled, or a
quorum is done and its deadline has passed; closing expires the leases still out so a
late completion is refused, and the outer step (rounds.outer.step) then runs once.

The deadline adapts (no round waits for its slowest unit): once a quorum is done and every unit has started, it moves
up to what the done units' durations say (`adaptive_deadline`: median + k·MAD after the
last grant), never later than the fixed one.
Units still out when it passes are not lost: agents learn the deadline from their lease
and heartbeats, stop before it and upload the Δ of the steps done (worker_agent), and the
round waits DIPACO_ROUND_SALVAGE_GRACE_S after the deadline for those partial Δs.

With ``outer.overlap`` "delayed" round t + 1 opens as round t starts closing
(rounds.lifecycle.tasks.start_closing), and round t + 1 closes only once round t is closed
(`Round.previous_published`).
"""

from __future__ import annotations

import math
import statistics
import time
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.protocol.pacing import heartbeat_interval_s
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import TERMINAL

# The completion path's check (rounds.protocol.api) recomputes the adaptive deadline at most this
# often per round and process: it reads every completed lease of the round, so doing it on
# every completion cost O(units) each, O(units²) a round (10,000 units: 50 million rows).
ADAPT_EVERY_S = 2.0
_adapted_at: dict[int, float] = {}  # round pk -> time.monotonic() of its last recomputation


def round_ready_to_close(
    round_: Round, *, now: datetime | None = None, adapt_every_s: float = 0.0
) -> bool:
    """True when every unit is settled, or a quorum is done and the deadline has passed.

    A queued check copy (rounds.verification.replication) never holds the round up; one being trained
    does, until the deadline and DIPACO_ROUND_SALVAGE_GRACE_S, like an original.

    `adapt_every_s`: recompute the adaptive deadline only if this process has not done so for
    this round within that many seconds (the completion path); otherwise the deadline as
    stored decides, and beat's close_ready_rounds (every 30 s) recomputes it regardless.
    """
    now = now or timezone.now()
    # Mid-round, the usual answer after a completion: units still out and the deadline
    # (as loaded) ahead. One indexed query instead of counting every unit of the round.
    before_deadline = round_.deadline is None or now < round_.deadline
    # A check copy (rounds.verification.replication) holds the round up only while someone trains it.
    unsettled = round_.units.filter(
        Q(state=WorkUnit.State.LEASED) | Q(state=WorkUnit.State.QUEUED, replica__lt=CHECK_OFFSET)
    )
    if before_deadline and unsettled.exists() and not _adapted(round_, now, adapt_every_s):
        return False
    round_.refresh_from_db(fields=["state", "deadline"])
    run_state = Run.objects.filter(pk=round_.run_id).values_list("state", flat=True).first()
    if round_.state != Round.State.OPEN or run_state in TERMINAL:
        return False  # a cancelled or failed run gets no more outer steps
    if not round_.previous_published():
        return False  # outer.overlap delayed: finish_round of round t - 1 tries again
    counts = round_.units.filter(replica__lt=CHECK_OFFSET).aggregate(
        total=Count("pk"),
        done=Count("pk", filter=Q(state=WorkUnit.State.DONE)),
        settled=Count("pk", filter=Q(state__in=[WorkUnit.State.DONE, WorkUnit.State.EXPIRED])),
    )
    if counts["done"] == 0:
        return False  # nothing to average: wait, however late it is
    policy = current_policy()
    if counts["settled"] == counts["total"]:
        checks_out = round_.units.filter(state=WorkUnit.State.LEASED, replica__gte=CHECK_OFFSET)
        if round_.deadline is None or not checks_out.exists():
            return True
        # Only check copies are still training (the deadline, fixed or adaptive, has passed,
        # or this round would not be here): they get the salvage grace an original would, so
        # that their Δs are compared with their originals' rather than refused and lost.
        return now >= round_.deadline + timedelta(seconds=policy.round_salvage_grace_s)
    quorum = max(1, math.ceil(policy.round_quorum * counts["total"]))
    if round_.deadline is None or counts["done"] < quorum:
        return False
    grace = 0.0
    if round_.units.filter(state=WorkUnit.State.LEASED).exists():
        grace = policy.round_salvage_grace_s  # time to hand in the partial Δs
    return now >= round_.deadline + timedelta(seconds=grace)


def adaptive_deadline(round_: Round) -> datetime | None:
    """When the units still out should be done, from how long the done ones took.

    The durations are the completed leases' (granted to completed); with k =
    DIPACO_ROUND_DEADLINE_MADS and the MAD taken as at least 10 % of the median (so equal
    durations still leave a margin), a unit granted at g is expected by g + median + k·MAD;
    the deadline is that of the last one granted, plus the heartbeat interval by which
    agents stop before the deadline they hear (`heartbeat_interval_s`). None before a quorum is done, while any
    unit still waits in the queue (fewer workers than units: a unit not yet started says
    nothing about when the round can end), or when no lease is out.
    """
    policy = current_policy()
    units = round_.units.filter(replica__lt=CHECK_OFFSET)
    if units.filter(state=WorkUnit.State.QUEUED).exists():
        return None
    total = units.count()
    leases = Lease.objects.filter(unit__round=round_, unit__replica__lt=CHECK_OFFSET)
    took = [
        (ended - granted).total_seconds()
        for granted, ended in leases.filter(
            state=Lease.State.COMPLETED, ended_at__isnull=False
        ).values_list("granted_at", "ended_at")
    ]
    latest = leases.filter(state=Lease.State.ACTIVE).order_by("-granted_at").first()
    if latest is None or not took or len(took) < max(1, math.ceil(policy.round_quorum * total)):
        return None
    median = statistics.median(took)
    mad = statistics.median(abs(d - median) for d in took)
    spread = policy.round_deadline_mads * max(mad, 0.1 * median)
    # Agents stop a heartbeat interval before the deadline they hear (time to upload on top
    # of the salvage grace): without it the last unit out had median + spread - interval to
    # train, nothing at all when units are short. In `dipaco demo` (1 s units, a 100 s
    # interval) a worker granted just after the first completion stopped after one step.
    margin = heartbeat_interval_s(policy)
    return latest.granted_at + timedelta(seconds=median + spread + margin)


def _adapted(round_: Round, now: datetime, every_s: float = 0.0) -> bool:
    """Move the round's deadline up to `adaptive_deadline` (earlier only); True when the
    deadline, so moved, has passed. With `every_s`, not again within that many seconds of
    this process's last recomputation for the round (False then: the stored deadline, which
    the caller checked, has not passed)."""
    if every_s > 0:
        clock = time.monotonic()
        if clock - _adapted_at.get(round_.pk, -math.inf) < every_s:
            return False
        if len(_adapted_at) > 256:  # rounds come and go: keep the table small
            _adapted_at.clear()
        _adapted_at[round_.pk] = clock
    adaptive = adaptive_deadline(round_)
    if adaptive is None or round_.deadline is None or adaptive >= round_.deadline:
        return False
    Round.objects.filter(pk=round_.pk, deadline__gt=adaptive).update(deadline=adaptive)
    round_.deadline = adaptive
    return now >= adaptive


def mark_round_closing(round_: Round, *, now: datetime | None = None) -> bool:
    """open → closing, exactly once: True for the one caller that should run the outer step.

    Units not done are given up and their active leases expire, so a late
    completion under them is refused (docs/design.md §4: stale work is never used).
    """
    now = now or timezone.now()
    with transaction.atomic():
        if not Round.objects.filter(pk=round_.pk, state=Round.State.OPEN).update(
            state=Round.State.CLOSING, closing_at=now, closing_started_at=now
        ):
            return False
        Lease.objects.filter(unit__round=round_, state=Lease.State.ACTIVE).update(
            state=Lease.State.EXPIRED, ended_at=now
        )
        round_.units.filter(state__in=[WorkUnit.State.QUEUED, WorkUnit.State.LEASED]).update(
            state=WorkUnit.State.EXPIRED, updated_at=now
        )
    round_.refresh_from_db(fields=["state"])
    return True


def mark_round_closed(round_: Round, *, now: datetime | None = None) -> bool:
    """closing → closed once the outer step has published the next versions."""
    now = now or timezone.now()
    won = Round.objects.filter(pk=round_.pk, state=Round.State.CLOSING).update(
        state=Round.State.CLOSED, closed_at=now
    )
    round_.refresh_from_db(fields=["state", "closed_at"])
    return bool(won)
