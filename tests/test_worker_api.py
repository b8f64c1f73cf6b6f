"""The worker API over HTTP: registration, the lease cycle, and every refusal in the one error shape.

The full cycle runs against a live server with the local blob store, downloading
and uploading through the presigned URLs exactly as an agent would; the other
tests use Django's test client on the same database (PostgreSQL when it answers).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from django.test import Client
from django.utils import timezone

from dipaco.codecs import decode, encode
from dipaco.data.shards import ShardIndex, ShardInfo
from dipaco.data.windows import path_seed, unit_start, unit_windows
from dipaco_server.core import tokens
from dipaco_server.errors import MAX_JSON_BODY_BYTES
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit
from dipaco_server.runs import keys
from dipaco_server.runs.models import MetricPoint, Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.stages import upload_rows
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import (
    create_enrollment_token,
    register_worker,
    revoke_worker,
)
from tests.test_models import tiny_config

SHARD_TOKENS = 50_000  # about 4 unit windows of the tiny config (20 x 4 x 128 tokens)
WORKER = "/api/v1/worker"


# --- builders --------------------------------------------------------------------------------


@pytest.fixture
def store(settings: Any, tmp_path: Path, db: None) -> BlobStore:
    """The local blob store in a fresh directory (and the database)."""
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    return get_blob_store()


def running_run(store: BlobStore, name: str = "api-run") -> Run:
    """A running tiny run with real version-0 module blobs, token shards and round 0 open."""
    from dipaco.modular import init_modules

    run = create_run(name, tiny_config())
    modules = init_modules(run.run_config)
    for module in run.modules.all():
        data = encode(modules[module.module_id], "fp32")
        key = keys.module_key(run.pk, module.module_id, 0)
        store.put_bytes(key, data)
        digest = hashlib.sha256(data).hexdigest()
        publish_module_version(module, 0, blob_key=key, sha256=digest, size=len(data))
    put_train_shards(store, run, SHARD_TOKENS)
    for state in ("preparing", "ready", "running"):
        transition(run, state)
    open_round(run, 0)
    return run


def put_train_shards(store: BlobStore, run: Run, tokens: int) -> None:
    """Random train shards of `tokens` tokens for every path, their row chunks, and the
    shard index (with each one's sha256) that the data preparation uploads next to them."""
    rng, vocab, entries = np.random.default_rng(0), run.run_config.model.vocab_size, []
    work = Path(tempfile.mkdtemp(prefix="shards-"))
    for path in run.paths.order_by("index"):
        data = rng.integers(0, vocab, tokens, dtype=np.uint16).astype("<u2").tobytes()
        store.put_bytes(keys.data_key(run.pk, path.index, "train"), data)
        (work / "train.bin").write_bytes(data)
        upload_rows(store, run.run_config, run.pk, path.index, 2, work / "train.bin", "<u2")
        train = ShardInfo(f"{path.index}/train.bin", tokens, 1, hashlib.sha256(data).hexdigest())
        val = ShardInfo(f"{path.index}/val.bin", 0, 0, hashlib.sha256(b"").hexdigest())
        entries.append({"train": train, "val": val})
    index = ShardIndex("<u2", vocab, 0, len(entries), "test", entries)
    store.put_bytes(keys.data_index_key(run.pk), json.dumps(asdict(index)).encode())
    run.paths.update(train_tokens=tokens)


def new_worker(name: str = "gpu-box") -> tuple[Worker, str]:
    _, enrollment = create_enrollment_token(max_uses=None)
    return register_worker(enrollment, name, {"gpu": "none"})


def call(
    client: Client,
    method: str,
    path: str,
    token: str | None = None,
    body: Any = None,
    secret: str | None = None,
    raw: bytes | str | None = None,
) -> Any:
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if secret is not None:
        headers["X-Lease-Secret"] = secret
    data = raw if raw is not None else (json.dumps(body) if body is not None else "")
    return client.generic(
        method, f"{WORKER}{path}", data, content_type="application/json", headers=headers
    )


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    """The one error shape: {"error": {"code", "message"[, "details"]}} with this status."""
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


def sent_tasks() -> list[tuple[str, str]]:
    """(task name, args) of the Celery messages in the session's filesystem broker, removed.

    Other messages share the folder and are left alone: a worker on the session's data dir
    (tests/test_two_phases.py's embedded broker) answers control pings there, and a reply
    that came after its ping gave up stays in the folder; it has no "task" header."""
    from dipaco_server.celery import app

    folder = Path(app.conf.broker_transport_options["data_folder_out"])
    sent = []
    for message in sorted(folder.glob("*.msg")):
        try:
            headers = json.loads(message.read_text()).get("headers") or {}
        except (FileNotFoundError, ValueError):  # taken by a worker meanwhile, or half written
            continue
        if "task" not in headers:
            continue
        sent.append((headers["task"], headers["argsrepr"]))
        message.unlink(missing_ok=True)
    return sent


def take_lease(client: Client, token: str) -> dict[str, Any]:
    response = call(client, "POST", "/lease", token)
    assert response.status_code == 200, response.content
    return dict(response.json())


def upload_fake_deltas(store: BlobStore, lease: dict[str, Any]) -> list[dict[str, Any]]:
    """Put a blob at each module's upload key (content is the outer step's business)."""
    reports = []
    for module_id in lease["modules"]:
        key = keys.contribution_key(
            lease["run_id"], lease["round"], lease["unit_id"], lease["lease_id"], module_id
        )
        data = f"delta of {module_id}".encode()
        store.put_bytes(key, data)
        reports.append(
            {"module_id": module_id, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        )
    return reports


def completion(reports: list[dict[str, Any]], tokens: int = 10_240) -> dict[str, Any]:
    return {"contributions": reports, "tokens": tokens, "metrics": {"loss": 7.5}}


@dataclass
class Holder:
    """A worker holding a fresh lease of a running run, and its calls about that lease."""

    client: Client
    store: BlobStore
    run: Run
    token: str
    lease: dict[str, Any]

    @property
    def lease_id(self) -> int:
        return int(self.lease["lease_id"])

    def on(
        self,
        action: str,
        body: Any = None,
        *,
        method: str = "POST",
        token: str | None = None,
        secret: str | None = None,
        raw: str | bytes | None = None,
    ) -> Any:
        """``METHOD /lease/<id>/<action>`` as this worker, with the lease's secret."""
        return call(
            self.client,
            method,
            f"/lease/{self.lease_id}/{action}",
            token or self.token,
            body,
            secret or self.lease["lease_secret"],
            raw,
        )

    def heartbeat(self) -> Any:
        body = {"lease_id": self.lease_id}
        return call(self.client, "POST", "/heartbeat", self.token, body, self.lease["lease_secret"])

    def completion(self) -> dict[str, Any]:
        """A well-formed report of fresh uploads for every module of the lease."""
        return completion(upload_fake_deltas(self.store, self.lease))


@pytest.fixture
def holder(client: Client, store: BlobStore) -> Holder:
    run = running_run(store)
    _, token = new_worker()
    return Holder(client, store, run, token, take_lease(client, token))


def test_a_replicated_units_two_copies_are_both_leased_cold(
    client: Client, store: BlobStore, settings: Any
) -> None:
    """A newcomer's unit is replicated (workers.probation), so its lease and its check
    copy's lease both say `cold`: both train from fresh AdamW moments and compare alike. An
    established worker's unreplicated unit continues its warm ones."""
    settings.DIPACO_REPLICATION_RATE = 0.0
    settings.DIPACO_PROBATION_PARTNERS = 3
    running_run(store)
    _, newcomer = new_worker("newcomer")
    original = take_lease(client, newcomer)
    assert original["cold"] is True and original["replica"] < 1_000_000
    _, checker = new_worker("checker")
    check = take_lease(client, checker)
    assert check["replica"] >= 1_000_000 and check["unit_id"] != original["unit_id"]
    assert check["cold"] is True
    established, token = new_worker("established")
    Worker.objects.filter(pk=established.pk).update(probation=False)
    plain = take_lease(client, token)
    assert plain["cold"] is False and plain["replica"] < 1_000_000


def test_cold_share_hides_which_units_are_compared(store: BlobStore, settings: Any) -> None:
    """DIPACO_COLD_SHARE: a share of the unreplicated units train cold too, drawn by a keyed
    hash of the lease (the same answer every time it is asked); at 1 every lease is cold,
    so `cold` says nothing about audits."""
    from dipaco_server.rounds.protocol.grant import grant_lease, trains_cold

    settings.DIPACO_REPLICATION_RATE = 0.0
    settings.DIPACO_PROBATION_PARTNERS = 0  # every worker established: nothing replicated
    run = running_run(store)
    granted = grant_lease(new_worker()[0])
    assert granted is not None
    assert not WorkUnit.objects.filter(round__run=run, replica__gte=1_000_000).exists()
    # the draw reads the lease's id and unit: 40 leases of that unit
    leases = [Lease(pk=pk, unit=granted.lease.unit) for pk in range(1, 41)]
    settings.DIPACO_COLD_SHARE = 0.0
    assert not any(trains_cold(lease) for lease in leases)
    settings.DIPACO_COLD_SHARE = 1.0
    assert all(trains_cold(lease) for lease in leases)
    settings.DIPACO_COLD_SHARE = 0.5
    drawn = [trains_cold(lease) for lease in leases]
    assert 8 <= sum(drawn) <= 32  # binomial(40, 0.5): outside with probability < 1e-4
    assert drawn == [trains_cold(lease) for lease in leases]
    settings.SECRET_KEY = settings.SECRET_KEY + "-other"
    assert drawn != [trains_cold(lease) for lease in leases]  # keyed with the server's secret


# --- the full cycle over real HTTP ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_worker_registers_leases_downloads_uploads_and_completes_over_http(
    live_server: Any, settings: Any, store: BlobStore
) -> None:
    settings.DIPACO_PUBLIC_URL = live_server.url
    run = running_run(store)
    _, enrollment = create_enrollment_token(max_uses=1)
    http = httpx.Client(base_url=f"{live_server.url}{WORKER}", timeout=30)

    registered = http.post("/register", json={"enrollment_token": enrollment, "name": "box-1"})
    assert registered.status_code == 201, registered.text
    auth = {"Authorization": f"Bearer {registered.json()['token']}"}

    lease = http.post("/lease", headers=auth).json()
    assert (lease["run_id"], lease["round"], lease["steps"]) == (run.pk, 0, 20)
    assert "unit_steps" not in lease, "the unit's length travels once: `steps`"
    assert lease["config"]["model"]["hidden_size"] == 128 and lease["codec"] == "fp16"
    with_secret = {**auth, "X-Lease-Secret": lease["lease_secret"]}

    manifest = http.get(f"/lease/{lease['lease_id']}/manifest", headers=with_secret).json()
    assert [m["module_id"] for m in manifest["modules"]] == lease["modules"]
    deltas = {}
    for module in manifest["modules"]:
        blob = httpx.get(module["url"], timeout=30)
        assert blob.status_code == 200 and len(blob.content) == module["size"]
        assert hashlib.sha256(blob.content).hexdigest() == module["sha256"]
        weights = decode(blob.content)  # the module's fp32 tensors, as the trainer sees them
        gen = torch.Generator().manual_seed(0)
        deltas[module["module_id"]] = {
            name: 1e-3 * torch.randn(t.shape, generator=gen) for name, t in weights.items()
        }
    data = manifest["data"]
    rows = 0
    for chunk in data["chunks"]:  # the unit's row chunks, each kept by sha256
        blob = httpx.get(chunk["url"], timeout=30)
        assert blob.status_code == 200 and len(blob.content) == chunk["size"]
        assert hashlib.sha256(blob.content).hexdigest() == chunk["sha256"]
        assert len(np.frombuffer(blob.content, dtype=data["dtype"])) == chunk["rows"] * (
            data["seq_len"] + 1
        )
        rows += chunk["count"]
    assert rows == data["windows"] and data["tokens"] == rows * (data["seq_len"] + 1)
    config, unit = run.run_config, WorkUnit.objects.get(pk=lease["unit_id"])
    # Where dipaco simulate starts unit (t, r) of this path, in the same window order.
    assert lease["data"] == {
        "start_position": unit_start(config, 0, unit.replica),
        "windows": unit_windows(config),
        "seed": path_seed(config, lease["path"]),
        "dtype": "<u2",
    }

    urls = http.post(f"/lease/{lease['lease_id']}/upload-urls", headers=with_secret).json()
    reports = []
    for upload in urls["uploads"]:
        encoded = encode(deltas[upload["module_id"]], urls["codec"])
        assert len(encoded) <= upload["max_bytes"]
        put = httpx.put(upload["put_url"], content=encoded, timeout=30)
        assert put.status_code == 200, put.text
        digest = hashlib.sha256(encoded).hexdigest()
        reports.append({"module_id": upload["module_id"], "sha256": digest, "size": len(encoded)})
    body = {"contributions": reports, "tokens": 20 * 4 * 128, "metrics": {"loss": 9.1}}
    done = http.post(f"/lease/{lease['lease_id']}/complete", headers=with_secret, json=body)
    assert done.status_code == 200, done.text
    assert {c["status"] for c in done.json()["contributions"]} == {"pending"}

    rows = Contribution.objects.filter(lease_id=lease["lease_id"]).select_related("module")
    assert sorted(r.module.module_id for r in rows) == sorted(lease["modules"])
    for row in rows:
        assert store.size(row.blob_key) == row.size  # the server's key is the one we PUT to
    assert Lease.objects.get(pk=lease["lease_id"]).state == Lease.State.COMPLETED
    assert WorkUnit.objects.get(pk=lease["unit_id"]).state == WorkUnit.State.DONE
    point = MetricPoint.objects.get(run=run, name="loss")
    assert (point.value, point.round, point.path.index) == (9.1, 0, lease["path"])

    again = http.post(f"/lease/{lease['lease_id']}/complete", headers=with_secret, json=body)
    assert again.status_code == 200 and again.json() == done.json()
    assert MetricPoint.objects.filter(run=run).count() == 1, "a replay records nothing twice"
    http.close()


# --- registration ------------------------------------------------------------------------------


def test_registration_shows_a_working_token_once_and_stores_only_its_hash(
    client: Client, db: None
) -> None:
    _, enrollment = create_enrollment_token(max_uses=1)
    body = {"enrollment_token": enrollment, "name": "box", "device": {"gpu": "A100"}}
    response = call(client, "POST", "/register", body=body)
    assert response.status_code == 201, response.content
    token = response.json()["token"]
    worker = Worker.objects.get(pk=response.json()["worker_id"])
    assert worker.token_hash == tokens.hash_token(token) and token not in worker.token_hash
    beat = call(client, "POST", "/heartbeat", token, body={})
    assert beat.status_code == 200 and beat.json()["worker_id"] == worker.pk
    assert_error(call(client, "POST", "/register", body=body), 403, "enrollment_refused")
    assert_error(call(client, "POST", "/heartbeat", token + "x", body={}), 401, "token_invalid")


def test_a_revoked_worker_is_refused_with_403(client: Client, db: None) -> None:
    worker, token = new_worker()
    revoke_worker(worker)
    assert_error(call(client, "POST", "/lease", token), 403, "worker_revoked")


# --- leases ------------------------------------------------------------------------------------


def test_lease_answers_204_when_nothing_is_queued(client: Client, db: None) -> None:
    _, token = new_worker()
    response = call(client, "POST", "/lease", token)
    assert response.status_code == 204 and response.content == b""


def test_heartbeat_extends_the_lease_deadline(holder: Holder) -> None:
    soon = timezone.now() + timedelta(seconds=5)
    Lease.objects.filter(pk=holder.lease_id).update(deadline=soon)
    beat = holder.heartbeat()
    assert beat.status_code == 200, beat.content
    assert beat.json()["instructions"] == []
    assert Lease.objects.get(pk=holder.lease_id).deadline > soon + timedelta(seconds=60)


def test_heartbeat_tells_the_worker_to_release_a_cancelled_runs_lease(holder: Holder) -> None:
    transition(holder.run, "cancelled")
    beat = holder.heartbeat()
    assert beat.status_code == 200 and beat.json()["instructions"] == ["release"]


@pytest.mark.parametrize(
    ("method", "action"),
    [("GET", "manifest"), ("POST", "upload-urls"), ("POST", "complete"), ("POST", "release")],
)
def test_another_workers_lease_is_refused(holder: Holder, method: str, action: str) -> None:
    _, thief = new_worker("thief")
    body = holder.completion() if action == "complete" else None
    stolen = holder.on(action, body, method=method, token=thief)
    assert_error(stolen, 403, "lease_not_yours")
    guessed = holder.on(action, body, method=method, secret="dpl_wrong")
    assert_error(guessed, 403, "lease_secret_invalid")
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.ACTIVE


def test_an_expired_lease_is_refused_with_lease_expired(holder: Holder) -> None:
    past = timezone.now() - timedelta(seconds=1)
    Lease.objects.filter(pk=holder.lease_id).update(deadline=past)
    assert_error(holder.on("manifest", None, method="GET"), 409, "lease_expired")
    assert_error(holder.heartbeat(), 409, "lease_expired")
    assert not Contribution.objects.exists()


def test_the_partial_delta_of_an_expired_lease_is_salvaged_while_its_unit_is_free(
    holder: Holder,
) -> None:
    """A worker alive when its lease ran out still gets upload URLs and completes with the
    tokens it trained (issue 20); the unit is done, not trained again."""
    past = timezone.now() - timedelta(seconds=1)
    Lease.objects.filter(pk=holder.lease_id).update(deadline=past)
    body = {**holder.completion(), "tokens": 512}  # one step of the tiny run
    done = holder.on("complete", body)
    assert done.status_code == 200, done.content
    assert {c.tokens for c in Contribution.objects.all()} == {512}
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.COMPLETED


def test_a_completion_below_one_step_of_tokens_is_refused_with_a_clear_422(
    holder: Holder,
) -> None:
    refused = holder.on("complete", {**holder.completion(), "tokens": 100})
    assert_error(refused, 422, "contribution_invalid")
    assert "units.min_partial_steps" in refused.json()["error"]["message"]


def test_a_replayed_completion_is_idempotent_and_a_different_one_is_409(holder: Holder) -> None:
    body = holder.completion()
    first = holder.on("complete", body)
    assert first.status_code == 200, first.content
    again = holder.on("complete", body)
    assert again.status_code == 200 and again.json() == first.json()
    changed = {**body, "tokens": body["tokens"] - 1}
    assert_error(holder.on("complete", changed), 409, "contribution_conflict")
    assert Contribution.objects.count() == len(holder.lease["modules"])


def test_complete_asks_the_store_for_sizes_only_and_records_the_report_pending(
    holder: Holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion checks that each upload is there with its declared size (one HEAD per
    module, issue 34); what the bytes hold (sha256, content) is the outer step's to check,
    which refuses a bad upload (tests/test_outer_tasks.py)."""
    body = holder.completion()
    asked: list[str] = []
    real_size = type(holder.store).size
    monkeypatch.setattr(
        type(holder.store), "size", lambda self, key: asked.append("size") or real_size(self, key)
    )
    for name in ("exists", "open"):
        monkeypatch.setattr(type(holder.store), name, lambda self, key, n=name: asked.append(n))
    done = holder.on("complete", body)
    assert done.status_code == 200, done.content
    assert {c["status"] for c in done.json()["contributions"]} == {"pending"}
    assert asked == ["size"] * len(holder.lease["modules"])
    assert Lease.objects.get(pk=holder.lease_id).state == Lease.State.COMPLETED


def test_upload_urls_are_scoped_to_the_unit_and_lease_and_size_limited(holder: Holder) -> None:
    response = holder.on("upload-urls")
    assert response.status_code == 200, response.content
    counts = holder.run.run_config.module_param_counts()
    unit, lease_id = holder.lease["unit_id"], holder.lease_id
    for upload in response.json()["uploads"]:
        module_id = upload["module_id"]
        expected = f"runs/{holder.run.pk}/rounds/0/{unit}/{lease_id}/{module_id}.safetensors"
        assert upload["key"] == expected
        assert 4 * counts[module_id] < upload["max_bytes"] <= 4 * counts[module_id] + 2**20
        assert f"max_bytes={upload['max_bytes']}" in upload["put_url"]


def test_completing_the_last_unit_of_a_round_sends_close_round(
    client: Client, store: BlobStore, django_capture_on_commit_callbacks: Any
) -> None:
    run = running_run(store)
    sent_tasks()  # whatever earlier tests left
    for i in range(run.paths.count()):
        _, token = new_worker(f"w{i}")
        holder = Holder(client, store, run, token, take_lease(client, token))
        with django_capture_on_commit_callbacks(execute=True):
            done = holder.on("complete", holder.completion())
        assert done.status_code == 200, done.content
        closing = [args for task, args in sent_tasks() if task.endswith(".close_round")]
        assert closing == ([f"[{run.pk}, 0]"] if i == run.paths.count() - 1 else [])


def test_a_completion_tells_the_rounds_life_through_a_signal_once_not_on_a_replay(
    holder: Holder, django_capture_on_commit_callbacks: Any
) -> None:
    """The protocol records the completion and sends rounds.signals.lease_completed after
    its commit; whether the round closes is the round's life's (rounds.lifecycle)."""
    from dipaco_server.rounds.lifecycle.receivers import close_if_ready
    from dipaco_server.rounds.signals import lease_completed

    heard: list[int] = []

    def probe(sender: Any, *, round_: Round, **_: Any) -> None:
        heard.append(round_.pk)

    lease_completed.connect(probe, weak=False)
    try:
        assert lease_completed.has_listeners()
        report = holder.completion()
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            assert holder.on("complete", report).status_code == 200
        assert heard == [], "sent only once the completion is committed"
        for callback in callbacks:
            callback()
        assert heard == [Round.objects.get(run=holder.run, t=0).pk]
        with django_capture_on_commit_callbacks(execute=True):
            assert holder.on("complete", report).status_code == 200  # a replay
        assert len(heard) == 1, "a replay tells nothing again"
    finally:
        lease_completed.disconnect(probe)
    receivers = [entry[1]() for entry in lease_completed.receivers]  # (key, weakref, ...)
    assert close_if_ready in receivers, "the round's life listens (RoundsConfig.ready)"


def test_release_puts_the_unit_back_in_the_queue(holder: Holder) -> None:
    response = holder.on("release")
    assert response.status_code == 200 and response.json()["state"] == "released"
    assert WorkUnit.objects.get(pk=holder.lease["unit_id"]).state == WorkUnit.State.QUEUED


# --- malformed requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        ("{not json", 400, "malformed_json"),
        (b"\xff\xfe", 400, "malformed_json"),
        ("{}", 422, "invalid_request"),
        ('{"contributions": "x", "tokens": 1}', 422, "invalid_request"),
        ('{"contributions": [{"module_id": "0.0"}], "tokens": "many"}', 422, "invalid_request"),
        ("[1, 2]", 422, "invalid_request"),
    ],
)
def test_malformed_or_incomplete_bodies_are_4xx_in_the_one_error_shape(
    holder: Holder, raw: str | bytes, status: int, code: str
) -> None:
    assert_error(holder.on("complete", raw=raw), status, code)


def test_a_report_the_completion_service_refuses_is_422(holder: Holder) -> None:
    body = holder.completion()
    body["metrics"] = {"loss": float("nan")}
    raw = json.dumps(body)  # Python writes NaN, which the parser accepts and the schema refuses
    refused = assert_error(holder.on("complete", raw=raw), 422, "invalid_request")
    assert "metrics.loss" in refused["message"]
    missing = {**body, "metrics": {}, "contributions": body["contributions"][1:]}
    assert_error(holder.on("complete", missing), 422, "contribution_invalid")


def test_a_manifest_without_the_row_index_says_to_prepare_the_data_again(
    holder: Holder,
) -> None:
    unit = Lease.objects.get(pk=holder.lease_id).unit
    holder.store.delete(keys.rows_index_key(holder.run.pk, unit.path.index))
    error = assert_error(holder.on("manifest", method="GET"), 409, "data_not_ready")
    assert "prepare the run's data again" in error["message"]


def test_a_lease_call_without_its_secret_is_refused(holder: Holder) -> None:
    manifest = call(holder.client, "GET", f"/lease/{holder.lease_id}/manifest", holder.token)
    assert_error(manifest, 422, "invalid_request")
    beat = call(holder.client, "POST", "/heartbeat", holder.token, {"lease_id": holder.lease_id})
    assert_error(beat, 403, "lease_secret_missing")


@pytest.mark.parametrize("size", [MAX_JSON_BODY_BYTES + 1, 3 * 1024 * 1024])
def test_an_oversized_body_is_413(client: Client, db: None, size: int) -> None:
    raw = json.dumps({"enrollment_token": "x", "name": "y" * size})
    assert_error(call(client, "POST", "/register", raw=raw), 413, "body_too_large")


def test_unknown_routes_and_methods_under_the_api_are_json_errors(client: Client, db: None) -> None:
    assert_error(client.get("/api/v1/no/such/route"), 404, "not_found")
    assert_error(client.post("/api/v1/"), 404, "not_found")
    _, token = new_worker()
    assert_error(call(client, "GET", "/lease", token), 405, "method_not_allowed")
    assert_error(call(client, "POST", "/lease/1/nope", token), 404, "not_found")
    assert_error(
        call(client, "GET", "/lease/999/manifest", token, secret="s"), 404, "lease_not_found"
    )


def test_a_heartbeat_tells_the_rounds_deadline_as_it_moves_up(holder: Holder) -> None:
    """An adaptive close (rounds.lifecycle.close) moves the deadline up; agents learn it on their next
    heartbeat and stop in time to upload what they trained."""
    first = holder.heartbeat()
    assert first.status_code == 200, first.content
    said = first.json()["lease"]["round_deadline"]
    round_ = Round.objects.get(run=holder.run, t=0)
    assert said is not None and round_.deadline is not None
    assert abs(datetime.fromisoformat(said) - round_.deadline) < timedelta(milliseconds=1)
    sooner = timezone.now() + timedelta(minutes=3)
    Round.objects.filter(pk=round_.pk).update(deadline=sooner)
    moved = holder.heartbeat().json()["lease"]["round_deadline"]
    assert abs(datetime.fromisoformat(moved) - sooner) < timedelta(milliseconds=1)
