"""A real Prometheus (Debian's package) scrapes an embedded `dipaco server` through a short
real run, as an operator's would: the shipped deploy/prometheus/prometheus.yml with only
its target and token file changed, two `dipaco-worker` processes training a micro model
for two rounds. Prometheus' own HTTP API then answers for the units completed, each path's
validation loss and a round stage's histogram, and the alert rules loaded. Loopback only;
every wait is bounded."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dipaco_demo.control import AdminClient, ServerProcess, embedded_environ, free_port
from dipaco_demo.plan import DemoPlan, stdlib_sample
from dipaco_demo.workers import WorkerPool
from tests.conftest import log_tail, require_service, start_process, stop_process
from tests.test_prometheus_rules import scrape_config

TOKEN = "prometheus-scrape-token-0123456789"
RUN_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 60.0


def admin(environ: dict[str, str], *args: str) -> str:
    command = [sys.executable, "-m", "dipaco_server.cli.admin", *args]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


class Prometheus:
    """`prometheus` on a free loopback port, scraping every second."""

    def __init__(self, directory: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        require_service("prometheus", binary is not None, "apt-get install prometheus")
        assert binary is not None
        config_path = scrape_config(directory, target, TOKEN)
        config = yaml.safe_load(config_path.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "prometheus.log"
        command = [binary, f"--config.file={config_path}",
                   f"--storage.tsdb.path={directory / 'tsdb'}",
                   f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]  # fmt: skip
        self.process = start_process(command, {"PATH": "/usr/bin:/bin"}, self.log)

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        answer.raise_for_status()
        body = answer.json()
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log_tail(self.log)
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"prometheus never became ready:\n{log_tail(self.log)}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    port = free_port()
    environ = {
        **embedded_environ(tmp_path / "data", f"http://127.0.0.1:{port}"),
        "DIPACO_METRICS_TOKEN": TOKEN,
    }
    process = ServerProcess(environ, port, tmp_path / "server.log", task_concurrency=1)
    process.start()
    try:
        process.wait_until_healthy()
        yield process, environ
    finally:
        process.stop()


@pytest.mark.timeout(600)
def test_a_real_prometheus_scrapes_units_losses_and_stage_histograms_during_a_run(
    tmp_path: Path, server: tuple[ServerProcess, dict[str, str]]
) -> None:
    web, environ = server
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{web.port}")
    pool = WorkerPool(tmp_path / "agents", tmp_path, 2)
    try:
        prometheus.wait_ready()
        admin(environ, "createuser", "ops", "--staff")
        token = admin(environ, "token", "create", "ops")
        enrollment = admin(environ, "enroll", "--uses", "10")
        corpus = stdlib_sample(tmp_path / "data" / "corpus", 400_000)  # the default data root
        plan = DemoPlan(model_size="micro", rounds=2, inner_steps=5, workers=2)
        client = AdminClient(web.url, token)
        try:
            dataset = client.dataset("stdlib-sample", str(corpus))["id"]
            config = plan.config("scraped", tmp_path / "corpus").model_dump(mode="json")
            run_id = int(client.create_run("scraped", config, dataset)["id"])
            client.move(run_id, "start")
            wait_for(client, run_id, "ready", web)
            client.move(run_id, "start")
            pool.start(web.url, enrollment, environ)
            wait_for(client, run_id, "finished", web, pool)
        finally:
            client.close()

        # The run finished; Prometheus' last scrape may predate its last round's close:
        # wait (bounded) for a scrape of the final state.
        training = 'dipaco_round_stage_seconds_count{stage="training"}'
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rounds = prometheus.query(training)
            if rounds and float(rounds[0]["value"][1]) >= 2:
                break
            time.sleep(1)
        done = prometheus.query("dipaco_units_completed_total")
        assert done and float(done[0]["value"][1]) >= 4, done
        up = prometheus.query('up{job="dipaco"}')
        assert [float(s["value"][1]) for s in up] == [1.0], up
        # A path's loss: scraped while the run ran (a finished run's series end with it).
        losses = prometheus.query('max_over_time(dipaco_path_validation_loss{run="scraped"}[10m])')
        assert {s["metric"]["path"] for s in losses} >= {"0"}, losses
        assert all(0 < float(s["value"][1]) < 20 for s in losses), losses
        buckets = prometheus.query('dipaco_round_stage_seconds_bucket{stage="training"}')
        by_bound = {s["metric"]["le"]: float(s["value"][1]) for s in buckets}
        assert by_bound.get("+Inf") == 2, by_bound  # both rounds' training
        assert sorted(by_bound.values()) == [by_bound[b] for b in sorted(by_bound, key=float)]
        median = prometheus.query(
            'histogram_quantile(0.5, sum by (le) (dipaco_round_stage_seconds_bucket{stage="outer_step"}))'
        )
        assert median and 0 < float(median[0]["value"][1]) < 600, median
        rules = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()
        alerts = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
        assert "DipacoWorkersStuck" in alerts and "DipacoServerDown" in alerts, alerts
    finally:
        pool.stop()
        stop_process(prometheus.process)


def wait_for(
    client: AdminClient,
    run_id: int,
    wanted: str,
    web: ServerProcess,
    pool: WorkerPool | None = None,
) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        status = client.run(run_id)
        if status["state"] == wanted:
            return
        assert status["state"] not in ("failed", "cancelled"), status["error"]
        assert web.process is not None and web.process.poll() is None, log_tail(web.log_path)
        for worker, code in pool.failed() if pool else ():
            raise AssertionError(f"{worker.name} exited {code}: {worker.snapshot().lines}")
        assert time.monotonic() < deadline, f"run stuck in {status['state']}: {status}"
        time.sleep(0.5)
