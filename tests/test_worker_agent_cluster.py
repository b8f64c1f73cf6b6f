"""The worker agent on the real cluster: a 2x1 run survives a volunteer killed with -9.

The control plane is docker-compose.yml's own commands (migrate, web = gunicorn, worker =
Celery, beat) on a fresh PostgreSQL database, Redis as the broker and the moto S3 server
as the blob store; two `dipaco-worker --json-logs` processes train a 2x1 run (2 levels of
1 module: one path, two replicas, so each worker has a unit per round) for 3 rounds.

In round 1 one worker is killed with SIGKILL while it trains. It cannot release its lease,
so only the lease liveness timeout can return the unit: the deployment's settings module
(``DJANGO_SETTINGS_MODULE``, the Django way to give a deployment its own settings; the
scheduling policy reads Django settings) shortens it to a few seconds and runs beat's
sweep every second. The surviving worker must then redo the unit and the run finish,
with every round closed, each module one version further per round, validation loss
lower at the end than after the first round, no unit completed twice and no module
version skipped or written twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from dipaco_demo.control import AdminClient, free_port
from dipaco_demo.plan import DemoPlan, stdlib_sample
from dipaco_demo.workers import worker_command
from tests.conftest import (
    S3Server,
    compose_command,
    compose_env,
    log_tail,
    start_process,
    stop_process,
    with_database,
)

ROUNDS = 3
# Inner steps per unit: a few seconds of CPU for the micro model, so a kill lands mid-unit.
INNER_STEPS = 80
LEASE_TIMEOUT_S = 8  # agents heartbeat every 8/3 s; a dead one's lease is gone 8 s later
SWEEP_EVERY_S = 1.0
READY_TIMEOUT_S = 90.0
RUN_TIMEOUT_S = 240.0
# A Redis db nobody flushes: not 15 (the redis_url fixture's, flushed by every pytest session),
# 13 (test_cluster_mode's), 12 (bench/control_plane.py's) or 11 (bench/soak.py's); a flush
# mid-round loses the chord that closes it. The test's own Celery queue keeps concurrent
# sessions on this db apart, and its results expire on their own.
REDIS_DB = 14
MODULES = ("0.0", "1.0", "shared")  # what a 2x1 layout of the micro model is made of

SETTINGS_MODULE = """\
from dipaco_server.settings import *  # noqa: F403

DIPACO_LEASE_TIMEOUT_S = {lease_timeout}
# Every unit done before a round closes: the killed worker's unit waits for the survivor
# to redo it, not cut by the adaptive deadline once the other unit makes a quorum.
DIPACO_ROUND_QUORUM = 1.0
CELERY_TASK_DEFAULT_QUEUE = {queue!r}
CELERY_RESULT_EXPIRES = 600
CELERY_BEAT_SCHEDULE = {{
    name: {{**entry, "schedule": {sweep}}}
    for name, entry in CELERY_BEAT_SCHEDULE.items()  # noqa: F405
}}
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


