"""The worker protocol over HTTP (docs/design.md §4.2-4.3): register, lease, manifest, upload
URLs, complete; and the contributions of a worker with the verdict on each.

``router`` is mounted under /api/v1/worker with worker bearer tokens (registration needs
none: it hands one out). ``staff_router`` answers staff what rounds record: a worker's
contributions, and a run's status with its current round and the workers on it. A lease comes with a
secret, shown once; every call about the lease sends it back in the
``X-Lease-Secret`` header. Keys of uploads are built from ids only (runs.keys);
presigned URLs are short-lived and name one key each. Nothing here reads the
uploaded bytes: completion records contributions pending, and the outer step
verifies them (docs/design.md §7).

The logic is in rounds.lease and rounds.complete; these views translate.
"""

import json
import logging
from datetime import datetime
from typing import Annotated, Any

from django.db import transaction
from django.db.models import Count, F, QuerySet
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from kombu.exceptions import KombuError
from ninja import Field, Header, Query, Router, Schema, Status
from ninja.pagination import paginate

from dipaco.data.windows import path_seed
from dipaco_server.accounts.auth import staff_auth
from dipaco_server.bounds import MAX_ID, JsonId, LeaseId, Paging, RunId, WorkerId
from dipaco_server.celery import app as celery_app
from dipaco_server.errors import ApiError
from dipaco_server.patterns import NAME, OPTIONAL_NAME, declared
from dipaco_server.rounds import lease as leasing
from dipaco_server.rounds import stages
from dipaco_server.rounds.close import ADAPT_EVERY_S, round_ready_to_close
from dipaco_server.rounds.complete import (
    ContributionReport,
    check_uploads,
    complete,
    max_upload_bytes,
    upload_key,
)
from dipaco_server.rounds.downloads import HELD_PATTERN, parse_held, plan_downloads
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round, WorkUnit
from dipaco_server.rounds.open import overlaps
from dipaco_server.rounds.rebase import rebase_plan, rebase_state
from dipaco_server.rounds.tasks import start_closing
from dipaco_server.rounds.unit_data import unit_data
from dipaco_server.rounds.worker_metrics import WorkerMetricsIn, worker_metrics
from dipaco_server.runs.api import RunOut, find_run, run_out
from dipaco_server.runs.errors import DataNotReady, ModulesNotReady, RoundClosed, RunNotActive
from dipaco_server.runs.models import ModuleVersion
from dipaco_server.runs.phases import local_round, phase_config
from dipaco_server.runs.prepare import data_index_key
from dipaco_server.runs.services import record_metric
from dipaco_server.storage import BlobNotFound, BlobStore, get_blob_store
from dipaco_server.workers.api import find_worker
from dipaco_server.workers.auth import current_worker, worker_auth
from dipaco_server.workers.services import MAX_NAME_LENGTH, MAX_OWNER_LENGTH, register_worker

logger = logging.getLogger(__name__)
router = Router(tags=["worker"], auth=worker_auth)
staff_router = Router(auth=staff_auth)

# Presigned URLs live long enough to start a transfer (S3 checks the signature once, at
# the start) and no longer: a leaked URL is useless after a quarter of an hour.
DOWNLOAD_URL_EXPIRES_S = 900
UPLOAD_URL_EXPIRES_S = 900
MAX_MODULES_PER_PATH = 256
# `held` lists a module id and a version per module: every module of a 256-module path, ids
# like "255.15" and 9-digit versions, is under 4,400 characters. A client may percent-encode
# its 511 ':' and ',' (2 bytes more each), and the request line must stay within gunicorn's
# --limit-request-line (cli.server.REQUEST_LINE_LIMIT, 8190 bytes): the longest one the
# schema admits is 8,090 (tests/test_openapi_patterns.py, tests/test_server_cli.py).
HELD_MAX_LENGTH = 7000
REBASE_RETRY_S = 1.0  # an eager unit waiting for the previous round's versions asks again
SECRET_HEADER = "X-Lease-Secret"
Secret = Annotated[
    str, Header(alias=SECRET_HEADER, max_length=256, description="The lease's secret.")
]
OptionalSecret = Annotated[
    str | None, Header(None, alias=SECRET_HEADER, max_length=256, description="With lease_id.")
]


