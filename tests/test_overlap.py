"""Overlapped outer steps (issue 20, ``outer.overlap`` "delayed"): round t + 1 opens while
round t's outer step runs, and its Δs are applied onto the versions round t publishes.

The Celery test runs test_outer_tasks' real worker process on Redis against the session's
PostgreSQL test database and the moto S3 server; contributions go through the real lease
and completion services, and the run's invariant check (tests/faults.py) ends it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco import codecs
from dipaco.modular import module_spec
from dipaco.modules_file import read_module
from dipaco.outer import aggregate, outer_lr, outer_step
from dipaco_server.rounds.lifecycle.close import (
    mark_round_closed,
    mark_round_closing,
    round_ready_to_close,
)
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.lifecycle.tasks import close_round, start_closing
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round
from dipaco_server.rounds.outer.step import step_module
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.runs.errors import RoundClosed, RunNotActive
from dipaco_server.runs.models import ModuleVersion, Run
from dipaco_server.storage import BlobStore, get_blob_store
from tests import test_worker_api as api
from tests.conftest import CeleryWorker, session_database_url
from tests.faults import Accepted, check_invariants
from tests.test_models import make_worker
from tests.test_outer_tasks import (  # noqa: F401 (module-scoped fixtures used below)
    DILOCO,
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
from tests.test_worker_api import store  # noqa: F401 (a fixture used below)

DELAYED = {"outer": {"overlap": "delayed"}}
# close_round(t) sent by hand once round t is done: finish_round(t - 1) sends one too, and
# either may be the one that moves the round to closing (the other says "closing elsewhere").
CLOSING = ("closing", "closing elsewhere")


def momentum_of(run: Run, module_id: str, version: int) -> dict[str, torch.Tensor]:
    row = ModuleVersion.objects.get(module__run=run, module__module_id=module_id, version=version)
    file = Path(os.environ["DIPACO_DATA_DIR"]) / f"momentum-{uuid.uuid4().hex}"
    get_blob_store().download_to(row.momentum_key, file)
    try:
        return read_module(file, module_spec(run.run_config, module_id))
    finally:
        file.unlink()


def accepted_of(run: Run, t: int) -> list[Accepted]:
    leases = Lease.objects.filter(unit__round__run=run, unit__round__t=t, state="completed")
    return [
        Accepted(lease.pk, tuple(lease.contributions.values_list("module__module_id", flat=True)))
        for lease in leases
    ]


@pytest.mark.django_db(transaction=True)
def test_round_t_plus_1_trains_while_round_t_steps_and_lands_on_round_ts_versions(
    on_s3: CeleryWorker,  # noqa: F811 (the fixture imported above)
) -> None:
    run = running_run(DILOCO, replicas=1, **DELAYED)
    contribute(run, good, seed=1, name="first")
    round0 = Round.objects.select_related("run").get(run=run, t=0)
    assert round_ready_to_close(round0)

    # What the completion request does: round 0 starts closing and round 1 opens at once,
    # from version 0, before round 0's outer step has published anything.
    assert start_closing(round0)
    round1 = Round.objects.get(run=run, t=1)
    assert (Round.objects.get(pk=round0.pk).state, round1.state) == ("closing", "open")
    assert not ModuleVersion.objects.filter(module__run=run, version=1).exists()
    worker, uploaded = contribute(run, good, seed=2, name="second")
    lease = Lease.objects.get(worker=worker)
    assert lease.unit.round_id == round1.pk and lease.unit.base_versions == {"0.0": 0, "shared": 0}

    # Round 1 is done but may not close, nor step, before round 0 has published.
    assert not round_ready_to_close(round1)
    assert send(on_s3, "close_round", run.pk, 1, True).get(timeout=30) == "waiting for round t - 1"
    assert Round.objects.get(pk=round1.pk).state == "open"

    # Round 0's steps run (as the completion request sends them); its finish_round then
    # closes round 1, which opens round 2 from version 1 and steps round 1 onto version 1.
    assert send(on_s3, "close_round", run.pk, 0, True).get(timeout=30) == "closing"
    wait_for(lambda: Round.objects.filter(run=run, t=1, state="closed").exists(), on_s3)
    round2 = Round.objects.get(run=run, t=2)
    assert {u.base_versions["0.0"] for u in round2.units.all()} == {1}
    config = run.run_config
    for module_id in ("0.0", "shared"):
        step = OuterStep.objects.get(round=round1, module__module_id=module_id)
        assert (step.outcome, step.base_version, step.version) == ("stepped", 1, 2)
        spec = module_spec(config, module_id)
        # Round 1's one Δ, trained from version 0, with the weight the server gave it.
        grad = aggregate([(codecs.decode(uploaded[module_id], spec), step.tokens)],
                         config.outer, paths_through=1, spec=spec)  # fmt: skip
        expected, _ = outer_step(
            stored_version(run, module_id, 1),
            grad,
            momentum_of(run, module_id, 1),
            config.outer,
            lr=outer_lr(config.outer, 1),
        )
        actual = stored_version(run, module_id, 2)
        for name in expected:
            assert torch.equal(actual[name], expected[name]), (module_id, name)

    # The last round: no overlap after it; the run finishes with its invariants whole.
    contribute(run, good, seed=3, name="third")
    assert send(on_s3, "close_round", run.pk, 2).get(timeout=30) in CLOSING
    wait_for(lambda: Run.objects.get(pk=run.pk).state == "finished", on_s3)
    assert not Contribution.objects.filter(unit__round__run=run, status="pending").exists()
    accepted = [a for t in range(3) for a in accepted_of(run, t)]
    assert len(accepted) == 3
    check_invariants(session_database_url(), run.pk, accepted)


def test_without_overlap_the_next_round_opens_only_after_the_step(db: None) -> None:
    run = running_run(DILOCO, replicas=1)
    contribute(run, good, seed=7)
    round0 = Round.objects.select_related("run").get(run=run, t=0)

    assert start_closing(round0)

    assert not Round.objects.filter(run=run, t=1).exists()
    assert grant_lease(make_worker("waiting")) is None
    with pytest.raises(RunNotActive, match="not closed"):
        open_round(run, 1)


def test_staleness_is_at_most_one_version(db: None) -> None:
    """Round t may not close, step, or let round t + 1 open before round t - 1 published,
    even when something forces it (close_round with force, a closing marked by hand)."""
    run = running_run(DILOCO, replicas=1, **DELAYED)
    contribute(run, good, seed=8)
    round0 = Round.objects.select_related("run").get(run=run, t=0)
    assert start_closing(round0)
    contribute(run, good, seed=9, name="next")
    round1 = Round.objects.select_related("run").get(run=run, t=1)

    assert not round_ready_to_close(round1)
    assert close_round(run.pk, 1, force=True) == "waiting for round t - 1"
    assert mark_round_closing(round1)  # by hand, past the checks above
    with pytest.raises(RunNotActive, match="two versions behind"):
        open_round(run, 2)
    with pytest.raises(RoundClosed, match="has not published"):
        step_module(run.pk, "0.0", 1)

    mark_round_closed(round0)  # (round 0 stepped nothing here: version 0 stays current)
    assert open_round(run, 2).units.get().base_versions == {"0.0": 0, "shared": 0}


def test_the_completion_that_fills_round_t_opens_round_t_plus_1_before_it_answers(
    client: Any,
    store: BlobStore,  # noqa: F811 (the fixture imported above)
    django_capture_on_commit_callbacks: Any,
) -> None:
    """Over the worker API: the last completion of round 0 moves it to closing and opens
    round 1 in the request, so the same worker's next lease call gets round 1's unit (from
    version 0, round 0's step not published) and round 0's steps are on their way."""
    run = api.running_run(store)
    config = {**run.config, "outer": {**run.config["outer"], "overlap": "delayed"}}
    Run.objects.filter(pk=run.pk).update(config=config)
    api.sent_tasks()  # whatever earlier tests left
    for i in range(run.paths.count()):
        _, token = api.new_worker(f"w{i}")
        holder = api.Holder(client, store, run, token, api.take_lease(client, token))
        with django_capture_on_commit_callbacks(execute=True):
            done = holder.on("complete", holder.completion())
        assert done.status_code == 200, done.content

    assert Round.objects.get(run=run, t=0).state == "closing"
    assert not ModuleVersion.objects.filter(module__run=run, version=1).exists()
    lease = api.take_lease(client, token)
    assert lease["round"] == 1 and set(lease["base_versions"].values()) == {0}
    sent = [task for task, _ in api.sent_tasks()]
    # Each completion sent its Δs' checks (rounds.verification.arrival) and its unit's
    # scoring (rounds.verification.unit_score), the last one the round's close after them.
    # A unit's scoring may be sent by its replica's completion, so only the counts are fixed.
    per_unit = ["dipaco_server.rounds.tasks.check_unit", "dipaco_server.rounds.tasks.score_unit"]
    scoring = per_unit * run.paths.count()
    assert sorted(sent[:-1]) == sorted(scoring), sent
    assert sent[-1] == "dipaco_server.rounds.tasks.close_round", sent
