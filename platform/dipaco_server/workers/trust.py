"""How far the server trusts a worker's work, and what follows from it.

Trust is a score, 0..1: each contribution the outer step rejects multiplies it by
DIPACO_TRUST_PENALTY, each replica disagreement by the same, and each accepted one adds
DIPACO_TRUST_REWARD (capped at 1). Trust alone is not earned evidence, though: a worker
registered through an enrollment token starts on probation (workers.probation) and is
replicated in both roles until its copies agreed with several distinct workers'. What each
setting means now:

- DIPACO_REPLICATION_RATE: the audit rate, the share of an established worker's units
  also issued as a check copy while its trust is 1; it rises linearly as trust falls...
- DIPACO_TRUST_REPLICATE_ALL: ...to every unit at this trust and below;
- DIPACO_MIN_TRUST: below it the worker gets no more work (403 worker_distrusted) until
  staff reset its trust;
- DIPACO_TRUST_PENALTY / DIPACO_TRUST_REWARD: as above; one refusal (0.7) raises a
  trusted worker's audit rate from 0.05 to 0.62 with the defaults;
- DIPACO_PROBATION_PARTNERS: distinct partners a newcomer's copies must agree with
  (default workers.probation.PARTNERS; 0: no probation, every new worker established);
- DIPACO_COLD_SHARE: the share of the units no copy is compared with that also train from
  fresh AdamW moments (rounds.protocol.grant.trains_cold). A replicated unit's
  lease says `cold: true`, so at 0 (the default) `cold` tells a worker which of its units
  are audited, and one that knows the rules attacks only the others; at 1 every lease is
  cold and says nothing. Cold units cost quality (the path's warm moments are dropped).

With the defaults, one unit of three rejected Δs (0.7³ = 0.34) moves a worker to full
replication, a second one stops it; a single honest Δ refused now and then is recovered
by the next few accepted ones.

Credit (`grant_credit`) is granted on validation, as BOINC grants it: held on probation,
while doubted, and, with audits on, from one agreeing audit of an established worker to
the next (or to the end of the run), so a copy that loses a comparison forfeits every unit
since the worker's last vouched agreement.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F, Q, Value
from django.db.models.functions import Least

from dipaco_server.workers import probation
from dipaco_server.workers.errors import WorkerDistrusted
from dipaco_server.workers.models import Worker

DEFAULTS: dict[str, float] = {
    # Share of a trusted worker's units also issued to a second worker and compared: 0.05
    # keeps check copies at <= 0.10 of the work once probation is over, and a run's total
    # at <= 0.20 with four newcomers over 8 rounds (six probation copies, docs/reliability.md).
    "DIPACO_REPLICATION_RATE": 0.05,
    # Below this trust every unit the worker takes is replicated.
    "DIPACO_TRUST_REPLICATE_ALL": 0.5,
    # Below this trust the worker gets no more leases.
    "DIPACO_MIN_TRUST": 0.3,
    # Trust is multiplied by this per rejected contribution or replica disagreement...
    "DIPACO_TRUST_PENALTY": 0.7,
    # ...and raised by this per accepted contribution, up to 1.
    "DIPACO_TRUST_REWARD": 0.02,
    # Share of the unreplicated units that train cold too, so `cold` hides the audits.
    "DIPACO_COLD_SHARE": 0.0,
}


def setting(name: str) -> float:
    """A Django setting of that name, else the environment variable, else the default."""
    value: object = getattr(settings, name, None)
    if value is None:
        raw = os.environ.get(name)
        try:
            value = DEFAULTS[name] if raw is None else float(raw)
        except ValueError:
            value = raw
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ImproperlyConfigured(
            f"{name}={value!r}: must be a number in [0, 1]; e.g. {DEFAULTS[name]}"
        )
    return float(value)


def check_trusted(worker: Worker) -> None:
    """Refuse work to a worker whose trust fell below DIPACO_MIN_TRUST."""
    minimum = setting("DIPACO_MIN_TRUST")
    if worker.trust < minimum:
        raise WorkerDistrusted(
            f"worker {worker.pk}'s work failed verification too often (trust "
            f"{worker.trust:.2f} < {minimum:g}); it gets no more work. See its rejected "
            "contributions (GET /api/v1/worker/contributions) and ask an operator to reset it",
            trust=worker.trust,
            minimum=minimum,
        )


def partners_needed() -> int:
    """DIPACO_PROBATION_PARTNERS: distinct partners that end a probation (0..64; 0: new
    workers start established, as before probation existed)."""
    value: object = getattr(settings, "DIPACO_PROBATION_PARTNERS", None)
    if value is None:
        raw = os.environ.get("DIPACO_PROBATION_PARTNERS")
        value = probation.PARTNERS if raw is None else raw
    try:
        number = int(str(value))
    except ValueError:
        number = -1
    if isinstance(value, bool) or not 0 <= number <= 64:
        raise ImproperlyConfigured(
            f"DIPACO_PROBATION_PARTNERS={value!r}: must be an integer in [0, 64]; e.g. "
            f"{probation.PARTNERS}"
        )
    return number


def standing(worker: Worker) -> probation.Standing:
    return probation.Standing(worker.trust, worker.probation, worker.operator_trusted)


def replication_rate(worker: Worker) -> float:
    """The share of `worker`'s units that a second worker also trains (workers.probation)."""
    return probation.replication_rate(
        standing(worker),
        setting("DIPACO_REPLICATION_RATE"),
        setting("DIPACO_TRUST_REPLICATE_ALL"),
    )


