"""Who may see and steer: staff buttons, CSRF, sign-in, and the private-dashboard setting."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from dipaco_server.rounds.models import Round
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import transition
from dipaco_web import apps as web_apps
from dipaco_web.templatetags import dashboard as formats
from tests.test_dashboard import build_short_run, make_user
from tests.test_models import make_run, prepare_run

PASSWORD = "a long test password"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def run(db: None) -> Run:
    return build_short_run(rounds_done=1).run


def _state(run: Run) -> str:
    run.refresh_from_db()
    return run.state


def _csrf_token(client: Client, url: str) -> str:
    html = client.get(url).content.decode()
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match, f"{url} has no form with a CSRF token"
    return match.group(1)


def test_anonymous_visitors_see_no_buttons_and_their_posts_are_refused(
    client: Client, run: Run
) -> None:
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert "data-action=" not in html
    for action in ("pause", "cancel", "start", "resume"):
        assert client.post(f"/runs/{run.pk}/actions/{action}/").status_code == 403
    assert _state(run) == Run.State.RUNNING


def test_a_signed_in_user_who_is_not_staff_cannot_act(client: Client, run: Run) -> None:
    client.force_login(make_user("visitor", staff=False))
    assert "data-action=" not in client.get(f"/runs/{run.pk}/").content.decode()
    assert client.post(f"/runs/{run.pk}/actions/pause/").status_code == 403
    assert _state(run) == Run.State.RUNNING


def test_staff_pause_resume_and_cancel_a_run_with_csrf_protected_forms(run: Run) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user())
    page = f"/runs/{run.pk}/"
    assert re.findall(r'data-action="(\w+)"', client.get(page).content.decode()) == [
        "pause",
        "cancel",
    ]
    assert client.post(f"{page}actions/pause/").status_code == 403  # no CSRF token
    assert _state(run) == Run.State.RUNNING
    for action, state in (("pause", "paused"), ("resume", "running"), ("cancel", "cancelled")):
        token = _csrf_token(client, page)
        response = client.post(f"{page}actions/{action}/", {"csrfmiddlewaretoken": token})
        assert response.status_code == 302 and response["Location"] == page
        assert _state(run) == state
    html = client.get(page).content.decode()
    assert "cancel: run short-run is now cancelled" in html
    assert "data-action=" not in html  # a cancelled run is final: no buttons


def test_starting_a_ready_run_opens_round_zero(client: Client, db: None) -> None:
    ready = prepare_run(make_run("ready-run"))
    client.force_login(make_user())
    client.post(f"/runs/{ready.pk}/actions/start/")
    assert _state(ready) == Run.State.RUNNING
    assert Round.objects.filter(run=ready, t=0, state=Round.State.OPEN).exists()
    draft = make_run("draft-run")
    client.post(f"/runs/{draft.pk}/actions/start/")
    assert _state(draft) == Run.State.PREPARING


def test_a_move_the_state_refuses_is_shown_not_raised(client: Client, run: Run) -> None:
    transition(run, Run.State.PAUSED)
    client.force_login(make_user())
    response = client.post(f"/runs/{run.pk}/actions/pause/", follow=True)
    assert response.status_code == 200
    assert "it cannot become paused" in response.content.decode()
    assert _state(run) == Run.State.PAUSED
    assert client.post(f"/runs/{run.pk}/actions/explode/").status_code == 404
    assert client.get(f"/runs/{run.pk}/actions/pause/").status_code == 405


def test_staff_sign_in_through_the_login_form_and_then_see_the_buttons(
    client: Client, run: Run
) -> None:
    make_user("operator")
    page = f"/runs/{run.pk}/"
    refused = client.post("/login/", {"username": "operator", "password": "wrong"})
    assert "do not match" in refused.content.decode()
    response = client.post("/login/", {"username": "operator", "password": PASSWORD, "next": page})
    assert response.status_code == 302 and response["Location"] == page
    assert 'data-action="pause"' in client.get(page).content.decode()
    assert client.post("/logout/").status_code == 302
    assert "data-action=" not in client.get(page).content.decode()


def test_a_private_dashboard_shows_pages_to_signed_in_users_only(
    client: Client, run: Run, settings: Any
) -> None:
    settings.DIPACO_PUBLIC_DASHBOARD = False
    for page in ("/", f"/runs/{run.pk}/", "/workers/"):
        response = client.get(page)
        assert response.status_code == 302, page
        assert response["Location"].startswith("/login/?next=")
    for live in ("/live/runs/", f"/runs/{run.pk}/live/", "/workers/live/"):
        assert client.get(live).status_code == 403, live
    assert client.get("/login/").status_code == 200
    client.force_login(make_user("reader", staff=False))
    for page in ("/", f"/runs/{run.pk}/", "/workers/", "/live/runs/"):
        assert client.get(page).status_code == 200, page


def test_a_public_dashboard_is_the_default(client: Client, run: Run) -> None:
    for page in ("/", f"/runs/{run.pk}/", "/workers/", f"/runs/{run.pk}/live/"):
        assert client.get(page).status_code == 200, page


def test_the_system_check_names_npm_ci_when_the_browser_libraries_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web_apps, "VENDOR_DIR", tmp_path)
    (warning,) = web_apps.vendor_files_check()
    assert "uPlot.iife.min.js" in warning.msg and "npm ci" in (warning.hint or "")
    for name in web_apps.VENDOR_FILES:
        (tmp_path / name).write_text("")
    assert web_apps.vendor_files_check() == []


@pytest.mark.parametrize(
    ("value", "size", "count"),
    [
        (0, "0 B", "0"),
        (950, "950 B", "950"),
        (12_345, "12.3 kB", "12.3k"),
        (4.5e9, "4.5 GB", "4.5B"),
    ],
)
def test_sizes_and_counts_read_short(value: float, size: str, count: str) -> None:
    assert formats.size(value) == size
    assert formats.count(value) == count


def test_durations_read_as_a_person_would_say_them() -> None:
    assert [formats.seconds(s) for s in (42, 185, 7800)] == ["42 s", "3 min 05 s", "2 h 10 min"]
    assert formats.ppl(None) == formats.share(None) == "—"
    assert formats.share(0.253) == "25.3 %"
