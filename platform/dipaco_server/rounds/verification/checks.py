"""The acceptance checks of one module's step, in order, behind one entry point
(`check_contributions`; docs/design.md §7):

1. **format** (`uploads.check_upload`): size and sha256 against what the worker declared,
   hashed as it downloads; then `codecs.verify` against the module's spec for its norm.
   Usually done already, with the cosine of step 2, by the check_unit task at the Δ's
   completion (rounds.verification.arrival): its record is reused for the bytes it names
   (`reuse_arrival`), so the step neither fetches nor decodes that Δ to judge it.
   Norms above ``outer.reject_norm_factor`` x the median of the verified ones are outliers.
2. **history, direction, useful work** (`screen_verdicts`, rounds.verification.rules's rules, with
   ``outer.verify``): replay, norm against the module's history, cosine with its outer
   momentum, proof of useful work (`scorer.Scorer`).
3. **replication** (`compare_replicas`): a check copy's Δ against its original's, a
   disagreement settled by evidence; a copy that differs in the direction its worker's
   copies differed from other workers' before is refused however close
   the pair is
   (rounds.verification.persistence: a fixed-direction bias); `aggregated` puts a check copy in the
   place of a refused original.
4. **the first round** (`first_round_check`, a module's first step): the round's units
   settled over every module they share (rounds.verification.first_round), so two
   colluders cannot win a tie, nor a module only their paths share.
5. **peers** (`peer_check`), in a module's first step only: no free first round.

Each Δ is decoded to tensors at most once (`Verdict.decoded`) and kept for the later
checks and the aggregation: pass 1 holds every verified Δ of the module in fp32.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dipaco.codecs import CodecError
from dipaco.config import OuterConfig
from dipaco.modules_file import Spec
from dipaco.outer import norm_outliers
from dipaco_server.rounds import stages
from dipaco_server.rounds.verification import persistence, rules
from dipaco_server.rounds.verification.uploads import (
    ScoreFn,
    Upload,
    Verdict,
    check_upload,
    fetch,
)
from dipaco_server.storage import BlobStore

Tensors = Mapping[str, Tensor]
GRAM_CHUNK = 1 << 16  # values of each Δ per step of the peer check's Gram matrix


def check_contributions(
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
    arrival: Mapping[int, Mapping[str, Any]] | None = None,
    kept: Callable[[Upload], Path] | None = None,
    momentum_version: int | None = None,
) -> tuple[list[Verdict], list[tuple[int, str]]]:
    """Every check on one module's uploads: (a verdict per upload, in order; (worker,
    the replica counter it moves) per settled replica pair). An accepted verdict keeps its verified
    file (and its decoded Δ, when a check decoded it) for the aggregation; `aggregated`
    picks the ones that go into the step. `first_round`: the round's settlement over
    whole units (lease id -> reason, rounds.verification.settlement), for a module's first
    step.

    `arrival`: contribution -> what its check at completion recorded
    (rounds.verification.arrival), reused for the bytes it names; `kept(upload)`: where
    that check kept them; `momentum_version`: the version `momentum` is of (a cosine taken
    at arrival against another version is taken again)."""
    verdicts = verify_uploads(
        store,
        uploads,
        spec,
        cfg.reject_norm_factor,
        work,
        cfg=cfg,
        history=history,
        momentum=momentum,
        scorer=scorer,
        arrival=arrival,
        kept=kept,
        momentum_version=momentum_version,
    )
    replicas = compare_replicas(verdicts, spec, cfg)
    if cfg.verify and not history:
        first_round_check(verdicts, first_round or {})
        peer_check(verdicts, spec)
    return verdicts, replicas


def first_round_check(verdicts: Sequence[Verdict], settled: Mapping[int, str]) -> None:
    """The round's settlement over whole units (first_round.settle) applied to this
    module's Δs: a unit refused or held out there is, in every module it trained."""
    for v in verdicts:
        reason = settled.get(v.upload.lease_id)
        if v.accepted and reason:
            code, _, message = reason.partition(": ")
            v.reject(code, message)


def peer_check(verdicts: Sequence[Verdict], spec: Spec) -> None:
    """A module's first step, before it has a history or a momentum to hold a Δ against:
    the Δs it would aggregate against each other (rounds.verification.rules.peer_refusals)."""
    chosen = {v.upload.contribution_id: v for v in aggregated(verdicts) if (v.norm or 0) > 0}
    if len(chosen) < 2:
        return
    refused = rules.peer_refusals(
        _pairwise_cosines(chosen, spec),
        {key: rules.gain_rate(v.score, v.upload.work) for key, v in chosen.items()},
    )
    for key, reason in refused.items():
        code, _, message = reason.partition(": ")
        chosen[key].reject(code, message)


