"""The control plane's data model: constraints, indexes, run creation and blob keys.

Also home of the small builders the scheduler, run-state and worker tests share
(`make_run`, `prepare_run`, `make_worker`), so each test reads as its scenario.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction

from dipaco.config import RunConfig
from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit
from dipaco_server.runs import keys
from dipaco_server.runs.errors import VersionConflict
from dipaco_server.runs.models import Module, ModuleVersion, Path, Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker

SHARD_TOKENS = 100_000  # about 9 unit windows of the tiny config (20 x 4 x 128 tokens)


def tiny_config(**sections: Any) -> dict[str, Any]:
    """RunConfig.tiny as the JSON an admin would post (its name left to the run)."""
    config = RunConfig.tiny(**sections).model_dump(mode="json")
    del config["name"]
    return config


def make_run(name: str = "tiny-run", **sections: Any) -> Run:
    return create_run(name, tiny_config(**sections))


def prepare_run(run: Run, shard_tokens: int = SHARD_TOKENS) -> Run:
    """Prepared data and version 0 of every module, then draft → preparing → ready."""
    for module in run.modules.all():
        publish_module_version(
            module,
            0,
            blob_key=keys.module_key(run.pk, module.module_id, 0),
            sha256="0" * 64,
            size=1024,
        )
    run.paths.update(train_tokens=shard_tokens)
    for state in ("preparing", "ready"):
        transition(run, state)
    return run


def make_worker(name: str = "gpu-box") -> Worker:
    _, enrollment = create_enrollment_token(max_uses=None)
    worker, _ = register_worker(enrollment, name, {"gpu": "none", "memory_gb": 1})
    return worker


def test_create_run_makes_every_module_and_path_of_the_layout(db: None) -> None:
    from dipaco.modular import module_ids, modules_of_path

    run = make_run(replicas_per_path=2)
    spec = run.run_config
    assert sorted(run.modules.values_list("module_id", flat=True)) == sorted(module_ids(spec))
    paths = list(run.paths.order_by("index"))
    assert [p.index for p in paths] == list(range(spec.num_paths))
    for path in paths:
        assert path.modules == modules_of_path(spec, path.index)
        assert tuple(path.choices) == spec.path_modules(path.index)
    level_module = run.modules.get(module_id="1.0")
    assert (level_module.level, level_module.index) == (1, 0)
    assert run.state == Run.State.DRAFT


def test_a_module_version_is_unique_per_module_and_version(db: None) -> None:
    module = make_run().modules.get(module_id="0.1")
    ModuleVersion.objects.create(module=module, version=0, blob_key="a", sha256="0" * 64, size=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        ModuleVersion.objects.create(
            module=module, version=0, blob_key="b", sha256="1" * 64, size=2
        )


def test_publishing_a_version_again_is_a_no_op_but_other_content_is_refused(db: None) -> None:
    module = make_run().modules.get(module_id="shared")
    first = publish_module_version(module, 3, blob_key="k", sha256="a" * 64, size=10)
    again = publish_module_version(module, 3, blob_key="k", sha256="a" * 64, size=10)
    assert again.pk == first.pk and module.current_version == 3
    with pytest.raises(VersionConflict, match="immutable"):
        publish_module_version(module, 3, blob_key="k", sha256="b" * 64, size=10)
    publish_module_version(module, 1, blob_key="old", sha256="c" * 64, size=10)
    module.refresh_from_db()
    assert module.current_version == 3, "an older version must never become current again"


def test_a_round_number_and_a_path_index_are_unique_per_run(db: None) -> None:
    run = make_run()
    Round.objects.create(run=run, t=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        Round.objects.create(run=run, t=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        Path.objects.create(run=run, index=0, choices=[0, 0], modules=[])
    with pytest.raises(IntegrityError), transaction.atomic():
        Module.objects.create(run=run, module_id="0.0")


def _contribution(lease: Lease, module: Module, **fields: Any) -> Contribution:
    values = {"blob_key": "k", "size": 1, "sha256": "0" * 64, "tokens": 1, **fields}
    return Contribution.objects.create(lease=lease, unit=lease.unit, module=module, **values)


def test_a_unit_gets_at_most_one_live_contribution_per_module(db: None) -> None:
    run = make_run()
    path, module = run.paths.get(index=0), run.modules.get(module_id="0.0")
    round_ = Round.objects.create(run=run, t=0)
    unit = WorkUnit.objects.create(
        round=round_, path=path, replica=0, data_position=0, data_windows=10, base_versions={}
    )
    worker = make_worker()
    leases = [
        Lease.objects.create(
            unit=unit,
            worker=worker,
            secret_hash="x",
            attempt=i + 1,
            deadline=round_.opened_at,
            hard_deadline=round_.opened_at,
        )
        for i in range(3)
    ]
    first = _contribution(leases[0], module)
    with pytest.raises(IntegrityError), transaction.atomic():
        _contribution(leases[0], module, blob_key="again")  # twice under one lease
    with pytest.raises(IntegrityError), transaction.atomic():
        _contribution(leases[1], module)  # a second live Δ for the same unit and module
    first.status, first.reason = Contribution.Status.REJECTED, "non-finite values"
    first.save()
    _contribution(leases[2], module)  # a rejected one no longer blocks a replacement
    assert unit.contributions.filter(status="pending").count() == 1


def test_the_hot_queries_have_their_indexes(db: None) -> None:
    with connection.cursor() as cursor:
        found = {
            name
            for table in ("rounds_workunit", "rounds_lease", "workers_worker")
            for name in connection.introspection.get_constraints(cursor, table)
        }
    assert {"unit_state_round_idx", "lease_state_deadline_idx"} <= found
    with connection.cursor() as cursor:
        worker_columns = connection.introspection.get_constraints(cursor, "workers_worker")
    assert any(
        c["columns"] == ["token_hash"] and (c["unique"] or c["index"])
        for c in worker_columns.values()
    )


def test_keys_follow_the_object_store_layout() -> None:
    assert keys.module_key(7, "0.1", 3) == "runs/7/modules/0.1/v3.safetensors"
    assert keys.momentum_key(7, "shared", 3) == "runs/7/modules/shared/momentum/v3.safetensors"
    assert (
        keys.contribution_key(7, 2, 41, 99, "path.3") == "runs/7/rounds/2/41/99/path.3.safetensors"
    )
    assert keys.data_key(7, 5, "val") == "runs/7/data/5/val.bin"
    assert keys.tokenizer_key(7) == "runs/7/tokenizer.json"


@pytest.mark.parametrize("module_id", ["../x", "0.1/../../etc", "", "0.-1", "shared/x", "Path.1"])
def test_keys_refuse_anything_but_a_module_id(module_id: str) -> None:
    with pytest.raises(ValueError, match="module id"):
        keys.contribution_key(1, 0, 1, 1, module_id)


def test_keys_refuse_negative_or_non_integer_ids() -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        keys.module_key(-1, "0.0", 0)
    with pytest.raises(ValueError, match="non-negative int"):
        keys.contribution_key(1, 0, "3/../4", 1, "0.0")  # type: ignore[arg-type]
