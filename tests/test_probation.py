"""Trust is earned: probation, audits and the operator's trusted machines (workers.probation).

The rules as pure functions first; then on the real services (PostgreSQL, the blob store,
the lease and completion services and the outer step with its scorer on real shards), as
tests/test_replica_bias.py runs them: real honest Δs (dipaco.inner.train_path), each
worker's copy differing from another's by what differs between two machines (noise drawn
anew per unit).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from dipaco.data.windows import ShardSource
from dipaco.inner import train_path
from dipaco_server.rounds.models import Contribution, OuterStep, Round, WorkUnit
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import first_round, replication
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import Run
from dipaco_server.workers import probation, trust
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_outer_tasks import DILOCO, GRID, running_run
from tests.test_replica_bias import added, hand_in
from tests.test_untrusted import (
    INNER,
    Attack,
    base_modules,
    honest_deltas,
    step_round,
    with_data,
)

# --- the rules ---------------------------------------------------------------------------------


def test_the_replication_rate_follows_probation_trust_and_the_operators_word() -> None:
    rate = lambda **kw: probation.replication_rate(probation.Standing(**kw), 0.1, 0.5)  # noqa: E731
    assert rate(probation=True) == 1.0
    assert rate(trust=1.0) == pytest.approx(0.1)
    assert rate(trust=0.7) == pytest.approx(0.1 + 0.9 * 0.6)  # one refusal: audited far more
    assert rate(trust=0.5) == rate(trust=0.3) == 1.0
    assert rate(trust=0.2, operator_trusted=True) == 0.0  # the operator's machines: never


def test_probation_ends_with_several_distinct_partners_in_both_roles() -> None:
    partners: list[list[int]] = []
    for worker, as_check in ((7, False), (7, True), (7, False), (8, True)):
        partners = probation.agreed(partners, worker, as_check)
    assert partners == [[7, 1], [7, 0], [8, 1]]  # one entry per partner and role
    assert not probation.leaves_probation(partners, 3)  # two partners
    assert probation.leaves_probation(partners, 2)
    assert not probation.leaves_probation([[1, 0], [2, 0], [3, 0]], 3)  # never the check copy
    assert probation.leaves_probation([[1, 0], [2, 0], [3, 1]], 3)
    assert probation.probation_progress([[1, 0], [2, 0]]) == (2, True, False)
    many = [[n, 0] for n in range(40)]
    assert len(probation.agreed(many, 99, True)) == probation.KEEP_PARTNERS


def test_a_check_copy_is_drawn_at_random_away_from_the_last_partner() -> None:
    rng = random.Random(0)
    offered = [(10, 1), (11, 2), (12, 3)]
    picks = {probation.pick_check(offered, 2, rng) for _ in range(60)}
    assert picks == {10, 12}
    assert probation.pick_check([(11, 2)], 2, rng) == 11  # the only one on offer
    assert probation.pick_check([], None, rng) is None


def evidence(*pairs: tuple[int, bool], queued: int = 0) -> probation.Evidence:
    return probation.Evidence(frozenset(pairs), queued)


def test_a_newcomer_is_replicated_only_while_a_copy_can_bring_what_it_lacks() -> None:
    needs = lambda *pairs, queued=0: probation.replicate_newcomer(  # noqa: E731
        evidence(*pairs, queued=queued), 3
    )
    assert needs()
    assert needs((1, False))  # two partners short; its one check copy brings one
    assert not needs((1, False), (2, False))  # its check copy to come brings the third
    assert needs((1, False), (2, True))  # both roles: only its originals bring more
    assert needs((1, True), (2, True), (3, True))  # never compared as the original
    assert not needs((1, True), (2, True), queued=1)  # its copy waiting brings both
    assert not needs((1, False), (2, True), (3, False))


def test_a_check_copy_goes_to_a_new_partner_an_established_one_first() -> None:
    offered = [(10, 1), (11, 2), (12, 5)]  # (unit, its original's worker); 5 is established
    newcomers = {1, 2}
    pool = lambda standing, ev: probation.check_pool(offered, newcomers, standing, ev, 3)  # noqa: E731
    newcomer = probation.Standing(probation=True)
    assert pool(newcomer, evidence()) == [(12, 5)]
    assert pool(newcomer, evidence((5, False))) == [(10, 1), (11, 2)]
    # every worker on offer a partner already: a check copy only for the role it lacks
    assert pool(newcomer, evidence((1, False), (2, False), (5, False))) == [(12, 5)]
    assert pool(newcomer, evidence((1, True), (2, True), (5, True))) == []
    # a newcomer whose pairings suffice, and an established worker: newcomers' new partners
    assert pool(newcomer, evidence((3, False), (4, True), (6, False))) == [(10, 1), (11, 2)]
    assert pool(newcomer, evidence((1, False), (4, True), (6, False))) == [(11, 2)]
    assert pool(probation.Standing(), evidence((1, True))) == [(11, 2)]
    assert pool(probation.Standing(operator_trusted=True), evidence()) == [(10, 1), (11, 2)]


# --- on the real services ----------------------------------------------------------------------

TOKENS = INNER["steps"] * 4  # x seq_len below


def device(seed: int) -> Attack:
    """What differs between two honest machines: a fresh deviation every unit."""
    return lambda deltas: added(deltas, seed, 0.3)


def same(deltas: Any) -> Any:
    """Two CPUs train a unit from fresh moments to the same bytes."""
    return deltas


def train(run: Run, worker: Worker, sources: dict[int, ShardSource], attack: Attack) -> WorkUnit:
    """`worker` asks for work, trains what it is given, uploads and completes."""
    granted = grant_lease(worker)
    assert granted is not None
    deltas = attack(honest_deltas(run, granted.unit, sources))
    tokens = TOKENS * run.run_config.model.seq_len
    hand_in(worker, granted, deltas, tokens)
    return granted.unit


@pytest.mark.django_db
def test_a_new_worker_is_replicated_in_both_roles_until_trusted_and_honest_ones_pass(
    tmp_path: Path, settings: Any
) -> None:
    """Three newcomers, two partners needed: each round one trains the unit and another,
    asking next, is handed its check copy before anything else. After agreeing with both
    others, once in each role, a worker leaves probation, its next unit is not replicated
    (audit rate 0 here), and no honest copy was ever refused. With two partners needed the
    repetition rule, which needs differences against two workers besides the current
    partner, cannot judge, so no judged agreement is asked for (replication.judge_for)."""
    settings.DIPACO_PROBATION_PARTNERS = 2
    settings.DIPACO_REPLICATION_RATE = 0.0
    run = running_run(DILOCO, replicas=1, rounds=4, inner=INNER, data={"val_fraction": 0.2})
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    workers = [register_worker(token, name, {})[0] for name in ("a", "b", "c")]
    assert all(w.probation and not w.operator_trusted for w in workers)
    for t, (first, second) in enumerate(((0, 1), (1, 2), (2, 0))):
        original = train(run, workers[first], sources, device(100 + 2 * t))
        assert original.replica < CHECK_OFFSET
        check = train(run, workers[second], sources, device(101 + 2 * t))
        assert check.replica == CHECK_OFFSET + original.replica  # the check copy, first
        assert check.data_position == original.data_position
        # both copies train from fresh moments (the lease's `cold`): they compare alike
        assert replication.replicated(original) and replication.replicated(check)
        step_round(run, t)
        if t == 0:  # credit is held while on probation, not granted
            held = Worker.objects.get(pk=workers[0].pk)
            assert held.probation and (held.held_units, held.units_completed) == (1, 0)
            assert held.held_tokens > 0 and held.tokens_processed == 0
    for w in workers:
        w.refresh_from_db()
        assert not w.probation, (w.name, w.partners)
        assert w.contributions_rejected == 0 and w.trust == 1.0
        assert w.audits == 1  # its one original, replicated
        assert w.units_completed == 2  # the check copy it trained is credited too
        assert w.held_units == w.held_tokens == 0  # granted when probation ended
    assert not Contribution.objects.filter(unit__round__run=run).exclude(reason="").exists()
    established = train(run, workers[0], sources, device(200))
    assert not WorkUnit.objects.filter(
        round_id=established.round_id, replica__gte=CHECK_OFFSET
    ).exists()
    assert not replication.replicated(established)  # its warm moments, as usual


@pytest.mark.django_db
def test_a_check_copy_goes_neither_to_the_same_partner_again_nor_to_one_that_cannot_finish_it(
    tmp_path: Path, settings: Any
) -> None:
    """A check copy is a copy only when trained whole from the same start: one cut to the
    round's deadline stays queued. And a newcomer is not paired again with a partner: not
    in the roles they already had with each other (that brings neither a partner nor a
    role), nor for a role while a third newcomer would be a new partner."""
    from datetime import timedelta

    from django.utils import timezone

    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0
    settings.DIPACO_WORKER_MAX_LEASES = 4
    run = running_run(GRID, replicas=1, rounds=2, inner=INNER, data={"val_fraction": 0.2})
    with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    a, b, c = (register_worker(token, name, {})[0] for name in ("a", "b", "c"))
    original = grant_lease(a)
    assert original is not None and original.unit.replica < CHECK_OFFSET
    copy = WorkUnit.objects.get(round_id=original.unit.round_id, replica__gte=CHECK_OFFSET)
    # b is slow, and the round's deadline near: the copy would be cut, so b trains an original
    Worker.objects.filter(pk=b.pk).update(measured_speed=1.0)
    Round.objects.filter(pk=copy.round_id).update(deadline=timezone.now() + timedelta(seconds=5))
    late = grant_lease(Worker.objects.get(pk=b.pk))
    assert late is not None and late.unit.replica < CHECK_OFFSET
    assert WorkUnit.objects.get(pk=copy.pk).state == WorkUnit.State.QUEUED
    Round.objects.filter(pk=copy.round_id).update(deadline=None)  # time enough: it is b's
    checked = grant_lease(Worker.objects.get(pk=b.pk))
    assert checked is not None and checked.unit.pk == copy.pk
    # b's first original was replicated too: a checking it would bring a the check role and
    # b the original's, but the two compared already, and c, new to b, lacks both: it is c's
    b_copy = WorkUnit.objects.get(
        round_id=late.unit.round_id, path_id=late.unit.path_id, replica__gte=CHECK_OFFSET
    )
    assert replication.repeats_partner(a, b_copy)
    assert not replication.repeats_partner(c, b_copy)
    # so while an original waits, a takes the original, and b's copy waits for a new partner
    second = grant_lease(a)
    assert second is not None and second.unit.replica < CHECK_OFFSET
    assert WorkUnit.objects.get(pk=b_copy.pk).state == WorkUnit.State.QUEUED
    # a copy of a's original (queued here as an audit would queue it): b checking it again
    # would bring neither a thing, so it is left for c, a new partner to both
    a_copy = WorkUnit.objects.create(
        round_id=second.unit.round_id,
        path_id=second.unit.path_id,
        replica=CHECK_OFFSET + second.unit.replica,
        data_position=second.unit.data_position,
        data_windows=second.unit.data_windows,
        base_versions=second.unit.base_versions,
    )
    assert replication.repeats_partner(Worker.objects.get(pk=b.pk), a_copy)
    assert not replication.repeats_partner(c, a_copy)
    other = grant_lease(Worker.objects.get(pk=b.pk))
    assert other is None or other.unit.pk != a_copy.pk
    assert not WorkUnit.objects.filter(
        round_id=a_copy.round_id, state=WorkUnit.State.QUEUED, replica__lt=CHECK_OFFSET
    ).exists()  # b took the last original
    taken = grant_lease(c)
    assert taken is not None and taken.unit.pk in (a_copy.pk, b_copy.pk)
    # no original waits now, and still a leaves b's copy to c, new to b
    mutual = grant_lease(a)
    assert mutual is None or mutual.unit.pk != b_copy.pk


@pytest.mark.django_db
def test_probation_asks_no_more_partners_than_there_are_workers_to_agree_with(
    tmp_path: Path, settings: Any
) -> None:
    """Three partners among four workers; once one is stopped (trust below
    DIPACO_MIN_TRUST), a newcomer that agreed with both others, in both roles, leaves
    probation at its next grant, its held credit granted, its unit no longer replicated."""
    settings.DIPACO_PROBATION_PARTNERS = 3
    settings.DIPACO_REPLICATION_RATE = 0.0
    run = running_run(GRID, replicas=1, rounds=3, inner=INNER, data={"val_fraction": 0.2})
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    a, b, c, bad = (register_worker(token, name, {})[0] for name in ("a", "b", "c", "bad"))
    assert replication.partners_needed_now(a.pk) == 3
    # round 0: b checks a's unit, the same bytes (a conclusive agreement); the rest idle
    train(run, a, sources, same)
    train(run, b, sources, same)
    step_round(run, 0, ALL_MODULES)
    assert replication.judged_agreement(a.pk)
    assert Worker.objects.get(pk=a.pk).partners == [[b.pk, 0]]
    Worker.objects.filter(pk=a.pk).update(
        partners=[[b.pk, 0], [c.pk, 1]], held_units=2, held_tokens=500
    )
    granted = grant_lease(Worker.objects.get(pk=a.pk))  # still three to find: replicated
    assert granted is not None and replication.replicated(granted.unit)
    Worker.objects.filter(pk=bad.pk).update(trust=0.1)  # stopped: it gets no more work
    assert replication.partners_needed_now(a.pk) == 2
    settings.DIPACO_WORKER_MAX_LEASES = 2
    again = grant_lease(Worker.objects.get(pk=a.pk))
    assert again is not None and again.unit.replica < CHECK_OFFSET
    assert not replication.replicated(again.unit)
    row = Worker.objects.get(pk=a.pk)
    assert not row.probation
    assert (row.units_completed, row.tokens_processed, row.held_units) == (2, 500, 0)


@pytest.mark.django_db
def test_credit_held_on_probation_is_granted_when_it_ends_and_forfeited_when_a_copy_loses(
    settings: Any,
) -> None:
    """Held on probation, then (audits on) pending each next agreeing audit or the run's
    end (workers.trust.grant_credit); forfeited with a lost comparison."""
    settings.DIPACO_PROBATION_PARTNERS = 2
    settings.DIPACO_REPLICATION_RATE = 0.05
    token = create_enrollment_token(max_uses=None)[1]
    worker = register_worker(token, "newcomer", {})[0]

    def counts() -> tuple[bool, int, int, int, int]:
        w = Worker.objects.get(pk=worker.pk)
        return w.probation, w.held_units, w.held_tokens, w.units_completed, w.tokens_processed

    trust.grant_credit(worker.pk, 100)
    assert counts() == (True, 1, 100, 0, 0)
    trust.record_agreement(worker.pk, 7, False)
    trust.restart_probation([worker.pk])  # one of its copies lost a comparison
    assert counts() == (True, 0, 0, 0, 0)  # forfeited, and its agreements with it
    assert Worker.objects.get(pk=worker.pk).partners == []
    trust.grant_credit(worker.pk, 50)
    trust.record_agreement(worker.pk, 7, False)
    trust.record_agreement(worker.pk, 8, True)  # two partners, both roles: probation ends
    assert counts() == (False, 0, 0, 1, 50)
    trust.grant_credit(worker.pk, 30)
    # established, audits on: held until a copy of its agrees with an established,
    # undoubted worker's (a newcomer's agreement vouches for nothing)
    assert counts() == (False, 1, 30, 1, 50)
    newcomer = register_worker(token, "another newcomer", {})[0]
    trust.record_agreement(worker.pk, newcomer.pk, True)
    assert counts() == (False, 1, 30, 1, 50)
    referee = register_worker(token, "established", {})[0]
    Worker.objects.filter(pk=referee.pk).update(probation=False)
    trust.record_agreement(worker.pk, referee.pk, False)
    assert counts() == (False, 0, 0, 2, 80)
    trust.grant_credit(worker.pk, 20)
    assert trust.release_held([worker.pk]) == 1  # a run it worked on finished
    assert counts() == (False, 0, 0, 3, 100)
    settings.DIPACO_REPLICATION_RATE = 0.0  # no audit could ever grant it: at once
    trust.grant_credit(worker.pk, 10)
    assert counts() == (False, 0, 0, 4, 110)
    settings.DIPACO_REPLICATION_RATE = 0.05
    trust.grant_credit(worker.pk, 10)
    trust.restart_probation([worker.pk])  # an established worker's copy lost: probation again
    assert counts() == (True, 0, 0, 4, 110)  # what was granted stays granted; held forfeited
    assert trust.release_held([worker.pk]) == 0
    operator = register_worker(create_enrollment_token(trusted=True)[1], "operator-box", {})[0]
    trust.restart_probation([operator.pk])
    assert not Worker.objects.get(pk=operator.pk).probation  # the operator's word stands
    settings.DIPACO_PROBATION_PARTNERS = 0  # no probation at all
    other = register_worker(token, "another", {})[0]
    trust.restart_probation([other.pk])
    assert not Worker.objects.get(pk=other.pk).probation


def four_newcomers(
    tmp_path: Path, settings: Any
) -> tuple[Run, dict[int, ShardSource], list[Worker]]:
    """A 3-round run on the 2x2 grid with its data, and four newcomers that each need
    `probation.PARTNERS` partners, with audits off."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0
    run = running_run(GRID, replicas=1, rounds=3, inner=INNER, data={"val_fraction": 0.2})
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    workers = [register_worker(token, f"n{i}", {})[0] for i in range(4)]
    return run, sources, workers


