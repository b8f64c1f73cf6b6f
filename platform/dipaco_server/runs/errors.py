"""Every error the control-plane services raise on purpose, with a stable code and a status.

The API turns a `ServiceError` into its one JSON error shape
(``{"code": ..., "message": ..., "details": ...}``) with ``status`` as the HTTP
status: client faults are 4xx, never 500. Codes are part of the API contract;
messages are for people and say what to do. Anything else a service raises is
a bug (a 500).
"""

from __future__ import annotations

from typing import Any, ClassVar


class ServiceError(Exception):
    """Base class: ``code`` is stable, ``status`` is the HTTP status, ``details`` is JSON."""

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 400

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


# --- runs -----------------------------------------------------------------------
class ConfigInvalid(ServiceError):
    """details["problems"]: [{"field", "value", "rule"}, ...] from dipaco.config."""

    code, status = "config_invalid", 422


class RunNameTaken(ServiceError):
    code, status = "run_name_taken", 409


class RunNotFound(ServiceError):
    code, status = "run_not_found", 404


class InvalidTransition(ServiceError):
    """details: {"state", "requested", "allowed"}."""

    code, status = "invalid_transition", 409


class RunNotActive(ServiceError):
    """The run is not running (or paused) so the operation makes no sense now."""

    code, status = "run_not_active", 409


class ModulesNotReady(ServiceError):
    code, status = "modules_not_ready", 409


class DataNotReady(ServiceError):
    code, status = "data_not_ready", 409


class VersionConflict(ServiceError):
    """A module version exists with other content; versions are immutable."""

    code, status = "version_conflict", 409


# --- workers --------------------------------------------------------------------
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


# --- rounds, leases, contributions ----------------------------------------------
class RoundClosed(ServiceError):
    code, status = "round_closed", 409


class LeaseNotFound(ServiceError):
    code, status = "lease_not_found", 404


class LeaseNotYours(ServiceError):
    code, status = "lease_not_yours", 403


class LeaseSecretInvalid(ServiceError):
    code, status = "lease_secret_invalid", 403


class LeaseExpired(ServiceError):
    code, status = "lease_expired", 409


class LeaseNotActive(ServiceError):
    """The lease was released or completed; details["state"] says which."""

    code, status = "lease_not_active", 409


class LeaseLimitReached(ServiceError):
    code, status = "lease_limit_reached", 409


class ContributionInvalid(ServiceError):
    code, status = "contribution_invalid", 422


class ContributionConflict(ServiceError):
    """A completion was replayed with different content than the one recorded."""

    code, status = "contribution_conflict", 409