def should_replicate(worker: Worker, rng: random.Random | None = None) -> bool:
    rate = replication_rate(worker)
    return rate >= 1.0 or (rng or random).random() < rate


def record_agreement(
    worker_id: int,
    partner_id: int,
    as_check: bool,
    needed: int | None = None,
    judged: Callable[[int], bool] | None = None,
    late: bool = False,
) -> None:
    """A replica pair of `worker_id` agreed with `partner_id`'s copy: keep it as evidence,
    and end the worker's probation once the evidence suffices (workers.probation; `needed`
    partners, default `partners_needed`, or probation.LATE_PARTNERS when `late`: on
    probation for rounds.verification.replication.PROBATION_ROUNDS rounds of work;
    `judged`: whether the repetition rule has judged one of the worker's agreements,
    rounds.verification.replication.judged_agreement). An agreement with an established
    partner that is not doubted itself also ends a doubt (`doubt`), granting the credit
    held since."""
    row = Worker.objects.select_for_update().filter(pk=worker_id).first()
    if row is None:
        return
    row.partners = probation.agreed(row.partners, partner_id, as_check)
    needed = partners_needed() if needed is None else needed
    # Only an established partner that is not doubted itself vouches for a doubted worker:
    # two workers doubted together (a biased one and its honest partner, or two colluders)
    # prove nothing to each other.
    vouches = Worker.objects.filter(pk=partner_id, probation=False, doubted=False).exists()
    _save_standing(row, ["partners"], needed, judged, agreed=vouches, late=late)


def end_probation_if_due(
    worker_id: int, needed: int, judged: Callable[[int], bool] | None = None, late: bool = False
) -> bool:
    """End the worker's probation if its recorded agreements suffice for `needed` partners
    (fewer workers to be partners than when it came), or for probation.LATE_PARTNERS when
    `late` (`record_agreement`); whether it ended."""
    row = Worker.objects.select_for_update().filter(pk=worker_id, probation=True).first()
    if row is None:
        return False
    _save_standing(row, [], needed, judged, late=late)
    return not row.probation


def _save_standing(
    row: Worker,
    fields: list[str],
    needed: int,
    judged: Callable[[int], bool] | None = None,
    agreed: bool = False,
    late: bool = False,
) -> None:
    if agreed and not row.probation and (row.doubted or row.held_units or row.held_tokens):
        # an agreement vouched for (record_agreement) ends a doubt, and grants the credit
        # held since the worker's last one (`grant_credit`)
        row.doubted = False
        row.units_completed += row.held_units
        row.tokens_processed += row.held_tokens
        row.held_units = row.held_tokens = 0
        fields += ["doubted", "units_completed", "tokens_processed", "held_units", "held_tokens"]
    # Probation's hard end: PROBATION_ROUNDS rounds of work (`late`) at full trust (no Δ
    # refused since it came or since its trust was earned back) need LATE_PARTNERS partners
    # in either role. Live, an honest newcomer's original was checked by an attacker whose
    # copy the checks refused: it had two partners as the check copy, a round without a
    # copy followed (the pairing counted as if it would agree), and it stayed on probation
    # for four rounds (bench/attacks_live.py, scored_windows, seed 1).
    hard_end = late and row.trust >= 1.0
    if late:
        needed = min(needed, probation.LATE_PARTNERS)
    leaves = row.probation and probation.leaves_probation(
        row.partners, needed, both_roles=not hard_end
    )
    if leaves and (judged is None or judged(row.pk)):
        row.probation = False
        row.units_completed += row.held_units  # the credit it held is granted now
        row.tokens_processed += row.held_tokens
        row.held_units = row.held_tokens = 0
        fields += ["probation", "units_completed", "tokens_processed", "held_units", "held_tokens"]
    row.save(update_fields=fields)


def pending_credit() -> bool:
    """Whether an established worker's credit waits for its next audit that agrees
    (`grant_credit`): with probation and audits on (DIPACO_PROBATION_PARTNERS and
    DIPACO_REPLICATION_RATE above 0); else nothing could ever grant it."""
    return partners_needed() > 0 and setting("DIPACO_REPLICATION_RATE") > 0


