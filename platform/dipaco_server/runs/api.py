"""Admin API for datasets, runs (create, status, start/pause/resume/cancel) and their metrics.

Staff-only (accounts.auth.StaffToken). Views are thin: the config is validated by
the library schema (runs.services.validate_config) and every state change goes
through runs.services.transition, which answers an illegal move with 409 and the
allowed moves.
"""

import logging
import re
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Count, F, QuerySet
from django.http import HttpRequest
from kombu.exceptions import KombuError
from ninja import Field, Query, Router, Schema, Status
from ninja.pagination import LimitOffsetPagination, paginate

from dipaco_server.accounts.auth import staff_auth
from dipaco_server.audit.services import audited
from dipaco_server.celery import app as celery_app
from dipaco_server.errors import ApiError
from dipaco_server.rounds.models import Lease
from dipaco_server.rounds.services import open_round
from dipaco_server.runs import services
from dipaco_server.runs.errors import ConfigInvalid, RunNotFound
from dipaco_server.runs.models import Dataset, MetricPoint, ModuleVersion, Run

logger = logging.getLogger(__name__)
router = Router(tags=["admin: runs"], auth=staff_auth)
MAX_PAGE = 500
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


# --- schemas -------------------------------------------------------------------------------


class DatasetIn(Schema):
    name: str = Field(description="Unique name: letters, digits, '.', '_' or '-'.")
    source: str = Field(description='"stdlib", or an absolute path to a text directory or .jsonl.')


class DatasetOut(Schema):
    id: int
    name: str
    source: str
    state: str
    stats: dict[str, Any]
    tokenizer_key: str
    router_key: str
    error: str
    progress: dict[str, Any] = Field(description="What preparation is doing now.")
    created_at: datetime
    updated_at: datetime


class RunIn(Schema):
    name: str = Field(description="Unique run name (also the config's name).")
    config: dict[str, Any] = Field(
        default_factory=dict, description="A dipaco.config.RunConfig as JSON; defaults fill gaps."
    )
    dataset_id: int | None = None


class RunOut(Schema):
    id: int
    name: str
    state: str
    current_round: int
    dataset_id: int | None
    error: str
    progress: dict[str, Any] = Field(description="What preparation is doing now.")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    allowed_moves: list[str] = Field(description="States this run may move to next.")

    @staticmethod
    def resolve_allowed_moves(obj: Run | dict[str, Any]) -> list[str]:
        state = obj.state if isinstance(obj, Run) else obj["state"]
        return list(services.allowed_moves(state))


class ModuleOut(Schema):
    module_id: str
    level: int | None
    index: int
    current_version: int | None
    blob_key: str | None = Field(description="The current version's blob (fp32 safetensors).")
    sha256: str | None
    size: int | None


class PathOut(Schema):
    index: int
    choices: list[int]
    modules: list[str]
    state: str
    train_tokens: int
    val_tokens: int
    best_val_loss: float | None
    best_round: int | None
    routing_share: float | None


class RoundOut(Schema):
    t: int
    state: str
    opened_at: datetime
    deadline: datetime | None
    closed_at: datetime | None
    units: dict[str, int] = Field(description="Work units of the round by state.")


class WorkerCounts(Schema):
    active: int = Field(description="Workers holding a live lease of this run now.")
    contributed: int = Field(description="Workers that completed at least one unit of this run.")


class RunStatusOut(RunOut):
    config: dict[str, Any]
    blob_prefix: str
    round: RoundOut | None = Field(description="The current round, once one was opened.")
    paths: list[PathOut]
    modules: list[ModuleOut]
    workers: WorkerCounts


class RunFilter(Schema):
    state: Run.State | None = Field(None, description="Only runs in this state.")


class MetricFilter(Schema):
    name: str | None = Field(None, max_length=64, description="Only this series, e.g. loss.")
    path: int | None = Field(None, ge=0, description="Only this path index.")
    round: int | None = Field(None, ge=0, description="Only this outer round.")


