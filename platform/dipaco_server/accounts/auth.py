"""Bearer-token auth for the admin API: staff tokens (worker tokens: workers.auth).

It reads ``Authorization: Bearer <token>``. A missing header is 401
``unauthenticated``; the service decides the rest (unknown or revoked token
401, a valid token of a user who is not active staff 403), and its errors reach
the client through dipaco_server.errors in the one error shape.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from dipaco_server.accounts.services import authenticate_staff


class StaffToken(HttpBearer):
    """An admin API token of an active staff user (``dipaco admin token create``)."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        return authenticate_staff(token)


staff_auth = StaffToken()
