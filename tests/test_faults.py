"""Fault injection on a whole run (issue 11): after each fault the run finishes, no module
version is skipped or published twice, and no accepted contribution is lost.

One stack serves every test of the module: a private PostgreSQL cluster and a private Redis
(these tests stop and start them; the shared ones serve other sessions), the session's moto S3
server behind a TCP proxy that can be cut, and docker-compose.yml's web, Celery worker and beat
commands with short leases (tests/fault_settings.py). Volunteers are real `dipaco-worker`
processes; where a fault needs an exact moment of the protocol (a duplicate completion, a
completion under an expired lease) a client speaks the worker API over real HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
import torch

from dipaco.config import RunConfig
from dipaco_demo.control import AdminClient
from dipaco_demo.plan import DemoPlan, stdlib_sample
from dipaco_demo.workers import WorkerPool, WorkerProcess
from tests.conftest import (
    ROOT,
    S3Server,
    compose_command,
    compose_env,
    log_tail,
    require_service,
    start_process,
    stop_processes,
)
from tests.faults import (
    Accepted,
    PrivatePostgres,
    PrivateRedis,
    TcpProxy,
    check_invariants,
    free_port,
)
from worker_agent.client import Client, Contribution
from worker_agent.errors import ServerError
from worker_agent.payload import encode_deltas, load_module
from worker_agent.transfer import Transfers

ROUNDS = 2
RUN_TIMEOUT_S = 150.0
READY_TIMEOUT_S = 90.0
SKEW_S = 3 * 3600  # the skewed worker's clock runs three hours ahead
OUTAGE_S = 30.0  # the S3 outage
LEASE_TIMEOUT_S = 8  # tests/fault_settings.py
METRICS_TOKEN = "fault-tests-scrape-token-0123456789"


@dataclass
class Stack:
    environ: dict[str, str]
    url: str
    token: str
    enrollment: str
    dataset_id: int
    logs: Path
    processes: dict[str, subprocess.Popen[bytes]]
    postgres: PrivatePostgres
    redis: PrivateRedis
    s3: TcpProxy
    faults: Path

    @contextlib.contextmanager
    def admin(self) -> Iterator[AdminClient]:
        client = AdminClient(self.url, self.token)
        try:
            yield client
        finally:
            client.close()

    def assert_alive(self) -> None:
        """No long-running process of the control plane crashed."""
        for name, process in self.processes.items():
            log = self.logs / f"{name}.log"
            assert process.poll() is None, f"{name} exited:\n{log_tail(log)}"

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{log_tail(self.logs / f'{n}.log')}" for n in self.processes)


def dipaco_admin(environ: dict[str, str], *args: str) -> str:
    command = [sys.executable, "-m", "dipaco_server.cli.admin", *args]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def retrying(call: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``call()`` until it answers: the web may refuse while a service it needs restarts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Stack]:
    import shutil

    require_service("redis-server", shutil.which("redis-server") is not None, "not installed")
    base = tmp_path_factory.mktemp("faults")
    postgres, redis = PrivatePostgres(), PrivateRedis(base / "redis")
    postgres.init()
    redis.start()
    bucket = f"faults-{os.getpid()}"
    s3_server.client().create_bucket(Bucket=bucket)
    proxy = TcpProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]))
    proxy.start()
    faults = base / "armed"
    faults.mkdir()
    port = free_port()
    s3 = {**s3_server.environ(bucket), "S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    environ = compose_env(
        DATABASE_URL=postgres.url, REDIS_URL=redis.url, **s3,
        DIPACO_DATA_DIR=str(base / "data"), DIPACO_PUBLIC_URL=f"http://127.0.0.1:{port}",
        DIPACO_HOST="127.0.0.1", DIPACO_PORT=str(port), WEB_CONCURRENCY="2",
        CELERY_CONCURRENCY="1", DJANGO_SETTINGS_MODULE="tests.fault_settings",
        PYTHONPATH=str(ROOT), DIPACO_FAULTS_DIR=str(faults), DIPACO_METRICS_TOKEN=METRICS_TOKEN,
    )  # fmt: skip
    migrate = subprocess.run(
        compose_command("migrate", environ), env=environ, capture_output=True, timeout=180
    )
    assert migrate.returncode == 0, migrate.stderr
    processes = {
        name: start_process(compose_command(name, environ), environ, base / f"{name}.log")
        for name in ("web", "worker", "beat")
    }
    try:
        dipaco_admin(environ, "createuser", "ops", "--staff")
        token = dipaco_admin(environ, "token", "create", "ops")
        enrollment = dipaco_admin(environ, "enroll", "--uses", "50")
        url = f"http://127.0.0.1:{port}"
        stack = Stack(environ, url, token, enrollment, 0, base, processes, postgres, redis,
                      proxy, faults)  # fmt: skip
        wait_healthy(stack)
        corpus = stdlib_sample(base / "data" / "corpus", 1_000_000)  # the default data root
        with stack.admin() as client:
            stack.dataset_id = client.dataset("stdlib-sample", str(corpus))["id"]
        yield stack
    finally:
        stop_processes(processes.values())
        proxy.stop()
        redis.stop()
        postgres.remove()


def wait_healthy(stack: Stack) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        stack.assert_alive()
        try:
            if httpx.get(f"{stack.url}/api/v1/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the web never became healthy:\n{stack.tails()}")


def start_run(stack: Stack, name: str, inner_steps: int = 5) -> int:
    """A micro run of ROUNDS rounds, prepared and started: its round 0 is open."""
    plan = DemoPlan(model_size="micro", rounds=ROUNDS, inner_steps=inner_steps, workers=2)
    with stack.admin() as client:
        config = plan.config(name, stack.logs / "corpus").model_dump(mode="json")
        run_id = int(client.create_run(name, config, stack.dataset_id)["id"])
        client.move(run_id, "start")
        wait_for(stack, run_id, "ready", None, READY_TIMEOUT_S)
        client.move(run_id, "start")
    return run_id


def wait_for(
    stack: Stack, run_id: int, wanted: str, workers: WorkerPool | None, timeout: float,
    killed: tuple[WorkerProcess, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """Poll the run through the admin API until it is ``wanted``; fail fast on a crash."""
    deadline = time.monotonic() + timeout
    with stack.admin() as client:
        while True:
            status: dict[str, Any] = retrying(lambda: client.run(run_id))
            if status["state"] == wanted:
                return status
            assert status["state"] not in ("failed", "cancelled"), status["error"]
            stack.assert_alive()
            for worker, code in workers.failed() if workers else ():
                if worker not in killed:
                    raise AssertionError(f"{worker.name} exited {code}: {worker.snapshot().lines}")
            if time.monotonic() > deadline:
                raise AssertionError(f"run stuck in {status['state']}: {status}\n{stack.tails()}")
            time.sleep(0.5)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def training(worker: WorkerProcess) -> bool:
    snapshot = worker.snapshot()
    return snapshot.state == "training" and snapshot.step >= 1


@pytest.fixture
def pool(tmp_path: Path, stack: Stack) -> Iterator[WorkerPool]:
    workers = WorkerPool(tmp_path / "agents", tmp_path, 2)
    yield workers
    workers.stop()


def sql(stack: Stack, query: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(stack.postgres.url, connect_timeout=10) as conn:
        return [tuple(row) for row in conn.execute(query, args).fetchall()]


def held_lease(worker: WorkerProcess, phase: str) -> int | None:
    """The lease the agent holds in ``phase`` ("training", "uploading"), from its lease.json
    (written before each phase starts, removed after the completion), or None."""
    try:
        record = json.loads((worker.data_dir / "lease.json").read_text())
        return int(record["lease"]["lease_id"]) if record["phase"] == phase else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@pytest.mark.timeout(300)
def test_workers_killed_mid_training_and_mid_upload_and_the_celery_worker_mid_outer_step_lose_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    # Units long enough (40 steps, a second or two) for the test to see one in training
    # between two of its polls even on a loaded machine; 5 steps could slip past.
    run_id = start_run(stack, "kill-9", inner_steps=40)
    armed = stack.faults / "kill-after-blob-write"  # outer.Fault.KILL_AFTER_BLOB_WRITE
    armed.touch()
    pool = WorkerPool(tmp_path / "agents", tmp_path, 3)
    stack.s3.delay_s = 0.05  # a slow link to S3: an upload takes long enough to be cut
    try:
        pool.start(stack.url, stack.enrollment, stack.environ)
        in_training, in_upload = pool.workers[0], pool.workers[1]
        wait_until(
            lambda: training(in_training) and held_lease(in_training, "training") is not None,
            "the first worker to train",
        )
        cut_leases = [held_lease(in_training, "training")]
        assert in_training.process is not None
        os.killpg(in_training.process.pid, signal.SIGKILL)
        wait_until(lambda: held_lease(in_upload, "uploading") is not None, "an upload", 120)
        cut_leases.append(held_lease(in_upload, "uploading"))
        assert in_upload.process is not None and None not in cut_leases
        os.killpg(in_upload.process.pid, signal.SIGKILL)
        stack.s3.delay_s = 0.0

        wait_for(stack, run_id, "finished", pool, RUN_TIMEOUT_S, killed=(in_training, in_upload))
    finally:
        stack.s3.delay_s = 0.0
        pool.stop()

    check_invariants(stack.postgres.url, run_id)
    assert not armed.exists(), "the outer-step fault never fired"
    worker_log = (stack.logs / "worker.log").read_text(errors="replace")
    assert "injected fault kill-after-blob-write" in worker_log
    assert "SIGKILL" in worker_log, "the Celery pool process died by SIGKILL mid-step"
    cut = sql(stack, "SELECT state FROM rounds_lease WHERE id = ANY(%s)", cut_leases)
    assert cut == [("expired",)] * 2, "the killed leases never completed; their units were redone"
    stack.assert_alive()


@pytest.mark.timeout(300)
def test_the_whole_celery_worker_killed_mid_outer_step_is_replaced_and_the_round_closes_once(
    stack: Stack, pool: WorkerPool
) -> None:
    run_id = start_run(stack, "celery-kill-9")
    modules = sql(stack, "SELECT count(*) FROM runs_module WHERE run_id = %s", run_id)[0][0]
    broker = redis.Redis.from_url(stack.environ["REDIS_URL"])
    stack.s3.delay_s = 0.05  # slow blob reads: an outer step lasts long enough to be cut
    try:
        pool.start(stack.url, stack.enrollment, stack.environ)

        def mid_step() -> bool:
            stepped = sql(stack, "SELECT r.state, count(s.id) FROM rounds_round r LEFT JOIN"
                          " rounds_outerstep s ON s.round_id = r.id WHERE r.run_id = %s AND"
                          " r.t = 0 GROUP BY r.state", run_id)  # fmt: skip
            # At least three steps still to go, and the worker holding one (kombu's unacked
            # hash: a step running or prefetched, acks_late): the kill must lose a step that
            # only the sweep sends again. Right after close_round sent the steps, before the
            # worker took one, a kill loses nothing and the new worker takes them all from
            # the queue (seen on a loaded machine).
            closing = bool(stepped) and stepped[0][0] == "closing"
            return closing and stepped[0][1] <= modules - 3 and held_steps() > 0

        def held_steps() -> int:
            """This run's outer steps in kombu's unacked hash (earlier tests share Redis)."""
            mine = f"({run_id}, ".encode()
            return sum(
                b"rounds.tasks.outer_step" in raw and mine in raw for raw in broker.hvals("unacked")
            )

        wait_until(mid_step, "round 0's outer steps", timeout=120)
        celery = stack.processes["worker"]
        os.killpg(celery.pid, signal.SIGKILL)  # the main process and its pool: nothing acks
        assert celery.wait(timeout=10) == -signal.SIGKILL
        log = stack.logs / "worker.log"
        stack.processes["worker"] = start_process(
            compose_command("worker", stack.environ), stack.environ, log
        )
    finally:
        stack.s3.delay_s = 0.0

    wait_for(stack, run_id, "finished", pool, RUN_TIMEOUT_S)

    check_invariants(stack.postgres.url, run_id)
    assert "sending its outer steps again" in log.read_text(errors="replace")
    stack.assert_alive()


@pytest.mark.timeout(300)
def test_redis_and_postgres_restarted_mid_run_are_survived_by_every_process(
    stack: Stack, pool: WorkerPool
) -> None:
    run_id = start_run(stack, "restarts")
    pool.start(stack.url, stack.enrollment, stack.environ)
    wait_until(lambda: any(training(w) for w in pool.workers), "a worker to train")
    stack.redis.stop()
    health = httpx.get(f"{stack.url}/api/v1/health", timeout=30)
    assert health.status_code == 503 and health.json()["broker"]["ok"] is False, health.text
    ready = httpx.get(f"{stack.url}/readyz", timeout=30)
    assert ready.status_code == 503 and ready.json()["failed"] == ["broker"], ready.text
    time.sleep(2)
    stack.redis.start()
    # A micro unit trains in ~60 ms, too brief to catch in training by polling: wait
    # for a unit completed after the restart, a worker's second at least.
    done = {w.name: w.snapshot().units_done for w in pool.workers}
    wait_until(
        lambda: any(w.snapshot().units_done > max(done[w.name], 1) for w in pool.workers),
        "a worker to complete its second unit after Redis restarted",
    )
    stack.postgres.stop()
    health = httpx.get(f"{stack.url}/api/v1/health", timeout=30)
    assert health.status_code == 503 and health.json()["database"]["ok"] is False, health.text
    ready = httpx.get(f"{stack.url}/readyz", timeout=30)
    assert ready.status_code == 503 and "database" in ready.json()["failed"], ready.text
    assert httpx.get(f"{stack.url}/healthz", timeout=30).status_code == 200
    scraped = httpx.get(f"{stack.url}/metrics", timeout=30,
                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"})  # fmt: skip
    assert scraped.status_code == 200, scraped.text  # blind, not down: the errors say so
    assert re.search(r'^dipaco_scrape_errors_total\{part="runs"\} [1-9]', scraped.text, re.M)
    staff = httpx.get(f"{stack.url}/metrics", timeout=30,
                      headers={"Authorization": f"Bearer {stack.token}"})  # fmt: skip
    assert staff.status_code == 503, staff.text
    assert staff.json()["error"]["code"] == "database_unavailable", staff.text
    headers = {"Authorization": "Bearer not-a-token"}
    refused = httpx.post(f"{stack.url}/api/v1/worker/lease", headers=headers, timeout=30)
    assert refused.status_code == 503, refused.text  # a clear retry-later, never a 500
    assert refused.json()["error"]["code"] == "database_unavailable", refused.text
    assert refused.headers["Retry-After"], refused.headers
    time.sleep(2)
    stack.postgres.start()

    wait_for(stack, run_id, "finished", pool, RUN_TIMEOUT_S)

    check_invariants(stack.postgres.url, run_id)
    stack.assert_alive()
    assert not pool.failed(), "no worker agent crashed"


@pytest.mark.timeout(300)
def test_the_s3_server_unreachable_for_30_seconds_delays_the_run_but_loses_nothing(
    stack: Stack, pool: WorkerPool
) -> None:
    run_id = start_run(stack, "s3-outage")
    pool.start(stack.url, stack.enrollment, stack.environ)
    wait_until(lambda: any(training(w) for w in pool.workers), "a worker to train")
    before = stack.s3.connections
    stack.s3.cut()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{stack.s3.port}/", timeout=3)
    outage = time.monotonic()
    ready = httpx.get(f"{stack.url}/readyz", timeout=30)
    assert ready.status_code == 503 and ready.json()["failed"] == ["blob_store"], ready.text
    assert httpx.get(f"{stack.url}/healthz", timeout=30).status_code == 200
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - outage)))
    stack.s3.restore()

    wait_for(stack, run_id, "finished", pool, RUN_TIMEOUT_S)

    check_invariants(stack.postgres.url, run_id)
    assert stack.s3.connections > before, "the blobs went through the proxy after the outage"
    stack.assert_alive()
    assert not pool.failed(), "no worker agent crashed"


# --- protocol faults: a duplicate completion, one under an expired lease, a skewed clock --------


def skewed_clock(directory: Path, seconds: int) -> dict[str, str]:
    """An environment whose Python processes see a wall clock ``seconds`` ahead.

    The hook is a ``sitecustomize`` module on PYTHONPATH: ``time.time`` and ``datetime.now``
    (through a subclass that ``from datetime import datetime`` picks up) are shifted, so the
    agent's code is the shipped code and only the interpreter's clock differs.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        f"""import datetime, time
SKEW = {seconds}
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + SKEW
time.time_ns = lambda: _time_ns() + SKEW * 10**9


class SkewedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return super().now(tz) + datetime.timedelta(seconds=SKEW)

    @classmethod
    def utcnow(cls):
        return super().utcnow() + datetime.timedelta(seconds=SKEW)


datetime.datetime = SkewedDatetime
"""
    )
    return {"PYTHONPATH": f"{directory}{os.pathsep}{ROOT}"}


