"""Cluster mode end to end: the demo's kind of run on PostgreSQL, Redis and an S3 server.

Every server process is started with its docker-compose.yml service's own command
(migrate, web = gunicorn, worker = Celery, beat), natively, in the environment compose
would give it with local addresses; the staff and enrollment tokens come from
`dipaco admin`; two `dipaco-worker` processes train. The run is driven through the
admin API with the demo's own client, and must finish its rounds with every module's
version advanced, its blobs in the bucket, and a validation loss for every path and round.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from dipaco_demo.control import AdminClient, free_port
from dipaco_demo.plan import DemoPlan, stdlib_sample
from dipaco_demo.workers import WorkerPool
from tests.conftest import (
    S3Server,
    compose_command,
    compose_env,
    log_tail,
    start_process,
    stop_processes,
)

ROUNDS = 2
RUN_TIMEOUT_S = 150.0
READY_TIMEOUT_S = 90.0
# Not the redis_url fixture's db 15: other pytest sessions on the same Redis flush that one
# when they start, which would drop this test's queued tasks. The fixture still decides
# whether Redis is there (skip, or fail under CI).
REDIS_DB = 13


def admin(environ: dict[str, str], *args: str) -> str:
    """`dipaco admin ARGS` against the cluster; the secret it prints on stdout."""
    command = [sys.executable, "-m", "dipaco_server.cli.admin", *args]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def cluster(
    tmp_path: Path, postgres_url: str, redis_url: str, s3_server: S3Server, s3_bucket: str
) -> Iterator[dict[str, Any]]:
    import redis

    redis_db = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    redis.Redis.from_url(redis_db).flushdb()
    port = free_port()
    environ = compose_env(
        DATABASE_URL=postgres_url, REDIS_URL=redis_db, **s3_server.environ(s3_bucket),
        DIPACO_DATA_DIR=str(tmp_path / "data"), DIPACO_PUBLIC_URL=f"http://127.0.0.1:{port}",
        DIPACO_HOST="127.0.0.1", DIPACO_PORT=str(port), WEB_CONCURRENCY="2",
        CELERY_CONCURRENCY="2",
    )  # fmt: skip
    migrate = subprocess.run(
        compose_command("migrate", environ), env=environ, capture_output=True, timeout=180
    )
    assert migrate.returncode == 0, migrate.stderr
    processes = {
        name: start_process(compose_command(name, environ), environ, tmp_path / f"{name}.log")
        for name in ("web", "worker", "beat")
    }
    workers = WorkerPool(tmp_path / "agents", tmp_path, 2)
    try:
        yield {"environ": environ, "url": f"http://127.0.0.1:{port}", "workers": workers,
               "processes": processes, "logs": tmp_path, "s3": s3_server.client(),
               "bucket": s3_bucket}  # fmt: skip
    finally:
        workers.stop()
        stop_processes(processes.values())
        redis.Redis.from_url(redis_db).flushdb()


def wait_healthy(url: str, cluster: dict[str, Any]) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, process in cluster["processes"].items():
            log = cluster["logs"] / f"{name}.log"
            assert process.poll() is None, f"{name} exited:\n{log_tail(log)}"
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the web never became healthy:\n{log_tail(cluster['logs'] / 'web.log')}")


def wait_for_state(client: AdminClient, run_id: int, wanted: str, cluster: dict[str, Any],
                   timeout: float) -> dict[str, Any]:  # fmt: skip
    deadline = time.monotonic() + timeout
    status = client.run(run_id)
    while status["state"] != wanted:
        assert status["state"] not in ("failed", "cancelled"), status["error"]
        for worker, code in cluster["workers"].failed():
            raise AssertionError(f"{worker.name} exited {code}: {worker.snapshot().lines}")
        if time.monotonic() > deadline:
            logs = {n: log_tail(cluster["logs"] / f"{n}.log") for n in ("web", "worker")}
            raise AssertionError(f"run stuck in {status['state']} ({status['round']}): {logs}")
        time.sleep(0.5)
        status = client.run(run_id)
    return status


def test_a_run_finishes_its_rounds_on_postgres_redis_s3_and_separate_celery_processes(
    tmp_path: Path, cluster: dict[str, Any]
) -> None:
    environ, url = cluster["environ"], cluster["url"]
    admin(environ, "createuser", "ops", "--staff")
    token = admin(environ, "token", "create", "ops")
    enrollment = admin(environ, "enroll", "--uses", "2")
    wait_healthy(url, cluster)

    client = AdminClient(url, token)
    corpus = stdlib_sample(tmp_path / "data" / "corpus", 1_000_000)  # the default data root
    dataset = client.dataset("stdlib-sample", str(corpus))
    plan = DemoPlan(model_size="micro", rounds=ROUNDS, inner_steps=5, workers=2)
    config = plan.config("cluster", corpus).model_dump(mode="json")
    run_id = client.create_run("cluster", config, dataset["id"])["id"]
    client.move(run_id, "start")
    wait_for_state(client, run_id, "ready", cluster, READY_TIMEOUT_S)
    client.move(run_id, "start")
    cluster["workers"].start(url, enrollment, environ)
    status = wait_for_state(client, run_id, "finished", cluster, RUN_TIMEOUT_S)
    client.close()

    assert status["current_round"] == ROUNDS - 1
    assert {m["module_id"]: m["current_version"] for m in status["modules"]} == {
        m: ROUNDS for m in ("0.0", "0.1", "1.0", "1.1", "shared")
    }, "every module took one outer step per round"
    pages = cluster["s3"].get_paginator("list_objects_v2")
    listing = pages.paginate(Bucket=cluster["bucket"], Prefix=f"runs/{run_id}/")
    keys = {item["Key"] for page in listing for item in page.get("Contents", [])}
    assert f"runs/{run_id}/modules/shared/v{ROUNDS}.safetensors" in keys
    assert any(f"/rounds/{ROUNDS - 1}/" in key for key in keys), "Δs were uploaded to S3"
    losses = AdminClient(url, token).metrics(run_id, "val_loss")
    assert sorted({(p["round"], p["path"]) for p in losses}) == [
        (t, p) for t in range(ROUNDS) for p in range(4)
    ]
    assert sum(w.snapshot().units_done for w in cluster["workers"].workers) == ROUNDS * 4
