"""Rounds: opening one (its work units and data windows) and deciding when it may close.

A round's units are R replicas per active path (DESIGN §4.1), each starting from
the modules' current versions and reading its own run of windows of the path's
training shard, in the path's seeded shuffled order (dipaco.data.windows: the simulator
and the worker read the same windows). Leases and completions are in rounds.scheduler
and rounds.completion.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Count, Q
from django.utils import timezone

from dipaco.config import RunConfig
from dipaco.data.windows import unit_start, unit_windows
from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.runs.errors import DataNotReady, ModulesNotReady, RunNotActive
from dipaco_server.runs.models import Path, Run
from dipaco_server.runs.phases import PATHS, first_round, round_config
from dipaco_server.runs.services import TERMINAL, current_versions, transition

logger = logging.getLogger(__name__)

OPENABLE = (Run.State.RUNNING, Run.State.PAUSED)  # a paused run's next round waits queued


def unit_tokens(config: RunConfig) -> int:
    """Tokens one unit trains on: H steps x batch sequences x sequence length."""
    return config.inner.steps * config.inner.batch_size * config.model.seq_len


def open_round(
    run: Run,
    t: int,
    *,
    train_tokens: Mapping[int, int] | None = None,
    deadline: datetime | None = None,
    now: datetime | None = None,
) -> Round:
    """Open round `t` of `run` with its queued units; opening an open round again returns it.

    `train_tokens` maps path index to its shard size in tokens; by default each
    Path's ``train_tokens`` (written when the data was prepared).
    """
    now = now or timezone.now()
    existing = Round.objects.filter(run=run, t=t).first()
    if existing is not None:
        return existing  # a retried task: never a second set of units
    run.refresh_from_db(fields=["state", "current_round", "phase"])
    if run.state not in OPENABLE:
        raise RunNotActive(f"run {run.name!r} is {run.state}; start or resume it first")
    if t >= run.run_config.total_rounds:
        last = run.run_config.total_rounds - 1
        raise RunNotActive(f"round {t} is past the run's last round ({last}); finish the run")
    if t > 0 and not Round.objects.filter(run=run, t=t - 1, state=Round.State.CLOSED).exists():
        raise RunNotActive(f"round {t - 1} of run {run.name!r} is not closed; close it first")
    # Each phase has its own config, paths and modules (runs.phases).
    phase, config = round_config(run.run_config, t)
    if phase == PATHS and run.phase != Run.Phase.PATHS:
        raise RunNotActive(
            f"run {run.name!r} is preparing phase 2 (phase {run.phase}); its first DiPaCo "
            "round opens when the preparation is done"
        )
    paths = list(run.paths.filter(phase=phase, state=Path.State.ACTIVE).order_by("index"))
    if not paths:
        raise RunNotActive(f"every path of run {run.name!r} has finished; finish the run")
    versions = current_versions(run, phase)
    missing = sorted({m for p in paths for m in p.modules if versions.get(m) is None})
    if missing:
        raise ModulesNotReady(
            f"modules {missing} of run {run.name!r} have no version yet; prepare the run first",
            modules=missing,
        )
    windows = unit_windows(config)
    replicas = config.replicas_per_path
    units = []
    round_ = Round(run=run, t=t, opened_at=now, deadline=deadline or _default_deadline(now))
    for path in paths:
        shard = (train_tokens or {}).get(path.index, path.train_tokens)
        if shard <= config.model.seq_len:
            raise DataNotReady(
                f"path {path.index} of run {run.name!r} has {shard} training tokens, not "
                f"one window of {config.model.seq_len + 1}; prepare the data first",
                path=path.index,
            )
        base = {m: versions[m] for m in path.modules}
        for r in range(replicas):
            units.append(
                WorkUnit(
                    round=round_,
                    path=path,
                    replica=r,
                    data_position=unit_start(config, t - first_round(run.run_config, phase), r),
                    data_windows=windows,
                    base_versions=base,
                    created_at=now,
                    updated_at=now,
                )
            )
    try:
        with transaction.atomic():
            round_.save()
            WorkUnit.objects.bulk_create(units)
            Run.objects.filter(pk=run.pk).update(current_round=t, updated_at=now)
    except IntegrityError:
        return Round.objects.get(run=run, t=t)  # a concurrent open won; use its round
    run.current_round = t
    logger.info("run %s: opened round %d with %d units", run.pk, t, len(units))
    return round_


def start_run(run: Run, *, now: datetime | None = None) -> Round:
    """ready → running and open round 0, together: a run that cannot open it stays ready."""
    now = now or timezone.now()
    try:
        with transaction.atomic():
            transition(run, Run.State.RUNNING, now=now)
            return open_round(run, 0, now=now)
    except Exception:
        run.refresh_from_db()  # transition() updated the object; the database rolled back
        raise


def _default_deadline(now: datetime) -> datetime:
    return now + timedelta(seconds=current_policy().round_deadline_s)


def round_ready_to_close(round_: Round, *, now: datetime | None = None) -> bool:
    """True when every unit is settled, or a quorum is done and the deadline has passed."""
    now = now or timezone.now()
    # Mid-round, the usual answer after a completion: units still out and the deadline
    # (as loaded) ahead. One indexed query instead of counting every unit of the round.
    before_deadline = round_.deadline is None or now < round_.deadline
    unsettled = round_.units.filter(state__in=[WorkUnit.State.QUEUED, WorkUnit.State.LEASED])
    if before_deadline and unsettled.exists():
        return False
    round_.refresh_from_db(fields=["state", "deadline"])
    run_state = Run.objects.filter(pk=round_.run_id).values_list("state", flat=True).first()
    if round_.state != Round.State.OPEN or run_state in TERMINAL:
        return False  # a cancelled or failed run gets no more outer steps
    counts = round_.units.aggregate(
        total=Count("pk"),
        done=Count("pk", filter=Q(state=WorkUnit.State.DONE)),
        settled=Count("pk", filter=Q(state__in=[WorkUnit.State.DONE, WorkUnit.State.EXPIRED])),
    )
    if counts["done"] == 0:
        return False  # nothing to average: wait, however late it is
    if counts["settled"] == counts["total"]:
        return True
    quorum = max(1, math.ceil(current_policy().round_quorum * counts["total"]))
    past_deadline = round_.deadline is not None and now >= round_.deadline
    return past_deadline and counts["done"] >= quorum


def mark_round_closing(round_: Round, *, now: datetime | None = None) -> bool:
    """open → closing, exactly once: True for the one caller that should run the outer step.

    Units not done are given up and their active leases expire, so a late
    completion under them is refused (DESIGN §4: stale work is never used).
    """
    now = now or timezone.now()
    with transaction.atomic():
        if not Round.objects.filter(pk=round_.pk, state=Round.State.OPEN).update(
            state=Round.State.CLOSING, closing_at=now
        ):
            return False
        Lease.objects.filter(unit__round=round_, state=Lease.State.ACTIVE).update(
            state=Lease.State.EXPIRED, ended_at=now
        )
        round_.units.filter(state__in=[WorkUnit.State.QUEUED, WorkUnit.State.LEASED]).update(
            state=WorkUnit.State.EXPIRED, updated_at=now
        )
    round_.refresh_from_db(fields=["state"])
    return True


def mark_round_closed(round_: Round, *, now: datetime | None = None) -> bool:
    """closing → closed once the outer step has published the next versions."""
    now = now or timezone.now()
    won = Round.objects.filter(pk=round_.pk, state=Round.State.CLOSING).update(
        state=Round.State.CLOSED, closed_at=now
    )
    round_.refresh_from_db(fields=["state", "closed_at"])
    return bool(won)
