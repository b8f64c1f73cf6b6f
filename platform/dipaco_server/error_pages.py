"""The site's error answers: 404, 403, 500 and CSRF failures, and the favicon.

Here, below the URL map (dipaco_server.urls) that names them, rather than in the dashboard
package whose page template and icon they use (``dipaco_web/error.html``, found by
Django's template loader, and ``dipaco_web/favicon.ico``, by the static files finders), so
that the URL map imports nothing above it (tests/test_layers.py).

Under /api/ (and /blobs/, whose views answer JSON too) every error is the API's one
shape (dipaco_server.errors.error_response), whatever the method: a POST to an unknown
API path is a JSON 404, never a CSRF page. Everywhere else a person gets a page of the
dashboard, with its navigation, that says what happened and where to go. None of them
shows a path on the server, a host name or a stack: a 500 is logged with its traceback
and answered with a line.
"""

from __future__ import annotations

import logging
from typing import Any

from django.contrib.staticfiles import finders
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.html import escape

from dipaco import __version__
from dipaco_server.errors import STATUS_CODES, error_response

logger = logging.getLogger(__name__)

JSON_PREFIXES = ("/api/", "/blobs/")
FAVICON = "dipaco_web/favicon.ico"  # a static file of the dashboard: favicon.svg, 32 px

# (title, what to do) per status, for a person.
PAGES = {
    403: ("Not allowed", "This page or action is for staff. Sign in with a staff account."),
    404: ("Page not found", "There is no page at this address. The runs list is a good start."),
    500: ("Something went wrong", "The server failed to answer this page; the failure is "
          "logged. Try again in a moment."),
}  # fmt: skip
API_MESSAGES = {
    403: "not allowed: this needs a staff or worker token with the right scope",
    404: "no API route at this address; the routes are listed at /api/v1/docs",
    500: "the server failed to answer; this is a bug, it has been logged",
}


def wants_json(request: HttpRequest) -> bool:
    return request.path.startswith(JSON_PREFIXES) or request.path == "/api"


def _answer(request: HttpRequest, status: int, reason: str = "") -> HttpResponse:
    if wants_json(request):
        message = API_MESSAGES[status]
        if status == 404:
            message = f"no API route at {request.path}; the routes are listed at /api/v1/docs"
        return error_response(status, STATUS_CODES.get(status, "internal_error"), message)
    title, hint = PAGES[status]
    context: dict[str, Any] = {"status": status, "title": title, "hint": hint,
                               "reason": reason, "nav": "", "version": __version__}  # fmt: skip
    try:
        return render(request, "dipaco_web/error.html", context, status=status)
    except Exception:  # the page itself failed (its database is down): a bare line
        logger.exception("the %s page could not be drawn", status)
        body = f"<!DOCTYPE html><title>{status}</title><h1>{escape(title)}</h1><p>{escape(hint)}"
        return HttpResponse(body, status=status)


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return _answer(request, 404)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    # A PermissionDenied raised by the dashboard says what to do ("sign in with a staff
    # account"): those texts are written for people and name nothing on the server.
    reason = str(exception) if exception is not None and str(exception) else ""
    return _answer(request, 403, reason)


def server_error(request: HttpRequest) -> HttpResponse:
    return _answer(request, 500)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: a dashboard form that lost its token says to reload the page.
    The API needs no CSRF token (its routes, and its JSON 404 for unknown paths, are
    exempt), so a refusal there is only a fallback, in the API's shape."""
    if wants_json(request):
        return error_response(403, "forbidden", "refused: the request's CSRF check failed")
    return _answer(request, 403, "the form's CSRF token is missing or out of date (the form "
                   "expired, or came from another site): reload the page and send it again")  # fmt: skip


def favicon(request: HttpRequest) -> FileResponse:
    """/favicon.ico, which browsers and feed readers ask for whatever the page links."""
    found = finders.find(FAVICON)
    if not isinstance(found, str):  # the dashboard app is not installed
        raise Http404("no favicon")
    # FileResponse closes the file once it is sent.
    response = FileResponse(open(found, "rb"), content_type="image/x-icon")  # noqa: SIM115
    response["Cache-Control"] = "public, max-age=86400"
    return response
