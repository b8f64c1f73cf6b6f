"""What can stop the agent, each with the exit code ``dipaco-worker --help`` documents.

An `AgentError` carries a message a volunteer can act on (what happened and what to
check); the CLI prints it and exits with its code. `ServerError` is the control plane's
JSON error (``{"error": {"code", "message"}}``) with its HTTP status; its ``code`` is
stable, so the agent branches on it, never on the message.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from dipaco.retry import transient_status


class ExitCode(IntEnum):
    OK = 0  # stopped cleanly: --once/--max-units done, or SIGINT/SIGTERM after a release
    ERROR = 1  # an unexpected failure: a bug; the message and traceback say where
    USAGE = 2  # bad options, or not enrolled yet
    UNREACHABLE = 3  # the server did not answer after every retry
    AUTH = 4  # the worker token was revoked or is unknown, or the enrollment was refused
    INCOMPATIBLE = 5  # the server speaks another version of the worker API
    DISK_FULL = 6  # the data directory ran out of space
    OUT_OF_MEMORY = 7  # a unit does not fit even with a micro-batch of one sequence
    DISTRUSTED = 8  # the server gives this worker no more work: its Δs failed its checks
    INTERRUPTED = 130  # a second Ctrl+C: exited at once, nothing released


EXIT_CODES_HELP = """exit codes:
  0    stopped cleanly (--once/--max-units done, or Ctrl+C/SIGTERM: lease released)
  1    unexpected error (a bug: please report it with the log)
  2    bad options, or not enrolled yet (run with --server URL --enroll TOKEN)
  3    server unreachable after retries (check the URL, the network, the server)
  4    worker token revoked or unknown, or enrollment refused (enroll again)
  5    server version incompatible with this agent (upgrade dipaco)
  6    disk full in the data directory (free space or use --data-dir)
  7    out of memory even with a micro-batch of 1 (use a bigger GPU or --memory-cap)
  8    distrusted: this worker's Δs failed the server's checks too often, so it gets no
       more work until an operator resets it (see its page, <server>/workers/<id>/)
  130  second Ctrl+C: exited at once without releasing the lease"""


class AgentError(Exception):
    """A failure the agent cannot work around; `exit_code` is what the process returns."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(AgentError):
    exit_code = ExitCode.USAGE


class ServerUnreachable(AgentError):
    exit_code = ExitCode.UNREACHABLE


class AuthFailed(AgentError):
    exit_code = ExitCode.AUTH


class IncompatibleServer(AgentError):
    exit_code = ExitCode.INCOMPATIBLE


class DiskFull(AgentError):
    exit_code = ExitCode.DISK_FULL


class OutOfMemory(AgentError):
    exit_code = ExitCode.OUT_OF_MEMORY


class WorkerDistrusted(AgentError):
    """403 ``worker_distrusted``: the server's checks rejected this worker's Δs too often
    (its trust fell below the run's minimum), so it gets no more leases. Not a crash, and a
    restart changes nothing; an honest machine gets here too when a check copy disagreed
    with it, so the message says where to look and whom to ask."""

    exit_code = ExitCode.DISTRUSTED

    def __init__(self, server: str, worker_id: int | None, reason: str) -> None:
        page = f"{server}/workers/{worker_id}/" if worker_id is not None else f"{server}/workers/"
        super().__init__(
            f"the server gives this worker no more work: its trained Δs failed the server's "
            f"checks too often ({reason}). This is not a fault of this machine's setup and "
            f"restarting changes nothing. See which contributions were rejected and why on "
            f"its page, {page}, and ask the run's operator to review them and reset its trust"
        )
        self.page = page


class ServerError(Exception):
    """A JSON error answer of the control plane (or a blob URL): status, stable code, message."""

    def __init__(
        self, status: int, code: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}

    @property
    def transient(self) -> bool:
        """Worth retrying: the server's fault or overload, never the client's (4xx)."""
        return transient_status(self.status)


# Codes that mean "this lease is over": drop the unit, ask for another (not an error).
LEASE_GONE = frozenset(
    {
        "lease_expired",
        "lease_not_active",
        "lease_not_found",
        "lease_not_yours",
        "lease_secret_invalid",
        "round_closed",
        "run_not_active",
    }
)
# Codes that mean this worker's token is no good: enroll again.
TOKEN_REFUSED = frozenset({"token_invalid", "worker_revoked", "unauthenticated"})


class Interrupted(Exception):
    """The agent was asked to stop (SIGINT/SIGTERM) during a wait or a transfer."""
