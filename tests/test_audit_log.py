"""The audit log: a row for every admin action, through the HTTP API and the dashboard,
readable by staff only, and never changed once written."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from dipaco_server.accounts.models import ApiToken
from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.audit.models import AuditEntry, AuditLogIsAppendOnly
from dipaco_server.audit.services import redact
from dipaco_server.workers.models import EnrollmentToken
from tests.test_admin_api import ready_run
from tests.test_models import make_run, make_worker, tiny_config

API = "/api/v1"
ADDRESS = "10.9.8.7"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Django's default hasher takes about a second per password on a shared CI core."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff(db: None) -> tuple[ApiToken, str]:
    """A staff user's admin API token row and plaintext."""
    user, _ = create_user("auditor", staff=True)
    return create_api_token(user, name="audit-tests")


def call(method: str, path: str, token: str | None, body: Any = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = json.dumps(body) if body is not None else ""
    client = Client(REMOTE_ADDR=ADDRESS)
    return client.generic(
        method, f"{API}{path}", data, content_type="application/json", headers=headers
    )


def log(token: str, query: str = "") -> list[dict[str, Any]]:
    """Every entry of GET /audit-log (filtered by `query`), oldest first."""
    response = call("GET", f"/audit-log?limit=500{query}", token)
    assert response.status_code == 200, response.content
    return list(reversed(response.json()["items"]))


def test_every_admin_action_through_the_api_writes_one_entry_saying_who_what_and_where(
    staff: tuple[ApiToken, str],
) -> None:
    token_row, token = staff
    dataset = call("POST", "/datasets", token, {"name": "corpus", "source": "stdlib"}).json()
    created = call("POST", "/runs", token, {"name": "new-run", "config": tiny_config()}).json()
    run = ready_run("audited-run")
    for move in ("start", "pause", "resume", "cancel"):
        assert call("POST", f"/runs/{run.pk}/{move}", token).status_code == 200
    enrollment = call("POST", "/enrollment-tokens", token, {"label": "lab", "max_uses": 3})
    enrollment_id, plaintext = enrollment.json()["id"], enrollment.json()["token"]
    assert call("POST", f"/enrollment-tokens/{enrollment_id}/revoke", token).status_code == 200
    worker = make_worker("audited-box")
    assert call("POST", f"/workers/{worker.pk}/revoke", token).status_code == 200

    entries = log(token)
    assert [(e["action"], e["target_type"], e["target_id"], e["status"]) for e in entries] == [
        ("dataset.create", "dataset", str(dataset["id"]), 201),
        ("run.create", "run", str(created["id"]), 201),
        ("run.start", "run", str(run.pk), 200),
        ("run.pause", "run", str(run.pk), 200),
        ("run.resume", "run", str(run.pk), 200),
        ("run.cancel", "run", str(run.pk), 200),
        ("enrollment_token.create", "enrollment_token", str(enrollment_id), 201),
        ("enrollment_token.revoke", "enrollment_token", str(enrollment_id), 200),
        ("worker.revoke", "worker", str(worker.pk), 200),
    ]
    for entry in entries:
        assert entry["actor"] == "auditor" and entry["actor_id"] == token_row.user_id
        assert entry["api_token_id"] == token_row.pk and entry["channel"] == "api"
        assert entry["address"] == ADDRESS and entry["outcome"] == "ok"
        assert entry["created_at"] and entry["error_code"] == ""
    body = {"name": "corpus", "source": "stdlib", "text_field": "text", "token_budget": None}
    assert entries[0]["params"] == {"body": body}, "a budget of tokens is no secret"
    enrolled = {"label": "lab", "max_uses": 3, "expires_in_s": None, "trusted": False}
    assert entries[6]["params"]["body"] == enrolled
    assert entries[2]["params"] == {"run_id": run.pk}
    assert plaintext not in json.dumps(entries), "the token the answer carried is not logged"


def test_a_refused_admin_action_is_logged_with_its_status_and_error_code(
    staff: tuple[ApiToken, str],
) -> None:
    _, token = staff
    draft = make_run("draft-run")
    refused = call("POST", f"/runs/{draft.pk}/pause", token)
    assert refused.status_code == 409, refused.content
    missing = call("POST", "/workers/987654/revoke", token)
    assert missing.status_code == 404

    pause, revoke = log(token)
    assert (pause["action"], pause["target_id"], pause["outcome"]) == (
        "run.pause",
        str(draft.pk),
        "refused",
    )
    assert (pause["status"], pause["error_code"]) == (409, refused.json()["error"]["code"])
    assert pause["message"] == refused.json()["error"]["message"]
    assert (revoke["action"], revoke["target_id"], revoke["outcome"]) == (
        "worker.revoke",
        "987654",
        "refused",
    )
    assert revoke["error_code"] == "worker_not_found"


def test_the_log_filters_by_action_and_target_and_pages(staff: tuple[ApiToken, str]) -> None:
    _, token = staff
    first, second = ready_run("first-run"), ready_run("second-run")
    for run in (first, second):
        call("POST", f"/runs/{run.pk}/start", token)
        call("POST", f"/runs/{run.pk}/pause", token)
    pauses = log(token, "&action=run.pause")
    assert [e["target_id"] for e in pauses] == [str(first.pk), str(second.pk)]
    on_first = log(token, f"&target_type=run&target_id={first.pk}")
    assert [e["action"] for e in on_first] == ["run.start", "run.pause"]
    assert log(token, "&outcome=refused") == []
    page = call("GET", "/audit-log?limit=1&offset=1", token).json()
    assert page["count"] == 4 and len(page["items"]) == 1
    assert page["items"][0]["action"] == "run.start" and page["items"][0]["target_id"] == str(
        second.pk
    )
    bad = call("GET", "/audit-log?outcome=maybe", token)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"


def test_only_staff_can_read_the_log_and_it_is_in_the_openapi_schema(
    staff: tuple[ApiToken, str],
) -> None:
    _, token = staff
    visitor, _ = create_user("visitor", staff=False)
    _, visitor_token = create_api_token(visitor)
    assert call("GET", "/audit-log", None).status_code == 401
    forbidden = call("GET", "/audit-log", visitor_token)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "staff_required"
    assert call("GET", "/audit-log", token).status_code == 200
    operations = call("GET", "/openapi.json", None).json()["paths"]["/api/v1/audit-log"]
    assert set(operations) == {"get"}


def test_the_log_cannot_be_changed_through_the_api_or_the_models(
    staff: tuple[ApiToken, str],
) -> None:
    _, token = staff
    call("POST", "/enrollment-tokens", token, {"label": "x"})
    (entry,) = log(token)
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        answer = call(method, "/audit-log", token, {"action": "forged"})
        assert answer.status_code == 405, method
        assert answer.json()["error"]["code"] == "method_not_allowed"
    assert call("DELETE", f"/audit-log/{entry['id']}", token).status_code == 404
    row = AuditEntry.objects.get()
    row.action = "forged"
    with pytest.raises(AuditLogIsAppendOnly):
        row.save()
    with pytest.raises(AuditLogIsAppendOnly):
        row.delete()
    with pytest.raises(AuditLogIsAppendOnly):
        AuditEntry.objects.update(action="forged")
    with pytest.raises(AuditLogIsAppendOnly):
        AuditEntry.objects.all().delete()
    assert AuditEntry.objects.get().action == "enrollment_token.create"


def test_the_django_admin_lists_the_log_read_only(staff: tuple[ApiToken, str]) -> None:
    _, token = staff
    call("POST", "/enrollment-tokens", token, {"label": "x"})
    entry = AuditEntry.objects.get()
    superuser, _ = create_user("root", staff=True)
    superuser.is_superuser = True
    superuser.save()
    client = Client()
    client.force_login(superuser)
    listing = client.get("/admin/audit/auditentry/")
    assert listing.status_code == 200 and b"enrollment_token.create" in listing.content
    assert client.get("/admin/audit/auditentry/add/").status_code == 403
    assert (
        client.post(f"/admin/audit/auditentry/{entry.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    client.post(f"/admin/audit/auditentry/{entry.pk}/change/", {"action": "forged"})
    assert AuditEntry.objects.get().action == "enrollment_token.create"


def test_a_staff_button_on_the_dashboard_is_logged_as_well(staff: tuple[ApiToken, str]) -> None:
    run = ready_run("button-run")
    user, _ = create_user("button-pusher", staff=True)
    client = Client(REMOTE_ADDR=ADDRESS)
    client.force_login(user)
    client.post(f"/runs/{run.pk}/actions/start/")
    client.post(f"/runs/{run.pk}/actions/resume/")  # running → running: refused
    start, resume = AuditEntry.objects.order_by("pk")
    assert (start.action, start.channel, start.actor, start.outcome) == (
        "run.start", "dashboard", "button-pusher", "ok",
    )  # fmt: skip
    assert (start.target_type, start.target_id, start.address) == ("run", str(run.pk), ADDRESS)
    assert (resume.action, resume.outcome, resume.status) == ("run.resume", "refused", 409)
    assert EnrollmentToken.objects.count() == 0


def test_secret_looking_parameters_are_logged_as_stars() -> None:
    params = {"body": {"enrollment_token": "dpe_x", "password": "p", "name": "box", "n": [1]}}
    assert redact(params) == {
        "body": {"enrollment_token": "***", "password": "***", "name": "box", "n": [1]}
    }


def test_a_refused_body_with_a_nul_or_a_lone_surrogate_is_still_logged(
    staff: tuple[ApiToken, str],
) -> None:
    """PostgreSQL refuses U+0000 in text and jsonb; a fuzzer's body held one in a key, and
    the audit entry of the refused request was lost (tests/test_conformance.py found it)."""
    _, token = staff
    config = {**tiny_config(), "b\u0000ad": {"x\u0000": "\ud800"}}
    refused = call("POST", "/runs", token, {"name": "nul-test", "config": config})
    assert refused.status_code == 422, refused.content
    (entry,) = log(token, "&action=run.create")
    assert entry["outcome"] == "refused" and entry["status"] == 422
    assert entry["params"]["body"]["config"]["b\ufffdad"] == {"x\ufffd": "\ufffd"}
    assert "b\ufffdad" in entry["message"]
