"""Test infrastructure: real PostgreSQL, Redis, an S3 server over HTTP, real Celery workers.

Services come from the environment (``DATABASE_URL``, ``REDIS_URL``), defaulting
to 127.0.0.1:5432 and :6379. A test that needs a service that does not answer
calls ``require_service``: it skips with the reason locally and fails when
``CI=true``, so CI can never go green by skipping.

Fixtures other test modules use (names are a contract):
  require_service  the helper above, as a fixture (also importable)
  postgres_url     a fresh, empty PostgreSQL database for the session (URL)
  redis_url        Redis db 15, flushed before and after the session (URL)
  s3_server        a moto S3 server over HTTP on a free loopback port
  s3_bucket        a fresh, uniquely named bucket on s3_server (its name)
  celery_worker_redis  a real worker process (docker-compose.yml's command) on redis_url

Processes that tests start run compose commands (``compose_command``) with
``compose_env``, so docker-compose.yml cannot drift from the code.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import hypothesis
import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
VENV_BIN = Path(sys.executable).parent
CI = os.environ.get("CI", "").lower() == "true"

# One intra-op thread per torch process: the suite runs two pytest workers and, beside
# them, the servers, Celery workers and volunteers they start, all on a few cores. torch's
# default (a thread per core in every process) made those threads wait on each other: on two
# cores, scoring a micro model's validation sample took 11 s of CPU with two threads and
# 1.5 s with one. Set here, before anything imports torch, so the pytest workers and every
# process they start (their environment is this one's) inherit it; a test that wants more
# threads asks torch for them. Already set (a developer's own value) is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A GPU machine may hold only the worker's dependencies (a CUDA torch, transformers,
# pydantic...): bench/gpu_check.sh runs the tests that need no server there. Without the
# server's packages nothing below touches Django, PostgreSQL or Redis; under CI=true they
# must be installed (pytest_configure), so CI never passes by leaving them out.
SERVER = all(
    importlib.util.find_spec(name) is not None
    for name in ("django", "pytest_django", "psycopg", "dipaco_server")
)

# The fuzz tests (hypothesis, and schemathesis on top of it) explore new examples on every
# developer run; under CI they replay the same derandomised examples, so a submission
# cannot fail on a bug it did not touch. Either way a failure prints how to reproduce it.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if CI:
    hypothesis.settings.load_profile("ci")
DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/dipaco"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
REDIS_TEST_DB = 15
# Under pytest-xdist each worker process (gw0, gw1, ...) is a session of its own, with its
# own PostgreSQL database (by pid) and data dir; Redis databases are few, so gw0 keeps 15
# and the others take 9, 8, ... (10 to 14 belong to single test modules, see theirs).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
PROCESS_STOP_TIMEOUT_S = 20.0
WORKER_READY_TIMEOUT_S = 60.0


def require_service(name: str, ok: bool, reason: str) -> None:
    """Skip the calling test when ``name`` is unavailable; fail instead under CI=true."""
    if ok:
        return
    message = f"{name} is not available: {reason}"
    if CI:
        pytest.fail(f"{message} (CI=true: every service must run; see .ci/run)")
    pytest.skip(message)


@pytest.fixture(name="require_service")
def require_service_fixture() -> Any:
    return require_service


# --- session configuration ---------------------------------------------------


def postgres_problem(url: str) -> str | None:
    """Why the PostgreSQL server of ``url`` does not answer, or None when it does."""
    import psycopg

    try:
        psycopg.connect(with_database(url, "postgres"), connect_timeout=3).close()
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__
    return None


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


# The files that take longest on two cores, longest first. Under pytest-xdist
# (`--dist loadfile --no-loadscope-reorder`, as `make test` runs it) each worker takes the
# next file when it is free, so starting with these and ending with the many short files
# keeps both workers busy to the end (longest-processing-time-first scheduling); xdist's
# own order (most tests first) left a 1-2 minute file such as the demo's for last.
LONGEST_FIRST = (
    "tests/test_faults.py",
    "tests/test_demo.py",
    "tests/test_conformance.py",
    "tests/test_replica_bias.py",
    "tests/test_encoded_downloads.py",
    "tests/test_soak.py",
    "tests/test_worker_agent_cluster.py",
    "tests/test_platform_vs_simulate.py",
    "tests/test_boundaries.py",
    "tests/browser/test_manage_browser.py",
    "tests/test_two_phases.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run LONGEST_FIRST's files first, in that order; the rest keep their order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    """Point Django at a per-session data dir and at PostgreSQL when it answers.

    pytest-django imports the settings before any conftest runs, so after
    changing the environment the settings module is evaluated again. Modules
    must therefore read settings when called, never copy them at import time.
    """
    data_dir = Path(tempfile.mkdtemp(prefix="dipaco-test-"))
    config.add_cleanup(lambda: shutil.rmtree(data_dir, ignore_errors=True))
    os.environ["DIPACO_DATA_DIR"] = str(data_dir)
    # Sampled replication (rounds.verification.replication) would add check copies at random; tests
    # that want it set DIPACO_REPLICATION_RATE themselves.
    os.environ.setdefault("DIPACO_REPLICATION_RATE", "0")
    # Probation (workers.probation) replicates every new worker's units the same way; tests
    # of it set DIPACO_PROBATION_PARTNERS themselves.
    os.environ.setdefault("DIPACO_PROBATION_PARTNERS", "0")
    if not SERVER:
        if CI:
            raise pytest.UsageError(
                "CI=true but the server's packages are not installed: "
                "pip install -e '.[server,dev]' (make setup does)"
            )
        return  # worker-only machine: the tests that need no server still run
    if not os.environ.get("DATABASE_URL"):
        problem = postgres_problem(DEFAULT_POSTGRES_URL)
        if problem is None:
            os.environ["DATABASE_URL"] = DEFAULT_POSTGRES_URL
        elif CI:
            raise pytest.UsageError(
                f"CI=true but PostgreSQL at {DEFAULT_POSTGRES_URL} does not answer "
                f"({problem}); start it or set DATABASE_URL"
            )
        # else: the embedded default, SQLite in the session's data dir.
    _reload_django_settings(data_dir)


def _reload_django_settings(data_dir: Path) -> None:
    from django.conf import settings
    from django.db import connections
    from django.utils.functional import empty

    module = os.environ.get("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")
    importlib.reload(importlib.import_module(module))
    settings._wrapped = empty  # the next access re-reads the reloaded module
    # The connection handler caches DATABASES (in `settings` and `_settings`)
    # and the wrappers built from it; drop all three.
    connections.close_all()
    for alias in connections.settings:
        with contextlib.suppress(AttributeError):
            del connections[alias]
    connections.__dict__.pop("settings", None)
    connections._settings = None
    database = settings.DATABASES["default"]
    # Test databases get a per-session name: several pytest sessions may share
    # one PostgreSQL server, and Django drops a test database that exists.
    # SQLite's goes to a file so that worker processes can open it too.
    if database["ENGINE"].endswith("sqlite3"):
        database.setdefault("TEST", {})["NAME"] = str(data_dir / "test.sqlite3")
    else:
        database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_{os.getpid()}"


def session_database_url() -> str:
    """A URL that subprocesses can use to open the session's test database."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    name = database["TEST"]["NAME"]
    if database["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{name}"
    return with_database(os.environ["DATABASE_URL"], name)


# --- docker-compose commands, run natively --------------------------------------

_COMPOSE_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)"
)


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, ${X}, ${X:-default}, ${X-default}, ${X:?error}."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg, value = match.group("op"), match.group("arg") or "", environ.get(name)
        missing = value is None or (value == "" and op is not None and op.startswith(":"))
        if missing and op in {":-", "-"}:
            return arg
        if missing and op in {":?", "?"}:
            raise ValueError(f"docker-compose.yml needs {name}: {arg}")
        return value or ""

    return _COMPOSE_VARIABLE.sub(substitute, text)


