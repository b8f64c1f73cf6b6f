"""Workers over HTTP, for staff: enrollment tokens and workers.

``router``: create, list and revoke enrollment tokens; list and revoke workers, reset a
worker's trust. A machine's registration and the contributions of a worker are answered
with rounds' records (the heartbeat interval leases keep, the verdicts of its Δs), so
they are rounds' routes (rounds.protocol.api).
"""

from datetime import datetime, timedelta
from typing import Annotated, Any

from django.db.models import QuerySet
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate
from pydantic import Field as Range
from pydantic import StrictBool

from dipaco_server.accounts.auth import staff_auth
from dipaco_server.audit.services import audited
from dipaco_server.bounds import JSON_INTEGER, MAX_INT, Paging, TokenId, WorkerId
from dipaco_server.errors import ApiError
from dipaco_server.workers import probation, services, signals, trust
from dipaco_server.workers.models import EnrollmentToken, Worker

router = Router(tags=["admin: workers"], auth=staff_auth)
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
    trusted: StrictBool = Field(
        False,
        description="For the operator's own machines: its workers skip probation, are "
        "never audited, and referee a module's first step.",
    )


class EnrollmentOut(Schema):
    id: int
    label: str
    max_uses: int | None
    uses: int
    expires_at: datetime | None
    revoked: bool
    trusted: bool
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
    probation: bool = Field(
        description="Every unit it takes is replicated, and it checks others' units, until "
        "its copies agreed with probation_partners_needed distinct workers' in both roles."
    )
    probation_partners: int = Field(description="Distinct workers its copies agreed with.")
    probation_partners_needed: int
    operator_trusted: bool = Field(description="Registered with a token marked trusted.")
    audits: int = Field(description="Units of its also issued as a check copy.")
    doubted: bool = Field(
        description="Established, but a copy of its was close to another worker's without "
        "confirming it: every unit it takes is replicated and its credit held until a copy "
        "of its agrees (never a refusal by itself)."
    )
    held_units: int = Field(
        description="Accepted units not credited yet: on probation, doubted, or (audits on) "
        "since its last audit that agreed; credited when it leaves probation, when a copy "
        "of its agrees with an established worker's, or when the run finishes (forfeited if "
        "one of its copies loses a comparison first)."
    )
    held_tokens: int = Field(description="Their tokens, held the same way.")
    replication_rate: float = Field(description="The share of its units replicated now.")
    state: str = Field(
        description="What it is doing now, one of: training, idle, stuck (heartbeats and "
        "holds a lease but completed nothing for three lease timeouts), offline, "
        "distrusted, revoked."
    )

    @staticmethod
    def resolve_state(obj: Worker) -> str:
        return signals.state_of(obj)

    @staticmethod
    def resolve_probation_partners(obj: Worker) -> int:
        return probation.probation_progress(obj.partners)[0]

    @staticmethod
    def resolve_probation_partners_needed(obj: Worker) -> int:
        return trust.partners_needed()

    @staticmethod
    def resolve_replication_rate(obj: Worker) -> float:
        return trust.replication_rate(obj)


# --- enrollment tokens (staff) -------------------------------------------------------------


@router.post("/enrollment-tokens", response={201: EnrollmentCreatedOut})
@audited("enrollment_token.create", "enrollment_token")
def create_enrollment_token(request: HttpRequest, body: EnrollmentIn) -> Status[EnrollmentToken]:
    """A token volunteers register workers with; its plaintext appears only in this answer."""
    expires = timedelta(seconds=body.expires_in_s) if body.expires_in_s is not None else None
    row, plaintext = services.create_enrollment_token(
        created_by=request.auth,
        label=body.label,
        max_uses=body.max_uses,
        expires_in=expires,
        trusted=body.trusted,
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


def find_worker(worker_id: int) -> Worker:
    """The worker of id `worker_id`; 404 worker_not_found when there is none."""
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise ApiError(404, "worker_not_found", f"no worker with id {worker_id}")
    return worker


@router.get("/workers/{worker_id}", response=WorkerOut)
def get_worker(request: HttpRequest, worker_id: WorkerId) -> Worker:
    return find_worker(worker_id)


@router.post("/workers/{worker_id}/reset-trust", response=WorkerOut)
@audited("worker.reset_trust", "worker")
def reset_trust(request: HttpRequest, worker_id: WorkerId) -> Worker:
    """Trust the worker fully again (1.0), e.g. after its owner fixed a broken machine."""
    worker = find_worker(worker_id)
    Worker.objects.filter(pk=worker.pk).update(trust=1.0)
    worker.refresh_from_db()
    return worker


@router.post("/workers/{worker_id}/revoke", response=WorkerOut)
@audited("worker.revoke", "worker")
def revoke_worker(request: HttpRequest, worker_id: WorkerId) -> Worker:
    """Refuse the worker's token from now on; the lease sweep takes its units back."""
    worker = find_worker(worker_id)
    services.revoke_worker(worker)
    return worker
