"""Trust is earned: probation, audits and the replication schedule, as pure rules.

BOINC's adaptive replication (Anderson, "BOINC: a platform for volunteer computing", 2019,
§5.2): a host's results are replicated until enough of them validated, then only at random.
Here:

- **probation**: a worker registered through an enrollment token starts on it. Its units
  are also issued as check copies (its copy the original) while what it has, agreed or being
  compared in an open round (`Evidence`), still lacks partners or the original's role
  (`replicate_newcomer`); it takes a queued check copy before an original (its copy the
  check) when that copy's original is a partner it has not had yet, or when it still lacks
  the check copy's role (`check_pool`; then not another newcomer's it was paired with
  while an original waits): compared in both roles, with a new partner each time, so that
  it leaves probation as soon as the grid allows (four newcomers, three partners each: six
  comparisons, the edges of the complete graph, in two rounds) and no copy is trained that
  adds nothing. Checks of its units go to established workers first,
  else to other new ones.
- **leaving probation** (`leaves_probation`): its copies agreed with those of `PARTNERS`
  distinct workers (never more than there are others to agree with:
  rounds.verification.replication.partners_needed_now), at least once in each role, each
  agreement a whole unit whose every Δ was accepted, and one of them conclusive where three
  partners or more are needed (rounds.verification.replication.judged_agreement: the same
  bytes as its partner's, or a difference the repetition rule judged with its evidence).
  Passing one-Δ checks earns nothing: a fixed-direction bias passes them all
  (rounds.verification.persistence), and one partner could be a colluder, so agreement
  must come from several.
- **credit waits for trust** (workers.trust.grant_credit): a newcomer's accepted units are
  credited when it leaves probation; a copy of its that loses a comparison forfeits them
  and starts its probation over (workers.trust.restart_probation).
- **audits** (`replication_rate`): an established worker's units are replicated at
  DIPACO_REPLICATION_RATE while its trust is 1; each refusal multiplies trust by
  DIPACO_TRUST_PENALTY and the rate rises with the lost trust, linearly up to every unit
  at DIPACO_TRUST_REPLICATE_ALL (accepted work earns it back by DIPACO_TRUST_REWARD each);
  below DIPACO_MIN_TRUST it gets no work at all.
- **the operator's machines**: a worker registered with an enrollment token marked
  trusted is never on probation, never audited, and its copies referee a module's first
  step, where nothing else is known yet (rounds.verification.first_round).
- **partners vary** (`check_pool`, `pick_check`): a newcomer's check copy goes to a worker
  it has not been paired with (an established one takes a newcomer's check only then, and
  before its own work); among those, one is drawn at random, not from the worker last
  paired with while another is queued.

No Django here: bench/attacks.py and bench/attacks_live.py run the same rules.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# Distinct partners whose copies must have agreed with a worker's before it leaves
# probation: with two, one colluding partner plus one honest would do; three needs a
# majority of honest ones among any four workers (the bench's two-colluders setting).
PARTNERS = 3
# ...or this many, in either role, once it has been on probation for a few rounds of work
# (rounds.verification.replication.PROBATION_ROUNDS) without losing trust: partners can be
# scarce, and a comparison spent on an attacker that checks refuse brings nothing (the hard
# end, workers.trust._save_standing).
LATE_PARTNERS = 2
KEEP_PARTNERS = 16  # agreements kept per worker (Worker.partners), newest last


@dataclass(frozen=True)
class Standing:
    """What the schedule knows of a worker."""

    trust: float = 1.0
    probation: bool = False
    operator_trusted: bool = False


def replication_rate(standing: Standing, rate: float, replicate_all: float) -> float:
    """The share of the worker's units also issued as a check copy: 0 for the operator's
    machines, 1 on probation or at trust <= `replicate_all`, `rate` at trust 1, and in
    between a straight line (a refusal raises it at once; accepted work lowers it again)."""
    if standing.operator_trusted:
        return 0.0
    if standing.probation or standing.trust <= replicate_all:
        return 1.0
    lost = (1.0 - standing.trust) / max(1.0 - replicate_all, 1e-9)
    return min(1.0, rate + (1.0 - rate) * max(lost, 0.0))


def should_replicate(standing: Standing, rate: float, replicate_all: float, draw: float) -> bool:
    """`draw`: a uniform number in [0, 1) (random.random())."""
    share = replication_rate(standing, rate, replicate_all)
    return share >= 1.0 or draw < share


def agreed(partners: Sequence[Sequence[int]], partner: int, as_check: bool) -> list[list[int]]:
    """`partners` (Worker.partners) with this agreement moved to the end (once per partner
    and role), the oldest dropped beyond KEEP_PARTNERS."""
    entry = [int(partner), int(as_check)]
    kept = [list(p) for p in partners if isinstance(p, list | tuple) and len(p) == 2]
    kept = [p for p in kept if p != entry]  # each module of a unit reports the same pair
    kept.append(entry)
    return kept[-KEEP_PARTNERS:]


def leaves_probation(
    partners: Sequence[Sequence[int]], needed: int = PARTNERS, both_roles: bool = True
) -> bool:
    """Whether these agreements (Worker.partners) end a probation: `needed` distinct
    partners, and at least one agreement as the original and one as the check copy
    (`both_roles`; probation's hard end, workers.trust._save_standing, asks either role)."""
    pairs = [(int(p[0]), bool(p[1])) for p in partners if len(p) == 2]
    roles = {as_check for _, as_check in pairs}
    enough_roles = roles == {False, True} if both_roles else bool(roles)
    return len({worker for worker, _ in pairs}) >= needed and enough_roles


def probation_progress(partners: Sequence[Sequence[int]]) -> tuple[int, bool, bool]:
    """(distinct partners agreed with, agreed as original, agreed as check copy)."""
    pairs = [(int(p[0]), bool(p[1])) for p in partners if len(p) == 2]
    roles = {as_check for _, as_check in pairs}
    return len({w for w, _ in pairs}), False in roles, True in roles


@dataclass(frozen=True)
class Evidence:
    """A worker's probation so far: (partner, whether it was the check copy) for each
    agreement recorded (Worker.partners) and each pairing of an open round still being
    trained or compared (counted as if it will agree: one that does not leaves the worker
    short, and the next round replicates again); `queued`: its originals whose check copy
    no worker has taken yet (each will bring a partner and the original's role)."""

    pairs: frozenset[tuple[int, bool]] = frozenset()
    queued: int = 0

    @classmethod
    def recorded(cls, partners: Sequence[Sequence[int]]) -> Evidence:
        return cls(frozenset((int(p[0]), bool(p[1])) for p in partners if len(p) == 2))

    def partners(self) -> set[int]:
        return {worker for worker, _ in self.pairs}

    def lacks(self, needed: int) -> tuple[bool, bool, bool]:
        """(more partners, the original's role, the check copy's role) still needed."""
        roles = {as_check for _, as_check in self.pairs}
        return (
            len(self.partners()) + self.queued < needed,
            False not in roles and self.queued == 0,
            True not in roles,
        )


def replicate_newcomer(evidence: Evidence, needed: int) -> bool:
    """Whether a newcomer's original, just granted, is also issued as a check copy: while
    it lacks the original's role, or more partners than the check copy it still has to
    train will bring (a copy beyond that costs a unit of work and proves nothing new)."""
    _, original, check = evidence.lacks(needed)
    missing = needed - len(evidence.partners()) - evidence.queued
    return original or missing > (1 if check else 0)


def check_pool(
    offered: Sequence[tuple[int, int]],
    newcomers: set[int],
    standing: Standing,
    evidence: Evidence,
    needed: int,
    originals_waiting: bool = False,
    unjudged: Callable[[], Collection[int]] = frozenset,
) -> list[tuple[int, int]]:
    """The queued check copies ((unit, its original's worker)) a worker asking for work takes
    one of before any original; [] for none. A newcomer that still lacks partners or the
    check role: those whose original's worker is a new partner (an established one's first),
    or any while it lacks the role, except, while it lacks partners too, another newcomer's
    it has been paired with while an original is waiting (`originals_waiting`); the
    operator's machines (referees): newcomers' first, else any; anyone else (established, or
    a newcomer whose pairings in flight suffice): a newcomer's whose partner it has not
    been.

    Why the exception: a copy that pairs two newcomers again brings one of them a role and
    neither a partner, so one more copy is needed later for the partner. Live, round 0 of
    four newcomers: one checked a second, then the second, back from its own check copy and
    given its original, had that original's copy taken by the first as the only copy queued:
    the complete graph's six comparisons took seven copies (bench/attacks_live.py, seed 0).
    Taking the waiting original instead leaves the copy to a newcomer it would pair for the
    first time, and the role comes from the copies still to be queued (or from this one,
    once no original is left). Only while it lacks partners: with all it needs (two workers:
    one), the role is all a copy can bring, and declining it left two newcomers on probation
    for seven rounds, each copy dropped as the round closed. Likewise a newcomer that has
    the check role and lacks the original's takes a waiting original first: live, in round
    1, one such took a copy that brought it a partner only, its next original was replicated
    again for the role, and that copy paired it with a partner it had (seven copies, seed
    2).

    `unjudged()`: newcomers among the originals' workers that have every partner and role
    and still wait for a conclusive agreement (rounds.verification.replication
    .awaits_judgement, a query each: asked only when no newcomer's copy is a new
    partner). An established worker takes their copies too, after any that
    would be a new partner: a comparison with a partner had before is one the
    repetition rule can judge. Live, a biased newcomer had its three partners in both
    roles by round 1, none conclusive; every established worker had been paired with
    it, so none took its copies, each was dropped as its round closed, and it stayed on
    probation to the end with its Δs aggregated and no refusal (bench/attacks_live.py,
    seed 2: 30 accepted, loss 1.019 of clean)."""
    new = [c for c in offered if c[1] not in evidence.partners()]
    if standing.operator_trusted:
        return [c for c in offered if c[1] in newcomers] or list(offered)
    more, original, check = evidence.lacks(needed)
    if standing.probation and original and not check and originals_waiting:
        return []  # an original first: its copy brings a partner and the role it lacks
    if standing.probation and (more or check):
        again = [c for c in offered if not (more and originals_waiting and c[1] in newcomers)]
        pool = new or (again if check else [])
        return [c for c in pool if c[1] not in newcomers] or pool
    if standing.probation and waits_for_its_check(evidence, needed):
        return []
    newcomers_new = [c for c in new if c[1] in newcomers]
    if standing.probation:
        return newcomers_new
    return newcomers_new or [c for c in offered if c[1] in unjudged()]


def waits_for_its_check(evidence: Evidence, needed: int) -> bool:
    """Whether a newcomer whose pairings suffice only counting its copies still queued
    (never compared as the original otherwise) should take no other newcomer's copy for a
    partner: that newcomer can check its queued copy instead, which brings the partner and
    the original's role at once. Live, round 1: one such took a new partner's copy, that
    partner then had no reason to check its own, and the copy went to a worker it had
    compared with (seven copies, bench/attacks_live.py seed 0)."""
    more, _, check = evidence.lacks(needed)
    compared = {as_check for _, as_check in evidence.pairs}
    return not (more or check) and evidence.queued > 0 and False not in compared


def pick_check(
    candidates: Sequence[tuple[int, int]], last_partner: int | None, rng: random.Random
) -> int | None:
    """One of `candidates` ((unit id, its original's worker)) at random, avoiding the
    worker `last_partner` while another is offered: a partner is never always the same."""
    if not candidates:
        return None
    others = [c for c in candidates if c[1] != last_partner]
    return rng.choice(others or list(candidates))[0]
