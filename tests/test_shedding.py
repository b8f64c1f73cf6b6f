"""Load shedding: new work that waited too long for a web thread is told to come back later.

The middleware tests go through Django's test client with the wait that
dipaco_server.web_worker would have measured set on this thread; the last test runs
``dipaco server``'s own gunicorn command, with its worker class, one thread, and a burst
of concurrent requests, so the waits are real.
"""

from __future__ import annotations

import json
import random
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from dipaco_server import env, shedding, web_worker
from dipaco_server.api import api
from dipaco_server.cli.server import child_commands
from tests.conftest import compose_command, compose_env, log_tail, start_process, stop_process
from tests.test_server_cli import free_port, wait_for_health

pytestmark = pytest.mark.django_db

LEASE = "/api/v1/worker/lease"
HEARTBEAT = "/api/v1/worker/heartbeat"
WORK_IN_HAND = ["/api/v1/worker/lease/7/complete", "/api/v1/worker/lease/7/upload-urls"]
SCRAPE_TOKEN = "shedding-test-scrape-token-0123456789"  # DIPACO_METRICS_TOKEN of the server


@contextmanager
def waited(seconds: float | None) -> Iterator[None]:
    """As if QueueTimingWorker had queued this thread's next request for `seconds`."""
    web_worker._local.queued_s = seconds
    try:
        yield
    finally:
        web_worker._local.queued_s = None


def post(client: Client, path: str, **headers: str) -> Any:
    return client.post(path, {}, content_type="application/json", headers=headers)


def test_a_lease_request_queued_too_long_is_answered_503_with_a_jittered_retry_after(
    client: Client, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.DIPACO_SHED_AFTER_S = 5.0
    with waited(7.0):
        response = post(client, LEASE, Authorization="Bearer whatever")
    assert response.status_code == 503, response.content
    assert "django.request" not in caplog.text  # no error line per shed request
    error = response.json()["error"]
    assert error["code"] == "overloaded"
    assert "DIPACO_SHED_AFTER_S=5" in error["message"] and "Retry-After" in error["message"]
    assert 7 <= int(response["Retry-After"]) <= 14
    assert error["details"] == {"waited_s": 7.0, "retry_after_s": int(response["Retry-After"])}
    # The returns are spread over [wait, 2 x wait] (whole seconds, rounded up), and bounded.
    rng = random.Random(0)
    assert {shedding.retry_after_s(7.0, rng) for _ in range(200)} == set(range(8, 15))
    assert shedding.retry_after_s(0.2, rng) == 1
    assert shedding.retry_after_s(100.0, rng) == shedding.MAX_RETRY_AFTER_S


def test_an_idle_heartbeat_is_shed_but_one_that_keeps_a_lease_alive_is_served(
    client: Client, settings: Any
) -> None:
    settings.DIPACO_SHED_AFTER_S = 5.0
    with waited(6.0):
        assert post(client, HEARTBEAT).status_code == 503
    with waited(6.0):
        # No token: served, so refused by auth, not by the shedder.
        assert post(client, HEARTBEAT, X_Lease_Secret="s").status_code == 401


@pytest.mark.parametrize("path", WORK_IN_HAND)
def test_work_in_hand_is_served_however_long_it_waited(
    client: Client, settings: Any, path: str
) -> None:
    settings.DIPACO_SHED_AFTER_S = 5.0
    with waited(120.0):
        assert post(client, path, X_Lease_Secret="s").status_code == 401


@pytest.mark.parametrize(("wait", "limit"), [(4.9, 5.0), (120.0, None), (None, 5.0)])
def test_nothing_is_shed_under_the_limit_with_shedding_off_or_outside_our_worker(
    client: Client, settings: Any, wait: float | None, limit: float | None
) -> None:
    settings.DIPACO_SHED_AFTER_S = limit
    with waited(wait):
        assert post(client, LEASE, Authorization="Bearer whatever").status_code == 401


def test_dipaco_shed_after_s_is_parsed_and_a_bad_value_names_the_fix() -> None:
    assert env.shed_after_s({}) == env.DEFAULT_SHED_AFTER_S == 5.0
    assert env.shed_after_s({"DIPACO_SHED_AFTER_S": "2.5"}) == 2.5
    assert env.shed_after_s({"DIPACO_SHED_AFTER_S": "off"}) is None
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ImproperlyConfigured, match=r"DIPACO_SHED_AFTER_S=.*e\.g\. 5"):
            env.shed_after_s({"DIPACO_SHED_AFTER_S": bad})