class MetricOut(Schema):
    name: str
    value: float
    round: int | None
    path: int | None = Field(description="The path's index, for per-path series.")
    created_at: datetime

    @staticmethod
    def resolve_path(obj: MetricPoint) -> int | None:
        return getattr(obj, "path_index", None)


# --- datasets ------------------------------------------------------------------------------


@router.post("/datasets", response={201: DatasetOut})
@audited("dataset.create", "dataset")
def create_dataset(request: HttpRequest, body: DatasetIn) -> Status[Dataset]:
    """Record a corpus to prepare: the built-in "stdlib" one, a directory or a .jsonl file."""
    if not _NAME.match(body.name):
        raise ApiError(
            422, "dataset_invalid", "name must be 1-100 letters, digits, '.', '_' or '-'"
        )
    source = body.source.strip()
    if source != "stdlib" and not (source.startswith("/") and len(source) <= 1000):
        raise ApiError(
            422,
            "dataset_invalid",
            f'source {source!r}: use "stdlib" or an absolute path on the server',
        )
    try:
        with transaction.atomic():
            dataset = Dataset.objects.create(name=body.name, source=source)
    except IntegrityError:
        raise ApiError(
            409, "dataset_name_taken", f"a dataset named {body.name!r} exists; choose another"
        ) from None
    transaction.on_commit(lambda: enqueue("dipaco_server.runs.tasks.prepare_dataset", dataset.pk))
    return Status(201, dataset)


@router.get("/datasets", response=list[DatasetOut])
@paginate(LimitOffsetPagination, max_limit=MAX_PAGE)
def list_datasets(request: HttpRequest) -> QuerySet[Dataset]:
    return Dataset.objects.order_by("-created_at", "-pk")


@router.get("/datasets/{dataset_id}", response=DatasetOut)
def get_dataset(request: HttpRequest, dataset_id: int) -> Dataset:
    dataset = Dataset.objects.filter(pk=dataset_id).first()
    if dataset is None:
        raise ApiError(404, "dataset_not_found", f"no dataset with id {dataset_id}")
    return dataset


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


# --- runs ----------------------------------------------------------------------------------


def _run(run_id: int) -> Run:
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise RunNotFound(f"no run with id {run_id}; list them at GET /api/v1/runs")
    return run


def _run_out(run: Run) -> dict[str, Any]:
    return {f: getattr(run, f) for f in RunOut.model_fields if f != "allowed_moves"}


@router.post("/runs", response={201: RunOut})
@audited("run.create", "run")
def create_run(request: HttpRequest, body: RunIn) -> Status[Run]:
    """Create a draft run from a config; a bad config is 400 with one problem per field."""
    dataset = None
    if body.dataset_id is not None:
        dataset = Dataset.objects.filter(pk=body.dataset_id).first()
        if dataset is None:
            raise ApiError(404, "dataset_not_found", f"no dataset with id {body.dataset_id}")
    try:
        run = services.create_run(body.name, body.config, dataset=dataset)
    except ConfigInvalid as exc:
        # A config that breaks the schema is a bad request (details.problems names each field).
        raise ApiError(400, exc.code, exc.message, **exc.details) from None
    return Status(201, run)


@router.get("/runs", response=list[RunOut])
@paginate(LimitOffsetPagination, max_limit=MAX_PAGE)
def list_runs(request: HttpRequest, filters: Query[RunFilter]) -> QuerySet[Run]:
    """Runs, newest first; `state` keeps only runs in that state."""
    runs = Run.objects.order_by("-created_at", "-pk")
    return runs if filters.state is None else runs.filter(state=filters.state)