# --- schemas -------------------------------------------------------------------------------


class DataWindowOut(Schema):
    """Which windows of its path's train shard the unit trains on (dipaco.data.windows)."""

    start_position: int = Field(
        description="Where the unit starts in the path's window order: (t·R + r)·H·B."
    )
    windows: int = Field(description="Windows (sequences of seq_len + 1 tokens) it reads: H·B.")
    seed: int = Field(description="Seed of the path's window order (config.seed + path).")
    dtype: str = Field(description="numpy dtype of the token file, e.g. '<u2' (little-endian).")


class RebaseOut(Schema):
    """outer.overlap eager (rounds.rebase): after step `at_step`, rebase onto the versions
    round `round`'s outer step publishes (GET .../lease/{lease_id}/rebase)."""

    at_step: int = Field(
        description="Rebase after this many of the unit's inner steps (counted from the "
        "unit's start): ceil(outer.eager_at x H). Wait there until the versions are published."
    )
    round: int = Field(description="The round whose outer step publishes them (lease round - 1).")


class LeaseOut(Schema):
    lease_id: int
    lease_secret: str = Field(description="Send it as X-Lease-Secret. Shown once.")
    attempt: int
    deadline: datetime = Field(description="Heartbeat before this, or the lease expires.")
    hard_deadline: datetime = Field(description="Heartbeats never extend past this.")
    heartbeat_interval_s: float
    run_id: int
    run_name: str
    round: int = Field(description="Outer round t.")
    unit_id: int
    replica: int
    path: int = Field(description="The path index.")
    modules: list[str] = Field(description="Module ids of the path, in assembly order.")
    base_versions: dict[str, int] = Field(description="Module version each module starts from.")
    steps: int = Field(
        description="The unit's length, the inner loop's bound: inner steps to train, "
        "counted from the unit's start (a resumed checkpoint's included). H "
        "(config.inner.steps), or fewer when the unit is sized to this worker's speed: H "
        "stays the unit's slot of the lr schedule (steps t·H .. t·H + H - 1 of T·H), of "
        "which it trains the first `steps`."
    )
    size_reason: str = Field(description="Why `steps` (speed x units.target_seconds, ...).")
    seconds_limit: float | None = Field(
        description="Stop training after this long and upload the steps done (a new "
        "worker's calibration unit); null: train `steps` steps."
    )
    round_deadline: datetime | None = Field(
        description="The round may close soon after this: upload what is trained by then."
    )
    codec: str = Field(description="How to encode each module's Δ (dipaco.codecs).")
    config: dict[str, Any] = Field(description="The whole run config (dipaco.config.RunConfig).")
    data: DataWindowOut
    rebase: RebaseOut | None = Field(
        None,
        description="outer.overlap eager: when and onto what to rebase (rounds.rebase); "
        "null: the Δ is relative to base_versions.",
    )


class ModuleUpdateOut(Schema):
    """One encoded outer update (comm.download_codec): version `from_version` + its decoded
    values = version `version`, bit for bit (dipaco.updates.apply_update)."""

    from_version: int
    version: int
    key: str
    url: str = Field(description="Presigned GET of the update (a dipaco.codecs container).")
    sha256: str = Field(description="Of the update's bytes, lowercase hex.")
    size: int = Field(description="Bytes.")
    from_sha256: str = Field(description="sha256 of version from_version's fp32 module file.")
    to_sha256: str = Field(
        description="sha256 of version `version`'s fp32 module file, as the worker rewrites "
        "it (dipaco.modules_file): how it checks the result."
    )


class UnitModuleBlobOut(Schema):
    module_id: str
    version: int
    key: str
    sha256: str
    size: int
    url: str = Field(description="Presigned GET of the module's fp32 weights.")
    updates: list[ModuleUpdateOut] = Field(
        default_factory=list,
        description="The encoded updates from the version the request said it `held` to "
        "`version`, in order: fetch these instead of the fp32 weights (rounds.downloads). "
        "Empty: fetch the fp32 weights (or keep them, when held at `version`).",
    )


