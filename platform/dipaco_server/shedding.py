"""Load shedding: new work that waited too long for a thread is told to come back later.

When more requests arrive than the web processes serve (docs/deploy.md, "Limits"), they
queue for a thread. Served in order, each then waits longer than the last until requests
outlive their clients' time-out and are served for nobody, and every retry adds to the
queue: the server stays busy and the volunteers get nothing. This middleware keeps the
queue short instead. A request that waited longer than ``DIPACO_SHED_AFTER_S`` (default
5 s; ``off`` disables) for a thread (dipaco_server.web_worker measures it) and asks for
*new* work is answered at once with ``503 overloaded`` and a jittered ``Retry-After``,
which the agent honours. Shedding costs about a tenth of serving, so the queue drains.

What is shed: a lease request, a heartbeat of a worker without a lease, an enrolment.
Work in hand is never shed: heartbeats with a lease, upload URLs, manifests,
completions and releases are served however long they waited, so overload delays
volunteers' work but does not lose it. The admin API, the dashboard and the public
reads are not shed either (the public reads have their own rate limit).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from dipaco_server.errors import error_response
from dipaco_server.monitoring.http import SHED
from dipaco_server.ratelimit import WORKER_API_PREFIX
from dipaco_server.web_worker import queued_s

logger = logging.getLogger(__name__)

# Requests that ask for new work: (method, path without a trailing slash).
SHEDDABLE = frozenset(
    {
        ("POST", f"{WORKER_API_PREFIX}lease"),
        ("POST", f"{WORKER_API_PREFIX}heartbeat"),  # only without a lease: see is_sheddable
        ("POST", f"{WORKER_API_PREFIX}register"),
    }
)
LEASE_SECRET_META = "HTTP_X_LEASE_SECRET"
MAX_RETRY_AFTER_S = 60
LOG_EVERY_S = 10.0


def is_sheddable(request: HttpRequest) -> bool:
    """Whether `request` asks for new work (and may be answered "come back later")."""
    if (request.method, request.path.rstrip("/")) not in SHEDDABLE:
        return False
    # A heartbeat that carries its lease's secret keeps work in hand alive.
    return not request.META.get(LEASE_SECRET_META)


def retry_after_s(waited_s: float, rng: random.Random | random.SystemRandom) -> int:
    """Seconds to come back after: uniform over [waited, 2 x waited], 1 to 60.

    The queue that made this request wait takes about as long to drain; the jitter spreads
    the shed requests' returns over as long again, so they do not come back as one wave."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(rng.uniform(waited_s, 2 * waited_s))))


def overloaded(waited_s: float, limit_s: float, retry_after: int) -> HttpResponse:
    response = error_response(
        503,
        "overloaded",
        f"the server is overloaded: this request waited {waited_s:.1f} s for a thread "
        f"(more than DIPACO_SHED_AFTER_S={limit_s:g}); ask again in {retry_after} s as "
        "Retry-After says (dipaco-worker does); an operator adds web processes or machines "
        "(docs/deploy.md)",
        {"waited_s": round(waited_s, 3), "retry_after_s": retry_after},
    )
    response["Retry-After"] = str(retry_after)
    # Django logs every 5xx as an error with its request; under overload that is a log line
    # per shed request. The middleware logs a summary every LOG_EVERY_S instead.
    response._has_been_logged = True  # type: ignore[attr-defined]  # django.utils.log
    return response


def document_shedding(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the 503 a shed request gets to the OpenAPI operations that may be shed."""
    answer = {
        "description": "Overloaded: this request for new work waited longer than "
        "DIPACO_SHED_AFTER_S for a web thread; ask again after the Retry-After header's "
        "seconds (dipaco-worker does). Work in hand is never shed.",
        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    paths = schema.get("paths", {})
    for method, path in SHEDDABLE:
        operation = paths.get(path, {}).get(method.lower())
        if operation is not None:
            operation.setdefault("responses", {}).setdefault("503", answer)
    return schema


class LoadSheddingMiddleware:
    """Answers 503 overloaded, before auth and rate limits, to new work queued too long."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.rng = random.Random()
        self.shed = 0
        self._logged_at = -math.inf

    def __call__(self, request: HttpRequest) -> HttpResponse:
        waited, limit = queued_s(), settings.DIPACO_SHED_AFTER_S
        if waited is None or limit is None or waited <= limit or not is_sheddable(request):
            return self.get_response(request)
        self.shed += 1
        SHED.inc()  # dipaco_requests_shed_total
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            logger.warning(
                "overloaded: shed %d request(s) for new work so far in this process; the "
                "last waited %.1f s for a thread (DIPACO_SHED_AFTER_S=%g)",
                self.shed,
                waited,
                limit,
            )
        return overloaded(waited, limit, retry_after_s(waited, self.rng))
