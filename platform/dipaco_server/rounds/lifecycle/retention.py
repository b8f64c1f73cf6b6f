"""Blob retention: what the object store may forget, and the sweep that forgets it (so
the store stays bounded).

Without it every upload and every module version stays forever: a run of T rounds and U
units keeps T x U Δs and T versions of every module, weights and momentum.

`sweep_blobs` (beat: rounds.lifecycle.tasks.sweep_blobs) deletes, run by run:

- **uploads of closed rounds** (``runs/<run>/rounds/<t>/...``): every blob there that no
  contribution row names (a lease that expired or was released after uploading, a
  completion that never came), every rejected contribution's, and the accepted ones'
  once the round is more than DIPACO_RETENTION_ROUNDS rounds behind the run's newest
  (the outer step applied them: they are superseded). Rounds that are open or closing
  are never touched: their steps may still read any upload.
- **module versions** (weights, momentum, encoded update and its residual) beyond the
  newest DIPACO_RETENTION_VERSIONS of each module: the blobs and then the rows (a download that asks for such a round gets a clear
  "no version after round t", not older weights). Never the module's current version,
  never a version that a unit of a round still open or closing starts from (its outer
  step reads it), and the momentum of the newest version is always kept.

It never deletes anything still referenced: what it deletes is computed from the rows
first, and a row goes only after its blobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from dipaco_server.rounds.models import Contribution, Round, WorkUnit
from dipaco_server.runs import keys
from dipaco_server.runs.models import Module, ModuleVersion, Run
from dipaco_server.storage import BlobNotFound, BlobStore, get_blob_store

logger = logging.getLogger(__name__)

DEFAULTS = {
    # Accepted uploads of this many most recent closed rounds are kept (audit, replay checks
    # use their sha256 rows, not their bytes).
    "DIPACO_RETENTION_ROUNDS": 2,
    # Versions (weights + momentum) kept per module, newest first; downloads of older
    # rounds answer 404. At least 2: evaluation reads the version before the newest.
    "DIPACO_RETENTION_VERSIONS": 4,
}


def _setting(name: str, low: int) -> int:
    value = getattr(settings, name, DEFAULTS[name])
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ImproperlyConfigured(f"{name}={value!r}: must be an integer >= {low}")
    return value


@dataclass
class SweepReport:
    deleted: list[str] = field(default_factory=list)
    versions_deleted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"blobs_deleted": len(self.deleted), "versions_deleted": self.versions_deleted}


def sweep_blobs(*, store: BlobStore | None = None) -> SweepReport:
    # torch (seconds): the Celery app imports this module without it (tests/test_boundaries)
    from dipaco_server.rounds.verification.arrival import sweep_kept

    store = store or get_blob_store()
    report = SweepReport()
    keep_rounds = _setting("DIPACO_RETENTION_ROUNDS", 0)
    keep_versions = _setting("DIPACO_RETENTION_VERSIONS", 2)
    for run in Run.objects.order_by("pk"):
        _sweep_uploads(store, run, keep_rounds, report)
        _sweep_versions(store, run, keep_versions, report)
        sweep_kept(run.pk)  # the Δs check_unit kept on this disk for steps that are done
    if report.deleted:
        logger.info("retention: %s", report.as_dict())
    return report


def _delete(store: BlobStore, key: str, report: SweepReport) -> None:
    try:
        store.delete(key)
    except BlobNotFound:
        return
    report.deleted.append(key)


def _sweep_uploads(store: BlobStore, run: Run, keep_rounds: int, report: SweepReport) -> None:
    newest = run.rounds.order_by("-t").values_list("t", flat=True).first()
    if newest is None:
        return
    for t in run.rounds.filter(state=Round.State.CLOSED).values_list("t", flat=True):
        prefix = f"{keys.run_prefix(run.pk)}/rounds/{t}/"
        present = store.list(prefix)
        if not present:
            continue
        rows = Contribution.objects.filter(unit__round__run=run, unit__round__t=t)
        keep = set(
            rows.filter(status=Contribution.Status.PENDING).values_list("blob_key", flat=True)
        )
        if newest - t <= keep_rounds:
            accepted = rows.filter(status=Contribution.Status.ACCEPTED)
            keep |= set(accepted.values_list("blob_key", flat=True))
        for key in present:
            if key not in keep:
                _delete(store, key, report)


def referenced_versions(run: Run) -> dict[int, set[int]]:
    """Module pk -> versions that units of rounds still open or closing start from."""
    live = WorkUnit.objects.filter(round__run=run).exclude(round__state=Round.State.CLOSED)
    by_id = {(m.phase, m.module_id): m.pk for m in Module.objects.filter(run=run)}
    used: dict[int, set[int]] = {}
    for base_versions, phase in live.values_list("base_versions", "path__phase"):
        for module_id, version in (base_versions or {}).items():
            pk = by_id.get((phase, module_id))
            if pk is not None:
                used.setdefault(pk, set()).add(int(version))
    return used


def _sweep_versions(store: BlobStore, run: Run, keep_versions: int, report: SweepReport) -> None:
    used = referenced_versions(run)
    for module in Module.objects.filter(run=run):
        rows = list(ModuleVersion.objects.filter(module=module).order_by("-version"))
        keep = {v.version for v in rows[:keep_versions]} | used.get(module.pk, set())
        if module.current_version is not None:
            keep.add(module.current_version)
        kept_keys = {k for v in rows if v.version in keep for k in _blob_keys(v)}
        for row in rows:
            if row.version in keep:
                continue
            with transaction.atomic():
                # Re-read under a lock: a step publishing meanwhile changes nothing here
                # (it only adds newer versions), but the module's current one must hold.
                locked = Module.objects.select_for_update().get(pk=module.pk)
                if locked.current_version == row.version:
                    continue
                for key in _blob_keys(row):
                    if key and key not in kept_keys:
                        _delete(store, key, report)
                row.delete()
                report.versions_deleted += 1


def _blob_keys(version: ModuleVersion) -> tuple[str, ...]:
    """Every blob of a version: weights, momentum, and its encoded update with the update's
    residual (comm.download_codec). They live and go together: a worker holding version
    t - 1 is sent update t only while version t's row, and so its blobs, is kept."""
    return (version.blob_key, version.momentum_key, version.update_key, version.residual_key)