def grant_credit(worker_id: int, tokens: int) -> None:
    """Credit one accepted unit of `tokens` tokens. Held while the worker is on probation or
    doubted, and, where audits are on (`pending_credit`), until its next copy that agrees
    with an established, undoubted worker's (`record_agreement`): granted then, when it
    leaves probation, or when a run it worked on finishes (`release_held`); forfeited if
    one of its copies loses a comparison first. The operator's machines are credited at
    once.

    Why an established worker's credit waits too (BOINC grants credit on validation): a
    worker that turns hostile after probation (a sleeper) was credited every unit it
    handed in between turning and its first audit, 28% of what it claimed after turning
    over three seeds of bench/attacks_live.py. Held until an audit agrees, the units
    since its last agreeing audit are forfeited with the comparison it loses."""
    held = Q(probation=True) | Q(doubted=True)
    if pending_credit():
        held |= Q(operator_trusted=False)
    pending = Worker.objects.filter(pk=worker_id).filter(held)
    if pending.update(held_units=F("held_units") + 1, held_tokens=F("held_tokens") + tokens):
        return
    Worker.objects.filter(pk=worker_id).update(
        units_completed=F("units_completed") + 1,
        tokens_processed=F("tokens_processed") + tokens,
    )


def release_held(worker_ids: Iterable[int]) -> int:
    """A run these workers worked on finished: no later audit of it can check their units,
    so the credit held pending one (`grant_credit`) is granted to each that is established
    and not doubted (a worker's held credit is one count, whatever the run). How many
    workers it granted credit to."""
    return Worker.objects.filter(
        pk__in=set(worker_ids), probation=False, doubted=False, held_units__gt=0
    ).update(
        units_completed=F("units_completed") + F("held_units"),
        tokens_processed=F("tokens_processed") + F("held_tokens"),
        held_units=0,
        held_tokens=0,
    )


def restart_probation(worker_ids: Iterable[int]) -> None:
    """Workers one of whose copies lost a comparison with another worker's: on probation
    again with no agreements and no held credit, so that only agreement with several
    partners after it earns trust back (the operator's machines excepted; with
    DIPACO_PROBATION_PARTNERS = 0 there is no probation)."""
    ids = set(worker_ids)
    if not ids or partners_needed() == 0:
        return
    Worker.objects.filter(pk__in=ids, operator_trusted=False).update(
        probation=True, partners=[], held_units=0, held_tokens=0, doubted=False
    )


def doubt(worker_id: int) -> None:
    """One of the worker's copies was close to another worker's without confirming it
    (rounds.verification.rules.AGREE_COSINE): nothing tells which of the two added the
    difference, so neither is refused, and both are checked again. An established worker
    is *doubted*: every unit it takes is replicated (rounds.verification.replication) and
    its credit held from now on, until a copy of its agrees conclusively with another
    worker's (`record_agreement`: the credit is granted) or loses a comparison
    (`restart_probation`: forfeited, on probation again). A worker on probation is
    replicated and holds its credit already; the operator's machines are not doubted.

    Why doubt and not a refusal: an honest worker paired with a biased one sees the same
    difference, mirrored; its next comparison, with a third worker, clears it, while the
    biased worker's copies keep differing, in the same direction, until the repetition
    rule (rounds.verification.persistence) refuses one. So an honest worker is never
    refused on a doubt alone, and a sleeper's credit from its first audit after it turned
    is held until it is forfeited."""
    Worker.objects.filter(pk=worker_id, probation=False, operator_trusted=False).update(
        doubted=True
    )


def penalise(worker_ids: Iterable[int], times: int = 1) -> None:
    """Multiply each worker's trust by DIPACO_TRUST_PENALTY per listed occurrence."""
    factor = setting("DIPACO_TRUST_PENALTY")
    counts: dict[int, int] = {}
    for worker_id in worker_ids:
        counts[worker_id] = counts.get(worker_id, 0) + times
    for worker_id, n in counts.items():
        Worker.objects.filter(pk=worker_id).update(trust=F("trust") * factor**n)


def reward(worker_ids: Iterable[int]) -> None:
    """Add DIPACO_TRUST_REWARD per listed occurrence, up to 1."""
    step = setting("DIPACO_TRUST_REWARD")
    counts: dict[int, int] = {}
    for worker_id in worker_ids:
        counts[worker_id] = counts.get(worker_id, 0) + 1
    for worker_id, n in counts.items():
        Worker.objects.filter(pk=worker_id).update(
            trust=Least(F("trust") + Value(step * n), Value(1.0))
        )


def referee(worker: Worker) -> bool:
    """Whether `worker` may settle a doubt (`doubt`): established, not doubted."""
    return not worker.probation and not worker.doubted


def doubted_checks(offered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The queued check copies ((unit, its original's worker)) of doubted workers' units, which
    a `referee` takes before its own originals
    (rounds.verification.replication.preferred_check). Left to the queue's order, a doubted pair's
    copies went to whichever worker had no original left, often the other worker of the
    pair: the sleeper and its honest partner trained each other's copies, every comparison
    doubtful again, and the honest one stayed doubted (every unit replicated, its credit
    held) to the end of the run (bench/attacks_live.py, six workers). A third worker's copy
    ends an honest worker's doubt in one comparison (`record_agreement`) and
    gives the repetition rule a difference of the biased one against another partner."""
    owners = {w for _, w in offered}
    doubted = set(Worker.objects.filter(pk__in=owners, doubted=True).values_list("pk", flat=True))
    return [c for c in offered if c[1] in doubted]
