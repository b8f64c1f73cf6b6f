"""Round tasks: closing a round, one outer step per module, and opening the next round.

    close_round(run, t)  ──chord──▶  outer_step(run, m, t) for every module m
                                     ──▶ finish_round(run, t): evaluate, open t + 1 or finish

Before that, each completion sends check_unit(lease): its Δs fetched, decoded and checked
as far as each alone allows (rounds.verification.arrival), and score_unit(lease): its
unit's proof of useful work (rounds.verification.unit_score), both while the round trains
and recorded for the steps, which then mostly aggregate.

With ``outer.overlap`` "delayed" (or "eager"), close_round opens round t + 1 as it moves round t to
closing (`start_closing`), and finish_round(run, t) sends close_round(run, t + 1), which
could not close before round t published (Round.previous_published).

Call `close_round` whenever a round may have become ready (after each completion, and
from beat through `close_ready_rounds`): it does nothing until every unit is in, or a
quorum is in and the deadline passed, and of concurrent calls only one closes the round.
A round already closing is left alone, unless `force`: then the chord is launched again,
which is safe since every outer step is idempotent (rounds.outer.step). Beat does that for a
round closing longer than DIPACO_ROUND_CLOSE_RETRY_S (its steps were lost with the broker),
and an operator does it to resume a round whose steps failed (`fail_round` leaves the
reason in ``Run.error``). Tasks started here go to the queue their parent came from.

Beat (settings.CELERY_BEAT_SCHEDULE), e.g. every 30 s:
``{"sweep-leases": {"task": "dipaco_server.rounds.tasks.sweep_leases", "schedule": 30.0},
"close-ready-rounds": {"task": "dipaco_server.rounds.tasks.close_ready_rounds", "schedule": 30.0}}``.

The tasks keep the names ``dipaco_server.rounds.tasks.*`` they had before this module moved
into the round's life: messages already queued, beat schedules and ``send_task`` callers
name them.
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta

from celery import Task, chord, shared_task
from celery.signals import worker_init
from django.utils import timezone

from dipaco_server.core.tasks import RETRY, same_queue
from dipaco_server.errors import ServiceError
from dipaco_server.rounds import stages
from dipaco_server.rounds.lifecycle import retention
from dipaco_server.rounds.lifecycle.close import (
    mark_round_closed,
    mark_round_closing,
    round_ready_to_close,
)
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.models import Lease, OuterStep, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.protocol.leases import expire_leases
from dipaco_server.runs.models import Module, Run
from dipaco_server.runs.models import Path as RunPath
from dipaco_server.runs.phases import DENSE, overlaps, round_phase
from dipaco_server.runs.services import TERMINAL, transition
from dipaco_server.workers import trust

logger = logging.getLogger(__name__)
PREPARING_PHASE2 = "preparing phase 2"


@worker_init.connect
def preload(**_: object) -> None:
    """Import torch, transformers and the outer step once in the worker's main process,
    before it forks its pool: every pool process (and each replacement of one that died)
    then starts warm instead of spending seconds on imports in its first task."""
    for module in (
        "dipaco.modular",
        "dipaco_server.rounds.outer.step",
        "dipaco_server.runs.evaluate",
    ):
        importlib.import_module(module)


@shared_task(name="dipaco_server.rounds.tasks.sweep_leases")
def sweep_leases() -> int:
    """Requeue the units of leases past their deadline or held by revoked workers."""
    return expire_leases()


@shared_task(name="dipaco_server.rounds.tasks.sweep_blobs")
def sweep_blobs() -> dict[str, int]:
    """Delete uploads and module versions past retention (rounds.lifecycle.retention)."""
    return retention.sweep_blobs().as_dict()


@shared_task(bind=True, name="dipaco_server.rounds.tasks.close_ready_rounds")
def close_ready_rounds(self: Task) -> list[tuple[int, int]]:
    """Send close_round for every open round that may close now: (run, t) of each."""
    ready = [
        (r.run_id, r.t)
        for r in Round.objects.filter(
            state=Round.State.OPEN, run__state__in=[Run.State.RUNNING, Run.State.PAUSED]
        )
        if round_ready_to_close(r)
    ]
    for run_id, t in ready:
        close_round.apply_async((run_id, t), **same_queue(self))
    resend_stalled_rounds(self)
    resend_stalled_phase2(self)
    return ready


def resend_stalled_phase2(task: Task) -> list[int]:
    """Send prepare_phase2 again for runs preparing phase 2 with no progress for longer than
    DIPACO_ROUND_CLOSE_RETRY_S: its chord was lost with the broker, or a task failed for good.

    Every step between the phases is idempotent (runs.between), so a resend redoes only what
    is missing; the conditional UPDATE of ``updated_at`` makes one sweep the sender.
    """
    cutoff = timezone.now() - timedelta(seconds=current_policy().round_close_retry_s)
    stalled = Run.objects.filter(
        phase=Run.Phase.PREPARING,
        state__in=[Run.State.RUNNING, Run.State.PAUSED],
        updated_at__lt=cutoff,
    )
    resent = []
    for run in stalled:
        if Run.objects.filter(pk=run.pk, updated_at=run.updated_at).update(
            updated_at=timezone.now()
        ):
            logger.warning("run %s: no progress preparing phase 2; sending it again", run.pk)
            task.app.send_task(
                "dipaco_server.runs.tasks.prepare_phase2", args=[run.pk], **same_queue(task)
            )
            resent.append(run.pk)
    return resent


def resend_stalled_rounds(task: Task) -> list[tuple[int, int]]:
    """Send close_round again for rounds closing longer than DIPACO_ROUND_CLOSE_RETRY_S
    during which none of their modules finished its step.

    The outer steps of a closing round live in the broker as a chord; if Redis loses them
    (restarted without persistence), nothing would ever finish the round. The steps are
    idempotent (an OuterStep row per module and round), so sending them again is safe; the
    conditional UPDATE of ``closing_at`` makes one sweep, of several, the sender. A round
    whose modules are still finishing steps is slow, not lost: at 10,000 units a round its
    five steps took 18 minutes here, and the resend at 15 minutes set a second worker on the
    step a first was still running (docs/benchmarks.md).
    """
    now = timezone.now()
    cutoff = now - timedelta(seconds=current_policy().round_close_retry_s)
    closing = Round.objects.filter(
        state=Round.State.CLOSING, run__state__in=[Run.State.RUNNING, Run.State.PAUSED]
    )
    closing.filter(closing_at__isnull=True).update(closing_at=now)  # start the clock
    resent = []
    for round_ in closing.filter(closing_at__lt=cutoff):
        if OuterStep.objects.filter(round=round_, created_at__gte=cutoff).exists():
            continue  # a module stepped lately: the others are running, not lost
        if Round.objects.filter(pk=round_.pk, closing_at=round_.closing_at).update(closing_at=now):
            logger.warning(
                "run %s round %d: still closing since %s; sending its outer steps again",
                round_.run_id, round_.t, round_.closing_at.isoformat(),
            )  # fmt: skip
            close_round.apply_async((round_.run_id, round_.t), {"force": True}, **same_queue(task))
            resent.append((round_.run_id, round_.t))
    return resent


@shared_task(bind=True, name="dipaco_server.rounds.tasks.close_round", **RETRY)
def close_round(self: Task, run_id: int, t: int, force: bool = False) -> str:
    """Close round t once it is ready (or now, with `force`) and step every module.

    A round already closing is left to the outer steps sent for it: completions that
    raced to make the round ready each send close_round, and only the one that moved it
    to closing sends the steps. ``force`` sends them again (the stalled-round sweep, or
    an operator after fail_round); steps already done are not redone.
    """
    round_ = Round.objects.select_related("run").filter(run_id=run_id, t=t).first()
    if round_ is None:
        return "missing"
    if round_.run.state in TERMINAL:
        return round_.run.state  # a cancelled or failed run gets no more outer steps
    if round_.state == Round.State.CLOSED:
        return "closed"
    if round_.state == Round.State.OPEN:
        if not round_.previous_published():
            # outer.overlap delayed, even forced: finish_round(t - 1) sends this again.
            return "waiting for round t - 1"
        if not force and not round_ready_to_close(round_):
            if round_.state != Round.State.OPEN:  # as refreshed: a concurrent call moved it on
                return "closing elsewhere"
            return "not ready"
        if not start_closing(round_):
            return "closing elsewhere"  # a concurrent call won and launched the chord
    elif not force:
        return "closing elsewhere"  # its steps are in the queue already
    phase = round_phase(round_.run.run_config, t)  # the modules of the round's phase
    modules = (
        Module.objects.filter(run_id=run_id, phase=phase)
        .order_by("pk")
        .values_list("module_id", flat=True)
    )
    options = same_queue(self)
    steps = [outer_step.si(run_id, module_id, t).set(**options) for module_id in modules]
    done = finish_round.si(run_id, t).set(**options)
    chord(steps)(done.on_error(fail_round.si(run_id, t).set(**options)))
    logger.info("run %s round %d closing: %d outer steps sent", run_id, t, len(steps))
    return "closing"


def start_closing(round_: Round) -> bool:
    """open → closing (`mark_round_closing`), and with ``outer.overlap`` (not "none") open round
    t + 1 at once from the versions published now, so that workers train it while round t's
    outer step runs (runs.phases.overlaps says when). True for the one caller that won."""
    if not mark_round_closing(round_):
        return False
    run = round_.run
    if overlaps(run.run_config, round_.t):
        try:
            open_round(run, round_.t + 1)
        except ServiceError as exc:  # finish_round's advance_run opens it, or says why not
            logger.warning("run %s: round %d not opened early: %s", run.pk, round_.t + 1, exc)
    return True


@shared_task(
    bind=True,
    name="dipaco_server.rounds.tasks.outer_step",
    acks_late=True,
    reject_on_worker_lost=True,  # a worker killed mid-step hands the step to another
    **RETRY,
)
def outer_step(self: Task, run_id: int, module_id: str, t: int) -> dict[str, object]:
    """Verify, aggregate and apply round t's contributions to one module, exactly once."""
    # torch (seconds): the Celery app and the URLs load without it (tests/test_boundaries);
    # worker_init's preload imports it before the pool forks.
    from dipaco_server.rounds.outer.step import step_module

    return step_module(run_id, module_id, t)


