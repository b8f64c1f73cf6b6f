"""The worker protocol under concurrency, on PostgreSQL, Redis and the S3 server.

Three workers run the whole cycle at once against a live server, moving every
blob through S3 presigned URLs; then a hundred lease requests hit a multi-process
gunicorn at the same instant, and no unit may be granted twice.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from django.db import connection

from dipaco.codecs import decode, encode
from dipaco.modular import module_spec
from dipaco_server.env import blob_store, celery_transport
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.models import Contribution, Lease, WorkUnit
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import transition
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.storage.factory import _STORES
from dipaco_server.workers.services import create_enrollment_token
from tests.conftest import (
    S3Server,
    celery_client,
    compose_command,
    compose_env,
    log_tail,
    require_service,
    session_database_url,
    start_process,
    stop_process,
)
from tests.test_models import make_run, prepare_run
from tests.test_server_cli import free_port, wait_for_health
from tests.test_worker_api import WORKER, new_worker, running_run

THREAD_TIMEOUT_S = 120.0  # a bound on a hung thread, far above a normal run
LEASE_REQUESTS = 100
UNITS = 40  # fewer than the requests, so both grants and 204s are exercised
WEB_PROCESSES, WEB_THREADS = 4, 4


@pytest.fixture
def s3_store(
    settings: Any, s3_server: S3Server, s3_bucket: str, tmp_path: Path, transactional_db: None
) -> Iterator[BlobStore]:
    """The S3 blob store on the test server, configured as the settings would from S3_*."""
    require_service("PostgreSQL", connection.vendor == "postgresql", "DATABASE_URL is not it")
    settings.DIPACO_BLOB_STORE = blob_store(s3_server.environ(s3_bucket), tmp_path)
    _STORES.clear()  # get_blob_store caches per configuration; start from this one
    yield get_blob_store()
    _STORES.clear()


class RedisQueue:
    """The private Redis queue the worker API's Celery sends go to in a test."""

    def __init__(self, url: str, name: str) -> None:
        import redis

        self.name = name
        self.client = redis.Redis.from_url(url)

    def sent(self) -> list[tuple[str, str]]:
        """(task name, args) of each message waiting in the queue."""
        messages = [json.loads(raw)["headers"] for raw in self.client.lrange(self.name, 0, -1)]
        return [(m["task"], m["argsrepr"]) for m in messages]


@pytest.fixture
def redis_queue(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RedisQueue]:
    """Point the Celery sends that follow a completion (rounds.lifecycle.receivers) at Redis,
    on a queue no other session consumes."""
    name = f"dipaco-test-{uuid.uuid4().hex[:8]}"
    app = celery_client(celery_transport(tmp_path, redis_url), name)
    monkeypatch.setattr("dipaco_server.rounds.lifecycle.receivers.celery_app", app)
    queue = RedisQueue(redis_url, name)
    yield queue
    queue.client.delete(name)
    queue.client.close()
    app.close()


def running_run_with_replicas(store: BlobStore, replicas: int) -> Run:
    """running_run (tiny: 4 paths, R = 1), its round 0 reopened with R replicas per path."""
    run = running_run(store, "concurrent-run")
    Run.objects.filter(pk=run.pk).update(config={**run.config, "replicas_per_path": replicas})
    run.rounds.all().delete()  # the units of R = 1; no lease was granted yet
    run = Run.objects.get(pk=run.pk)
    open_round(run, 0)
    return run


@pytest.fixture
def web_server(transactional_db: None, tmp_path: Path) -> Iterator[str]:
    """docker-compose.yml's gunicorn, several processes x threads, on the test database."""
    require_service("PostgreSQL", connection.vendor == "postgresql", "DATABASE_URL is not it")
    port, log = free_port(), tmp_path / "web.log"
    environ = compose_env(
        DATABASE_URL=session_database_url(),
        DIPACO_DATA_DIR=str(tmp_path / "data"),
        DIPACO_HOST="127.0.0.1",
        DIPACO_PORT=str(port),
        WEB_CONCURRENCY=str(WEB_PROCESSES),
        # What is checked here is that no unit is granted twice. A hundred requests at
        # once on a busy 2-core box can queue past the 5 s shedding bar and be answered
        # 503 overloaded instead (tests/test_shedding.py checks that on its own).
        DIPACO_SHED_AFTER_S="off",
    )
    # Threads as well as processes: more grants in flight at once than processes alone.
    command = [*compose_command("web", environ), "--threads", str(WEB_THREADS)]
    server = start_process(command, environ, log)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", server, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        code = stop_process(server)
    assert code == 0, log_tail(log)


