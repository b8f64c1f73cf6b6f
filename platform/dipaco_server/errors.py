"""The one error shape of every API, and the mapping from exceptions to it.

Every refusal is JSON ``{"error": {"code": ..., "message": ...}}`` with a 4xx
status, plus ``"details"`` inside ``error`` when there is more to say (config
problems, allowed moves, validation errors). ``code`` is stable and part of the
API contract; ``message`` is for a person and says what to do. Client faults
are never 500: malformed JSON, missing fields, unknown routes, wrong methods,
bodies over the limit and auth failures all land here. A 500 means a bug; it
is logged with its traceback and answered in the same shape.

`ServiceError` is the base of every app's errors (runs.errors, workers.errors, the
accounts services): this module is at the bottom of the server's layers and imports no
app. `install(api)` registers the handlers on a NinjaAPI; `error_response` is the
helper everything else (the blob views too) builds its errors with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any, ClassVar

from django.core.exceptions import RequestDataTooBig
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DataError, InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, AuthorizationError, HttpError, ValidationError
from ninja.parser import Parser

from dipaco_server.http_limits import REQUEST_LINE_LIMIT  # gunicorn's

logger = logging.getLogger(__name__)

# JSON bodies of this API are small (the largest, a completion, is a few KiB); Django's
# DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MiB) stops anything bigger before it is read.
MAX_JSON_BODY_BYTES = 256 * 1024
MAX_ERRORS_LISTED = 20  # validation errors echoed in one response

# A code for statuses that reach us without one (ninja's HttpError, Django responses).
STATUS_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "too_many_requests",
}


class ServiceError(Exception):
    """What a service raises on purpose; every app's errors subclass it.

    ``code`` is stable and part of the API contract, ``status`` is the HTTP status (client
    faults are 4xx, never 500), ``details`` is JSON; the message is for a person and says
    what to do. `install` answers it in the one error shape. Anything else a service raises
    is a bug (a 500).
    """

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 400

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class ApiError(Exception):
    """An API-level refusal (not a service's): raise it from a view or an auth check."""

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details


def error_response(
    status: int, code: str, message: str, details: Mapping[str, Any] | None = None
) -> JsonResponse:
    """The one error body: ``{"error": {"code", "message"[, "details"]}}``."""
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = dict(details)
    return JsonResponse({"error": body}, status=status, encoder=DjangoJSONEncoder)


class SizeLimitedParser(Parser):
    """ninja's JSON parser, refusing bodies over MAX_JSON_BODY_BYTES and saying why JSON fails."""

    def parse_body(self, request: HttpRequest) -> Any:
        declared = request.META.get("CONTENT_LENGTH") or ""
        too_long = declared.isdigit() and int(declared) > MAX_JSON_BODY_BYTES
        if too_long or len(request.body) > MAX_JSON_BODY_BYTES:
            raise _too_large()
        try:
            parsed = json.loads(request.body)
        except UnicodeDecodeError:
            raise ApiError(400, "malformed_json", "the body is not UTF-8 encoded JSON") from None
        except json.JSONDecodeError as exc:
            raise ApiError(
                400,
                "malformed_json",
                f"the body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
            ) from None
        if not isinstance(parsed, dict):
            # Every JSON body of this API is an object; ninja would read fields off a list.
            raise ApiError(
                422,
                "invalid_request",
                f"the body is a JSON {type(parsed).__name__}; send a JSON object",
            )
        return parsed


def _too_large() -> ApiError:
    return ApiError(
        413, "body_too_large", f"the request body exceeds {MAX_JSON_BODY_BYTES} bytes; send less"
    )


# --- exception handlers ------------------------------------------------------------------


def _service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    return error_response(exc.status, exc.code, exc.message, exc.details)


def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return error_response(exc.status, exc.code, exc.message, exc.details)


def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    # ninja wraps whatever the body parser raised in HttpError(400): answer with the cause.
    cause = exc.__cause__
    if isinstance(cause, ApiError):
        return _api_error(request, cause)
    if isinstance(cause, RequestDataTooBig):
        return _api_error(request, _too_large())
    if isinstance(exc, AuthenticationError):
        return error_response(
            401,
            "unauthenticated",
            "send a token in the header 'Authorization: Bearer <token>'",
        )
    if isinstance(exc, AuthorizationError):
        return error_response(403, "forbidden", str(exc))
    status = exc.status_code
    return error_response(status, STATUS_CODES.get(status, f"http_{status}"), str(exc))


def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    errors = [
        {"loc": _location(e.get("loc", ())), "msg": str(e.get("msg", ""))}
        for e in exc.errors[:MAX_ERRORS_LISTED]
    ]
    listed = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors)
    return error_response(
        422,
        "invalid_request",
        f"the request does not match the schema: {listed}",
        {"errors": errors},
    )


