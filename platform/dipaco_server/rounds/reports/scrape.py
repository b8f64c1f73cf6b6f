"""GET /metrics: the platform's state in Prometheus' text format (monitoring.names lists
it), and who may scrape it: the figures name runs and count workers, so not anyone.

One answer holds the database's figures (rounds.reports.metrics, the same from every
process) and this process's HTTP counts (monitoring.http), or every process's in
multiprocess mode.

A scrape is served when any of these holds:

- it comes from an address in ``DIPACO_METRICS_ALLOW`` (the connecting address,
  REMOTE_ADDR: behind a proxy that is the proxy's, so list the Prometheus host only where
  it connects directly);
- it sends ``Authorization: Bearer <DIPACO_METRICS_TOKEN>``;
- it sends a staff API token (``dipaco admin token create``).

Anything else is refused in the API's error shape: 401 without a token, 401 or 403 with a
token that is not one of those; the message names both variables.

With the database down, a scrape with DIPACO_METRICS_TOKEN is still answered: each part
of the database's figures that fails is left out and counted in
``dipaco_scrape_errors_total`` (the DipacoScrapeIncomplete alert), the HTTP counts stay.
"""

from __future__ import annotations

import hmac
import ipaddress

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from dipaco_server.accounts.services import authenticate_staff
from dipaco_server.errors import ServiceError, error_response
from dipaco_server.monitoring import http
from dipaco_server.rounds.reports.metrics import DatabaseCollector

HOW = (
    "send Authorization: Bearer with the token in DIPACO_METRICS_TOKEN (or a staff token "
    "from 'dipaco admin token create'), or scrape from an address listed in "
    "DIPACO_METRICS_ALLOW"
)


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def allowed_address(request: HttpRequest) -> bool:
    networks = settings.DIPACO_METRICS_ALLOW
    if not networks:
        return False
    try:
        address = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    return any(address in network for network in networks)


def refusal(request: HttpRequest) -> HttpResponse | None:
    """None when `request` may scrape; otherwise the answer that says how to."""
    if allowed_address(request):
        return None
    token = _bearer(request)
    if token is None:
        return error_response(401, "metrics_unauthenticated", f"/metrics is not public: {HOW}")
    expected = settings.DIPACO_METRICS_TOKEN
    if expected is not None and hmac.compare_digest(token.encode(), expected.encode()):
        return None
    try:
        authenticate_staff(token)
    except ServiceError as exc:
        return error_response(
            exc.status, "metrics_forbidden", f"this token may not scrape /metrics ({exc}): {HOW}"
        )
    except DatabaseError:
        return error_response(
            503,
            "database_unavailable",
            "the database does not answer, so a staff token cannot be checked; scrape with "
            "DIPACO_METRICS_TOKEN, which needs no database (GET /readyz says what is down)",
        )
    return None


_database = DatabaseCollector()


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """The text format 0.0.4, which every Prometheus reads (no content negotiation: the
    OpenMetrics format would gain nothing here)."""
    refused = refusal(request)
    if refused is not None:
        return refused
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_database)
    registry.register(http.process_registry())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_PLAIN_0_0_4)
