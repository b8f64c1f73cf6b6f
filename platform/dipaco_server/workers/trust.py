"""How far the server trusts a worker's work, and what follows from it (issue 19).

Every worker starts at trust 1.0. Each contribution the outer step rejects multiplies it
by DIPACO_TRUST_PENALTY, each replica disagreement by the same, and each accepted one adds
DIPACO_TRUST_REWARD (capped at 1). BOINC's adaptive replication, on that score:

- a trusted worker's units are replicated (issued to a second worker as well, their Δs
  compared) at DIPACO_REPLICATION_RATE;
- below DIPACO_TRUST_REPLICATE_ALL every unit it takes is replicated;
- below DIPACO_MIN_TRUST it gets no more work (403 worker_distrusted) until staff reset
  its trust.

With the defaults, one unit of three rejected Δs (0.7³ = 0.34) moves a worker to full
replication, a second one stops it; a single honest Δ refused now and then is recovered
by the next few accepted ones.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F, Value
from django.db.models.functions import Least

from dipaco_server.workers.errors import WorkerDistrusted
from dipaco_server.workers.models import Worker

DEFAULTS: dict[str, float] = {
    # Share of a trusted worker's units also issued to a second worker and compared.
    "DIPACO_REPLICATION_RATE": 0.1,
    # Below this trust every unit the worker takes is replicated.
    "DIPACO_TRUST_REPLICATE_ALL": 0.5,
    # Below this trust the worker gets no more leases.
    "DIPACO_MIN_TRUST": 0.3,
    # Trust is multiplied by this per rejected contribution or replica disagreement...
    "DIPACO_TRUST_PENALTY": 0.7,
    # ...and raised by this per accepted contribution, up to 1.
    "DIPACO_TRUST_REWARD": 0.02,
}


def setting(name: str) -> float:
    """A Django setting of that name, else the environment variable, else the default."""
    value: object = getattr(settings, name, None)
    if value is None:
        raw = os.environ.get(name)
        try:
            value = DEFAULTS[name] if raw is None else float(raw)
        except ValueError:
            value = raw
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ImproperlyConfigured(
            f"{name}={value!r}: must be a number in [0, 1]; e.g. {DEFAULTS[name]}"
        )
    return float(value)


def check_trusted(worker: Worker) -> None:
    """Refuse work to a worker whose trust fell below DIPACO_MIN_TRUST."""
    minimum = setting("DIPACO_MIN_TRUST")
    if worker.trust < minimum:
        raise WorkerDistrusted(
            f"worker {worker.pk}'s work failed verification too often (trust "
            f"{worker.trust:.2f} < {minimum:g}); it gets no more work. See its rejected "
            "contributions (GET /api/v1/worker/contributions) and ask an operator to reset it",
            trust=worker.trust,
            minimum=minimum,
        )


def replication_rate(worker: Worker) -> float:
    """The share of `worker`'s units that a second worker also trains."""
    if worker.trust < setting("DIPACO_TRUST_REPLICATE_ALL"):
        return 1.0
    return setting("DIPACO_REPLICATION_RATE")


def should_replicate(worker: Worker, rng: random.Random | None = None) -> bool:
    rate = replication_rate(worker)
    return rate >= 1.0 or (rng or random).random() < rate


def penalise(worker_ids: Iterable[int], times: int = 1) -> None:
    """Multiply each worker's trust by DIPACO_TRUST_PENALTY per listed occurrence."""
    factor = setting("DIPACO_TRUST_PENALTY")
    counts: dict[int, int] = {}
    for worker_id in worker_ids:
        counts[worker_id] = counts.get(worker_id, 0) + times
    for worker_id, n in counts.items():
        Worker.objects.filter(pk=worker_id).update(trust=F("trust") * factor**n)


def reward(worker_ids: Iterable[int]) -> None:
    """Add DIPACO_TRUST_REWARD per listed occurrence, up to 1."""
    step = setting("DIPACO_TRUST_REWARD")
    counts: dict[int, int] = {}
    for worker_id in worker_ids:
        counts[worker_id] = counts.get(worker_id, 0) + 1
    for worker_id, n in counts.items():
        Worker.objects.filter(pk=worker_id).update(
            trust=Least(F("trust") + Value(step * n), Value(1.0))
        )
