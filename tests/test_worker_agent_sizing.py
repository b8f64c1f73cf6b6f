"""Units sized to each worker (issue 20): three `dipaco-worker` processes of three speeds
(one CPU thread, two, and one thread slowed by --step-delay) share one run.

Each new worker's first unit calibrates it (it stops after ``units.calibration_seconds``
and uploads the steps done); every later unit is sized by the server to
``units.target_seconds`` at the speed that worker reported, so the slow worker gets
fewer steps, not a unit it cannot finish. What this test checks is the sizing, never a
timing: the per-unit wall times against the target are bench/unit_sizing.py's to report.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dipaco.config import RunConfig
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.models import Contribution, Lease
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.storage import BlobStore, get_blob_store
from tests.test_models import tiny_config
from tests.test_worker_agent_e2e import (
    SMALL_MODEL,
    WorkerProcess,
    enrollment,
    publish_version_0,
)
from tests.test_worker_api import put_train_shards

pytestmark = pytest.mark.django_db(transaction=True)
H = 2000  # far more than a target's worth of steps on any of the three
UNITS_EACH = 2


@pytest.fixture
def store(settings: Any, tmp_path: Path, live_server: Any) -> BlobStore:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    settings.DIPACO_PUBLIC_URL = live_server.url
    return get_blob_store()


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


def sized_run(store: BlobStore) -> Run:
    config = tiny_config(
        model=SMALL_MODEL,
        replicas_per_path=3,
        inner={"steps": H, "micro_batch_size": 8, "grad_accum_steps": 1},
        units={"target_seconds": 3.0, "calibration_seconds": 1.5},
    )
    run = create_run("sized-run", config)
    publish_version_0(store, run)
    put_train_shards(store, run, 40_000)
    for state in ("preparing", "ready"):
        transition(run, state)
    start_run(run)
    return run


def test_workers_of_three_speeds_get_units_sized_to_each_and_none_is_starved(
    store: BlobStore, live_server: Any, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    run = sized_run(store)
    config = RunConfig.model_validate(run.config)
    per_step = config.inner.batch_size * config.model.seq_len
    speeds = {"one-thread": ("--threads", "1"), "two-threads": ("--threads", "2"),
              "throttled": ("--threads", "1", "--step-delay", "0.4")}  # fmt: skip
    for name, args in speeds.items():
        worker = WorkerProcess(
            live_server.url, tmp_path / name, "--enroll", enrollment(), "--name", name,
            "--max-units", str(UNITS_EACH), *args,
        )  # fmt: skip
        workers.append(worker)
    for worker in workers:
        assert worker.finish() == 0, worker.output()

    sized: dict[str, list[int]] = {}
    for name in speeds:
        leases = list(Lease.objects.filter(worker__name=name).order_by("granted_at"))
        assert [lease.state for lease in leases] == ["completed"] * UNITS_EACH, name
        first, *later = leases
        assert first.seconds_limit == 1.5 and first.size_reason.startswith("calibration")
        for lease in later:  # "<speed> tokens/s x 3 s target = <n> steps": n is the size
            match = re.match(r"([\d,]+) tokens/s x 3 s target = ([\d,]+) steps", lease.size_reason)
            assert match, lease.size_reason
            speed, fit = (int(g.replace(",", "")) for g in match.groups())
            assert lease.steps == min(H, max(1, fit)) and lease.seconds_limit is None
            assert abs(fit - 3.0 * speed / per_step) <= 1 + 3.0 / per_step
            tokens = {c.tokens for c in Contribution.objects.filter(lease=lease)}
            assert tokens == {lease.steps * per_step}, "a sized unit trains all its steps"
        sized[name] = [lease.steps for lease in later]
        seconds = [
            Contribution.objects.filter(lease=lease).first().metrics["train_seconds"]  # type: ignore[union-attr]
            for lease in later
        ]
        print(f"{name}: sized units {sized[name]} steps, trained in "
              f"{[round(s / 3.0, 2) for s in seconds]} x the 3 s target")  # fmt: skip
    # The throttled worker (one thread, slowed) is given fewer steps than the same thread
    # unslowed, and still units it finishes. (Two threads on a busy two-core machine may
    # be slower than one: its units follow its measured speed, whatever that is.)
    assert max(sized["throttled"]) < min(sized["one-thread"])
    assert all(steps >= 1 for steps in sized["throttled"])
