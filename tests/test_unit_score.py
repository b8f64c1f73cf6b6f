"""A unit's proof of useful work scored when its lease completes (rounds.verification
.unit_score), off the round's critical path: the same score the outer step computes inline,
the same verdicts, its seconds in the round's scoring stage, and the task sent from the
completion's commit before the round's close."""

from __future__ import annotations

from pathlib import Path

import pytest

from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.models import Lease, Round, RoundStage
from dipaco_server.rounds.outer.step import step_module
from dipaco_server.rounds.verification.unit_score import score_completed
from tests.test_untrusted import one_torch_thread as one_torch_thread  # the fixture
from tests.test_untrusted import reasons, scaled, submit, two_worker_run
from tests.test_untrusted import work as work  # the fixture

pytestmark = pytest.mark.django_db


def _scores(leases: list[Lease]) -> dict[int, dict[str, object]]:
    out = {}
    for lease in leases:
        lease.refresh_from_db()
        assert lease.score is not None
        out[lease.pk] = {k: v for k, v in lease.score.items() if k != "seconds"}
    return out


def test_the_score_at_completion_is_the_steps_own_and_refuses_the_same_delta(work: Path) -> None:
    run, sources = two_worker_run(work)
    honest, _ = submit(run, "honest", sources)
    attacker, _ = submit(run, "attacker", sources, scaled(-1.0))
    leases = list(Lease.objects.filter(unit__round__run=run, state=Lease.State.COMPLETED))
    assert len(leases) == 2
    assert [score_completed(lease.pk) for lease in leases] == ["scored", "scored"]
    assert [score_completed(lease.pk) for lease in leases] == ["scored already"] * 2
    stage = RoundStage.objects.get(round__run=run, round__t=0, stage="scoring")
    assert stage.tasks == 2 and stage.seconds > 0
    early = _scores(leases)

    # Scored inline by the step instead (the fallback): the same numbers, bit for bit.
    Lease.objects.filter(pk__in=[lease.pk for lease in leases]).update(score=None)
    assert mark_round_closing(Round.objects.get(run=run, t=0))
    step_module(run.pk, "0.0", 0)
    assert _scores(leases) == early
    # The shared module's step reads the recorded scores: the same verdicts.
    step_module(run.pk, "shared", 0)
    assert reasons(run, honest) == {""}
    assert reasons(run, attacker) == {"no_training_gain"}


def test_only_a_completed_lease_of_a_scoring_run_is_scored(work: Path) -> None:
    run, sources = two_worker_run(work)
    submit(run, "honest", sources)
    lease = Lease.objects.get(unit__round__run=run, state=Lease.State.COMPLETED)
    assert score_completed(lease.pk + 1000) == "not completed"
    config = {**run.config, "outer": {**run.config["outer"], "score": False}}
    type(run).objects.filter(pk=run.pk).update(config=config)
    assert score_completed(lease.pk) == "not scored in this run"
    lease.refresh_from_db()
    assert lease.score is None
