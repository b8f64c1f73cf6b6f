"""Verification's one entry point for an outer step: `judge` the module's Δs of a round,
then `settle` the verdicts inside the step's commit (rounds.verification.credit).

`judge(round_, module, rows, ...)` gathers what the checks compare against from the
database and the store (each upload's lease, replays and check copies, the module's norm
history and outer momentum, the scorer, a first step's settlement, the records of the
checks done at each completion: rounds.verification.arrival), runs every check in order
(rounds.verification.checks.check_contributions) and returns a `Judgement`: a verdict per
upload, the Δs the aggregation takes (the robust rule's choice), and whether an undecided
first round makes the step wait. The outer step (rounds.outer.step) then reads: fetch the
round's contributions, judge, aggregate, Nesterov step, publish, settle.

`judge_uploads` is the same without the database (tests and benches hand it uploads).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from dipaco.config import OuterConfig, RunConfig
from dipaco.data.windows import unit_tokens
from dipaco.modules_file import Spec
from dipaco_server.rounds import stages
from dipaco_server.rounds.granted import lease_lr_share, lease_tokens
from dipaco_server.rounds.models import Contribution, Round
from dipaco_server.rounds.verification.arrival import arrival_records, checked_file
from dipaco_server.rounds.verification.checks import aggregated, check_contributions
from dipaco_server.rounds.verification.context import (
    check_copies,
    norm_history,
    outer_momentum,
    replayed,
    replica_past,
)
from dipaco_server.rounds.verification.credit import settle
from dipaco_server.rounds.verification.first_round import UNSETTLED
from dipaco_server.rounds.verification.scorer import Scorer, delta_bases
from dipaco_server.rounds.verification.settlement import first_round_verdicts
from dipaco_server.rounds.verification.uploads import ScoreFn, Upload, Verdict
from dipaco_server.runs.phases import local_round

if TYPE_CHECKING:
    from dipaco_server.runs.models import Module
    from dipaco_server.storage import BlobStore

__all__ = ["Judgement", "judge", "judge_uploads", "settle", "uploads_of"]


@dataclass
class Judgement:
    """What the checks decided about one module's Δs of a round."""

    verdicts: list[Verdict]
    replicas: list[tuple[int, str]] = field(default_factory=list)  # (worker, counter it moves)
    accepted: list[Verdict] = field(default_factory=list)  # what the aggregation takes
    history: Sequence[float] = ()  # the module's accepted median norms of earlier rounds
    waited: bool = False  # an undecided first round: every Δ kept for the next step
    median_norm: float | None = None  # of every Δ with a norm, accepted or not
    seconds: float = 0.0


def judge_uploads(
    store: BlobStore,
    uploads: Sequence[Upload],
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    *,
    history: Sequence[float] = (),
    momentum: Mapping[str, Tensor] | None = None,
    scorer: ScoreFn | None = None,
    first_round: Mapping[int, str] | None = None,
    can_wait: bool = False,
    arrival: Mapping[int, Mapping[str, Any]] | None = None,
    kept: Callable[[Upload], Path] | None = None,
    momentum_version: int | None = None,
) -> Judgement:
    """Every check on `uploads`, in order; the Δs a check decoded stay on disk in `work`
    for the aggregation (each accepted verdict's), the rest are released. `can_wait`: a
    next round of the phase exists, so an undecided first round (first_round.UNSETTLED)
    makes the step wait instead of stepping without the held Δs."""
    clock = time.perf_counter()
    with stages.timed("checks"):
        verdicts, replicas = check_contributions(
            store, uploads, spec, cfg, work, history=history, momentum=momentum, scorer=scorer,
            first_round=first_round, arrival=arrival, kept=kept,
            momentum_version=momentum_version,
        )  # fmt: skip
    judgement = Judgement(verdicts, replicas=replicas, history=history)
    if can_wait and any(v.reason.startswith(UNSETTLED) for v in verdicts):
        for v in verdicts:
            v.release()
        judgement.waited = True
        judgement.seconds = time.perf_counter() - clock
        return judgement
    norms = [v.norm for v in verdicts if v.norm is not None]
    judgement.median_norm = statistics.median(norms) if norms else None
    judgement.accepted = aggregated(verdicts)
    chosen = {v.upload.contribution_id for v in judgement.accepted}
    for v in verdicts:  # a check copy of an accepted original: compared, no more
        if v.upload.contribution_id not in chosen:
            v.release()
    judgement.seconds = time.perf_counter() - clock
    return judgement


def judge(
    round_: Round,
    module: Module,
    rows: Sequence[Contribution],
    *,
    config: RunConfig,
    store: BlobStore,
    spec: Spec,
    work: Path,
    base_momentum_key: str | None,
    base_version: int | None,
    can_wait: bool,
) -> Judgement:
    """Judge `rows` (the module's pending contributions of round_, and those a waiting
    first step kept, in the order they are added) against what the database and the
    store hold about them (module doc). `base_momentum_key`/`base_version`: the version
    the units trained from, whose outer momentum the direction check reads (None: no
    version, nothing to compare against)."""
    run_id, t = round_.run_id, round_.t
    uploads = uploads_of(run_id, module, t, rows, config)
    outer = config.outer
    momentum, scorer = None, None
    if outer.verify and uploads and base_version is not None:
        momentum = outer_momentum(store, base_momentum_key, spec, work)
        if outer.score:
            scorer = Scorer(store, round_, module, config, work)
    history = norm_history(module, t, outer.history_rounds)
    settled = None
    if outer.verify and uploads and not history:  # a module's first step
        settled = first_round_verdicts(store, round_, config, work, scorer)
    return judge_uploads(
        store, uploads, spec, outer, work, history=history, momentum=momentum,
        scorer=scorer, first_round=settled, can_wait=can_wait, arrival=arrival_records(rows),
        kept=lambda u: checked_file(run_id, u.contribution_id, u.sha256),
        momentum_version=base_version if momentum is not None else None,
    )  # fmt: skip


def uploads_of(
    run_id: int, module: Module, t: int, rows: Sequence[Contribution], config: RunConfig
) -> list[Upload]:
    """Round t's pending contributions to `module` as the checks see them (`rows` in the
    order they are added), with what the database knows about each: replays, check copies,
    the replica's past, the versions its Δ is relative to.

    Each Δ weighs its tokens, capped at what its lease allowed (rounds.granted), never only at what the completion claimed: a partial or sized unit weighs
    less.
    """
    whole_unit = unit_tokens(config)
    round_index = local_round(module.run.run_config, t) if rows else 0
    bases = delta_bases(rows)
    replays = replayed(run_id, t, rows)
    checks = check_copies(rows)
    pasts = replica_past(module, rows, checks)  # what paired workers' copies differed by
    uploads = []
    for c in rows:
        allowed = lease_tokens(c.lease, config)
        uploads.append(
            Upload(
                c.pk,
                c.lease.worker_id,
                c.blob_key,
                c.size,
                c.sha256,
                min(c.tokens, allowed),
                c.unit.path.index,
                unit_id=c.unit_id,
                lease_id=c.lease_id,
                position=c.unit.data_position,
                replayed=c.pk in replays,
                check_of=checks.get(c.pk),
                partial=c.tokens < allowed,
                work=min(1.0, min(c.tokens, allowed) / whole_unit),
                sized=min(1.0, allowed / whole_unit),
                lr_share=lease_lr_share(c.lease, config, round_index),
                delta_base=bases[c.lease_id],
                replica_past=pasts.get(c.lease.worker_id, ()),
            )
        )
    return uploads
