"""Read-only queries behind the dashboard's tables: one function per table, plain rows out.

Views only pick a function and a template; everything the pages show is computed
here (and in ``dipaco_web.curves`` for the charts), where it can be tested
without HTTP. Nothing here writes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, F, Max, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from dipaco.evaluate import (
    perplexity,  # one helper, so every page shows the same number
    rotation_every,
    sample_size,
    window_count,
)
from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.reports import activity
from dipaco_server.rounds.stages import stages_by_round
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import MetricPoint, ModuleVersion, Path, Run
from dipaco_server.runs.phases import PATHS
from dipaco_server.runs.services import TERMINAL
from dipaco_server.workers.models import Worker

# Metric series the evaluation and outer-step tasks record (MetricPoint.name).
VAL_LOSS = "val_loss"  # per path (path set), after round t's outer step
ROUTED_VAL_LOSS = "routed_val_loss"  # per run (no path): token-weighted mean over paths
# The training loss is what workers report: rounds.protocol.api.complete_lease records each metric
# of a completion under the name the worker sent, one point per unit (path and round set),
# and worker_agent sends "loss", the mean of the unit's last tenth of inner-step losses.
TRAIN_LOSS = "loss"

ACCEPTED, REJECTED = Contribution.Status.ACCEPTED, Contribution.Status.REJECTED
ORIGINAL = Q(units__replica__lt=CHECK_OFFSET)  # a round's own units, not check copies
DONE_UNIT = Q(units__state=WorkUnit.State.DONE)
PENDING = Contribution.Status.PENDING


def accepted_tokens_by(key: str, **filters: Any) -> dict[int, int]:
    """Tokens of units with an accepted Δ, summed per ``key`` (e.g. "lease__worker_id").

    Every module of a unit reports the same token count, so a unit counts once
    (the max over its modules), not once per module.
    """
    rows = (
        Contribution.objects.filter(status=ACCEPTED, **filters)
        .values("lease_id", key)
        .annotate(tokens=Max("tokens"))
        .order_by()
    )
    totals: dict[int, int] = defaultdict(int)
    for row in rows:
        totals[row[key]] += row["tokens"]
    return dict(totals)


# --- runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRow:
    run: Run
    rounds_done: int
    rounds_total: int
    paths_active: int
    paths_total: int
    active_workers: int
    best_perplexity: float | None
    best_path: int | None
    routed_perplexity: float | None
    routed_round: int | None
    tokens: int


def run_rows() -> list[RunRow]:
    """Every run, newest first, with the figures of the runs list."""
    runs = _with_counts(Run.objects.order_by("-created_at", "-pk"))
    tokens = accepted_tokens_by("unit__round__run_id")
    workers = dict(
        Lease.objects.filter(state=Lease.State.ACTIVE)
        .values_list("unit__round__run_id")
        .annotate(n=Count("worker", distinct=True))
        .order_by()
    )
    return [_run_row(run, tokens.get(run.pk, 0), workers.get(run.pk, 0)) for run in runs]


def run_row(run: Run) -> RunRow:
    """The runs list's figures for one run (the run page's header)."""
    annotated = _with_counts(Run.objects.filter(pk=run.pk)).get()
    tokens = accepted_tokens_by("unit__round__run_id", unit__round__run=run).get(run.pk, 0)
    workers = (
        Lease.objects.filter(state=Lease.State.ACTIVE, unit__round__run=run)
        .values("worker")
        .distinct()
        .count()
    )
    return _run_row(annotated, tokens, workers)


def _count(rows: QuerySet[Any]) -> Coalesce:
    """A correlated COUNT of ``rows`` (filtered on ``run=OuterRef("pk")``), 0 when none."""
    counted = rows.order_by().values("run").annotate(n=Count("pk")).values("n")
    return Coalesce(Subquery(counted), 0)


def _with_counts(runs: QuerySet[Run]) -> QuerySet[Run]:
    """``runs`` with rounds_done, paths_total and paths_active (subqueries: no join fan-out)."""
    return runs.annotate(
        rounds_done=_count(Round.objects.filter(run=OuterRef("pk"), state=Round.State.CLOSED)),
        # DiPaCo paths (phase 2); a dense phase 1's one path is not counted.
        paths_total=_count(Path.objects.filter(run=OuterRef("pk"), phase=PATHS)),
        paths_active=_count(
            Path.objects.filter(run=OuterRef("pk"), phase=PATHS, state=Path.State.ACTIVE)
        ),
    )


def _run_row(run: Any, tokens: int, workers: int) -> RunRow:
    best_loss, best_path = best_val_loss(run)
    routed = latest_routed_val_loss(run)
    return RunRow(
        run=run,
        rounds_done=run.rounds_done,
        rounds_total=run.run_config.total_rounds,  # both phases
        paths_active=run.paths_active,
        paths_total=run.paths_total,
        active_workers=workers,
        best_perplexity=perplexity(best_loss),
        best_path=best_path,
        routed_perplexity=perplexity(routed[1]) if routed else None,
        routed_round=routed[0] if routed else None,
        tokens=tokens,
    )


def best_val_loss(run: Run) -> tuple[float | None, int | None]:
    """(lowest validation loss of any path in any round, that path's index)."""
    point = (
        MetricPoint.objects.filter(run=run, name=VAL_LOSS, path__phase=PATHS)
        .order_by("value", "round")
        .values_list("value", "path__index")
        .first()
    )
    return point if point is not None else (None, None)


def evaluation_every(run: Run) -> int:
    """K: the run's evaluation scores each DiPaCo path every K rounds (1: every round;
    dipaco.evaluate.eval_plan rotates the paths when the budget cannot hold them all)."""
    config = run.run_config
    tokens = list(
        run.paths.filter(phase=PATHS).order_by("index").values_list("val_tokens", flat=True)
    )
    minimum = config.eval.min_path_windows
    return rotation_every(tokens, config.model.seq_len, sample_size(config), minimum)


def routed_val_losses(run: Run) -> dict[int, float]:
    """Round → routed validation loss: the recorded ``routed_val_loss`` where there is one,
    else the mean of that round's path losses weighted by each path's validation tokens
    (every path alike when no token counts are known).

    A rotated evaluation (`evaluation_every` > 1) scores a group of the paths a round: its
    routed mean at round t weighs each path's latest loss at or before t, from the round by
    which every path with validation text has one (the mean of one group would jump from
    group to group)."""
    recorded = dict(
        MetricPoint.objects.filter(run=run, name=ROUTED_VAL_LOSS, round__isnull=False)
        .order_by("round", "pk")
        .values_list("round", "value")
    )
    weights = dict(run.paths.values_list("pk", "val_tokens"))
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    uniform = not any(weights.values())
    for t, path_id, value in (
        MetricPoint.objects.filter(run=run, name=VAL_LOSS, path__isnull=False, round__isnull=False)
        .order_by("round", "pk")
        .values_list("round", "path_id", "value")
    ):
        weight = 1.0 if uniform else float(weights.get(path_id, 0))
        sums[t][0] += weight * value
        sums[t][1] += weight
    derived = {t: s / w for t, (s, w) in sums.items() if w > 0}
    if evaluation_every(run) > 1:
        for t, carried in _carried_forward(run, weights, uniform).items():
            if carried is None:
                derived.pop(t, None)  # one group's mean: not the routed model's
            else:
                derived[t] = carried
    return dict(sorted({**derived, **recorded}.items()))


def _carried_forward(run: Run, weights: dict[int, int], uniform: bool) -> dict[int, float | None]:
    """Per DiPaCo round, the weighted mean of every path's latest loss (routed_val_losses);
    None before every path with a window has a loss."""
    seq_len = run.run_config.model.seq_len
    paths = run.paths.filter(phase=PATHS)
    scored = {pk for pk, n in paths.values_list("pk", "val_tokens") if window_count(n, seq_len)}
    points = MetricPoint.objects.filter(run=run, name=VAL_LOSS, path__in=paths, round__isnull=False)
    by_round: dict[int, dict[int, float]] = defaultdict(dict)
    for t, path_id, value in points.order_by("round", "pk").values_list(
        "round", "path_id", "value"
    ):
        by_round[t][path_id] = value
    latest: dict[int, float] = {}
    carried: dict[int, float | None] = {}
    for t in sorted(by_round):
        latest.update(by_round[t])
        weight = {p: 1.0 if uniform else float(weights.get(p, 0)) for p in latest}
        total = sum(weight.values())
        whole = scored <= latest.keys() and total > 0
        carried[t] = sum(weight[p] * v for p, v in latest.items()) / total if whole else None
    return carried


def latest_routed_val_loss(run: Run) -> tuple[int, float] | None:
    losses = routed_val_losses(run)
    if not losses:
        return None
    t = max(losses)
    return t, losses[t]


# --- one run's rounds, modules, paths and workers ---------------------------------------


@dataclass(frozen=True)
class RoundRow:
    t: int
    state: str
    opened_at: datetime
    closed_at: datetime | None
    open_seconds: float
    bar_percent: float  # open_seconds relative to the longest round, for the timeline bar
    units_done: int  # of the units the round needed (originals)
    units_total: int
    checks_done: int  # check copies trained besides (sampled replication)
    accepted: int
    rejected: int
    pending: int
    # Where its time went (rounds.stages): each stage's wall span as a part of a stacked
    # bar scaled to the round with the most, and its tasks' summed seconds.
    stages: tuple[StageBar, ...] = ()


@dataclass(frozen=True)
class StageBar:
    stage: str
    percent: float
    wall_seconds: float
    seconds: float


def _stage_bars(rounds: list[Round]) -> dict[int, tuple[StageBar, ...]]:
    spans = stages_by_round(rounds)
    longest = max((sum(s.wall_seconds for s in row) for row in spans.values()), default=0.0)
    scale = 100 / (longest or 1.0)
    return {
        pk: tuple(
            StageBar(s.stage, round(scale * s.wall_seconds, 2), s.wall_seconds, s.seconds)
            for s in row
        )
        for pk, row in spans.items()
    }


def round_rows(run: Run, *, now: datetime | None = None) -> list[RoundRow]:
    """The round timeline, newest first: how long each round stayed open and its Δs."""
    now = now or timezone.now()
    rounds = list(
        Round.objects.filter(run=run)
        .order_by("-t")
        .annotate(
            # The units the round needed: its originals. Sampled replication's check copies
            # (rounds.verification.replication) do not hold a round up, and one still queued when the
            # round closes is dropped, so they are counted apart, and only when trained.
            units_total=Count("units", filter=ORIGINAL, distinct=True),
            units_done=Count("units", filter=ORIGINAL & DONE_UNIT, distinct=True),
            checks_done=Count("units", filter=~ORIGINAL & DONE_UNIT, distinct=True),
        )
    )
    counts: dict[tuple[int, str], int] = {
        (r["unit__round_id"], r["status"]): r["n"]
        for r in Contribution.objects.filter(unit__round__run=run)
        .values("unit__round_id", "status")
        .annotate(n=Count("pk"))
        .order_by()
    }
    bars = _stage_bars(rounds)
    seconds = {r.pk: ((r.closed_at or now) - r.opened_at).total_seconds() for r in rounds}
    longest = max(seconds.values(), default=0.0) or 1.0
    return [
        RoundRow(
            t=r.t,
            state=r.state,
            opened_at=r.opened_at,
            closed_at=r.closed_at,
            open_seconds=max(seconds[r.pk], 0.0),
            bar_percent=round(100 * max(seconds[r.pk], 0.0) / longest, 1),
            units_done=r.units_done,
            units_total=r.units_total,
            checks_done=r.checks_done,
            accepted=counts.get((r.pk, ACCEPTED), 0),
            rejected=counts.get((r.pk, REJECTED), 0),
            pending=counts.get((r.pk, PENDING), 0),
            stages=bars[r.pk],
        )
        for r in rounds
    ]


@dataclass(frozen=True)
class ModuleCell:
    module_id: str
    version: int | None
    updated_at: datetime | None
    size: int | None


@dataclass(frozen=True)
class ModuleGrid:
    levels: list[list[ModuleCell]]  # levels[l][k]: module "l.k"
    others: list[ModuleCell]  # the shared module and path-specific ones
    columns: list[int]  # 0..max K - 1, for the table header


def module_grid(run: Run) -> ModuleGrid:
    """Levels x modules with each module's current version and when it landed."""
    current = {
        v.module_id: v
        for v in ModuleVersion.objects.filter(module__run=run, version=F("module__current_version"))
    }
    levels: dict[int, list[ModuleCell]] = defaultdict(list)
    others = []
    for module in run.modules.filter(phase=PATHS).order_by("level", "index", "module_id"):
        version = current.get(module.pk)
        cell = ModuleCell(
            module_id=module.module_id,
            version=module.current_version,
            updated_at=version.created_at if version else None,
            size=version.size if version else None,
        )
        if module.level is None:
            others.append(cell)
        else:
            levels[module.level].append(cell)
    grid = [levels[level] for level in sorted(levels)]
    width = max((len(cells) for cells in grid), default=0)
    return ModuleGrid(levels=grid, others=others, columns=list(range(width)))


@dataclass(frozen=True)
class PathRow:
    index: int
    modules: list[str]
    state: str
    routing_share: float | None
    val_perplexity: float | None  # after the latest evaluated round
    best_perplexity: float | None
    best_round: int | None
    train_tokens: int
    download_url: str


def path_rows(run: Run) -> list[PathRow]:
    """Each path with its latest and best validation perplexity and its download link."""
    latest: dict[int, float] = {}
    best: dict[int, tuple[float, int | None]] = {}
    for path_id, t, value in (
        MetricPoint.objects.filter(run=run, name=VAL_LOSS, path__isnull=False)
        .order_by("round", "pk")
        .values_list("path_id", "round", "value")
    ):
        latest[path_id] = value
        if path_id not in best or value < best[path_id][0]:
            best[path_id] = (value, t)
    rows = []
    for path in run.paths.filter(phase=PATHS).order_by("index"):
        best_loss, best_round = best.get(path.pk, (path.best_val_loss, path.best_round))
        rows.append(
            PathRow(
                index=path.index,
                modules=list(path.modules),
                state=path.state,
                routing_share=path.routing_share,
                val_perplexity=perplexity(latest.get(path.pk)),
                best_perplexity=perplexity(best_loss),
                best_round=best_round,
                train_tokens=path.train_tokens,
                download_url=f"/api/v1/runs/{run.pk}/paths/{path.index}/download",
            )
        )
    return rows


def active_leases(run: Run) -> list[Lease]:
    """Leases being trained on now, with their worker and unit (for 'active workers')."""
    return list(
        Lease.objects.filter(unit__round__run=run, state=Lease.State.ACTIVE)
        .select_related("worker", "unit__path", "unit__round")
        .order_by("granted_at", "pk")
    )


def run_actions(run: Run) -> list[str]:
    """The buttons staff see: what the run's state allows (see dipaco_web.actions)."""
    if run.state in TERMINAL:
        return []
    first = {
        Run.State.DRAFT: "prepare",
        Run.State.READY: "start",
        Run.State.RUNNING: "pause",
        Run.State.PAUSED: "resume",
    }.get(Run.State(run.state))
    return [first, "cancel"] if first else ["cancel"]  # preparing: only cancel


# --- workers ---------------------------------------------------------------------------


@dataclass
class WorkerRow:
    worker: Worker
    online: bool
    device: str
    accepted: int
    rejected: int
    accepted_tokens: int = 0
    # credit of accepted units held while the worker is on probation or doubted
    # (workers.trust.grant_credit): shown beside the granted tokens, marked held
    held_tokens: int = 0
    current: list[str] = field(default_factory=list)  # "run r · path p" it is training now
    stuck: bool = False  # heartbeats, holds a lease, completed nothing (rounds.reports.activity)


def online_window() -> timedelta:
    """A worker heard from within one lease timeout is online (agents heartbeat every third)."""
    return timedelta(seconds=current_policy().lease_timeout_s)


def worker_rows(*, now: datetime | None = None) -> list[WorkerRow]:
    """Every worker, online ones first, most recently seen first."""
    now = now or timezone.now()
    since = now - online_window()
    workers = Worker.objects.annotate(
        accepted=Count("leases__contributions", filter=Q(leases__contributions__status=ACCEPTED)),
        rejected=Count("leases__contributions", filter=Q(leases__contributions__status=REJECTED)),
    ).order_by("-last_seen", "pk")
    current: dict[int, list[str]] = defaultdict(list)
    for worker_id, run_name, path_index in (
        Lease.objects.filter(state=Lease.State.ACTIVE)
        .order_by("granted_at")
        .values_list("worker_id", "unit__round__run__name", "unit__path__index")
    ):
        current[worker_id].append(f"{run_name} · path {path_index}")
    stuck = set(activity.stuck_workers(activity.Window.at(now)).values_list("pk", flat=True))
    rows = [
        WorkerRow(
            worker=w,
            online=not w.revoked and w.last_seen is not None and w.last_seen >= since,
            device=device_label(w.device),
            accepted=w.accepted,
            rejected=w.rejected,
            # The credit the outer step gave (rounds.verification.credit): the same count
            # as the worker API's tokens_processed, not every unit with one accepted Δ.
            accepted_tokens=w.tokens_processed,
            held_tokens=w.held_tokens,
            current=current.get(w.pk, []),
            stuck=w.pk in stuck,
        )
        for w in workers
    ]
    return sorted(rows, key=lambda r: not r.online)  # stable: keeps last-seen order within


def leaderboard(rows: list[WorkerRow], limit: int = 10) -> list[WorkerRow]:
    """The workers whose accepted Δs trained the most tokens: ranked by the credit granted,
    then by the credit held (a newcomer on probation, or a doubted worker, holds the credit
    of its accepted units until it is trusted: it is listed, its held tokens marked held,
    not left out as it was with nothing granted)."""
    ranked = sorted(
        (r for r in rows if r.accepted_tokens or r.held_tokens),
        key=lambda r: (-r.accepted_tokens, -r.held_tokens),
    )
    return ranked[:limit]


_DEVICE_KEYS = ("gpu", "name", "device", "accelerator", "type")


def device_label(device: Any) -> str:
    """A short description of the device a worker reported (untrusted: text only, cut)."""
    if not isinstance(device, dict) or not device:
        return "unknown"
    name = next(
        (str(device[k]) for k in _DEVICE_KEYS if device.get(k) not in (None, "", "none")),
        "no GPU" if device.get("gpu") == "none" else "",
    )
    memory = device.get("memory_gb")
    parts = [name] if name else [f"{k}={v}" for k, v in list(device.items())[:2]]
    if isinstance(memory, int | float) and not isinstance(memory, bool):
        parts.append(f"{memory:g} GB")
    label = " · ".join(parts)
    return label if len(label) <= 60 else label[:59] + "…"
