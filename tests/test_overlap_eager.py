"""The eager correction on the platform (issue 20, ``outer.overlap`` "eager").

Round t + 1 opens while round t steps, as with "delayed"; its units also rebase at step
s = ceil(outer.eager_at x H) onto the versions round t publishes (platform rounds.protocol.rebase,
worker_agent.rebase), so their Δs are relative to those and the outer step applies them
with no staleness. The agent's hook is checked against the simulator's (`train_dipaco`'s
`_eager`: the same `dipaco.inner.path_shift`, bit for bit); the server side through its
services, its worker API and a real Celery worker (test_outer_tasks' fixtures: Redis,
PostgreSQL, the moto S3 server), ending with the run's invariant check (tests/faults.py).
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from dipaco import codecs
from dipaco.config import RunConfig
from dipaco.inner import ResidentTrainer, StepMetrics, UnitHooks, UnitWork, train_path
from dipaco.modular import init_modules, module_spec
from dipaco.modules_file import write_module
from dipaco.outer import aggregate, outer_lr, outer_step
from dipaco.simulate.train import _eager
from dipaco_server.rounds.lifecycle.close import mark_round_closed, mark_round_closing
from dipaco_server.rounds.lifecycle.open import open_round, start_run
from dipaco_server.rounds.lifecycle.tasks import start_closing
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round
from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.protocol.rebase import rebase_plan, rebase_targets
from dipaco_server.rounds.verification.scorer import delta_bases
from dipaco_server.runs import keys
from dipaco_server.runs.errors import ContributionInvalid
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store
from tests import test_worker_api as api
from tests.conftest import CeleryWorker, session_database_url
from tests.faults import check_invariants
from tests.test_inner import CFG, SOURCE
from tests.test_models import make_worker, tiny_config
from tests.test_outer_tasks import (  # noqa: F401 (module-scoped fixtures used below)
    DILOCO,
    TOKENS,
    contribute,
    good,
    on_s3,
    outer_worker,
    running_run,
    s3_env,
    send,
    stored_version,
    wait_for,
)
from tests.test_overlap import CLOSING, accepted_of, momentum_of
from tests.test_worker_agent_e2e import (  # noqa: F401 (a fixture used below)
    SHARD_TOKENS,
    SMALL_MODEL,
    WorkerProcess,
    enrollment,
    publish_version_0,
    workers,
)
from tests.test_worker_api import (
    put_train_shards,
    store,  # noqa: F401 (a fixture used below)
)
from worker_agent.client import BlobRef, RebaseAnswer, RebasePlan
from worker_agent.errors import ServerError
from worker_agent.rebase import MARKER_NAME, Rebaser, rebased_versions

EAGER = {"outer": {"overlap": "eager"}}
Modules = dict[str, dict[str, Tensor]]


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares two cores with other work
    yield
    torch.set_num_threads(threads)


# --- the agent's rebase against the simulator's (no server) -----------------------------------


def eager_config(eager_at: float = 0.25) -> RunConfig:
    outer = CFG.outer.model_copy(update={"overlap": "eager", "eager_at": eager_at})
    return CFG.model_copy(update={"outer": outer})


def newer(modules: Modules, scale: float = 1e-2) -> Modules:
    """A stand-in for round t's outcome: every module moved a little."""
    g = torch.Generator().manual_seed(7)
    return {
        m: {n: t + torch.randn(t.shape, generator=g) * scale for n, t in tensors.items()}
        for m, tensors in modules.items()
    }


def answer(state: str, versions: dict[str, int] | None = None) -> RebaseAnswer:
    refs = [BlobRef(m, v, "k", "0" * 64, 1, "u") for m, v in (versions or {}).items()]
    return RebaseAnswer(state, dict(versions or {}), 0.0, refs)


