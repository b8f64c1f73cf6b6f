"""Rounds: opening one (its work units and data windows) and deciding when it may close.

A round's units are R replicas per active path (docs/design.md §4.1), each starting from
the modules' current versions and reading its own run of windows of the path's
training shard, in the path's seeded shuffled order (dipaco.data.windows: the simulator
and the worker read the same windows). Leases and completions are in rounds.protocol.leases
and rounds.protocol.complete.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from dipaco.data.windows import unit_start, unit_windows
from dipaco_server.rounds.models import Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.runs.errors import DataNotReady, ModulesNotReady, RunNotActive
from dipaco_server.runs.models import Path, Run
from dipaco_server.runs.phases import PATHS, first_round, overlaps, round_config
from dipaco_server.runs.services import OPENABLE, transition
from dipaco_server.runs.versions import current_versions

logger = logging.getLogger(__name__)


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
    if t > 0:
        _check_previous(run, t)
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


def _check_previous(run: Run, t: int) -> None:
    """Round t opens after round t - 1 closed; with overlap, once it is closing, and only
    when round t - 2 has closed (its versions, round t's base, are published)."""
    previous = Round.objects.filter(run=run, t=t - 1).values_list("state", flat=True).first()
    if previous == Round.State.CLOSED:
        return
    if previous == Round.State.CLOSING and overlaps(run.run_config, t - 1):
        if t < 2 or Round.objects.filter(run=run, t=t - 2, state=Round.State.CLOSED).exists():
            return
        raise RunNotActive(
            f"round {t - 2} of run {run.name!r} has not published its versions; round {t} "
            "would start two versions behind (outer.overlap delayed or eager allows one)"
        )
    raise RunNotActive(f"round {t - 1} of run {run.name!r} is not closed; close it first")


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
