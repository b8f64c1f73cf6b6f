"""What a step's verdicts do to their workers, inside the step's transaction: counts,
trust (workers.trust) and credit (units and tokens for accepted work only)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from django.db.models import F

from dipaco_server.rounds.models import Contribution, WorkUnit
from dipaco_server.rounds.verification import first_round, replication, rules
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.rounds.verification.uploads import Verdict
from dipaco_server.workers import trust
from dipaco_server.workers.models import Worker

# Reasons a Δ of a lease the server sized below a whole unit (the round's deadline, a
# calibration) may fail honestly: a step or two moves the weights too little to show a
# gain or a norm near the module's history. Refused and not credited, but its worker's
# trust does not fall for it. Only the server's own sizing counts, never the tokens a
# completion claims: a claim one token short of the unit must not make a rejection free
# (that would be an attack). A salvaged Δ's claimed share already lowers the gain it must show.
WEAK_REASONS = frozenset({rules.NO_GAIN, rules.NORM_LOW})
HELD = (first_round.UNSETTLED, f"{rules.AGREED_NO_GAIN}:")  # refused, not the worker's fault


def weak_partial(verdict: Verdict) -> bool:
    return verdict.upload.sized < 1.0 and verdict.reason.split(":")[0] in WEAK_REASONS


def count(verdicts: Sequence[Verdict], counter: str) -> None:
    """Add each worker's contributions to its `counter` (docs/design.md §4: drops count against it)."""
    for worker_id, n in Counter(v.upload.worker_id for v in verdicts).items():
        Worker.objects.filter(pk=worker_id).update(**{counter: F(counter) + n})


def credit(unit_ids: set[int], whole_unit: int) -> None:
    """Credit each unit whose contributions are now all settled and all accepted: one
    unit, and its claimed tokens x its useful fraction (rounds.verification.rules.useful_fraction:
    its scored gain per token against the round's other accepted units'), to the worker
    that completed it, held while that worker is on probation (workers.trust.grant_credit);
    a unit that agreed with another worker's copy is probation's evidence (issues 19, 34:
    credit follows verified useful work, not claims).
    Inside the step's transaction; the unit rows are locked in pk order, so of two
    modules' steps settling one unit's last contributions concurrently, the second waits,
    then sees the first's, and exactly one of them credits it. `whole_unit`: a whole
    unit's tokens (dipaco.data.windows.unit_tokens).
    """
    if not unit_ids:
        return
    list(WorkUnit.objects.select_for_update().filter(pk__in=unit_ids).order_by("pk"))
    rows = Contribution.objects.filter(unit_id__in=unit_ids).values_list(
        "unit_id", "status", "tokens", "lease__worker_id", "lease_id", "unit__round_id",
        "agreed_with_id", "unit__replica",
    )  # fmt: skip
    by_unit: dict[int, list[tuple[Any, ...]]] = {}
    for unit_id, *row in rows:
        by_unit.setdefault(unit_id, []).append(tuple(row))
    scores = _round_scores({r[4] for rows_ in by_unit.values() for r in rows_}, whole_unit)
    for contributions in by_unit.values():
        if any(c[0] != Contribution.Status.ACCEPTED for c in contributions):
            continue  # a Δ still pending (another module's step credits it) or rejected
        tokens, worker_id = min(c[1] for c in contributions), contributions[0][2]
        lease_id, round_id = contributions[0][3], contributions[0][4]
        # Probation's evidence is the whole unit: every Δ of it accepted and agreeing with
        # the same worker's copy (one module agreeing while another is refused is none).
        partners = {c[5] for c in contributions}
        if len(partners) == 1 and None not in partners and worker_id not in partners:
            needed = replication.partners_needed_now(worker_id)
            trust.record_agreement(
                worker_id,
                partners.pop(),
                contributions[0][6] >= CHECK_OFFSET,
                needed,
                replication.judge_for(needed),
                replication.late(worker_id),
            )
        own = scores.get(round_id, {})
        peers = [scored for lease, scored in own.items() if lease != lease_id]
        score, work = own.get(lease_id, (None, min(1.0, tokens / whole_unit)))
        earned = round(tokens * rules.useful_fraction(score, work, peers))
        trust.grant_credit(worker_id, earned)


def _round_scores(
    round_ids: set[int], whole_unit: int
) -> dict[int, dict[int, tuple[rules.Score, float]]]:
    """Round -> lease -> (its unit's recorded score, its work) for every scored lease of
    those rounds none of whose Δs was refused (a refused unit is no reference)."""
    rows = Contribution.objects.filter(
        unit__round_id__in=round_ids, lease__score__isnull=False
    ).values_list("unit__round_id", "lease_id", "lease__score", "status", "tokens")
    out: dict[int, dict[int, tuple[rules.Score, float]]] = {}
    refused: set[int] = set()
    for round_id, lease_id, row, status, tokens in rows:
        if status == Contribution.Status.REJECTED:
            refused.add(lease_id)
            continue
        score = rules.Score.from_dict(row)
        if score is not None:
            work = min(1.0, tokens / whole_unit) if whole_unit > 0 else 1.0
            out.setdefault(round_id, {})[lease_id] = (score, work)
    for leases in out.values():
        for lease_id in refused & set(leases):
            del leases[lease_id]
    return out


def settle(
    verdicts: Sequence[Verdict], replicas: Sequence[tuple[int, str]], whole_unit: int
) -> None:
    """Counts, trust and credit for one step's verdicts (already saved on their rows), and
    each compared copy's difference sketch: its worker's evidence for later rounds."""
    for v in verdicts:
        if v.sketch is not None:
            Contribution.objects.filter(pk=v.upload.contribution_id).update(
                replica_sketch=v.sketch, replica_partner_id=v.partner
            )
        if v.accepted and v.agreed_with is not None:
            Contribution.objects.filter(pk=v.upload.contribution_id).update(
                agreed_with_id=v.agreed_with
            )
    accepted = [v for v in verdicts if v.accepted]
    rejected = [v for v in verdicts if not v.accepted]
    # Held out by an undecided first round (first_round.UNSETTLED), or agreeing copies
    # that both bought nothing (rules.AGREED_NO_GAIN): not its worker's fault, so neither
    # counted as rejected nor penalised.
    held = [v for v in rejected if v.reason.startswith(HELD)]
    count(accepted, "contributions_accepted")
    count([v for v in rejected if v not in held], "contributions_rejected")
    trust.penalise(v.upload.worker_id for v in rejected if not weak_partial(v) and v not in held)
    for worker_id, counter in replicas:  # compare_replicas: "replicas_(dis)agreed", "doubted"
        if counter == "doubted":
            trust.doubt(worker_id)
            continue
        Worker.objects.filter(pk=worker_id).update(**{counter: F(counter) + 1})
    trust.reward(v.upload.worker_id for v in accepted)
    # A copy that lost a comparison with another worker's: its worker starts probation
    # over (BOINC resets a host's count of valid results on an invalid one) and forfeits
    # the credit it held.
    trust.restart_probation(
        v.upload.worker_id for v in rejected if v.reason.startswith(f"{rules.REPLICA}:")
    )
    credit({v.upload.unit_id for v in verdicts}, whole_unit)