def rebaser(
    config: RunConfig,
    old: Modules,
    new: Modules,
    work: Path,
    asks: list[RebaseAnswer],
    **options: Any,
) -> tuple[Rebaser, list[float]]:
    """A Rebaser whose server answers `asks` in turn (the last one again) and whose
    download returns `new`; the waits it made come back in the list."""
    plan = RebasePlan(max(1, math.ceil(config.outer.eager_at * config.inner.steps)), 0)
    waits: list[float] = []
    answers = iter(asks)
    last = [asks[-1]]

    def ask() -> RebaseAnswer:
        last[0] = next(answers, last[0])
        return last[0]

    def sleep(seconds: float) -> bool:
        waits.append(seconds)
        return False

    hook = Rebaser(
        plan=plan, config=config, path=0, base=old, work_dir=work, ask=ask,
        load=lambda refs: new, give_up=lambda: None, sleep=sleep,
        steps=config.inner.steps, **options,
    )  # fmt: skip
    return hook, waits


def agent_train(
    config: RunConfig, old: Modules, work: Path, hook: Rebaser | None, **options: Any
) -> Any:
    unit = UnitWork(config, 1, 0, 0, old, SOURCE, 0)
    trainer = ResidentTrainer("cpu")
    hooks = UnitHooks(rebase=hook, fault=options.pop("fault", None))
    result, _ = trainer.train(unit, work_dir=work, hooks=hooks, **options)
    return result


def test_the_agent_waits_at_its_step_and_rebases_bit_for_bit_as_the_simulator(
    tmp_path: Path,
) -> None:
    config = eager_config()
    old = init_modules(config)
    new = newer(old)
    versions = {m: 1 for m in old}
    expected = train_path(
        config, 0, old, SOURCE, rebase=_eager(config, 0, old, new, config.outer.eager_at)
    )
    # The server says "waiting" twice (round t still steps), then "ready".
    hook, waits = rebaser(
        config, old, new, tmp_path,
        [answer("waiting"), answer("waiting"), answer("ready", versions)],
    )  # fmt: skip

    result = agent_train(config, old, tmp_path, hook)

    assert hook.plan.at_step == 5 and len(waits) == 2 and hook.versions == versions
    assert rebased_versions(tmp_path, hook.plan, len(result.losses)) == versions
    assert result.losses == expected.losses
    for module_id, delta in expected.module_deltas.items():
        for name, tensor in delta.items():  # relative to the newer version: new − θ_final
            assert torch.equal(result.module_deltas[module_id][name], tensor), (module_id, name)
    plain = train_path(config, 0, old, SOURCE)
    assert result.losses[5:] != plain.losses[5:], "the rebase changed the training"


def test_a_resumed_unit_past_its_rebase_still_reports_the_versions_it_rebased_onto(
    tmp_path: Path,
) -> None:
    config = eager_config()
    old = init_modules(config)
    new = newer(old)
    versions = {m: 1 for m in old}
    uninterrupted = train_path(
        config, 0, old, SOURCE, rebase=_eager(config, 0, old, new, config.outer.eager_at)
    )

    class Crash(Exception):
        pass

    def crash(metrics: StepMetrics, _: Any) -> None:
        if metrics.step == 9:
            raise Crash

    hook, _ = rebaser(config, old, new, tmp_path, [answer("ready", versions)])
    with pytest.raises(Crash):
        agent_train(config, old, tmp_path, hook, checkpoint_every=4, fault=crash)
    assert (tmp_path / MARKER_NAME).exists()

    def never() -> RebaseAnswer:
        raise AssertionError("a unit resumed past its rebase step does not ask again")

    again, _ = rebaser(config, old, new, tmp_path, [answer("ready", versions)])
    again.ask = never
    result = agent_train(config, old, tmp_path, again, checkpoint_every=4)

    assert rebased_versions(tmp_path, again.plan, len(result.losses)) == versions
    for module_id, delta in uninterrupted.module_deltas.items():
        for name, tensor in delta.items():
            assert torch.equal(result.module_deltas[module_id][name], tensor), (module_id, name)


