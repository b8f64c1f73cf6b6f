"""The errors the workers services raise on purpose: a `ServiceError` (dipaco_server.errors)
each, with a stable code and an HTTP status."""

from __future__ import annotations

from dipaco_server.errors import ServiceError


class TokenInvalid(ServiceError):
    code, status = "token_invalid", 401


class WorkerRevoked(ServiceError):
    code, status = "worker_revoked", 403


class WorkerDistrusted(ServiceError):
    """Its work failed verification too often (workers.trust); details: trust, minimum."""

    code, status = "worker_distrusted", 403


class EnrollmentRefused(ServiceError):
    """details["reason"]: unknown, revoked, expired or used_up."""

    code, status = "enrollment_refused", 403


class WorkerInvalid(ServiceError):
    code, status = "worker_invalid", 422
