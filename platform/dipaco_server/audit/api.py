"""The audit log over HTTP, for staff: read-only, newest first, paginated and filtered.

Only GET is routed: the log cannot be changed through the API (other methods are 405).
"""

from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest
from ninja import Field, FilterSchema, Query, Router, Schema
from ninja.pagination import paginate

from dipaco_server.accounts.auth import staff_auth
from dipaco_server.audit.models import AuditEntry
from dipaco_server.bounds import Paging
from dipaco_server.patterns import NO_NUL

router = Router(tags=["admin: audit log"], auth=staff_auth)


class AuditEntryOut(Schema):
    id: int
    created_at: datetime
    actor: str = Field(description="The staff user's name.")
    actor_id: int | None
    channel: str = Field(description="api or dashboard.")
    api_token_id: int | None = Field(description="The admin API token used, by id.")
    action: str = Field(description="e.g. run.start, enrollment_token.create.")
    target_type: str
    target_id: str
    params: dict[str, Any] = Field(description="The request's values; secrets as ***.")
    address: str | None = Field(description="The client address (REMOTE_ADDR).")
    outcome: str = Field(description="ok, refused (4xx) or failed (5xx).")
    status: int = Field(description="The HTTP status the action was answered with.")
    error_code: str
    message: str


class AuditFilter(FilterSchema):
    action: str | None = Field(
        None, max_length=64, pattern=NO_NUL, description="Exactly this action."
    )
    target_type: str | None = Field(None, max_length=64, pattern=NO_NUL)
    target_id: str | None = Field(None, max_length=64, pattern=NO_NUL)
    actor: str | None = Field(None, max_length=150, pattern=NO_NUL)
    outcome: AuditEntry.Outcome | None = None


@router.get("/audit-log", response=list[AuditEntryOut])
@paginate(Paging)
def list_audit_log(request: HttpRequest, filters: Query[AuditFilter]) -> QuerySet[AuditEntry]:
    """Admin actions, newest first; filter by action, target, actor or outcome."""
    return filters.filter(AuditEntry.objects.order_by("-created_at", "-pk"))
