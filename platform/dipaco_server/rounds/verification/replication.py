"""Sampled replication (BOINC's adaptive replication): some units trained twice.

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

Who trains a check copy (`preferred_check`, workers.probation.check_pool): a worker on
probation takes a queued check copy before an original when it gives it a partner it has
not had (or the check role it lacks), the operator's trusted machines always; an
established worker takes one only when its original is a newcomer's that it has not been
paired with (newcomers are checked by established workers where any exist), or, after
those, a newcomer's that waits only for a conclusive agreement (`awaits_judgement`); the copy is
drawn at random, avoiding the worker the asker was last paired with. A newcomer's
probation evidence (`evidence`) counts the pairings of open rounds too, so a round gives
it what it lacks and no more.

After probation (trust earned once must keep being earned): an established
worker is audited at a rate grown with its share of the round's units (`audit_rate`), never
more than ceil(AUDIT_SPREAD / rate) units apart (`audit_overdue`), so a sleeper is compared
within a bounded number of units of turning; a doubtful comparison (rules.AGREE_COSINE)
replicates both workers' units until one agrees with an undoubted third (workers.trust).
A newcomer on probation for PROBATION_ROUNDS rounds of work needs fewer partners (`late`)
and is given a copy for the check role it lacks (`copy_for_check_role`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db import connection
from django.db.models import Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from dipaco_server.rounds.models import CHECK_OFFSET as CHECK_OFFSET  # where it is read
from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.verification.audits import (  # re-exported: the schedule's parts
    AUDIT_SPREAD as AUDIT_SPREAD,
)
from dipaco_server.rounds.verification.audits import audit_overdue, audit_rate
from dipaco_server.workers import probation, trust
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)


def is_check(unit: WorkUnit) -> bool:
    return unit.replica >= CHECK_OFFSET


def partners_needed_now(worker_id: int) -> int:
    """The distinct partners that end the worker's probation: DIPACO_PROBATION_PARTNERS, but
    never more than the other workers that can be partners now (heard from within a lease
    timeout, not revoked, trusted enough to get work), and at least 1. Live, with one
    attacker among four workers, the three honest ones agreed with each other in both roles
    and could never find a third partner once the attacker was stopped: every unit of theirs
    stayed replicated and their credit held for the rest of the run (bench/attacks_live.py,
    seed 0). 0: probation is off."""
    needed = trust.partners_needed()
    if needed == 0:
        return 0
    return max(1, min(needed, can_get_work().exclude(pk=worker_id).count()))


# A newcomer that handed in work in this many rounds of its probation needs
# probation.LATE_PARTNERS distinct partners (a conclusive agreement where one is asked
# for, still; either role at full trust, both below: the hard end), not
# DIPACO_PROBATION_PARTNERS (`late`, workers.trust._save_standing): live, with six honest
# workers, one agreed with 2 of its 3 partners and never met a third in 8 rounds (every unit
# of it replicated, 61,918 tokens of its credit held at the end). Four newcomers
# meet all their partners in two rounds (tests/test_probation.py), so the rule changes
# nothing where the grid allows. Two partners still mean two workers that trained the same
# units to the same Δ within AGREE_COSINE (rules), and audits go on after probation
# (audit_rate, audit_overdue) with doubt (workers.trust.doubt) behind them.
PROBATION_ROUNDS = 2
_LOST = "replica_disagrees:"  # rounds.verification.rules.REPLICA (torch: not on the URL path)


def late(worker_id: int) -> bool:
    """Whether the worker has been on probation for PROBATION_ROUNDS rounds of work."""
    return rounds_on_probation(worker_id) >= PROBATION_ROUNDS


def rounds_on_probation(worker_id: int) -> int:
    """The rounds in which the worker, on probation, completed a unit since its last lost
    comparison (its probation started over then, workers.trust.restart_probation), or since
    it came; 0 for a worker not on probation."""
    if not Worker.objects.filter(pk=worker_id, probation=True).exists():
        return 0
    lost = (
        Contribution.objects.filter(
            lease__worker_id=worker_id,
            status=Contribution.Status.REJECTED,
            reason__startswith=_LOST,
        )
        .order_by("-unit__round_id")
        .values_list("unit__round_id", flat=True)
        .first()
    )
    done = Lease.objects.filter(worker_id=worker_id, state=Lease.State.COMPLETED)
    if lost is not None:
        done = done.filter(unit__round_id__gt=lost)
    return done.values("unit__round_id").distinct().count()


def can_get_work() -> QuerySet[Worker]:
    """Workers heard from within a lease timeout, not revoked, trusted enough to get work."""
    since = timezone.now() - timedelta(seconds=current_policy().lease_timeout_s)
    return Worker.objects.filter(
        last_seen__gte=since, revoked=False, trust__gte=trust.setting("DIPACO_MIN_TRUST")
    )


def active_newcomers() -> QuerySet[Worker]:
    """Workers on probation that can get work (`can_get_work`), not the operator's."""
    return can_get_work().filter(probation=True, operator_trusted=False)


