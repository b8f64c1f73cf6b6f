"""How often an established worker is audited (rounds.verification.replication): a rate
grown with its share of a round's updates, and a bound on the gap between two audits, so
a worker that turns hostile after probation (a sleeper) is compared soon after it turns."""

from __future__ import annotations

import math

from django.db.models import Exists, OuterRef

from dipaco_server.rounds.models import CHECK_OFFSET, Lease, Round, WorkUnit
from dipaco_server.workers import trust
from dipaco_server.workers.models import Worker

# How much faster an established worker is audited per share of a round's updates it
# supplies (`audit_rate`): a worker supplying a quarter of them is audited at twice the base.
SHARE_AUDIT = 4.0
# An established worker's audits come at most this many times its mean interval apart
# (`audit_overdue`).
AUDIT_SPREAD = 2.0


def audit_rate(worker: Worker, unit: WorkUnit) -> float:
    """The share of an established worker's units replicated now: its trust's rate
    (workers.trust.replication_rate: DIPACO_REPLICATION_RATE at trust 1, rising as trust
    falls), grown with the share of the run's last closed round's originals it supplied
    (x (1 + SHARE_AUDIT x share), at most 1). What an unaudited worker can do to a module
    grows with the share of its updates it supplies: among 10,000 workers a sleeper moves
    nothing, among 4 it is a quarter of every step (live: a sleeper biasing a quarter of a
    2x2 run's units, audited at 0.05, was credited all it claimed). 0 when audits
    are off (the rate 0)."""
    base = trust.replication_rate(worker)
    if base <= 0 or base >= 1:
        return base
    return min(1.0, base * (1 + SHARE_AUDIT * round_share(worker.pk, unit.round_id)))


def round_share(worker_id: int, round_id: int) -> float:
    """The worker's share of the originals completed in the last closed round of the run
    that round `round_id` belongs to (each module's updates come from its paths' units:
    the round's share stands for the modules'); 0 before any round closed."""
    run_id = Round.objects.filter(pk=round_id).values_list("run_id", flat=True).first()
    last = (
        Round.objects.filter(run_id=run_id, state=Round.State.CLOSED)
        .order_by("-t")
        .values_list("pk", flat=True)
        .first()
    )
    if last is None:
        return 0.0
    done = Lease.objects.filter(
        unit__round_id=last, unit__replica__lt=CHECK_OFFSET, state=Lease.State.COMPLETED
    )
    total = done.count()
    return done.filter(worker_id=worker_id).count() / total if total else 0.0


def audit_overdue(worker: Worker, unit: WorkUnit, rate: float) -> bool:
    """Whether none of the worker's last ceil(AUDIT_SPREAD / rate) - 1 originals before
    `unit` was replicated: audits are drawn at random (the worker cannot foresee which unit
    is checked), and this bounds the gap between two, so a worker that turns hostile after
    probation (a sleeper) is compared within that many units of turning, whatever the
    draws. Probation replicates every unit, so the count starts when it ends."""
    gap = math.ceil(AUDIT_SPREAD / rate) - 1
    copy = WorkUnit.objects.filter(
        round_id=OuterRef("unit__round_id"),
        path_id=OuterRef("unit__path_id"),
        replica=CHECK_OFFSET + OuterRef("unit__replica"),
    )
    last = list(
        Lease.objects.filter(worker=worker, unit__replica__lt=CHECK_OFFSET)
        .exclude(unit=unit)
        .annotate(checked=Exists(copy))
        .order_by("-pk")
        .values_list("checked", flat=True)[:gap]
    )
    return len(last) >= gap and not any(last)
