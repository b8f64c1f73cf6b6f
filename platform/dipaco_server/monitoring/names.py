"""Every metric /metrics serves: its name, type, labels and help, in one place.

Names are part of the operator's contract (alerts, dashboards: deploy/prometheus,
deploy/grafana): they keep their meaning once released. Units are base units (seconds,
bytes), counters end in ``_total``, and every label takes few values: a run's name only
for runs not yet finished (queued to cancelled runs drop out), a path's index, a state
or a reason code from a fixed set, a Celery queue, a URL route pattern.

The prometheus_client families add ``_total`` to counters and ``_bucket``/``_sum``/
``_count`` to histograms on the wire; the names here are the families' names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # gauge, counter, histogram
    help: str
    labels: tuple[str, ...] = ()

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.name,)


# --- collected from the database at scrape time (rounds.reports.metrics) ----------------------
RUNS = Metric("dipaco_runs", "gauge", "Runs by state.", ("state",))
RUN_ROUND = Metric("dipaco_run_round", "gauge", "A live run's current outer round.", ("run",))
RUN_PHASE = Metric(
    "dipaco_run_phase",
    "gauge",
    "1 for a live run's current phase: 1 (dense DiLoCo), preparing (between the phases), "
    "2 (DiPaCo paths).",
    ("run", "phase"),
)
ROUND_AGE = Metric(
    "dipaco_round_open_age_seconds",
    "gauge",
    "How long a running run's oldest round not yet closed has been open.",
    ("run",),
)
ROUND_EXPECTED = Metric(
    "dipaco_round_expected_seconds",
    "gauge",
    "How long that round was expected to stay open: the median of the run's last closed "
    "rounds, else its deadline. Stalled: age > 2 x this.",
    ("run",),
)
ROUND_STALLED = Metric(
    "dipaco_round_stalled",
    "gauge",
    "1 when a running run's open round has stayed open more than twice its expected duration.",
    ("run",),
)
WORKERS = Metric(
    "dipaco_workers",
    "gauge",
    "Workers by state, each in one: training, idle, stuck (heartbeats, holds a lease, "
    "completed nothing for three lease timeouts), offline, distrusted, revoked.",
    ("state",),
)
WORKERS_PROBATION = Metric(
    "dipaco_workers_on_probation", "gauge", "Workers on probation (not revoked), any state."
)
LEASES_GRANTED = Metric("dipaco_leases_granted", "counter", "Leases granted.")
LEASES_ENDED = Metric(
    "dipaco_leases_ended",
    "counter",
    "Leases that ended, by how: completed, expired (no heartbeat, or past the hard "
    "deadline), released (handed back).",
    ("state",),
)
LEASES_SALVAGED = Metric(
    "dipaco_leases_salvaged",
    "counter",
    "Expired leases whose partial pseudo-gradient was still handed in and stored.",
)
UNITS_COMPLETED = Metric("dipaco_units_completed", "counter", "Work units done.")
CONTRIBUTIONS_ACCEPTED = Metric(
    "dipaco_contributions_accepted", "counter", "Pseudo-gradients (one per module) accepted."
)
CONTRIBUTIONS_REJECTED = Metric(
    "dipaco_contributions_rejected",
    "counter",
    "Pseudo-gradients rejected by the outer step's checks, by reason code.",
    ("reason",),
)
TOKENS_TRAINED = Metric(
    "dipaco_tokens_trained",
    "counter",
    "Training tokens of units whose every pseudo-gradient was accepted and credited.",
)
UPLOAD_BYTES = Metric(
    "dipaco_upload_bytes", "counter", "Bytes of pseudo-gradients workers uploaded."
)
DOWNLOAD_BYTES = Metric(
    "dipaco_download_bytes",
    "counter",
    "Bytes of module weights and encoded updates leases' manifests sent workers to.",
)
ROUND_STAGE_SECONDS = Metric(
    "dipaco_round_stage_seconds",
    "histogram",
    "Wall seconds of each stage of each round (rounds.stages): training, manifest, "
    "fetch_decode, checks, scoring, outer_step, publishing, evaluation.",
    ("stage",),
)
PATH_VALIDATION_LOSS = Metric(
    "dipaco_path_validation_loss",
    "gauge",
    "A live run's path's latest held-out loss (nats per token).",
    ("run", "path"),
)
CELERY_QUEUE_LENGTH = Metric(
    "dipaco_celery_queue_length",
    "gauge",
    "Tasks waiting in a Celery queue on the Redis broker (absent without REDIS_URL).",
    ("queue",),
)
PREPARATION_PIECES = Metric(
    "dipaco_preparation_pieces",
    "gauge",
    "A preparing run's corpus pieces (runs.pieces) tokenised, routed and uploaded, and left.",
    ("run", "state"),
)
SCRAPE_ERRORS = Metric(
    "dipaco_scrape_errors",
    "counter",
    "Parts of a scrape this process could not collect (the log says why), by part.",
    ("part",),
)

# --- counted by each web process as it serves (monitoring.http) -----------------------------
HTTP_REQUESTS = Metric(
    "dipaco_http_requests",
    "counter",
    "HTTP requests answered, by route pattern, method and status.",
    ("route", "method", "status"),
)
HTTP_DURATION = Metric(
    "dipaco_http_request_duration_seconds",
    "histogram",
    "Seconds from a request reaching Django to its answer, by route pattern.",
    ("route",),
)
REQUESTS_SHED = Metric(
    "dipaco_requests_shed",
    "counter",
    "Requests for new work answered 503 overloaded (DIPACO_SHED_AFTER_S).",
)

DATABASE = (
    RUNS, RUN_ROUND, RUN_PHASE, ROUND_AGE, ROUND_EXPECTED, ROUND_STALLED, WORKERS,
    WORKERS_PROBATION, LEASES_GRANTED, LEASES_ENDED, LEASES_SALVAGED, UNITS_COMPLETED,
    CONTRIBUTIONS_ACCEPTED, CONTRIBUTIONS_REJECTED, TOKENS_TRAINED, UPLOAD_BYTES,
    DOWNLOAD_BYTES, ROUND_STAGE_SECONDS, PATH_VALIDATION_LOSS, CELERY_QUEUE_LENGTH,
    PREPARATION_PIECES, SCRAPE_ERRORS,
)  # fmt: skip
PROCESS = (HTTP_REQUESTS, HTTP_DURATION, REQUESTS_SHED)
ALL = DATABASE + PROCESS
