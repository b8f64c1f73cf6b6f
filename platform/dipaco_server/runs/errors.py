"""The errors the runs services raise on purpose, and those of rounds, leases and
contributions (rounds builds on runs). Each is a `ServiceError` (dipaco_server.errors)
with a stable code and an HTTP status; the API answers it in the one error shape.
"""

from __future__ import annotations

from dipaco_server.errors import ServiceError


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
