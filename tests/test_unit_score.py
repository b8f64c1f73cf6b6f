"""A unit's proof of useful work scored when its lease completes (rounds.verification
.unit_score), off the round's critical path: the same score the outer step computes inline,
the same verdicts, its seconds in the round's scoring stage, and the task sent from the
completion's commit before the round's close."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dipaco.flops import score_windows
from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.models import Lease, Round, RoundStage
from dipaco_server.rounds.outer.step import step_module
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification.unit_score import score_completed, score_granted
from dipaco_server.workers.services import create_enrollment_token, register_worker
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


def test_base_losses_scored_while_the_unit_trains_are_what_its_score_reads(work: Path) -> None:
    """score_base at the grant (unit_score.score_granted) records the base losses on the
    unit's scored windows; the score at completion reads them instead of running those
    passes, and gives the same numbers as a score that computes them itself."""
    run, sources = two_worker_run(work)
    said: list[str] = []

    def at_grant(lease: Lease) -> None:
        said.append(score_granted(lease.pk))
        said.append(score_granted(lease.pk))

    honest, _ = submit(run, "honest", sources, granted_hook=at_grant)
    attacker, _ = submit(run, "attacker", sources, scaled(-1.0), granted_hook=at_grant)
    assert said == ["scored", "scored already"] * 2
    leases = list(Lease.objects.filter(unit__round__run=run, state=Lease.State.COMPLETED))
    config = run.run_config
    for lease in leases:
        row = lease.base_losses
        assert row["base"] == [[m, 0] for m in sorted(lease.unit.path.modules)]
        assert len(row["train"]) == score_windows(config) and row["heldout"] > 0
        assert score_granted(lease.pk) == "not active"  # completed: nothing to do early
    assert [score_completed(lease.pk) for lease in leases] == ["scored", "scored"]
    early = _scores(leases)
    for lease in leases:  # the recorded base losses are the score's "before"
        assert early[lease.pk]["train_before"] == pytest.approx(
            sum(lease.base_losses["train"]) / len(lease.base_losses["train"])
        )
        assert early[lease.pk]["heldout_before"] == lease.base_losses["heldout"]

    # Without them the score computes the same losses itself: the same numbers.
    ids, base = [lease.pk for lease in leases], leases[0].base_losses["base"]
    Lease.objects.filter(pk__in=ids).update(score=None, base_losses=None)
    assert [score_completed(pk) for pk in ids] == ["scored", "scored"]
    assert _scores(leases) == early

    # Base losses of other versions, or of other windows, are not used.
    planted = {"train": [99.0] * score_windows(config), "heldout": 99.0}
    for wrong in ({"base": [["0.0", 7], ["shared", 7]], "covered": None},
                  {"base": base, "covered": 3}):  # fmt: skip
        Lease.objects.filter(pk__in=ids).update(score=None, base_losses={**wrong, **planted})
        assert [score_completed(pk) for pk in ids] == ["scored", "scored"]
        assert _scores(leases) == early
    # Of the same versions and windows, they are: the planted losses are the "before".
    right = {"base": base, "covered": None, **planted}
    Lease.objects.filter(pk=ids[0]).update(score=None, base_losses=right)
    score_completed(ids[0])
    assert _scores(leases[:1])[ids[0]]["train_before"] == 99.0

    Lease.objects.filter(pk__in=ids).update(score=None, base_losses=None)
    assert mark_round_closing(Round.objects.get(run=run, t=0))
    for module_id in ("0.0", "shared"):
        step_module(run.pk, module_id, 0)
    assert reasons(run, honest) == {""}
    assert reasons(run, attacker) == {"no_training_gain"}


def test_a_grant_sends_score_base_on_commit(
    work: Path, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dipaco_server.celery import app as celery_app

    run, _ = two_worker_run(work)
    sent: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, **_: sent.append((name, args)))
    with django_capture_on_commit_callbacks(execute=True):
        lease = grant_lease(register_worker(create_enrollment_token()[1], "w", {})[0]).lease
    assert sent == [("dipaco_server.rounds.tasks.score_base", [lease.pk])]
    config = {**run.config, "outer": {**run.config["outer"], "score": False}}
    type(run).objects.filter(pk=run.pk).update(config=config)
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        grant_lease(register_worker(create_enrollment_token()[1], "v", {})[0])
    assert sent == []  # a run that does not score