def maybe_replicate(unit: WorkUnit, worker: Worker) -> WorkUnit | None:
    """Queue a check copy of `unit`, just granted to `worker`, if its standing says so: on
    probation while its evidence lacks partners or the original's role (or it lost trust),
    every unit while it is doubted (workers.trust.doubt), else at its audit rate
    (`audit_rate`) or when an audit is overdue (`audit_overdue`). A newcomer whose agreements suffice now
    (fewer workers to be partners than when it came: `partners_needed_now`) leaves
    probation here."""
    if is_check(unit):
        return None
    newcomer, needed = worker.probation and not worker.operator_trusted, 0
    if newcomer:
        needed = partners_needed_now(worker.pk)
        if _ends_probation(worker):
            worker.refresh_from_db()
            newcomer = False
    why = "probation" if worker.probation else "audit"
    if worker.doubted and not newcomer:
        why = "doubt"  # every unit until it agrees conclusively (workers.trust.doubt)
    elif newcomer and worker.trust >= 1.0:
        # partners and roles enough, but no agreement judged yet: another comparison
        unjudged = awaits_judgement(worker, needed)
        if not (probation.replicate_newcomer(evidence(worker), needed) or unjudged):
            return None
    elif newcomer:
        if not trust.should_replicate(worker):
            return None
    elif (rate := audit_rate(worker, unit)) > 0 and (
        _rng.random() < rate or audit_overdue(worker, unit, rate)
    ):
        pass  # an audit: drawn at its rate, or overdue
    elif not newcomer_lacks_a_check(unit.round_id):
        return None
    else:
        why = "a newcomer's check role"
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
        Worker.objects.filter(pk=worker.pk).update(audits=F("audits") + 1)
        logger.info(
            "unit %s of worker %s replicated as unit %s (%s)",
            unit.pk, worker.pk, copy.pk, why,
        )  # fmt: skip
    return copy if created else None


def newcomer_lacks_a_check(round_id: int) -> bool:
    """Whether an established worker's original, just granted in round `round_id`, should
    also be issued as a check copy for a lone newcomer to train: exactly one newcomer can
    get work (heard from within a lease timeout, not revoked, trusted enough, not the
    operator's), it still lacks the check copy's role, and no check copy it could take is
    queued in the round. Probation needs both roles, and an established worker's units are
    otherwise replicated only at DIPACO_REPLICATION_RATE (the operator's machines never):
    a lone newcomer among them got the check role only when an audit happened to queue a
    copy, and among the operator's machines alone never, its units replicated and its
    credit held all the while. Two newcomers or more take each other's copies
    (workers.probation.replicate_newcomer queues them), so nothing is added for them."""
    newcomers = list(active_newcomers()[:2])
    if len(newcomers) != 1:
        return False
    lone = newcomers[0]
    if not evidence(lone).lacks(partners_needed_now(lone.pk))[2]:
        return False
    queued = WorkUnit.objects.filter(
        round_id=round_id, state=WorkUnit.State.QUEUED, replica__gte=CHECK_OFFSET
    ).values_list("path_id", "data_position")[:CHECK_CANDIDATES]
    # its own original's copy is not one it may take (not_own_check)
    return all(_original_worker(round_id, path, at) == lone.pk for path, at in queued)