class DataBlobOut(Schema):
    key: str
    url: str = Field(
        description="Presigned GET of the unit's windows, nothing else of the path's shard: "
        "row i (seq_len + 1 tokens) is the window at position first_position + i "
        "(dipaco.data.windows.UnitSource)."
    )
    sha256: str = Field(description="Of the blob's bytes, lowercase hex.")
    size: int = Field(description="Bytes.")
    tokens: int
    dtype: str
    scope: str = Field(description='"unit": the blob holds this unit\'s windows only.')
    windows: int = Field(description="Rows of seq_len + 1 tokens in the blob.")
    first_position: int = Field(description="The position of the blob's first row.")


class UnitManifestOut(Schema):
    lease_id: int
    expires_in_s: int
    modules: list[UnitModuleBlobOut]
    data: DataBlobOut


class RebaseManifestOut(Schema):
    """The versions an eager unit rebases onto (rounds.rebase), once they are published."""

    lease_id: int
    state: str = Field(
        description='"ready": `versions` are published and `modules` fetch them; "waiting": '
        "round `round`'s outer step is still running, ask again after `retry_after_s`; "
        '"none": this unit has no rebase (its Δ stays relative to its base versions).'
    )
    round: int | None = Field(description="The round whose outer step publishes them.")
    versions: dict[str, int] = Field(
        description="Module id -> the version to rebase onto (when ready)."
    )
    retry_after_s: float = Field(description="When waiting: ask again after this long.")
    expires_in_s: int
    modules: list[UnitModuleBlobOut] = Field(
        description="When ready: the modules at `versions`, with the encoded updates from "
        "the unit's base versions where the run publishes them (as the manifest's)."
    )


class PresignedPostOut(Schema):
    url: str
    fields: dict[str, str] = Field(description="Form fields to send before the 'file' field.")


class UploadOut(Schema):
    module_id: str
    key: str
    max_bytes: int
    put_url: str | None = Field(
        description="A raw PUT, only where the store itself bounds its size (the local "
        "store); S3 cannot, so use `post` (content-length-range) there."
    )
    post: PresignedPostOut


class UploadUrlsOut(Schema):
    lease_id: int
    codec: str
    expires_in_s: int
    uploads: list[UploadOut]


class ContributionIn(Schema):
    module_id: str = Field(max_length=32)
    sha256: str = Field(max_length=64, description="Of the uploaded bytes, lowercase hex.")
    size: JsonId = Field(description="Bytes uploaded.")


class CompleteIn(Schema):
    contributions: list[ContributionIn] = Field(max_length=MAX_MODULES_PER_PATH)
    tokens: JsonId = Field(description="Training tokens the unit consumed.")
    metrics: WorkerMetricsIn = Field(
        default_factory=WorkerMetricsIn,
        description="The worker's own training metrics (closed: another name, or one of "
        "the server's evaluation series such as val_loss, is refused with 422).",
    )
    base_versions: dict[str, JsonId] | None = Field(
        None,
        max_length=MAX_MODULES_PER_PATH,
        description="Module id -> the version each Δ is relative to: the unit's base "
        "versions (the default), or, for an eager unit that rebased, the versions its "
        "rebase named (outer.overlap eager). Anything else is refused (422).",
    )


class ContributionOut(Schema):
    module_id: str
    key: str
    size: int
    sha256: str
    status: str
    base_version: int | None = Field(
        None, description="The module version the Δ is relative to (rounds.rebase)."
    )


class CompleteOut(Schema):
    lease_id: int
    state: str
    contributions: list[ContributionOut]


class LeaseStateOut(Schema):
    lease_id: int
    state: str
    deadline: datetime
    hard_deadline: datetime
    round_deadline: datetime | None = Field(
        None,
        description="On heartbeats: the round's deadline now (a quorum may move it up); "
        "stop before it and upload the steps trained.",
    )


