"""The outer step as Celery tasks: verified, streamed, idempotent, crash-safe and parallel.

The Celery tests run a real worker process (concurrency 2) on Redis against the session's
test database and the S3 server; the others call the service in this process on the local
blob store. Contributions go through the real lease and completion services; their bytes
are real codec containers, some of them made hostile on purpose. (Over the house limit of
~500 lines: the Celery scenarios share one module-scoped worker, so they live in one file.)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from django.utils import timezone
from torch import Tensor

from dipaco import codecs
from dipaco.config import LayoutConfig, RunConfig
from dipaco.modular import init_modules, module_spec, paths_through
from dipaco.modules_file import read_module, write_module
from dipaco.outer import aggregate, outer_lr, outer_step
from dipaco_server.env import blob_store as blob_store_config
from dipaco_server.env import celery_transport
from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.lifecycle.tasks import advance_run, fail_round, finish_round
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round
from dipaco_server.rounds.outer.step import (
    FAULTS_DIR_ENV,
    BaseVersion,
    Fault,
    InjectedFault,
    step_judged,
    step_module,
)
from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification.judge import judge_uploads
from dipaco_server.rounds.verification.uploads import Upload
from dipaco_server.runs import keys
from dipaco_server.runs.models import Module, ModuleVersion, Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import get_blob_store
from dipaco_server.workers.models import Worker
from tests.conftest import (
    CeleryWorker,
    S3Server,
    compose_env,
    session_database_url,
    start_celery_worker,
    stop_process,
)
from tests.test_models import make_worker

MODEL = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 320,
    "seq_len": 16,
}
DILOCO = LayoutConfig.grid(2, levels=1, modules=1)  # modules "0.0" and "shared", one path
GRID = LayoutConfig.grid(2, levels=2, modules=2)  # 4 paths over 0.0, 0.1, 1.0, 1.1, shared
TOKENS = 1000
TASK = "dipaco_server.rounds.tasks."  # the tasks' names, kept when their module moved
Deltas = dict[str, Tensor]


# --- builders ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One thread: on a shared, loaded machine torch's thread pool stalls tiny ops 10-70x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def running_run(layout: LayoutConfig, replicas: int, **sections: Any) -> Run:
    """A running run of a 2-layer model with real version-0 blobs and round 0 open."""
    config = RunConfig.tiny(model=MODEL, layout=layout, replicas_per_path=replicas, **sections)
    spec = config.model_dump(mode="json")
    del spec["name"]
    run = create_run(f"outer-{uuid.uuid4().hex[:8]}", spec)
    store = get_blob_store()
    modules = init_modules(run.run_config)
    for module in run.modules.all():
        file = Path(os.environ["DIPACO_DATA_DIR"]) / f"v0-{run.pk}-{module.module_id}"
        sha256, size = write_module(file, modules[module.module_id])
        key = keys.module_key(run.pk, module.module_id, 0)
        store.put_file(key, file)
        file.unlink()
        publish_module_version(module, 0, blob_key=key, sha256=sha256, size=size)
    run.paths.update(train_tokens=100_000)
    transition(run, "preparing")
    transition(run, "ready")
    start_run(run)
    return run


def random_delta(run: Run, module_id: str, seed: int, scale: float = 1e-3) -> Deltas:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) * scale
        for name, (shape, _) in module_spec(run.run_config, module_id).items()
    }


def good(run: Run, module_id: str, seed: int) -> bytes:
    return codecs.encode(random_delta(run, module_id, seed), "fp16")


def with_nan(run: Run, module_id: str, seed: int) -> bytes:
    """A container whose payload holds a NaN: what a diverged or hostile worker sends."""
    delta = random_delta(run, module_id, seed)
    first = next(iter(delta))
    delta[first].view(-1)[0] = 12345.0  # a marker to overwrite after encoding
    data = codecs.encode(delta, "fp32")
    marker = struct.pack("<f", 12345.0)
    assert data.count(marker) == 1
    return data.replace(marker, struct.pack("<f", float("nan")))


def wrong_shape(run: Run, module_id: str, seed: int) -> bytes:
    delta = random_delta(run, module_id, seed)
    first = next(iter(delta))
    delta[first] = delta[first].view(-1)[:-1].clone()  # one value short
    return codecs.encode(delta, "fp16")


Payload = Callable[[Run, str, int], bytes]


def contribute(
    run: Run, payload: Payload, seed: int, name: str = "gpu"
) -> tuple[Worker, dict[str, bytes]]:
    """A new worker leases a unit, uploads `payload` for each module and completes."""
    worker = make_worker(name)
    granted = grant_lease(worker)
    assert granted is not None
    store, uploaded, reports = get_blob_store(), {}, []
    for module_id in granted.unit.path.modules:
        data = payload(run, module_id, seed)
        store.put_bytes(upload_key(granted.lease, module_id), data)
        uploaded[module_id] = data
        digest = hashlib.sha256(data).hexdigest()
        reports.append(ContributionReport(module_id, len(data), digest, TOKENS))
    complete(worker, granted.lease.pk, granted.secret, reports)
    return worker, uploaded


def stored_version(run: Run, module_id: str, version: int) -> dict[str, Tensor]:
    row = ModuleVersion.objects.get(module__run=run, module__module_id=module_id, version=version)
    file = Path(os.environ["DIPACO_DATA_DIR"]) / f"read-{uuid.uuid4().hex}"
    get_blob_store().download_to(row.blob_key, file)
    try:
        return read_module(file, module_spec(run.run_config, module_id), row.sha256)
    finally:
        file.unlink()


def library_step(
    run: Run, module_id: str, uploads: list[bytes], paths: int = 1
) -> dict[str, Tensor]:
    """What dipaco.outer computes from version 0 and these uploads of `paths` distinct
    paths in round 0 (the reference)."""
    config = run.run_config
    spec = module_spec(config, module_id)
    deltas = [(codecs.decode(data, spec), TOKENS) for data in uploads]
    grad = aggregate(deltas, config.outer, paths_through=paths, spec=spec)
    lr = outer_lr(config.outer, 0)
    params, _ = outer_step(stored_version(run, module_id, 0), grad, None, config.outer, lr=lr)
    return params


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def closing_round(run: Run) -> Round:
    round_ = Round.objects.get(run=run, t=0)
    assert mark_round_closing(round_)
    return round_


# --- a real Celery worker on Redis, with the S3 server ------------------------------------------


@pytest.fixture(scope="module")
def s3_env(s3_server: S3Server) -> Iterator[dict[str, str]]:
    client = s3_server.client()
    bucket = f"outer-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield s3_server.environ(bucket)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=item["Key"])
    client.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def outer_worker(
    redis_url: str,
    s3_env: dict[str, str],
    django_db_setup: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CeleryWorker]:
    """A worker with two pool processes on Redis, the test database and the S3 bucket."""
    log_dir = tmp_path_factory.mktemp("outer-worker")
    faults = tmp_path_factory.mktemp("faults")
    environ = compose_env(
        REDIS_URL=redis_url,
        DATABASE_URL=session_database_url(),
        DIPACO_DATA_DIR=os.environ["DIPACO_DATA_DIR"],
        CELERY_CONCURRENCY="2",
        OMP_NUM_THREADS="1",
        **{FAULTS_DIR_ENV: str(faults)},
        **s3_env,
    )
    worker = start_celery_worker(environ, celery_transport(log_dir, redis_url), log_dir)
    worker.faults = faults  # type: ignore[attr-defined]
    yield worker
    # Nothing is left to finish on this private queue: kill the worker and its pool at once.
    os.killpg(worker.process.pid, signal.SIGKILL)
    stop_process(worker.process)
    worker.app.close()


@pytest.fixture
def on_s3(outer_worker: CeleryWorker, s3_env: dict[str, str], settings: Any) -> CeleryWorker:
    """This process on the worker's bucket, so both see the same blobs."""
    settings.DIPACO_BLOB_STORE = blob_store_config(s3_env, Path(os.environ["DIPACO_DATA_DIR"]))
    return outer_worker


