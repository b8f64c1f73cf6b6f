"""Bearer-token auth for the two APIs: staff tokens (admin API) and worker tokens (worker API).

Both read ``Authorization: Bearer <token>``. A missing header is 401
``unauthenticated``; the services decide the rest (unknown or revoked token
401, a valid token of the wrong kind of account 403), and their errors reach
the client through dipaco_server.errors in the one error shape.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from dipaco_server.accounts.services import authenticate_staff
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import authenticate_worker


class StaffToken(HttpBearer):
    """An admin API token of an active staff user (``dipaco admin token create``)."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        return authenticate_staff(token)


class WorkerToken(HttpBearer):
    """A worker's own token, received once from ``POST /api/v1/worker/register``."""

    def authenticate(self, request: HttpRequest, token: str) -> Worker:
        return authenticate_worker(token)


staff_auth = StaffToken()
worker_auth = WorkerToken()


def current_worker(request: HttpRequest) -> Worker:
    """The worker a request under `worker_auth` was authenticated as."""
    worker = getattr(request, "auth", None)
    if not isinstance(worker, Worker):  # a route mounted without worker_auth: a bug
        raise TypeError("this route needs auth=worker_auth")
    return worker