class HeartbeatIn(Schema):
    lease_id: JsonId | None = Field(None, description="The lease to extend (with X-Lease-Secret).")


class HeartbeatOut(Schema):
    server_time: datetime
    worker_id: int
    heartbeat_interval_s: float
    lease: LeaseStateOut | None
    instructions: list[str] = Field(
        description="'release': the lease's work is no longer needed; release it and stop."
    )


def _lease_state(lease: Lease) -> dict[str, Any]:
    return {
        "lease_id": lease.pk,
        "state": lease.state,
        "deadline": lease.deadline,
        "hard_deadline": lease.hard_deadline,
        "round_deadline": lease.round_deadline,
    }


def _token_dtype(vocab_size: int) -> str:
    """dipaco.data.shards.token_dtype as a string, without importing torch into the web process."""
    return "<u2" if vocab_size <= 2**16 else "<u4"


def _train_shard_sha256(store: BlobStore, index_key: str, path_index: int) -> str:
    """A path's train shard digest, from the shard index the data preparation uploaded."""
    try:
        index = json.loads(store.get_bytes(index_key))
        return str(index["paths"][path_index]["train"]["sha256"])
    except (BlobNotFound, ValueError, LookupError, TypeError) as exc:
        raise DataNotReady(
            f"the shard index {index_key} names no train shard of path {path_index} "
            f"({type(exc).__name__}); prepare the run's data again",
            path=path_index,
        ) from exc


# --- views ---------------------------------------------------------------------------------


@router.post("/heartbeat", response=HeartbeatOut)
def heartbeat(
    request: HttpRequest,
    body: HeartbeatIn,
    lease_secret: OptionalSecret = None,
) -> dict[str, Any]:
    """I am alive; with a lease id, extend that lease (never past its hard deadline)."""
    worker = current_worker(request)
    out: dict[str, Any] = {
        "server_time": timezone.now(),
        "worker_id": worker.pk,
        "heartbeat_interval_s": leasing.heartbeat_interval_s(),
        "lease": None,
        "instructions": [],
    }
    if body.lease_id is None:
        return out
    if not lease_secret:
        # 403, not 400: the request is well formed, and the secret is what authorises it.
        raise ApiError(403, "lease_secret_missing", f"send the lease's secret in {SECRET_HEADER}")
    try:
        lease = leasing.heartbeat(worker, body.lease_id, lease_secret)
    except (RoundClosed, RunNotActive):
        # The unit's work can no longer be used: tell the agent to stop, not to retry.
        lease = leasing.load_own_lease(worker, body.lease_id, lease_secret)
        out["instructions"] = ["release"]
    out["lease"] = _lease_state(lease)
    return out


@router.post("/lease", response={200: LeaseOut, 204: None})
def lease(
    request: HttpRequest,
    response: HttpResponse,
    handing_in: Annotated[
        int | None,
        Query(
            None,
            ge=0,
            le=MAX_ID,
            description="The id of this worker's lease whose trained Δ it is handing in "
            "(uploads, then completion) while it asks for its next unit: that one lease does "
            "not count against the worker's lease limit (one training, one handing in).",
        ),
    ] = None,
) -> Status[dict[str, Any] | None]:
    """Take one queued work unit; 204 when none can be granted now: ask again after
    Retry-After seconds, a jittered slot (more when many workers are idle,
    DIPACO_IDLE_POLL_RATE; after the next round's expected opening while one closes, spread
    over the waiting workers at DIPACO_GRANT_RATE)."""
    worker = current_worker(request)
    grant = leasing.grant_lease(worker, handing_in=handing_in)
    if grant is None:
        response["Retry-After"] = str(leasing.retry_after_s())
        return Status(204, None)
    lease, unit = grant.lease, grant.unit
    # Each phase is a run of its own to a worker: its config (phase 1: the dense DiLoCo
    # one), and the round's index within it, which the worker's lr schedule counts.
    run, run_config = unit.round.run, unit.round.run.run_config
    config = phase_config(run_config, unit.path.phase)
    return Status(
        200,
        {
            "lease_id": lease.pk,
            "lease_secret": grant.secret,
            "attempt": lease.attempt,
            "deadline": lease.deadline,
            "hard_deadline": lease.hard_deadline,
            "heartbeat_interval_s": leasing.heartbeat_interval_s(),
            "run_id": run.pk,
            "run_name": run.name,
            "round": local_round(run_config, unit.round.t),
            "unit_id": unit.pk,
            "replica": unit.replica,
            "path": unit.path.index,
            "modules": list(unit.path.modules),
            "base_versions": dict(unit.base_versions),
            "steps": leasing.lease_steps(lease, config),
            "size_reason": lease.size_reason,
            "seconds_limit": lease.seconds_limit,
            "round_deadline": unit.round.deadline,
            "codec": config.comm.codec,
            "config": run.config if config is run_config else config.model_dump(mode="json"),
            "data": {
                "start_position": unit.data_position,
                "windows": unit.data_windows,
                "seed": path_seed(config, unit.path.index),
                "dtype": _token_dtype(config.model.vocab_size),
            },
            "rebase": rebase_plan(unit),
        },
    )


