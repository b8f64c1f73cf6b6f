"""Admin API for datasets, runs (create, status, start/pause/resume/cancel) and their metrics.

Staff-only (accounts.auth.StaffToken). Views are thin: the config is validated by
the library schema (runs.services.validate_config) and every state change goes
through runs.services.transition, which answers an illegal move with 409 and the
allowed moves.
"""

import logging
import re
import shutil
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from django.db import IntegrityError, transaction
from django.db.models import F, QuerySet
from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status, UploadedFile
from ninja import File as NinjaFile
from ninja.pagination import paginate
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from dipaco.config import RunConfig
from dipaco_server.accounts.auth import staff_auth
from dipaco_server.audit.services import audited
from dipaco_server.bounds import MAX_INT, DatasetId, JsonId, Paging, RunId
from dipaco_server.errors import ApiError, ServiceError
from dipaco_server.patterns import WHITESPACE, declared
from dipaco_server.runs import actions, keys, services
from dipaco_server.runs.errors import RunNotFound
from dipaco_server.runs.models import Dataset, MetricPoint, Run
from dipaco_server.runs.prepare import work_root
from dipaco_server.runs.sources import BUILTIN_SOURCES, MAX_SOURCE_LENGTH, check_source
from dipaco_server.storage import get_blob_store

logger = logging.getLogger(__name__)
router = Router(tags=["admin: runs"], auth=staff_auth)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


# --- schemas -------------------------------------------------------------------------------

# What runs.sources.check_source reads, once stripped: a built-in corpus, or an absolute path
# without NUL. Whether the path lies under DIPACO_DATA_ROOTS is the server's configuration,
# which no schema can say (a 422 naming the setting).
SOURCE_PATTERN = (
    f"^[{WHITESPACE}]*(?:{'|'.join(BUILTIN_SOURCES)}|/[^\\x00]*|s3://[^\\x00]*)[{WHITESPACE}]*$"
)


