"""HMAC-signed, expiring URLs for the local blob store.

A URL carries ``expires`` (Unix seconds), ``max_bytes`` (uploads only) and
``signature``: an HMAC-SHA256, keyed by a key derived from SECRET_KEY, over
the method, the key, the expiry and the size limit. Changing any of them,
using the URL with another method, or signing with another SECRET_KEY makes
the signature fail. Like S3, the URL is a bearer credential until it expires.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from django.utils.crypto import constant_time_compare, salted_hmac

_SALT = "dipaco_server.storage.local.url"
SIGNED_METHODS = ("GET", "PUT", "POST")


class UrlRefused(Exception):
    """A signed URL that does not authorise this request (HTTP 403)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def sign(secret: str, method: str, key: str, expires_at: int, max_bytes: int | None) -> str:
    limit = "" if max_bytes is None else str(max_bytes)
    value = f"{method}\n{key}\n{expires_at}\n{limit}"
    return str(salted_hmac(_SALT, value, secret=secret, algorithm="sha256").hexdigest())


def query_for(
    secret: str, method: str, key: str, expires_at: int, max_bytes: int | None
) -> dict[str, str]:
    """The query parameters that authorise `method` on `key` until `expires_at`."""
    query = {"expires": str(expires_at)}
    if max_bytes is not None:
        query["max_bytes"] = str(max_bytes)
    query["signature"] = sign(secret, method, key, expires_at, max_bytes)
    return query


def verify(secret: str, method: str, key: str, query: Mapping[str, str]) -> int | None:
    """Check a request's query against its method and key; return its max_bytes.

    Raises UrlRefused when a parameter is missing or malformed, the signature
    does not match, or the URL has expired. The signature is checked before the
    expiry so a forged URL never learns whether its expiry would have passed.
    """
    signature = query.get("signature")
    expires = query.get("expires")
    if not signature or not expires:
        raise UrlRefused(
            "signature_missing",
            "this URL carries no signature; ask the server for a fresh presigned URL",
        )
    raw_limit = query.get("max_bytes")
    uploads = method in ("PUT", "POST")
    if uploads != (raw_limit is not None) or not expires.isdigit():
        raise UrlRefused("signature_invalid", "the URL's parameters are malformed")
    if raw_limit is not None and not raw_limit.isdigit():
        raise UrlRefused("signature_invalid", "the URL's max_bytes is malformed")
    expires_at = int(expires)
    max_bytes = None if raw_limit is None else int(raw_limit)
    expected = sign(secret, method, key, expires_at, max_bytes)
    if not constant_time_compare(expected, signature):
        raise UrlRefused(
            "signature_invalid",
            f"the signature does not match this {method} of this key; "
            "use the URL exactly as the server issued it, with the method it was issued for",
        )
    if expires_at < time.time():
        raise UrlRefused("url_expired", "this URL has expired; ask the server for a fresh one")
    return max_bytes