class Agent:
    """One volunteer machine speaking the protocol over its own HTTP client."""

    def __init__(self, base_url: str, run: Run, statuses: list[tuple[str, int]]) -> None:
        self.http = httpx.Client(base_url=f"{base_url}{WORKER}", timeout=30)
        self.config = run.run_config
        self.statuses = statuses
        self.units: list[int] = []

    def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self.http.request(method, path, **kwargs)
        self.statuses.append((path, response.status_code))
        return response

    def register(self, enrollment: str, name: str) -> None:
        body = {"enrollment_token": enrollment, "name": name}
        registered = self.send("POST", "/register", json=body)
        assert registered.status_code == 201, registered.text
        self.auth = {"Authorization": f"Bearer {registered.json()['token']}"}

    def work_until_the_queue_is_empty(self, start: threading.Barrier) -> None:
        start.wait(timeout=THREAD_TIMEOUT_S)
        while (granted := self.send("POST", "/lease", headers=self.auth)).status_code == 200:
            self.train(granted.json())
        assert granted.status_code == 204, granted.text

    def train(self, lease: dict[str, Any]) -> None:
        self.units.append(lease["unit_id"])
        base = f"/lease/{lease['lease_id']}"
        headers = {**self.auth, "X-Lease-Secret": lease["lease_secret"]}
        manifest = self.send("GET", f"{base}/manifest", headers=headers)
        assert manifest.status_code == 200, manifest.text
        for module in manifest.json()["modules"]:
            blob = httpx.get(module["url"], timeout=30)  # presigned S3 GET, no credentials
            assert blob.status_code == 200 and len(blob.content) == module["size"]
            assert hashlib.sha256(blob.content).hexdigest() == module["sha256"]
            spec = module_spec(self.config, module["module_id"])
            shapes = {name: tuple(t.shape) for name, t in decode(blob.content).items()}
            assert shapes == {name: shape for name, (shape, _) in spec.items()}
        self.beat(lease, headers)
        urls = self.send("POST", f"{base}/upload-urls", headers=headers)
        assert urls.status_code == 200, urls.text
        gen = torch.Generator().manual_seed(lease["unit_id"])
        reports = []
        for upload in urls.json()["uploads"]:
            spec = module_spec(self.config, upload["module_id"])
            delta = {n: 1e-3 * torch.randn(shape, generator=gen) for n, (shape, _) in spec.items()}
            encoded = encode(delta, urls.json()["codec"])
            assert len(encoded) <= upload["max_bytes"]
            # The presigned form POST, as worker_agent.transfer uploads: S3 offers no PUT
            # (put_url is null) since only the form's content-length-range bounds the size.
            post = upload["post"]
            files = {"file": (f"{upload['module_id']}.bin", encoded, "application/octet-stream")}
            sent = httpx.post(post["url"], data=post["fields"], files=files, timeout=30)
            assert sent.status_code < 300, sent.text
            digest = hashlib.sha256(encoded).hexdigest()
            reports.append(
                {"module_id": upload["module_id"], "sha256": digest, "size": len(encoded)}
            )
        self.beat(lease, headers)
        body = {"contributions": reports, "tokens": 10_240, "metrics": {"loss": 9.0}}
        done = self.send("POST", f"{base}/complete", headers=headers, json=body)
        assert done.status_code == 200, done.text
        assert {c["status"] for c in done.json()["contributions"]} == {"pending"}

    def beat(self, lease: dict[str, Any], headers: dict[str, str]) -> None:
        beat = self.send(
            "POST", "/heartbeat", headers=headers, json={"lease_id": lease["lease_id"]}
        )
        assert beat.status_code == 200, beat.text
        assert beat.json()["instructions"] == [] and beat.json()["lease"]["state"] == "active"