def _location(loc: Any) -> list[str]:
    """ninja's (source, parameter, field...) without the parameter name of a body schema,
    which means nothing to a client: ("body", "body", "name") -> ["body", "name"]."""
    parts = [str(part) for part in loc]
    if len(parts) > 2 and parts[0] == "body":
        del parts[1]
    return parts


def _too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return _api_error(request, _too_large())


def _out_of_range(request: HttpRequest, exc: DataError) -> HttpResponse:
    # The database refused a value the schema let through: a number past its column's range
    # (an id or offset of 10**20) or text past its length. The client sent it, so a 422 that
    # names the problem; logged, in case a value the server computed is ever the cause.
    logger.warning(
        "%s %s: the database refused a value", request.method, request.path, exc_info=exc
    )
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "a value is out of range"
    return error_response(
        422,
        "value_out_of_range",
        f"a value in the request is beyond what the server stores ({reason}); "
        "send smaller numbers or shorter text",
    )


def _bad_multipart(request: HttpRequest, exc: MultiPartParserError) -> HttpResponse:
    return error_response(
        400,
        "malformed_multipart",
        f"the multipart body cannot be read ({exc}); send multipart/form-data with a boundary, "
        "as curl -F or requests' files= do",
    )


def _database_down(request: HttpRequest, exc: Exception) -> HttpResponse:
    # The database is unreachable (restarting, failing over): not a bug and not the client's
    # fault, so a 503 with Retry-After that agents and scripts retry, never a 500.
    logger.warning("%s %s: the database is unreachable: %s", request.method, request.path, exc)
    response = error_response(
        503,
        "database_unavailable",
        "the server cannot reach its database right now; retry in a few seconds",
    )
    response["Retry-After"] = "5"
    return response


def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return not_found(request)


def _bug(request: HttpRequest, exc: Exception) -> HttpResponse:
    logger.error("%s %s failed", request.method, request.path, exc_info=exc)
    return error_response(
        500, "internal_error", "the server failed to answer; this is a bug, it has been logged"
    )


def install(api: NinjaAPI) -> None:
    """Answer every error `api` raises in the one shape (replaces ninja's defaults)."""
    api.add_exception_handler(ServiceError, _service_error)
    api.add_exception_handler(ApiError, _api_error)
    api.add_exception_handler(HttpError, _http_error)
    api.add_exception_handler(ValidationError, _validation_error)
    api.add_exception_handler(RequestDataTooBig, _too_big)
    api.add_exception_handler(MultiPartParserError, _bad_multipart)
    api.add_exception_handler(DataError, _out_of_range)
    api.add_exception_handler(OperationalError, _database_down)
    api.add_exception_handler(InterfaceError, _database_down)
    api.add_exception_handler(Http404, _not_found)
    api.add_exception_handler(Exception, _bug)


# --- the shape in the OpenAPI schema -----------------------------------------------------

ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "description": "Stable, e.g. lease_expired."},
                "message": {"type": "string", "description": "What went wrong and what to do."},
                "details": {"type": "object", "description": "More, by code (e.g. problems)."},
            },
        }
    },
}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the error shape to an OpenAPI schema as every operation's 4XX answer."""
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    answer = {
        "description": "A client fault, in the one error shape",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    too_long = {
        "description": f"The request line (path and query) is over {REQUEST_LINE_LIMIT} bytes: "
        "gunicorn refuses it before the application, with its own HTML page",
        "content": {"text/html": {"schema": {"type": "string"}}},
    }
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.setdefault("4XX", answer)
            responses.setdefault("414", too_long)
    return schema


# --- plain Django views under the API's prefix ------------------------------------------


@csrf_exempt  # any method gets the JSON 404, not the CSRF middleware's 403 page
def not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """JSON 404 for a path no route matches (mounted as the API's last URL pattern)."""
    return error_response(
        404,
        "not_found",
        f"no API route at {request.path}; the routes are listed at /api/v1/docs",
    )


def json_errors(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Wrap a ninja URL view so the few answers ninja builds itself come back as JSON too.

    Those are 405 for a known path with another method (ninja answers plain text)
    and 404 from the API root (ninja raises Http404 there).
    """

    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            response = view(request, *args, **kwargs)
        except Http404:
            return not_found(request)
        if response.status_code == 405 and "json" not in response.get("Content-Type", ""):
            allowed = response.get("Allow", "")
            json_response = error_response(
                405,
                "method_not_allowed",
                f"{request.method} is not allowed on {request.path}; use {allowed}",
            )
            json_response["Allow"] = allowed
            return json_response
        return response

    return wrapped