def awaits_judgement(worker: Worker, needed: int | None = None) -> bool:
    """Whether `worker`, on probation, has agreed with every partner it needs in both
    roles and waits only for a conclusive agreement (`judged_agreement`): its next
    comparison, with any partner, is what can end its probation or refuse it."""
    if not worker.probation or worker.operator_trusted:
        return False
    needed = partners_needed_now(worker.pk) if needed is None else needed
    return judge_for(needed) is not None and probation.leaves_probation(
        worker.partners or [], needed
    )


def judge_for(needed: int) -> Callable[[int], bool] | None:
    """`judged_agreement` where probation needs it: with `needed` partners above
    persistence.MIN_PARTNERS. With fewer workers to pair with, the repetition rule can never
    judge (it needs differences against two workers besides the current partner), and a
    newcomer on another device than its partners would never leave probation."""
    from dipaco_server.rounds.verification import persistence  # torch: not on the URL path

    return judged_agreement if needed > persistence.MIN_PARTNERS else None


def judged_agreement(worker_id: int) -> bool:
    """Whether one of the worker's agreements is conclusive: its copy and its partner's were
    the same bytes, or their difference was judged by the repetition rule with the evidence
    it needs (rounds.verification.persistence.enough: the worker's differences in the module
    from earlier rounds, against other workers than this partner). A newcomer leaves
    probation only then (workers.trust): before it, a quiet bias agrees with every partner.
    Live, a biased newcomer's two first comparisons were both against one worker, so the
    rule could not judge its next ones; it agreed with three partners in both roles, left
    probation with its credit, and was refused by the rule only in later audits
    (bench/attacks_live.py, seed 1: 95,464 of its 153,600 tokens credited)."""
    from dipaco_server.rounds.verification import persistence  # torch: not on the URL path

    agreed = Contribution.objects.filter(
        lease__worker_id=worker_id,
        status=Contribution.Status.ACCEPTED,
        agreed_with__isnull=False,
    ).values_list("pk", "module_id", "sha256", "replica_partner_id", "unit__round_id",
                  "unit__round__t", "unit__path_id", "unit__data_position")  # fmt: skip
    for pk, module_id, sha256, partner, round_id, t, path_id, position in agreed[:64]:
        same = Contribution.objects.filter(
            module_id=module_id,
            unit__round_id=round_id,
            unit__path_id=path_id,
            unit__data_position=position,
            sha256=sha256,
        ).exclude(pk=pk)
        if same.exists():
            return True
        earlier = (
            Contribution.objects.filter(
                module_id=module_id,
                lease__worker_id=worker_id,
                replica_sketch__isnull=False,
                unit__round__t__lt=t,
            )
            .exclude(replica_partner_id=partner)
            .order_by("-pk")
            .values_list("replica_partner_id", flat=True)[: persistence.PAST]
        )
        if persistence.enough([(other, None) for other in earlier]):  # the rule's own test
            return True
    return False


def replicated(unit: WorkUnit) -> bool:
    """Whether two workers train `unit`: a check copy, or an original with one. Both copies
    train from fresh AdamW moments (the lease's `cold`), so they differ only by what
    differs between two machines: an original continuing its worker's warm moments was
    measured 3.1-9.6 x the norm of an honest cold copy (bench/attacks_live.py), which no
    tolerance tells from a scaled Δ."""
    if is_check(unit):
        return True
    return WorkUnit.objects.filter(
        round_id=unit.round_id, path_id=unit.path_id, replica=CHECK_OFFSET + unit.replica
    ).exists()


