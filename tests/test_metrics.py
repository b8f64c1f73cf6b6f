"""GET /metrics (rounds.reports.scrape), the probes /healthz and /readyz (core.probes), and
the stuck-worker and stalled-round flags (rounds.reports.activity), on the real database:
who may scrape, what a real two-round run's scrape holds, a worker that heartbeats over
HTTP without completing, a round open past twice its expected duration, and the blob store
(the moto S3 server behind the fault tests' proxy) stopped under /readyz."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client, override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.monitoring import names
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.models import Contribution, Round
from dipaco_server.rounds.reports import activity
from dipaco_server.rounds.reports.metrics import reason_code
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token
from tests.conftest import S3Server
from tests.faults import TcpProxy
from tests.test_models import make_run, prepare_run
from tests.test_untrusted import one_torch_thread, step_round, submit, two_worker_run, work

__all__ = ["one_torch_thread", "work"]  # fixtures, used by name

pytestmark = pytest.mark.django_db
METRICS_TOKEN = "scrape-secret-0123456789abcdef"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def staff_token(name: str = "ops", staff: bool = True) -> str:
    user, _ = create_user(name, staff=staff)
    return create_api_token(user, name="tests")[1]


def scrape(client: Client, token: str = METRICS_TOKEN) -> dict[str, list[Any]]:
    """Every sample of an authorised scrape, by sample name: [(labels, value)]."""
    with override_settings(DIPACO_METRICS_TOKEN=METRICS_TOKEN):
        answer = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.content
    assert answer["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(answer.content.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [
        v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    ]
    assert len(found) == 1, f"{name}{labels}: {samples.get(name)}"
    return float(found[0])


# --- who may scrape ----------------------------------------------------------------------------


def test_an_anonymous_scrape_is_refused_with_a_message_naming_the_variables(client: Client) -> None:
    answer = client.get("/metrics")
    assert answer.status_code == 401
    error = answer.json()["error"]
    assert error["code"] == "metrics_unauthenticated"
    assert "DIPACO_METRICS_TOKEN" in error["message"]
    assert "DIPACO_METRICS_ALLOW" in error["message"]


@override_settings(DIPACO_METRICS_TOKEN=METRICS_TOKEN)
def test_a_scrape_with_the_metrics_token_or_a_staff_token_is_served(client: Client) -> None:
    for token in (METRICS_TOKEN, staff_token()):
        answer = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200, answer.content
        assert b"# TYPE dipaco_units_completed_total counter" in answer.content


@override_settings(DIPACO_METRICS_TOKEN=METRICS_TOKEN)
def test_a_wrong_token_or_a_non_staff_users_token_is_refused(client: Client) -> None:
    wrong = client.get("/metrics", headers={"Authorization": "Bearer not-the-token-at-all"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "metrics_forbidden"
    volunteer = staff_token("volunteer", staff=False)
    refused = client.get("/metrics", headers={"Authorization": f"Bearer {volunteer}"})
    assert refused.status_code == 403, refused.content
    assert "DIPACO_METRICS_TOKEN" in refused.json()["error"]["message"]


def test_an_address_on_the_allow_list_scrapes_without_a_token_and_others_do_not(
    client: Client,
) -> None:
    import ipaddress

    allowed = [ipaddress.ip_network("10.1.0.0/16"), ipaddress.ip_network("127.0.0.1/32")]
    with override_settings(DIPACO_METRICS_ALLOW=allowed):
        assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
        assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
        assert client.get("/metrics", REMOTE_ADDR="10.2.0.1").status_code == 401
        assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 401


def test_the_metrics_variables_refuse_malformed_values_naming_them() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from dipaco_server import env

    with pytest.raises(ImproperlyConfigured, match=r"DIPACO_METRICS_ALLOW=.*'10\.0\.0\.300'"):
        env.metrics_allow({"DIPACO_METRICS_ALLOW": "127.0.0.1, 10.0.0.300"})
    with pytest.raises(ImproperlyConfigured, match=r"DIPACO_METRICS_TOKEN=.*shorter than 16"):
        env.metrics_token({"DIPACO_METRICS_TOKEN": "short"})
    assert [str(n) for n in env.metrics_allow({"DIPACO_METRICS_ALLOW": "::1,10.0.0.0/8"})] == [
        "::1/128",
        "10.0.0.0/8",
    ]


# --- what a scrape holds -----------------------------------------------------------------------


def test_a_two_round_runs_scrape_counts_its_units_losses_stages_and_requests(
    work: Path, client: Client
) -> None:
    run, sources = two_worker_run(work)
    run.paths.update(val_tokens=2000)  # with_data's validation shards: evaluation scores them
    for t in range(2):
        for name in ("a", "b"):
            submit(run, f"{name}-{t}", sources, manifest=True)
        step_round(run, t)
    client.get("/healthz")
    samples = scrape(client)

    assert value(samples, "dipaco_units_completed_total") == 4
    assert value(samples, "dipaco_contributions_accepted_total") > 0
    assert value(samples, "dipaco_leases_granted_total") == 4
    assert value(samples, "dipaco_leases_ended_total", state="completed") == 4
    assert value(samples, "dipaco_upload_bytes_total") > 0
    assert value(samples, "dipaco_runs", state="running") == 1
    assert value(samples, "dipaco_run_round", run=run.name) == 2
    assert value(samples, "dipaco_run_phase", run=run.name, phase="2") == 1
    assert 0 <= value(samples, "dipaco_round_open_age_seconds", run=run.name) < 600
    assert value(samples, "dipaco_round_stalled", run=run.name) == 0
    loss = value(samples, "dipaco_path_validation_loss", run=run.name, path="0")
    assert 0 < loss < 20, loss
    for stage in ("training", "outer_step", "evaluation"):
        assert value(samples, "dipaco_round_stage_seconds_count", stage=stage) == 2, stage
        assert value(samples, "dipaco_round_stage_seconds_bucket", stage=stage, le="+Inf") == 2
    assert value(samples, "dipaco_workers", state="idle") == 4, "two per round, none leasing"
    assert value(samples, "dipaco_http_requests_total", route="healthz", method="GET",
                 status="200") >= 1  # fmt: skip
    assert value(samples, "dipaco_scrape_errors_total", part="runs") == 0
    bounds = [(float(labels["le"]), v) for labels, v in
              samples["dipaco_round_stage_seconds_bucket"] if labels["stage"] == "outer_step"]  # fmt: skip
    assert [v for _, v in sorted(bounds)] == sorted(v for _, v in bounds), "cumulative"
    assert value(samples, "dipaco_round_stage_seconds_sum", stage="outer_step") > 0

    accepted = value(samples, "dipaco_contributions_accepted_total")
    rows = list(Contribution.objects.order_by("pk").values_list("pk", flat=True)[:3])
    for pk, reason in zip(rows, ("norm_outlier: 12x the median", "norm_outlier: 3x",
                                 "Not a coded reason"), strict=True):  # fmt: skip
        Contribution.objects.filter(pk=pk).update(status="rejected", reason=reason)
    rejected = scrape(client)
    assert value(rejected, "dipaco_contributions_rejected_total", reason="norm_outlier") == 2
    assert value(rejected, "dipaco_contributions_rejected_total", reason="other") == 1
    assert value(rejected, "dipaco_contributions_accepted_total") == accepted - 3

    served = set(samples)
    for metric in names.ALL:
        if metric in (names.CELERY_QUEUE_LENGTH, names.PREPARATION_PIECES, names.REQUESTS_SHED):
            continue  # no Redis broker, no preparation, nothing shed in this test
        if metric is names.CONTRIBUTIONS_REJECTED:
            continue  # nothing rejected in the first scrape: no sample yet (above: after)
        assert set(metric.samples) <= served, metric.name


def test_a_rejections_reason_code_is_its_label_and_anything_else_is_other() -> None:
    assert reason_code("norm_outlier: 12x the median") == "norm_outlier"
    assert reason_code("no_gain: the loss did not fall") == "no_gain"
    assert reason_code("Something odd happened") == "other"
    assert reason_code("x" * 80 + ": long") == "other"


# --- stuck workers and stalled rounds ----------------------------------------------------------


def register(client: Client, enrollment: str, name: str) -> dict[str, str]:
    answer = client.post(
        "/api/v1/worker/register",
        {"enrollment_token": enrollment, "name": name, "device": {}},
        content_type="application/json",
    )
    assert answer.status_code == 201, answer.content
    return {"Authorization": f"Bearer {answer.json()['token']}"}


def heartbeat(client: Client, headers: dict[str, str], lease: dict[str, Any] | None) -> None:
    body = {"lease_id": lease["lease_id"]} if lease else {}
    extra = {"X-Lease-Secret": lease["lease_secret"]} if lease else {}
    answer = client.post(
        "/api/v1/worker/heartbeat", body, content_type="application/json",
        headers={**headers, **extra},
    )  # fmt: skip
    assert answer.status_code == 200, answer.content


@override_settings(DIPACO_LEASE_TIMEOUT_S=1.0)
def test_a_worker_that_heartbeats_without_completing_for_three_lease_timeouts_is_stuck(
    client: Client,
) -> None:
    from dipaco_server.rounds.protocol import pacing

    pacing._heartbeating = (float("-inf"), 0)  # this process's count from earlier tests
    start_run(prepare_run(make_run()))
    _, enrollment = create_enrollment_token(max_uses=None)
    hung, waiting = register(client, enrollment, "hung"), register(client, enrollment, "waiting")
    started = time.monotonic()  # before the grant: `at` below is never less than its age
    granted = client.post("/api/v1/worker/lease", headers=hung)
    assert granted.status_code == 200, granted.content
    lease = granted.json()
    staff = {"Authorization": f"Bearer {staff_token()}"}
    listed = client.get("/api/v1/workers", headers=staff).json()["items"]
    ids = {w["name"]: w["id"] for w in listed}
    worker_id = ids["hung"]

    def state() -> str:
        answer = client.get(f"/api/v1/workers/{worker_id}", headers=staff)
        assert answer.status_code == 200, answer.content
        return str(answer.json()["state"])

    seen = []
    while time.monotonic() - started < 3 * 1.0 + 1.0:  # three lease timeouts, and a margin
        heartbeat(client, hung, lease)
        heartbeat(client, waiting, None)
        now_state = state()
        seen.append((round(time.monotonic() - started, 2), now_state))  # timed after asking
        time.sleep(0.25)
    early = [s for at, s in seen if at < 2.5]
    assert early and set(early) == {"training"}, seen
    assert seen[-1][1] == "stuck", seen

    samples = scrape(client)
    assert value(samples, "dipaco_workers", state="stuck") == 1
    assert value(samples, "dipaco_workers", state="idle") == 1, "the waiting worker"
    assert value(samples, "dipaco_workers", state="training") == 0
    fresh = register(client, enrollment, "fresh")
    assert client.post("/api/v1/worker/lease", headers=fresh).status_code == 200
    assert value(scrape(client), "dipaco_workers", state="training") == 1, "a new lease: not stuck"

    page = client.get(f"/workers/{worker_id}/").content.decode()
    assert 'data-activity="stuck"' in page and "data-stuck" in page
    listed_page = client.get("/workers/").content.decode()
    row = listed_page[listed_page.index(f'data-worker="{worker_id}"') :].split("</tr>")[0]
    assert "data-stuck" in row
    other = ids["waiting"]
    assert 'data-activity="idle"' in client.get(f"/workers/{other}/").content.decode()

    register(client, enrollment, "gone")
    Worker.objects.filter(name="gone").update(last_seen=timezone.now() - timedelta(days=1))
    Worker.objects.filter(name="waiting").update(revoked=True)
    Worker.objects.filter(name="fresh").update(trust=0.1)  # below DIPACO_MIN_TRUST (0.3)
    states = {s: value(scrape(client), "dipaco_workers", state=s) for s in activity.STATES}
    assert states == {"training": 0, "idle": 0, "stuck": 1, "offline": 1, "distrusted": 1,
                      "revoked": 1}, states  # fmt: skip


def test_a_round_open_past_twice_its_expected_duration_is_flagged_on_the_run_page(
    client: Client,
) -> None:
    round0 = start_run(prepare_run(make_run()))
    run = round0.run
    now = timezone.now()
    # Round 0 took 100 s; round 1 has been open for 150 s: expected, not stalled.
    Round.objects.filter(pk=round0.pk).update(
        state=Round.State.CLOSED, opened_at=now - timedelta(seconds=400),
        closed_at=now - timedelta(seconds=300),
    )  # fmt: skip
    round1 = Round.objects.create(run=run, t=1, opened_at=now - timedelta(seconds=150))
    run.current_round = 1
    run.save(update_fields=["current_round"])
    assert "data-round-stalled" not in client.get(f"/runs/{run.pk}/").content.decode()
    assert value(scrape(client), "dipaco_round_stalled", run=run.name) == 0

    Round.objects.filter(pk=round1.pk).update(opened_at=now - timedelta(seconds=250))
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-round-stalled="1"' in page, page[:3000]
    assert "more than twice" in page
    samples = scrape(client)
    assert value(samples, "dipaco_round_stalled", run=run.name) == 1
    assert value(samples, "dipaco_round_expected_seconds", run=run.name) == 100
    assert value(samples, "dipaco_round_open_age_seconds", run=run.name) >= 250


# --- probes ------------------------------------------------------------------------------------


def test_healthz_answers_without_touching_anything_and_readyz_checks_all_three(
    client: Client,
) -> None:
    healthy = client.get("/healthz")
    assert healthy.status_code == 200 and healthy.json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.content
    assert set(ready.json()["checks"]) == {"database", "broker", "blob_store"}
    assert ready.json()["failed"] == []


def refused_by(port: int, timeout: float = 10.0) -> None:
    """Wait until the cut proxy refuses connections (its acceptor may take one more)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
        except OSError:
            return
        time.sleep(0.1)
    raise AssertionError(f"127.0.0.1:{port} still accepts connections")


