"""The settings helpers: good values parse, bad ones stop start-up with the fix."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from dipaco_server import env
from tests.conftest import S3Server, compose_env


def test_it_rejects_a_database_url_without_a_scheme_separator(tmp_path: Path) -> None:
    with pytest.raises(ImproperlyConfigured) as error:
        env.database({"DATABASE_URL": "postgres//x"}, tmp_path)
    message = str(error.value)
    assert message.startswith("DATABASE_URL=")
    assert "expected e.g. postgres://user:pass@host:5432/db" in message


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("mysql://u:p@h/db", "unsupported scheme 'mysql'"),
        ("postgres://u:p@h:port/db", "the port is not a number"),
        ("postgres://u:p@h:5432/", "no database name"),
        ("sqlite:///relative.db", "the SQLite path is not absolute"),
        ("postgres://u:p@[::1/db", "not a valid URL"),
    ],
)
def test_it_rejects_malformed_database_urls_naming_the_problem(
    url: str, problem: str, tmp_path: Path
) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^DATABASE_URL=") as error:
        env.database({"DATABASE_URL": url}, tmp_path)
    assert problem in str(error.value)


def test_it_never_prints_the_database_password(tmp_path: Path) -> None:
    with pytest.raises(ImproperlyConfigured) as error:
        env.database({"DATABASE_URL": "postgres://dipaco:hunter2@h:x/db"}, tmp_path)
    assert "hunter2" not in str(error.value)
    assert "***" in str(error.value)


def test_it_parses_a_postgres_url_and_defaults_to_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    postgres = env.database({"DATABASE_URL": "postgres://u:p@db.local:5433/dipaco"}, tmp_path)
    assert (postgres["ENGINE"], postgres["HOST"], postgres["PORT"], postgres["NAME"]) == (
        "django.db.backends.postgresql",
        "db.local",
        5433,
        "dipaco",
    )
    sqlite = env.database({}, tmp_path)
    assert sqlite["ENGINE"] == "django.db.backends.sqlite3"
    assert Path(sqlite["NAME"]) == tmp_path / "db.sqlite3"


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"DEBUG": "maybe"}, "DEBUG"),
        ({"REDIS_URL": "localhost:6379"}, "REDIS_URL"),
        ({"REDIS_URL": "redis://h:6379/cache"}, "REDIS_URL"),
        ({"DIPACO_PUBLIC_URL": "ftp://example.org"}, "DIPACO_PUBLIC_URL"),
        ({"ALLOWED_HOSTS": "http://example.org"}, "ALLOWED_HOSTS"),
        ({"SECRET_KEY": "short"}, "SECRET_KEY"),
        ({"S3_BUCKET": "Not_A_Bucket"}, "S3_BUCKET"),
        ({"S3_ENDPOINT_URL": "http://minio:9000"}, "S3_ENDPOINT_URL"),
        ({"S3_BUCKET": "dipaco", "S3_ACCESS_KEY_ID": "k"}, "S3_SECRET_ACCESS_KEY"),
        ({"DIPACO_DATA_DIR": "relative/dir"}, "DIPACO_DATA_DIR"),
    ],
)
def test_it_rejects_other_bad_values_naming_the_variable(
    environ: dict[str, str], variable: str, tmp_path: Path
) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"^{variable}="):
        read_every_variable(environ, tmp_path)


def read_every_variable(environ: dict[str, str], data: Path) -> None:
    """What settings.py does, against ``environ`` instead of the process environment."""
    env.data_dir({"DIPACO_DATA_DIR": str(data), **environ})
    env.env_bool("DEBUG", False, environ)
    env.redis_url(environ)
    env.allowed_hosts(environ, env.public_url(environ))
    env.secret_key(environ, data)
    env.blob_store(environ, data)
    env.database(environ, data)


def test_it_keeps_a_generated_secret_key_private_and_stable(tmp_path: Path) -> None:
    first = env.secret_key({}, tmp_path)
    assert len(first) >= env.MIN_SECRET_KEY_LENGTH
    assert stat.S_IMODE((tmp_path / "secret_key").stat().st_mode) == 0o600
    assert env.secret_key({}, tmp_path) == first
    assert env.secret_key({"SECRET_KEY": "x" * 40}, tmp_path) == "x" * 40


def test_the_embedded_default_keeps_everything_in_the_data_dir(tmp_path: Path) -> None:
    store = env.blob_store({}, tmp_path)
    assert store == {"backend": "local", "root": tmp_path / "blobs"}
    celery = env.celery_transport(tmp_path, env.redis_url({}))
    assert celery["broker_url"].startswith("filesystem://")
    assert celery["result_backend"] == f"file://{tmp_path / 'results'}"
    assert Path(celery["broker_transport_options"]["data_folder_in"]).is_dir()


def test_the_s3_settings_reach_a_real_s3_server(s3_server: S3Server, s3_bucket: str) -> None:
    import boto3

    store = env.blob_store(s3_server.environ(s3_bucket), Path("/unused"))
    client = boto3.client(
        "s3",
        endpoint_url=store["endpoint_url"],
        aws_access_key_id=store["access_key_id"],
        aws_secret_access_key=store["secret_access_key"],
        region_name=store["region"],
    )
    client.put_object(Bucket=store["bucket"], Key="probe", Body=b"hello")
    assert client.get_object(Bucket=s3_bucket, Key="probe")["Body"].read() == b"hello"


def test_django_refuses_to_start_with_a_malformed_database_url(tmp_path: Path) -> None:
    environ = compose_env(DATABASE_URL="postgres//x", DIPACO_DATA_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "DATABASE_URL='postgres//x'" in result.stderr
    assert "expected e.g. postgres://" in result.stderr


def test_settings_expose_the_data_dir_public_url_and_blob_store() -> None:
    from django.conf import settings

    data_dir = settings.DIPACO_DATA_DIR
    assert data_dir == Path(os.environ["DIPACO_DATA_DIR"])
    assert settings.DIPACO_PUBLIC_URL.startswith("http")
    assert settings.DIPACO_BLOB_STORE["backend"] in {"local", "s3"}
    assert settings.CELERY_TASK_ACKS_LATE and settings.CELERY_WORKER_PREFETCH_MULTIPLIER == 1
    assert settings.CELERY_ACCEPT_CONTENT == ["json"]


@pytest.mark.django_db
def test_the_test_session_uses_the_database_the_environment_names() -> None:
    from django.conf import settings
    from django.db import connection

    url = os.environ.get("DATABASE_URL", "")
    assert connection.vendor == ("postgresql" if url.startswith("postgres") else "sqlite")
    assert connection.settings_dict["NAME"] == settings.DATABASES["default"]["TEST"]["NAME"]


def test_dipaco_db_pool_gives_each_process_a_pool_of_postgresql_connections(tmp_path: Path) -> None:
    url = "postgres://u:p@db.local:5432/dipaco"
    pooled = env.database({"DATABASE_URL": url, "DIPACO_DB_POOL": "4"}, tmp_path)
    assert pooled["OPTIONS"]["pool"]["max_size"] == 4
    assert pooled["CONN_MAX_AGE"] == 0, "Django returns pooled connections after each request"
    plain = env.database({"DATABASE_URL": url, "DIPACO_DB_POOL": "off"}, tmp_path)
    assert "pool" not in plain.get("OPTIONS", {}) and plain["CONN_MAX_AGE"] == 60
    sqlite = env.database({"DIPACO_DB_POOL": "4"}, tmp_path)
    assert "pool" not in sqlite["OPTIONS"], "SQLite has no pool: the setting is for PostgreSQL"


@pytest.mark.parametrize("value", ["four", "0", "1000"])
def test_a_bad_dipaco_db_pool_is_refused_naming_the_fix(tmp_path: Path, value: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"DIPACO_DB_POOL=.*e\.g\. 4, or off"):
        env.database({"DATABASE_URL": "postgres://u@h:5432/d", "DIPACO_DB_POOL": value}, tmp_path)


def test_dipaco_worker_install_is_the_enrolment_pages_command_and_refuses_several_lines() -> None:
    assert env.worker_install({}) == "pip install dipaco"
    assert env.worker_install({"DIPACO_WORKER_INSTALL": ""}) == "pip install dipaco"  # compose
    pinned = "pip install --index-url https://pypi.example.org/simple dipaco==0.1.0"
    assert env.worker_install({"DIPACO_WORKER_INSTALL": pinned}) == pinned
    for bad in ("pip install dipaco\nrm -rf ~", "x" * 501):
        with pytest.raises(
            ImproperlyConfigured, match=r"DIPACO_WORKER_INSTALL=.*one shell command"
        ):
            env.worker_install({"DIPACO_WORKER_INSTALL": bad})


def test_dipaco_grant_rate_sets_the_pace_of_grants_and_refuses_nonsense() -> None:
    assert env.grant_rate({}) is None
    assert env.grant_rate({"DIPACO_GRANT_RATE": "20"}) == 20.0
    for bad in ("fast", "0", "-5", "inf"):
        with pytest.raises(ImproperlyConfigured, match=r"DIPACO_GRANT_RATE=.*e\.g\. 50"):
            env.grant_rate({"DIPACO_GRANT_RATE": bad})
