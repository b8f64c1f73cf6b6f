"""A worker's contributions, newest first, with the verdict on each and why any was
rejected: the worker asks for its own (GET /api/v1/worker/contributions, worker token),
staff for any worker's (GET /api/v1/workers/{id}/contributions); the dashboard runs the
same query (`contributions_of`)."""

from datetime import datetime

from django.db.models import QuerySet
from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.pagination import paginate

from dipaco_server.accounts.auth import staff_auth
from dipaco_server.bounds import Paging, WorkerId
from dipaco_server.errors import ApiError
from dipaco_server.rounds.models import Contribution
from dipaco_server.workers.api import find_worker
from dipaco_server.workers.auth import current_worker, worker_auth

router = Router(tags=["worker"], auth=worker_auth)  # mounted under /api/v1/worker
staff_router = Router(auth=staff_auth)


class ContributionVerdictOut(Schema):
    """One Δ a worker uploaded and what the server decided about it."""

    id: int
    run_id: int
    round: int
    path: int
    module_id: str
    lease_id: int
    status: str = Field(description="pending, accepted or rejected.")
    reason: str = Field(
        description="Why it was rejected, or why a pending one waits for the next round's "
        'step (first_round_unsettled, first_round_waiting): "<code>: <message>"; empty '
        "otherwise."
    )
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


@router.get("/contributions", response=list[ContributionVerdictOut])
@paginate(Paging)
def my_contributions(
    request: HttpRequest, status: Contribution.Status | None = None
) -> QuerySet[Contribution]:
    """This worker's contributions, newest first: accepted, rejected (with the reason) or
    still pending verification. Only accepted ones earn credit."""
    return contributions_of(current_worker(request).pk, status)
