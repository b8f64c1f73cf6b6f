"""Run tasks: preparing datasets and runs, and evaluating paths (logic in prepare/evaluate).

Send `prepare_run` right after a run moves to ``preparing`` (the admin API's start);
it reports each stage in ``Run.progress`` and ends with the run ``ready``, or ``failed``
with the reason in ``Run.error``. A transient failure (database or object store
unreachable) is retried with backoff first. `evaluate` is what finish_round runs after
each round; send it yourself to re-score a round (it skips paths already scored).

Between the phases of a run with ``phase1`` (runs.between), finish_round sends
`prepare_phase2`, which writes the base model and fits the router on a sample, then runs
a chord of `route_chunk` tasks, one per document chunk not yet routed, then
`finish_phase2` (shards, modules, first DiPaCo round). If one fails for good,
``Run.error`` says so; sending prepare_phase2 again resumes (every step is idempotent).
"""

from __future__ import annotations

import json
import logging

from celery import Task, chord, shared_task

from dipaco_server.core.tasks import RETRY, TRANSIENT, same_queue
from dipaco_server.runs import prepare as preparation
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.runs.services import TERMINAL, transition
from dipaco_server.storage import get_blob_store

logger = logging.getLogger(__name__)

MAX_RETRIES = 4


def _retry_or_raise(task: Task, exc: Exception) -> None:
    """Retry a transient error with exponential backoff; anything else, or the last retry,
    falls through to the caller, which records the failure."""
    if isinstance(exc, TRANSIENT) and task.request.retries < MAX_RETRIES:
        raise task.retry(exc=exc, countdown=2 ** (task.request.retries + 1))


def _fail_run(run_id: int, error: str) -> None:
    run = Run.objects.get(pk=run_id)
    if run.state == Run.State.PREPARING:  # not if it was cancelled meanwhile
        transition(run, Run.State.FAILED, error=error)


@shared_task(bind=True, name="dipaco_server.runs.tasks.prepare_run")
def prepare_run(self: Task, run_id: int, max_files: int | None = None) -> str:
    """Plan (corpus scan, tokenizer, router), then a chord of `prepare_piece` tasks, one per
    piece (a file, or a range of a large one) not yet prepared, then `finish_preparation`
    (join, modules): the run ends ready, or failed with why. Sending it again resumes with
    the pieces left (runs.pieces)."""
    from dipaco_server.runs import pieces  # pyarrow and torch: not at the Celery app's start

    run = Run.objects.get(pk=run_id)
    try:
        planned = preparation.begin_run(run, max_files=max_files)
        if planned is not None:
            todo = pieces.pending(get_blob_store(), planned)
            if not todo:
                preparation.finish_run(run, planned["key"])
                return str(Run.objects.get(pk=run_id).state)
            options = same_queue(self)
            header = [prepare_piece.si(run_id, planned["key"], i).set(**options) for i in todo]
            done = finish_preparation.si(run_id, planned["key"]).set(**options)
            chord(header)(done.on_error(fail_preparation.si(run_id).set(**options)))
            logger.info("run %s: %d pieces to prepare", run_id, len(todo))
    except Exception as exc:
        _retry_or_raise(self, exc)
        logger.exception("run %s: preparation failed", run_id)
        _fail_run(run_id, f"preparation failed: {exc}")
        raise
    return str(Run.objects.get(pk=run_id).state)


@shared_task(
    bind=True,
    name="dipaco_server.runs.tasks.prepare_piece",
    acks_late=True,
    reject_on_worker_lost=True,
    **RETRY,
)
def prepare_piece(self: Task, run_id: int, key: str, piece: int) -> int:
    """One piece tokenised, routed and uploaded as its part of every shard (runs.pieces)."""
    from dipaco_server.runs import pieces  # as in prepare_run

    run = Run.objects.get(pk=run_id)
    if run.state in TERMINAL:
        return 0
    store = get_blob_store()
    planned = json.loads(store.get_bytes(f"{pieces.prefix(key)}/plan.json"))
    result = pieces.write_piece(store, planned, piece, preparation.work_root())
    pieces.record_pieces(run, store, planned)
    return int(result.get("chars", 0))


