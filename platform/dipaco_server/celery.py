"""The Celery app, configured from Django settings (``CELERY_*`` names).

Workers and beat start with ``celery -A dipaco_server worker`` / ``beat``;
the broker is Redis when ``REDIS_URL`` is set and kombu's filesystem
transport in the data dir otherwise (see ``dipaco_server.env``).
"""

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

# Set before the app exists so Celery's Django fix-up sees it and calls
# django.setup() in every worker process.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")

app = Celery("dipaco_server")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# The rounds app keeps its tasks with the round's life, not at the app's top (<app>.tasks).
app.autodiscover_tasks(["dipaco_server.rounds.lifecycle"])


def pool_threads(cpus: int, concurrency: int) -> int:
    """torch intra-op threads for each of a worker's ``concurrency`` pool processes: the
    cores shared out, at least one. torch's default is a thread per core in every process,
    so N pool processes stepping or scoring at once ran N threads per core, which then
    waited on each other (on two cores, one process scoring a validation sample with two
    threads beside a busy neighbour used 7x the CPU of one thread)."""
    return max(1, cpus // max(1, concurrency))


@worker_init.connect
def share_cores_between_pool_processes(sender: Any = None, **_: Any) -> None:
    """Before the pool forks (torch is imported later, inside tasks): OMP_NUM_THREADS for
    the pool processes, unless the operator set it. ``--concurrency auto`` sizes the pool to
    the cores, so each process gets one thread."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    concurrency = getattr(sender, "concurrency", None)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = concurrency if isinstance(concurrency, int) and concurrency > 0 else cpus
    os.environ["OMP_NUM_THREADS"] = str(pool_threads(cpus, processes))