@router.get("/runs/{run_id}", response=RunStatusOut)
def get_run(request: HttpRequest, run_id: int) -> dict[str, Any]:
    """A run with its config, current round, paths, modules (current versions) and workers."""
    run = _run(run_id)
    out = _run_out(run)
    out.update(config=run.config, blob_prefix=f"runs/{run.pk}")
    round_ = run.rounds.filter(t=run.current_round).first()
    out["round"] = None
    if round_ is not None:
        units = dict(round_.units.values_list("state").annotate(n=Count("pk")).order_by())
        out["round"] = {
            "t": round_.t,
            "state": round_.state,
            "opened_at": round_.opened_at,
            "deadline": round_.deadline,
            "closed_at": round_.closed_at,
            "units": units,
        }
    out["paths"] = list(run.paths.order_by("index"))
    current = {
        v.module_id: v
        for v in ModuleVersion.objects.filter(module__run=run, version=F("module__current_version"))
    }
    out["modules"] = [
        {
            "module_id": m.module_id,
            "level": m.level,
            "index": m.index,
            "current_version": m.current_version,
            "blob_key": getattr(current.get(m.pk), "blob_key", None),
            "sha256": getattr(current.get(m.pk), "sha256", None),
            "size": getattr(current.get(m.pk), "size", None),
        }
        for m in run.modules.order_by("pk")
    ]
    leases = Lease.objects.filter(unit__round__run=run)
    out["workers"] = {
        "active": leases.filter(state=Lease.State.ACTIVE).values("worker").distinct().count(),
        "contributed": leases.filter(state=Lease.State.COMPLETED)
        .values("worker")
        .distinct()
        .count(),
    }
    return out


@router.post("/runs/{run_id}/start", response=RunOut)
@audited("run.start", "run")
def start_run(request: HttpRequest, run_id: int) -> Run:
    """draft → preparing (a task prepares data and modules, then the run is ready), or
    ready → running with its first round open."""
    run = _run(run_id)
    if run.state == Run.State.DRAFT:
        # The conditional transition lets one of concurrent starts win, and only it sends
        # the preparation task (runs.tasks.prepare_run moves the run on to ready).
        services.transition(run, Run.State.PREPARING)
        transaction.on_commit(lambda: enqueue("dipaco_server.runs.tasks.prepare_run", run.pk))
        return run
    # One transaction: if the first round cannot open (no module versions, no data),
    # the run stays ready and the error says what is missing.
    with transaction.atomic():
        services.transition(run, Run.State.RUNNING)
        open_round(run, run.current_round)
    run.refresh_from_db()
    return run


@router.post("/runs/{run_id}/pause", response=RunOut)
@audited("run.pause", "run")
def pause_run(request: HttpRequest, run_id: int) -> Run:
    """running → paused: no new leases; units already leased may still complete."""
    return services.transition(_run(run_id), Run.State.PAUSED)


@router.post("/runs/{run_id}/resume", response=RunOut)
@audited("run.resume", "run")
def resume_run(request: HttpRequest, run_id: int) -> Run:
    """paused → running."""
    return services.transition(_run(run_id), Run.State.RUNNING)


@router.post("/runs/{run_id}/cancel", response=RunOut)
@audited("run.cancel", "run")
def cancel_run(request: HttpRequest, run_id: int) -> Run:
    """Any live state → cancelled (final): workers are told to drop its units."""
    return services.transition(_run(run_id), Run.State.CANCELLED)


@router.get("/runs/{run_id}/metrics", response=list[MetricOut])
@paginate(LimitOffsetPagination, max_limit=MAX_PAGE)
def run_metrics(
    request: HttpRequest, run_id: int, filters: Query[MetricFilter]
) -> QuerySet[MetricPoint]:
    """A run's metric points, oldest first, filtered by series name, path and round."""
    points = MetricPoint.objects.filter(run=_run(run_id))
    if filters.name is not None:
        points = points.filter(name=filters.name)
    if filters.path is not None:
        points = points.filter(path__index=filters.path)
    if filters.round is not None:
        points = points.filter(round=filters.round)
    return points.annotate(path_index=F("path__index")).order_by("created_at", "pk")
