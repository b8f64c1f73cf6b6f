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
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from dipaco.codecs import CodecError
from dipaco_server.rounds import stages
from dipaco_server.rounds.models import Contribution, Lease, Round
from dipaco_server.rounds.verification.scorer import Scorer, delta_bases
from dipaco_server.rounds.verification.uploads import Upload
from dipaco_server.runs.phases import round_config
from dipaco_server.runs.prepare import work_root
from dipaco_server.storage import BlobStore, get_blob_store

logger = logging.getLogger(__name__)


def score_completed(lease_id: int, store: BlobStore | None = None) -> str:
    """Score the unit of a completed lease and record it (`Lease.score`); what happened."""
    lease = (
        Lease.objects.select_related("unit__round__run", "unit__path").filter(pk=lease_id).first()
    )
    if lease is None or lease.state != Lease.State.COMPLETED:
        return "not completed"
    if lease.score is not None:
        return "scored already"
    round_ = lease.unit.round
    if round_.state == Round.State.CLOSED:
        return "round closed"
    _, config = round_config(round_.run.run_config, round_.t)
    if not (config.outer.verify and config.outer.score):
        return "not scored in this run"
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
