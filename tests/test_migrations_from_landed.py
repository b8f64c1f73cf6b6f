"""A database migrated from the landed schema serves a run created before the change.

LANDED names each app's last migration when the server's rounds app was split into its
parts (verification, protocol, outer, lifecycle, reports), which moved code and kept every
model and table. The test migrates the test database back to those nodes, writes a running
run with round 0 open through the historical models of that schema (what a server of then
stored), migrates forward to today's leaves, and has today's code serve it: a worker leases
one of the old units, trains nothing but hands in a well-formed Δ for every module, and
the run's status shows the round. A later migration that breaks existing rows fails here.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.utils import timezone

from dipaco.codecs import encode
from dipaco.config import RunConfig
from dipaco.data.windows import unit_start, unit_windows
from dipaco.modular import init_modules, module_ids, modules_of_path
from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.runs import keys
from dipaco_server.runs.models import Run
from dipaco_server.storage import BlobStore, get_blob_store
from tests import test_worker_api as api

LANDED = [
    ("accounts", "0001_initial"),
    ("audit", "0001_initial"),
    ("rounds", "0011_contribution_replica_sketch"),
    ("runs", "0004_module_version_update"),
    ("workers", "0002_trust"),
]


def write_landed_run(apps: Any, store: BlobStore, config: RunConfig) -> int:
    """A running run with its version-0 modules and round 0 open with its units queued, as
    rows of the historical models `apps`; its id."""
    now = timezone.now()
    run_model = apps.get_model("runs", "Run")
    run = run_model.objects.create(
        name=config.name, config=config.model_dump(mode="json"), state="running",
        phase="paths", started_at=now,
    )  # fmt: skip
    modules = init_modules(config)
    versions = {}
    for module_id in module_ids(config):
        level, index = None, 0  # "shared"
        if module_id.startswith("path."):
            index = int(module_id.removeprefix("path."))
        elif "." in module_id:
            level, index = (int(part) for part in module_id.split("."))
        module = apps.get_model("runs", "Module").objects.create(
            run=run, phase=2, module_id=module_id, current_version=0, level=level, index=index
        )
        data = encode(modules[module_id], "fp32")
        key = keys.module_key(run.pk, module_id, 0)
        store.put_bytes(key, data)
        apps.get_model("runs", "ModuleVersion").objects.create(
            module=module, version=0, blob_key=key, size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )  # fmt: skip
        versions[module_id] = 0
    round_ = apps.get_model("rounds", "Round").objects.create(
        run=run, t=0, opened_at=now, deadline=now + timedelta(hours=1)
    )
    for p in range(config.num_paths):
        path = apps.get_model("runs", "Path").objects.create(
            run=run, phase=2, index=p, choices=list(config.path_modules(p)),
            modules=modules_of_path(config, p),
        )  # fmt: skip
        base = {m: versions[m] for m in path.modules}
        for r in range(config.replicas_per_path):
            apps.get_model("rounds", "WorkUnit").objects.create(
                round=round_, path=path, replica=r, data_position=unit_start(config, 0, r),
                data_windows=unit_windows(config), base_versions=base,
            )  # fmt: skip
    return int(run.pk)


@pytest.mark.django_db(transaction=True)
def test_a_run_written_under_the_landed_schema_is_served_after_migrating(
    client: Client, settings: Any, tmp_path: Any
) -> None:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    store = get_blob_store()
    executor = MigrationExecutor(connection)
    executor.migrate(LANDED)  # undoes whatever was added since
    landed = executor.loader.project_state(LANDED).apps
    run_id = write_landed_run(landed, store, RunConfig.tiny(name="landed-run"))

    executor = MigrationExecutor(connection)  # a fresh loader: it sees the applied state
    leaves = executor.loader.graph.leaf_nodes()
    executor.migrate(leaves)
    assert not MigrationExecutor(connection).migration_plan(leaves), "left unapplied"

    run = Run.objects.get(pk=run_id)
    api.put_train_shards(store, run, api.SHARD_TOKENS)
    _, token = api.new_worker("after-migrating")
    lease = api.take_lease(client, token)
    assert lease["run_id"] == run_id and lease["round"] == 0
    holder = api.Holder(client, store, run, token, lease)
    manifest = holder.on("manifest", method="GET")
    assert manifest.status_code == 200, manifest.content
    done = holder.on("complete", holder.completion())
    assert done.status_code == 200, done.content
    assert {c["status"] for c in done.json()["contributions"]} == {"pending"}

    user, _ = create_user("ops", staff=True)
    staff = create_api_token(user, name="tests")[1]
    status = client.get(f"/api/v1/runs/{run_id}", headers={"Authorization": f"Bearer {staff}"})
    assert status.status_code == 200, status.content
    assert status.json()["round"]["t"] == 0 and status.json()["workers"]["contributed"] == 1