def test_a_unit_that_cannot_get_the_versions_in_time_trains_on_from_its_base(
    tmp_path: Path,
) -> None:
    config = eager_config()
    old = init_modules(config)
    new = newer(old)
    plain = train_path(config, 0, old, SOURCE)

    # The lease's hard deadline has passed: waiting on cannot finish the unit in time.
    late, waits = rebaser(
        config, old, new, tmp_path / "late", [answer("waiting")],
        hard_deadline="2020-01-01T00:00:00+00:00",
    )  # fmt: skip
    result = agent_train(config, old, tmp_path / "late", late)
    assert late.versions is None and "hard deadline" in late.fallback and waits == []
    assert rebased_versions(tmp_path / "late", late.plan, len(result.losses)) is None
    assert result.losses == plain.losses  # plain delayed: relative to its base
    for module_id, delta in plain.module_deltas.items():
        for name, tensor in delta.items():
            assert torch.equal(result.module_deltas[module_id][name], tensor), (module_id, name)

    # A signal while it waits: no rebase, and it stops asking.
    stopping, waits = rebaser(config, old, new, tmp_path / "stop", [answer("waiting")])
    stopping.give_up = lambda: "stopped by a signal" if waits else None
    assert stopping(stopping.plan.at_step) is None
    assert stopping.fallback == "stopped by a signal" and len(waits) == 1
    assert stopping(stopping.plan.at_step + 1) is None  # only at its step

    # A lease that is gone is the agent's business (it drops the unit), not a fallback.
    gone, _ = rebaser(config, old, new, tmp_path / "gone", [answer("waiting")])

    def expired() -> RebaseAnswer:
        raise ServerError(409, "lease_expired", "lease 1 expired")

    gone.ask = expired
    with pytest.raises(ServerError):
        gone(gone.plan.at_step)


# --- the server ------------------------------------------------------------------------------


def upload(run: Run, lease: Lease, seed: int) -> tuple[list[ContributionReport], dict[str, bytes]]:
    blobs, reports, uploaded = get_blob_store(), [], {}
    for module_id in lease.unit.path.modules:
        data = good(run, module_id, seed)
        blobs.put_bytes(upload_key(lease, module_id), data)
        uploaded[module_id] = data
        digest = hashlib.sha256(data).hexdigest()
        reports.append(ContributionReport(module_id, len(data), digest, TOKENS))
    return reports, uploaded


