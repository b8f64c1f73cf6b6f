"""GET /api/v1/health: 200 when the database and broker answer, 503 otherwise."""

from __future__ import annotations

from typing import Literal

from django.http import HttpRequest
from ninja import Router, Schema, Status

from dipaco import __version__
from dipaco_server.core import services

router = Router(tags=["health"])


class CheckOut(Schema):
    ok: bool
    detail: str


class HealthOut(Schema):
    status: Literal["ok", "degraded"]
    version: str
    database: CheckOut
    broker: CheckOut


@router.get("/health", response={200: HealthOut, 503: HealthOut}, auth=None)
def health(request: HttpRequest) -> Status[HealthOut]:
    """Whether this server can reach its database and Celery broker."""
    database, broker = services.check_database(), services.check_broker()
    ok = database.ok and broker.ok
    body = HealthOut(
        status="ok" if ok else "degraded",
        version=__version__,
        database=CheckOut(ok=database.ok, detail=database.detail),
        broker=CheckOut(ok=broker.ok, detail=broker.detail),
    )
    return Status(200 if ok else 503, body)