def log_clock_skew(log: Path) -> float:
    """How far ahead of the file's modification time (this machine's clock) the last JSON
    line of ``log`` was stamped by the agent's clock."""
    from datetime import UTC, datetime

    last = json.loads(log.read_text().splitlines()[-1])
    stamped = datetime.fromisoformat(last["time"].replace("Z", "+00:00"))
    return (stamped - datetime.fromtimestamp(log.stat().st_mtime, UTC)).total_seconds()


def zero_contribution(client: Any, grant: Any, directory: Path) -> list[Any]:
    """Download the lease's base modules and upload an all-zero Δ of each (a valid Δ)."""
    config = RunConfig.model_validate(grant.config)
    directory.mkdir(parents=True, exist_ok=True)
    deltas = {}
    for ref in client.manifest(grant.lease_id, grant.secret).modules:
        client.heartbeat(grant.lease_id, grant.secret)  # leases last seconds here
        path = directory / f"{ref.module_id}.safetensors"
        path.write_bytes(httpx.get(ref.url, timeout=30).raise_for_status().content)
        base = load_module(path, config, ref.module_id)
        deltas[ref.module_id] = {name: torch.zeros_like(t) for name, t in base.items()}
    client.heartbeat(grant.lease_id, grant.secret)
    encoded, _ = encode_deltas(deltas, config, directory / "deltas")
    targets = client.upload_urls(grant.lease_id, grant.secret)
    # The agent's own upload: the presigned form POST (S3 offers no PUT: put_url is empty).
    with contextlib.closing(Transfers(directory)) as transfers:
        for delta in encoded:
            transfers.upload(targets[delta.module_id], delta.path)
    return [Contribution(d.module_id, d.sha256, d.size) for d in encoded]


