"""Staff users and their admin API tokens: create, authenticate, revoke.

A token is shown once when it is made; the database keeps its sha256 (the same
scheme as worker tokens, see core.tokens). Authentication refuses unknown
and revoked tokens with 401 and a token whose user is not active staff with
403, so the API can tell "who are you?" from "you may not".
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from dipaco_server.accounts.models import ApiToken
from dipaco_server.core import tokens
from dipaco_server.errors import ServiceError

logger = logging.getLogger(__name__)

ADMIN_PREFIX = "dpa_"  # names the kind of secret in logs and leak scanners
PASSWORD_BYTES = 18  # 24 URL-safe characters
# Writing last_used on every request would turn each read into a write; a minute is enough
# to tell an operator which tokens are in use.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class ApiTokenInvalid(ServiceError):
    code, status = "token_invalid", 401


class StaffRequired(ServiceError):
    code, status = "staff_required", 403


class UserNotFound(ServiceError):
    code, status = "user_not_found", 404


class UserExists(ServiceError):
    code, status = "user_exists", 409


class ApiTokenNotFound(ServiceError):
    code, status = "api_token_not_found", 404


def create_user(
    username: str, *, email: str = "", staff: bool = False, password: str | None = None
) -> tuple[Any, str]:
    """A new active user and its password (generated when not given; shown once)."""
    User = get_user_model()
    if not username or len(username) > 150:
        raise ValueError("give a user name of 1 to 150 characters")
    password = password or secrets.token_urlsafe(PASSWORD_BYTES)
    try:
        with transaction.atomic():
            user = User.objects.create_user(
                username=username, email=email, password=password, is_staff=staff
            )
    except IntegrityError:
        raise UserExists(f"a user named {username!r} exists; choose another name") from None
    logger.info("created user %s (staff=%s)", username, staff)
    return user, password


def find_user(username: str) -> Any:
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise UserNotFound(f"no user named {username!r}; create it with: dipaco admin createuser")
    return user


def create_api_token(
    user: Any, *, name: str = "", now: datetime | None = None
) -> tuple[ApiToken, str]:
    """A new token for `user` and its plaintext (shown once; only the hash is kept)."""
    if len(name) > 100:
        raise ValueError(f"the token name is {len(name)} characters; the limit is 100")
    plaintext = tokens.generate_token(ADMIN_PREFIX)
    row = ApiToken.objects.create(
        user=user,
        name=name,
        token_hash=tokens.hash_token(plaintext),
        created_at=now or timezone.now(),
    )
    logger.info("created API token %s for %s", row.pk, user)
    return row, plaintext


def revoke_api_token(token_id: int, *, now: datetime | None = None) -> ApiToken:
    """Refuse the token from now on; revoking twice is a no-op."""
    row = ApiToken.objects.filter(pk=token_id).first()
    if row is None:
        raise ApiTokenNotFound(f"no API token with id {token_id}")
    ApiToken.objects.filter(pk=row.pk, revoked=False).update(
        revoked=True, revoked_at=now or timezone.now()
    )
    row.refresh_from_db()
    return row


def authenticate_staff(token: str, *, now: datetime | None = None) -> Any:
    """The active staff user holding `token`; ApiTokenInvalid (401) or StaffRequired (403)."""
    if not isinstance(token, str) or not token or len(token) > tokens.MAX_TOKEN_LENGTH:
        raise ApiTokenInvalid("missing or malformed API token; create one: dipaco admin token")
    row = (
        ApiToken.objects.select_related("user").filter(token_hash=tokens.hash_token(token)).first()
    )
    if row is None or not tokens.token_matches(token, row.token_hash):
        raise ApiTokenInvalid("unknown API token; create one with: dipaco admin token create")
    if row.revoked:
        raise ApiTokenInvalid(f"API token {row.pk} was revoked; create a new one")
    user = row.user
    if not user.is_active:
        raise ApiTokenInvalid(f"user {user.username!r} is deactivated")
    if not user.is_staff:
        raise StaffRequired(f"user {user.username!r} is not staff; the admin API is for staff only")
    now = now or timezone.now()
    stale = Q(last_used__isnull=True) | Q(last_used__lt=now - LAST_USED_RESOLUTION)
    ApiToken.objects.filter(stale, pk=row.pk).update(last_used=now)
    return user