@router.get("/lease/{lease_id}/manifest", response=UnitManifestOut)
def manifest(
    request: HttpRequest,
    lease_id: LeaseId,
    lease_secret: Secret,
    held: Annotated[
        str | None,
        Query(
            None,
            max_length=HELD_MAX_LENGTH,
            pattern=HELD_PATTERN,
            description="Module versions the worker holds, 'module:version' comma-separated "
            "(e.g. '0.0:3,1.1:3'): it is sent their encoded updates (rounds.downloads).",
        ),
    ] = None,
) -> dict[str, Any]:
    """Presigned GETs for the path's module blobs (at the unit's base versions), or the
    encoded updates to them from the versions the worker `held`, and the unit's training
    windows (rounds.unit_data: only those, not the path's whole shard)."""
    lease = leasing.authorize_lease(current_worker(request), lease_id, lease_secret)
    unit, store = lease.unit, get_blob_store()
    run = unit.round.run
    modules, sent = _module_blobs(store, unit, dict(unit.base_versions), parse_held(held))
    config = phase_config(run.run_config, unit.path.phase)
    dtype = _token_dtype(config.model.vocab_size)
    digest = _train_shard_sha256(store, data_index_key(run.pk, unit.path.phase), unit.path.index)
    stages.reset()
    cut = unit_data(
        store,
        run_id=run.pk,
        phase=unit.path.phase,
        path=unit.path.index,
        shard_sha256=digest,
        dtype=dtype,
        seq_len=config.model.seq_len,
        seed=path_seed(config, unit.path.index),
        first=unit.data_position,
        count=unit.data_windows,
    )
    stages.flush(unit.round_id)  # the cutting's seconds, when this request cut the data
    Lease.objects.filter(pk=lease.pk).update(download_bytes=sent)
    return {
        "lease_id": lease.pk,
        "expires_in_s": DOWNLOAD_URL_EXPIRES_S,
        "modules": modules,
        "data": {
            "key": cut.key,
            "url": store.presigned_get(cut.key, DOWNLOAD_URL_EXPIRES_S),
            "sha256": cut.sha256,
            "size": cut.size,
            "tokens": cut.tokens,
            "dtype": dtype,
            "scope": "unit",
            "windows": cut.windows,
            "first_position": cut.first_position,
        },
    }


