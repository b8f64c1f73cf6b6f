"""The run page's chart series: validation and training curves, and bytes moved per round.

Each chart is plain JSON for uPlot (static/dipaco_web/dashboard.js): a shared x
axis of outer rounds and one list of y values per series, ``None`` where a series
has no point in a round. A path's validation series also carries ``lower`` and ``upper``:
its loss one standard error below and above (``val_loss_se``, the server's standard error
of the mean window loss, runs.evaluate), drawn as a band around its curve; a rotated
evaluation (dipaco.evaluate.eval_plan) gives a path a point, and a band, every few rounds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NotRequired, TypedDict

from django.db.models import Max, Sum

from dipaco.data.windows import step_tokens
from dipaco_server.rounds.models import Contribution, Lease
from dipaco_server.runs.models import MetricPoint, ModuleVersion, Run
from dipaco_server.runs.phases import DENSE, PATHS, phase_config
from dipaco_web.queries import TRAIN_LOSS, VAL_LOSS, perplexity, routed_val_losses

FP32_BYTES = 4
ROUTED = "routed mean"
DENSE_LABEL = "dense model (phase 1)"
# runs.evaluate.START_LOSS, named here: that module imports torch, the web process need not.
START_LOSS = "start_val_loss"
STDERR = "val_loss_se"  # runs.evaluate.STDERR: a val_loss point's standard error


Band = dict[int, tuple[float, float]]  # round -> (lower, upper)


class Series(TypedDict):
    label: str
    values: list[float | None]
    lower: NotRequired[list[float | None]]  # a band: one standard error below the values
    upper: NotRequired[list[float | None]]  # ... and above (None where a point has none)


class Chart(TypedDict, total=False):
    x: list[int]
    series: list[Series]
    # The first DiPaCo round of a run with a dense phase 1 (runs.phases): every chart marks it.
    phase_boundary: int


def _chart(by_label: dict[str, dict[int, float]], bands: dict[str, Band] | None = None) -> Chart:
    rounds = sorted({t for values in by_label.values() for t in values})
    series: list[Series] = []
    for label, values in by_label.items():
        one: Series = {"label": label, "values": [values.get(t) for t in rounds]}
        band = (bands or {}).get(label)
        if band:
            one["lower"] = [band[t][0] if t in band else None for t in rounds]
            one["upper"] = [band[t][1] if t in band else None for t in rounds]
        series.append(one)
    return {"x": rounds, "series": series}


def loss_charts(run: Run) -> dict[str, Chart]:
    """Validation loss and perplexity per path (each with its standard-error band) with the
    routed mean; training loss."""
    series: dict[str, dict[Any, dict[int, float]]] = {VAL_LOSS: {}, TRAIN_LOSS: {}, STDERR: {}}
    reported: dict[Any, dict[int, list[float]]] = {}  # training: every unit's point
    for name, path_index, phase, t, value in (
        MetricPoint.objects.filter(run=run, name__in=list(series), round__isnull=False)
        .order_by("path__phase", "path__index", "round", "pk")
        .values_list("name", "path__index", "path__phase", "round", "value")
    ):
        if phase == DENSE:
            path_index = DENSE_LABEL  # phase 1's one path is not DiPaCo path 0
        if name == TRAIN_LOSS:
            reported.setdefault(path_index, {}).setdefault(t, []).append(value)
        else:
            series[name].setdefault(path_index, {})[t] = value  # the last point of a round wins
    for path_index, rounds in reported.items():  # a path's replicas: the mean of their units
        series[TRAIN_LOSS][path_index] = {t: sum(v) / len(v) for t, v in rounds.items()}
    start = _phase2_start(run)
    for path_index, loss in start.items():  # each phase-2 path's curve starts at its start
        series[VAL_LOSS].setdefault(path_index, {}).setdefault(start_round(run), loss)
    validation = {_label(p): v for p, v in series[VAL_LOSS].items() if p is not None}
    bands: dict[str, Band] = {}
    for p, errors in series[STDERR].items():
        losses = series[VAL_LOSS].get(p, {})
        bands[_label(p)] = {
            t: (losses[t] - e, losses[t] + e) for t, e in errors.items() if t in losses
        }
    routed = routed_val_losses(run)
    if start:  # at phase 1's last round, the routed curve is phase 2's start, not phase 1's
        routed[start_round(run)] = _weighted(run, start)
        routed = dict(sorted(routed.items()))
    if routed:
        validation[ROUTED] = routed
    training = {
        ("all paths" if p is None else _label(p)): values
        for p, values in series[TRAIN_LOSS].items()
    }
    ppl = {
        label: {t: p for t, loss in values.items() if (p := perplexity(loss)) is not None}
        for label, values in validation.items()
    }
    ppl_bands: dict[str, Band] = {
        label: {
            t: (lo, hi)
            for t, (low, high) in band.items()
            if (lo := perplexity(low)) is not None and (hi := perplexity(high)) is not None
        }
        for label, band in bands.items()
    }
    return {
        "val_loss": _chart(validation, bands),
        "val_perplexity": _chart(ppl, ppl_bands),
        "train_loss": _chart(training),
    }


def start_round(run: Run) -> int:
    """The x of phase 2's starting point: phase 1's last round (runs.evaluate.evaluate_start)."""
    phase1 = run.run_config.phase1
    return phase1.rounds - 1 if phase1 is not None else -1


def _phase2_start(run: Run) -> dict[int, float]:
    """Per phase-2 path, its loss before phase 2's first round (runs.evaluate.START_LOSS),
    on the same validation sample as every later point; {} without a phase 1."""
    if run.run_config.phase1 is None:
        return {}
    return dict(
        MetricPoint.objects.filter(run=run, name=START_LOSS, path__phase=PATHS)
        .order_by("pk")
        .values_list("path__index", "value")
    )


def _weighted(run: Run, losses: dict[int, float]) -> float:
    """The routed mean of per-path losses, weighted by each path's validation tokens."""
    weights = dict(run.paths.filter(phase=PATHS).values_list("index", "val_tokens"))
    total = sum(weights.get(p, 0) for p in losses)
    if not total:
        return sum(losses.values()) / len(losses)
    return sum(loss * weights.get(p, 0) for p, loss in losses.items()) / total