def not_own_check(worker: Worker) -> Q:
    """Excludes the check copies of units `worker` holds or held (same round, path and
    windows), and the originals of check copies it holds or held (`copy_for_check_role`
    queues a copy before its original is granted): two workers, never one twice."""
    own = Lease.objects.filter(
        worker=worker,
        unit__round_id=OuterRef("round_id"),
        unit__path_id=OuterRef("path_id"),
        unit__data_position=OuterRef("data_position"),
    )
    own_copy = own.filter(unit__replica__gte=CHECK_OFFSET)
    return ~(Q(replica__gte=CHECK_OFFSET) & Q(Exists(own))) & ~(
        Q(replica__lt=CHECK_OFFSET) & Q(Exists(own_copy))
    )


# Queued check copies looked at per grant: a round queues at most one per original.
CHECK_CANDIDATES = 64
_rng = random.Random()


def preferred_check(worker: Worker, groups: list[dict[str, Any]]) -> WorkUnit | None:
    """A queued check copy `worker` should train before any original (module docstring),
    locked where the database can skip locked rows, or None. `groups`: the grantable
    (round, path) groups (rounds.protocol.pacing._open_groups)."""
    rounds = {g["round_id"] for g in groups if g["queued"] > 0}
    if not rounds:
        return None
    if worker.probation and not worker.operator_trusted and _ends_probation(worker):
        worker.refresh_from_db()  # its hard end (workers.trust): no copy made for a role
    if worker.probation and never_agreed(worker):
        return None  # an original instead, replicated: its copy of another's proves nothing
    made = copy_for_check_role(worker, rounds)
    if made is not None:
        return made
    queued = (
        WorkUnit.objects.filter(
            state=WorkUnit.State.QUEUED, round_id__in=rounds, replica__gte=CHECK_OFFSET
        )
        .filter(not_own_check(worker))
        .order_by("pk")
        .values_list("pk", "round_id", "path_id", "data_position")[:CHECK_CANDIDATES]
    )
    offered = [(pk, _original_worker(r, p, d)) for pk, r, p, d in queued]
    if not offered:
        return None
    standing = trust.standing(worker)
    on_probation = list(Worker.objects.filter(pk__in={w for _, w in offered}, probation=True))
    newcomers = {w.pk for w in on_probation}
    known = evidence(worker) if worker.probation else probation.Evidence.recorded(_agreed(worker))
    waiting = (
        worker.probation
        and WorkUnit.objects.filter(
            state=WorkUnit.State.QUEUED, round_id__in=rounds, replica__lt=CHECK_OFFSET
        ).exists()
    )
    needed = partners_needed_now(worker.pk)

    def unjudged() -> set[int]:  # asked by check_pool only where it is read: a query each
        return {w.pk for w in on_probation if awaits_judgement(w)}

    pool = probation.check_pool(offered, newcomers, standing, known, needed, waiting, unjudged)
    if not pool and trust.referee(worker):
        pool = trust.doubted_checks(offered)
    if not pool:
        return None
    partners = worker.partners if isinstance(worker.partners, list) else []
    last = int(partners[-1][0]) if partners and len(partners[-1]) == 2 else None
    chosen = probation.pick_check(pool, last, _rng)
    units = WorkUnit.objects.filter(pk=chosen, state=WorkUnit.State.QUEUED)
    if connection.features.has_select_for_update_skip_locked:
        units = units.select_for_update(skip_locked=True)
    return units.first()


def never_agreed(worker: Worker) -> bool:
    """Whether `worker`, on probation with no agreement recorded, has had copies compared
    with two distinct workers or more and agreed with none: it takes no check copy
    (`preferred_check`), since a comparison with it likely brings its partner nothing.
    Live, an attacker whose two round-0 comparisons had not agreed checked an honest
    newcomer's original in round 2; its copy was refused, the newcomer gained no partner,
    and it stayed on probation for four rounds (bench/attacks_live.py, scored_windows,
    seed 0). It still trains originals, each replicated while it is on probation."""
    if worker.operator_trusted or _agreed(worker):
        return False
    compared = Contribution.objects.filter(
        lease__worker=worker, replica_partner__isnull=False, agreed_with__isnull=True
    ).values_list("replica_partner_id", flat=True)[:CHECK_CANDIDATES]
    return len(set(compared)) >= 2