def tokens_of(grant: Any) -> int:
    """The tokens of the lease's whole allowance: its steps x batch x seq_len (a completion
    must report between units.min_partial_steps and the lease's steps of them)."""
    config = RunConfig.model_validate(grant.config)
    return grant.steps * config.inner.batch_size * config.model.seq_len


@pytest.mark.timeout(300)
def test_a_duplicate_completion_counts_once_a_late_one_is_refused_and_a_skewed_clock_is_harmless(
    stack: Stack, tmp_path: Path
) -> None:
    run_id = start_run(stack, "protocol")
    clients = []
    for name in ("prompt", "late"):
        registration = Client(stack.url).register(stack.enrollment, f"proto-{name}", {})
        clients.append(Client(stack.url, registration.token))
    prompt, late = clients
    prompt_grant = prompt.lease()
    assert prompt_grant is not None
    report = zero_contribution(prompt, prompt_grant, tmp_path / "prompt")
    tokens = tokens_of(prompt_grant)
    first = prompt.complete(
        prompt_grant.lease_id, prompt_grant.secret, report, tokens, {"loss": 7.0}
    )
    again = prompt.complete(
        prompt_grant.lease_id, prompt_grant.secret, report, tokens, {"loss": 7.0}
    )
    assert again == first, "a replayed completion answers like the first"

    late_grant = late.lease()
    assert late_grant is not None
    late_report = zero_contribution(late, late_grant, tmp_path / "late")

    wait_until(
        lambda: (
            sql(stack, "SELECT state FROM rounds_lease WHERE id = %s", late_grant.lease_id)
            == [("expired",)]
        ),
        "the silent lease to expire",
        timeout=LEASE_TIMEOUT_S * 6,
    )
    # An expired lease's Δ is salvaged only while no other lease holds its unit (issue 20);
    # the late worker asking again takes its unit back, so the old lease's Δ is not needed.
    retaken = late.lease()
    assert retaken is not None and retaken.unit_id == late_grant.unit_id, retaken
    with pytest.raises(ServerError) as refused:
        late.complete(
            late_grant.lease_id,
            late_grant.secret,
            late_report,
            tokens_of(late_grant),
            {"loss": 7.0},
        )
    assert refused.value.status == 409 and refused.value.code == "lease_expired", refused.value
    late.release(retaken.lease_id, retaken.secret)

    skewed = WorkerPool(tmp_path / "agents", tmp_path, 1)
    environ = {**stack.environ, **skewed_clock(tmp_path / "skew", SKEW_S)}
    try:
        skewed.start(stack.url, stack.enrollment, environ)
        wait_for(stack, run_id, "finished", skewed, RUN_TIMEOUT_S)
    finally:
        skewed.stop()
        for client in clients:
            client.close()

    check_invariants(
        stack.postgres.url, run_id, [Accepted(prompt_grant.lease_id, tuple(prompt_grant.modules))]
    )
    agent = skewed.workers[0]
    assert agent.snapshot().units_done >= 2, "the skewed worker did the rest of the run"
    assert log_clock_skew(agent.log_path) > SKEW_S - 600, "the worker's clock was skewed"
    lines = (agent.log_path).read_text(errors="replace")
    assert "heartbeat refused" not in lines and "lease_expired" not in lines, lines[-2000:]
    leases = sql(stack, "SELECT l.state, count(*) FROM rounds_lease l JOIN rounds_workunit u"
                 " ON u.id = l.unit_id JOIN rounds_round r ON r.id = u.round_id JOIN"
                 " workers_worker w ON w.id = l.worker_id WHERE r.run_id = %s AND w.name"
                 " NOT LIKE 'proto-%%' GROUP BY l.state", run_id)  # fmt: skip
    assert dict(leases).keys() == {"completed"}, f"the skewed worker's leases: {leases}"
    stack.assert_alive()
