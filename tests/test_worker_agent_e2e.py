"""The worker agent against a live control plane: `dipaco-worker` processes over real HTTP.

The server is Django's live server on the session's database (PostgreSQL when it
answers) with the local blob store, so every byte goes through presigned URLs as in
production. Each test starts real `dipaco-worker` processes and reads their
``--json-logs`` lines: one unit from enrollment to recorded contributions; ``kill -9``
mid-unit, then a restart that resumes the same lease from its checkpoint, then SIGTERM
during training (its partial Δ is uploaded and completed, exit 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.codecs import decode
from dipaco.config import RunConfig
from dipaco.inner import InnerState, state_fingerprint
from dipaco.modular import init_modules, module_spec
from dipaco.modules_file import write_module
from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round, WorkUnit
from dipaco_server.rounds.outer.step import step_module
from dipaco_server.rounds.protocol.leases import expire_leases
from dipaco_server.runs import keys
from dipaco_server.runs.models import ModuleVersion, Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token
from tests.test_models import tiny_config
from tests.test_worker_api import put_train_shards

SHARD_TOKENS = 40_000
# A smaller model than RunConfig.tiny's, so steps are quick on a busy CPU.
SMALL_MODEL = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 64,
               "vocab_size": 256, "seq_len": 32}  # fmt: skip
WORKER_BIN = Path(sys.executable).parent / "dipaco-worker"
EVENT_TIMEOUT_S = 90.0
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def store(settings: Any, tmp_path: Path, live_server: Any) -> BlobStore:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    settings.DIPACO_PUBLIC_URL = live_server.url
    return get_blob_store()


def running_run(store: BlobStore, steps: int) -> Run:
    """A running 2x2-path tiny run, H = `steps`, with real version-0 blobs and shards."""
    run = create_run("agent-run", tiny_config(model=SMALL_MODEL, inner={"steps": steps}))
    publish_version_0(store, run)
    put_train_shards(store, run, SHARD_TOKENS)
    for state in ("preparing", "ready"):
        transition(run, state)
    start_run(run)
    return run


def publish_version_0(store: BlobStore, run: Run) -> None:
    """Version 0 of every module, written as the server's preparation writes them."""
    modules = init_modules(run.run_config)
    folder = Path(tempfile.mkdtemp(prefix="agent-run-v0-"))
    for module in run.modules.all():  # as the server's preparation writes them
        file = folder / f"{module.module_id}.safetensors"
        digest, size = write_module(file, modules[module.module_id])
        key = keys.module_key(run.pk, module.module_id, 0)
        store.put_file(key, file)
        publish_module_version(module, 0, blob_key=key, sha256=digest, size=size)
    shutil.rmtree(folder)


