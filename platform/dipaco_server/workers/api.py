"""Workers over HTTP: enrollment tokens and workers for staff, registration for volunteers.

``router`` (staff): create, list and revoke enrollment tokens; list and revoke
workers, list a worker's contributions with the reason of each rejection, reset its
trust. ``worker_router`` (mounted under /worker): a machine trades an enrollment token
for its own worker token, shown once and stored hashed; a worker lists its own
contributions and why any was rejected (issue 19).
"""

from datetime import datetime, timedelta
from typing import Annotated, Any

from django.db.models import QuerySet
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate
from pydantic import Field as Range

from dipaco_server.accounts.auth import current_worker, staff_auth, worker_auth
from dipaco_server.audit.services import audited
from dipaco_server.bounds import JSON_INTEGER, MAX_INT, Paging, TokenId, WorkerId
from dipaco_server.errors import ApiError
from dipaco_server.patterns import NAME, OPTIONAL_NAME, declared
from dipaco_server.rounds.lease import heartbeat_interval_s
from dipaco_server.rounds.models import Contribution
from dipaco_server.workers import services
from dipaco_server.workers.models import EnrollmentToken, Worker
from dipaco_server.workers.services import MAX_NAME_LENGTH, MAX_OWNER_LENGTH

router = Router(tags=["admin: workers"], auth=staff_auth)
worker_router = Router(tags=["worker"])
MAX_EXPIRY_S = 365 * 24 * 3600


# --- schemas -------------------------------------------------------------------------------


class EnrollmentIn(Schema):
    label: str = Field("", max_length=100, description="Who or what it is for.")
    max_uses: Annotated[int, Range(ge=1, le=MAX_INT), JSON_INTEGER] | None = Field(
        1, description="Workers it may register; null: unlimited."
    )
    expires_in_s: Annotated[int, Range(ge=60, le=MAX_EXPIRY_S), JSON_INTEGER] | None = Field(
        None, description="Seconds until it expires; null: never."
    )


class EnrollmentOut(Schema):
    id: int
    label: str
    max_uses: int | None
    uses: int
    expires_at: datetime | None
    revoked: bool
    created_at: datetime
    created_by: str | None

    @staticmethod
    def resolve_created_by(obj: EnrollmentToken) -> str | None:
        return obj.created_by.get_username() if obj.created_by else None


class EnrollmentCreatedOut(EnrollmentOut):
    token: str = Field(description="The enrollment token. Shown once: only its hash is kept.")


class WorkerOut(Schema):
    id: int
    name: str
    owner: str
    device: dict[str, Any]
    measured_speed: float | None = Field(description="Training tokens per second, smoothed.")
    created_at: datetime
    last_seen: datetime | None
    revoked: bool
    revoked_at: datetime | None
    units_completed: int
    leases_expired: int
    contributions_accepted: int
    contributions_rejected: int
    tokens_processed: int = Field(description="Tokens of units whose every Δ was accepted.")
    trust: float = Field(description="0..1; below DIPACO_MIN_TRUST it gets no more work.")
    replicas_agreed: int
    replicas_disagreed: int


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


# --- enrollment tokens (staff) -------------------------------------------------------------


@router.post("/enrollment-tokens", response={201: EnrollmentCreatedOut})
@audited("enrollment_token.create", "enrollment_token")
def create_enrollment_token(request: HttpRequest, body: EnrollmentIn) -> Status[EnrollmentToken]:
    """A token volunteers register workers with; its plaintext appears only in this answer."""
    expires = timedelta(seconds=body.expires_in_s) if body.expires_in_s is not None else None
    row, plaintext = services.create_enrollment_token(
        created_by=request.auth, label=body.label, max_uses=body.max_uses, expires_in=expires
    )
    row.token = plaintext  # for the answer only, never saved
    return Status(201, row)


@router.get("/enrollment-tokens", response=list[EnrollmentOut])
@paginate(Paging)
def list_enrollment_tokens(request: HttpRequest) -> QuerySet[EnrollmentToken]:
    return EnrollmentToken.objects.select_related("created_by").order_by("-created_at", "-pk")


@router.post("/enrollment-tokens/{token_id}/revoke", response=EnrollmentOut)
@audited("enrollment_token.revoke", "enrollment_token", id_parameter="token_id")
def revoke_enrollment_token(request: HttpRequest, token_id: TokenId) -> EnrollmentToken:
    """Refuse the token from now on; workers it already registered keep working."""
    row = EnrollmentToken.objects.filter(pk=token_id).first()
    if row is None:
        raise ApiError(404, "enrollment_token_not_found", f"no enrollment token with id {token_id}")
    services.revoke_enrollment_token(row)
    return row


# --- workers (staff) -----------------------------------------------------------------------


@router.get("/workers", response=list[WorkerOut])
@paginate(Paging)
def list_workers(request: HttpRequest, revoked: bool | None = None) -> QuerySet[Worker]:
    """Workers, most recently seen first; `revoked` keeps only (non-)revoked ones."""
    workers = Worker.objects.order_by("-last_seen", "-pk")
    return workers if revoked is None else workers.filter(revoked=revoked)


def _worker(worker_id: int) -> Worker:
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise ApiError(404, "worker_not_found", f"no worker with id {worker_id}")
    return worker


@router.get("/workers/{worker_id}", response=WorkerOut)
def get_worker(request: HttpRequest, worker_id: WorkerId) -> Worker:
    return _worker(worker_id)


@router.get("/workers/{worker_id}/contributions", response=list[ContributionVerdictOut])
@paginate(Paging)
def worker_contributions(
    request: HttpRequest, worker_id: WorkerId, status: Contribution.Status | None = None
) -> QuerySet[Contribution]:
    """A worker's contributions, newest first, each with the reason it was rejected."""
    return contributions_of(_worker(worker_id).pk, status)


@router.post("/workers/{worker_id}/reset-trust", response=WorkerOut)
@audited("worker.reset_trust", "worker")
def reset_trust(request: HttpRequest, worker_id: WorkerId) -> Worker:
    """Trust the worker fully again (1.0), e.g. after its owner fixed a broken machine."""
    worker = _worker(worker_id)
    Worker.objects.filter(pk=worker.pk).update(trust=1.0)
    worker.refresh_from_db()
    return worker


@router.post("/workers/{worker_id}/revoke", response=WorkerOut)
@audited("worker.revoke", "worker")
def revoke_worker(request: HttpRequest, worker_id: WorkerId) -> Worker:
    """Refuse the worker's token from now on; the lease sweep takes its units back."""
    worker = _worker(worker_id)
    services.revoke_worker(worker)
    return worker


# --- registration (volunteers) -------------------------------------------------------------


@worker_router.post("/register", response={201: RegisterOut}, auth=None)
def register(request: HttpRequest, body: RegisterIn) -> Status[dict[str, Any]]:
    """Trade an enrollment token for this worker's own token (shown once, stored hashed)."""
    worker, plaintext = services.register_worker(
        body.enrollment_token, body.name, body.device, owner=body.owner
    )
    return Status(
        201,
        {
            "worker_id": worker.pk,
            "name": worker.name,
            "token": plaintext,
            "heartbeat_interval_s": heartbeat_interval_s(),
        },
    )


@worker_router.get("/contributions", response=list[ContributionVerdictOut], auth=worker_auth)
@paginate(Paging)
def my_contributions(
    request: HttpRequest, status: Contribution.Status | None = None
) -> QuerySet[Contribution]:
    """This worker's contributions, newest first: accepted, rejected (with the reason) or
    still pending verification. Only accepted ones earn credit."""
    return contributions_of(current_worker(request).pk, status)
