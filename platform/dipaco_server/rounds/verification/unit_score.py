"""A unit's proof of useful work as soon as its lease completes, off the round's critical path.

The outer step scores each unit's Δ (rounds.verification.scorer) before aggregating it. In
the step that is on the round's critical path: at the 150M path every unit's score is
forward passes over its windows, and the steps run only after the last completion.
Scored here instead, by a task queued when the completion commits
(rounds.lifecycle.receivers), the score is recorded on the lease (`Lease.score`, with the
versions it is relative to) while the round still trains, and the steps take it from
there (`Scorer._recorded`). It is the same score of the same bytes: the same rule
(rules.score_delta) on the same windows, the unit's Δs fetched against the digests its
worker declared, relative to the versions the step reads (`delta_bases`). When this task
failed, was late or scored against other versions, the step scores inline as before, so
what is refused does not depend on it.

Half of a score does not depend on the Δ: the path's base losses on the unit's scored
windows. `score_granted`, queued when the lease is granted, computes them while the unit
trains and records them on the lease (`Lease.base_losses`, with the versions and the
windows they are of), so the score at completion runs only the passes with the Δ applied.
The windows are still drawn with the secret the worker never sees (dipaco.data.scored);
computing their base losses early tells the worker nothing, since nothing is sent.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dipaco.codecs import CodecError
from dipaco_server.rounds import stages
from dipaco_server.rounds.models import Contribution, Lease, Round
from dipaco_server.rounds.verification.scorer import Scorer, covered_windows, delta_bases
from dipaco_server.rounds.verification.uploads import Upload
from dipaco_server.runs.models import Module, ModuleVersion
from dipaco_server.runs.phases import round_config
from dipaco_server.runs.prepare import work_root
from dipaco_server.storage import BlobNotFound, BlobStore, get_blob_store

logger = logging.getLogger(__name__)


def _to_score(lease_id: int, state: str, field: str) -> tuple[Lease, Any] | str:
    """(the lease, its round's config) when the lease is in `state`, has no `field` recorded
    yet, its round is not closed and its run scores; else what stops it."""
    lease = (
        Lease.objects.select_related("unit__round__run", "unit__path").filter(pk=lease_id).first()
    )
    if lease is None or lease.state != state:
        return f"not {state}"
    if getattr(lease, field) is not None:
        return "scored already"
    round_ = lease.unit.round
    if round_.state == Round.State.CLOSED:
        return "round closed"
    _, config = round_config(round_.run.run_config, round_.t)
    if not (config.outer.verify and config.outer.score):
        return "not scored in this run"
    return lease, config


def score_completed(lease_id: int, store: BlobStore | None = None) -> str:
    """Score the unit of a completed lease and record it (`Lease.score`); what happened."""
    found = _to_score(lease_id, Lease.State.COMPLETED, "score")
    if isinstance(found, str):
        return found
    lease, config = found
    round_ = lease.unit.round
    rows = list(
        Contribution.objects.filter(lease=lease, status=Contribution.Status.PENDING)
        .select_related("module", "unit")
        .order_by("pk")
    )
    if not rows:
        return "nothing pending"
    first = rows[0]
    upload = Upload(
        first.pk, lease.worker_id, first.blob_key, first.size, first.sha256, first.tokens,
        lease.unit.path.index, unit_id=lease.unit_id, lease_id=lease.pk,
        position=lease.unit.data_position, delta_base=delta_bases(rows)[lease.pk],
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix=f"score-{lease_id}-", dir=work_root()))
    stages.reset()
    try:
        scorer = Scorer(store or get_blob_store(), round_, first.module, config, work)
        score = scorer.whole_unit(upload)
    except CodecError as exc:  # a Δ of the unit is unusable: its step refuses it
        logger.info("lease %d not scored: %s", lease_id, exc)
        score = None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stages.flush(round_.pk)
    return "scored" if score is not None else "not scored"


def score_granted(lease_id: int, store: BlobStore | None = None) -> str:
    """The base losses of a granted lease's unit on its scored windows, recorded on the lease
    (`Lease.base_losses`) for its score at completion; what happened."""
    found = _to_score(lease_id, Lease.State.ACTIVE, "base_losses")
    if isinstance(found, str):
        return found
    lease, config = found
    unit, round_ = lease.unit, lease.unit.round
    base = tuple(sorted(dict(unit.base_versions).items()))
    module = Module.objects.filter(
        run=round_.run, phase=unit.path.phase, module_id=unit.path.modules[0]
    ).first()
    if module is None or not base:
        return "no base to score"
    covered = covered_windows(config, lease.pk)
    work = Path(tempfile.mkdtemp(prefix=f"base-{lease_id}-", dir=work_root()))
    stages.reset()
    try:
        scorer = Scorer(store or get_blob_store(), round_, module, config, work)
        losses = scorer.base_losses(unit.path.index, base, unit.data_position, covered)
    except (BlobNotFound, ValueError, KeyError, ModuleVersion.DoesNotExist) as exc:
        # Nothing to score it on yet (a version not published): its score does it all.
        logger.info("lease %d: base losses not scored: %s", lease_id, exc)
        return "not scored"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        stages.flush(round_.pk)
    row = {"base": [list(p) for p in base], "covered": covered,
           "train": list(losses.train), "heldout": losses.heldout}  # fmt: skip
    Lease.objects.filter(pk=lease.pk, base_losses__isnull=True).update(base_losses=row)
    return "scored"