@override_settings(DIPACO_METRICS_TOKEN=METRICS_TOKEN)
def test_probes_and_the_scrape_answer_any_host_name_and_other_routes_keep_the_check(
    client: Client,
) -> None:
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    for host in ("web:8000", "10.9.8.7:8000"):  # compose's service name, a container's IP
        assert client.get("/healthz", HTTP_HOST=host).status_code == 200
        assert client.get("/readyz", HTTP_HOST=host).status_code == 200
        assert client.get("/metrics", HTTP_HOST=host, headers=scraper).status_code == 200
        assert client.get("/metrics", HTTP_HOST=host).status_code == 401, "still guarded"
        assert client.get("/api/v1/health", HTTP_HOST=host).status_code == 400
        assert client.get("/", HTTP_HOST=host).status_code == 400


def test_readyz_names_the_blob_store_when_the_s3_server_is_stopped(
    client: Client, s3_server: S3Server, s3_bucket: str
) -> None:
    proxy = TcpProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]))
    proxy.start()
    store = {
        "backend": "s3",
        "endpoint_url": f"http://127.0.0.1:{proxy.port}",
        "bucket": s3_bucket,
        "access_key_id": s3_server.access_key_id,
        "secret_access_key": s3_server.secret_access_key,
        "region": s3_server.region,
    }
    try:
        with override_settings(DIPACO_BLOB_STORE=store):
            ready = client.get("/readyz")
            assert ready.status_code == 200, ready.content
            assert ready.json()["checks"]["blob_store"] == {"ok": True, "detail": "s3"}
            proxy.cut()
            refused_by(proxy.port)
            started = time.monotonic()
            down = client.get("/readyz")
            assert time.monotonic() - started < 10, "the probe does not retry for long"
            assert client.get("/healthz").status_code == 200, "liveness touches no store"
    finally:
        proxy.stop()
    assert down.status_code == 503, down.content
    body = down.json()
    assert body["failed"] == ["blob_store"] and "blob_store" in body["message"]
    assert s3_bucket in body["checks"]["blob_store"]["detail"]
    assert body["checks"]["database"]["ok"] and body["checks"]["broker"]["ok"]


MULTIPROCESS_CHILD = """
import os
import django

django.setup()
from prometheus_client import generate_latest

from dipaco_server.monitoring import http

http.REQUESTS.labels("healthz", "GET", "200").inc()
child = os.fork()  # a second web process, as gunicorn forks its workers
if child == 0:
    http.REQUESTS.labels("healthz", "GET", "200").inc()
    http.SHED.inc()
    os._exit(0)
os.waitpid(child, 0)
print(generate_latest(http.process_registry()).decode())
"""


def test_with_prometheus_multiproc_dir_the_http_counts_are_summed_over_processes(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    shared = tmp_path / "multiproc"
    shared.mkdir()
    environ = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared),
               "DIPACO_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", MULTIPROCESS_CHILD], env=environ,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 'dipaco_http_requests_total{method="GET",route="healthz",status="200"} 2.0' in lines
    assert "dipaco_requests_shed_total 1.0" in lines
    assert len(list(shared.glob("counter_*.db"))) == 2, "one file per process"