def test_the_openapi_schema_documents_the_503_on_the_routes_that_may_be_shed() -> None:
    paths = api.get_openapi_schema()["paths"]
    for method, path in shedding.SHEDDABLE:
        answer = paths[path][method.lower()]["responses"]["503"]
        assert "Retry-After" in answer["headers"]
    assert "503" not in paths["/api/v1/worker/lease/{lease_id}/complete"]["post"]["responses"]


def send(url: str, secret: bool) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer nobody"}
    if secret:
        headers["X-Lease-Secret"] = "s"
    request = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_dipaco_servers_gunicorn_measures_the_queue_and_sheds_only_new_work(
    tmp_path: Path,
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    environ = compose_env(
        DIPACO_DATA_DIR=str(tmp_path),
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        # Any wait at all: a burst at one thread makes most requests wait for it.
        DIPACO_SHED_AFTER_S="0.001",
        DIPACO_RATE_LIMIT_ADDRESS="off",
        DIPACO_RATE_LIMIT_WORKER="off",
        DIPACO_METRICS_TOKEN=SCRAPE_TOKEN,
    )
    migrate = subprocess.run(
        compose_command("migrate", environ), env=environ, capture_output=True, timeout=180
    )
    assert migrate.returncode == 0, migrate.stderr
    web = child_commands("127.0.0.1", port, web_workers=1, task_concurrency=1, web_threads=1)
    log = tmp_path / "web.log"
    server = start_process(web["web"], environ, log)
    try:
        wait_for_health(base, server, log)
        urls = [(f"{base}{LEASE}", False), (f"{base}{WORK_IN_HAND[0]}", True)] * 40
        with ThreadPoolExecutor(max_workers=40) as pool:
            answers = list(pool.map(lambda u: (u[0], *send(*u)), urls))
        # One web process: its /metrics counted every request above.
        scrape = urllib.request.Request(
            f"{base}/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}
        )
        with urllib.request.urlopen(scrape, timeout=30) as reply:
            scraped = reply.read().decode()
    finally:
        assert stop_process(server) == 0, log_tail(log)
    lease = [(code, body) for url, code, body in answers if url.endswith(LEASE)]
    shed = [body["error"] for code, body in lease if code == 503]
    assert shed, f"no lease request was shed: {lease}"
    assert all(error["code"] == "overloaded" for error in shed)
    # Shed past 0.001 s; the answer rounds the wait to the millisecond (0.0012 -> 0.001).
    assert all(error["details"]["waited_s"] >= 0.001 for error in shed)
    assert {code for code, _ in lease} <= {401, 503}
    # Completions waited in the same queue and were all served (refused by auth).
    assert {code for url, code, _ in answers if not url.endswith(LEASE)} == {401}
    assert "overloaded: shed" in log_tail(log, 400)
    counted = {s.name: s.value for f in text_string_to_metric_families(scraped) for s in f.samples
               if s.name == "dipaco_requests_shed_total"}  # fmt: skip
    assert counted == {"dipaco_requests_shed_total": len(shed)}, counted
    answered = [s for f in text_string_to_metric_families(scraped) for s in f.samples
                if s.name == "dipaco_http_requests_total" and s.labels["status"] == "503"]  # fmt: skip
    assert sum(s.value for s in answered) == len(shed), answered
    assert all("worker/lease" in s.labels["route"] for s in answered), answered


def test_a_process_holds_as_many_connections_as_the_open_files_limit_allows() -> None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert web_worker.raise_open_files_limit() >= soft  # raised to the hard limit at most
    assert web_worker.connection_room(10_000, 4, open_files=20_000) == 10_000
    assert web_worker.connection_room(10_000, 4, open_files=1_024) == 1_024 - 256
    assert web_worker.connection_room(10_000, 4, open_files=100) == 5  # the threads' own
    assert web_worker.connection_room(500, 4, open_files=resource.RLIM_INFINITY) == 500
    assert "--worker-connections" in child_commands("127.0.0.1", 1, 1, 1)["web"]