def _label(path_index: int | str) -> str:
    return path_index if isinstance(path_index, str) else f"path {path_index}"


def with_phase_boundary(run: Run, charts: dict[str, Chart]) -> dict[str, Chart]:
    """Every chart with the round phase 2 starts at, for a run with a dense phase 1."""
    phase1 = run.run_config.phase1
    if phase1 is None:
        return charts
    return {name: {**chart, "phase_boundary": phase1.rounds} for name, chart in charts.items()}


@dataclass(frozen=True)
class Communication:
    """Bytes moved per round by DiPaCo, and by data-parallel training of the same steps.

    DiPaCo moves, per completed unit, the path's weights down and its encoded Δ up. Down
    is what the unit's manifest sent its worker to (Lease.download_bytes,
    rounds.protocol.downloads): with ``comm.download_codec`` int8/fp16 only the encoded updates
    from the versions the worker held, else the fp32 files of the versions it started
    from (as `dipaco simulate` counts them; leases from before it was recorded count the
    fp32 files). Data-parallel training of the same steps would
    exchange every inner step's fp32 gradient of the whole path: sent and received,
    2 x 4 bytes per parameter per step (a parameter server; a ring all-reduce moves
    about as much per worker). The steps are the ones each unit trained (its tokens over
    batch x sequence length): units sized to a worker's speed, or salvaged partway, train
    fewer than H.
    """

    rounds: list[int]
    moved: list[int]
    data_parallel: list[int]
    downloaded: list[int] = field(default_factory=list)  # part of `moved`: weights down
    uploaded: list[int] = field(default_factory=list)  # part of `moved`: Δs up

    @property
    def total_moved(self) -> int:
        return sum(self.moved)

    @property
    def total_downloaded(self) -> int:
        return sum(self.downloaded)

    @property
    def total_uploaded(self) -> int:
        return sum(self.uploaded)

    @property
    def total_data_parallel(self) -> int:
        return sum(self.data_parallel)

    @property
    def ratio(self) -> float | None:
        """How many times more data-parallel would have moved (None before any unit)."""
        return self.total_data_parallel / self.total_moved if self.total_moved else None

    def chart(self) -> Chart:
        """Cumulative bytes over rounds, both ways."""
        moved: list[float | None] = [float(b) for b in accumulate(self.moved)]
        data_parallel: list[float | None] = [float(b) for b in accumulate(self.data_parallel)]
        return {
            "x": self.rounds,
            "series": [
                {"label": "dipaco", "values": moved},
                {"label": "data-parallel", "values": data_parallel},
            ],
        }


def communication(run: Run) -> Communication:
    """Bytes per round, from the module versions, contributions and completed leases."""
    config = run.run_config
    # A dense phase 1 has modules of its own under the same ids (runs.phases): key by phase.
    phases = (DENSE, PATHS) if config.phase1 is not None else (PATHS,)
    configs = {phase: phase_config(config, phase) for phase in phases}
    params = {phase: c.module_param_counts() for phase, c in configs.items()}
    steps = {phase: c.inner.steps for phase, c in configs.items()}
    per_step = {phase: step_tokens(c) for phase, c in configs.items()}
    sizes = {
        (phase, module_id, version): size
        for phase, module_id, version, size in ModuleVersion.objects.filter(
            module__run=run
        ).values_list("module__phase", "module__module_id", "version", "size")
    }
    up: dict[int, int] = defaultdict(int)
    down: dict[int, int] = defaultdict(int)
    data_parallel: dict[int, int] = defaultdict(int)
    for t, uploaded in (
        Contribution.objects.filter(unit__round__run=run)
        .values_list("unit__round__t")
        .annotate(total=Sum("size"))
        .order_by()
    ):
        up[t] += uploaded
    for t, phase, base_versions, modules, tokens, downloaded in (
        Lease.objects.filter(unit__round__run=run, state=Lease.State.COMPLETED)
        .annotate(tokens=Max("contributions__tokens"))
        .values_list(
            "unit__round__t",
            "unit__path__phase",
            "unit__base_versions",
            "unit__path__modules",
            "tokens",
            "download_bytes",
        )
    ):
        counts = params.get(phase, {})
        if downloaded is not None:
            down[t] += downloaded
        else:  # A version not in the table (never expected) is counted at its fp32 size.
            down[t] += sum(
                sizes.get((phase, m, v), FP32_BYTES * counts.get(m, 0))
                for m, v in base_versions.items()
            )
        trained = steps.get(phase, 0)
        if tokens and per_step.get(phase):
            trained = min(trained, tokens // per_step[phase])
        data_parallel[t] += trained * 2 * FP32_BYTES * sum(counts.get(m, 0) for m in modules)
    rounds = sorted(set(up) | set(down) | set(data_parallel))
    return Communication(
        rounds=rounds,
        moved=[up.get(t, 0) + down.get(t, 0) for t in rounds],
        data_parallel=[data_parallel.get(t, 0) for t in rounds],
        downloaded=[down.get(t, 0) for t in rounds],
        uploaded=[up.get(t, 0) for t in rounds],
    )
