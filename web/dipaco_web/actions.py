"""What the staff buttons on a run page do, through the same services as the admin API.

prepare (or start on a draft): draft → preparing, and the preparation task is sent
(runs.tasks.prepare_run reads the data, fits the router, writes version 0 of every module,
then makes the run ready; a "base-lm" router without phase 1 or a checkpoint is refused
first, as by the API); start: ready → running with round 0 opened in the same transaction;
pause: running → paused; resume: paused → running; cancel: any live state → cancelled. A
move the run's state does not allow raises InvalidTransition, whose message says what is
allowed; a broker that does not answer raises ApiError (503) naming the command to resend.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import transaction

from dipaco_server.rounds.open import start_run
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import transition


def _prepare(run: Run) -> Run:
    if run.state != Run.State.DRAFT:
        return transition(run, Run.State.PREPARING)  # refused with the allowed moves named
    from dipaco_server.runs.api import _check_base_model, enqueue

    _check_base_model(run)
    with transaction.atomic():
        transition(run, Run.State.PREPARING)
        transaction.on_commit(lambda: enqueue("dipaco_server.runs.tasks.prepare_run", run.pk))
    return run


def _start(run: Run) -> Run:
    if run.state == Run.State.DRAFT:
        return _prepare(run)
    if run.state == Run.State.READY:
        start_run(run)
        return run
    return transition(run, Run.State.RUNNING)  # refused with the allowed moves named


ACTIONS: dict[str, Callable[[Run], Run]] = {
    "prepare": _prepare,
    "start": _start,
    "pause": lambda run: transition(run, Run.State.PAUSED),
    "resume": lambda run: transition(run, Run.State.RUNNING),
    "cancel": lambda run: transition(run, Run.State.CANCELLED),
}


def perform(run: Run, action: str) -> Run:
    """Apply ``action`` (a key of ACTIONS) to ``run``; KeyError for an unknown one."""
    return ACTIONS[action](run)