@pytest.mark.django_db(transaction=True)
def test_an_eager_units_delta_is_relative_to_round_ts_versions_and_lands_on_them(
    on_s3: CeleryWorker,  # noqa: F811 (the fixture imported above)
) -> None:
    run = running_run(DILOCO, replicas=1, **EAGER)
    config = run.run_config
    contribute(run, good, seed=1, name="first")
    round0 = Round.objects.select_related("run").get(run=run, t=0)
    assert start_closing(round0)  # round 1 opens from version 0 while round 0 steps

    worker = make_worker("eager")
    granted = grant_lease(worker)
    assert granted is not None and granted.unit.round.t == 1
    unit = granted.unit
    at = max(1, math.ceil(config.outer.eager_at * config.inner.steps))
    assert rebase_plan(unit) == {"at_step": at, "round": 0}
    assert rebase_targets(unit) is None  # round 0 has not published
    reports, uploaded = upload(run, granted.lease, seed=2)
    with pytest.raises(ContributionInvalid, match="base_versions") as refused:
        complete(worker, granted.lease.pk, granted.secret, reports,
                 base_versions={"0.0": 1, "shared": 1})  # fmt: skip
    assert refused.value.details["field"] == "base_versions"

    assert send(on_s3, "close_round", run.pk, 0, True).get(timeout=30) == "closing"
    wait_for(lambda: Round.objects.filter(run=run, t=0, state="closed").exists(), on_s3)
    targets = {"0.0": 1, "shared": 1}
    assert rebase_targets(unit) == targets
    complete(worker, granted.lease.pk, granted.secret, reports, base_versions=targets)
    rows = list(Contribution.objects.filter(lease=granted.lease).select_related("lease", "unit"))
    assert {c.base_version for c in rows} == {1}
    # Proof of useful work scores it on the versions it is relative to (rounds.outer.step).
    assert delta_bases(rows)[granted.lease.pk] == (("0.0", 1), ("shared", 1))

    assert send(on_s3, "close_round", run.pk, 1).get(timeout=30) in CLOSING
    wait_for(lambda: Round.objects.filter(run=run, t=1, state="closed").exists(), on_s3)
    round1 = Round.objects.get(run=run, t=1)
    for module_id in ("0.0", "shared"):
        step = OuterStep.objects.get(round=round1, module__module_id=module_id)
        assert (step.outcome, step.base_version, step.version, step.accepted) == (
            "stepped", 1, 2, 1,
        )  # fmt: skip
        spec = module_spec(config, module_id)
        grad = aggregate([(codecs.decode(uploaded[module_id], spec), step.tokens)],
                         config.outer, paths_through=1, spec=spec)  # fmt: skip
        expected, _ = outer_step(
            stored_version(run, module_id, 1), grad, momentum_of(run, module_id, 1),
            config.outer, lr=outer_lr(config.outer, 1),
        )  # fmt: skip
        actual = stored_version(run, module_id, 2)
        for name in expected:  # the Δ, relative to version 1, applied onto version 1
            assert torch.equal(actual[name], expected[name]), (module_id, name)

    # The last round: a unit that did not rebase (no base_versions) is relative to its base,
    # as delayed; the run finishes with its invariants whole.
    contribute(run, good, seed=3, name="third")
    last = Contribution.objects.filter(unit__round__run=run, unit__round__t=2)
    assert {c.base_version for c in last} == {c.unit.base_versions["0.0"] for c in last} == {1}
    assert send(on_s3, "close_round", run.pk, 2).get(timeout=30) in CLOSING
    wait_for(lambda: Run.objects.get(pk=run.pk).state == "finished", on_s3)
    assert not Contribution.objects.filter(unit__round__run=run, status="pending").exists()
    accepted = [a for t in range(3) for a in accepted_of(run, t)]
    assert len(accepted) == 3
    check_invariants(session_database_url(), run.pk, accepted)


def publish_next(blobs: BlobStore, run: Run, version: int, work: Path) -> None:
    """Version `version` of every module (round version - 1's step, by hand)."""
    modules = newer(init_modules(run.run_config))
    for module in run.modules.all():
        file = work / f"v{version}-{module.module_id}"
        digest, size = write_module(file, modules[module.module_id])
        key = keys.module_key(run.pk, module.module_id, version)
        blobs.put_file(key, file)
        publish_module_version(module, version, blob_key=key, sha256=digest, size=size)


