"""Rate limits on the worker API: per worker token and per client address.

Every request under WORKER_API_PREFIX (the lease routes, heartbeats and the enrollment
endpoint ``/worker/register``) counts against two fixed windows: one keyed by the
bearer token it carries (hashed, never stored) and one by its client address. The
limits are ``DIPACO_RATE_LIMIT_WORKER`` and ``DIPACO_RATE_LIMIT_ADDRESS`` (env.py;
``off`` disables one). Over a limit, the answer is 429 in the one error shape, naming
the limit and its variable, with a ``Retry-After`` header the worker agent honours.

The counters live in the ``ratelimit`` cache (settings.CACHES): Redis when REDIS_URL is
set, so every web process shares them, else this process's memory (the embedded server;
each process then counts on its own). Django's cache API suffices for a fixed window,
``add`` then ``incr``, so no extra library: django-ratelimit wraps views with
decorators, answers 403 without a Retry-After, and raises on an unreachable Redis.

The limiter fails open: when the cache does not answer (Redis down or unreachable),
requests pass unlimited and a warning is logged, at most once per FAIL_OPEN_PAUSE_S;
during that pause the cache is not asked again, so a dead Redis adds no latency.
Rate limiting protects the service, and a worker API that answered 500 while Redis is
away would do the opposite.

The public endpoints that cost the server CPU or bandwidth, routing a text
(``POST /api/v1/runs/{id}/route``), generating text (``POST .../generate``) and a
path's downloads (its manifest, zip and files), answer anyone while DIPACO_PUBLIC_READ is on; they count per client address against
``DIPACO_RATE_LIMIT_PUBLIC`` (default 120/min), in the same way and the same shape.

A middleware rather than a ninja decorator: it covers every worker route, including
unknown ones and those refused by auth, and it runs before authentication queries the
database, so a flood costs one cache round trip per request.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.base import BaseCache
from django.core.cache.backends.redis import RedisCache
from django.http import HttpRequest, HttpResponse
from redis.exceptions import RedisError

from dipaco_server.errors import error_response

logger = logging.getLogger(__name__)

WORKER_API_PREFIX = "/api/v1/worker/"
# Public routes that cost CPU (routing runs the router) or bandwidth (a path's weights).
PUBLIC_COSTLY = re.compile(
    r"^/api/v1/runs/[^/]+/(?:route|generate|paths/[^/]+/(?:manifest|download|files/[^/]*))/?$"
)
CACHE_ALIAS = "ratelimit"
FAIL_OPEN_PAUSE_S = 30.0


@dataclass(frozen=True)
class Limit:
    """One limit: what it counts (``worker`` or ``address``), its variable and its rate."""

    kind: str
    variable: str
    requests: int
    seconds: int

    def describe(self) -> str:
        return f"{self.requests} requests per {self.seconds} s"


@dataclass(frozen=True)
class Refusal:
    limit: Limit
    retry_after_s: int


def _bearer(request: HttpRequest) -> str | None:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _address(request: HttpRequest) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


def _public_limits_for(request: HttpRequest) -> list[tuple[Limit, str]]:
    """The public-endpoint limit (per address) when `request` is one of PUBLIC_COSTLY."""
    rate = settings.DIPACO_RATE_LIMIT_PUBLIC
    if rate is None or not PUBLIC_COSTLY.match(request.path):
        return []
    return [(Limit("public", "DIPACO_RATE_LIMIT_PUBLIC", *rate), _address(request))]


def _limits_for(request: HttpRequest) -> list[tuple[Limit, str]]:
    """(limit, counter key) pairs that apply to `request`; settings are read per call."""
    if not request.path.startswith(WORKER_API_PREFIX):
        return _public_limits_for(request)
    pairs: list[tuple[Limit, str]] = []
    address_rate = settings.DIPACO_RATE_LIMIT_ADDRESS
    if address_rate is not None:
        pairs.append(
            (Limit("address", "DIPACO_RATE_LIMIT_ADDRESS", *address_rate), _address(request))
        )
    token = _bearer(request)
    worker_rate = settings.DIPACO_RATE_LIMIT_WORKER
    if worker_rate is not None and token is not None:
        digest = hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()[:32]
        pairs.append((Limit("worker", "DIPACO_RATE_LIMIT_WORKER", *worker_rate), digest))
    return pairs


def _count(limit: Limit, key: str, now: float) -> tuple[int, int]:
    """Count one request in the current window: (requests so far, seconds until it ends).

    The key names its window, and lives one second past it, so ``incr`` never meets an
    expired key within its window (which Django's Redis ``incr`` would refuse).
    """
    cache = caches[CACHE_ALIAS]
    window = int(now // limit.seconds)
    full_key = f"{limit.kind}:{key}:{limit.seconds}:{window}"
    timeout = limit.seconds + 1
    client = _redis_client(cache)
    if client is not None:
        # One round trip instead of two: create the counter if new, then count.
        pipe = client.pipeline(transaction=False)
        pipe.set(cache.make_and_validate_key(full_key), 0, ex=timeout, nx=True)
        pipe.incr(cache.make_and_validate_key(full_key))
        count = int(pipe.execute()[1])
    elif cache.add(full_key, 1, timeout=timeout):
        count = 1
    else:
        try:
            count = cache.incr(full_key)
        except ValueError:  # evicted meanwhile (the local cache culls when full)
            cache.add(full_key, 1, timeout=timeout)
            count = 1
    remaining = (window + 1) * limit.seconds - now
    return count, max(1, math.ceil(remaining))


def _redis_client(cache: BaseCache) -> Any:
    """The Redis client under Django's Redis cache, made once per cache object, or None.

    Django's RedisCache builds a client object for every operation (a third of a
    millisecond each, most of it filling redis-py's callback table); the limiter runs
    on every worker request, so it keeps one (connections still come from the cache's
    pool) and sends its two commands as one pipeline.
    """
    if not isinstance(cache, RedisCache):
        return None
    client = cache.__dict__.get("_dipaco_ratelimit_client")
    if client is None:
        client = cache._cache.get_client(write=True)
        cache.__dict__["_dipaco_ratelimit_client"] = client
    return client


class RateLimiter:
    """Counts worker API and costly public requests and says which limit, if any, a request is over."""

    def __init__(self) -> None:
        self._paused_until = 0.0

    def check(self, request: HttpRequest) -> Refusal | None:
        """The first limit `request` exceeds, or None; None too when the cache is away."""
        if time.monotonic() < self._paused_until:
            return None
        now = time.time()
        try:
            for limit, key in _limits_for(request):
                count, retry_after = _count(limit, key, now)
                if count > limit.requests:
                    return Refusal(limit, retry_after)
        except (RedisError, OSError) as exc:
            self._paused_until = time.monotonic() + FAIL_OPEN_PAUSE_S
            logger.warning(
                "rate limits are off for %.0f s: the rate-limit cache does not answer (%s); "
                "check REDIS_URL and that Redis runs",
                FAIL_OPEN_PAUSE_S,
                exc,
            )
        return None


def too_many_requests(refusal: Refusal) -> HttpResponse:
    """429 in the one error shape, naming the limit, with Retry-After."""
    limit = refusal.limit
    counted = "worker token" if limit.kind == "worker" else "client address"
    response = error_response(
        429,
        "rate_limited",
        f"too many requests from this {counted}: the limit is {limit.describe()} "
        f"({limit.variable}); wait {refusal.retry_after_s} s as Retry-After says, "
        "then send fewer requests, or ask the operator to raise the limit",
        {
            "limit": limit.kind,
            "variable": limit.variable,
            "requests": limit.requests,
            "period_s": limit.seconds,
            "retry_after_s": refusal.retry_after_s,
        },
    )
    response["Retry-After"] = str(refusal.retry_after_s)
    return response


class RateLimitMiddleware:
    """Refuses worker API and costly public requests over a limit with 429 before any view or auth runs."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.limiter = RateLimiter()

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith(WORKER_API_PREFIX) or PUBLIC_COSTLY.match(request.path):
            refusal = self.limiter.check(request)
            if refusal is not None:
                return too_many_requests(refusal)
        return self.get_response(request)
