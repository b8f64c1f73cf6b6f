"""The worker protocol over HTTP (docs/design.md §4.2-4.3): register, heartbeat, lease,
manifest, rebase, upload URLs, complete, release.

``router`` is mounted under /api/v1/worker with worker bearer tokens (registration needs
none: it hands one out). A lease comes with a secret, shown once; every call about the
lease sends it back in the ``X-Lease-Secret`` header. Keys of uploads are built from ids
only (runs.keys); presigned URLs are short-lived and name one key each. Nothing here reads
the uploaded bytes: completion records contributions pending, and the outer step verifies
them (docs/design.md §7). A completion sends ``rounds.signals.lease_completed``; whether
the round closes is the round's life's to decide (rounds.lifecycle.receivers).

Registration is here, not in the workers app, because it is the protocol's first step
under /worker and its answer carries the heartbeat interval leases keep (rounds' scheduling
policy, rounds.protocol.pacing); the enrollment itself is workers.services.register_worker.

The wire shapes are rounds.protocol.schemas; the logic is in rounds.protocol.leases,
rounds.protocol.grant and rounds.protocol.complete; these views translate.
"""

import logging
from typing import Annotated, Any

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Query, Router, Status

from dipaco.data.windows import path_seed
from dipaco_server.bounds import MAX_ID, LeaseId
from dipaco_server.errors import ApiError
from dipaco_server.rounds import stages
from dipaco_server.rounds.granted import lease_steps
from dipaco_server.rounds.models import Lease, OuterStep, WorkUnit
from dipaco_server.rounds.protocol import grant as granting
from dipaco_server.rounds.protocol import leases as leasing
from dipaco_server.rounds.protocol import pacing
from dipaco_server.rounds.protocol.complete import (
    ContributionReport,
    check_uploads,
    complete,
    max_upload_bytes,
    upload_key,
)
from dipaco_server.rounds.protocol.downloads import HELD_PATTERN, parse_held, plan_downloads
from dipaco_server.rounds.protocol.rebase import rebase_plan, rebase_state
from dipaco_server.rounds.protocol.schemas import (
    SECRET_HEADER,
    CompleteIn,
    CompleteOut,
    HeartbeatIn,
    HeartbeatOut,
    LeaseOut,
    LeaseStateOut,
    OptionalSecret,
    RebaseManifestOut,
    RegisterIn,
    RegisterOut,
    Secret,
    UnitManifestOut,
    UploadUrlsOut,
)
from dipaco_server.rounds.protocol.unit_data import unit_rows
from dipaco_server.rounds.protocol.worker_metrics import worker_metrics
from dipaco_server.rounds.signals import lease_completed
from dipaco_server.runs.errors import ModulesNotReady, RoundClosed, RunNotActive
from dipaco_server.runs.models import ModuleVersion
from dipaco_server.runs.phases import local_round, phase_config
from dipaco_server.runs.services import record_metric
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.workers.auth import current_worker, worker_auth
from dipaco_server.workers.services import register_worker

logger = logging.getLogger(__name__)
router = Router(tags=["worker"], auth=worker_auth)

# Presigned URLs live long enough to start a transfer (S3 checks the signature once, at
# the start) and no longer: a leaked URL is useless after a quarter of an hour.
DOWNLOAD_URL_EXPIRES_S = 900
UPLOAD_URL_EXPIRES_S = 900
# `held` lists a module id and a version per module: every module of a 256-module path, ids
# like "255.15" and 9-digit versions, is under 4,400 characters. A client may percent-encode
# its 511 ':' and ',' (2 bytes more each), and the request line must stay within gunicorn's
# --limit-request-line (http_limits.REQUEST_LINE_LIMIT, 8190 bytes): the longest one the
# schema admits is 8,090 (tests/test_openapi_patterns.py, tests/test_server_cli.py).
HELD_MAX_LENGTH = 7000
REBASE_RETRY_S = 1.0  # an eager unit waiting for the previous round's versions asks again


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
        "heartbeat_interval_s": pacing.heartbeat_interval_s(),
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
    grant = granting.grant_lease(worker, handing_in=handing_in)
    if grant is None:
        response["Retry-After"] = str(pacing.retry_after_s())
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
            "heartbeat_interval_s": pacing.heartbeat_interval_s(),
            "run_id": run.pk,
            "run_name": run.name,
            "round": local_round(run_config, unit.round.t),
            "unit_id": unit.pk,
            "replica": unit.replica,
            "cold": granting.trains_cold(lease),
            "path": unit.path.index,
            "modules": list(unit.path.modules),
            "base_versions": dict(unit.base_versions),
            "steps": lease_steps(lease, config),
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
            "(e.g. '0.0:3,1.1:3'): it is sent their encoded updates (rounds.protocol.downloads).",
        ),
    ] = None,
) -> dict[str, Any]:
    """Presigned GETs for the path's module blobs (at the unit's base versions), or the
    encoded updates to them from the versions the worker `held`, and the row chunks of the
    unit's training windows (rounds.protocol.unit_data: only those chunks; no token read)."""
    lease = leasing.authorize_lease(current_worker(request), lease_id, lease_secret)
    unit, store = lease.unit, get_blob_store()
    run = unit.round.run
    modules, sent = _module_blobs(store, unit, dict(unit.base_versions), parse_held(held))
    config = phase_config(run.run_config, unit.path.phase)
    stages.reset()
    with stages.timed("manifest"):  # the caller flushes it to its round
        data = unit_rows(store, lease, config, _token_dtype(config.model.vocab_size))
    stages.flush(unit.round_id)
    Lease.objects.filter(pk=lease.pk).update(download_bytes=sent)
    return {
        "lease_id": lease.pk,
        "expires_in_s": DOWNLOAD_URL_EXPIRES_S,
        "modules": modules,
        "data": data,
    }


def _module_blobs(
    store: BlobStore, unit: WorkUnit, wanted: dict[str, int], held: dict[str, int]
) -> tuple[list[dict[str, Any]], int]:
    """The unit's modules at the `wanted` versions, in path order, each with the encoded
    updates from the version the worker `held` (rounds.protocol.downloads), and the bytes they send."""
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
    """outer.overlap eager (rounds.protocol.rebase): the versions this unit rebases onto, with
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
    for an expired lease whose partial Δ can still be salvaged (rounds.protocol.complete)."""
    worker = current_worker(request)
    lease = leasing.authorize_lease(worker, lease_id, lease_secret, salvage=True)
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
    claim a unit it never handed in. Their sha256 and content are the outer
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
        # The round's life (rounds.lifecycle.receivers) decides whether it may close now.
        transaction.on_commit(lambda: lease_completed.send(Lease, round_=round_, lease=lease))
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


@router.post("/lease/{lease_id}/release", response=LeaseStateOut)
def release_lease(request: HttpRequest, lease_id: LeaseId, lease_secret: Secret) -> Any:
    """Give the unit back unfinished (it is queued again); releasing twice is a no-op."""
    lease = leasing.release(current_worker(request), lease_id, lease_secret)
    return _lease_state(lease)


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
            "heartbeat_interval_s": pacing.heartbeat_interval_s(),
        },
    )
