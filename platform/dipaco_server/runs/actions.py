"""A run's life-cycle actions: one service behind the admin API and the dashboard's buttons.

prepare (or start on a draft): draft → preparing, and the preparation task is sent
(runs.tasks.prepare_run reads the data, fits the router, writes version 0 of every module,
then makes the run ready; a "base-lm" router without phase 1 or a checkpoint is refused
first); start: ready → running with its first round opened in the same transaction;
pause: running → paused; resume: paused → running; cancel: any live state → cancelled.
A move the run's state does not allow raises InvalidTransition, whose message names the
allowed ones; a broker that does not answer raises ApiError (503) naming the command to
send the task by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction
from kombu.exceptions import KombuError

from dipaco_server.celery import app as celery_app
from dipaco_server.errors import ApiError
from dipaco_server.runs import keys
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import transition
from dipaco_server.runs.signals import open_round
from dipaco_server.storage import get_blob_store

__all__ = ["ACTIONS", "cancel", "check_base_model", "enqueue", "pause", "perform", "prepare",
           "resume", "start"]  # fmt: skip

logger = logging.getLogger(__name__)


def enqueue(task: str, *args: Any) -> None:
    """Send a Celery task; a broker that does not answer is 503 with the command to resend."""
    try:
        celery_app.send_task(task, args=list(args))
    except (KombuError, OSError) as exc:
        resend = f"celery -A dipaco_server call {task} --args='{list(args)}'"
        logger.error("could not send %s%s: %s", task, list(args), exc)
        raise ApiError(
            503,
            "broker_unavailable",
            f"the task queue does not answer ({exc}); start the broker and a Celery worker, "
            f"then send the task yourself: {resend}",
        ) from None


def check_base_model(run: Run) -> None:
    """A "base-lm" router without phase 1 reads an uploaded checkpoint: refuse to start
    without one, before preparation spends minutes on the corpus."""
    config = run.run_config
    if config.phase1 is not None or config.router.featurizer != "base-lm":
        return
    if config.num_paths > 1 and not get_blob_store().exists(keys.base_model_key(run.pk)):
        raise ApiError(
            409,
            "base_model_missing",
            f"router.featurizer = 'base-lm' routes run {run.name!r} with a dense base model, and "
            f"it has none: upload one (POST /api/v1/runs/{run.pk}/checkpoint), or create the "
            "run with phase1 to train one, or with router.featurizer 'tfidf'",
            field="router.featurizer",
        )


def prepare(run: Run) -> Run:
    """draft → preparing, and the preparation task sent once the move is committed."""
    if run.state != Run.State.DRAFT:
        return transition(run, Run.State.PREPARING)  # refused with the allowed moves named
    check_base_model(run)
    # The conditional transition lets one of concurrent starts win, and only it sends the
    # preparation task (runs.tasks.prepare_run moves the run on to ready).
    with transaction.atomic():
        transition(run, Run.State.PREPARING)
        transaction.on_commit(lambda: enqueue("dipaco_server.runs.tasks.prepare_run", run.pk))
    return run


def start(run: Run) -> Run:
    """draft: prepare it; otherwise running, with its current round open (opening an open
    round returns it; a move the state does not allow is refused with the allowed ones)."""
    if run.state == Run.State.DRAFT:
        return prepare(run)
    # One transaction: if the first round cannot open (no module versions, no data), the
    # run stays ready and the error says what is missing.
    try:
        with transaction.atomic():
            transition(run, Run.State.RUNNING)
            open_round(run, run.current_round)
    except Exception:
        run.refresh_from_db()  # transition() updated the object; the database rolled back
        raise
    run.refresh_from_db()
    return run


def pause(run: Run) -> Run:
    """running → paused: no new leases; units already leased may still complete."""
    return transition(run, Run.State.PAUSED)


def resume(run: Run) -> Run:
    """paused → running."""
    return transition(run, Run.State.RUNNING)


def cancel(run: Run) -> Run:
    """Any live state → cancelled (final): workers are told to drop its units."""
    return transition(run, Run.State.CANCELLED)


ACTIONS: dict[str, Callable[[Run], Run]] = {
    "prepare": prepare,
    "start": start,
    "pause": pause,
    "resume": resume,
    "cancel": cancel,
}


def perform(run: Run, action: str) -> Run:
    """Apply ``action`` (a key of ACTIONS) to ``run``; KeyError for an unknown one."""
    return ACTIONS[action](run)
