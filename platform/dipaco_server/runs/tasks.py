"""Run tasks: preparing datasets and runs, and evaluating paths (logic in prepare/evaluate).

Send `prepare_run` right after a run moves to ``preparing`` (the admin API's start);
it reports each stage in ``Run.progress`` and ends with the run ``ready``, or ``failed``
with the reason in ``Run.error``. A transient failure (database or object store
unreachable) is retried with backoff first. `evaluate` is what finish_round runs after
each round; send it yourself to re-score a round (it skips paths already scored).
"""

from __future__ import annotations

import logging

from celery import Task, shared_task

from dipaco_server.rounds.tasks import TRANSIENT
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.runs.services import transition

logger = logging.getLogger(__name__)

MAX_RETRIES = 4


def _retry_or_raise(task: Task, exc: Exception) -> None:
    """Retry a transient error with exponential backoff; anything else, or the last retry,
    falls through to the caller, which records the failure."""
    if isinstance(exc, TRANSIENT) and task.request.retries < MAX_RETRIES:
        raise task.retry(exc=exc, countdown=2 ** (task.request.retries + 1))


@shared_task(bind=True, name="dipaco_server.runs.tasks.prepare_run")
def prepare_run(self: Task, run_id: int, max_files: int | None = None) -> str:
    """Tokenise, route, shard, initialise modules; the run ends ready (or failed, with why)."""
    from dipaco_server.runs.prepare import prepare_run as prepare

    run = Run.objects.get(pk=run_id)
    try:
        prepare(run, max_files=max_files)
    except Exception as exc:
        _retry_or_raise(self, exc)
        logger.exception("run %s: preparation failed", run_id)
        run.refresh_from_db()
        if run.state == Run.State.PREPARING:  # not if it was cancelled meanwhile
            transition(run, Run.State.FAILED, error=f"preparation failed: {exc}")
        raise
    return str(run.state)


@shared_task(bind=True, name="dipaco_server.runs.tasks.prepare_dataset")
def prepare_dataset(self: Task, dataset_id: int) -> dict[str, object]:
    """Read a dataset's corpus and record its statistics; it ends ready or failed."""
    from dipaco_server.runs.prepare import fail_dataset
    from dipaco_server.runs.prepare import prepare_dataset as prepare

    dataset = Dataset.objects.get(pk=dataset_id)
    try:
        prepare(dataset)
    except Exception as exc:
        _retry_or_raise(self, exc)
        logger.exception("dataset %s: preparation failed", dataset_id)
        fail_dataset(dataset, f"preparation failed: {exc}")
        raise
    return dict(dataset.stats)


@shared_task(bind=True, name="dipaco_server.runs.tasks.evaluate")
def evaluate(self: Task, run_id: int, t: int) -> list[dict[str, object]]:
    """Held-out loss and perplexity of every active path after round t; early stopping."""
    from dipaco_server.runs.evaluate import evaluate_run

    run = Run.objects.get(pk=run_id)
    try:
        results = evaluate_run(run, t)
    except Exception as exc:
        _retry_or_raise(self, exc)
        raise
    return [
        {"path": r.path, "loss": r.loss, "perplexity": r.perplexity, "finished": r.finished}
        for r in results
    ]
