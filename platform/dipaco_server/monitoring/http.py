"""HTTP requests and their latency, by route pattern, counted by each process as it serves.

Unlike the database's figures (rounds.reports.metrics), these exist only in the memory of
the process that served the request. Two modes:

- per process (the default): each web process counts its own requests and /metrics
  answers that process's counts. Behind one address that load-balances over several
  gunicorn workers, successive scrapes see different processes: scrape each process, or
  use the next mode;
- shared (``PROMETHEUS_MULTIPROC_DIR`` set, to an empty directory every web process can
  write, before they start): prometheus_client's multiprocess mode, whose counters live in
  memory-mapped files there, and /metrics sums every process's. Empty the directory when
  the server restarts.

The route label is the URL pattern that served the request (``api/v1/runs/<int:run_id>``,
never the path itself), so it takes as many values as there are routes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve
from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess

from dipaco_server.monitoring import names

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
# Per process: our own registry (not prometheus_client's global one, which also holds the
# process and platform collectors). Multiprocess: values go to the files, read at scrape.
_registry = None if MULTIPROCESS else CollectorRegistry(auto_describe=True)
# Latency from a shed answer (about a millisecond) to a slow completion under load.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter(
    names.HTTP_REQUESTS.name,
    names.HTTP_REQUESTS.help,
    names.HTTP_REQUESTS.labels,
    registry=_registry,
)
DURATION = Histogram(
    names.HTTP_DURATION.name,
    names.HTTP_DURATION.help,
    names.HTTP_DURATION.labels,
    buckets=LATENCY_BUCKETS,
    registry=_registry,
)
SHED = Counter(names.REQUESTS_SHED.name, names.REQUESTS_SHED.help, registry=_registry)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def process_registry() -> CollectorRegistry:
    """What /metrics adds to the database's figures: this process's counts, or every
    process's in multiprocess mode."""
    if _registry is not None:
        return _registry
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


def route_of(request: HttpRequest) -> str:
    """The URL pattern of `request`; resolved here for answers given before the view's
    resolution (shed, rate-limited), "unmatched" for paths no pattern takes."""
    match = getattr(request, "resolver_match", None)
    if match is None:
        try:
            match = resolve(request.path_info)
        except Resolver404:
            return "unmatched"
    return str(match.route or "unmatched")


class RequestMetricsMiddleware:
    """Counts every answer by route, method and status, and times it by route."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        route = route_of(request)
        method = request.method if request.method in METHODS else "other"
        REQUESTS.labels(route, method, str(response.status_code)).inc()
        DURATION.labels(route).observe(time.perf_counter() - started)
        return response
