"""GET /healthz and GET /readyz: what orchestrators and load balancers probe.

- ``/healthz`` (liveness): 200 whenever this process answers HTTP; it touches no
  dependency, so a database outage never gets healthy web processes restarted.
- ``/readyz`` (readiness): 200 when the database, the Celery broker and the blob store
  all answer; otherwise 503 naming each one that does not, with why.

Neither needs a token, and neither is rate-limited or shed (dipaco_server.ratelimit and
shedding only touch the worker API and the public downloads). ``/api/v1/health`` (database
and broker) stays for docker-compose.yml's healthcheck and older probes.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
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
