"""No number a worker or an operator sends can break the server (issue 34).

A completion reports the worker's own training metrics only, closed and bounded; the
speed that sizes a worker's units is the smaller of its claim and the server's measure;
a completion is answered only when its uploads are in the store; every run config field
has a bound a real run can hold; a run that ended holds no lease; and the audit log
records the status the client got. On the real services: PostgreSQL (the session's
database) and the local blob store.
"""

from __future__ import annotations

import json
import math
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import DataError
from django.test import Client

from dipaco.config import MAX_DATA_POSITION, RunConfig
from dipaco.data.windows import step_tokens, unit_start, unit_tokens, unit_windows
from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.audit.models import AuditEntry
from dipaco_server.audit.services import _refusal
from dipaco_server.rounds.models import Contribution, Lease
from dipaco_server.rounds.protocol.complete import ContributionReport, complete
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.protocol.sizing import size_unit
from dipaco_server.rounds.protocol.worker_metrics import SERVER_SERIES, WorkerMetricsIn
from dipaco_server.runs import keys
from dipaco_server.runs.models import MetricPoint, Run
from dipaco_server.runs.services import transition
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.workers.models import Worker
from dipaco_server.workers.speed import MAX_TOKENS_PER_SECOND
from tests.test_admin_api import admin
from tests.test_models import tiny_config
from tests.test_worker_api import Holder, assert_error, call, new_worker, running_run, take_lease

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(settings: Any, tmp_path: Path, db: None) -> BlobStore:
    """The local blob store in a fresh directory (and the database)."""
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    return get_blob_store()


@pytest.fixture
def holder(client: Client, store: BlobStore) -> Holder:
    """A new worker holding a fresh (never heartbeated) lease of a running tiny run."""
    run = running_run(store)
    _, token = new_worker()
    return Holder(client, store, run, token, take_lease(client, token))


