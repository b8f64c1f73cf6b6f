"""Where a round's time goes (rounds.stages), recorded on a real two-round run: real Δs of
two workers, the manifest that signs each unit's row chunks, every module's outer step and the
evaluation; listed by GET /api/v1/runs/{id}/rounds and drawn on the run page as a stacked
bar per round."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.rounds import stages
from dipaco_server.rounds.models import Round, RoundStage
from tests.test_outer_tasks import DILOCO, running_run
from tests.test_untrusted import one_torch_thread, step_round, submit, two_worker_run, work

__all__ = ["one_torch_thread", "work"]  # fixtures, used by name

pytestmark = pytest.mark.django_db
SERVER_STAGES = ["fetch_decode", "checks", "scoring", "outer_step", "publishing", "evaluation"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_nested_stages_are_exclusive_and_a_second_task_widens_the_span(db: None) -> None:
    run = running_run(DILOCO, replicas=1)
    round_ = Round.objects.create(run=run, t=5)
    for _ in range(2):  # two tasks of the same round
        stages.reset()
        with stages.timed("outer_step"), stages.timed("checks"), stages.timed("scoring"):
            sum(range(200_000))
        stages.flush(round_.pk)
    rows = {r.stage: r for r in RoundStage.objects.filter(round=round_)}
    assert set(rows) == {"outer_step", "checks", "scoring"}
    assert all(r.tasks == 2 for r in rows.values())
    assert rows["scoring"].seconds > rows["checks"].seconds, "checks less the scoring inside"
    assert rows["outer_step"].started_at <= rows["scoring"].started_at
    assert rows["outer_step"].ended_at >= rows["scoring"].ended_at


def test_a_two_round_run_records_lists_and_draws_each_rounds_stages(
    work: Path, client: Client
) -> None:
    run, sources = two_worker_run(work)
    for t in range(2):
        for name in ("a", "b"):
            submit(run, f"{name}-{t}", sources, manifest=True)
        step_round(run, t)
    user, _ = create_user("ops", staff=True)
    token = create_api_token(user, name="tests")[1]

    listed = client.get(
        f"/api/v1/runs/{run.pk}/rounds", headers={"Authorization": f"Bearer {token}"}
    )
    assert listed.status_code == 200, listed.content
    rounds = listed.json()
    assert [r["t"] for r in rounds] == [2, 1, 0]
    for r in rounds[1:]:
        names = [s["stage"] for s in r["stages"]]
        assert names == ["training", "manifest", *SERVER_STAGES], names
        by = {s["stage"]: s for s in r["stages"]}
        assert by["training"]["tasks"] == 2 and by["manifest"]["tasks"] == 2
        assert by["outer_step"]["tasks"] == 2, "one per module step"
        assert by["evaluation"]["tasks"] == 1
        for s in r["stages"]:
            assert s["seconds"] > 0 and s["wall_seconds"] >= 0, s
            assert s["started_at"] <= s["ended_at"]
        assert by["training"]["ended_at"] <= by["fetch_decode"]["started_at"]
        assert by["publishing"]["ended_at"] <= by["evaluation"]["ended_at"]
    assert rounds[0]["stages"] == [], "round 2 has only opened"
    assert client.get(f"/api/v1/runs/{run.pk}/rounds").status_code == 401

    client.force_login(user)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    drawn = re.findall(r'<td class="bar-col stages" data-stages="([^"]*)">', page)
    assert drawn == ["", " ".join(["training", "manifest", *SERVER_STAGES])] * 1 + [
        " ".join(["training", "manifest", *SERVER_STAGES])
    ], drawn
    assert page.count('class="fill stage-scoring"') == 2