class RunConfigJson:
    """A run config as the API reads it: any JSON object, which runs.services.validate_config
    checks whole (400 config_invalid with every problem, not the first a parser meets); the
    schema shows dipaco.config.RunConfig itself, closed and bounded, so clients see the
    fields, their limits and that unknown keys are refused."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.dict_schema(core_schema.str_schema(), core_schema.any_schema())

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(RunConfig.__pydantic_core_schema__)


class DatasetIn(Schema):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="Unique name: 1-100 letters, digits, '.', '_' or '-'.",
    )
    source: str = Field(
        max_length=MAX_SOURCE_LENGTH,
        json_schema_extra=declared(SOURCE_PATTERN),
        description='"stdlib"; an absolute path (a file, a directory or a glob of text, JSON '
        "Lines (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or a saved datasets directory) under "
        "one of the server's data roots (DIPACO_DATA_ROOTS); or s3://bucket/prefix in a "
        "bucket of DIPACO_SOURCE_BUCKETS.",
    )
    text_field: str = Field(
        default="text",
        pattern=r"^[^\x00]{1,100}$",
        description="The column (Parquet, Arrow) or field (JSON Lines) holding the text.",
    )
    token_budget: int | None = Field(
        default=None,
        ge=1000,
        le=10**15,
        description="Prepare about this many training tokens: a seeded subset of records.",
    )


class DatasetOut(Schema):
    id: int
    name: str
    source: str
    text_field: str
    token_budget: int | None
    state: str
    stats: dict[str, Any]
    tokenizer_key: str
    router_key: str
    error: str
    progress: dict[str, Any] = Field(description="What preparation is doing now.")
    created_at: datetime
    updated_at: datetime


class RunIn(Schema):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Unique run name (also the config's name): 1-64 letters, digits, '.', "
        "'_' or '-'.",
    )
    config: Annotated[dict[str, Any], RunConfigJson] = Field(
        default_factory=dict,
        description="A dipaco.config.RunConfig as JSON; defaults fill gaps, unknown keys are "
        "refused. Its name, when given, is the run's.",
    )
    dataset_id: JsonId | None = None


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
    phase: str = Field(
        description='"1": the dense DiLoCo phase; "preparing": routing and module '
        'initialisation from its model; "2": DiPaCo rounds (a run without phase1 starts here).'
    )
    phase1_rounds: int = Field(description="Rounds of the dense phase (0: no phase 1).")
    phase1_rounds_done: int = Field(description="Rounds of the dense phase closed so far.")

    @staticmethod
    def resolve_allowed_moves(obj: Run | dict[str, Any]) -> list[str]:
        state = obj.state if isinstance(obj, Run) else obj["state"]
        return list(services.allowed_moves(state))

    @staticmethod
    def resolve_phase1_rounds(obj: Run | dict[str, Any]) -> int:
        phase1 = _run_of(obj).run_config.phase1
        return 0 if phase1 is None else phase1.rounds

    @staticmethod
    def resolve_phase1_rounds_done(obj: Run | dict[str, Any]) -> int:
        run = _run_of(obj)
        total = RunOut.resolve_phase1_rounds(run)
        # Rounds open one at a time, in order: in phase 1 the current round is the first open.
        return min(run.current_round, total) if run.phase == Run.Phase.DENSE else total


def _run_of(obj: Run | dict[str, Any]) -> Run:
    return obj if isinstance(obj, Run) else obj["run"]


class RunFilter(Schema):
    state: Run.State | None = Field(None, description="Only runs in this state.")


class MetricFilter(Schema):
    name: str | None = Field(None, max_length=64, description="Only this series, e.g. loss.")
    path: int | None = Field(None, ge=0, le=MAX_INT, description="Only this path index.")
    round: int | None = Field(None, ge=0, le=MAX_INT, description="Only this outer round.")


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
    source = check_source(body.source)
    try:
        with transaction.atomic():
            dataset = Dataset.objects.create(
                name=body.name,
                source=source,
                text_field=body.text_field,
                token_budget=body.token_budget,
            )
    except IntegrityError:
        raise ApiError(
            409, "dataset_name_taken", f"a dataset named {body.name!r} exists; choose another"
        ) from None
    transaction.on_commit(
        lambda: actions.enqueue("dipaco_server.runs.tasks.prepare_dataset", dataset.pk)
    )
    return Status(201, dataset)


@router.get("/datasets", response=list[DatasetOut])
@paginate(Paging)
def list_datasets(request: HttpRequest) -> QuerySet[Dataset]:
    return Dataset.objects.order_by("-created_at", "-pk")


@router.get("/datasets/{dataset_id}", response=DatasetOut)
def get_dataset(request: HttpRequest, dataset_id: DatasetId) -> Dataset:
    dataset = Dataset.objects.filter(pk=dataset_id).first()
    if dataset is None:
        raise ApiError(404, "dataset_not_found", f"no dataset with id {dataset_id}")
    return dataset


# --- runs ----------------------------------------------------------------------------------


def find_run(run_id: int) -> Run:
    """The run of id `run_id`; 404 run_not_found when there is none."""
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise RunNotFound(f"no run with id {run_id}; list them at GET /api/v1/runs")
    return run


_RESOLVED = ("allowed_moves", "phase1_rounds", "phase1_rounds_done")


def run_out(run: Run) -> dict[str, Any]:
    """RunOut's fields of `run`, to answer with more fields (its resolvers read "run")."""
    out = {f: getattr(run, f) for f in RunOut.model_fields if f not in _RESOLVED}
    return {**out, "run": run}


@router.post("/runs", response={201: RunOut})
@audited("run.create", "run")
def create_run(request: HttpRequest, body: RunIn) -> Status[Run]:
    """Create a draft run from a config; a bad config is 422 config_invalid with one problem
    per field (details.problems: field, value, rule)."""
    dataset = None
    if body.dataset_id is not None:
        dataset = Dataset.objects.filter(pk=body.dataset_id).first()
        if dataset is None:
            raise ApiError(404, "dataset_not_found", f"no dataset with id {body.dataset_id}")
    run = services.create_run(body.name, body.config, dataset=dataset)
    return Status(201, run)


@router.get("/runs", response=list[RunOut])
@paginate(Paging)
def list_runs(request: HttpRequest, filters: Query[RunFilter]) -> QuerySet[Run]:
    """Runs, newest first; `state` keeps only runs in that state."""
    runs = Run.objects.order_by("-created_at", "-pk")
    return runs if filters.state is None else runs.filter(state=filters.state)


@router.post("/runs/{run_id}/start", response=RunOut)
@audited("run.start", "run")
def start_run(request: HttpRequest, run_id: RunId) -> Run:
    """draft → preparing (a task prepares data and modules, then the run is ready), or
    ready → running with its first round open."""
    return actions.start(find_run(run_id))


