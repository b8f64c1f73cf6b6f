"""``outer.overlap`` "eager": a unit's rebase onto the previous round's versions.

With overlap, round t opens as round t - 1 starts closing (runs.phases.overlaps): its
units start from the versions current then (v_{t-1}), and round t's outer step applies
their Δs onto the versions round t - 1's step publishes meanwhile (v_t; one-step-delayed
DiLoCo, rounds.outer.step). With "eager" a unit also learns, in its lease, to rebase at
step s = ceil(outer.eager_at x H) (`rebase_plan`): it waits there until round t - 1 has
closed, fetches v_t (GET .../lease/<id>/rebase: encoded updates from its base where the run
publishes them), adds v_t - v_{t-1} to its live weights and reports its Δ relative to v_t
(`dipaco.inner.run_inner_loop(rebase=)`, as `dipaco simulate`'s `train_dipaco(eager_at=)`).
The step then applies it onto the version it is relative to: no staleness.

The rebase point is fixed by the lease, not by when the versions arrive, so a check copy
(rounds.verification.replication) that rebased computes what its original computed. A worker that
cannot get v_t in time (the lease would run out) trains on and reports its Δ relative to
its base, as plain delayed: the completion names the versions (`check_delta_base`) and
the outer step scores each Δ on the versions it is relative to (rounds.verification.rules) and
compares only check copies with the same base.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dipaco.config import eager_rebase_step
from dipaco_server.rounds.models import Round, WorkUnit
from dipaco_server.runs.errors import ContributionInvalid
from dipaco_server.runs.models import ModuleVersion
from dipaco_server.runs.phases import local_round, overlaps, round_config


def rebase_targets(unit: WorkUnit) -> dict[str, int] | None:
    """The versions round t's outer step applies onto, for the unit's modules: the newest of
    each published before it (at most version t), once round t - 1 has closed; None while
    round t - 1 is still stepping (rounds.outer.step._latest_version, the same query)."""
    round_ = unit.round
    if round_.t > 0:
        previous = Round.objects.filter(run_id=round_.run_id, t=round_.t - 1)
        if previous.exclude(state=Round.State.CLOSED).exists():
            return None
    base = _versions(unit.base_versions)
    newest: dict[str, int] = {}
    rows = ModuleVersion.objects.filter(
        module__run_id=round_.run_id,
        module__phase=unit.path.phase,
        module__module_id__in=list(base),
        version__lte=round_.t,
    ).values_list("module__module_id", "version")
    for module_id, version in rows:
        newest[module_id] = max(version, newest.get(module_id, version))
    return {m: newest.get(m, v) for m, v in base.items()}


def _versions(raw: Mapping[Any, Any]) -> dict[str, int]:
    return {str(m): int(v) for m, v in raw.items()}


def rebase_plan(unit: WorkUnit) -> dict[str, Any] | None:
    """The lease's ``rebase`` instruction: {"at_step": s, "round": t - 1 (the phase's count,
    as the lease's "round")}, or None when the unit's base is already what its round's
    step applies onto (no overlap, "delayed", the first round, or round t - 1 kept them)."""
    return rebase_state(unit)[0]


def rebase_state(unit: WorkUnit) -> tuple[dict[str, Any] | None, dict[str, int] | None]:
    """(`rebase_plan`, `rebase_targets`) from one look at the versions: the targets are
    None without a plan, or while round t - 1 still steps."""
    run_config = unit.round.run.run_config
    t = unit.round.t
    _, config = round_config(run_config, t)
    if config.outer.overlap != "eager" or t == 0 or not overlaps(run_config, t - 1):
        return None, None
    targets = rebase_targets(unit)
    if targets is not None and targets == _versions(unit.base_versions):
        return None, None
    return {
        "at_step": eager_rebase_step(config.outer.eager_at, config.inner.steps),
        "round": local_round(run_config, t - 1),
    }, targets


def check_delta_base(unit: WorkUnit, given: Mapping[str, Any] | None) -> dict[str, int]:
    """The version each module's Δ is relative to, from a completion's ``base_versions``:
    the unit's base versions (absent: those), or, for an eager unit that rebased, the
    versions round t - 1 published (`rebase_targets`), for every module alike.
    ContributionInvalid, naming the field, for anything else."""
    base = _versions(unit.base_versions)
    if given is None:
        return base
    if not isinstance(given, Mapping) or set(given) != set(base):
        names = sorted(given) if isinstance(given, Mapping) else given
        raise ContributionInvalid(
            f"base_versions must name every module of the unit once: {sorted(base)}, not {names!r}",
            field="base_versions",
        )
    clean = {}
    for module_id, version in given.items():
        if isinstance(version, bool) or not isinstance(version, int):
            raise ContributionInvalid(
                f"base_versions.{module_id} = {version!r} must be a version number",
                field=f"base_versions.{module_id}",
            )
        clean[str(module_id)] = version
    if clean == base:
        return base
    _, targets = rebase_state(unit)
    if targets is None or clean != targets:
        wrong = sorted(m for m in clean if clean[m] != base[m])
        allowed = "" if targets is None else f" or the rebased versions {targets}"
        raise ContributionInvalid(
            f"base_versions {clean} is not what the Δ can be relative to: the unit's base "
            f"versions {base}{allowed} (modules {wrong} differ); report the versions the "
            "unit trained from, or those it rebased onto (outer.overlap eager)",
            field="base_versions",
            modules=wrong,
        )
    return clean