def wave_round(run: Run, workers: list[Worker], sources: dict[int, ShardSource], t: int) -> int:
    """Round t as concurrent workers meet it: in waves, each worker asks once (in an order
    that turns each wave), then every granted unit is trained and handed in; until a wave
    is granted nothing. Then the round's step. Returns the check copies trained."""
    checks, wave = 0, 0
    while True:
        order = workers[wave % len(workers) :] + workers[: wave % len(workers)]
        granted = [(w, grant_lease(w)) for w in order]
        granted = [(w, g) for w, g in granted if g is not None]
        if not granted:
            break
        for w, g in granted:
            assert g.unit.round.t == t
            checks += g.unit.replica >= CHECK_OFFSET
            deltas = added(honest_deltas(run, g.unit, sources), 600 + 10 * t + w.pk % 10, 0.3)
            hand_in(w, g, deltas, TOKENS * run.run_config.model.seq_len)
        wave += 1
    step_round(run, t, ALL_MODULES)
    return checks


@pytest.mark.django_db
def test_four_newcomers_leave_probation_in_two_rounds_with_six_copies(
    tmp_path: Path, settings: Any
) -> None:
    """Four honest newcomers on the 2x2 grid, three partners each: the schedule pairs each
    with a partner it has not had, in the role it lacks, and replicates only what brings
    one; every worker leaves probation after two rounds, and later originals are only
    audited (at rate 0 here)."""
    run, sources, workers = four_newcomers(tmp_path, settings)
    copies, on_probation = [], []
    for t in range(3):
        copies.append(wave_round(run, workers, sources, t))
        for w in workers:
            w.refresh_from_db()
        on_probation.append(sum(w.probation for w in workers))
    assert copies == [4, 2, 0]  # the six edges of the complete graph on four workers
    assert on_probation == [4, 0, 0]
    for w in workers:
        assert probation.probation_progress(w.partners) == (3, True, True)
        assert w.contributions_rejected == 0 and w.trust == 1.0
    assert not Contribution.objects.filter(unit__round__run=run).exclude(reason="").exists()


