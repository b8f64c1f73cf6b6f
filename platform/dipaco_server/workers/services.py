"""Enrollment, registration, authentication and revocation of workers.

An operator creates an enrollment token and hands it to volunteers; a worker
trades it for its own token (`register_worker`), shown once, then presents
that on every call (`authenticate_worker`). Every use of an enrollment token
is counted with a conditional UPDATE, so ``max_uses`` holds under concurrency.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from dipaco_server.core import tokens
from dipaco_server.workers import trust
from dipaco_server.workers.errors import (
    EnrollmentRefused,
    TokenInvalid,
    WorkerInvalid,
    WorkerRevoked,
)
from dipaco_server.workers.models import EnrollmentToken, Worker

logger = logging.getLogger(__name__)

MAX_NAME_LENGTH = 64
MAX_OWNER_LENGTH = 100
MAX_DEVICE_JSON_BYTES = 4096  # a GPU description, not a dump: keeps rows and pages small


def create_enrollment_token(
    *,
    created_by: Any = None,
    label: str = "",
    max_uses: int | None = 1,
    expires_in: timedelta | None = None,
    now: datetime | None = None,
    trusted: bool = False,
) -> tuple[EnrollmentToken, str]:
    """A new enrollment token and its plaintext (shown once; only the hash is kept).
    `trusted`: for the operator's own machines; its workers skip probation and referee
    (workers.probation)."""
    if max_uses is not None and max_uses < 1:
        raise ValueError(f"max_uses = {max_uses}: use at least 1, or None for unlimited")
    if len(label) > 100:
        raise ValueError(f"label is {len(label)} characters; the limit is 100")
    now = now or timezone.now()
    plaintext = tokens.generate_token(tokens.ENROLLMENT_PREFIX)
    row = EnrollmentToken.objects.create(
        token_hash=tokens.hash_token(plaintext),
        label=label,
        created_by=created_by,
        created_at=now,
        expires_at=now + expires_in if expires_in is not None else None,
        max_uses=max_uses,
        trusted=trusted,
    )
    return row, plaintext


def revoke_enrollment_token(token: EnrollmentToken) -> None:
    EnrollmentToken.objects.filter(pk=token.pk).update(revoked=True)
    token.refresh_from_db(fields=["revoked"])


def register_worker(
    enrollment_token: str,
    name: str,
    device: Any,
    *,
    owner: str = "",
    now: datetime | None = None,
) -> tuple[Worker, str]:
    """Trade an enrollment token for a new worker and its plaintext token (shown once)."""
    now = now or timezone.now()
    clean_name = _clean_text(name, "name", MAX_NAME_LENGTH, required=True)
    clean_owner = _clean_text(owner, "owner", MAX_OWNER_LENGTH, required=False)
    clean_device = _clean_device(device)
    digest = tokens.hash_token(enrollment_token) if isinstance(enrollment_token, str) else ""
    usable = (
        Q(token_hash=digest, revoked=False)
        & (Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        & (Q(max_uses__isnull=True) | Q(uses__lt=F("max_uses")))
    )
    with transaction.atomic():
        if not EnrollmentToken.objects.filter(usable).update(uses=F("uses") + 1):
            raise _why_refused(digest, now)
        enrollment = EnrollmentToken.objects.get(token_hash=digest)
        plaintext = tokens.generate_token(tokens.WORKER_PREFIX)
        worker = Worker.objects.create(
            name=clean_name,
            owner=clean_owner,
            token_hash=tokens.hash_token(plaintext),
            enrollment=enrollment,
            device=clean_device,
            created_at=now,
            last_seen=now,
            # Trust is earned (workers.probation), unless the operator vouched for the token.
            probation=not enrollment.trusted and trust.partners_needed() > 0,
            operator_trusted=enrollment.trusted,
        )
    logger.info("registered worker %s (%s) with enrollment %s", worker.pk, name, enrollment.pk)
    return worker, plaintext


def _why_refused(digest: str, now: datetime) -> EnrollmentRefused:
    row = EnrollmentToken.objects.filter(token_hash=digest).first() if digest else None
    if row is None:
        reason, text = "unknown", "is not valid; ask the operator for a new one"
    elif row.revoked:
        reason, text = "revoked", "was revoked; ask the operator for a new one"
    elif row.expires_at is not None and row.expires_at <= now:
        reason, text = "expired", f"expired at {row.expires_at.isoformat()}; ask for a new one"
    else:
        reason, text = "used_up", f"was used {row.uses} of {row.max_uses} times; ask for a new one"
    return EnrollmentRefused(f"the enrollment token {text}", reason=reason)


def _clean_text(value: Any, field: str, limit: int, *, required: bool) -> str:
    if not isinstance(value, str):
        raise WorkerInvalid(f"{field} must be a string", field=field)
    text = value.strip()
    if required and not text:
        raise WorkerInvalid(f"{field} is empty; give the machine a name", field=field)
    if len(text) > limit:
        raise WorkerInvalid(f"{field} is {len(text)} characters; the limit is {limit}", field=field)
    # Names end up in the dashboard and in logs: no control or format characters.
    if any(unicodedata.category(c) in {"Cc", "Cf", "Zl", "Zp"} for c in text):
        raise WorkerInvalid(f"{field} contains control characters", field=field)
    return text


def _clean_device(device: Any) -> dict[str, Any]:
    if device is None:
        return {}
    if not isinstance(device, dict):
        raise WorkerInvalid("device must be a JSON object", field="device")
    try:
        encoded = json.dumps(device, allow_nan=False)
    except (TypeError, ValueError):
        raise WorkerInvalid("device must be plain JSON (no NaN)", field="device") from None
    if len(encoded.encode()) > MAX_DEVICE_JSON_BYTES:
        raise WorkerInvalid(
            f"device is {len(encoded)} bytes of JSON; the limit is {MAX_DEVICE_JSON_BYTES}",
            field="device",
        )
    parsed: dict[str, Any] = json.loads(encoded)
    return parsed


# How stale Worker.last_seen may be: well inside the dashboard's "online" window (one lease
# timeout, 5 min) and the idle-poll count's (2 min). Heartbeats every 30 s then write it
# every other time: at 5,000 volunteers, 80 fewer writes a second.
LAST_SEEN_RESOLUTION = timedelta(seconds=60)


def authenticate_worker(token: str, *, now: datetime | None = None) -> Worker:
    """The worker holding `token`; TokenInvalid if none, WorkerRevoked if revoked."""
    if not isinstance(token, str) or not token or len(token) > tokens.MAX_TOKEN_LENGTH:
        raise TokenInvalid("missing or malformed worker token; register the worker again")
    digest = tokens.hash_token(token)
    worker = Worker.objects.filter(token_hash=digest).first()
    if worker is None or not tokens.token_matches(token, worker.token_hash):
        raise TokenInvalid("unknown worker token; register the worker again")
    if worker.revoked:
        raise WorkerRevoked(
            f"worker {worker.pk} ({worker.name}) was revoked; ask the operator why",
            worker=worker.pk,
        )
    now = now or timezone.now()
    seen = worker.last_seen
    # Every worker request authenticates; last_seen is written once per LAST_SEEN_RESOLUTION.
    if seen is None or not (now - LAST_SEEN_RESOLUTION < seen <= now):
        Worker.objects.filter(pk=worker.pk).update(last_seen=now)
        worker.last_seen = now
    return worker


def revoke_worker(worker: Worker, *, now: datetime | None = None) -> None:
    """Refuse the worker's token from now on; the next lease sweep takes back its units."""
    now = now or timezone.now()
    Worker.objects.filter(pk=worker.pk).update(revoked=True, revoked_at=now)
    worker.refresh_from_db(fields=["revoked", "revoked_at"])
    logger.info("revoked worker %s (%s)", worker.pk, worker.name)