def _ends_probation(worker: Worker) -> bool:
    """End `worker`'s probation now if its recorded agreements suffice (`maybe_replicate`
    does the same for the unit it is granted); whether it ended."""
    needed = partners_needed_now(worker.pk)
    return trust.end_probation_if_due(worker.pk, needed, judge_for(needed), late(worker.pk))


def copy_for_check_role(worker: Worker, rounds: set[int]) -> WorkUnit | None:
    """For a newcomer `late` on probation (PROBATION_ROUNDS rounds of work) that still
    lacks the check copy's role and finds no check copy it may take queued: a check copy
    of a queued original of those rounds, made now and locked for it, else None. The
    original is not granted yet, so both copies train cold (`replicated`), and it never
    goes to this worker (`not_own_check`). Live, with six honest workers, one that had
    agreed twice as the original asked first each round, took an original, and the copies
    queued for it later went to others; it stayed on probation for the whole run, its
    credit held."""
    if not worker.probation or worker.operator_trusted or not late(worker.pk):
        return None
    if not evidence(worker).lacks(partners_needed_now(worker.pk))[2]:
        return None
    queued = WorkUnit.objects.filter(state=WorkUnit.State.QUEUED, round_id__in=rounds)
    if queued.filter(replica__gte=CHECK_OFFSET).filter(not_own_check(worker)).exists():
        return None  # one it may take is queued (check_pool hands it over)
    original = (
        queued.filter(replica__lt=CHECK_OFFSET, round__state=Round.State.OPEN)
        .filter(not_own_check(worker))
        .exclude(
            Exists(
                WorkUnit.objects.filter(
                    round_id=OuterRef("round_id"),
                    path_id=OuterRef("path_id"),
                    replica=CHECK_OFFSET + OuterRef("replica"),
                )
            )
        )
        .order_by("round_id", "pk")
        .first()
    )
    if original is None:
        return None
    copy, created = WorkUnit.objects.get_or_create(
        round_id=original.round_id,
        path_id=original.path_id,
        replica=CHECK_OFFSET + original.replica,
        defaults={
            "data_position": original.data_position,
            "data_windows": original.data_windows,
            "base_versions": original.base_versions,
        },
    )
    if not created:
        return None
    logger.info(
        "unit %s replicated as unit %s for worker %s's check role (late on probation)",
        original.pk, copy.pk, worker.pk,
    )  # fmt: skip
    units = WorkUnit.objects.filter(pk=copy.pk, state=WorkUnit.State.QUEUED)
    if connection.features.has_select_for_update_skip_locked:
        units = units.select_for_update(skip_locked=True)
    return units.first()


def repeats_partner(worker: Worker, unit: WorkUnit) -> bool:
    """Whether `unit` is a check copy that would pair `worker` with the original's worker
    while either is on probation and bring neither of them anything: a partner it has not
    had, or a role it lacks (probation counts distinct partners in both roles, and the
    repetition rule, rounds.verification.persistence, ignores a partner's own
    differences). A copy of an operator's machine's unit, never audited, exists only for a
    newcomer's check role (`newcomer_lacks_a_check`): it brings nothing to anyone else.
    Left for another worker, or dropped when the round closes: two newcomers
    that had checked each other in round 0 did so again in round 1, and a biased one met no
    third partner in time (bench/attacks_live.py, seed 0). A pair that compared before,
    bringing a role only, is left likewise while another newcomer would be a new partner
    to the original's worker (below)."""
    if not is_check(unit):
        return False
    original = _original_worker(unit.round_id, unit.path_id, unit.data_position)
    if not original:
        return False
    other = Worker.objects.filter(pk=original).first()
    if other is not None and other.operator_trusted and not worker.probation:
        return True  # the operator's unit is copied only for a newcomer's check role
    if other is None or not (worker.probation or other.probation):
        return False  # an audit between established workers

    if not worker.probation and awaits_judgement(other):
        return False  # a comparison the repetition rule can judge (probation.check_pool)
    mine, theirs = evidence(worker), evidence(other)  # each read once: several queries

    def brings(side: Worker, known: probation.Evidence, partner: int, as_check: bool) -> bool:
        roles = {role for _, role in known.pairs}
        return side.probation and (partner not in known.partners() or as_check not in roles)

    if not (brings(worker, mine, original, True) or brings(other, theirs, worker.pk, False)):
        return True
    if (
        worker.probation
        and other.probation
        and probation.waits_for_its_check(mine, partners_needed_now(worker.pk))
    ):
        return True  # the other newcomer can check its queued copy instead
    # A pair compared before brings roles only, no partner: it is left for a newcomer that
    # would be a new partner to the original's worker and still lacks something itself,
    # which gets both. Live-like, round 1 of four newcomers: one whose pairings sufficed
    # took such a copy while the one lacking the check role and that partner trained its
    # original; one comparison was spent on a role and a third round needed
    # (tests/test_probation_order.py). Live, one lacking the check role took its earlier
    # partner's copy for it, while a third newcomer new to that partner still lacked one
    # (seven copies, bench/attacks_live.py seed 0).
    paired = theirs.partners()
    again = worker.pk in paired or original in mine.partners()
    return again and _a_newcomer_would_pair(worker, other, paired)