@pytest.fixture
def staff(db: None, settings: Any) -> str:
    """A staff user's admin API token (with a fast password hasher)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user, _ = create_user("ops", staff=True)
    return create_api_token(user, name="tests")[1]


# --- the completion's metrics --------------------------------------------------------------


@pytest.mark.parametrize("series", sorted(SERVER_SERIES))
def test_a_completion_naming_an_evaluation_series_is_refused_and_nothing_is_stored(
    holder: Holder, series: str
) -> None:
    body = holder.completion()
    body["metrics"] = {"loss": 3.0, series: 0.0001}
    error = assert_error(holder.on("complete", body), 422, "invalid_request")
    assert series in error["message"] and "the server writes itself" in error["message"]
    assert not Contribution.objects.exists() and not MetricPoint.objects.exists()
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.ACTIVE


def test_a_metric_the_schema_does_not_know_is_refused_naming_it(holder: Holder) -> None:
    body = {**holder.completion(), "metrics": {"loss": 3.0, "accuracy_of_path": 1.0}}
    error = assert_error(holder.on("complete", body), 422, "invalid_request")
    assert "accuracy_of_path" in error["message"]
    assert not Contribution.objects.exists() and not MetricPoint.objects.exists()


@pytest.mark.parametrize("bad", [1e308, -1.0, "fast", True])
def test_a_speed_out_of_bounds_is_refused_and_the_next_lease_is_answered(
    holder: Holder, bad: Any
) -> None:
    body = {**holder.completion(), "metrics": {"loss": 3.0, "tokens_per_second": bad}}
    error = assert_error(holder.on("complete", body), 422, "invalid_request")
    assert "metrics.tokens_per_second" in error["message"]
    assert Worker.objects.get(leases__pk=holder.lease_id).measured_speed is None
    honest = {**holder.completion(), "metrics": {"loss": 3.0, "tokens_per_second": 900.0}}
    assert holder.on("complete", honest).status_code == 200
    after = call(holder.client, "POST", "/lease", holder.token)
    assert after.status_code in (200, 204), after.content


def test_a_stored_speed_past_any_device_still_sizes_a_lease(holder: Holder) -> None:
    """A row written before speeds were bounded (1e308 tokens/s, or inf) made every lease
    of its worker a 500: inf x target seconds -> NaN -> int()."""
    assert holder.on("complete", holder.completion()).status_code == 200
    worker = Worker.objects.get(leases__pk=holder.lease_id)
    for stored in (1e308, math.inf):
        Worker.objects.filter(pk=worker.pk).update(measured_speed=stored)
        Lease.objects.filter(worker=worker, state=Lease.State.ACTIVE).update(
            state=Lease.State.RELEASED
        )
        answer = call(holder.client, "POST", "/lease", holder.token)
        assert answer.status_code in (200, 204), answer.content


def test_the_speed_a_completion_stores_is_the_smaller_of_the_claim_and_the_measure(
    holder: Holder,
) -> None:
    """A claim of 10^9 tokens/s for a unit that took 100 s stores tokens / 100 s."""
    lease = Lease.objects.select_related("unit__round__run", "unit__path", "worker").get(
        pk=holder.lease_id
    )
    tokens = unit_tokens(lease.unit.round.run.run_config)
    claims = [
        ContributionReport(m, 4096, "ab" * 32, tokens, {"tokens_per_second": 1e9})
        for m in lease.unit.path.modules
    ]
    later = lease.granted_at + timedelta(seconds=100)
    complete(lease.worker, lease.pk, holder.lease["lease_secret"], claims, now=later)
    assert Worker.objects.get(pk=lease.worker_id).measured_speed == pytest.approx(tokens / 100)


def test_every_metric_the_agent_sends_is_in_the_schema() -> None:
    """The agent's completion metrics (one dict literal, plus keys set on it later)."""
    sources = [p.read_text() for p in sorted((ROOT / "worker_agent").glob("*.py"))]
    literals = [
        m for s in sources for m in re.findall(r"metrics(?::[^=\n]*)? = \{(.*?)\}", s, re.S)
    ]
    assert literals, "the agent builds its completion metrics in a dict named metrics"
    sent = {name for block in literals for name in re.findall(r'"(\w+)":', block)}
    sent |= {name for s in sources for name in re.findall(r'metrics\["(\w+)"\] =', s)}
    assert {"loss", "tokens_per_second", "rebase_wait_s"} <= sent
    assert sent <= set(WorkerMetricsIn.model_fields), sent - set(WorkerMetricsIn.model_fields)


def test_the_openapi_schema_shows_the_completion_metrics_closed_and_bounded(
    client: Client, db: None
) -> None:
    schema = client.get("/api/v1/openapi.json").json()["components"]["schemas"]
    metrics = schema["WorkerMetricsIn"]
    assert metrics["additionalProperties"] is False
    speed = metrics["properties"]["tokens_per_second"]["anyOf"][0]
    assert speed["maximum"] == MAX_TOKENS_PER_SECOND


def test_the_server_series_are_the_ones_its_evaluation_and_dashboard_write() -> None:
    from dipaco_server.runs import evaluate
    from dipaco_web import queries

    assert {evaluate.LOSS, evaluate.PERPLEXITY, queries.ROUTED_VAL_LOSS} <= SERVER_SERIES
    assert not SERVER_SERIES & set(WorkerMetricsIn.model_fields)


# --- uploads before the answer --------------------------------------------------------------


