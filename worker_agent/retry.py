"""The agent's retries: dipaco.retry's one policy, taught the agent's ServerError.

Every network call of the agent goes through `retry` (dipaco.retry, on tenacity): a
ServerError is transient when the server said so (5xx, 408, 429), and its
``retry_after`` detail is honoured up to the policy's max_s.

    value = retry(lambda: client.get(url), Backoff(attempts=5), what="GET manifest")
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TypeVar

from dipaco import retry as _policy
from dipaco.retry import Backoff, RetryAttempt, delays
from worker_agent.errors import ServerError

__all__ = ["Backoff", "RetryAttempt", "delays", "is_transient", "retry"]
T = TypeVar("T")


def is_transient(error: BaseException) -> bool:
    """True for failures a later try may not see: network, timeouts, 5xx, 408, 429."""
    if isinstance(error, ServerError):
        return error.transient
    return _policy.is_transient(error)


def retry_after(error: BaseException) -> float | None:
    raw = error.details.get("retry_after") if isinstance(error, ServerError) else None
    try:
        return float(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None


def retry(
    call: Callable[[], T],
    policy: Backoff,
    *,
    what: str,
    transient: Callable[[BaseException], bool] = is_transient,
    stop: threading.Event | None = None,
    on_retry: Callable[[RetryAttempt], None] | None = None,
    sleep: Callable[[float], object] | None = None,
    rng: random.Random | None = None,
) -> T:
    """dipaco.retry.retry with the agent's transient rule and the server's Retry-After."""
    return _policy.retry(
        call,
        policy,
        what=what,
        transient=transient,
        retry_after=retry_after,
        stop=stop,
        on_retry=on_retry,
        sleep=sleep,
        rng=rng,
    )
