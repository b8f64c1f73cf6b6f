"""GET /healthz and GET /readyz: what orchestrators and load balancers probe.

- ``/healthz`` (liveness): 200 whenever this process answers HTTP; it touches no
  dependency, so a database outage never gets healthy web processes restarted.
- ``/readyz`` (readiness): 200 when the database, the Celery broker and the blob store
  all answer; otherwise 503 naming each one that does not, with why.

Neither needs a token, and neither is rate-limited or shed (dipaco_server.ratelimit and
shedding only touch the worker API and the public downloads). ``/api/v1/health`` (database
and broker) stays for docker-compose.yml's healthcheck and older probes.

Probes and scrapes name the server by whatever address they reach it at (an orchestrator
probes a container's IP, compose's Prometheus scrapes ``web:8000``), which ALLOWED_HOSTS
need not list: `HostFreeRoutes` serves these two routes and ``/metrics`` before Django's
host check (CommonMiddleware). They build no URL from the Host header, so it cannot
mislead them; every other route keeps the check.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import resolve
from django.views.decorators.http import require_safe

from dipaco import __version__
from dipaco_server.core import services


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok", "version": __version__})


@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    checks = {
        "database": services.check_database(),
        "broker": services.check_broker(),
        "blob_store": services.check_blob_store(),
    }
    failed = [name for name, check in checks.items() if not check.ok]
    body = {
        "status": "unavailable" if failed else "ok",
        "version": __version__,
        "failed": failed,
        "message": (
            f"not ready: {', '.join(failed)} did not answer (see checks)" if failed else "ready"
        ),
        "checks": {name: {"ok": c.ok, "detail": c.detail} for name, c in checks.items()},
    }
    return JsonResponse(body, status=503 if failed else 200)


HOST_FREE = frozenset({"/healthz", "/readyz", "/metrics"})


class HostFreeRoutes:
    """Serves HOST_FREE's routes without the host check or the session and auth layers."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path_info not in HOST_FREE:
            return self.get_response(request)
        match = resolve(request.path_info)  # the URL map's view (the metrics view is above core)
        request.resolver_match = match
        response: HttpResponse = match.func(request, *match.args, **match.kwargs)
        return response