def _pairwise_cosines(
    chosen: Mapping[int, Verdict], spec: Spec
) -> dict[tuple[int, int], float | None]:
    """rounds.verification.rules.pairwise_cosines, streamed: the Gram matrix of the Δs' raw fp32
    copies, read a chunk of each at a time (memory: Δs x chunk, not Δs x module)."""
    keys = list(chosen)
    for v in chosen.values():
        if v.raw is None:
            v.decoded(spec)  # writes the raw copy; the tensors are dropped at once
    gram = torch.zeros(len(keys), len(keys), dtype=torch.float64)
    total = sum(math.prod(shape) for shape, _ in spec.values())
    handles = [open(chosen[k].raw, "rb") for k in keys]  # type: ignore[arg-type]  # noqa: SIM115
    try:
        for start in range(0, total, GRAM_CHUNK):
            count = min(GRAM_CHUNK, total - start)
            rows = torch.empty(len(keys), count, dtype=torch.float32)  # (Δs, count)
            for row, handle in zip(rows, handles, strict=True):
                handle.readinto(row.view(torch.uint8).numpy().data)
            wide = rows.double()
            gram += wide @ wide.T
    finally:
        for handle in handles:
            handle.close()
    out: dict[tuple[int, int], float | None] = {}
    for i, a in enumerate(keys):
        for j in range(i + 1, len(keys)):
            scale = float(gram[i, i] * gram[j, j])
            out[(a, keys[j])] = float(gram[i, j]) / math.sqrt(scale) if scale > 0 else None
    return out


def verify_uploads(
    store: BlobStore,
    uploads: Sequence[Upload],
    spec: Spec,
    reject_norm_factor: float,
    work: Path,
    *,
    cfg: OuterConfig | None = None,
    history: Sequence[float] = (),
    momentum: Mapping[str, Tensor] | None = None,
    scorer: ScoreFn | None = None,
    arrival: Mapping[int, Mapping[str, Any]] | None = None,
    kept: Callable[[Upload], Path] | None = None,
    momentum_version: int | None = None,
) -> list[Verdict]:
    """Pass 1: every upload fetched, checked and measured (or its check at arrival
    reused: `reuse_arrival`); outliers by norm rejected; then, with `cfg` and
    ``cfg.verify``, the history, direction and useful-work checks."""
    verdicts = []
    for upload in uploads:
        verdict = Verdict(upload)
        record = (arrival or {}).get(upload.contribution_id)
        try:
            with stages.timed("fetch_decode"):
                if record is not None and record.get("sha256") == upload.sha256:
                    reuse_arrival(verdict, record, store, work, kept)
                else:  # not checked at arrival (or not these bytes): checked here
                    verdict.file, verdict.norm = check_upload(store, upload, spec, work)
        except CodecError as exc:  # the codec's refusals and ours share one shape
            verdict.reject(exc.code, str(exc))
        verdicts.append(verdict)
    verified = [v for v in verdicts if v.accepted]
    if verified:
        norms = [float(v.norm or 0.0) for v in verified]
        median = statistics.median(norms)
        for verdict, outlier in zip(
            verified, norm_outliers(norms, reject_norm_factor), strict=True
        ):
            if outlier:
                verdict.reject(
                    "norm_outlier",
                    f"norm {verdict.norm:.4g} exceeds {reject_norm_factor:g} x the round's "
                    f"median {median:.4g} (outer.reject_norm_factor)",
                )
    if cfg is not None and cfg.verify:
        screen_verdicts(verdicts, spec, cfg, history, momentum, scorer, momentum_version)
    return verdicts


def reuse_arrival(
    verdict: Verdict,
    record: Mapping[str, Any],
    store: BlobStore,
    work: Path,
    kept: Callable[[Upload], Path] | None,
) -> None:
    """`verdict` as the check at its completion left it (rounds.verification.arrival): its
    refusal raised as a CodecError, or its norm and the verified bytes, linked from where
    that check kept them (no copy), else fetched again against the same size and sha256,
    whose content that check has already verified."""
    upload = verdict.upload
    if "code" in record:
        raise CodecError(str(record["code"]), str(record.get("message", "")))
    verdict.norm = float(record["norm"])
    verdict.arrival = record
    local = work / f"contribution-{upload.contribution_id}.safetensors"
    source = kept(upload) if kept is not None else None
    if source is not None:
        try:
            os.link(source, local)
            verdict.file = local
            return
        except OSError:  # not kept here (another machine's task, removed): fetched again
            pass
    verdict.file, _ = fetch(store, upload, work)


