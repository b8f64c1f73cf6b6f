"""Probation's hard end (workers.trust._save_standing): after
rounds.verification.replication.PROBATION_ROUNDS rounds of work at full trust, a newcomer
leaves probation with probation.LATE_PARTNERS partners in either role, so a comparison
spent on an attacker whose copy the checks refused cannot keep an honest worker replicated
round after round. On the real services (PostgreSQL, the lease service, real Δs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dipaco_server.rounds.models import Contribution
from dipaco_server.rounds.protocol import pacing
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import replication
from dipaco_server.workers import probation, trust
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_probation import four_newcomers, wave_round


def test_the_hard_end_asks_late_partners_in_either_role() -> None:
    as_check = [[7, 1], [8, 1]]
    assert not probation.leaves_probation(as_check, probation.LATE_PARTNERS)
    assert probation.leaves_probation(as_check, probation.LATE_PARTNERS, both_roles=False)
    assert not probation.leaves_probation([[7, 1]], probation.LATE_PARTNERS, both_roles=False)
    assert not probation.leaves_probation([], 0, both_roles=False)  # no agreement at all


@pytest.mark.django_db
def test_only_a_late_newcomer_at_full_trust_leaves_with_partners_in_one_role(
    settings: Any,
) -> None:
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    token = create_enrollment_token(max_uses=None)[1]
    worker = register_worker(token, "newcomer", {})[0]
    Worker.objects.filter(pk=worker.pk).update(
        partners=[[101, 1], [102, 1]], held_units=2, held_tokens=900
    )
    assert not trust.end_probation_if_due(worker.pk, probation.PARTNERS)  # not late yet
    Worker.objects.filter(pk=worker.pk).update(trust=0.9)  # a Δ of it was refused
    assert not trust.end_probation_if_due(worker.pk, probation.PARTNERS, late=True)
    Worker.objects.filter(pk=worker.pk).update(trust=1.0)
    assert trust.end_probation_if_due(worker.pk, probation.PARTNERS, late=True)
    row = Worker.objects.get(pk=worker.pk)
    assert not row.probation
    assert (row.units_completed, row.tokens_processed, row.held_units) == (2, 900, 0)


@pytest.mark.django_db
@pytest.mark.parametrize("full_trust", [True, False])
def test_a_newcomer_late_on_probation_leaves_at_its_next_grant_unreplicated(
    tmp_path: Path, settings: Any, full_trust: bool
) -> None:
    """Four newcomers work two rounds; one is then put back as the live run left it: two
    partners, both as the check copy (its original's checker was refused). At its round-2
    grant it has worked PROBATION_ROUNDS rounds: at full trust it leaves probation there,
    its held credit granted, its unit not replicated (audits off); at a lost trust it
    stays, and its unit is replicated for the role it lacks."""
    workers = newcomers_after(tmp_path, settings, rounds=2)
    a, b, c = workers[:3]
    Worker.objects.filter(pk=a.pk).update(
        probation=True,
        partners=[[b.pk, 1], [c.pk, 1]],
        held_units=1,
        held_tokens=500,
        trust=1.0 if full_trust else 0.9,
    )
    assert replication.rounds_on_probation(a.pk) == replication.PROBATION_ROUNDS
    granted = grant_lease(Worker.objects.get(pk=a.pk))
    assert granted is not None and granted.unit.round.t == 2
    row = Worker.objects.get(pk=a.pk)
    assert row.probation is not full_trust
    assert replication.replicated(granted.unit) is not full_trust
    assert row.held_units == (0 if full_trust else 1)


@pytest.mark.django_db
def test_a_newcomer_that_agreed_with_no_one_takes_no_check_copy(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer whose copies were compared with two workers and agreed with neither (as
    live, an attacker refused by the checks) is given an original, not another newcomer's
    check copy: that comparison would bring the other newcomer nothing."""
    workers = newcomers_after(tmp_path, settings, rounds=1)
    x, y, z = workers[:3]
    assert Worker.objects.filter(pk__in=[w.pk for w in workers], probation=True).count() == 4
    first, second = Contribution.objects.filter(lease__worker=x).order_by("pk")[:2]
    Contribution.objects.filter(pk=first.pk).update(replica_partner=y, agreed_with=None)
    Contribution.objects.filter(pk=second.pk).update(replica_partner=z, agreed_with=None)
    Worker.objects.filter(pk=x.pk).update(partners=[])
    x = Worker.objects.get(pk=x.pk)
    assert replication.never_agreed(x)
    assert not replication.never_agreed(Worker.objects.get(pk=y.pk))  # it agreed in round 0
    original = grant_lease(Worker.objects.get(pk=workers[3].pk))
    assert original is not None and replication.replicated(original.unit)  # a copy queued
    groups = pacing._open_groups()
    with monkeypatch.context() as patched:
        patched.setattr(replication, "never_agreed", lambda worker: False)
        assert replication.preferred_check(x, groups) is not None  # without the rule
    assert replication.preferred_check(x, groups) is None
    granted = grant_lease(x)
    assert granted is not None and not replication.is_check(granted.unit)


def newcomers_after(tmp_path: Path, settings: Any, rounds: int) -> list[Worker]:
    """Four honest newcomers on the 2x2 grid (three partners needed, audits off) after
    `rounds` rounds of work (tests.test_probation.wave_round)."""
    run, sources, workers = four_newcomers(tmp_path, settings)
    for t in range(rounds):
        wave_round(run, workers, sources, t)
    return workers
