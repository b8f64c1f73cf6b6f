"""What a worker's answer asks of rounds, which workers must not import.

Whether a worker is training, idle or stuck follows from its leases, which are rounds'
records (rounds sits above workers in tests/test_layers.py). So the admin API's worker
answer asks through a signal, and rounds.reports.activity answers (connected when the
rounds app is ready).
"""

from __future__ import annotations

from django.dispatch import Signal

from dipaco_server.workers.models import Worker

state_asked = Signal()  # worker=: the receiver returns the worker's state now


def state_of(worker: Worker) -> str:
    """`worker`'s state now (rounds.reports.activity.STATES); "unknown" without rounds."""
    answers = state_asked.send(sender=Worker, worker=worker)
    return str(answers[0][1]) if answers else "unknown"