def test_the_worker_api_tells_the_rebase_and_refuses_a_delta_relative_to_anything_else(
    client: Any,
    store: BlobStore,  # noqa: F811 (the fixture imported above)
    django_capture_on_commit_callbacks: Any,
    tmp_path: Path,
) -> None:
    run = api.running_run(store)
    config = {**run.config, "outer": {**run.config["outer"], "overlap": "eager"}}
    Run.objects.filter(pk=run.pk).update(config=config)
    run.refresh_from_db()
    api.sent_tasks()  # whatever earlier tests left
    for i in range(run.paths.count()):
        _, token = api.new_worker(f"w{i}")
        holder = api.Holder(client, store, run, token, api.take_lease(client, token))
        assert holder.lease["rebase"] is None  # round 0: nothing to rebase onto
        with django_capture_on_commit_callbacks(execute=True):
            done = holder.on("complete", holder.completion())
        assert done.status_code == 200, done.content
    api.sent_tasks()

    holder = api.Holder(client, store, run, token, api.take_lease(client, token))
    at = max(1, math.ceil(0.1 * run.run_config.inner.steps))
    assert holder.lease["round"] == 1 and holder.lease["rebase"] == {"at_step": at, "round": 0}
    waiting = holder.on("rebase", method="GET")
    assert waiting.status_code == 200, waiting.content
    assert waiting.json()["state"] == "waiting" and waiting.json()["modules"] == []

    body = holder.completion()
    modules = holder.lease["modules"]
    for bad in ({m: 99 for m in modules}, {m: 1 for m in modules}, {modules[0]: 0}):
        refused = api.assert_error(
            holder.on("complete", {**body, "base_versions": bad}), 422, "contribution_invalid"
        )
        assert "base_versions" in refused["message"], refused
        assert refused["details"]["field"] == "base_versions", refused

    publish_next(store, run, 1, tmp_path)
    mark_round_closed(Round.objects.get(run=run, t=0))
    ready = holder.on("rebase", method="GET").json()
    targets = {m: 1 for m in modules}
    assert ready["state"] == "ready" and ready["versions"] == targets
    assert [m["version"] for m in ready["modules"]] == [1] * len(modules)
    mixed = {**{m: 0 for m in modules}, modules[0]: 1}  # a rebase moves every module
    api.assert_error(
        holder.on("complete", {**body, "base_versions": mixed}), 422, "contribution_invalid"
    )

    done = holder.on("complete", {**body, "base_versions": targets})
    assert done.status_code == 200, done.content
    assert {c["base_version"] for c in done.json()["contributions"]} == {1}
    assert holder.on("complete", {**body, "base_versions": targets}).status_code == 200
    api.assert_error(holder.on("complete", body), 409, "contribution_conflict")  # not the same
    api.sent_tasks()


# --- a real dipaco-worker process against a live server -----------------------------------


@pytest.fixture
def live_store(settings: Any, tmp_path: Path, live_server: Any) -> BlobStore:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    settings.DIPACO_PUBLIC_URL = live_server.url
    return get_blob_store()


@pytest.mark.django_db(transaction=True)
def test_a_dipaco_worker_waits_at_its_step_rebases_and_completes_relative_to_round_ts(
    live_store: BlobStore,
    live_server: Any,
    tmp_path: Path,
    workers: list[WorkerProcess],  # noqa: F811 (the fixture imported above)
) -> None:
    """Round 0 closing, round 1 open: the worker trains round 1's unit to step
    ceil(0.5 x 4) = 2, waits there while round 0 "steps", then rebases onto version 1."""
    run = create_run(
        "eager-agent",
        tiny_config(model=SMALL_MODEL, inner={"steps": 4},
                    outer={"overlap": "eager", "eager_at": 0.5}),
    )  # fmt: skip
    publish_version_0(live_store, run)
    put_train_shards(live_store, run, SHARD_TOKENS)
    for state in ("preparing", "ready"):
        transition(run, state)
    start_run(run)
    assert mark_round_closing(Round.objects.get(run=run, t=0))
    open_round(run, 1)  # as start_closing does: round 0's step has published nothing yet

    worker = WorkerProcess(
        live_server.url, tmp_path / "agent", "--enroll", enrollment(), "--once",
        "--checkpoint-every", "1",
    )  # fmt: skip
    workers.append(worker)
    lease = worker.wait_for("lease")
    assert lease["round"] == 1
    assert worker.wait_for("rebase_wait")["at_step"] == 2
    time.sleep(2.0)  # it waits at step 2: no step 3 before version 1 is published
    assert not any(e.get("event") == "step" and e.get("step", 0) > 2 for e in worker.events)

    publish_next(live_store, run, 1, tmp_path)
    mark_round_closed(Round.objects.get(run=run, t=0))
    rebased = worker.wait_for("rebase")
    assert rebased["at_step"] == 2
    assert worker.finish() == 0, worker.output()

    done = next(e for e in worker.events if e.get("event") == "completed")
    assert done["rebased"] == 1.0 and done["rebase_wait_s"] > 0
    row = Lease.objects.get(pk=lease["lease_id"])
    assert {c.base_version for c in row.contributions.all()} == {1}
    assert set(row.unit.base_versions.values()) == {0}
