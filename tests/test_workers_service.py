"""Enrollment, registration and authentication of workers; tokens stored only as hashes."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from dipaco_server.core import tokens
from dipaco_server.workers.errors import (
    EnrollmentRefused,
    TokenInvalid,
    WorkerInvalid,
    WorkerRevoked,
)
from dipaco_server.workers.models import EnrollmentToken, Worker
from dipaco_server.workers.services import (
    authenticate_worker,
    create_enrollment_token,
    register_worker,
    revoke_enrollment_token,
    revoke_worker,
)

DEVICE = {"gpu": "RTX 4090", "memory_gb": 24}


def test_a_registered_worker_authenticates_with_the_token_shown_once(db: None) -> None:
    _, enrollment = create_enrollment_token()
    worker, token = register_worker(enrollment, "alice-4090", DEVICE, owner="alice")
    assert token.startswith(tokens.WORKER_PREFIX)
    assert authenticate_worker(token).pk == worker.pk
    stored = Worker.objects.get(pk=worker.pk)
    assert stored.token_hash == tokens.hash_token(token) and token not in stored.token_hash
    assert stored.device == DEVICE and stored.owner == "alice"
    assert stored.enrollment is not None and stored.enrollment.uses == 1


def test_no_plaintext_token_is_stored(db: None) -> None:
    row, enrollment = create_enrollment_token()
    worker, token = register_worker(enrollment, "w", DEVICE)
    assert row.token_hash == tokens.hash_token(enrollment)
    values = [str(v) for v in Worker.objects.filter(pk=worker.pk).values().get().values()]
    values += [str(v) for v in EnrollmentToken.objects.filter(pk=row.pk).values().get().values()]
    assert not any(token in v or enrollment in v for v in values)


def test_an_enrollment_token_refuses_uses_beyond_max_uses(db: None) -> None:
    _, enrollment = create_enrollment_token(max_uses=2)
    register_worker(enrollment, "one", DEVICE)
    register_worker(enrollment, "two", DEVICE)
    with pytest.raises(EnrollmentRefused, match="used 2 of 2") as refused:
        register_worker(enrollment, "three", DEVICE)
    assert refused.value.details["reason"] == "used_up"
    assert Worker.objects.count() == 2


def test_an_unlimited_enrollment_token_keeps_working(db: None) -> None:
    _, enrollment = create_enrollment_token(max_uses=None)
    for i in range(3):
        register_worker(enrollment, f"w{i}", DEVICE)
    assert Worker.objects.count() == 3


def test_an_expired_enrollment_token_is_refused(db: None) -> None:
    now = timezone.now()
    _, enrollment = create_enrollment_token(expires_in=timedelta(hours=1), now=now)
    with pytest.raises(EnrollmentRefused, match="expired") as refused:
        register_worker(enrollment, "late", DEVICE, now=now + timedelta(hours=2))
    assert refused.value.details["reason"] == "expired"


def test_a_revoked_or_unknown_enrollment_token_is_refused(db: None) -> None:
    row, enrollment = create_enrollment_token()
    revoke_enrollment_token(row)
    with pytest.raises(EnrollmentRefused, match="revoked"):
        register_worker(enrollment, "w", DEVICE)
    with pytest.raises(EnrollmentRefused, match="not valid") as refused:
        register_worker("dpe_made-up", "w", DEVICE)
    assert refused.value.details["reason"] == "unknown"
    assert refused.value.status == 403 and refused.value.code == "enrollment_refused"


@pytest.mark.django_db(transaction=True)
def test_concurrent_registrations_never_exceed_max_uses() -> None:
    _, enrollment = create_enrollment_token(max_uses=3)
    barrier, outcomes = threading.Barrier(6), []

    def register(i: int) -> None:
        try:
            barrier.wait()
            register_worker(enrollment, f"w{i}", DEVICE)
            outcomes.append("registered")
        except EnrollmentRefused:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=register, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["refused"] * 3 + ["registered"] * 3
    assert EnrollmentToken.objects.get().uses == 3


def test_an_unknown_or_malformed_worker_token_is_refused(db: None) -> None:
    for token in ("dpw_nobody", "", "x" * 10_000):
        with pytest.raises(TokenInvalid):
            authenticate_worker(token)


def test_a_revoked_worker_is_refused(db: None) -> None:
    _, enrollment = create_enrollment_token()
    worker, token = register_worker(enrollment, "w", DEVICE)
    revoke_worker(worker)
    with pytest.raises(WorkerRevoked, match="revoked") as refused:
        authenticate_worker(token)
    assert refused.value.status == 403
    assert worker.revoked and worker.revoked_at is not None


def test_authentication_records_when_the_worker_was_last_seen(db: None) -> None:
    _, enrollment = create_enrollment_token()
    worker, token = register_worker(enrollment, "w", DEVICE)
    later = timezone.now() + timedelta(minutes=5)
    authenticate_worker(token, now=later)
    assert Worker.objects.get(pk=worker.pk).last_seen == later
    # Within LAST_SEEN_RESOLUTION a request writes nothing; after it, it writes again.
    authenticate_worker(token, now=later + timedelta(seconds=10))
    assert Worker.objects.get(pk=worker.pk).last_seen == later
    authenticate_worker(token, now=later + timedelta(minutes=2))
    assert Worker.objects.get(pk=worker.pk).last_seen == later + timedelta(minutes=2)


@pytest.mark.parametrize(
    ("name", "device", "field"),
    [
        ("", DEVICE, "name"),
        ("bell\x07", DEVICE, "name"),
        ("x" * 65, DEVICE, "name"),
        ("ok", ["not", "an", "object"], "device"),
        ("ok", {"blob": "x" * 5000}, "device"),
        ("ok", {"nan": float("nan")}, "device"),
    ],
)
def test_registration_refuses_bad_names_and_devices_without_using_the_token(
    db: None, name: str, device: object, field: str
) -> None:
    row, enrollment = create_enrollment_token()
    with pytest.raises(WorkerInvalid) as refused:
        register_worker(enrollment, name, device)
    assert refused.value.details["field"] == field
    row.refresh_from_db()
    assert row.uses == 0


def test_lease_secrets_compare_in_constant_time_and_refuse_junk() -> None:
    secret = tokens.generate_token(tokens.LEASE_PREFIX)
    stored = tokens.hash_token(secret)
    assert tokens.token_matches(secret, stored)
    assert not tokens.token_matches(secret + "x", stored)
    assert not tokens.token_matches("", stored)
    assert not tokens.token_matches(None, stored)  # type: ignore[arg-type]