def _module_blobs(
    store: BlobStore, unit: WorkUnit, wanted: dict[str, int], held: dict[str, int]
) -> tuple[list[dict[str, Any]], int]:
    """The unit's modules at the `wanted` versions, in path order, each with the encoded
    updates from the version the worker `held` (rounds.downloads), and the bytes they send."""
    run = unit.round.run
    versions: dict[str, list[ModuleVersion]] = {}
    for v in ModuleVersion.objects.select_related("module").filter(
        module__run=run, module__phase=unit.path.phase, module__module_id__in=list(wanted)
    ):
        versions.setdefault(v.module.module_id, []).append(v)
    rows = {m: v for m, found in versions.items() for v in found if v.version == wanted[m]}
    missing = sorted(set(wanted) - set(rows))
    if missing:
        raise ModulesNotReady(
            f"modules {missing} have no blob at version {[wanted[m] for m in missing]}",
            modules=missing,
        )
    steps: dict[str, dict[int, int]] = {}
    for module_id, version, base in OuterStep.objects.filter(
        module__run=run,
        module__phase=unit.path.phase,
        module__module_id__in=list(wanted),
        version__isnull=False,
        base_version__isnull=False,
    ).values_list("module__module_id", "version", "base_version"):
        steps.setdefault(module_id, {})[version] = base
    plans = plan_downloads(versions, wanted, held, steps)
    modules = [
        {
            "module_id": m,
            "version": rows[m].version,
            "key": rows[m].blob_key,
            "sha256": rows[m].sha256,
            "size": rows[m].size,
            "url": store.presigned_get(rows[m].blob_key, DOWNLOAD_URL_EXPIRES_S),
            "updates": [
                {**u, "url": store.presigned_get(u["key"], DOWNLOAD_URL_EXPIRES_S)}
                for u in plans[m].updates
            ],
        }
        for m in unit.path.modules
    ]
    return modules, sum(plans[m].bytes for m in unit.path.modules)


@router.get("/lease/{lease_id}/rebase", response=RebaseManifestOut)
def rebase(request: HttpRequest, lease_id: LeaseId, lease_secret: Secret) -> dict[str, Any]:
    """outer.overlap eager (rounds.rebase): the versions this unit rebases onto, with
    presigned GETs for them (encoded updates from the unit's base versions, which the worker
    holds, where the run publishes them); "waiting" while the previous round still steps."""
    lease = leasing.authorize_lease(current_worker(request), lease_id, lease_secret)
    unit = lease.unit
    plan, targets = rebase_state(unit)
    out: dict[str, Any] = {
        "lease_id": lease.pk,
        "state": "none",
        "round": None if plan is None else plan["round"],
        "versions": {},
        "retry_after_s": 0.0,
        "expires_in_s": DOWNLOAD_URL_EXPIRES_S,
        "modules": [],
    }
    if plan is None:
        return out
    if targets is None:
        # About a second between asks: the step of round t - 1 takes seconds to minutes.
        out.update(state="waiting", retry_after_s=REBASE_RETRY_S)
        return out
    base = dict(unit.base_versions)
    modules, sent = _module_blobs(get_blob_store(), unit, targets, base)
    Lease.objects.filter(pk=lease.pk).update(download_bytes=Coalesce(F("download_bytes"), 0) + sent)
    out.update(state="ready", versions=targets, modules=modules)
    return out


@router.post("/lease/{lease_id}/upload-urls", response=UploadUrlsOut)
def upload_urls(request: HttpRequest, lease_id: LeaseId, lease_secret: Secret) -> dict[str, Any]:
    """One presigned PUT (and form POST) per module, scoped to this unit and lease; also
    for an expired lease whose partial Δ can still be salvaged (rounds.complete)."""
    lease = leasing.authorize_upload(current_worker(request), lease_id, lease_secret)
    store = get_blob_store()
    config = phase_config(lease.unit.round.run.run_config, lease.unit.path.phase)
    uploads = []
    for module_id in lease.unit.path.modules:
        key, limit = upload_key(lease, module_id), max_upload_bytes(config, module_id)
        post = store.presigned_post(key, UPLOAD_URL_EXPIRES_S, limit)
        uploads.append(
            {
                "module_id": module_id,
                "key": key,
                "max_bytes": limit,
                "put_url": (
                    store.presigned_put(key, UPLOAD_URL_EXPIRES_S, limit)
                    if store.bounds_put
                    else None
                ),
                "post": {"url": post.url, "fields": post.fields},
            }
        )
    return {
        "lease_id": lease.pk,
        "codec": config.comm.codec,
        "expires_in_s": UPLOAD_URL_EXPIRES_S,
        "uploads": uploads,
    }


