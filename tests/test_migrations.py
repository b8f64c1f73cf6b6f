"""Migrations apply from scratch on SQLite and on PostgreSQL, with compose's command."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import compose_command, compose_env, with_database


def django_admin(args: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["django-admin", *args], env=environ, capture_output=True, text=True, timeout=180
    )


def assert_migrates_from_scratch(environ: dict[str, str]) -> None:
    """Unapplied before, `migrate` (as docker-compose.yml runs it) succeeds, none left after."""
    before = django_admin(["migrate", "--check"], environ)
    assert before.returncode != 0, "a fresh database should have unapplied migrations"
    migrate = subprocess.run(
        compose_command("migrate", environ),
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert migrate.returncode == 0, migrate.stderr
    after = django_admin(["migrate", "--check"], environ)
    assert after.returncode == 0, after.stdout + after.stderr


def test_migrations_apply_on_sqlite(tmp_path: Path) -> None:
    database = tmp_path / "db.sqlite3"
    environ = compose_env(DATABASE_URL=f"sqlite:///{database}", DIPACO_DATA_DIR=str(tmp_path))
    assert_migrates_from_scratch(environ)
    assert database.stat().st_size > 0


@pytest.fixture
def empty_postgres_database(postgres_url: str) -> Iterator[str]:
    """A database of its own, so the test sees migrations apply to nothing."""
    import psycopg

    name = f"dipaco_migrate_{uuid.uuid4().hex[:12]}"
    admin = with_database(postgres_url, "postgres")
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield with_database(postgres_url, name)
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrations_apply_on_postgresql(empty_postgres_database: str, tmp_path: Path) -> None:
    environ = compose_env(DATABASE_URL=empty_postgres_database, DIPACO_DATA_DIR=str(tmp_path))
    assert_migrates_from_scratch(environ)
    import psycopg

    with psycopg.connect(empty_postgres_database, connect_timeout=5) as conn:
        applied = conn.execute("SELECT count(*) FROM django_migrations").fetchone()
    assert applied is not None and applied[0] > 0