def test_a_completion_whose_upload_is_missing_or_another_size_is_refused_naming_it(
    holder: Holder,
) -> None:
    body = holder.completion()
    first = body["contributions"][0]
    lease = holder.lease
    holder.store.delete(
        keys.contribution_key(
            lease["run_id"], lease["round"], lease["unit_id"], holder.lease_id, first["module_id"]
        )
    )
    error = assert_error(holder.on("complete", body), 422, "contribution_invalid")
    assert first["module_id"] in error["message"] and "nothing was uploaded" in error["message"]
    assert not Contribution.objects.exists()
    body = holder.completion()  # uploads again
    body["contributions"][0] = {**body["contributions"][0], "size": first["size"] + 1}
    error = assert_error(holder.on("complete", body), 422, "contribution_invalid")
    assert f"the upload holds {first['size']} bytes" in error["message"]
    assert not Contribution.objects.exists()
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.ACTIVE


def test_a_store_out_of_reach_during_the_upload_check_is_a_503_to_hand_in_again(
    holder: Holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is the network choke point: the check's one size lookup fails there."""
    body = holder.completion()

    def unreachable(self: BlobStore, key: str) -> int:
        raise OSError("the blob store's disk is gone")

    monkeypatch.setattr(type(holder.store), "size", unreachable)
    error = assert_error(holder.on("complete", body), 503, "store_unavailable")
    assert "send the completion again" in error["message"]
    assert not Contribution.objects.exists()
    monkeypatch.undo()
    assert holder.on("complete", body).status_code == 200  # the same completion, later


# --- run configs ----------------------------------------------------------------------------

IMPOSSIBLE = [
    ({"units": {"target_seconds": 1e308}}, "units.target_seconds"),
    ({"inner": {"steps": 2**63}}, "inner.steps"),
    ({"rounds": 2**63}, "rounds"),
    ({"seed": 2**63}, "seed"),
    ({"inner": {"lr": 1e308}}, "inner.lr"),
    ({"outer": {"lr": 1e308}}, "outer.lr"),
    ({"outer": {"clip_factor": 1e308}}, "outer.clip_factor"),
    ({"limits": {"max_path_memory_bytes": 2**64}}, "limits.max_path_memory_bytes"),
    ({"units": {"calibration_seconds": math.inf}}, "units.calibration_seconds"),
    ({"outer": {"momentum": math.nan}}, "outer.momentum"),
    ({"inner": {"steps": 10, "surprise": 1}}, "inner.surprise"),
    ({"surprise": {}}, "surprise"),
]


@pytest.mark.parametrize(("sections", "field"), IMPOSSIBLE)
def test_an_impossible_run_config_is_refused_with_422_naming_the_field(
    client: Client, staff: str, sections: dict[str, Any], field: str
) -> None:
    config = tiny_config()
    for key, value in sections.items():  # raw JSON: RunConfig.tiny itself would refuse it
        config[key] = {**config[key], **value} if isinstance(config.get(key), dict) else value
    raw = json.dumps({"name": "impossible", "config": config})  # Infinity and NaN as Python writes
    response = client.post(
        "/api/v1/runs", raw, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {staff}"
    )
    error = assert_error(response, 422, "config_invalid")
    assert field in {p["field"] for p in error["details"]["problems"]}, error
    assert field in error["message"]
    assert not Run.objects.exists()
    entry = AuditEntry.objects.get(action="run.create")
    assert (entry.status, entry.error_code) == (422, "config_invalid")


def test_the_openapi_schema_shows_the_config_bounds() -> None:
    schema = RunConfig.model_json_schema()
    inner = schema["$defs"]["InnerConfig"]["properties"]
    assert inner["steps"]["maximum"] == 100_000 and inner["lr"]["maximum"] == 10.0
    assert schema["properties"]["seed"]["maximum"] == 2**31 - 1
    assert schema["$defs"]["UnitsConfig"]["additionalProperties"] is False


def test_the_farthest_data_position_of_an_accepted_config_fits_its_column() -> None:
    """Data positions are stored as 64-bit integers: a config whose last unit would start
    past 2^62 windows is refused, one just inside is accepted and fits."""
    inside = RunConfig.tiny(
        rounds=100_000, replicas_per_path=16, inner={"steps": 100_000, "grad_accum_steps": 4096}
    )
    last = unit_start(inside, inside.rounds - 1, inside.replicas_per_path - 1)
    assert last + unit_windows(inside) <= MAX_DATA_POSITION < 2**63 - 1
    with pytest.raises(ValueError, match="windows of data"):
        RunConfig.tiny(
            rounds=100_000,
            replicas_per_path=16_384,
            inner={"steps": 100_000, "grad_accum_steps": 65_536},
        )


def test_a_unit_of_more_tokens_than_its_counters_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens per unit"):
        RunConfig.tiny(
            model={"seq_len": 131_072},
            inner={"steps": 100_000, "micro_batch_size": 4, "grad_accum_steps": 65_536},
        )


@pytest.mark.parametrize("speed", [1e-300, 1.0, 1e10, 1e308, math.inf, math.nan, -1.0])
def test_lease_sizing_gives_whole_steps_for_any_speed_and_the_widest_config(speed: float) -> None:
    config = RunConfig.tiny(
        inner={"steps": 100_000}, units={"target_seconds": 86_400, "calibration_seconds": 3600}
    )
    size = size_unit(config, speed)
    assert isinstance(size.steps, int) and 1 <= size.steps <= config.inner.steps
    assert 1 <= size.trained_steps <= size.steps
    tokens = size.trained_steps * step_tokens(config)
    assert tokens < 2**63


# --- runs that ended ------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["cancelled", "finished"])
def test_a_run_that_ended_releases_its_leases_and_never_hands_one_back(
    holder: Holder, end: str
) -> None:
    """The lease was never heartbeated (an unheard grant, which a worker at its limit gets
    back): once the run ended it is released, and asking again is not answered with it."""
    transition(holder.run, end)
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.RELEASED
    again = call(holder.client, "POST", "/lease", holder.token)
    assert again.status_code == 204, again.content
    worker = Worker.objects.get(leases__pk=holder.lease_id)
    assert grant_lease(worker) is None
    assert worker.leases_expired == 0  # not the worker's fault


def test_a_cancelled_runs_lease_is_not_handed_back_through_the_admin_api(
    holder: Holder, staff: str
) -> None:
    cancelled = admin(holder.client, "POST", f"/runs/{holder.run.pk}/cancel", staff)
    assert cancelled.status_code == 200, cancelled.content
    assert call(holder.client, "POST", "/lease", holder.token).status_code == 204
    assert not Lease.objects.filter(state=Lease.State.ACTIVE).exists()


# --- the audit log --------------------------------------------------------------------------


def test_the_audit_log_records_the_status_each_refusal_answered(client: Client, staff: str) -> None:
    sent = [
        ("POST", "/runs", {"name": "r", "config": {"rounds": 0}}),
        ("POST", "/runs", {"name": "r", "config": {"units": {"target_seconds": math.inf}}}),
        ("POST", "/runs/999999/start", None),
        ("POST", "/runs", {"name": "ok", "config": tiny_config()}),
        ("POST", "/runs", {"name": "ok", "config": tiny_config()}),  # the name is taken
    ]
    answers = []
    for method, path, body in sent:
        raw = json.dumps(body) if body is not None else ""
        response = client.generic(
            method, f"/api/v1{path}", raw, "application/json", HTTP_AUTHORIZATION=f"Bearer {staff}"
        )
        code = response.json()["error"]["code"] if response.status_code >= 400 else ""
        answers.append((response.status_code, code))
    logged = list(AuditEntry.objects.order_by("pk").values_list("status", "error_code"))
    assert logged == answers, (logged, answers)
    assert [s for s, _ in answers] == [422, 422, 404, 201, 409]


def test_a_database_range_error_is_logged_as_the_422_the_client_got() -> None:
    """What errors.install answers for a value past a column's range (value_out_of_range)."""
    status, code, _ = _refusal(DataError("integer out of range"))
    assert (status, code) == (422, "value_out_of_range")
