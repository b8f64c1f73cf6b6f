"""GET /api/v1/runs/{id}/rounds (staff): every round of a run with where its time went
(rounds.stages), newest first; GET /api/v1/runs/{id} has only the current round."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema

from dipaco_server.accounts.auth import staff_auth
from dipaco_server.bounds import RunId
from dipaco_server.rounds.stages import stages_by_round
from dipaco_server.runs.api import find_run

staff_router = Router(auth=staff_auth)


class StageOut(Schema):
    stage: str = Field(
        description="training, manifest, fetch_decode, checks, scoring, outer_step, "
        "publishing or evaluation (rounds.stages)."
    )
    started_at: datetime
    ended_at: datetime
    wall_seconds: float = Field(description="First task started to last task ended.")
    seconds: float = Field(description="The stage's tasks' seconds, summed.")
    tasks: int


class RoundStagesOut(Schema):
    t: int
    state: str
    opened_at: datetime
    closed_at: datetime | None
    stages: list[StageOut]


@staff_router.get("/runs/{run_id}/rounds", response=list[RoundStagesOut], tags=["admin: runs"])
def list_rounds(request: HttpRequest, run_id: RunId) -> list[dict[str, Any]]:
    """Every round of the run, newest first, each with its stages' spans and seconds."""
    rounds = list(find_run(run_id).rounds.order_by("-t"))
    stages = stages_by_round(rounds)
    return [
        {
            "t": r.t,
            "state": r.state,
            "opened_at": r.opened_at,
            "closed_at": r.closed_at,
            "stages": [vars(s) for s in stages[r.pk]],
        }
        for r in rounds
    ]
