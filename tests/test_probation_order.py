"""Four newcomers in round 0 in the order live workers meet it: two never check each other
while an original waits, and probation costs the complete graph's six copies, no more
(workers.probation.check_pool), on the real services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dipaco_server.rounds.models import WorkUnit
from dipaco_server.rounds.protocol.grant import LeaseGrant, grant_lease
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.workers import probation
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_outer_tasks import GRID, running_run
from tests.test_probation import ALL_MODULES, TOKENS, wave_round
from tests.test_replica_bias import added, hand_in
from tests.test_untrusted import INNER, honest_deltas, step_round, with_data


def test_a_newcomer_pairs_with_another_again_only_when_no_original_waits() -> None:
    newcomer = probation.Standing(probation=True)
    checked_by_1 = probation.Evidence(frozenset({(1, False)}))
    pool = lambda offered, originals_waiting: probation.check_pool(  # noqa: E731
        offered, {1, 2}, newcomer, checked_by_1, 3, originals_waiting
    )
    assert pool([(10, 1)], originals_waiting=True) == []  # the original instead
    assert pool([(10, 1)], originals_waiting=False) == [(10, 1)]  # the role it lacks
    assert pool([(10, 1), (11, 2)], originals_waiting=True) == [(11, 2)]  # a new partner
    assert pool([(10, 1), (12, 5)], originals_waiting=True) == [(12, 5)]  # 5: established
    # with the one partner it needs (two workers), the role is all it lacks: the copy now
    alone = probation.check_pool([(10, 1)], {1, 2}, newcomer, checked_by_1, 1, True)
    assert alone == [(10, 1)]
    # it has checked and was never the original: a waiting original first, whose copy
    # brings that role with a partner, not a copy that brings a partner only
    checker = probation.Evidence(frozenset({(1, True)}))
    offered = [(11, 2)]
    assert probation.check_pool(offered, {1, 2}, newcomer, checker, 3, True) == []
    assert probation.check_pool(offered, {1, 2}, newcomer, checker, 3, False) == offered
    # its pairings suffice only through its queued copy, never compared as the original:
    # 2 can check that copy instead, which brings it the partner and the role at once
    waiting = probation.Evidence(frozenset({(1, True), (3, True)}), queued=1)
    assert probation.waits_for_its_check(waiting, 3)
    assert probation.check_pool(offered, {1, 2}, newcomer, waiting, 3, False) == []
    compared = probation.Evidence(frozenset({(1, True), (3, False)}), queued=1)
    assert not probation.waits_for_its_check(compared, 3)
    assert probation.check_pool(offered, {1, 2}, newcomer, compared, 3, False) == offered


@pytest.mark.django_db
def test_four_newcomers_arriving_one_by_one_cost_six_copies(tmp_path: Path, settings: Any) -> None:
    """Round 0 as a live run met it (bench/attacks_live.py, seed 0): 1 takes an original, 2
    checks it, 3 takes an original, 4 checks it; 2, back from its check, takes an original
    and 1, back from its own, is offered only 2's copy. It takes the last original instead,
    so the four comparisons of round 0 are four distinct pairs, and round 1 adds the two
    left: six copies, every worker out of probation. Before, 1 took 2's copy (the pair
    again) and a seventh copy was needed in round 2."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0
    run = running_run(GRID, replicas=1, rounds=3, inner=INNER, data={"val_fraction": 0.2})
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    w1, w2, w3, w4 = (register_worker(token, f"n{i}", {})[0] for i in range(1, 5))
    tokens = TOKENS * run.run_config.model.seq_len

    def ask(worker: Worker) -> LeaseGrant:
        granted = grant_lease(Worker.objects.get(pk=worker.pk))
        assert granted is not None
        return granted

    def done(worker: Worker, granted: LeaseGrant) -> None:
        deltas = honest_deltas(run, granted.unit, sources)
        hand_in(worker, granted, added(deltas, 700 + granted.unit.pk, 0.3), tokens)

    held = {w: ask(w) for w in (w1, w2, w3, w4)}
    is_check = lambda g: g.unit.replica >= CHECK_OFFSET  # noqa: E731
    assert [is_check(held[w]) for w in (w1, w2, w3, w4)] == [False, True, False, True]
    done(w2, held[w2])
    held[w2] = ask(w2)
    assert not is_check(held[w2])
    done(w1, held[w1])
    held[w1] = ask(w1)
    assert not is_check(held[w1])  # the last original, not 2's copy
    for w in (w4, w3):  # each takes a copy of a partner new to it
        done(w, held[w])
        held[w] = ask(w)
        assert is_check(held[w])
    for w in (w1, w2, w3, w4):
        done(w, held[w])
    while left := [(w, g) for w in (w1, w2, w3, w4) if (g := grant_lease(w)) is not None]:
        for w, g in left:
            done(w, g)
    step_round(run, 0, ALL_MODULES)
    round_0 = WorkUnit.objects.filter(round__run=run, round__t=0, replica__gte=CHECK_OFFSET)
    assert round_0.count() == 4
    copies = [round_0.count(), wave_round(run, [w1, w2, w3, w4], sources, 1)]
    workers = list(Worker.objects.filter(pk__in=[w1.pk, w2.pk, w3.pk, w4.pk]))
    assert sum(copies) == 6
    assert [(w.pk, w.probation, w.partners) for w in workers if w.probation] == []
    for w in workers:
        assert probation.probation_progress(w.partners) == (3, True, True)
        assert w.contributions_rejected == 0