def _a_newcomer_would_pair(worker: Worker, other: Worker, paired: set[int]) -> bool:
    """Whether a newcomer besides `worker` and `other` that can get work
    (`active_newcomers`) is not among `paired` (`other`'s partners) and still lacks
    partners or the check copy's role."""
    candidates = (
        active_newcomers().exclude(pk__in=[worker.pk, other.pk, *paired]).order_by("pk")[:8]
    )
    for candidate in candidates:
        more, _, check = evidence(candidate).lacks(partners_needed_now(candidate.pk))
        if more or check:
            return True
    return False


def _agreed(worker: Worker) -> list[list[int]]:
    return [p for p in (worker.partners or []) if isinstance(p, list | tuple) and len(p) == 2]


_LIVE = (Lease.State.ACTIVE, Lease.State.COMPLETED)


def evidence(worker: Worker) -> probation.Evidence:
    """`worker`'s probation evidence: its recorded agreements, and its pairings in rounds
    not closed or not settled yet (a check copy it trains or trained against the original's worker; an
    original of its against whoever trains its check copy, or queued)."""
    pairs = set(probation.Evidence.recorded(_agreed(worker)).pairs)
    # A closed round whose step has not settled the lease's Δs yet counts too: under
    # outer.overlap the next round opens first, and its grants must not replicate again
    # what the last round's pairings already bring (live: every unit of round 1 was).
    unsettled = Exists(
        Contribution.objects.filter(lease=OuterRef("pk"), status=Contribution.Status.PENDING)
    )
    live = Lease.objects.filter(worker=worker, state__in=_LIVE).filter(
        ~Q(unit__round__state=Round.State.CLOSED) | Q(unsettled)
    )
    where = ("unit__round_id", "unit__path_id", "unit__data_position", "unit__replica")
    queued = 0
    for round_id, path_id, position, replica in live.values_list(*where):
        if replica >= CHECK_OFFSET:
            original = _original_worker(round_id, path_id, position)
            if original:
                pairs.add((original, True))
            continue
        copy = WorkUnit.objects.filter(
            round_id=round_id, path_id=path_id, replica=CHECK_OFFSET + replica
        ).first()
        if copy is None:
            continue
        checker = (
            Lease.objects.filter(unit=copy, state__in=_LIVE)
            .values_list("worker_id", flat=True)
            .first()
        )
        if checker:
            pairs.add((int(checker), False))
        elif copy.state == WorkUnit.State.QUEUED:
            queued += 1
    return probation.Evidence(frozenset(pairs), queued)


def _original_worker(round_id: int, path_id: int, data_position: int) -> int:
    """The worker holding (or last holding) the original of a check copy; 0 when none."""
    lease = (
        Lease.objects.filter(
            unit__round_id=round_id,
            unit__path_id=path_id,
            unit__data_position=data_position,
            unit__replica__lt=CHECK_OFFSET,
        )
        .order_by("-pk")
        .values_list("worker_id", flat=True)
        .first()
    )
    return int(lease or 0)
