"""Where a round's time goes: each stage's wall span and its tasks' summed seconds.

A task times its stages with `timed(stage)` (nested stages are exclusive: the outer step's
seconds do not count the checks inside it, nor the checks their fetching and scoring),
then `flush(round_id)` adds them to the round's `RoundStage` rows: the span widens to the
first start and the last end, the seconds and the task count add up, in one UPDATE per
stage (concurrent module steps of one round each add theirs). The stages:

- training: the round's opening to its last completion, and the leases' summed seconds
  from grant to completion (derived from the leases, not stored);
- manifest: a unit's row chunks signed for its worker (rounds.protocol.unit_data: no token read);
- fetch_decode: each upload fetched, size, digest and content checked, decoded: mostly
  by check_unit at its completion (rounds.verification.arrival), else by its step;
- checks: the rest of the verification (norms, history, direction, replicas, peers);
- scoring: proof of useful work (rounds.verification.scorer);
- outer_step: aggregation, the Nesterov step, the encoded update;
- publishing: the new version's blobs written;
- evaluation: the paths' held-out losses (runs.evaluate).

`round_stages(round)` lists them for the admin API and the run page.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import Count, DurationField, ExpressionWrapper, F, Max, Sum
from django.db.models.functions import Greatest, Least
from django.utils import timezone

from dipaco_server.rounds.models import Lease, Round, RoundStage

STAGES = (
    "training",
    "manifest",
    "fetch_decode",
    "checks",
    "scoring",
    "outer_step",
    "publishing",
    "evaluation",
)

_local = threading.local()


def _open() -> dict[str, list[float]]:
    """This thread's stages so far: stage -> [first start, last end, seconds] (epoch s)."""
    if not hasattr(_local, "spans"):
        _local.spans, _local.stack = {}, []
    spans: dict[str, list[float]] = _local.spans
    return spans


def reset() -> None:
    """Forget what this thread timed and has not flushed (a task that failed before)."""
    _local.spans, _local.stack = {}, []


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Time the block as `stage`, less the stages timed inside it."""
    spans = _open()
    stack: list[list[float]] = _local.stack
    frame = [time.time(), time.perf_counter(), 0.0]  # start, clock, nested seconds
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        elapsed = time.perf_counter() - frame[1]
        if stack:
            stack[-1][2] += elapsed
        span = spans.setdefault(stage, [frame[0], frame[0], 0.0])
        span[0] = min(span[0], frame[0])
        span[1] = max(span[1], time.time())
        span[2] += elapsed - frame[2]


def flush(round_id: int) -> None:
    """Add this thread's timed stages to round `round_id`'s rows, then forget them."""
    spans = _open()
    reset()
    for stage, (start, end, seconds) in spans.items():
        record(round_id, stage, _at(start), _at(end), seconds)


def record(round_id: int, stage: str, started: datetime, ended: datetime, seconds: float) -> None:
    """One task's part of `stage`: the span widened, the seconds and the count added."""
    rows = RoundStage.objects.filter(round_id=round_id, stage=stage)
    grow = {
        "started_at": Least(F("started_at"), started),
        "ended_at": Greatest(F("ended_at"), ended),
        "seconds": F("seconds") + seconds,
        "tasks": F("tasks") + 1,
    }
    if rows.update(**grow):
        return
    try:
        with transaction.atomic():
            RoundStage.objects.create(
                round_id=round_id, stage=stage, started_at=started, ended_at=ended,
                seconds=seconds, tasks=1,
            )  # fmt: skip
    except IntegrityError:  # a concurrent task created it first
        rows.update(**grow)


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=timezone.get_current_timezone())


@dataclass(frozen=True)
class Stage:
    stage: str
    started_at: datetime
    ended_at: datetime
    wall_seconds: float  # first task started to last task ended
    seconds: float  # the tasks' seconds, summed
    tasks: int


def round_stages(round_: Round) -> list[Stage]:
    """The round's stages in STAGES order, training first; stages that did not run are
    left out."""
    return stages_by_round([round_])[round_.pk]


def stages_by_round(rounds: Sequence[Round]) -> dict[int, list[Stage]]:
    """`round_stages` of each round (by pk), in two queries."""
    held = ExpressionWrapper(F("ended_at") - F("granted_at"), output_field=DurationField())
    training = {
        row["unit__round_id"]: row
        for row in Lease.objects.filter(
            unit__round__in=rounds, state=Lease.State.COMPLETED, ended_at__isnull=False
        )
        .values("unit__round_id")
        .annotate(last=Max("ended_at"), held=Sum(held), n=Count("pk"))
        .order_by()
    }
    rows: dict[int, dict[str, RoundStage]] = {r.pk: {} for r in rounds}
    for row in RoundStage.objects.filter(round__in=rounds):
        rows[row.round_id][row.stage] = row
    out: dict[int, list[Stage]] = {}
    for r in rounds:
        stages = []
        lease = training.get(r.pk)
        if lease is not None:
            wall = (lease["last"] - r.opened_at).total_seconds()
            seconds = lease["held"].total_seconds()
            stages.append(Stage("training", r.opened_at, lease["last"], wall, seconds, lease["n"]))
        for name in STAGES[1:]:
            row = rows[r.pk].get(name)
            if row is not None:
                wall = (row.ended_at - row.started_at).total_seconds()
                stages.append(
                    Stage(name, row.started_at, row.ended_at, wall, row.seconds, row.tasks)
                )
        out[r.pk] = stages
    return out
