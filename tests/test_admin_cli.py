"""``dipaco admin``: users, admin API tokens and enrollment tokens from the shell."""

from __future__ import annotations

import argparse
import io
import logging
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from dipaco_server.accounts.models import ApiToken
from dipaco_server.cli import admin
from dipaco_server.core import tokens
from dipaco_server.workers.models import EnrollmentToken
from tests.conftest import session_database_url


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Django's default hasher takes about a second per password on a shared CI core."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def dipaco_admin(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``dipaco admin ARGV`` through the ``dipaco`` parser, as the console script would."""
    parser = argparse.ArgumentParser(prog="dipaco")
    admin.register(parser.add_subparsers())
    args = parser.parse_args(["admin", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out.strip(), err


def runs_endpoint(token: str) -> int:
    response = Client().get("/api/v1/runs", headers={"Authorization": f"Bearer {token}"})
    return int(response.status_code)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", timedelta(seconds=90)), ("30m", timedelta(minutes=30)), ("7d", timedelta(days=7))],
)
def test_durations_read_as_a_number_and_a_unit(text: str, expected: timedelta) -> None:
    assert admin.parse_duration(text) == expected


@pytest.mark.parametrize("text", ["7", "0d", "-1h", "1y", "soon"])
def test_a_malformed_duration_is_refused_with_examples(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"e\.g\. 30m"):
        admin.parse_duration(text)


def test_createuser_prints_a_generated_password_that_logs_in(
    capsys: pytest.CaptureFixture[str], db: None
) -> None:
    code, password, err = dipaco_admin(capsys, "createuser", "alice", "--staff", "--email", "a@x")
    assert code == 0 and "created user 'alice'" in err
    user = get_user_model().objects.get(username="alice")
    assert user.is_staff and user.email == "a@x" and user.check_password(password)
    assert password not in user.password
    code, _, err = dipaco_admin(capsys, "createuser", "alice")
    assert code == 1 and "exists" in err


def test_createuser_reads_a_password_from_stdin(
    capsys: pytest.CaptureFixture[str], db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("correct horse battery\n"))
    code, out, _ = dipaco_admin(capsys, "createuser", "bob", "--password-stdin")
    assert code == 0 and out == ""
    user = get_user_model().objects.get(username="bob")
    assert user.check_password("correct horse battery") and not user.is_staff
    monkeypatch.setattr(sys, "stdin", io.StringIO("short\n"))
    code, _, err = dipaco_admin(capsys, "createuser", "carol", "--password-stdin")
    assert code == 1 and "shorter than 8" in err


def test_a_created_token_is_printed_once_works_and_stops_working_when_revoked(
    capsys: pytest.CaptureFixture[str], db: None
) -> None:
    dipaco_admin(capsys, "createuser", "ops", "--staff")
    code, token, _ = dipaco_admin(capsys, "token", "create", "ops", "--name", "laptop")
    assert code == 0 and token.startswith("dpa_")
    row = ApiToken.objects.get()
    assert row.name == "laptop" and row.token_hash == tokens.hash_token(token)
    assert runs_endpoint(token) == 200
    code, _, err = dipaco_admin(capsys, "token", "revoke", str(row.pk))
    assert code == 0 and "revoked" in err
    assert runs_endpoint(token) == 401


def test_token_create_refuses_an_unknown_user_and_warns_about_non_staff(
    capsys: pytest.CaptureFixture[str], db: None
) -> None:
    code, out, err = dipaco_admin(capsys, "token", "create", "nobody")
    assert code == 1 and out == "" and "createuser" in err
    dipaco_admin(capsys, "createuser", "volunteer")
    code, token, err = dipaco_admin(capsys, "token", "create", "volunteer")
    assert code == 0 and "not staff" in err
    assert runs_endpoint(token) == 403
    code, _, err = dipaco_admin(capsys, "token", "revoke", "999999")
    assert code == 1 and "no API token" in err


def test_enroll_prints_a_token_with_its_uses_and_expiry(
    capsys: pytest.CaptureFixture[str], db: None
) -> None:
    code, token, err = dipaco_admin(capsys, "enroll", "--uses", "3", "--expires", "12h")
    assert code == 0 and token.startswith("dpe_") and "3 use(s)" in err
    row = EnrollmentToken.objects.get(token_hash=tokens.hash_token(token))
    assert row.max_uses == 3
    assert row.expires_at is not None
    left = row.expires_at - timezone.now()
    assert timedelta(hours=11, minutes=59) < left <= timedelta(hours=12)
    code, token, _ = dipaco_admin(capsys, "enroll", "--uses", "unlimited", "--expires", "never")
    row = EnrollmentToken.objects.get(token_hash=tokens.hash_token(token))
    assert (row.max_uses, row.expires_at) == (None, None)


@pytest.mark.django_db(transaction=True)
def test_the_command_uses_the_database_its_environment_names() -> None:
    environ: dict[str, Any] = {**os.environ, "DATABASE_URL": session_database_url()}
    environ.pop("DJANGO_SETTINGS_MODULE", None)  # the command sets it itself
    result = subprocess.run(
        [sys.executable, "-m", "dipaco_server.cli.admin", "enroll", "--label", "from-shell"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    row = EnrollmentToken.objects.get(token_hash=tokens.hash_token(token))
    assert row.label == "from-shell" and row.max_uses == 1
    assert result.stderr.startswith("enrollment token") and " INFO " not in result.stderr


def shell_admin(*argv: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """``python -m dipaco_server.cli.admin ARGV`` in a fresh process, with only the dipaco
    variables given here (none from this test run's environment)."""
    from dipaco_server.env import KNOWN_VARIABLES

    clean = {k: v for k, v in os.environ.items() if k not in KNOWN_VARIABLES}
    clean.pop("DJANGO_SETTINGS_MODULE", None)
    return subprocess.run(
        [sys.executable, "-m", "dipaco_server.cli.admin", *argv],
        env={**clean, **environ},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_data_dir_without_a_database_is_named_with_the_way_out_and_left_empty(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = shell_admin("createuser", "alice", "--staff", DIPACO_DATA_DIR=str(empty))
    assert result.returncode == 1 and result.stdout == ""
    assert f"no database in the data dir {empty} (DIPACO_DATA_DIR)" in result.stderr
    assert "--data-dir DIR" in result.stderr and "nothing was created" in result.stderr
    assert list(empty.iterdir()) == [], "no db.sqlite3, secret key or broker folders"

    missing = tmp_path / "missing"
    result = shell_admin("enroll", "--data-dir", str(missing))
    assert result.returncode == 1 and f"{missing} (--data-dir)" in result.stderr
    assert not missing.exists()


def test_the_default_data_dir_without_a_database_points_at_the_demos(tmp_path: Path) -> None:
    demo = tmp_path / "share" / "dipaco" / "demo"
    demo.mkdir(parents=True)
    (demo / "db.sqlite3").touch()
    result = shell_admin("createuser", "alice", XDG_DATA_HOME=str(tmp_path / "share"))
    assert result.returncode == 1
    assert "(the default)" in result.stderr
    assert f"dipaco admin --data-dir {demo} createuser alice --staff" in result.stderr
    assert sorted(p.name for p in demo.parent.iterdir()) == ["demo"]

    # That command, as printed: the empty file has no tables, which it says how to fix.
    result = shell_admin("--data-dir", str(demo), "createuser", "alice", "--staff")
    assert result.returncode == 1 and "has no tables yet" in result.stderr
    assert "dipaco server" in result.stderr


def test_the_servers_log_lines_show_only_with_verbose(
    capsys: pytest.CaptureFixture[str], db: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        code, _, err = dipaco_admin(capsys, "createuser", "quiet")
        assert code == 0 and "created user 'quiet'" in err
        assert not [r for r in caplog.records if r.name.startswith("dipaco_server")]
        code, _, _ = dipaco_admin(capsys, "--verbose", "createuser", "loud")
        assert code == 0
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("dipaco_server")]
    assert logged == ["created user loud (staff=False)"]
    assert logging.getLogger("dipaco_server").level == logging.INFO, "restored afterwards"


@pytest.mark.django_db(transaction=True)
def test_the_demo_prints_a_staff_password_that_signs_in(tmp_path: Path) -> None:
    from dipaco_demo import control, runner

    control.mint_tokens("a demo", enrollments=1)
    first = runner.reset_staff_password()
    password = runner.reset_staff_password()  # each demo prints a new one
    line = runner.sign_in_line("http://127.0.0.1:8000", password, tmp_path)
    assert f"user demo, password {password} " in line
    assert f"dipaco admin --data-dir {tmp_path} createuser NAME --staff" in line
    signed_in = Client()
    answer = signed_in.post("/login/", {"username": "demo", "password": password})
    assert answer.status_code == 302, "signed in and sent on"
    assert signed_in.session.get("_auth_user_id") is not None
    stale = Client().post("/login/", {"username": "demo", "password": first})
    assert stale.status_code == 200, "the previous demo's password no longer signs in"