@cache
def compose_file() -> dict[str, Any]:
    import yaml

    with COMPOSE_FILE.open() as handle:
        loaded: dict[str, Any] = yaml.safe_load(handle)
    return loaded


def compose_command(service: str, environ: Mapping[str, str]) -> list[str]:
    """The ``command`` of a docker-compose.yml service, substituted with ``environ``."""
    command = compose_file()["services"][service]["command"]
    words = shlex.split(command) if isinstance(command, str) else list(command)
    return [interpolate(str(word), environ) for word in words]


def compose_env(**overrides: str) -> dict[str, str]:
    """This process's environment without dipaco settings, plus compose's fixed ones.

    The service addresses of the compose file (postgres:5432, ...) do not
    resolve here; tests pass local ones through ``overrides``.
    """
    from dipaco_server.env import KNOWN_VARIABLES

    environ = {k: v for k, v in os.environ.items() if k not in KNOWN_VARIABLES}
    fixed = compose_file()["x-django-env"]
    environ["DJANGO_SETTINGS_MODULE"] = fixed["DJANGO_SETTINGS_MODULE"]
    environ["PATH"] = f"{VENV_BIN}{os.pathsep}{environ.get('PATH', '')}"
    environ.update(overrides)
    return environ


def start_process(
    command: list[str], environ: Mapping[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session with output to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            env=dict(environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=log_path.parent,
        )


def stop_process(process: subprocess.Popen[bytes], timeout: float = PROCESS_STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait up to ``timeout``, then SIGKILL the whole process group."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # also the pool children it left
    return process.wait(timeout=10)


def stop_processes(
    processes: Iterable[subprocess.Popen[bytes]], timeout: float = PROCESS_STOP_TIMEOUT_S
) -> list[int]:
    """``stop_process`` on several at once: SIGTERM to all, then one shared wait (a web,
    a Celery worker and beat shut down side by side, as compose stops its services)."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        codes.append(stop_process(process, 0))  # SIGKILL to the group if it is still there
    return codes


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# --- services -------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, empty database on the test PostgreSQL server, dropped after the session."""
    import psycopg

    configured = os.environ.get("DATABASE_URL", "")
    server = configured if configured.startswith("postgres") else DEFAULT_POSTGRES_URL
    problem = postgres_problem(server)
    require_service("PostgreSQL", problem is None, f"{_safe(server)}: {problem}")
    name = f"dipaco_pytest_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = with_database(server, "postgres")
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield with_database(server, name)
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _safe(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(parts.password, "***")))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """Redis database 15 (never the default 0), flushed before and after the session; the
    other pytest-xdist workers' 9, 8, ... (XDIST_WORKER)."""
    import redis

    base = os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    index = int(XDIST_WORKER[2:]) if XDIST_WORKER.startswith("gw") else 0
    db = REDIS_TEST_DB if index == 0 else 10 - index
    if db < 1:
        raise pytest.UsageError(
            f"{XDIST_WORKER}: Redis has no test database left; use -n 9 or fewer"
        )
    url = urlunsplit(urlsplit(base)._replace(path=f"/{db}"))
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
        problem = None
    except redis.RedisError as exc:
        problem = str(exc)
    require_service("Redis", problem is None, f"{_safe(url)}: {problem}")
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=self.region,
        )

    def environ(self, bucket: str) -> dict[str, str]:
        """The S3_* variables that point the settings at ``bucket`` on this server."""
        return {
            "S3_ENDPOINT_URL": self.endpoint_url,
            "S3_BUCKET": bucket,
            "S3_ACCESS_KEY_ID": self.access_key_id,
            "S3_SECRET_ACCESS_KEY": self.secret_access_key,
            "S3_REGION": self.region,
        }


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """An S3-compatible server (moto) over real HTTP on a free loopback port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}", "testing", "testing", "us-east-1")
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A new bucket on ``s3_server``, emptied and deleted after the test."""
    client = s3_server.client()
    name = f"test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    yield name
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=item["Key"])
    client.delete_bucket(Bucket=name)


