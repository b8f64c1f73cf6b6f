"""Runs: creation from a validated config, the state machine, module versions, metrics.

Every change of `Run.state` goes through `transition`, the one place that knows
the allowed moves; it writes with a conditional UPDATE (``WHERE state = <seen>``)
so two concurrent requests cannot both move a run from the same state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone
from pydantic import ValidationError

from dipaco.config import RunConfig, config_problems
from dipaco_server.runs.errors import ConfigInvalid, InvalidTransition, RunNameTaken, RunNotFound
from dipaco_server.runs.models import Dataset, MetricPoint, Module, Path, Run
from dipaco_server.runs.signals import run_ended
from dipaco_server.runs.sources import check_source

logger = logging.getLogger(__name__)
State = Run.State

# The run's life (docs/design.md §6): draft → preparing → ready → running ⇄ paused → finished | failed |
# cancelled. A paused run may still finish (its last round can close while paused); any
# live state can fail or be cancelled; the three end states are final.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    State.DRAFT: (State.PREPARING, State.CANCELLED),
    State.PREPARING: (State.READY, State.FAILED, State.CANCELLED),
    State.READY: (State.RUNNING, State.FAILED, State.CANCELLED),
    State.RUNNING: (State.PAUSED, State.FINISHED, State.FAILED, State.CANCELLED),
    State.PAUSED: (State.RUNNING, State.FINISHED, State.FAILED, State.CANCELLED),
    State.FINISHED: (),
    State.FAILED: (),
    State.CANCELLED: (),
}
TERMINAL = frozenset(s for s, moves in TRANSITIONS.items() if not moves)
# States whose rounds open (rounds.lifecycle.open); a paused run's next round waits queued.
OPENABLE = (State.RUNNING, State.PAUSED)
_RACE_RETRIES = 3


def allowed_moves(state: str) -> tuple[str, ...]:
    return TRANSITIONS[State(state)]


def validate_config(config: Mapping[str, Any]) -> RunConfig:
    """The config as a RunConfig, or ConfigInvalid listing (field, value, rule) per problem."""
    if not isinstance(config, Mapping):
        raise ConfigInvalid(
            f"the run config must be a JSON object, got {type(config).__name__}",
            problems=[{"field": "", "value": None, "rule": "must be an object"}],
        )
    try:
        return RunConfig.model_validate(dict(config))
    except ValidationError as exc:
        problems = [
            {"field": p.field, "value": _jsonable(p.value), "rule": p.rule}
            for p in config_problems(exc)
        ]
        listed = "; ".join(f"{p['field']} = {p['value']!r}: {p['rule']}" for p in problems)
        raise ConfigInvalid(f"the run config is invalid: {listed}", problems=problems) from None


def _jsonable(value: Any) -> Any:
    """Values echoed in an error body: JSON scalars and containers as-is, others as text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def create_run(name: str, config: Mapping[str, Any], *, dataset: Dataset | None = None) -> Run:
    """A draft run with one Module per module id and one Path per path of the layout.

    The config's ``name`` defaults to the run's; naming another one is refused so the
    stored config always says which run it belongs to.
    """
    given = dict(config) if isinstance(config, Mapping) else config
    if isinstance(given, dict) and given.setdefault("name", name) != name:
        raise ConfigInvalid(
            f"name = {given['name']!r}: differs from the run name {name!r}; "
            "leave it out or make them equal",
            problems=[{"field": "name", "value": given["name"], "rule": "must match"}],
        )
    spec = validate_config(given)
    if dataset is None:
        check_source(spec.data.corpus)
    # Imported here: dipaco.modular pulls in torch and transformers (seconds), which
    # only run creation and the outer step need, not every server process start.
    from dipaco.modular import module_ids, modules_of_path

    if Run.objects.filter(name=name).exists():
        raise RunNameTaken(f"a run named {name!r} exists; choose another name", name=name)
    # The dense phase's rows (phase 1) carry the ids of its own DiLoCo config (runs.phases).
    phases = [(1, spec.dense_phase)] if spec.phase1 is not None else []
    phases.append((2, spec))
    try:
        with transaction.atomic():
            run = Run.objects.create(
                name=name,
                config=spec.model_dump(mode="json"),
                dataset=dataset,
                phase=Run.Phase.DENSE if spec.phase1 is not None else Run.Phase.PATHS,
            )
            for phase, config in phases:
                Module.objects.bulk_create(_module_row(run, m, phase) for m in module_ids(config))
                Path.objects.bulk_create(
                    Path(
                        run=run,
                        phase=phase,
                        index=p,
                        choices=list(config.path_modules(p)),
                        modules=modules_of_path(config, p),
                    )
                    for p in range(config.num_paths)
                )
    except IntegrityError:
        # Lost a race with a concurrent create of the same name.
        raise RunNameTaken(f"a run named {name!r} exists; choose another name", name=name) from None
    logger.info("created run %s (%s): %d paths", run.pk, name, spec.num_paths)
    return run