@router.post("/lease/{lease_id}/complete", response=CompleteOut)
def complete_lease(
    request: HttpRequest, lease_id: LeaseId, body: CompleteIn, lease_secret: Secret
) -> dict[str, Any]:
    """Report the uploads; recorded pending verification. A replay with the same report is 200.

    A fresh completion is answered only once every upload is in the store with the size it
    declares (one HEAD per module; 422 naming the module otherwise), so a worker cannot
    claim a unit it never handed in (issue 34). Their sha256 and content are the outer
    step's to check, which reads the bytes. The HEADs cost a share of a completion's time
    in the web process at round boundaries (bench/control_plane.py measures it)."""
    worker = current_worker(request)
    lease = leasing.load_own_lease(worker, lease_id, lease_secret)
    fresh = lease.state in (Lease.State.ACTIVE, Lease.State.EXPIRED)
    if fresh:
        leasing.check_salvage(lease, timezone.now())  # live, or expired but salvageable
    metrics = worker_metrics(body.metrics)
    reports = [
        ContributionReport(c.module_id, c.size, c.sha256, body.tokens, metrics)
        for c in body.contributions
    ]
    if fresh:
        check_uploads(lease, reports, get_blob_store())
    rows = complete(
        worker, lease_id, lease_secret, reports, lease=lease, base_versions=body.base_versions
    )
    if fresh:
        unit = lease.unit
        for name, value in metrics.items():
            record_metric(unit.round.run, name, value, path=unit.path, round=unit.round.t)
        round_ = unit.round
        transaction.on_commit(lambda: _close_if_ready(round_))
    return {
        "lease_id": lease.pk,
        "state": Lease.State.COMPLETED,
        "contributions": [
            {
                "module_id": row.module.module_id,
                "key": row.blob_key,
                "size": row.size,
                "sha256": row.sha256,
                "status": row.status,
                "base_version": row.base_version,
            }
            for row in rows
        ],
    }


def _close_if_ready(round_: Round) -> None:
    """Send close_round when this completion made the round ready (rounds.tasks).

    With ``outer.overlap`` "delayed" the round moves to closing here and round t + 1 opens
    (rounds.tasks.start_closing) before this worker asks for its next unit; close_round
    (forced: the round is closing already) then sends the outer steps.
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


@router.post("/lease/{lease_id}/release", response=LeaseStateOut)
def release_lease(request: HttpRequest, lease_id: LeaseId, lease_secret: Secret) -> Any:
    """Give the unit back unfinished (it is queued again); releasing twice is a no-op."""
    lease = leasing.release(current_worker(request), lease_id, lease_secret)
    return _lease_state(lease)


# --- registration and a worker's contributions -----------------------------------------------
# A machine trades an enrollment token for its own worker token (workers.services), shown
# once and stored hashed, and is told the heartbeat interval leases keep; a worker, and
# staff, list its contributions and why any was rejected (issue 19).


class ContributionVerdictOut(Schema):
    """One Δ a worker uploaded and what the server decided about it."""

    id: int
    run_id: int
    round: int
    path: int
    module_id: str
    lease_id: int
    status: str = Field(description="pending, accepted or rejected.")
    reason: str = Field(description='Why it was rejected: "<code>: <message>"; empty otherwise.')
    reason_code: str = Field(description="The reason's code alone (e.g. no_training_gain).")
    tokens: int
    created_at: datetime
    verified_at: datetime | None

    @staticmethod
    def resolve_run_id(obj: Contribution) -> int:
        return obj.unit.round.run_id

    @staticmethod
    def resolve_round(obj: Contribution) -> int:
        return obj.unit.round.t

    @staticmethod
    def resolve_path(obj: Contribution) -> int:
        return obj.unit.path.index

    @staticmethod
    def resolve_module_id(obj: Contribution) -> str:
        return obj.module.module_id

    @staticmethod
    def resolve_reason_code(obj: Contribution) -> str:
        return obj.reason.partition(":")[0] if obj.reason else ""


def contributions_of(worker_id: int, status: str | None = None) -> QuerySet[Contribution]:
    """A worker's contributions, newest first (the API's and the dashboard's query)."""
    rows = Contribution.objects.filter(lease__worker_id=worker_id)
    if status is not None:
        if status not in Contribution.Status.values:
            raise ApiError(
                422,
                "invalid_status",
                f"status {status!r} is not one of {', '.join(Contribution.Status.values)}",
            )
        rows = rows.filter(status=status)
    return rows.select_related("unit__round", "unit__path", "module").order_by("-pk")


