"""Writing the audit log: `audited` for admin API views, `record` for everything else.

An admin action is logged whether it succeeds or is refused (any 4xx the view raises,
e.g. a move the run's state does not allow): a refused attempt says as much about
intent as a successful one. Requests that fail before the view runs (a bad token, a
body that does not match the schema) are not admin actions yet and are not logged.

Parameters are the request's path and body values, with anything named like a secret
replaced by "***"; the plaintext tokens the create endpoints answer are never logged,
since only the request is. A failure to write the log is logged as an error and does
not change the answer: the action has already happened.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any, TypeVar, cast

from django.core.exceptions import RequestDataTooBig
from django.db import DataError, InterfaceError, OperationalError, transaction
from django.http import Http404, HttpRequest
from django.http.multipartparser import MultiPartParserError
from ninja.errors import AuthenticationError, AuthorizationError, HttpError, ValidationError
from ninja.responses import Status
from pydantic import BaseModel

from dipaco_server.accounts.models import ApiToken
from dipaco_server.audit.models import AuditEntry
from dipaco_server.core import tokens
from dipaco_server.errors import STATUS_CODES, ApiError, ServiceError

logger = logging.getLogger(__name__)

View = TypeVar("View", bound=Callable[..., Any])
SECRET_WORDS = ("token", "secret", "password", "passwd", "credential")
# Keys that hold a word of SECRET_WORDS and no secret (a dataset's budget of tokens).
NOT_SECRET = frozenset({"token_budget"})
MAX_MESSAGE = 2000


def redact(value: Any) -> Any:
    """`value` as JSON-ready data with the values of secret-looking keys replaced, and every
    string `storable`."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return {storable(str(k)): "***" if _secret(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON (and jsonb) hold no inf or NaN: a refused config sent one
    if value is None or isinstance(value, int | float | bool):
        return value
    return storable(str(value))


def _secret(key: str) -> bool:
    name = key.lower()
    return name not in NOT_SECRET and any(w in name for w in SECRET_WORDS)


def storable(value: str) -> str:
    """`value` as PostgreSQL stores it: a NUL character, which no text or jsonb value may
    hold, and a lone surrogate, which is no Unicode text, become U+FFFD.

    A refused request is logged with what it sent, and what it sent is untrusted: without
    this, one such character in a body made the audit entry's write fail (schemathesis
    found it), and the entry was lost."""
    if value.isascii() and "\x00" not in value:
        return value
    return "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in value)


def client_address(request: HttpRequest) -> str | None:
    """REMOTE_ADDR when it is an IP address (behind a proxy: the proxy's address)."""
    raw = request.META.get("REMOTE_ADDR") or ""
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return None


def _api_token_id(request: HttpRequest) -> int | None:
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    digest = tokens.hash_token(token.strip())
    return ApiToken.objects.filter(token_hash=digest).values_list("pk", flat=True).first()


def record(
    request: HttpRequest,
    action: str,
    *,
    channel: str,
    user: Any,
    target_type: str = "",
    target_id: Any = None,
    params: Mapping[str, Any] | None = None,
    status: int = 200,
    error_code: str = "",
    message: str = "",
) -> AuditEntry | None:
    """Append one entry; None (and an error in the log) when the database refuses it."""
    if status < 400:
        outcome = AuditEntry.Outcome.OK
    elif status < 500:
        outcome = AuditEntry.Outcome.REFUSED
    else:
        outcome = AuditEntry.Outcome.FAILED
    authenticated = user is not None and getattr(user, "is_authenticated", False)
    try:
        # A savepoint: a refused write leaves the caller's transaction usable.
        with transaction.atomic():
            return AuditEntry.objects.create(
                actor=user.get_username() if authenticated else "anonymous",
                actor_id=user.pk if authenticated else None,
                channel=channel,
                api_token_id=_api_token_id(request) if channel == AuditEntry.Channel.API else None,
                action=action,
                target_type=target_type,
                target_id="" if target_id is None else storable(str(target_id)[:64]),
                params=redact(dict(params or {})),
                address=client_address(request),
                outcome=outcome,
                status=status,
                error_code=storable(error_code[:64]),
                message=storable(message[:MAX_MESSAGE]),
            )
    except Exception:
        logger.exception("could not write the audit entry for %s on %s", action, target_id)
        return None


def _refusal(exc: Exception) -> tuple[int, str, str]:
    """(status, code, message) of the answer the client gets for `exc`: the same as the
    handlers errors.install registers give, so the log says what the client saw (a
    database range error is the client's 422, not a 500: fuzzing the API found five such)."""
    if isinstance(exc, ServiceError | ApiError):
        return exc.status, exc.code, exc.message
    if isinstance(exc, AuthenticationError):
        return 401, "unauthenticated", str(exc)
    if isinstance(exc, AuthorizationError):
        return 403, "forbidden", str(exc)
    if isinstance(exc, HttpError):
        cause = exc.__cause__
        if isinstance(cause, ApiError):
            return cause.status, cause.code, cause.message
        status = 413 if isinstance(cause, RequestDataTooBig) else exc.status_code
        return status, STATUS_CODES.get(status, f"http_{status}"), str(exc)
    if isinstance(exc, ValidationError):
        return 422, "invalid_request", "the request does not match the schema"
    if isinstance(exc, DataError):
        return 422, "value_out_of_range", str(exc).strip().split("\n")[0]
    if isinstance(exc, RequestDataTooBig):
        return 413, "body_too_large", str(exc)
    if isinstance(exc, MultiPartParserError):
        return 400, "malformed_multipart", str(exc)
    if isinstance(exc, OperationalError | InterfaceError):
        return 503, "database_unavailable", str(exc)
    if isinstance(exc, Http404):
        return 404, "not_found", str(exc)
    return 500, "internal_error", type(exc).__name__


def _result_id(result: Any) -> Any:
    value = result.value if isinstance(result, Status) else result
    if isinstance(value, Mapping):
        return value.get("id")
    return getattr(value, "pk", None)


def audited(
    action: str, target_type: str = "", id_parameter: str | None = None
) -> Callable[[View], View]:
    """Log every call of an admin API view as `action` on a `target_type` object.

    The target's id is the view's `id_parameter` (default ``<target_type>_id``), or for a create
    the id of the object it answers. Put it under the router decorator, so ninja reads
    the view's own signature (through ``__wrapped__``).
    """

    def decorate(view: View) -> View:
        parameter = id_parameter or f"{target_type}_id"

        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            audit: dict[str, Any] = {
                "channel": AuditEntry.Channel.API,
                "user": getattr(request, "auth", None),
                "target_type": target_type,
                "params": kwargs,
            }
            try:
                result = view(request, *args, **kwargs)
            except Exception as exc:
                status, code, message = _refusal(exc)
                target = kwargs.get(parameter)
                record(request, action, target_id=target, status=status, error_code=code,
                       message=message, **audit)  # fmt: skip
                raise
            status = result.status_code if isinstance(result, Status) else 200
            target = kwargs.get(parameter, _result_id(result))
            record(request, action, target_id=target, status=status, **audit)
            return result

        return cast(View, wrapper)

    return decorate