def send(worker: CeleryWorker, task: str, *args: Any) -> Any:
    return worker.app.send_task(TASK + task, args=args, queue=worker.queue)


def wait_for(condition: Callable[[], bool], worker: CeleryWorker, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            log = worker.log_path.read_text(errors="replace")[-4000:]
            raise AssertionError(f"timed out; worker log:\n{log}")
        time.sleep(0.2)


@pytest.mark.django_db(transaction=True)
def test_check_unit_runs_on_the_worker_and_the_step_after_it_steps_like_the_library(
    on_s3: CeleryWorker,
) -> None:
    """Each completed lease's check_unit task on the real worker (rounds.verification.arrival)
    records its Δs' verdicts; a second delivery does nothing; the round's steps then reuse
    them and step exactly as the library does."""
    run = running_run(DILOCO, replicas=3)
    _, kept = contribute(run, good, seed=1, name="honest")
    _, more = contribute(run, good, seed=2, name="other")
    diverged, _ = contribute(run, with_nan, seed=3, name="diverged")
    leases = list(Lease.objects.filter(unit__round__run=run).order_by("pk"))
    for lease in leases:
        assert send(on_s3, "check_unit", lease.pk).get(timeout=60) == "checked 2"
    assert send(on_s3, "check_unit", leases[0].pk).get(timeout=60) == "checked already"
    records = {
        (c.lease.worker_id, c.module.module_id): c.arrival_check
        for c in Contribution.objects.filter(unit__round__run=run).select_related("module")
    }
    for (worker_id, _), record in records.items():
        assert record is not None, records
        assert ("code" in record) == (worker_id == diverged.pk), record
    assert {r["code"] for (w, _), r in records.items() if w == diverged.pk} == {"non_finite"}

    assert send(on_s3, "close_round", run.pk, 0).get(timeout=30) == "closing"
    wait_for(lambda: Round.objects.filter(run=run, t=1).exists(), on_s3)
    for module_id in ("0.0", "shared"):
        assert_same(
            stored_version(run, module_id, 1),
            library_step(run, module_id, [kept[module_id], more[module_id]]),
        )
    rows = Contribution.objects.filter(unit__round__run=run, module__module_id="0.0")
    assert sorted(rows.values_list("status", flat=True)) == ["accepted", "accepted", "rejected"]


@pytest.mark.django_db(transaction=True)
def test_closing_a_round_rejects_nan_and_misshapen_uploads_and_steps_like_the_library(
    on_s3: CeleryWorker,
) -> None:
    run = running_run(DILOCO, replicas=3)
    honest, kept = contribute(run, good, seed=1, name="honest")
    diverged, _ = contribute(run, with_nan, seed=2, name="diverged")
    misfit, _ = contribute(run, wrong_shape, seed=3, name="misfit")

    assert send(on_s3, "close_round", run.pk, 0).get(timeout=30) == "closing"
    wait_for(lambda: Round.objects.filter(run=run, t=1).exists(), on_s3)

    assert Round.objects.get(run=run, t=0).state == Round.State.CLOSED
    for module_id in ("0.0", "shared"):
        assert_same(
            stored_version(run, module_id, 1), library_step(run, module_id, [kept[module_id]])
        )
        step = OuterStep.objects.get(round__run=run, module__module_id=module_id)
        assert (step.outcome, step.version, step.accepted, step.rejected) == ("stepped", 1, 1, 2)
    reasons = {
        c.lease.worker_id: (c.status, c.reason)
        for c in Contribution.objects.filter(module__module_id="0.0", unit__round__run=run)
    }
    assert reasons[honest.pk] == ("accepted", "")
    assert reasons[diverged.pk][0] == "rejected" and reasons[diverged.pk][1].startswith(
        "non_finite"
    )
    assert reasons[misfit.pk][0] == "rejected" and reasons[misfit.pk][1].startswith("spec_mismatch")
    counts = {
        w.pk: (w.contributions_accepted, w.contributions_rejected) for w in Worker.objects.all()
    }
    assert (
        counts[honest.pk] == (2, 0)
        and counts[diverged.pk] == (0, 2)
        and counts[misfit.pk] == (0, 2)
    )
    version = ModuleVersion.objects.get(module__run=run, module__module_id="shared", version=1)
    assert version.momentum_key == keys.momentum_key(run.pk, "shared", 1)
    next_units = Round.objects.get(run=run, t=1).units.all()
    assert {u.base_versions["0.0"] for u in next_units} == {1}


@pytest.mark.django_db(transaction=True)
def test_the_beat_sweep_closes_the_rounds_that_are_ready_and_only_those(
    on_s3: CeleryWorker,
) -> None:
    done, waiting = running_run(DILOCO, replicas=1), running_run(DILOCO, replicas=1)
    contribute(done, good, seed=40)

    assert send(on_s3, "close_ready_rounds").get(timeout=30) == [[done.pk, 0]]
    wait_for(lambda: Round.objects.filter(run=done, t=1).exists(), on_s3)
    assert Round.objects.get(run=waiting, t=0).state == Round.State.OPEN


@pytest.mark.django_db(transaction=True)
def test_a_round_whose_outer_steps_the_broker_lost_is_closed_by_the_beat_sweep(
    on_s3: CeleryWorker,
) -> None:
    run = running_run(DILOCO, replicas=1)
    contribute(run, good, seed=41)
    # Closing, with no close_round in the broker: as after Redis lost the round's chord.
    stalled = closing_round(run)
    Round.objects.filter(pk=stalled.pk).update(closing_at=timezone.now() - timedelta(hours=1))

    assert send(on_s3, "close_ready_rounds").get(timeout=30) == []  # nothing open is ready
    wait_for(lambda: Round.objects.filter(run=run, t=1).exists(), on_s3)

    stalled.refresh_from_db()
    assert stalled.state == Round.State.CLOSED
    assert sorted(
        ModuleVersion.objects.filter(module__run=run, version=1).values_list(
            "module__module_id", flat=True
        )
    ) == ["0.0", "shared"]
    assert OuterStep.objects.filter(round=stalled).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_between_blob_write_and_commit_is_retried_to_the_same_weights(
    on_s3: CeleryWorker,
) -> None:
    run = running_run(DILOCO, replicas=1)
    _, uploaded = contribute(run, good, seed=4)
    closing_round(run)
    armed = on_s3.faults / Fault.KILL_AFTER_BLOB_WRITE.value  # type: ignore[attr-defined]
    armed.touch()

    report = send(on_s3, "outer_step", run.pk, "0.0", 0).get(timeout=90)

    assert not armed.exists(), "the fault never fired: the worker was not killed"
    assert "SIGKILL" in on_s3.log_path.read_text(errors="replace")
    assert report["outcome"] == "stepped" and report["version"] == 1
    assert ModuleVersion.objects.filter(module__run=run, module__module_id="0.0").count() == 2
    assert_same(stored_version(run, "0.0", 1), library_step(run, "0.0", [uploaded["0.0"]]))


@pytest.mark.django_db(transaction=True)
def test_a_duplicate_delivery_publishes_one_version_and_counts_once(on_s3: CeleryWorker) -> None:
    run = running_run(DILOCO, replicas=1)
    worker, _ = contribute(run, good, seed=5)
    closing_round(run)

    first, second = (send(on_s3, "outer_step", run.pk, "0.0", 0) for _ in range(2))
    reports = [first.get(timeout=60), second.get(timeout=60)]

    assert sorted(r["replayed"] for r in reports) == [False, True]
    assert {r["version"] for r in reports} == {1}
    assert ModuleVersion.objects.filter(module__run=run, version=1).count() == 1
    assert Worker.objects.get(pk=worker.pk).contributions_accepted == 1


@pytest.mark.django_db(transaction=True)
def test_two_worker_processes_step_the_modules_of_a_round_side_by_side(on_s3: CeleryWorker) -> None:
    run = running_run(GRID, replicas=1)
    for seed in range(4):
        contribute(run, good, seed=10 + seed, name=f"w{seed}")
    closing_round(run)
    modules = list(Module.objects.filter(run=run).values_list("module_id", flat=True))

    results = [send(on_s3, "outer_step", run.pk, m, 0) for m in modules]
    reports = [r.get(timeout=60) for r in results]

    assert len(modules) == 5 and {r["module_id"] for r in reports} == set(modules)
    assert all(r["outcome"] == "stepped" for r in reports)
    assert len({r["pid"] for r in reports}) == 2, "both pool processes should have stepped modules"


# --- the service in this process, on the local store ------------------------------------------------


def test_a_module_with_no_accepted_contribution_keeps_its_version(db: None) -> None:
    run = running_run(DILOCO, replicas=2)
    worker, _ = contribute(run, with_nan, seed=6)
    contribute(run, wrong_shape, seed=7)
    closing_round(run)

    report = step_module(run.pk, "0.0", 0)

    assert (report["outcome"], report["version"], report["rejected"]) == ("kept", None, 2)
    assert Module.objects.get(run=run, module_id="0.0").current_version == 0
    assert not ModuleVersion.objects.filter(module__run=run, version=1).exists()
    assert Worker.objects.get(pk=worker.pk).contributions_rejected == 1
    assert step_module(run.pk, "0.0", 0)["replayed"]


def test_a_crash_after_the_blob_write_exposes_nothing_and_the_retry_lands_once(
    db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = running_run(DILOCO, replicas=1)
    worker, uploaded = contribute(run, good, seed=8)
    closing_round(run)
    monkeypatch.setenv(FAULTS_DIR_ENV, str(tmp_path))
    (tmp_path / Fault.RAISE_AFTER_BLOB_WRITE.value).touch()

    with pytest.raises(InjectedFault):
        step_module(run.pk, "shared", 0)

    key = keys.module_key(run.pk, "shared", 1)
    assert get_blob_store().exists(key), "the crash came after the blob write"
    assert Module.objects.get(run=run, module_id="shared").current_version == 0
    assert not OuterStep.objects.exists()
    assert set(Contribution.objects.values_list("status", flat=True)) == {"pending"}
    assert Worker.objects.get(pk=worker.pk).contributions_accepted == 0

    first = step_module(run.pk, "shared", 0)
    again = step_module(run.pk, "shared", 0)
    assert (first["replayed"], again["replayed"], first["version"]) == (False, True, 1)
    row = ModuleVersion.objects.get(module__run=run, module__module_id="shared", version=1)
    assert row.sha256 == hashlib.sha256(get_blob_store().get_bytes(key)).hexdigest()
    assert_same(stored_version(run, "shared", 1), library_step(run, "shared", [uploaded["shared"]]))
    assert Worker.objects.get(pk=worker.pk).contributions_accepted == 2 - 1  # shared only


def test_uploads_that_differ_from_their_report_or_stand_out_by_norm_are_rejected(db: None) -> None:
    run = running_run(DILOCO, replicas=6)
    for seed in range(3):
        contribute(run, good, seed=20 + seed)
    contribute(
        run, lambda r, m, s: codecs.encode(random_delta(r, m, s, scale=1.0), "fp16"), seed=23
    )
    lying, _ = contribute(run, good, seed=24)
    missing, _ = contribute(run, good, seed=25)
    store = get_blob_store()
    for c in Contribution.objects.filter(lease__worker=lying, module__module_id="0.0"):
        store.put_bytes(c.blob_key, good(run, "0.0", 99))  # overwritten after completion
    for c in Contribution.objects.filter(lease__worker=missing, module__module_id="0.0"):
        store.delete(c.blob_key)
    closing_round(run)

    report = step_module(run.pk, "0.0", 0)

    reasons = sorted(
        r.split(":")[0]
        for r in Contribution.objects.filter(status="rejected").values_list("reason", flat=True)
    )
    assert reasons == ["checksum_mismatch", "missing", "norm_outlier"]
    assert (report["accepted"], report["rejected"]) == (3, 3)


def test_the_robust_rules_match_the_library_while_streaming(db: None, tmp_path: Path) -> None:
    run = running_run(DILOCO, replicas=1)
    store, spec = get_blob_store(), module_spec(run.run_config, "0.0")
    uploads, deltas = [], []
    for i, scale in enumerate([1e-3, 2e-3, 5e-3, 1e-3, 3e-3]):
        data = codecs.encode(random_delta(run, "0.0", 30 + i, scale), "fp32")
        key = f"runs/{run.pk}/scratch/{i}.safetensors"
        store.put_bytes(key, data)
        digest = hashlib.sha256(data).hexdigest()
        uploads.append(Upload(i, 0, key, len(data), digest, 100 + i, path=i % 2))  # 2 paths
        deltas.append((codecs.decode(data), 100 + i))
    version = ModuleVersion.objects.get(module__run=run, module__module_id="0.0", version=0)
    base = BaseVersion(0, version.blob_key, version.sha256, "")
    for rule in ("clipped-mean", "trimmed-mean"):
        cfg = run.run_config.outer.model_copy(update={"robust": rule, "trim_fraction": 0.2})
        work = tmp_path / rule
        work.mkdir()
        judgement = judge_uploads(store, uploads, spec, cfg, work)
        result = step_judged(store, judgement, base, spec, cfg, work, round_index=0)
        assert result.weights is not None
        expected, _ = outer_step(
            stored_version(run, "0.0", 0), aggregate(deltas, cfg, paths_through=2), None, cfg
        )
        got = read_module(result.weights, spec, result.weights_sha256)
        for name in spec:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7)


def test_the_sqrt_rescale_counts_the_paths_that_contributed_not_the_layouts(db: None) -> None:
    # 4 paths, one unit each; "shared" is in all 4. The rescale is a run setting (off by
    # default since the outer-defaults sweep): on here.
    run = running_run(GRID, replicas=1, outer={"sqrt_paths_rescale": True})
    uploads: dict[str, list[bytes]] = {}
    for seed in range(3):  # three paths contribute, the fourth's unit never comes back
        _, uploaded = contribute(run, good, seed=60 + seed)
        for module_id, data in uploaded.items():
            uploads.setdefault(module_id, []).append(data)
    closing_round(run)
    done = {c.unit.path.index for c in Contribution.objects.filter(unit__round__run=run)}
    assert len(done) == 3

    for module_id in module_ids_of(run):
        report = step_module(run.pk, module_id, 0)
        contributed = [
            p for p in done if module_id in run.paths.get(index=p).modules
        ]  # the distinct paths whose uploads reached this module
        if not contributed:
            assert report["outcome"] == "kept"
            continue
        expected = library_step(run, module_id, uploads[module_id], paths=len(contributed))
        assert_same(stored_version(run, module_id, 1), expected)
    assert len(paths_through(run.run_config, "shared")) == 4
    as_if_four = library_step(run, "shared", uploads["shared"], paths=4)
    shared = stored_version(run, "shared", 1)
    assert any(not torch.equal(shared[n], as_if_four[n]) for n in shared), "√3, not √4"


def test_the_sum_follows_path_order_whatever_order_the_units_completed_in(db: None) -> None:
    """Float sums depend on their order: the server adds a module's Δs path by path (then
    replica), as dipaco simulate does, not in the order they arrived, so a run's weights
    do not depend on which worker finished first (bench/platform_run.py)."""
    run = running_run(GRID, replicas=1)
    workers = [make_worker(f"w{i}") for i in range(4)]
    grants = [grant_lease(worker) for worker in workers]
    assert [g.unit.path.index for g in grants if g is not None] == [0, 1, 2, 3]
    store, uploads = get_blob_store(), dict[str, dict[int, bytes]]()
    for worker, granted in reversed(list(zip(workers, grants, strict=True))):  # path 3 first
        assert granted is not None
        reports, seed = [], 80 + granted.unit.path.index
        for module_id in granted.unit.path.modules:
            # fp32: every mantissa bit set, so a sum in another order differs (fp16 Δs x
            # 1000 tokens add up exactly in fp32 in any order).
            data = codecs.encode(random_delta(run, module_id, seed), "fp32")
            store.put_bytes(upload_key(granted.lease, module_id), data)
            digest = hashlib.sha256(data).hexdigest()
            reports.append(ContributionReport(module_id, len(data), digest, TOKENS))
            uploads.setdefault(module_id, {})[granted.unit.path.index] = data
        complete(worker, granted.lease.pk, granted.secret, reports)
    closing_round(run)

    step_module(run.pk, "shared", 0)

    in_path_order = [uploads["shared"][p] for p in range(4)]
    assert_same(stored_version(run, "shared", 1), library_step(run, "shared", in_path_order, 4))


def test_a_warm_up_round_steps_with_its_share_of_the_outer_learning_rate(db: None) -> None:
    run = running_run(DILOCO, replicas=1, outer={"warmup_rounds": 3})
    _, uploaded = contribute(run, good, seed=70)
    closing_round(run)

    step_module(run.pk, "0.0", 0)

    config = run.run_config.outer
    first = config.lr / 4  # from random weights (no base model): SGD's own first step
    assert outer_lr(config, 0) == pytest.approx(first)
    spec = module_spec(run.run_config, "0.0")
    grad = aggregate([(codecs.decode(uploaded["0.0"], spec), TOKENS)], config, spec=spec)
    base = stored_version(run, "0.0", 0)
    expected, _ = outer_step(base, grad, None, config, lr=first)
    assert_same(stored_version(run, "0.0", 1), expected)


def module_ids_of(run: Run) -> list[str]:
    return list(run.modules.order_by("pk").values_list("module_id", flat=True))


def test_a_step_that_fails_for_good_leaves_the_reason_and_the_round_resumable(db: None) -> None:
    run = running_run(DILOCO, replicas=1)
    contribute(run, good, seed=50)
    closing_round(run)

    fail_round(run.pk, 0)  # the chord's error callback, after a step ran out of retries
    run.refresh_from_db()
    assert run.state == Run.State.RUNNING and "send close_round" in run.error

    for module_id in ("0.0", "shared"):  # what resending close_round runs
        step_module(run.pk, module_id, 0)
    assert finish_round(run.pk, 0) == "opened"
    run.refresh_from_db()
    assert run.error == "" and run.current_round == 1


def test_the_run_finishes_after_its_last_round(db: None) -> None:
    run = running_run(DILOCO, replicas=1, rounds=1)
    closing_round(run)
    assert advance_run(run, 0) == "finished"
    run.refresh_from_db()
    assert run.state == Run.State.FINISHED
    assert set(run.paths.values_list("state", flat=True)) == {"finished"}


MEMORY_SCRIPT = """
import json, os, sys, tempfile, pathlib
import django
django.setup()
import torch
from dipaco_server.rounds.outer.step import BaseVersion, step_judged
from dipaco_server.rounds.verification.judge import judge_uploads
from dipaco_server.rounds.verification.uploads import Upload
from dipaco_server.storage.local import LocalBlobStore

def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

args = json.loads(sys.argv[1])
store = LocalBlobStore(pathlib.Path(args["root"]), public_url="http://x", secret="s")
cfg = __import__("dipaco.config", fromlist=["OuterConfig"]).OuterConfig()
def run(case):
    spec = {k: (tuple(v), torch.float32) for k, v in case["spec"].items()}
    uploads = [Upload(i, 0, *u) for i, u in enumerate(case["uploads"])]
    base = BaseVersion(0, case["base"], case["base_sha"], "")
    work = pathlib.Path(tempfile.mkdtemp(dir=args["root"]))
    result = step_judged(store, judge_uploads(store, uploads, spec, cfg, work), base, spec, cfg,
                         work, round_index=0)
    assert result.weights is not None and all(v.accepted for v in result.verdicts)
run(args["warmup"])  # the same code path once, so the measured one loads no new code
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
baseline = rss_kib("VmRSS:")
run(args["measured"])
print(json.dumps({"baseline_kib": baseline, "peak_kib": rss_kib("VmHWM:")}))
"""


def test_the_peak_memory_of_an_outer_step_stays_under_three_times_the_module(
    tmp_path: Path,
) -> None:
    from dipaco_server.storage.local import LocalBlobStore

    store = LocalBlobStore(tmp_path, public_url="http://x", secret="s")

    def case(name: str, shapes: dict[str, tuple[int, ...]], count: int) -> dict[str, Any]:
        base = {k: torch.randn(s) for k, s in shapes.items()}
        file = tmp_path / f"{name}-base"
        sha, _ = write_module(file, base)
        store.put_file(f"{name}/base", file)
        # One Δ under `count` keys: the step reads each one as if it were different.
        data = codecs.encode({k: torch.randn(s) * 1e-3 for k, s in shapes.items()}, "fp32")
        digest, uploads = hashlib.sha256(data).hexdigest(), []
        for i in range(count):
            store.put_bytes(f"{name}/{i}", data)
            uploads.append([f"{name}/{i}", len(data), digest, 100])
        return {"spec": shapes, "base": f"{name}/base", "base_sha": sha, "uploads": uploads}

    # 4M parameters (16 MiB in fp32) in two tensors, 8 fp32 contributions (128 MiB of uploads).
    shapes = {"a": (2048, 1024), "b": (1024, 2048)}
    args = {
        "root": str(tmp_path),
        "warmup": case("warmup", {"a": (64, 32), "b": (32, 64)}, 2),
        "measured": case("big", shapes, 8),
    }
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "dipaco_server.settings",
        "OMP_NUM_THREADS": "1",
        # A fixed mmap threshold: big buffers are unmapped when freed, so memory freed
        # before the baseline cannot be reused unseen (see bench/outer_step.py).
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "MALLOC_TRIM_THRESHOLD_": "131072",
    }
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, json.dumps(args)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    module_kib = 4 * 4 * 1024 * 1024 // 1024
    growth = figures["peak_kib"] - figures["baseline_kib"]
    print(f"outer step peak growth {growth} KiB = {growth / module_kib:.2f}x the fp32 module")
    assert growth <= 3 * module_kib
