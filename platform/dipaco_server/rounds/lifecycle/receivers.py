"""What the round's life does when asked: open a due round and end the leases of a run that
ended (runs.signals), and close a round that a completion made ready (rounds.signals).
Connected when the app is ready (RoundsConfig.ready)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.dispatch import receiver
from kombu.exceptions import KombuError

from dipaco_server.celery import app as celery_app
from dipaco_server.rounds.lifecycle.close import ADAPT_EVERY_S, round_ready_to_close
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.lifecycle.tasks import start_closing
from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.signals import lease_completed, lease_granted
from dipaco_server.runs.models import Run
from dipaco_server.runs.phases import overlaps, round_config
from dipaco_server.runs.signals import round_due, run_ended

logger = logging.getLogger(__name__)


@receiver(round_due, dispatch_uid="dipaco_server.rounds.open_due_round")
def open_due_round(sender: Any, *, run: Run, t: int, **_: Any) -> Round:
    """Round `t` of `run`, opened (rounds.lifecycle.open.open_round: opening an open round returns it)."""
    return open_round(run, t)


@receiver(run_ended, dispatch_uid="dipaco_server.rounds.end_leases")
def end_leases(sender: Any, *, run: Run, now: datetime, **_: Any) -> None:
    """A run that ended (finished, failed, cancelled) holds no lease: each active one is
    released and its unit given up, so no heartbeat extends it and no grant hands it back
    (a cancelled run's lease was answered again by POST /worker/lease before).
    Not the workers' fault, so no lease counts as expired against them."""
    held = Lease.objects.filter(unit__round__run=run, state=Lease.State.ACTIVE)
    units = list(held.values_list("unit_id", flat=True))
    released = held.update(state=Lease.State.RELEASED, ended_at=now)
    WorkUnit.objects.filter(pk__in=units, state=WorkUnit.State.LEASED).update(
        state=WorkUnit.State.EXPIRED, updated_at=now
    )
    if released:
        logger.info("run %s ended: released its %d active lease(s)", run.pk, released)


@receiver(lease_completed, dispatch_uid="dipaco_server.rounds.check_completed_unit")
def check_completed_unit(
    sender: Any, *, round_: Round, lease: Lease | None = None, **_: Any
) -> None:
    """Send check_unit for the completed lease (rounds.verification.arrival), before
    close_if_ready may send the round's close: its Δs are fetched, decoded and checked while
    the round trains, and its outer steps aggregate them as checked. A task that cannot be
    sent leaves the checks to the steps (they check what has no record)."""
    if lease is None:
        return
    try:
        celery_app.send_task("dipaco_server.rounds.tasks.check_unit", args=[lease.pk])
    except (KombuError, OSError) as exc:
        logger.warning("lease %s: check_unit not sent (%s); its steps check it", lease.pk, exc)


@receiver(lease_completed, dispatch_uid="dipaco_server.rounds.score_completed_unit")
def score_completed_unit(
    sender: Any, *, round_: Round, lease: Lease | None = None, **_: Any
) -> None:
    """Send score_unit for the completed lease (rounds.verification.unit_score), before
    close_if_ready may send the round's close: the unit's proof of useful work runs while
    the round trains, and its outer steps find it recorded. A run that does not score, and
    a task that cannot be sent, leave it to the steps (they score what is not recorded)."""
    config = round_config(round_.run.run_config, round_.t)[1]
    if lease is None or not (config.outer.verify and config.outer.score):
        return
    try:
        celery_app.send_task("dipaco_server.rounds.tasks.score_unit", args=[lease.pk])
    except (KombuError, OSError) as exc:
        logger.warning("lease %s: score_unit not sent (%s); its steps score it", lease.pk, exc)


@receiver(lease_granted, dispatch_uid="dipaco_server.rounds.score_granted_unit")
def score_granted_unit(sender: Any, *, lease: Lease, **_: Any) -> None:
    """Send score_base for the granted lease (rounds.verification.unit_score.score_granted):
    the half of its unit's proof of useful work that does not depend on the Δ (the base
    losses on its scored windows) runs while the unit trains, so score_unit at its
    completion runs only the passes with the Δ applied. A run that does not score, and a
    task that cannot be sent, leave it to score_unit (it scores what has no base losses)."""
    round_ = lease.unit.round
    config = round_config(round_.run.run_config, round_.t)[1]
    if not (config.outer.verify and config.outer.score):
        return
    try:
        celery_app.send_task("dipaco_server.rounds.tasks.score_base", args=[lease.pk])
    except (KombuError, OSError) as exc:
        logger.warning("lease %s: score_base not sent (%s); its score does it all", lease.pk, exc)


@receiver(lease_completed, dispatch_uid="dipaco_server.rounds.close_if_ready")
def close_if_ready(sender: Any, *, round_: Round, **_: Any) -> None:
    """Send close_round when this completion made the round ready (rounds.lifecycle.tasks).

    With ``outer.overlap`` "delayed" or "eager" the round moves to closing here and round
    t + 1 opens (`start_closing`: two conditional updates and the new round's rows) before
    the completing worker has its answer, so its next POST /worker/lease finds t + 1 open:
    a Celery task would let that lease race the task. close_round (forced: the round is
    closing already) then sends the outer steps. Without overlap nothing closes here: the
    task does it all.
    """
    if not round_ready_to_close(round_, adapt_every_s=ADAPT_EVERY_S):
        return
    force = False
    if overlaps(round_.run.run_config, round_.t):
        if not start_closing(round_):
            return  # a concurrent completion closed it
        force = True
    try:
        celery_app.send_task(
            "dipaco_server.rounds.tasks.close_round",
            args=[round_.run_id, round_.t],
            kwargs={"force": True} if force else {},
        )
    except (KombuError, OSError) as exc:
        # The completion is recorded; beat's close_ready_rounds sends the task later.
        logger.warning(
            "run %s round %s is ready to close but close_round could not be sent (%s); "
            "beat's close_ready_rounds will send it",
            round_.run_id,
            round_.t,
            exc,
        )
