"""Periodic scheduling tasks (Celery beat).

Wire into settings.CELERY_BEAT_SCHEDULE, e.g. every 30 s:
``{"sweep-leases": {"task": "dipaco_server.rounds.tasks.sweep_leases", "schedule": 30.0}}``.
Idempotent: a sweep that runs twice, or two sweeps at once, expire each lease once.
"""

from __future__ import annotations

from celery import shared_task

from dipaco_server.rounds.scheduler import expire_leases


@shared_task(name="dipaco_server.rounds.tasks.sweep_leases")
def sweep_leases() -> int:
    """Requeue the units of leases past their deadline or held by revoked workers."""
    return expire_leases()
