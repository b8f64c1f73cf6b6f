"""Probation ends on agreements the repetition rule could judge
(rounds.verification.replication.judged_agreement), on the real services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dipaco_server.rounds.models import Contribution
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import replication
from dipaco_server.workers import probation
from dipaco_server.workers.models import Worker
from tests.test_probation import four_newcomers, wave_round


@pytest.mark.django_db
def test_agreements_the_repetition_rule_could_not_judge_do_not_end_probation(
    tmp_path: Path, settings: Any
) -> None:
    """Four newcomers, copies that differ as two devices' do. As live at seed 1, one
    newcomer's round-0 comparisons were all against one worker: its round-1 agreements
    bring it three partners in both roles, but the rule had no differences against two
    other workers to judge them by, so it stays on probation, its credit held and its next
    unit replicated, while the other three, judged, leave."""
    run, sources, workers = four_newcomers(tmp_path, settings)
    wave_round(run, workers, sources, 0)
    a = workers[0]
    compared = Contribution.objects.filter(
        lease__worker=a, unit__round__t=0, replica_sketch__isnull=False
    )
    first = compared.values_list("replica_partner_id", flat=True).first()
    assert first is not None
    compared.update(replica_partner_id=first)  # every difference against one worker
    wave_round(run, workers, sources, 1)
    a = Worker.objects.get(pk=a.pk)
    assert probation.leaves_probation(a.partners, probation.PARTNERS)  # partners and roles
    assert not replication.judged_agreement(a.pk)
    assert a.probation and a.held_units > 0 and a.tokens_processed == 0
    for other in workers[1:]:
        other = Worker.objects.get(pk=other.pk)
        assert replication.judged_agreement(other.pk) and not other.probation
    granted = grant_lease(a)
    assert granted is not None and replication.replicated(granted.unit)
    # Every established worker has been a's partner, yet one takes its copy first: a
    # comparison the rule can judge now. Live at seed 2, none did, each copy was dropped
    # at close, and the biased newcomer stayed on probation, never refused, to the end.
    assert replication.awaits_judgement(a)
    checker = Worker.objects.get(pk=workers[1].pk)
    assert a.pk in {partner for partner, _ in checker.partners}
    check = grant_lease(checker)
    assert check is not None and replication.is_check(check.unit)
    assert (check.unit.path_id, check.unit.data_position) == (
        granted.unit.path_id,
        granted.unit.data_position,
    )


def test_an_established_worker_takes_a_copy_awaiting_judgement_after_a_new_partners_copy() -> None:
    established = probation.Standing()
    known = probation.Evidence(frozenset({(1, False), (2, True)}))  # 1 and 2: partners had
    offered = [(10, 1), (11, 2)]
    check_pool = probation.check_pool
    assert check_pool(offered, {1, 2}, established, known, 3) == []
    assert check_pool(offered, {1, 2}, established, known, 3, unjudged=lambda: {1}) == [(10, 1)]
    # a newcomer new to it first: that comparison brings a partner and can be judged too
    offered = [(10, 1), (12, 3)]
    assert check_pool(offered, {1, 3}, established, known, 3, unjudged=lambda: {1}) == [(12, 3)]
    # a newcomer asking is not sent to re-check a partner it had for another's judgement
    newcomer = probation.Standing(probation=True)
    done = probation.Evidence(frozenset({(1, False), (2, True), (4, False)}))
    assert check_pool([(10, 1)], {1}, newcomer, done, 3, unjudged=lambda: {1}) == []
