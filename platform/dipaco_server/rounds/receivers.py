"""What rounds does when a run's life cycle asks (runs.signals): open a due round, and end
the leases of a run that ended. Connected when the app is ready (RoundsConfig.ready)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.dispatch import receiver

from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.open import open_round
from dipaco_server.runs.models import Run
from dipaco_server.runs.signals import round_due, run_ended

logger = logging.getLogger(__name__)


@receiver(round_due, dispatch_uid="dipaco_server.rounds.open_due_round")
def open_due_round(sender: Any, *, run: Run, t: int, **_: Any) -> Round:
    """Round `t` of `run`, opened (rounds.open.open_round: opening an open round returns it)."""
    return open_round(run, t)


@receiver(run_ended, dispatch_uid="dipaco_server.rounds.end_leases")
def end_leases(sender: Any, *, run: Run, now: datetime, **_: Any) -> None:
    """A run that ended (finished, failed, cancelled) holds no lease: each active one is
    released and its unit given up, so no heartbeat extends it and no grant hands it back
    (a cancelled run's lease was answered again by POST /worker/lease before, issue 34).
    Not the workers' fault, so no lease counts as expired against them."""
    held = Lease.objects.filter(unit__round__run=run, state=Lease.State.ACTIVE)
    units = list(held.values_list("unit_id", flat=True))
    released = held.update(state=Lease.State.RELEASED, ended_at=now)
    WorkUnit.objects.filter(pk__in=units, state=WorkUnit.State.LEASED).update(
        state=WorkUnit.State.EXPIRED, updated_at=now
    )
    if released:
        logger.info("run %s ended: released its %d active lease(s)", run.pk, released)