@shared_task(
    name="dipaco_server.rounds.tasks.check_unit", acks_late=True, reject_on_worker_lost=True
)
def check_unit(lease_id: int) -> str:
    """A completed unit's Δs fetched, decoded and checked as far as one Δ alone allows,
    recorded for its round's outer steps (rounds.verification.arrival). Not retried: a step
    whose Δ has no record checks it inline; a duplicate finds the records and does nothing."""
    from dipaco_server.rounds.verification.arrival import check_arrived  # torch, as above

    return check_arrived(lease_id)


@shared_task(
    name="dipaco_server.rounds.tasks.score_unit", acks_late=True, reject_on_worker_lost=True
)
def score_unit(lease_id: int) -> str:
    """A completed unit's proof of useful work, recorded for its round's outer steps
    (rounds.verification.unit_score). Not retried: a step whose unit has no recorded score
    scores it itself."""
    from dipaco_server.rounds.verification.unit_score import score_completed  # torch, as above

    return score_completed(lease_id)


@shared_task(
    name="dipaco_server.rounds.tasks.score_base", acks_late=True, reject_on_worker_lost=True
)
def score_base(lease_id: int) -> str:
    """A granted unit's base losses on its scored windows, computed while it trains and
    recorded for its score at completion (rounds.verification.unit_score.score_granted).
    Not retried: a score that finds none computes them itself."""
    from dipaco_server.rounds.verification.unit_score import score_granted  # torch, as above

    return score_granted(lease_id)