class RegisterIn(Schema):
    enrollment_token: str = Field(max_length=256, description="From the operator (dpe_...).")
    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        json_schema_extra=declared(NAME),
        description="This machine's name, shown on the dashboard: not only spaces, and no "
        "control or format characters (spaces at either end are dropped).",
    )
    owner: str = Field(
        "",
        max_length=MAX_OWNER_LENGTH,
        json_schema_extra=declared(OPTIONAL_NAME),
        description="Who runs it (optional); no control or format characters.",
    )
    device: dict[str, Any] = Field(
        default_factory=dict, description='What it trains on, e.g. {"gpu": "RTX 4090"}.'
    )


class RegisterOut(Schema):
    worker_id: int
    name: str
    token: str = Field(description="This worker's bearer token. Shown once: keep it.")
    heartbeat_interval_s: float


@staff_router.get(
    "/workers/{worker_id}/contributions",
    response=list[ContributionVerdictOut],
    tags=["admin: workers"],
)
@paginate(Paging)
def worker_contributions(
    request: HttpRequest, worker_id: WorkerId, status: Contribution.Status | None = None
) -> QuerySet[Contribution]:
    """A worker's contributions, newest first, each with the reason it was rejected."""
    return contributions_of(find_worker(worker_id).pk, status)


@router.post("/register", response={201: RegisterOut}, auth=None)
def register(request: HttpRequest, body: RegisterIn) -> Status[dict[str, Any]]:
    """Trade an enrollment token for this worker's own token (shown once, stored hashed)."""
    worker, plaintext = register_worker(
        body.enrollment_token, body.name, body.device, owner=body.owner
    )
    return Status(
        201,
        {
            "worker_id": worker.pk,
            "name": worker.name,
            "token": plaintext,
            "heartbeat_interval_s": leasing.heartbeat_interval_s(),
        },
    )


@router.get("/contributions", response=list[ContributionVerdictOut])
@paginate(Paging)
def my_contributions(
    request: HttpRequest, status: Contribution.Status | None = None
) -> QuerySet[Contribution]:
    """This worker's contributions, newest first: accepted, rejected (with the reason) or
    still pending verification. Only accepted ones earn credit."""
    return contributions_of(current_worker(request).pk, status)


# --- a run's status (staff) ------------------------------------------------------------------
# A run with its current round and the workers on it: rounds' records, so a rounds route
# (the run's own routes are runs.api's).


class ModuleOut(Schema):
    phase: int = Field(description="1: a module of the dense phase-1 model; 2: a DiPaCo module.")
    module_id: str
    level: int | None
    index: int
    current_version: int | None
    blob_key: str | None = Field(description="The current version's blob (fp32 safetensors).")
    sha256: str | None
    size: int | None


class PathOut(Schema):
    phase: int = Field(description="1: the dense phase-1 model's one path; 2: a DiPaCo path.")
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


@staff_router.get("/runs/{run_id}", response=RunStatusOut, tags=["admin: runs"])
def get_run(request: HttpRequest, run_id: RunId) -> dict[str, Any]:
    """A run with its config, current round, paths, modules (current versions) and workers."""
    run = find_run(run_id)
    out = run_out(run)
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
    out["paths"] = list(run.paths.order_by("phase", "index"))
    current = {
        v.module_id: v
        for v in ModuleVersion.objects.filter(module__run=run, version=F("module__current_version"))
    }
    out["modules"] = [
        {
            "phase": m.phase,
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
