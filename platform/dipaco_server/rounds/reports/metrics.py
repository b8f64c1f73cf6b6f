"""The platform's state as Prometheus metrics, read from the database at scrape time.

A prometheus_client custom Collector: nothing is counted in process memory, so every web
process (gunicorn runs several) and every Celery worker would answer the same figures, and
no multiprocess directory is needed. Counters are counts and sums over rows that only grow
(leases, units, contributions); a deleted run lowers them, which Prometheus reads as a
counter reset. Each part is collected on its own: a part that fails (Redis away for the
queue lengths) is left out of that scrape and counted in ``dipaco_scrape_errors_total``,
never a failed scrape.

A scrape costs a fixed number of queries (about fifteen, plus two per running run), each an
aggregate over indexed columns; the training stage of closed rounds, which is read from
their leases, is kept per process once computed (a closed round's leases do not change).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import (
    Case,
    CharField,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Q,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import StrIndex, Substr
from django.utils import timezone
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dipaco_server.monitoring import names
from dipaco_server.rounds.models import Contribution, Lease, Round, RoundStage, WorkUnit
from dipaco_server.rounds.reports import activity
from dipaco_server.runs.models import MetricPoint, Path, Run
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)

# Runs that get per-run series; the others only count in dipaco_runs.
LIVE_RUNS = (Run.State.PREPARING, Run.State.READY, Run.State.RUNNING, Run.State.PAUSED)
VAL_LOSS = "val_loss"  # MetricPoint name of a path's held-out loss (runs.evaluate)
# Stage seconds run from a tenth of a second (a micro model's publishing) to hours (a
# 150M model's training round): a 1-2.5-5 ladder over that span.
STAGE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
# A rejection's reason is "<code>: <message>" (rounds.verification); the code is the label.
REASON_CODE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
# kombu's Redis transport keeps a queue's priorities 3, 6, 9 in lists of their own.
PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
REDIS_TIMEOUT_S = 2.0


def _gauge(metric: names.Metric) -> GaugeMetricFamily:
    return GaugeMetricFamily(metric.name, metric.help, labels=metric.labels or None)


def _counter(metric: names.Metric, value: float | None = None) -> CounterMetricFamily:
    if metric.labels:
        return CounterMetricFamily(metric.name, metric.help, labels=metric.labels)
    return CounterMetricFamily(metric.name, metric.help, value=value or 0)


class DatabaseCollector(Collector):
    """Yields every family of names.DATABASE from the database (and the broker's queues)."""

    def __init__(self) -> None:
        self._training: dict[int, float | None] = {}  # closed round pk -> training wall s
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        errors: Counter[str] = Counter()
        parts: tuple[tuple[str, Callable[[], Iterable[Metric]]], ...] = (
            ("runs", self._runs),
            ("workers", self._workers),
            ("leases", self._leases),
            ("contributions", self._contributions),
            ("stages", self._stages),
            ("queues", self._queues),
        )
        for part, collect in parts:
            try:
                yield from list(collect())
            except Exception:
                logger.exception("metrics: could not collect %s; left out of this scrape", part)
                errors[part] += 1
        failed = _counter(names.SCRAPE_ERRORS)
        for part, _ in parts:
            failed.add_metric([part], _ERRORS.add(part, errors[part]))
        yield failed

    # --- runs --------------------------------------------------------------------------------

    def _runs(self) -> Iterator[Metric]:
        by_state = dict(Run.objects.values_list("state").annotate(n=Count("pk")).order_by())
        runs = _gauge(names.RUNS)
        for state in Run.State.values:
            runs.add_metric([state], by_state.get(state, 0))
        yield runs

        live = list(Run.objects.filter(state__in=LIVE_RUNS).order_by("pk"))
        current, phase = _gauge(names.RUN_ROUND), _gauge(names.RUN_PHASE)
        age, expected = _gauge(names.ROUND_AGE), _gauge(names.ROUND_EXPECTED)
        stalled, steps = _gauge(names.ROUND_STALLED), _gauge(names.PREPARATION_PIECES)
        now = timezone.now()
        for run in live:
            current.add_metric([run.name], run.current_round)
            for value in Run.Phase.values:
                phase.add_metric([run.name, value], 1 if run.phase == value else 0)
            # A paused run's round stays open on purpose: only running runs' rounds age.
            opened = activity.round_age(run, now) if run.state == Run.State.RUNNING else None
            if opened is not None:
                age.add_metric([run.name], opened.age_s)
                expected.add_metric([run.name], opened.expected_s)
                stalled.add_metric([run.name], 1 if opened.stalled else 0)
            progress = run.progress if isinstance(run.progress, dict) else {}
            pieces = progress.get("pieces")
            if run.state == Run.State.PREPARING and isinstance(pieces, dict):
                total, done = _whole(pieces.get("total")), _whole(pieces.get("done")) or 0
                if total is not None:
                    steps.add_metric([run.name, "done"], min(done, total))
                    steps.add_metric([run.name, "left"], max(0, total - done))
        yield from (current, phase, age, expected, stalled, steps)
        yield self._losses(live)

    def _losses(self, live: list[Run]) -> Metric:
        latest = (
            MetricPoint.objects.filter(path=OuterRef("pk"), name=VAL_LOSS)
            .order_by("-round", "-pk")
            .values("value")[:1]
        )
        paths = (
            Path.objects.filter(run__in=live)
            .annotate(loss=Subquery(latest))
            .filter(loss__isnull=False)
            .values_list("run__name", "phase", "index", "loss")
            .order_by("run_id", "phase", "index")
        )
        loss = _gauge(names.PATH_VALIDATION_LOSS)
        for run_name, phase, index, value in paths:
            loss.add_metric([run_name, "dense" if phase == 1 else str(index)], value)
        return loss

    # --- workers, leases, contributions ------------------------------------------------------

    def _workers(self) -> Iterator[Metric]:
        workers = _gauge(names.WORKERS)
        for state, n in activity.worker_counts().items():
            workers.add_metric([state], n)
        yield workers
        probation = _gauge(names.WORKERS_PROBATION)
        probation.add_metric([], activity.on_probation())
        yield probation
        tokens = Worker.objects.aggregate(n=Sum("tokens_processed"))["n"] or 0
        yield _counter(names.TOKENS_TRAINED, tokens)

    def _leases(self) -> Iterator[Metric]:
        ended = {state: Count("pk", filter=Q(state=state)) for state in _ENDED}
        totals = Lease.objects.aggregate(
            granted=Count("pk"),
            salvaged=Count("pk", filter=Q(state=Lease.State.COMPLETED, ended_at__gt=F("deadline"))),
            down=Sum("download_bytes"),
            **ended,
        )
        yield _counter(names.LEASES_GRANTED, totals["granted"])
        family = _counter(names.LEASES_ENDED)
        for state in _ENDED:
            family.add_metric([state], totals[state])
        yield family
        yield _counter(names.LEASES_SALVAGED, totals["salvaged"])
        yield _counter(names.DOWNLOAD_BYTES, totals["down"] or 0)
        done = WorkUnit.objects.filter(state=WorkUnit.State.DONE).count()
        yield _counter(names.UNITS_COMPLETED, done)

    def _contributions(self) -> Iterator[Metric]:
        totals = Contribution.objects.aggregate(
            accepted=Count("pk", filter=Q(status=Contribution.Status.ACCEPTED)), up=Sum("size")
        )
        yield _counter(names.CONTRIBUTIONS_ACCEPTED, totals["accepted"])
        yield _counter(names.UPLOAD_BYTES, totals["up"] or 0)
        reasons: Counter[str] = Counter()
        # Grouped by the reason's code in SQL: reasons carry figures, so their texts are
        # nearly all different, their codes few.
        colon = StrIndex("reason", Value(":"))
        code = Case(
            When(colon__gt=1, then=Substr("reason", 1, F("colon") - 1)),
            default=Value(""),
            output_field=CharField(),
        )
        rejected = (
            Contribution.objects.filter(status=Contribution.Status.REJECTED)
            .annotate(colon=colon)
            .annotate(code=code)
            .values_list("code")
            .annotate(n=Count("pk"))
            .order_by()
        )
        for reason, n in rejected:
            reasons[reason_code(reason)] += n
        family = _counter(names.CONTRIBUTIONS_REJECTED)
        for code in sorted(reasons):
            family.add_metric([code], reasons[code])
        yield family

    # --- round stages ------------------------------------------------------------------------

    def _stages(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            names.ROUND_STAGE_SECONDS.name, names.ROUND_STAGE_SECONDS.help, labels=["stage"]
        )
        # The server's stages, bucketed in SQL: one row per stage, whatever the rounds.
        wall = ExpressionWrapper(F("ended_at") - F("started_at"), output_field=DurationField())
        buckets = {
            f"le{i}": Count("pk", filter=Q(wall__lte=timedelta(seconds=bound)))
            for i, bound in enumerate(STAGE_BUCKETS)
        }
        rows = (
            RoundStage.objects.annotate(wall=wall)
            .values("stage")
            .annotate(n=Count("pk"), total=Sum("wall"), **buckets)
            .order_by("stage")
        )
        histograms = {}
        for row in rows:
            counts = [float(row[f"le{i}"]) for i in range(len(STAGE_BUCKETS))]
            total = row["total"].total_seconds() if row["total"] is not None else 0.0
            histograms[row["stage"]] = (counts, float(row["n"]), max(0.0, total))
        training = [s for s in self._training_walls().values() if s is not None]
        if training:
            counts = [float(sum(1 for s in training if s <= b)) for b in STAGE_BUCKETS]
            histograms["training"] = (counts, float(len(training)), sum(training))
        for stage in sorted(histograms):
            counts, n, total = histograms[stage]
            cumulative = [(_bound(b), c) for b, c in zip(STAGE_BUCKETS, counts, strict=True)]
            family.add_metric([stage], [*cumulative, ("+Inf", n)], sum_value=total)
        yield family

    def _training_walls(self) -> dict[int, float | None]:
        """Each closed round's training wall: its opening to its last completion."""
        closed = set(Round.objects.filter(state=Round.State.CLOSED).values_list("pk", flat=True))
        with self._lock:
            missing = closed - self._training.keys()
        if missing:
            last = dict(
                Lease.objects.filter(unit__round__in=missing, state=Lease.State.COMPLETED)
                .values_list("unit__round_id")
                .annotate(last=Max("ended_at"))
                .order_by()
            )
            opened = dict(Round.objects.filter(pk__in=missing).values_list("pk", "opened_at"))
            found = {
                pk: (last[pk] - opened[pk]).total_seconds() if pk in last else None
                for pk in missing
            }
            with self._lock:
                self._training.update(found)
        with self._lock:
            return {pk: self._training[pk] for pk in closed if pk in self._training}

    # --- Celery's queues ---------------------------------------------------------------------

    def _queues(self) -> Iterator[Metric]:
        url = getattr(settings, "REDIS_URL", None)
        if not url:
            return  # the embedded broker: its queue is a folder of files, not measured
        from dipaco_server.celery import app

        client = _redis(url)
        queues = sorted({app.conf.task_default_queue, *(app.amqp.queues or {})})
        family = _gauge(names.CELERY_QUEUE_LENGTH)
        with client.pipeline(transaction=False) as pipe:
            for queue in queues:
                for suffix in PRIORITY_SUFFIXES:
                    pipe.llen(f"{queue}{suffix}")
            lengths = pipe.execute()
        for i, queue in enumerate(queues):
            chunk = lengths[i * len(PRIORITY_SUFFIXES) : (i + 1) * len(PRIORITY_SUFFIXES)]
            family.add_metric([queue], sum(int(n) for n in chunk))
        yield family


_ENDED = (Lease.State.COMPLETED, Lease.State.EXPIRED, Lease.State.RELEASED)


def reason_code(reason: str) -> str:
    """The stable code of a rejection's reason ("norm_outlier: ..." -> "norm_outlier"); a
    reason without one is "other", so the label keeps a bounded set of values."""
    code = reason.partition(":")[0].strip()
    return code if REASON_CODE.match(code) else "other"


def _bound(value: float) -> str:
    return repr(float(value))


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_clients: dict[str, Any] = {}


def _redis(url: str) -> Any:
    import redis  # only with REDIS_URL set: the embedded server has no Redis to measure

    client = _clients.get(url)
    if client is None:
        client = redis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        _clients[url] = client
    return client


class _ErrorCounts:
    """Scrape errors so far in this process, per part (a counter must only grow)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, part: str, n: int) -> int:
        with self._lock:
            self._counts[part] += n
            return self._counts[part]


_ERRORS = _ErrorCounts()