@shared_task(bind=True, name="dipaco_server.rounds.tasks.finish_round", **RETRY)
def finish_round(self: Task, run_id: int, t: int) -> str:
    """After every module stepped: close the round, evaluate the paths, then go on.

    Workers wait for the next round while this runs, so the next round opens first and
    the evaluation runs while they train. With ``eval.patience`` set (early stopping),
    round t + 1 opens with the paths round t - 1's evaluation left active, and a path that
    round t's evaluation stops gives up its units of round t + 1 not yet leased
    (`stop_paths`): early stopping acts one round later than it could, and a held
    evaluation never delays the next round (at 150M it is minutes of CPU). After the
    last round, and at phase 1's end, the evaluation comes first, so a finished run (or
    phase) has its final scores.
    """
    from dipaco_server.runs.evaluate import eval_settings  # torch, as in outer_step above

    round_ = Round.objects.select_related("run").get(run_id=run_id, t=t)
    mark_round_closed(round_)
    Run.objects.filter(pk=run_id).exclude(state__in=TERMINAL).update(error="")
    run = round_.run
    config = run.run_config
    if overlaps(config, t):
        # Round t + 1, open since round t began closing, may have become ready meanwhile;
        # it could not close before round t's versions were published (previous_published).
        close_round.apply_async((run_id, t + 1), **same_queue(self))
    boundary = config.phase1 is not None and t + 1 == config.phase1.rounds
    if t + 1 < config.total_rounds and not boundary:
        outcome = advance_run(run, t)
        _evaluate(run, t)
        if eval_settings(config).patience is not None and outcome == "opened":
            outcome = stop_paths(run, t + 1) or outcome
        if outcome == PREPARING_PHASE2:
            self.app.send_task(
                "dipaco_server.runs.tasks.prepare_phase2", args=[run_id], **same_queue(self)
            )
        return outcome
    _evaluate(run, t)
    outcome = advance_run(run, t)
    if outcome == PREPARING_PHASE2:
        self.app.send_task(
            "dipaco_server.runs.tasks.prepare_phase2", args=[run_id], **same_queue(self)
        )
    return outcome