class LazyDelta(Mapping[str, Tensor]):
    """A verdict's Δ, decoded on first use (`Verdict.decoded`): a check whose answer was
    recorded already (a unit's score, a cosine taken at arrival) decodes nothing."""

    def __init__(self, verdict: Verdict, spec: Spec) -> None:
        self.verdict, self.spec = verdict, spec
        self._delta: dict[str, Tensor] | None = None

    def _get(self) -> dict[str, Tensor]:
        if self._delta is None:
            self._delta = self.verdict.decoded(self.spec)
        return self._delta

    def __getitem__(self, name: str) -> Tensor:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self.spec)


def screen_verdicts(
    verdicts: Sequence[Verdict],
    spec: Spec,
    cfg: OuterConfig,
    history: Sequence[float],
    momentum: Mapping[str, Tensor] | None,
    scorer: ScoreFn | None,
    momentum_version: int | None = None,
) -> None:
    """rounds.verification.rules's checks on the verified uploads, one decoded Δ in memory
    at a time; a Δ is decoded only when a cosine or a score was not recorded already."""
    candidates = []
    for v in verdicts:
        if not v.accepted or v.file is None:
            continue
        needs_delta = momentum is not None or (scorer is not None and cfg.score)
        if needs_delta and not v.upload.replayed and (v.norm or 0.0) > 0:
            delta = LazyDelta(v, spec)
            if momentum is not None:
                taken, cosine = v.arrival_cosine(momentum_version)
                v.cosine = cosine if taken else rules.cosine(delta, momentum)
            if scorer is not None and cfg.score:
                try:
                    v.score = scorer(v.upload, delta)
                except CodecError as exc:  # another module's Δ of its unit is unusable
                    v.reject("unit_invalid", f"its unit's Δ cannot be scored: {exc}")
                    continue
            del delta  # one decoded Δ in memory at a time
        candidates.append(
            rules.Candidate(
                v.upload.contribution_id,
                float(v.norm or 0.0),
                cosine=v.cosine,
                score=v.score,
                replayed=v.upload.replayed,
                work=v.upload.work,
                lr_share=v.upload.lr_share,
            )
        )
    refused = rules.screen(candidates, history, cfg)
    refused.update(_held_pairs(verdicts, refused, spec, cfg))
    for v in verdicts:
        reason = refused.get(v.upload.contribution_id)
        if reason:
            code, _, message = reason.partition(": ")
            v.reject(code, message)


def _held_pairs(
    verdicts: Sequence[Verdict], refused: Mapping[int, str], spec: Spec, cfg: OuterConfig
) -> dict[int, str]:
    """{contribution: reason} for both copies of each replicated unit that agree and are
    each refused for no gain alone (rules.held_no_gain): held, not refused. Before the
    refusals are applied, while both Δs are still on disk."""
    by_id = {v.upload.contribution_id: v for v in verdicts}
    held: dict[int, str] = {}
    for check in verdicts:
        original = by_id.get(check.upload.check_of) if check.upload.check_of else None
        if original is None or not comparable(original, check):
            continue
        keys = (original.upload.contribution_id, check.upload.contribution_id)
        reasons = (refused.get(keys[0], ""), refused.get(keys[1], ""))
        if not all(r.startswith(f"{rules.NO_GAIN}:") for r in reasons):
            continue
        identical = original.upload.sha256 == check.upload.sha256
        a, b = original.decoded(spec), check.decoded(spec)
        scores = (original.score, check.score)
        reason = rules.held_no_gain(reasons, scores, a, b, cfg, identical=identical)
        del a, b
        if reason:
            held.update(dict.fromkeys(keys, reason))
    return held


def comparable(original: Verdict, check: Verdict) -> bool:
    """Whether a check copy's Δ and its original's are one unit's work from one start:
    the server sized both leases alike (a deadline or a calibration sizes one lease
    below the other: fewer steps from the same start make another Δ, not a copy; the
    grant no longer hands out such a check copy), and both are relative to the same
    versions (outer.overlap eager: one rebased onto round t - 1's versions, the other
    could not in time, rounds.protocol.rebase)."""
    return (
        check.upload.sized == original.upload.sized
        and check.upload.delta_base == original.upload.delta_base
    )