class WorkerProcess:
    """A `dipaco-worker --json-logs` process; a thread collects the events it prints."""

    def __init__(self, server: str, data_dir: Path, *args: str) -> None:
        command = [
            str(WORKER_BIN), "--server", server, "--data-dir", str(data_dir), "--json-logs",
            "--threads", "1", "--probe-seconds", "0.05", *args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a traceback or a library's warning: kept in `lines`
            self.events.append(event)
            self._queue.put(event)
        self._queue.put(None)  # end of output

    def output(self) -> str:
        return "".join(self.lines[-40:])

    def wait_for(self, name: str, **fields: Any) -> dict[str, Any]:
        """The next event called `name` whose fields have at least the given values."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if event is None:
                break
            if event.get("event") == name and all(
                event.get(k) == v if not callable(v) else v(event.get(k)) for k, v in fields.items()
            ):
                return event
        raise AssertionError(f"no {name} event {fields}; output:\n{self.output()}")

    def wait_for_step(self, at_least: int) -> dict[str, Any]:
        return self.wait_for("step", step=lambda step: step >= at_least)

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=EVENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the worker did not exit; output:\n{self.output()}") from None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


def wait_for_saved_step(state: Path, at_least: int) -> dict[str, Any]:
    """The agent's lease.json once it records a checkpoint at `at_least` steps or more."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            saved: dict[str, Any] = json.loads(state.read_text())
        except (FileNotFoundError, ValueError):
            saved = {}
        if saved.get("step", 0) >= at_least:
            return saved
        time.sleep(0.01)
    raise AssertionError(f"{state} never recorded step {at_least}")


def enrollment() -> str:
    return create_enrollment_token(max_uses=None)[1]


def test_one_worker_enrolls_trains_a_unit_and_its_contributions_decode_to_finite_deltas(
    store: BlobStore, live_server: Any, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    run = running_run(store, steps=3)
    worker = WorkerProcess(live_server.url, tmp_path / "agent", "--enroll", enrollment(), "--once")
    workers.append(worker)
    assert worker.finish() == 0, worker.output()

    names = [e["event"] for e in worker.events]
    assert names.index("enrolled") < names.index("lease") < names.index("completed")
    config_file = tmp_path / "agent" / "worker.json"
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o600
    registered = Worker.objects.get()
    assert registered.device["probe_tokens_per_second"] > 0
    assert registered.units_completed == 0  # credited once the outer step accepts its Δs

    lease = Lease.objects.select_related("unit__path").get()
    assert lease.state == Lease.State.COMPLETED and lease.unit.state == WorkUnit.State.DONE
    config = RunConfig.model_validate(run.config)
    rows = list(Contribution.objects.filter(lease=lease).select_related("module"))
    assert sorted(r.module.module_id for r in rows) == sorted(lease.unit.path.modules)
    for row in rows:
        data = store.get_bytes(row.blob_key)
        assert (len(data), hashlib.sha256(data).hexdigest()) == (row.size, row.sha256)
        assert row.tokens == 3 * config.inner.batch_size * config.model.seq_len
        spec = module_spec(config, row.module.module_id)
        delta = decode(data, expected=spec)
        assert all(torch.isfinite(t).all() for t in delta.values())
        assert math.sqrt(sum(float(t.pow(2).sum()) for t in delta.values())) > 0
    assert not (tmp_path / "agent" / "lease.json").exists(), "a completed unit leaves no state"
    # ...but the path's inner state, for its next unit on this worker: AdamW moments (and,
    # with a quantising codec, the residual), for this model.
    kept = (
        tmp_path
        / "agent"
        / "cache"
        / "inner"
        / f"run-{run.pk}"
        / f"path-{lease.unit.path.index}.safetensors"
    )
    state = InnerState.load(kept, state_fingerprint(config))
    assert (
        state is not None
        and state.adam
        and state.residual.keys()
        >= {f"{m}/{name}" for m in lease.unit.path.modules for name in module_spec(config, m)}
    )


def test_after_kill_9_a_restart_resumes_the_lease_and_sigterm_then_salvages_its_partial_delta(
    store: BlobStore, live_server: Any, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    run = running_run(store, steps=400)
    data_dir = tmp_path / "agent"
    # Checkpoints by time, written in the background: lease.json records a step only once
    # its checkpoint is on disk.
    first = WorkerProcess(
        live_server.url, data_dir, "--enroll", enrollment(), "--checkpoint-interval", "0.05"
    )
    workers.append(first)
    first.wait_for_step(1)
    saved = wait_for_saved_step(data_dir / "lease.json", at_least=2)
    first.kill()

    second = WorkerProcess(live_server.url, data_dir, "--checkpoint-every", "100")
    workers.append(second)
    resumed = second.wait_for("resume")
    assert resumed["lease_id"] == saved["lease"]["lease_id"]
    assert second.wait_for_step(1)["step"] > saved["step"], "training went on from the checkpoint"
    second.process.send_signal(signal.SIGTERM)  # mid-training: 400 steps take far longer
    assert second.finish() == 0, second.output()

    names = [e["event"] for e in second.events]
    assert names.index("stopping") < names.index("salvage") < names.index("salvaged")
    salvaged = next(e for e in second.events if e["event"] == "salvaged")
    lease = Lease.objects.select_related("unit").get()
    assert lease.pk == saved["lease"]["lease_id"] and lease.state == Lease.State.COMPLETED
    assert lease.unit.state == WorkUnit.State.DONE, "the partial unit is done, not redone"
    config = RunConfig.model_validate(run.config)
    per_step = config.inner.batch_size * config.model.seq_len
    steps = salvaged["steps"]
    assert saved["step"] < steps < 400
    tokens = {c.tokens for c in Contribution.objects.filter(lease=lease)}
    assert tokens == {steps * per_step} == {salvaged["tokens"]}, "its true token count"
    assert not (data_dir / "lease.json").exists()
    assert not (data_dir / "work").exists() or not any((data_dir / "work").iterdir())
    kept = data_dir / "cache" / "inner" / f"run-{run.pk}"
    assert list(kept.glob("*.safetensors")), "an accepted partial Δ keeps its path's moments"


def test_after_kill_9_and_expiry_a_restart_resumes_the_unit_under_a_new_lease_and_it_counts(
    store: BlobStore, live_server: Any, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    """A preempted volunteer loses nothing: its lease expires while it is down, the server
    hands the same unit back to it under a new lease, training resumes from the unit's
    checkpoint, SIGTERM uploads the Δ of every step done (both leases'), and round 0's
    outer step takes it, weighted by those tokens: each version once, nothing lost."""
    run = running_run(store, steps=400)
    data_dir = tmp_path / "agent"
    first = WorkerProcess(
        live_server.url, data_dir, "--enroll", enrollment(), "--checkpoint-every", "2"
    )
    workers.append(first)
    first.wait_for_step(1)
    saved = wait_for_saved_step(data_dir / "lease.json", at_least=2)
    first.kill()
    old = Lease.objects.get(pk=saved["lease"]["lease_id"])
    assert expire_leases(now=old.hard_deadline + timedelta(seconds=1)) == 1  # it never came back

    second = WorkerProcess(live_server.url, data_dir, "--checkpoint-every", "100")
    workers.append(second)
    second.wait_for("resume")  # the saved lease is over; its unit's checkpoint is kept
    granted = second.wait_for("lease")
    assert granted["lease_id"] != old.pk
    assert second.wait_for_step(1)["step"] > saved["step"], "resumed from the checkpoint"
    second.process.send_signal(signal.SIGTERM)
    assert second.finish() == 0, second.output()
    salvaged = next(e for e in second.events if e["event"] == "salvaged")

    new = Lease.objects.select_related("unit").get(pk=granted["lease_id"])
    assert new.unit_id == old.unit_id and new.state == Lease.State.COMPLETED
    config = RunConfig.model_validate(run.config)
    per_step = config.inner.batch_size * config.model.seq_len
    assert salvaged["tokens"] == salvaged["steps"] * per_step > saved["step"] * per_step

    round_ = Round.objects.get(run=run, t=0)
    assert mark_round_closing(round_)
    for module_id in new.unit.path.modules:
        report = step_module(run.pk, module_id, 0, store=store)
        assert (report["outcome"], report["accepted"]) == ("stepped", 1), report
    steps = OuterStep.objects.filter(round=round_, outcome="stepped")
    assert {s.tokens for s in steps} == {salvaged["tokens"]}, "weighted by its true tokens"
    # The invariants: each stepped module went from version 0 to 1 once; every accepted
    # contribution is the one salvaged lease's; no unit completed under two leases.
    for s in steps:
        assert (s.base_version, s.version) == (0, 1)
        assert ModuleVersion.objects.filter(module=s.module).count() == 2
    statuses = set(Contribution.objects.values_list("lease_id", "status"))
    assert statuses == {(new.pk, "accepted")}
    assert Lease.objects.filter(unit_id=old.unit_id, state="completed").count() == 1
