"""Nothing given away: data roots, sign-in lockout, the immutable admin, check --deploy.

Requests go through Django's test client (middleware, auth and views all run) on the
session's database; `manage.py check --deploy` runs as a subprocess in a production-like
environment (DEBUG off, an https public URL).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import caches
from django.test import Client

from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.runs import keys
from dipaco_server.runs.models import Dataset, ModuleVersion, Run
from dipaco_server.runs.sources import check_source
from dipaco_server.runs.versions import publish_module_version
from tests.conftest import ROOT, compose_env
from tests.test_models import make_run, tiny_config


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff_token(db: None) -> str:
    user, _ = create_user(f"ops-{uuid.uuid4().hex[:6]}", staff=True)
    return create_api_token(user, name="t")[1]


def post(client: Client, path: str, token: str, body: dict[str, Any]) -> Any:
    return client.post(
        f"/api/v1{path}",
        body,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )


# --- data roots ---------------------------------------------------------------------------


def test_a_dataset_outside_the_data_roots_is_refused_naming_the_setting(
    staff_token: str, settings: Any, tmp_path: Path
) -> None:
    root = tmp_path / "corpora"
    (root / "python").mkdir(parents=True)
    (root / "python" / "a.txt").write_text("print('hello')\n")
    settings.DIPACO_DATA_ROOTS = [root]
    secret_key_file = Path(settings.DIPACO_DATA_DIR) / "secret_key"
    outside = [
        str(secret_key_file),  # what a stolen staff token would read first
        "/etc/passwd",
        f"{root}/../{root.name}-evil",  # ".." out of the root
        f"{root}-sibling/x",  # a prefix of the root is not inside it
    ]
    (root / "escape").symlink_to("/etc")  # a link inside the root pointing out of it
    outside.append(str(root / "escape" / "passwd"))
    client = Client()
    for number, source in enumerate(outside):
        answer = post(client, "/datasets", staff_token, {"name": f"x{number}", "source": source})
        assert answer.status_code == 422, (source, answer.content)
        error = answer.json()["error"]
        assert error["code"] == "source_outside_data_roots", source
        assert "DIPACO_DATA_ROOTS" in error["message"] and str(root) in error["message"]
        assert error["details"]["setting"] == "DIPACO_DATA_ROOTS"
    assert not Dataset.objects.filter(name__startswith="x").exists()
    # Inside a root, and the built-in corpus, are accepted.
    inside = post(client, "/datasets", staff_token, {"name": "py", "source": str(root / "python")})
    assert inside.status_code == 201, inside.content
    assert (
        post(client, "/datasets", staff_token, {"name": "s", "source": "stdlib"}).status_code == 201
    )


def test_a_run_config_corpus_outside_the_data_roots_is_refused_too(
    staff_token: str, settings: Any, tmp_path: Path
) -> None:
    settings.DIPACO_DATA_ROOTS = [tmp_path / "corpora"]
    config = tiny_config()
    config["data"] = {**config.get("data", {}), "corpus": str(Path(settings.DIPACO_DATA_DIR))}
    answer = post(Client(), "/runs", staff_token, {"name": "r", "config": config})
    assert answer.status_code == 422, answer.content
    assert answer.json()["error"]["code"] == "source_outside_data_roots"
    assert not Run.objects.filter(name="r").exists()


def test_the_default_data_root_is_the_corpus_folder_of_the_data_dir_not_the_data_dir(
    settings: Any,
) -> None:
    data = Path(settings.DIPACO_DATA_DIR)
    assert [Path(r) for r in settings.DIPACO_DATA_ROOTS] == [(data / "corpus").resolve()]
    assert check_source(str(data / "corpus" / "mine")) == str(data / "corpus" / "mine")
    with pytest.raises(Exception, match="DIPACO_DATA_ROOTS"):
        check_source(str(data / "secret_key"))


# --- password sign-in ----------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("login_url", ["/login/", "/admin/login/"])
def test_repeated_wrong_passwords_lock_the_user_out_even_with_the_right_one(
    settings: Any, login_url: str
) -> None:
    caches["ratelimit"].clear()
    name = f"alice-{uuid.uuid4().hex[:6]}"
    _, password = create_user(name, staff=True)
    client = Client(REMOTE_ADDR="10.9.0.1")

    def sign_in(secret: str, who: str = name, by: Client = client) -> bool:
        by.post(login_url, {"username": who, "password": secret})
        signed_in = "_auth_user_id" in by.session
        by.logout()
        return signed_in

    assert sign_in(password), "the right password signs in before any failure"
    for _ in range(settings.SIGNIN_FAILURES_PER_USER):
        assert not sign_in("wrong")
    assert not sign_in(password), "locked out: the right password is refused too"
    # From another address the user name stays locked.
    assert not sign_in(password, by=Client(REMOTE_ADDR="10.9.0.2"))
    # Another user from the first address is not locked by one user's failures.
    other = f"bob-{uuid.uuid4().hex[:6]}"
    _, other_password = create_user(other, staff=True)
    assert sign_in(other_password, who=other)
    caches["ratelimit"].clear()
    assert sign_in(password), "the lock ends with its window"


# --- the admin ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_refuses_to_change_or_delete_a_module_version() -> None:
    run = make_run("immutable")
    module = run.modules.first()
    assert module is not None
    version = publish_module_version(
        module, 0, blob_key=keys.module_key(run.pk, module.module_id, 0), sha256="a" * 64, size=8
    )
    root, _ = create_user(f"root-{uuid.uuid4().hex[:6]}")
    root.is_staff = root.is_superuser = True
    root.save()
    client = Client()
    client.force_login(root)
    change = f"/admin/runs/moduleversion/{version.pk}/change/"
    assert client.get(change).status_code == 200, "viewable"
    edited = client.post(change, {"module": module.pk, "version": 7, "sha256": "b" * 64})
    assert edited.status_code == 403
    assert (
        client.post(f"/admin/runs/moduleversion/{version.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert client.get("/admin/runs/moduleversion/add/").status_code == 403
    # Deleting the run would cascade to the version: refused as well.
    client.post(f"/admin/runs/run/{run.pk}/delete/", {"post": "yes"})
    stored = ModuleVersion.objects.get(pk=version.pk)
    assert (stored.version, stored.sha256) == (0, "a" * 64)
    for model in ("rounds/contribution", "rounds/outerstep", "audit/auditentry"):
        assert client.get(f"/admin/{model}/add/").status_code == 403, model


# --- check --deploy -------------------------------------------------------------------------


def test_check_deploy_is_clean_with_debug_off_and_an_https_public_url(tmp_path: Path) -> None:
    environ = compose_env(
        DIPACO_DATA_DIR=str(tmp_path / "data"),
        DIPACO_PUBLIC_URL="https://dipaco.example.org",
        DEBUG="false",
        PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in ("platform", "web")),
    )
    command = [sys.executable, "-m", "django", "check", "--deploy", "--fail-level", "WARNING"]
    result = subprocess.run(
        command, env=environ, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout, result.stdout
    # Over plain http, with DEBUG on, the same check names what is missing: it can fail.
    environ.update(DIPACO_PUBLIC_URL="http://127.0.0.1:8000", DEBUG="true")
    result = subprocess.run(
        command, env=environ, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode != 0 and "SESSION_COOKIE_SECURE" in result.stdout + result.stderr
