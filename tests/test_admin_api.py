"""The admin API: its OpenAPI schema, staff-only token auth, runs, datasets, tokens, workers, metrics."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from dipaco_server.accounts.models import ApiToken
from dipaco_server.accounts.services import create_api_token, create_user, revoke_api_token
from dipaco_server.core import tokens
from dipaco_server.rounds.models import Round
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import record_metric, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.workers.models import EnrollmentToken, Worker
from tests.test_models import SHARD_TOKENS, make_run, make_worker, tiny_config
from tests.test_worker_api import assert_error, sent_tasks

API = "/api/v1"
ENDPOINTS = {
    ("GET", "/api/v1/health"),
    ("POST", "/api/v1/datasets"),
    ("GET", "/api/v1/datasets"),
    ("GET", "/api/v1/datasets/{dataset_id}"),
    ("POST", "/api/v1/runs"),
    ("GET", "/api/v1/runs"),
    ("GET", "/api/v1/runs/{run_id}"),
    ("POST", "/api/v1/runs/{run_id}/start"),
    ("POST", "/api/v1/runs/{run_id}/pause"),
    ("POST", "/api/v1/runs/{run_id}/resume"),
    ("POST", "/api/v1/runs/{run_id}/cancel"),
    ("GET", "/api/v1/runs/{run_id}/metrics"),
    ("GET", "/api/v1/runs/{run_id}/rounds"),
    ("POST", "/api/v1/enrollment-tokens"),
    ("GET", "/api/v1/enrollment-tokens"),
    ("POST", "/api/v1/enrollment-tokens/{token_id}/revoke"),
    ("GET", "/api/v1/workers"),
    ("GET", "/api/v1/workers/{worker_id}"),
    ("POST", "/api/v1/workers/{worker_id}/revoke"),
    ("POST", "/api/v1/worker/register"),
    ("POST", "/api/v1/worker/heartbeat"),
    ("POST", "/api/v1/worker/lease"),
    ("GET", "/api/v1/worker/lease/{lease_id}/manifest"),
    ("POST", "/api/v1/worker/lease/{lease_id}/upload-urls"),
    ("POST", "/api/v1/worker/lease/{lease_id}/complete"),
    ("POST", "/api/v1/worker/lease/{lease_id}/release"),
}
ADMIN_READS = ["/runs", "/datasets", "/enrollment-tokens", "/workers"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Django's default hasher takes about a second per password on a shared CI core."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff(db: None) -> str:
    """A staff user's admin API token."""
    user, _ = create_user("ops", staff=True)
    return create_api_token(user, name="tests")[1]