@pytest.mark.django_db(transaction=True)
def test_three_workers_run_the_full_protocol_concurrently(
    live_server: Any, s3_store: BlobStore, redis_queue: RedisQueue
) -> None:
    run = running_run_with_replicas(s3_store, replicas=2)
    units = set(WorkUnit.objects.filter(round__run=run).values_list("pk", flat=True))
    assert len(units) == 8
    _, enrollment = create_enrollment_token(max_uses=3)
    statuses: list[tuple[str, int]] = []
    agents = [Agent(live_server.url, run, statuses) for _ in range(3)]
    for i, agent in enumerate(agents):
        agent.register(enrollment, f"box-{i}")

    # All three ask at once, so each gets a unit before any can finish and ask again.
    start = threading.Barrier(len(agents))
    with ThreadPoolExecutor(len(agents)) as pool:
        futures = [pool.submit(a.work_until_the_queue_is_empty, start) for a in agents]
        for future in futures:
            future.result(timeout=THREAD_TIMEOUT_S)  # re-raises a thread's failed assertion
    for agent in agents:
        agent.http.close()

    assert not [s for s in statuses if s[1] >= 500], statuses
    granted = [u for a in agents for u in a.units]
    assert sorted(granted) == sorted(units), "every unit granted exactly once"
    assert all(a.units for a in agents), [a.units for a in agents]
    assert set(WorkUnit.objects.filter(pk__in=units).values_list("state", flat=True)) == {"done"}
    leases = Lease.objects.filter(unit__in=units)
    assert sorted(leases.values_list("unit_id", flat=True)) == sorted(units)
    assert set(leases.values_list("state", flat=True)) == {Lease.State.COMPLETED}

    live = Contribution.objects.filter(unit__in=units, status__in=["pending", "accepted"])
    pairs = Counter(live.values_list("unit_id", "module__module_id"))
    expected = {(u.pk, m) for u in WorkUnit.objects.filter(pk__in=units) for m in u.path.modules}
    assert set(pairs) == expected and set(pairs.values()) == {1}
    for row in live:
        assert s3_store.size(row.blob_key) == row.size  # the bytes the worker PUT are in S3
    # Each completion queues its unit's scoring, and the last hands the round to the outer
    # step, through Redis; two completions finishing together may both send the close
    # (close_round runs once).
    sent = redis_queue.sent()
    per_unit = {"dipaco_server.rounds.tasks.score_unit", "dipaco_server.rounds.tasks.check_unit"}
    expected = sorted(f"[{pk}]" for pk in leases.values_list("pk", flat=True))
    for task in per_unit:  # its Δs checked and its unit scored, at its completion
        assert sorted(args for name, args in sent if name == task) == expected, task
    # and at its grant, its unit's base losses scored while it trains
    per_unit.add("dipaco_server.rounds.tasks.score_base")
    granted = sorted(args for name, args in sent if name == "dipaco_server.rounds.tasks.score_base")
    assert granted == expected
    closes = {task for task in sent if task[0] not in per_unit}
    assert closes == {("dipaco_server.rounds.tasks.close_round", f"[{run.pk}, 0]")}


@pytest.mark.django_db(transaction=True)
def test_a_hundred_concurrent_lease_requests_never_grant_one_unit_twice(web_server: str) -> None:
    run = prepare_run(make_run("race-run", replicas_per_path=UNITS // 4))  # tiny: 4 paths
    transition(run, "running")
    open_round(run, 0)
    units = set(WorkUnit.objects.filter(round__run=run).values_list("pk", flat=True))
    assert len(units) == UNITS
    tokens = [new_worker(f"racer-{i}")[1] for i in range(LEASE_REQUESTS)]
    start = threading.Barrier(LEASE_REQUESTS)

    def ask(token: str) -> httpx.Response:
        with httpx.Client(base_url=f"{web_server}{WORKER}", timeout=60) as http:
            start.wait(timeout=THREAD_TIMEOUT_S)
            return http.post("/lease", headers={"Authorization": f"Bearer {token}"})

    with ThreadPoolExecutor(LEASE_REQUESTS) as pool:
        answers = list(pool.map(ask, tokens, timeout=THREAD_TIMEOUT_S))

    statuses = Counter(a.status_code for a in answers)
    expected_grants = min(UNITS, LEASE_REQUESTS)
    assert statuses == {200: expected_grants, 204: LEASE_REQUESTS - expected_grants}, statuses
    granted = [a.json()["unit_id"] for a in answers if a.status_code == 200]
    assert len(set(granted)) == len(granted) and set(granted) == units
    leases = Lease.objects.filter(unit__in=units)
    assert sorted(leases.values_list("unit_id", flat=True)) == sorted(units)
    assert set(WorkUnit.objects.filter(pk__in=units).values_list("state", "attempts")) == {
        (WorkUnit.State.LEASED, 1)
    }