@pytest.mark.django_db
def test_an_enrollment_token_marked_trusted_registers_workers_without_probation(
    settings: Any,
) -> None:
    settings.DIPACO_PROBATION_PARTNERS = 3
    row, plaintext = create_enrollment_token(max_uses=None, trusted=True)
    assert row.trusted
    worker, _ = register_worker(plaintext, "operator-box", {})
    assert worker.operator_trusted and not worker.probation
    newcomer, _ = register_worker(create_enrollment_token()[1], "volunteer", {})
    assert newcomer.probation and not newcomer.operator_trusted
    settings.DIPACO_PROBATION_PARTNERS = 0  # probation off: as before it existed
    assert not register_worker(create_enrollment_token()[1], "v2", {})[0].probation


def warm_or_cold(
    run: Run, worker: Worker, sources: dict[int, ShardSource], states: dict[int, Any], seed: int
) -> WorkUnit | None:
    """`worker` trains what it is given as an honest worker does: an original from the AdamW
    moments it kept for the path (warm), a check copy from none (cold), each on a device of
    its own (fresh noise at 0.05 x the Δ's norm); None when nothing is queued."""
    granted = grant_lease(worker)
    if granted is None:
        return None
    unit = granted.unit
    check = unit.replica >= CHECK_OFFSET
    result = train_path(
        run.run_config, unit.path.index, base_modules(run, unit), sources[unit.path.index],
        round_index=unit.round.t, start_position=unit.data_position,
        state=None if check else states.get(worker.pk),
    )  # fmt: skip
    if not check:
        states[worker.pk] = result.state
    deltas = added(result.module_deltas, seed, 0.05)
    tokens = TOKENS * run.run_config.model.seq_len
    hand_in(worker, granted, deltas, tokens)
    return unit