class CheckpointOut(Schema):
    key: str = Field(description="Where the base model is stored (runs/<run>/base/...).")
    tensors: int
    params: int
    tokenizer: bool = Field(description="Whether its tokenizer came with it (and is used).")


@router.post("/runs/{run_id}/checkpoint", response={201: CheckpointOut})
@audited("run.checkpoint", "run")
def upload_checkpoint(
    request: HttpRequest,
    run_id: RunId,
    file: NinjaFile[UploadedFile],
    tokenizer: NinjaFile[UploadedFile | None] = None,
) -> Status[dict[str, Any]]:
    """Upload a dense checkpoint (safetensors: a path-size LlamaForCausalLM state dict) to a
    draft run: preparation initialises every module from it, and routes with its features
    when router.featurizer is 'base-lm'. Names and shapes must be the run's model's; a
    refusal (422) names the tensor that does not fit in details.field. Never unpickled.
    `tokenizer`: the tokenizer.json the checkpoint was trained with (a downloaded path has
    one); preparation then uses it instead of training a new one, so token ids keep their
    meaning. Without it, the run's tokenizer is trained from its corpus as usual."""
    # torch: runs.checkpoint imports it (seconds); the URLs load without it (test_boundaries).
    from dipaco_server.runs.checkpoint import (
        verify_checkpoint,
        verify_tokenizer,
        write_base_model,
    )

    run = find_run(run_id)
    if run.state != Run.State.DRAFT:
        raise ApiError(
            409,
            "run_not_draft",
            f"run {run.name!r} is {run.state}; a checkpoint is uploaded before the run starts",
        )
    if run.run_config.phase1 is not None:
        raise ApiError(
            409,
            "run_has_phase1",
            f"run {run.name!r} trains its base model in phase 1 (phase1 is set); create a "
            "run without phase1 to start from an uploaded checkpoint",
            field="phase1",
        )
    work = Path(tempfile.mkdtemp(prefix=f"checkpoint-{run.pk}-", dir=work_root()))
    try:
        upload = work / "upload.safetensors"
        with open(upload, "wb") as out:
            for chunk in file.chunks():
                out.write(chunk)
        tokenizer_json = b"".join(tokenizer.chunks()) if tokenizer is not None else None
        try:
            state = verify_checkpoint(upload, run.run_config)
            if tokenizer_json is not None:
                verify_tokenizer(tokenizer_json, run.run_config)
        except ServiceError as exc:
            raise ApiError(exc.status, exc.code, exc.message, **exc.details) from None
        store = get_blob_store()
        if tokenizer_json is not None:
            store.put_bytes(keys.base_tokenizer_key(run.pk), tokenizer_json)
        else:  # a checkpoint uploaded again without one: do not keep an earlier one's
            store.delete(keys.base_tokenizer_key(run.pk))
        key = write_base_model(store, run.pk, state, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = sum(t.numel() for t in state.values())
    out = {"key": key, "tensors": len(state), "params": params}
    return Status(201, {**out, "tokenizer": tokenizer_json is not None})


@router.post("/runs/{run_id}/pause", response=RunOut)
@audited("run.pause", "run")
def pause_run(request: HttpRequest, run_id: RunId) -> Run:
    """running → paused: no new leases; units already leased may still complete."""
    return actions.pause(find_run(run_id))


@router.post("/runs/{run_id}/resume", response=RunOut)
@audited("run.resume", "run")
def resume_run(request: HttpRequest, run_id: RunId) -> Run:
    """paused → running."""
    return actions.resume(find_run(run_id))


@router.post("/runs/{run_id}/cancel", response=RunOut)
@audited("run.cancel", "run")
def cancel_run(request: HttpRequest, run_id: RunId) -> Run:
    """Any live state → cancelled (final): workers are told to drop its units."""
    return actions.cancel(find_run(run_id))


@router.get("/runs/{run_id}/metrics", response=list[MetricOut])
@paginate(Paging)
def run_metrics(
    request: HttpRequest, run_id: RunId, filters: Query[MetricFilter]
) -> QuerySet[MetricPoint]:
    """A run's metric points, oldest first, filtered by series name, path and round."""
    points = MetricPoint.objects.filter(run=find_run(run_id))
    if filters.name is not None:
        points = points.filter(name=filters.name)
    if filters.path is not None:
        points = points.filter(path__index=filters.path)
    if filters.round is not None:
        points = points.filter(round=filters.round)
    return points.annotate(path_index=F("path__index")).order_by("created_at", "pk")
