"""Password sign-in throttling: repeated wrong passwords lock the account and the address out.

Every password sign-in (the dashboard's login page, the Django admin's) goes through
``django.contrib.auth.authenticate`` and so through `ThrottledModelBackend`, the only
entry in settings.AUTHENTICATION_BACKENDS. Each failure (Django's ``user_login_failed``
signal) counts in the ``ratelimit`` cache (Redis when REDIS_URL is set, so every web
process shares it) against two fixed windows of ``SIGNIN_LOCKOUT_S`` seconds: one per
user name (``SIGNIN_FAILURES_PER_USER``) and one per client address
(``SIGNIN_FAILURES_PER_ADDRESS``, for one address guessing many names). Past either, the
backend refuses every password, the right one included, until the window ends; a
successful sign-in clears its user name's count.

What django-axes does for this project's one login path, on the cache the rate limiter
already uses: no extra app, tables or migrations. Like the rate limiter, it fails open
when the cache does not answer (a dead Redis must not lock every operator out).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.conf import settings
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import caches
from django.core.exceptions import PermissionDenied
from django.dispatch import receiver
from django.http import HttpRequest
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)
CACHE_ALIAS = "ratelimit"


def _keys(username: str | None, request: HttpRequest | None) -> list[tuple[str, int]]:
    """(counter key, allowed failures) for this sign-in's user name and address."""
    window = int(time.time() // settings.SIGNIN_LOCKOUT_S)
    keys: list[tuple[str, int]] = []
    if username:
        name = username.strip().lower()[:150]
        keys.append((f"signin:user:{name}:{window}", settings.SIGNIN_FAILURES_PER_USER))
    address = request.META.get("REMOTE_ADDR") if request is not None else None
    if address:
        keys.append((f"signin:addr:{address}:{window}", settings.SIGNIN_FAILURES_PER_ADDRESS))
    return keys


def locked_out(username: str | None, request: HttpRequest | None) -> bool:
    """Whether this user name or address has failed too often in the current window."""
    cache = caches[CACHE_ALIAS]
    try:
        return any((cache.get(key) or 0) >= allowed for key, allowed in _keys(username, request))
    except (RedisError, OSError) as exc:
        logger.warning("sign-in throttling is off: the rate-limit cache does not answer (%s)", exc)
        return False


def record_failure(username: str | None, request: HttpRequest | None) -> None:
    cache = caches[CACHE_ALIAS]
    try:
        for key, _ in _keys(username, request):
            if not cache.add(key, 1, timeout=settings.SIGNIN_LOCKOUT_S + 1):
                try:
                    cache.incr(key)
                except ValueError:  # expired meanwhile
                    cache.add(key, 1, timeout=settings.SIGNIN_LOCKOUT_S + 1)
    except (RedisError, OSError) as exc:
        logger.warning(
            "sign-in failure not counted: the rate-limit cache does not answer (%s)", exc
        )


class ThrottledModelBackend(ModelBackend):
    """Django's user/password backend, refusing sign-ins while their name or address is locked."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> Any:
        if username is None:
            username = kwargs.get("username")
        if locked_out(username, request):
            logger.warning(
                "sign-in refused: %r or %s failed too often; locked for up to %s s",
                username,
                request.META.get("REMOTE_ADDR") if request is not None else "?",
                settings.SIGNIN_LOCKOUT_S,
            )
            # PermissionDenied stops authenticate() at once: no other backend is asked.
            raise PermissionDenied("too many failed sign-ins; wait and try again")
        return super().authenticate(request, username=username, password=password, **kwargs)


@receiver(user_login_failed)
def _count_failure(sender: Any, credentials: dict[str, Any], request: Any = None, **_: Any) -> None:
    record_failure(credentials.get("username"), request)


@receiver(user_logged_in)
def _clear_on_success(sender: Any, request: Any, user: Any, **_: Any) -> None:
    cache = caches[CACHE_ALIAS]
    try:
        for key, _ in _keys(user.get_username(), None):
            cache.delete(key)
    except (RedisError, OSError):
        pass