def compare_replicas(
    verdicts: Sequence[Verdict], spec: Spec, cfg: OuterConfig
) -> list[tuple[int, str]]:
    """Each check copy's Δ against its original's (rounds.verification.replication), settled by
    evidence (rounds.verification.rules.settle_replicas): on a disagreement only the copy its score
    (else its direction) finds worse is refused. A pair is compared when both passed
    every other check, whatever tokens each claims: a claimed count cannot opt out of
    the comparison. (worker, "replicas_agreed" | "replicas_disagreed") per worker whose
    counter moves; identical Δs move neither (one Δ twice confirms nothing); (worker,
    "doubted") for both workers of a doubtful pair (rules.AGREE_COSINE)."""
    by_id = {v.upload.contribution_id: v for v in verdicts}
    moves: list[tuple[int, str]] = []
    for check in verdicts:
        original = by_id.get(check.upload.check_of) if check.upload.check_of else None
        if original is None or not (check.accepted and original.accepted):
            continue
        if not comparable(original, check):  # left to the other checks
            continue
        pair = (original, check)
        a, b = original.decoded(spec), check.decoded(spec)
        repeats = _repeated(pair, a, b, spec)
        flagged = [i for i, why in enumerate(repeats) if why]
        # Only that worker's copies keep adding one direction, and the two are close enough
        # to pass as agreeing (what the rule is for). Copies that disagree anyway go to
        # the evidence: against a lazy or zero copy, an honest copy's difference is its own
        # Δ, which is no evidence about the honest worker.
        close = rules.replicas_agree(a, b, cfg)[0]
        if len(flagged) == 1 and close:
            outcome = rules.ReplicaOutcome("disagree", flagged[0], repeats[flagged[0]])
        else:
            outcome = rules.settle_replicas(
                a,
                b,
                cfg,
                tuple(  # type: ignore[arg-type]
                    rules.ReplicaEvidence(v.score, v.cosine, v.upload.sha256) for v in pair
                ),
                repeated="; ".join(repeats) if flagged else "",
            )
        del a, b
        if outcome.kind in ("agree", "identical"):
            # Identical copies move no counter (one Δ twice confirms neither against the
            # other checks), but they are probation's evidence: both computed the same
            # bytes from the same inputs (deterministic CPUs, both cold), which a worker
            # that trains otherwise cannot match; a colluding partner proves nothing
            # either way, hence several distinct partners (workers.probation).
            if outcome.kind == "agree":
                moves += [(v.upload.worker_id, "replicas_agreed") for v in pair]
            original.agreed_with, check.agreed_with = (
                check.upload.worker_id,
                original.upload.worker_id,
            )
        if outcome.kind == "doubtful":
            # Neither refused nor confirmed (rules.AGREE_COSINE): both workers' next units
            # are replicated, their credit held, until one agrees conclusively; the
            # difference is kept (below) for the repetition rule, which tells which of the
            # two keeps adding it.
            moves += [(v.upload.worker_id, "doubted") for v in pair]
        if not close:  # a difference from a far-off copy is that copy's error, not evidence
            original.sketch = check.sketch = original.partner = check.partner = None
        if outcome.kind == "disagree" and outcome.loser is not None:
            loser = pair[outcome.loser]
            moves.append((loser.upload.worker_id, "replicas_disagreed"))
            loser.reject(
                rules.REPLICA,
                f"two workers trained unit {original.upload.unit_id}: {outcome.why}",
            )
    return moves


def _repeated(pair: tuple[Verdict, Verdict], a: Tensors, b: Tensors, spec: Spec) -> list[str]:
    """Per copy, whether its difference from the other repeats what its worker's copies
    kept adding against other workers (persistence.repeated); each copy
    keeps its side of the difference (`Verdict.sketch`, `Verdict.partner`). Identical bytes are no
    difference: nothing to keep."""
    if pair[0].upload.sha256 == pair[1].upload.sha256:
        return ["", ""]
    sketch, difference = persistence.difference_sketch(a, b, spec)
    sides = []
    for verdict, other, signed in ((pair[0], pair[1], sketch), (pair[1], pair[0], -sketch)):
        verdict.sketch, verdict.partner = persistence.to_bytes(signed), other.upload.worker_id
        past = [  # against other workers (both copies train cold: either role)
            (partner, persistence.from_bytes(data))
            for partner, _, data in verdict.upload.replica_past
            if partner != other.upload.worker_id
        ]
        sides.append((verdict.upload.worker_id, signed, past))
    smaller = min(float(v.norm or 0.0) for v in pair)
    return persistence.repeated(sides, difference, smaller)


def aggregated(verdicts: Sequence[Verdict]) -> list[Verdict]:
    """The accepted verdicts the step aggregates: originals and ordinary contributions,
    and a check copy in the place of an original that was refused (its unit's work is
    still done once; a check copy of an accepted original would count the unit twice)."""
    by_id = {v.upload.contribution_id: v for v in verdicts}
    chosen = []
    for v in verdicts:
        if not v.accepted:
            continue
        original = by_id.get(v.upload.check_of) if v.upload.check_of is not None else None
        if original is None or not original.accepted:
            chosen.append(v)
    return chosen
