"""Schemathesis against the OpenAPI schema the server serves: every endpoint, no 5xx.

The schema is fetched from ``/api/v1/openapi.json`` through the real Django WSGI
application (in this process, on the session's PostgreSQL test database), and each
operation is fuzzed with three kinds of request: valid by the schema, invalid by the
schema (schemathesis' negative mode), and valid ones aimed at objects that exist (a
running run, its lease with the right ``X-Lease-Secret``, a worker, an enrollment
token), so requests get past the 404s into the services. Admin routes carry a staff
token and worker routes a worker token, so the authenticated code runs too.

Every answer must be a non-5xx status the operation documents, with the content type
and body schema it documents (the one error shape for 4xx). Examples per operation are
bounded so the whole module takes well under a minute and a half on a loaded machine.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import schemathesis
from django.conf import settings as django_settings
from django.core.cache import caches
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.api import api
from dipaco_server.ratelimit import CACHE_ALIAS, Limit
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_models import make_run, prepare_run

SCHEMA_URL = "/api/v1/openapi.json"
EXAMPLES_PER_OPERATION = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Operation labels ("METHOD /path") of the schema as built in this process; the test
# checks that the served schema lists exactly these, so no endpoint escapes the fuzzing.
OPERATIONS = sorted(
    f"{method.upper()} {path}"
    for path, methods in api.get_openapi_schema()["paths"].items()
    for method in methods
)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Django's default hasher takes about a second per password on a shared CI core."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def wsgi_app(transactional_db: None) -> Any:
    """Django's WSGI application on the test database, committing as in production.

    Transactional: a request the database refuses (a number past a column's range) must
    leave the connection usable, as it does in autocommit, not abort a test transaction.
    """
    return get_wsgi_application()


def real_objects() -> tuple[dict[str, str], dict[str, Any], str]:
    """(tokens by audience, real path parameters, lease secret) of a freshly seeded database."""
    user, _ = create_user("fuzz-ops", staff=True)
    _, staff = create_api_token(user, name="fuzz")
    enrollment_row, enrollment = create_enrollment_token(max_uses=None)
    worker, worker_token = register_worker(enrollment, "fuzz-box", {"gpu": "none"})
    run = prepare_run(make_run("fuzz-run"))
    start_run(run)
    grant = grant_lease(worker)
    assert grant is not None, "the seeded run should have a queued unit"
    ids = {
        "run_id": run.pk,
        "dataset_id": run.dataset_id or 1,
        "worker_id": worker.pk,
        "token_id": enrollment_row.pk,
        "lease_id": grant.lease.pk,
        "path_index": 0,
        "name": "config.json",
    }
    return {"staff": staff, "worker": worker_token}, ids, grant.secret


def fresh_public_counters() -> None:
    """Forget this window's (and the last one's) public requests from loopback."""
    rate = django_settings.DIPACO_RATE_LIMIT_PUBLIC
    if rate is None:
        return
    seconds = Limit("public", "DIPACO_RATE_LIMIT_PUBLIC", *rate).seconds
    window = int(time.time() // seconds)
    for address in ("127.0.0.1", "unknown"):
        for w in (window - 1, window, window + 1):
            caches[CACHE_ALIAS].delete(f"public:{address}:{seconds}:{w}")


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_request_to_any_endpoint_gets_a_server_error_or_an_undocumented_answer(
    wsgi_app: Any, label: str
) -> None:
    schema = schemathesis.openapi.from_wsgi(SCHEMA_URL, wsgi_app)
    served = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"the served schema has a broken operation: {result.err()}"
        served.append(result.ok().label)
    served.sort()
    assert served == OPERATIONS, "the served schema lists other operations than the API has"
    operation = schema.find_operation_by_label(label)
    assert operation is not None
    tokens, ids, secret = real_objects()
    worker_id = Worker.objects.get(name="fuzz-box").pk
    auth = {"Authorization": f"Bearer {tokens['worker' if '/worker/' in label else 'staff']}"}
    params = {p.name for p in operation.path_parameters}
    aimed: dict[str, Any] = {"path_parameters": {k: v for k, v in ids.items() if k in params}}
    if any(p.name == "X-Lease-Secret" for p in operation.headers):
        aimed["headers"] = {"X-Lease-Secret": secret}
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
        operation.as_strategy(GenerationMode.POSITIVE, **aimed),
    )
    answered: set[int] = set()
    # Each operation starts with a fresh public counter: the public limit is one per address
    # across routing, generating and downloads, so the operations fuzzed before this one
    # must not spend its budget.
    fresh_public_counters()

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, authenticated=st.booleans())
    def fuzz(case: Any, authenticated: bool) -> None:
        # A revocation the fuzzer sent must not silence the worker routes for the rest.
        Worker.objects.filter(pk=worker_id).update(revoked=False, revoked_at=None)
        if authenticated:  # else the generated Authorization header (if any) goes as it is
            case.headers = {**(case.headers or {}), **auth}
        response = case.call()
        answered.add(response.status_code)
        case.validate_response(response, checks=CHECKS)

    fuzz()
    assert answered - {429}, f"no request got past the rate limiter: {answered}"