# --- Celery workers ----------------------------------------------------------------


@dataclass
class CeleryWorker:
    """A worker process and a client app that reaches it (``app.send_task``)."""

    app: Any
    queue: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def call(self, task: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run ``task`` on the worker and return its result."""
        return self.app.send_task(task, args=args, queue=self.queue).get(timeout=timeout)


def celery_client(transport: Mapping[str, Any], queue: str) -> Any:
    """A Celery app that sends to ``queue`` with the project's serialisation settings."""
    from celery import Celery
    from django.conf import settings

    app = Celery("dipaco-tests", set_as_current=False)
    app.conf.update(
        transport,
        task_default_queue=queue,
        task_serializer=settings.CELERY_TASK_SERIALIZER,
        result_serializer=settings.CELERY_RESULT_SERIALIZER,
        accept_content=settings.CELERY_ACCEPT_CONTENT,
        result_accept_content=settings.CELERY_RESULT_ACCEPT_CONTENT,
    )
    return app


def start_celery_worker(
    environ: dict[str, str], transport: Mapping[str, Any], log_dir: Path
) -> CeleryWorker:
    """docker-compose.yml's worker command on its own queue; returns once it answers a ping.

    The extra ``--queues``/``--hostname`` keep concurrent test sessions that share
    one Redis from taking each other's tasks; the command is otherwise compose's.
    """
    tag = f"dipaco-test-{uuid.uuid4().hex[:8]}"
    environ = {"CELERY_CONCURRENCY": "1", **environ}
    command = [*compose_command("worker", environ), f"--queues={tag}", f"--hostname={tag}@%h"]
    log_path = log_dir / f"{tag}.log"
    process = start_process(command, environ, log_path)
    app = celery_client(transport, tag)
    deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the Celery worker exited ({process.returncode}):\n{log_tail(log_path)}"
            )
        replies = app.control.ping(timeout=0.5)
        if any(tag in name for reply in replies for name in reply):
            return CeleryWorker(app=app, queue=tag, process=process, log_path=log_path)
    stop_process(process)
    raise RuntimeError(f"the Celery worker did not answer in time:\n{log_tail(log_path)}")


@pytest.fixture(scope="session")
def celery_worker_redis(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryWorker]:
    """A real worker process on ``redis_url`` that opens the session's test database."""
    from dipaco_server.env import celery_transport

    log_dir = tmp_path_factory.mktemp("celery-redis")
    environ = compose_env(
        REDIS_URL=redis_url,
        DATABASE_URL=session_database_url(),
        DIPACO_DATA_DIR=os.environ["DIPACO_DATA_DIR"],
    )
    worker = start_celery_worker(environ, celery_transport(log_dir, redis_url), log_dir)
    yield worker
    stop_process(worker.process)
    worker.app.close()


@pytest.fixture(autouse=True)
def _fresh_scheduler_caches() -> None:
    """The scheduler's per-process caches (group counts, workers seen) start empty in every
    test: SQLite reuses the ids of rolled-back rows, so another test's counts could match."""
    if not SERVER:
        return
    from dipaco_server.rounds.protocol import pacing

    pacing._groups = (float("-inf"), [])
    pacing._active_workers = (float("-inf"), 0)
