"""Bearer-token auth for the worker API: a worker's own token (staff tokens: accounts.auth).

It reads ``Authorization: Bearer <token>``. A missing header is 401 ``unauthenticated``;
workers.services decides the rest (unknown token 401, revoked worker 403), and its errors
reach the client through dipaco_server.errors in the one error shape.
"""

from __future__ import annotations

from django.http import HttpRequest
from ninja.security import HttpBearer

from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import authenticate_worker


class WorkerToken(HttpBearer):
    """A worker's own token, received once from ``POST /api/v1/worker/register``."""

    def authenticate(self, request: HttpRequest, token: str) -> Worker:
        return authenticate_worker(token)


worker_auth = WorkerToken()


def current_worker(request: HttpRequest) -> Worker:
    """The worker a request under `worker_auth` was authenticated as."""
    worker = getattr(request, "auth", None)
    if not isinstance(worker, Worker):  # a route mounted without worker_auth: a bug
        raise TypeError("this route needs auth=worker_auth")
    return worker
