"""The one retry policy, for every network call of the worker agent and ``dipaco download``.

Built on tenacity: exponential backoff with "equal jitter", each wait drawn from
[base/2, base] with base = min(max_s, initial_s x multiplier^k), so a fleet that lost the
server at the same moment does not come back in lockstep and no wait exceeds max_s.
Transient failures (the network, timeouts, 5xx, 408, 429) are retried; anything else is
raised at once, since asking again cannot change the answer. A server's ``Retry-After``
is honoured up to max_s (`retry_after`). A set ``stop`` event ends the waits early
(shutdown) and the last error is raised at once.

    value = retry(lambda: http.get(url), Backoff(attempts=5), what="GET manifest")
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception

__all__ = [
    "HAND_IN_PAUSE_S",
    "Backoff",
    "RetryAttempt",
    "delays",
    "hand_in_patience_s",
    "idle_pause_s",
    "is_transient",
    "retry",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


# The longest Retry-After an idle worker honours: only a guard against a broken header. The
# server paces a waiting crowd itself (dipaco_server.rounds.protocol.pacing.retry_after_s): N workers
# waiting for the next round are spread over N / DIPACO_GRANT_RATE seconds after its
# expected opening, 200 s for 10,000 at the default 50/s. A cap of twice the agent's own
# longest wait (60 s) squeezed that crowd into 60 s: ~170 polls/s instead of 100/s while an
# outer step ran, on the cores the outer step needed (docs/benchmarks.md).
LONGEST_IDLE_WAIT_S = 1800.0


def idle_pause_s(backoff_s: float, retry_after_s: float | None, shed: bool = True) -> float:
    """How long an idle worker waits before it asks again: its own backoff without a
    Retry-After; with one, the server's when nothing was queued (`shed` False: a 204, whose
    Retry-After already spreads the idle crowd and knows when the next round opens), or the
    longer of the two when its request was shed (503 overloaded).

    Why the server's wins on a 204, shorter too: the worker's own backoff reached 30 s while
    rounds took 20 s, and two workers of six found no work in any later round
    (bench/attacks_live.py, 8 rounds: a sleeper that never got the units to turn on)."""
    if retry_after_s is None or not retry_after_s > 0:
        return backoff_s
    server = min(retry_after_s, LONGEST_IDLE_WAIT_S)
    return max(backoff_s, server) if shed else server


# A trained Δ (work in hand) is handed in again every HAND_IN_PAUSE_S after the client's own
# tries are spent, for `hand_in_patience_s` (worker_agent.agent.hand_in; the bench copies it).
HAND_IN_PAUSE_S = 30.0
HAND_IN_LONGEST_S = 3600.0  # at most this long, and this long when the round has no deadline


def hand_in_patience_s(
    round_left_s: float | None, heartbeat_interval_s: float, floor_s: float
) -> float:
    """How long a trained Δ is worth handing in from now: until its round's deadline as last
    heard (`round_left_s` from now, None: none) plus two heartbeat intervals (a round closes
    after its deadline and the salvage grace), at least `floor_s` (the client's own tries),
    at most HAND_IN_LONGEST_S. The server's refusal (the round closed) ends it sooner."""
    if round_left_s is None:
        return HAND_IN_LONGEST_S
    return min(HAND_IN_LONGEST_S, max(floor_s, round_left_s + 2 * heartbeat_interval_s))


@dataclass(frozen=True)
class Backoff:
    """How long to keep trying. Defaults: 8 tries over about 2 minutes."""

    attempts: int = 8  # tries in all, the first included
    initial_s: float = 1.0  # base wait after the first failure
    multiplier: float = 2.0  # base grows by this per failure...
    max_s: float = 30.0  # ...up to this

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_s < 0 or self.multiplier < 1 or self.max_s < 0:
            raise ValueError(f"bad backoff {self}: need attempts >= 1, times >= 0, multiplier >= 1")

    @property
    def longest_total_s(self) -> float:
        """Upper bound of the time spent waiting before giving up (for messages)."""
        return sum(
            min(self.max_s, self.initial_s * self.multiplier**k) for k in range(self.attempts - 1)
        )


@dataclass(frozen=True)
class RetryAttempt:
    """What `on_retry` hears before each wait."""

    what: str
    attempt: int  # the try that failed, 1-based
    error: BaseException
    wait_s: float


def delays(policy: Backoff, rng: random.Random | None = None) -> Iterator[float]:
    """The waits between tries: attempts - 1 of them, each in [base/2, base]."""
    draw = (rng or random).random
    for k in range(policy.attempts - 1):
        base = min(policy.max_s, policy.initial_s * policy.multiplier**k)
        yield base / 2 + draw() * base / 2


def transient_status(status: int) -> bool:
    """True for an HTTP status a later try may not see: 5xx, 408, 429 (never another 4xx)."""
    return status >= 500 or status in (408, 429)


def is_transient(error: BaseException) -> bool:
    """True for failures a later try may not see: network, timeouts, 5xx, 408, 429."""
    if isinstance(error, httpx.HTTPStatusError):
        return transient_status(error.response.status_code)
    return isinstance(error, httpx.TransportError | ConnectionError | TimeoutError)


def retry(
    call: Callable[[], T],
    policy: Backoff,
    *,
    what: str,
    transient: Callable[[BaseException], bool] = is_transient,
    retry_after: Callable[[BaseException], float | None] | None = None,
    stop: threading.Event | None = None,
    on_retry: Callable[[RetryAttempt], None] | None = None,
    sleep: Callable[[float], object] | None = None,
    rng: random.Random | None = None,
) -> T:
    """`call()` until it succeeds, a non-transient error, `stop`, or the last attempt;
    the last error is raised as it was."""
    waits = delays(policy, rng)
    last: list[BaseException] = []

    def wait(state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome else None
        seconds = next(waits, 0.0)
        hinted = retry_after(error) if retry_after and error is not None else None
        return min(policy.max_s, max(seconds, hinted)) if hinted is not None else seconds

    def give_up(state: RetryCallState) -> bool:
        return state.attempt_number >= policy.attempts or (stop is not None and stop.is_set())

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        assert error is not None and state.next_action is not None
        last[:] = [error]
        seconds = state.next_action.sleep
        log.info(
            "%s failed (try %d): %s; again in %.1f s", what, state.attempt_number, error, seconds
        )
        if on_retry is not None:
            on_retry(RetryAttempt(what, state.attempt_number, error, seconds))

    def pause(seconds: float) -> None:
        if sleep is not None:
            sleep(seconds)
        elif stop is not None:
            if stop.wait(seconds):
                raise last[0]  # shutting down: the error as it was, at once
        else:
            threading.Event().wait(seconds)

    retrying = Retrying(
        retry=retry_if_exception(transient),
        stop=give_up,
        wait=wait,
        before_sleep=before_sleep,
        sleep=pause,
        reraise=True,
    )
    return retrying(call)