def admin(client: Client, method: str, path: str, token: str | None, body: Any = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = json.dumps(body) if body is not None else ""
    return client.generic(
        method, f"{API}{path}", data, content_type="application/json", headers=headers
    )


def ready_run(name: str = "ready-run") -> Run:
    """A run whose modules have version 0 and whose paths have data, moved to ready."""
    run = make_run(name)
    for module in run.modules.all():
        key = f"runs/{run.pk}/modules/{module.module_id}/v0.safetensors"
        publish_module_version(module, 0, blob_key=key, sha256="0" * 64, size=1024)
    run.paths.update(train_tokens=SHARD_TOKENS)
    transition(run, "preparing")
    return transition(run, "ready")


# --- schema and auth ---------------------------------------------------------------------------


def test_the_openapi_schema_is_served_and_lists_every_endpoint_with_typed_bodies(
    client: Client, db: None
) -> None:
    response = client.get(f"{API}/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    listed = {(m.upper(), path) for path, ops in schema["paths"].items() for m in ops}
    assert listed >= ENDPOINTS, f"missing: {ENDPOINTS - listed}"
    for method, path in ENDPOINTS:
        operation = schema["paths"][path][method.lower()]
        answers = [r for code, r in operation["responses"].items() if code.startswith("2")]
        assert answers, f"{method} {path} documents no success response"
        typed = [r for r in answers if "content" in r]
        assert all("schema" in r["content"]["application/json"] for r in typed)
        error = operation["responses"]["4XX"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/Error"}
    assert {"StaffToken", "WorkerToken"} <= set(schema["components"]["securitySchemes"])
    docs = client.get(f"{API}/docs")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


@pytest.mark.parametrize("path", ADMIN_READS)
def test_admin_routes_refuse_anonymous_requests_with_401(
    client: Client, db: None, path: str
) -> None:
    assert_error(admin(client, "GET", path, None), 401, "unauthenticated")
    assert_error(admin(client, "GET", path, "dpa_not-a-token"), 401, "token_invalid")


@pytest.mark.parametrize("path", ADMIN_READS)
def test_admin_routes_refuse_a_non_staff_token_with_403(
    client: Client, db: None, path: str
) -> None:
    user, _ = create_user("volunteer")
    _, token = create_api_token(user)
    assert_error(admin(client, "GET", path, token), 403, "staff_required")


def test_a_revoked_token_is_refused_with_401(client: Client, staff: str) -> None:
    assert admin(client, "GET", "/runs", staff).status_code == 200
    row = ApiToken.objects.get(token_hash=tokens.hash_token(staff))
    revoke_api_token(row.pk)
    assert_error(admin(client, "GET", "/runs", staff), 401, "token_invalid")


def test_admin_tokens_are_stored_only_as_hashes_and_record_their_use(
    client: Client, staff: str
) -> None:
    row = ApiToken.objects.get()
    assert row.token_hash == tokens.hash_token(staff) and staff not in row.token_hash
    assert row.last_used is None
    admin(client, "GET", "/workers", staff)
    row.refresh_from_db()
    assert row.last_used is not None


# --- runs --------------------------------------------------------------------------------------


def test_creating_a_run_with_a_bad_config_is_422_naming_each_field(
    client: Client, staff: str
) -> None:
    config = tiny_config()
    config["rounds"] = 0
    config["model"]["num_heads"] = 5  # does not divide hidden_size 128
    error = assert_error(
        admin(client, "POST", "/runs", staff, {"name": "bad", "config": config}),
        422,
        "config_invalid",
    )
    fields = {p["field"] for p in error["details"]["problems"]}
    assert {"rounds", "model.num_heads"} <= fields
    assert all({"field", "value", "rule"} <= set(p) for p in error["details"]["problems"])
    assert not Run.objects.exists()


def test_a_created_run_is_a_draft_whose_status_lists_paths_modules_and_workers(
    client: Client, staff: str
) -> None:
    created = admin(client, "POST", "/runs", staff, {"name": "r1", "config": tiny_config()})
    assert created.status_code == 201, created.content
    assert created.json()["state"] == "draft"
    assert created.json()["allowed_moves"] == ["preparing", "cancelled"]
    status = admin(client, "GET", f"/runs/{created.json()['id']}", staff).json()
    assert status["config"]["name"] == "r1" and status["round"] is None
    assert [p["index"] for p in status["paths"]] == [0, 1, 2, 3]
    assert {m["module_id"] for m in status["modules"]} == {"0.0", "0.1", "1.0", "1.1", "shared"}
    assert all(m["current_version"] is None for m in status["modules"])
    assert status["workers"] == {"active": 0, "contributed": 0}
    again = admin(client, "POST", "/runs", staff, {"name": "r1", "config": tiny_config()})
    assert_error(again, 409, "run_name_taken")
    assert_error(admin(client, "GET", "/runs/999999", staff), 404, "run_not_found")


def test_starting_a_draft_run_moves_it_to_preparing_and_queues_its_preparation(
    client: Client, staff: str, django_capture_on_commit_callbacks: Any
) -> None:
    draft = make_run("draft-run")
    sent_tasks()  # whatever earlier tests left
    with django_capture_on_commit_callbacks(execute=True):
        moved = admin(client, "POST", f"/runs/{draft.pk}/start", staff)
    assert moved.status_code == 200 and moved.json()["state"] == "preparing"
    assert sent_tasks() == [("dipaco_server.runs.tasks.prepare_run", f"[{draft.pk}]")]
    with django_capture_on_commit_callbacks(execute=True):
        again = admin(client, "POST", f"/runs/{draft.pk}/start", staff)
    assert_error(again, 409, "invalid_transition")
    assert sent_tasks() == [], "only the start that moved the run queues its preparation"


def test_start_pause_resume_and_cancel_move_the_run_and_an_illegal_move_is_409(
    client: Client, staff: str
) -> None:
    draft = make_run("draft-run")

    run = ready_run()
    started = admin(client, "POST", f"/runs/{run.pk}/start", staff)
    assert started.status_code == 200 and started.json()["state"] == "running"
    status = admin(client, "GET", f"/runs/{run.pk}", staff).json()
    assert status["round"]["t"] == 0 and status["round"]["units"] == {"queued": 4}
    assert all(m["current_version"] == 0 and m["sha256"] for m in status["modules"])
    for action, state in [("pause", "paused"), ("resume", "running"), ("cancel", "cancelled")]:
        response = admin(client, "POST", f"/runs/{run.pk}/{action}", staff)
        assert response.status_code == 200 and response.json()["state"] == state
    error = assert_error(
        admin(client, "POST", f"/runs/{run.pk}/resume", staff), 409, "invalid_transition"
    )
    assert error["details"] == {"state": "cancelled", "requested": "running", "allowed": []}
    error = assert_error(
        admin(client, "POST", f"/runs/{draft.pk}/pause", staff), 409, "invalid_transition"
    )
    assert error["details"]["allowed"] == ["preparing", "cancelled"]


def test_start_leaves_a_run_ready_when_its_first_round_cannot_open(
    client: Client, staff: str
) -> None:
    run = make_run("no-modules")
    transition(run, "preparing")
    transition(run, "ready")
    assert_error(admin(client, "POST", f"/runs/{run.pk}/start", staff), 409, "modules_not_ready")
    run.refresh_from_db()
    assert run.state == "ready" and not Round.objects.exists()


def test_run_lists_are_paginated_and_filtered_by_state(client: Client, staff: str) -> None:
    for i in range(3):
        make_run(f"run-{i}")
    transition(Run.objects.get(name="run-1"), "cancelled")
    page = admin(client, "GET", "/runs?limit=2&offset=0", staff).json()
    assert page["count"] == 3 and [r["name"] for r in page["items"]] == ["run-2", "run-1"]
    rest = admin(client, "GET", "/runs?limit=2&offset=2", staff).json()
    assert [r["name"] for r in rest["items"]] == ["run-0"]
    cancelled = admin(client, "GET", "/runs?state=cancelled", staff).json()
    assert [r["name"] for r in cancelled["items"]] == ["run-1"]
    assert_error(admin(client, "GET", "/runs?state=dancing", staff), 422, "invalid_request")
    assert_error(admin(client, "GET", "/runs?limit=0", staff), 422, "invalid_request")


def test_metrics_are_filtered_by_name_path_and_round(client: Client, staff: str) -> None:
    run = make_run()
    path0, path1 = run.paths.get(index=0), run.paths.get(index=1)
    for t in range(3):
        record_metric(run, "loss", 5.0 - t, path=path0, round=t)
        record_metric(run, "loss", 6.0 - t, path=path1, round=t)
        record_metric(run, "val_loss", 7.0 - t, path=path0, round=t)
    everything = admin(client, "GET", f"/runs/{run.pk}/metrics", staff).json()
    assert everything["count"] == 9
    losses = admin(client, "GET", f"/runs/{run.pk}/metrics?name=loss&path=1", staff).json()
    assert [(p["round"], p["value"], p["path"]) for p in losses["items"]] == [
        (0, 6.0, 1),
        (1, 5.0, 1),
        (2, 4.0, 1),
    ]
    one = admin(client, "GET", f"/runs/{run.pk}/metrics?round=2&name=val_loss", staff).json()
    assert [(p["value"], p["path"]) for p in one["items"]] == [(5.0, 0)]


# --- datasets, enrollment tokens, workers ------------------------------------------------------


def test_datasets_are_created_queued_for_preparation_listed_and_fetched(
    client: Client, staff: str, django_capture_on_commit_callbacks: Any
) -> None:
    sent_tasks()  # whatever earlier tests left
    with django_capture_on_commit_callbacks(execute=True):
        created = admin(client, "POST", "/datasets", staff, {"name": "py", "source": "stdlib"})
    assert created.status_code == 201 and created.json()["state"] == "pending"
    prepare = ("dipaco_server.runs.tasks.prepare_dataset", f"[{created.json()['id']}]")
    assert sent_tasks() == [prepare]
    again = admin(client, "POST", "/datasets", staff, {"name": "py", "source": "stdlib"})
    assert_error(again, 409, "dataset_name_taken")
    relative = admin(client, "POST", "/datasets", staff, {"name": "rel", "source": "data/x"})
    assert_error(relative, 422, "source_invalid")
    listed = admin(client, "GET", "/datasets", staff).json()
    assert listed["count"] == 1 and listed["items"][0]["name"] == "py"
    fetched = admin(client, "GET", f"/datasets/{created.json()['id']}", staff)
    assert fetched.json() == created.json()
    assert_error(admin(client, "GET", "/datasets/999999", staff), 404, "dataset_not_found")
    run = admin(client, "POST", "/runs", staff, {"name": "d", "config": {}, "dataset_id": 999999})
    assert_error(run, 404, "dataset_not_found")


def test_an_enrollment_token_is_shown_once_listed_without_it_and_revocable(
    client: Client, staff: str
) -> None:
    body = {"label": "lab", "max_uses": 2, "expires_in_s": 3600}
    created = admin(client, "POST", "/enrollment-tokens", staff, body)
    assert created.status_code == 201, created.content
    token, token_id = created.json()["token"], created.json()["id"]
    assert created.json()["created_by"] == "ops" and created.json()["expires_at"]
    assert EnrollmentToken.objects.get(pk=token_id).token_hash == tokens.hash_token(token)
    listed = admin(client, "GET", "/enrollment-tokens", staff).json()
    assert listed["count"] == 1 and "token" not in listed["items"][0]
    revoked = admin(client, "POST", f"/enrollment-tokens/{token_id}/revoke", staff)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    register = client.post(
        f"{API}/worker/register",
        {"enrollment_token": token, "name": "late"},
        content_type="application/json",
    )
    assert_error(register, 403, "enrollment_refused")
    bad = admin(client, "POST", "/enrollment-tokens", staff, {"max_uses": 0})
    error = assert_error(bad, 422, "invalid_request")
    assert [e["loc"] for e in error["details"]["errors"]] == [["body", "max_uses"]]


def test_workers_are_listed_and_a_revoked_one_is_refused_by_the_worker_api(
    client: Client, staff: str
) -> None:
    from dipaco_server.workers.services import create_enrollment_token, register_worker

    make_worker("one")
    _, enrollment = create_enrollment_token()
    worker, token = register_worker(enrollment, "two", {})
    listed = admin(client, "GET", "/workers", staff).json()
    assert listed["count"] == 2 and {w["name"] for w in listed["items"]} == {"one", "two"}
    revoked = admin(client, "POST", f"/workers/{worker.pk}/revoke", staff)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert Worker.objects.get(pk=worker.pk).revoked
    only = admin(client, "GET", "/workers?revoked=true", staff).json()
    assert [w["name"] for w in only["items"]] == ["two"]
    lease = client.post(f"{API}/worker/lease", headers={"Authorization": f"Bearer {token}"})
    assert_error(lease, 403, "worker_revoked")
    assert_error(admin(client, "POST", "/workers/999999/revoke", staff), 404, "worker_not_found")