@pytest.mark.django_db
def test_honest_copies_differing_by_warm_and_cold_moments_are_never_refused(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four honest newcomers over eight rounds, every pair and both roles: originals from
    warm moments (an agent that ignores the lease's `cold`, as agents did before it), check
    copies cold, another device each. Their differences repeat for the worker that holds
    the moments (with the opposite sign in the other role), which the persistence rule
    must not take for a bias however often it sees them."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    # one pair a round: three partners each take six rounds, past the rounds after which
    # two suffice (replication.PROBATION_ROUNDS); kept at three so that the rule sees
    # every comparison of the schedule
    monkeypatch.setattr(replication, "PROBATION_ROUNDS", 99)
    rounds = ((0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (1, 3), (2, 0), (3, 1))
    run = running_run(
        DILOCO, replicas=1, rounds=len(rounds), inner=INNER, data={"val_fraction": 0.2}
    )
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    workers = [register_worker(token, f"honest-{i}", {})[0] for i in range(4)]
    states: dict[int, Any] = {}
    checked = 0
    for t, (first, second) in enumerate(rounds):
        warm_or_cold(run, workers[first], sources, states, 300 + 2 * t)
        checked += warm_or_cold(run, workers[second], sources, states, 301 + 2 * t) is not None
        step_round(run, t)
    assert checked >= 6  # most rounds compared a pair (a worker that left probation: not)
    refused = Contribution.objects.filter(unit__round__run=run).exclude(reason="")
    assert not refused.exists(), [c.reason for c in refused]
    for w in workers:
        w.refresh_from_db()
        assert w.trust == 1.0 and w.replicas_disagreed == 0


# --- the first round, settled over units (rounds.verification.first_round) -------------------


def facts(rates: dict[int, float], referees: tuple[int, ...] = ()) -> dict[int, Any]:
    return {k: first_round.UnitFacts(k, r, k in referees) for k, r in rates.items()}


def against(*pairs: tuple[int, int]) -> dict[tuple[int, int], float | None]:
    """Cosines among units 0..3: the listed pairs point against each other, the rest along."""
    out: dict[tuple[int, int], float | None] = {
        (a, b): 0.6 for a in range(4) for b in range(a + 1, 4)
    }
    for pair in pairs:
        out[tuple(sorted(pair))] = -0.9  # type: ignore[index]
    return out


# Two colluders (0, 1) flip; 2 and 3 are honest. Rates as measured from a fresh start.
TIE = against((0, 2), (0, 3), (1, 2), (1, 3))
HONEST_RATES = {0: 0.18, 1: 0.23, 2: 0.27, 3: 0.31}


def test_a_two_against_two_tie_is_settled_by_gain_per_token_not_by_accepting_both() -> None:
    verdicts = first_round.settle(facts(HONEST_RATES), TIE)
    assert set(verdicts) == {0, 1}
    assert all(v.startswith(first_round.AGAINST) for v in verdicts.values())


def test_a_tie_that_gain_cannot_decide_is_held_out_whole() -> None:
    close = {0: 0.26, 1: 0.27, 2: 0.27, 3: 0.28}
    verdicts = first_round.settle(facts(close), TIE)
    assert set(verdicts) == {0, 1, 2, 3}
    assert all(v.startswith(first_round.UNSETTLED) for v in verdicts.values())


def test_a_trusted_referee_decides_whatever_the_gains_say() -> None:
    # the colluders' gain even looks better; the referee (unit 3) says otherwise
    rates = {0: 0.4, 1: 0.4, 2: 0.27, 3: 0.31}
    verdicts = first_round.settle(facts(rates, referees=(3,)), TIE)
    assert set(verdicts) == {0, 1} and "trusted referee" in verdicts[0]


def test_a_minority_against_the_rest_is_refused_and_agreement_refuses_nobody() -> None:
    one = first_round.settle(facts(HONEST_RATES), against((0, 1), (0, 2), (0, 3)))
    assert set(one) == {0}
    assert first_round.settle(facts(HONEST_RATES), against()) == {}


def test_two_copies_of_one_unit_that_disagree_are_settled_on_their_windows() -> None:
    # 4 is honest worker's copy of colluder 0's unit: the same windows, more gain
    units = facts({**HONEST_RATES, 4: 0.30})
    cosines = {**TIE, (0, 4): -0.9, (1, 4): -0.9, (2, 4): 0.6, (3, 4): 0.6}
    verdicts = first_round.settle(units, cosines, copies=[(0, 4)])
    assert "same unit" in verdicts[0] and set(verdicts) == {0, 1}


# --- a first round colluders cannot win, on the real services ---------------------------------


def flip(deltas: Any) -> Any:
    return {m: {n: -t for n, t in d.items()} for m, d in deltas.items()}


ALL_MODULES = ("0.0", "0.1", "1.0", "1.1", "shared")


def fresh_grid(tmp_path: Path) -> tuple[Run, dict[int, ShardSource]]:
    """A 2x2 grid from a fresh start: four paths, each module of a level in two of them,
    the shared module in all four. Proof of useful work off: on real text a flipped Δ from
    a fresh start still lowers its unit's loss (first_round's docstring), while this test
    model's flips raise it and would be refused for that alone; without it, the first
    round's settlement is all that stands between the flips and the step."""
    run = running_run(
        GRID, replicas=1, rounds=2, inner=INNER, data={"val_fraction": 0.2},
        outer={"score": False},
    )  # fmt: skip
    return run, with_data(run, tmp_path)


def accepted(run: Run, workers: list[Worker]) -> list[str]:
    rows = Contribution.objects.filter(unit__round__run=run, lease__worker__in=workers)
    return [f"{c.lease.worker.name} {c.module.module_id}" for c in rows if not c.reason]


@pytest.mark.django_db
def test_two_colluders_out_of_four_get_no_flipped_delta_accepted_and_a_tie_waits(
    tmp_path: Path,
) -> None:
    """Workers 0 and 1 flip their Δs and get paths 0 and 1: a two-against-two tie in the
    shared module, and module 0.0 gets only their two flips, which agree with each other.
    Settled over whole units, the tie is not decided in round 0 (no score, no referee, no
    third copy): both sides are held, never both accepted, nobody's trust falls for it, and
    every module's step waits, keeping its version and all its Δs. In round 1 the two honest
    workers train the four paths; with round 0's kept units the majority refuses the flips,
    and the honest round-0 Δs step with round 1's (the pure tests above settle the same tie
    by gain per token, bench/attacks_live.py on real text)."""
    run, sources = fresh_grid(tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    workers = [register_worker(token, f"w{i}", {})[0] for i in range(4)]
    for i, worker in enumerate(workers):
        unit = train(run, worker, sources, flip if i < 2 else device(400 + i))
        assert unit.path.index == i
    step_round(run, 0, ALL_MODULES)

    assert accepted(run, workers[:2]) == []
    rows = Contribution.objects.filter(unit__round__run=run)
    assert {c.reason.partition(":")[0] for c in rows} == {first_round.UNSETTLED}
    assert {c.status for c in rows} == {Contribution.Status.PENDING}  # kept, not lost
    steps = OuterStep.objects.filter(round__run=run, round__t=0)
    waited = {(s.outcome, s.accepted, s.rejected) for s in steps}
    assert waited == {(OuterStep.Outcome.KEPT, 0, 0)}
    assert len(Round.objects.get(run=run, t=0).first_round) == 4
    for w in workers:
        w.refresh_from_db()
        assert w.trust == 1.0 and w.tokens_processed == 0 and w.contributions_rejected == 0

    round1 = [train(run, workers[2 + i % 2], sources, device(410 + i)) for i in range(4)]
    assert {u.round.t for u in round1} == {1}
    assert all(u.base_versions == {m: 0 for m in u.base_versions} for u in round1)
    step_round(run, 1, ALL_MODULES)

    flips = Contribution.objects.filter(lease__worker__in=workers[:2])
    assert {c.reason.partition(":")[0] for c in flips} == {first_round.AGAINST}
    honest = Contribution.objects.filter(lease__worker__in=workers[2:])
    assert {(c.status, c.reason) for c in honest} == {(Contribution.Status.ACCEPTED, "")}
    step = OuterStep.objects.get(round__run=run, round__t=1, module__module_id="0.1")
    assert (step.outcome, step.accepted) == (OuterStep.Outcome.STEPPED, 4)  # 2 kept + 2 new
    for w in workers[2:]:
        w.refresh_from_db()
        assert w.contributions_accepted == honest.filter(lease__worker=w).count()
        assert w.trust == 1.0 and w.tokens_processed > 0


@pytest.mark.django_db
def test_a_trusted_worker_from_a_marked_token_referees_round_0(
    tmp_path: Path, settings: Any
) -> None:
    """Probation at its default: the newcomers' units get check copies, and the operator's
    machine, asking for work, is handed the check copy of colluder w0's unit. Its copy
    refutes w0's flip, and w1's flipped unit points against it too; an honest newcomer's
    copy of w1's unit steps with the referee's."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    run, sources = fresh_grid(tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    w0, w1, w2 = (register_worker(token, f"w{i}", {})[0] for i in range(3))
    referee, _ = register_worker(create_enrollment_token(trusted=True)[1], "operator", {})
    assert referee.operator_trusted and not referee.probation
    original = train(run, w0, sources, flip)
    refereed = train(run, referee, sources, device(500))
    assert refereed.replica == CHECK_OFFSET + original.replica  # a check copy, first
    train(run, w1, sources, flip)
    checked = train(run, w2, sources, device(501))
    assert checked.replica >= CHECK_OFFSET
    step_round(run, 0, ALL_MODULES)

    assert accepted(run, [w0, w1]) == []
    refused = Contribution.objects.filter(lease__worker__in=[w0, w1])
    assert all("trusted referee" in c.reason for c in refused), [c.reason for c in refused]
    assert {c.reason.partition(":")[0] for c in refused} == {first_round.AGAINST}
    assert accepted(run, [referee, w2])
    assert not Contribution.objects.filter(lease__worker__in=[referee, w2]).exclude(reason="")