class Agent:
    """A `dipaco-worker --json-logs` process; a thread keeps its events and its log file."""

    def __init__(self, name: str, data_dir: Path, log_path: Path) -> None:
        self.name, self.data_dir, self.log_path = name, data_dir, log_path
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.process: subprocess.Popen[str] | None = None

    def start(self, server: str, enrollment: str, environ: dict[str, str]) -> None:
        command = [*worker_command(), "--server", server, "--data-dir", str(self.data_dir),
                   "--enroll", enrollment, "--name", self.name, "--json-logs", "--threads", "1",
                   "--probe-seconds", "0.1", "--checkpoint-every", "1000"]  # fmt: skip
        self.process = subprocess.Popen(
            command, env={**environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with self.log_path.open("a", encoding="utf-8") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a traceback or a library's warning: it is in the log
                if isinstance(event, dict):
                    with self._lock:
                        self.events.append(event)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill_9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def tail(self) -> str:
        return f"{self.name}:\n{log_tail(self.log_path, 25)}"


def training_in_round(agent: Agent, t: int) -> dict[str, Any] | None:
    """The lease event of `agent`'s unit in round t once it reported a step short of the end."""
    lease = None
    for event in agent.snapshot():
        if event.get("event") == "lease":
            lease = event if event.get("round") == t else None
        elif (
            lease is not None
            and event.get("event") == "step"
            and event.get("lease_id") == lease["lease_id"]
            and event["step"] < event["steps"]
        ):
            return lease
    return None


def admin(environ: dict[str, str], *args: str) -> str:
    """`dipaco admin ARGS` against the cluster's database; the secret it prints."""
    command = [sys.executable, "-m", "dipaco_server.cli.admin", *args]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def database_url(postgres_url: str) -> Iterator[str]:
    """A database of its own: the session's postgres_url may be another cluster test's."""
    import psycopg

    name = f"dipaco_agents_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    server = with_database(postgres_url, "postgres")
    with psycopg.connect(server, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield with_database(postgres_url, name)
    with psycopg.connect(server, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def cluster(
    tmp_path: Path, database_url: str, redis_url: str, s3_server: S3Server, s3_bucket: str
) -> Iterator[dict[str, Any]]:
    import redis

    queue = f"dipaco-agents-{uuid.uuid4().hex[:8]}"
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir()
    (settings_dir / "agent_cluster_settings.py").write_text(
        SETTINGS_MODULE.format(lease_timeout=LEASE_TIMEOUT_S, queue=queue, sweep=SWEEP_EVERY_S)
    )
    redis_db = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    port = free_port()
    python_path = os.pathsep.join(filter(None, [str(settings_dir), os.environ.get("PYTHONPATH")]))
    environ = compose_env(
        DATABASE_URL=database_url, REDIS_URL=redis_db, **s3_server.environ(s3_bucket),
        DIPACO_DATA_DIR=str(tmp_path / "data"), DIPACO_PUBLIC_URL=f"http://127.0.0.1:{port}",
        DIPACO_HOST="127.0.0.1", DIPACO_PORT=str(port), WEB_CONCURRENCY="2",
        CELERY_CONCURRENCY="2", DJANGO_SETTINGS_MODULE="agent_cluster_settings",
        PYTHONPATH=python_path,
    )  # fmt: skip
    migrate = subprocess.run(
        compose_command("migrate", environ), env=environ, capture_output=True, timeout=180
    )
    assert migrate.returncode == 0, migrate.stderr
    processes = {
        name: start_process(compose_command(name, environ), environ, tmp_path / f"{name}.log")
        for name in ("web", "worker", "beat")
    }
    agents = [Agent(f"agent-{i}", tmp_path / f"agent-{i}", tmp_path / f"agent-{i}.log")
              for i in range(2)]  # fmt: skip
    try:
        yield {"environ": environ, "url": f"http://127.0.0.1:{port}", "agents": agents,
               "processes": processes, "logs": tmp_path, "database": database_url}  # fmt: skip
    finally:
        running = [a.process for a in agents if a.process is not None] + [*processes.values()]
        for process in running:  # all at once: each takes seconds to wind down
            if process.poll() is None:
                process.terminate()
        for process in running:
            stop_process(process)  # type: ignore[arg-type]
        client = redis.Redis.from_url(redis_db)
        for key in client.scan_iter(f"*{queue}*"):
            client.delete(key)
        client.close()


def failure_report(cluster: dict[str, Any]) -> str:
    logs = [f"{n}:\n{log_tail(cluster['logs'] / f'{n}.log', 25)}" for n in ("web", "worker")]
    return "\n".join(logs + [agent.tail() for agent in cluster["agents"]])


def wait_until(check: Callable[[], Any], what: str, cluster: dict[str, Any], timeout: float) -> Any:
    """check()'s first truthy value, polling; fails with the logs if a process died."""
    deadline = time.monotonic() + timeout
    while True:
        for name, process in cluster["processes"].items():
            assert process.poll() is None, f"{name} exited:\n{failure_report(cluster)}"
        if value := check():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{failure_report(cluster)}")
        time.sleep(0.2)


def run_state(client: AdminClient, run_id: int, wanted: str) -> dict[str, Any] | None:
    status = client.run(run_id)
    assert status["state"] not in ("failed", "cancelled"), status["error"]
    return status if status["state"] == wanted else None


def healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/api/v1/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def query(database: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(database, connect_timeout=5) as conn:
        return list(conn.execute(sql, params).fetchall())


def test_a_2x1_run_on_the_cluster_finishes_after_a_worker_is_killed_mid_unit(
    tmp_path: Path, cluster: dict[str, Any]
) -> None:
    environ, url, agents = cluster["environ"], cluster["url"], cluster["agents"]
    with ThreadPoolExecutor(1) as pool:
        enrolling = pool.submit(admin, environ, "enroll", "--uses", "2")
        admin(environ, "createuser", "ops", "--staff")
        client = AdminClient(url, admin(environ, "token", "create", "ops"))
        enrollment = enrolling.result()
    wait_until(lambda: healthy(url), "the web to answer", cluster, READY_TIMEOUT_S)
    # The agents start (torch, speed probe, enrollment) while the run's data is prepared;
    # until the run starts they are told there is no work.
    for agent in agents:
        agent.start(url, enrollment, environ)

    corpus = stdlib_sample(tmp_path / "data" / "corpus", 300_000)  # the default data root
    dataset = client.dataset("stdlib-sample", str(corpus))
    plan = DemoPlan(paths=(2, 1), model_size="micro", rounds=ROUNDS, inner_steps=INNER_STEPS)
    config = plan.config("agents", corpus).model_dump(mode="json")
    assert config["replicas_per_path"] == 2, "one unit per worker and round"
    run_id = client.create_run("agents", config, dataset["id"])["id"]
    client.move(run_id, "start")
    wait_until(lambda: run_state(client, run_id, "ready"), "ready", cluster, READY_TIMEOUT_S)
    client.move(run_id, "start")

    def victim() -> tuple[Agent, dict[str, Any]] | None:
        for agent in agents:
            assert agent.exit_code() is None, f"{agent.name} exited:\n{agent.tail()}"
            if (lease := training_in_round(agent, 1)) is not None:
                return agent, lease
        return None

    killed, lost = wait_until(victim, "a worker training in round 1", cluster, RUN_TIMEOUT_S)
    killed.kill_9()
    survivor = next(agent for agent in agents if agent is not killed)

    def finished() -> dict[str, Any] | None:
        assert survivor.exit_code() is None, f"{survivor.name} exited:\n{survivor.tail()}"
        return run_state(client, run_id, "finished")

    status = wait_until(finished, "the run to finish", cluster, RUN_TIMEOUT_S)
    losses = {p["round"]: p["value"] for p in client.metrics(run_id, "val_loss")}
    client.close()
    database = cluster["database"]

    # Every round closed, and each module took exactly one outer step per round.
    assert status["current_round"] == ROUNDS - 1
    rounds = query(database, "SELECT t, state FROM rounds_round ORDER BY t")
    assert rounds == [(t, "closed") for t in range(ROUNDS)]
    assert {m["module_id"]: m["current_version"] for m in status["modules"]} == {
        m: ROUNDS for m in MODULES
    }
    versions = query(database, "SELECT m.module_id, v.version FROM runs_moduleversion v "
                     "JOIN runs_module m ON m.id = v.module_id ORDER BY 1, 2")  # fmt: skip
    assert versions == [(m, v) for m in MODULES for v in range(ROUNDS + 1)], "none skipped or twice"
    bases = query(database, "SELECT r.t, u.base_versions FROM rounds_workunit u "
                  "JOIN rounds_round r ON r.id = u.round_id ORDER BY r.t, u.replica")  # fmt: skip
    assert bases == [(t, {m: t for m in MODULES}) for t in range(ROUNDS) for _ in range(2)], (
        "every unit of round t trained from version t of each module"
    )

    # The killed worker's lease expired (it could not release it); the survivor redid its unit.
    leases = query(database, "SELECT l.id, l.unit_id, l.state, l.attempt, w.name, u.state "
                   "FROM rounds_lease l JOIN workers_worker w ON w.id = l.worker_id "
                   "JOIN rounds_workunit u ON u.id = l.unit_id ORDER BY l.id")  # fmt: skip
    by_id = {row[0]: row for row in leases}
    _, unit, state, attempt, holder, _ = by_id[lost["lease_id"]]
    assert (state, attempt, holder) == ("expired", 1, killed.name)
    redo = [row for row in leases if row[1] == unit and row[0] != lost["lease_id"]]
    assert [(r[2], r[3], r[4], r[5]) for r in redo] == [("completed", 2, survivor.name, "done")]
    completed = [row[1] for row in leases if row[2] == "completed"]
    assert sorted(completed) == sorted(set(completed)), "no unit completed twice"
    assert len(completed) == ROUNDS * 2 and {row[5] for row in leases} == {"done"}
    accepted = query(database, "SELECT r.t, m.module_id, count(*) FROM rounds_contribution c "
                     "JOIN rounds_workunit u ON u.id = c.unit_id JOIN rounds_round r "
                     "ON r.id = u.round_id JOIN runs_module m ON m.id = c.module_id "
                     "WHERE c.status = 'accepted' GROUP BY 1, 2 ORDER BY 1, 2")  # fmt: skip
    assert accepted == [(t, m, 2) for t in range(ROUNDS) for m in MODULES]
    # After the kill the survivor did the rest: round 1's other unit, the redone one, round 2.
    late = query(database, "SELECT w.name, count(*) FROM rounds_lease l JOIN rounds_workunit u "
                 "ON u.id = l.unit_id JOIN rounds_round r ON r.id = u.round_id JOIN "
                 "workers_worker w ON w.id = l.worker_id WHERE r.t >= 1 AND l.state = "
                 "'completed' GROUP BY 1")  # fmt: skip
    assert late == [(survivor.name, 4)]

    # Training worked: the routed validation loss fell from the first round to the last.
    assert sorted(losses) == list(range(ROUNDS)), losses
    assert losses[ROUNDS - 1] < losses[0], losses