def _module_row(run: Run, module_id: str, phase: int = 2) -> Module:
    if module_id.startswith("path."):
        index = int(module_id.removeprefix("path."))
        return Module(run=run, phase=phase, module_id=module_id, index=index)
    if "." in module_id:
        level, k = module_id.split(".")
        return Module(run=run, phase=phase, module_id=module_id, level=int(level), index=int(k))
    return Module(run=run, phase=phase, module_id=module_id)  # "shared"


def transition(run: Run, to: str, *, error: str = "", now: datetime | None = None) -> Run:
    """Move `run` to state `to`, or raise InvalidTransition naming the allowed moves.

    The check reads the state in the database (not the possibly stale `run`), and
    the write only succeeds if that state is still there; `run` is refreshed.
    """
    now = now or timezone.now()
    try:
        target = State(to)
    except ValueError:
        raise InvalidTransition(
            f"{to!r} is not a run state; states are {', '.join(State.values)}",
            state=run.state,
            requested=to,
            allowed=list(allowed_moves(run.state)),
        ) from None
    for _ in range(_RACE_RETRIES):
        current = Run.objects.filter(pk=run.pk).values_list("state", flat=True).first()
        if current is None:
            raise RunNotFound(f"run {run.pk} does not exist")
        allowed = allowed_moves(current)
        if target not in allowed:
            moves = ", ".join(allowed) if allowed else f"none: {current} is final"
            raise InvalidTransition(
                f"run {run.name!r} is {current}; it cannot become {target} (allowed: {moves})",
                state=current,
                requested=str(target),
                allowed=list(allowed),
            )
        changes: dict[str, Any] = {"state": target, "updated_at": now}
        if target == State.RUNNING:
            changes["started_at"] = Coalesce(F("started_at"), Value(now))
        if target in TERMINAL:
            changes["finished_at"] = now
        if target == State.FAILED:
            changes["error"] = error
        with transaction.atomic():
            moved = Run.objects.filter(pk=run.pk, state=current).update(**changes)
            if moved and target in TERMINAL:
                # Its leases end in this transaction (rounds.lifecycle.receivers.end_leases).
                run_ended.send(sender=Run, run=run, now=now)
        if moved:
            run.refresh_from_db()
            logger.info("run %s: %s -> %s", run.pk, current, target)
            return run
    raise InvalidTransition(
        f"run {run.name!r} kept changing state under concurrent requests; retry",
        state=run.state,
        requested=str(target),
        allowed=[],
    )


def record_metric(
    run: Run, name: str, value: float, *, path: Path | None = None, round: int | None = None
) -> MetricPoint:
    if not math.isfinite(value):
        # A NaN loss is news, but JSON (and the dashboard) cannot carry it.
        raise ValueError(f"metric {name} = {value}: only finite values are recorded")
    return MetricPoint.objects.create(run=run, path=path, round=round, name=name, value=value)