def _evaluate(run: Run, t: int) -> None:
    try:
        from dipaco_server.runs.evaluate import evaluate_run  # torch, as in outer_step

        stages.reset()
        with stages.timed("evaluation"):
            evaluate_run(run, t)
        stages.flush(Round.objects.get(run=run, t=t).pk)
    except Exception:  # evaluation is for curves and early stopping; training goes on
        logger.exception("run %s: evaluation after round %d failed; training goes on", run.pk, t)


def stop_paths(run: Run, t: int) -> str | None:
    """Expire the queued units of round t (open) whose path an evaluation stopped since it
    opened; those already leased train on and count. When no path is left active and no
    unit of round t is leased or done, nothing would close round t: it is closed here and
    the run goes on as after its last round (`advance_run`'s outcome is returned)."""
    round_ = Round.objects.filter(run=run, t=t, state=Round.State.OPEN).first()
    if round_ is None:
        return None
    expired = (
        round_.units.filter(state=WorkUnit.State.QUEUED)
        .exclude(path__state=RunPath.State.ACTIVE)
        .update(state=WorkUnit.State.EXPIRED)
    )
    if expired:
        logger.info("run %s round %d: %d units of stopped paths expired", run.pk, t, expired)
    working = round_.units.filter(state__in=[WorkUnit.State.LEASED, WorkUnit.State.DONE])
    if run.paths.filter(state=RunPath.State.ACTIVE).exists() or working.exists():
        return None
    if not Round.objects.filter(pk=round_.pk, state=Round.State.OPEN).update(
        state=Round.State.CLOSED, closed_at=timezone.now()
    ):
        return None  # closed concurrently
    return advance_run(run, t)


@shared_task(name="dipaco_server.rounds.tasks.fail_round")
def fail_round(run_id: int, t: int) -> None:
    """A module's outer step failed for good (a bug, or the store down through every retry;
    bad contributions are rejected, not failures). The round stays closing and the run keeps
    its state, with the reason in ``Run.error``: close_round with force resumes the round,
    and the steps already done are not redone."""
    message = (
        f"the outer step of round {t} failed; see the Celery worker log, fix the cause, "
        f"then send close_round({run_id}, {t}, force=True) again"
    )
    logger.error("run %s: %s", run_id, message)
    Run.objects.filter(pk=run_id).exclude(state__in=TERMINAL).update(error=message)


def advance_run(run: Run, t: int) -> str:
    """Open round t + 1, or finish the run after its last round or when every path stopped.

    After phase 1's last round (or when its dense path stopped early) the run enters
    "preparing phase 2" instead, and the caller sends runs.tasks.prepare_phase2
    (`PREPARING_PHASE2` is returned to the one caller that moved it there).
    """
    run.refresh_from_db()
    if run.state in TERMINAL:
        return run.state
    config = run.run_config
    phase = round_phase(config, t)
    active = run.paths.filter(phase=phase, state=RunPath.State.ACTIVE)
    if phase == DENSE and (round_phase(config, t + 1) != DENSE or not active.exists()):
        active.update(state=RunPath.State.FINISHED)
        from dipaco_server.runs.between import enter_preparing  # torch, as in outer_step

        return PREPARING_PHASE2 if enter_preparing(run) else "preparing elsewhere"
    if t + 1 < config.total_rounds and active.exists():
        try:
            open_round(run, t + 1)
        except ServiceError as exc:
            logger.warning("run %s: round %d not opened: %s", run.pk, t + 1, exc.message)
            return "stalled"
        return "opened"
    run.paths.filter(state=RunPath.State.ACTIVE).update(state=RunPath.State.FINISHED)
    # credit held pending an audit that no later round of this run can bring (workers.trust),
    # granted before the run reads as finished
    worked = Lease.objects.filter(unit__round__run=run).values_list("worker_id", flat=True)
    trust.release_held(worked.distinct())
    try:
        transition(run, Run.State.FINISHED)
    except ServiceError as exc:  # finished (or cancelled) concurrently
        logger.info("run %s: not finished here: %s", run.pk, exc.message)
    return "finished"