@shared_task(bind=True, name="dipaco_server.runs.tasks.finish_preparation", **RETRY)
def finish_preparation(self: Task, run_id: int, key: str) -> str:
    """After every piece: the shards joined, version 0 of every module; the run is ready."""
    run = Run.objects.get(pk=run_id)
    try:
        preparation.finish_run(run, key)
    except Exception as exc:
        _retry_or_raise(self, exc)
        _fail_run(run_id, f"preparation failed: {exc}")
        raise
    return str(Run.objects.get(pk=run_id).state)


@shared_task(name="dipaco_server.runs.tasks.fail_preparation")
def fail_preparation(run_id: int) -> None:
    """A piece failed for good: the run fails with where to look; the pieces done are kept,
    so preparing it again (a new run with the same inputs) resumes from them."""
    _fail_run(run_id, "preparation failed: a piece failed; see the Celery worker log")


@shared_task(bind=True, name="dipaco_server.runs.tasks.prepare_dataset")
def prepare_dataset(self: Task, dataset_id: int) -> dict[str, object]:
    """Read a dataset's corpus and record its statistics; it ends ready or failed."""
    dataset = Dataset.objects.get(pk=dataset_id)
    try:
        preparation.prepare_dataset(dataset)
    except Exception as exc:
        _retry_or_raise(self, exc)
        logger.exception("dataset %s: preparation failed", dataset_id)
        preparation.fail_dataset(dataset, f"preparation failed: {exc}")
        raise
    return dict(dataset.stats)


@shared_task(bind=True, name="dipaco_server.runs.tasks.evaluate")
def evaluate(self: Task, run_id: int, t: int) -> list[dict[str, object]]:
    """Held-out loss and perplexity of every active path after round t; early stopping."""
    # torch (seconds), here and in runs.between below: the Celery app and the URLs load
    # without it (tests/test_boundaries).
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


@shared_task(bind=True, name="dipaco_server.runs.tasks.prepare_phase2", **RETRY)
def prepare_phase2(self: Task, run_id: int) -> int:
    """After phase 1: the base model and the router, then one route_chunk per chunk not yet
    routed, then finish_phase2. Returns the number of chunks sent."""
    from dipaco_server.runs.between import begin, pending  # torch, as in evaluate above

    run = Run.objects.get(pk=run_id)
    if run.state in TERMINAL:
        return 0
    begin(run)
    todo = pending(run, get_blob_store())
    options = same_queue(self)
    done = finish_phase2.si(run_id).set(**options)
    if not todo:
        done.apply_async()
        return 0
    route = [route_chunk.si(run_id, i).set(**options) for i in todo]
    chord(route)(done.on_error(fail_phase2.si(run_id).set(**options)))
    logger.info("run %s: preparing phase 2, %d chunks to route", run_id, len(todo))
    return len(todo)


@shared_task(
    bind=True,
    name="dipaco_server.runs.tasks.route_chunk",
    acks_late=True,
    reject_on_worker_lost=True,
    **RETRY,
)
def route_chunk(self: Task, run_id: int, chunk: int) -> int:
    """One chunk of documents tokenised, routed and stored (runs.between.route_chunk)."""
    from dipaco_server.runs.between import route_chunk as route  # torch, as above

    run = Run.objects.get(pk=run_id)
    return 0 if run.state in TERMINAL else route(run, chunk)


@shared_task(bind=True, name="dipaco_server.runs.tasks.finish_phase2", **RETRY)
def finish_phase2(self: Task, run_id: int) -> str:
    """Router, shards and phase-2 modules from the features; opens phase 2's first round."""
    from dipaco_server.runs.between import finish  # torch, as in evaluate above

    return finish(Run.objects.get(pk=run_id))


@shared_task(name="dipaco_server.runs.tasks.fail_phase2")
def fail_phase2(run_id: int) -> None:
    """A step between the phases failed for good: the run keeps its state, the reason is in
    ``Run.error``, and sending prepare_phase2 again resumes (finished steps are kept)."""
    message = (
        "preparing phase 2 failed; see the Celery worker log, fix the cause, then send "
        f"prepare_phase2({run_id}) again"
    )
    logger.error("run %s: %s", run_id, message)
    Run.objects.filter(pk=run_id).exclude(state__in=TERMINAL).update(error=message)
