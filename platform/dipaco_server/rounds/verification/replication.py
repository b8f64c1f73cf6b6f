"""Sampled replication (BOINC's adaptive replication, issue 19): some units trained twice.

When a unit is granted, `maybe_replicate` may queue a *check copy* of it: the same round,
path, windows and base versions, with ``replica = CHECK_OFFSET + the original's replica``,
at the rate workers.trust.replication_rate gives the worker that took the original (a
low trust: every unit). A check copy is never granted to the worker that holds or held
its original (`not_own_check`), does not hold up the round while it is queued (rounds.lifecycle.close
counts only originals; one still queued when the round closes is dropped; one being
trained gets the deadline and salvage grace an original gets), and its Δ is never
aggregated unless its original was refused: the outer step compares it with the
original's (rounds.verification.rules.settle_replicas, a tolerance for nondeterminism) and a
disagreement refuses only the copy its evidence finds worse (rounds.verification).
"""

from __future__ import annotations

import logging

from django.db.models import Exists, OuterRef, Q

from dipaco_server.rounds.models import Lease, WorkUnit
from dipaco_server.workers import trust
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)

# Check copies take replica indices from here: replicas_per_path is far below it.
CHECK_OFFSET = 1_000_000


def is_check(unit: WorkUnit) -> bool:
    return unit.replica >= CHECK_OFFSET


def maybe_replicate(unit: WorkUnit, worker: Worker) -> WorkUnit | None:
    """Queue a check copy of `unit`, just granted to `worker`, if its trust says so."""
    if is_check(unit) or not trust.should_replicate(worker):
        return None
    copy, created = WorkUnit.objects.get_or_create(
        round_id=unit.round_id,
        path_id=unit.path_id,
        replica=CHECK_OFFSET + unit.replica,
        defaults={
            "data_position": unit.data_position,
            "data_windows": unit.data_windows,
            "base_versions": unit.base_versions,
        },
    )
    if created:
        logger.info("unit %s of worker %s replicated as unit %s", unit.pk, worker.pk, copy.pk)
    return copy if created else None


def not_own_check(worker: Worker) -> Q:
    """Excludes the check copies of units `worker` holds or held (same round, path and
    windows): two workers, never one twice."""
    own = Lease.objects.filter(
        worker=worker,
        unit__round_id=OuterRef("round_id"),
        unit__path_id=OuterRef("path_id"),
        unit__data_position=OuterRef("data_position"),
    )
    return ~(Q(replica__gte=CHECK_OFFSET) & Q(Exists(own)))
