"""A lone newcomer among established workers gets the check role at once
(rounds.verification.replication.newcomer_lacks_a_check), on the real services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dipaco_server.rounds.models import WorkUnit
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import replication
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.workers import probation
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_outer_tasks import GRID, running_run
from tests.test_untrusted import INNER, with_data


def copies(round_id: int) -> list[WorkUnit]:
    return list(WorkUnit.objects.filter(round_id=round_id, replica__gte=CHECK_OFFSET))


@pytest.mark.django_db
@pytest.mark.parametrize("operators", [False, True])
def test_a_lone_newcomer_gets_a_check_copy_of_an_established_workers_unit_at_once(
    tmp_path: Path, settings: Any, operators: bool
) -> None:
    """Three established workers (audited at rate 0, or the operator's, never audited) and
    one newcomer: the first established grant is issued as a check copy too, the newcomer
    takes it before any original, and once it holds the check role no further copy is
    queued for it. Before, it waited for an audit that rate 0 never queues."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0
    settings.DIPACO_WORKER_MAX_LEASES = 2
    run = running_run(GRID, replicas=1, rounds=2, inner=INNER, data={"val_fraction": 0.2})
    with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    a, b, c, new = (register_worker(token, name, {})[0] for name in ("a", "b", "c", "new"))
    Worker.objects.filter(pk__in=[a.pk, b.pk, c.pk]).update(
        probation=False, operator_trusted=operators
    )
    a, b = Worker.objects.get(pk=a.pk), Worker.objects.get(pk=b.pk)
    granted = grant_lease(a)
    assert granted is not None and granted.unit.replica < CHECK_OFFSET
    round_id = granted.unit.round_id
    assert [u.path_id for u in copies(round_id)] == [granted.unit.path_id]
    assert replication.replicated(granted.unit)  # both copies train cold
    # while that copy waits for the newcomer, b's unit is not replicated for it as well
    other = grant_lease(b)
    assert other is not None and not replication.replicated(other.unit)
    assert len(copies(round_id)) == 1
    checked = grant_lease(Worker.objects.get(pk=new.pk))
    assert checked is not None and checked.unit.replica == CHECK_OFFSET + granted.unit.replica
    assert checked.unit.path_id == granted.unit.path_id
    # the newcomer holds the check role now: c's unit is not replicated for it
    assert not replication.newcomer_lacks_a_check(round_id)
    third = grant_lease(Worker.objects.get(pk=c.pk))
    assert third is not None and not replication.replicated(third.unit)
    # its own original is replicated as probation says (it lacks partners and that role)
    own = grant_lease(Worker.objects.get(pk=new.pk))
    assert own is not None and own.unit.replica < CHECK_OFFSET
    assert replication.replicated(own.unit)


@pytest.mark.django_db
def test_established_workers_alone_queue_no_check_copies(tmp_path: Path, settings: Any) -> None:
    """No newcomer: the audit rate alone decides (0 here), one query per grant; a quiet
    newcomer or two newcomers add nothing either."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0
    run = running_run(GRID, replicas=1, rounds=2, inner=INNER, data={"val_fraction": 0.2})
    with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    workers = [register_worker(token, name, {})[0] for name in ("a", "b")]
    Worker.objects.filter(pk__in=[w.pk for w in workers]).update(probation=False)
    for w in workers:
        granted = grant_lease(Worker.objects.get(pk=w.pk))
        assert granted is not None and not replication.replicated(granted.unit)
    round_id = granted.unit.round_id
    # a newcomer that went quiet (not heard from within a lease timeout) asks for nothing
    quiet = register_worker(token, "quiet", {})[0]
    Worker.objects.filter(pk=quiet.pk).update(last_seen=None)
    assert not replication.newcomer_lacks_a_check(round_id)
    # one that can get work does; two take each other's copies, so nothing is added
    lone = register_worker(token, "lone", {})[0]
    assert replication.newcomer_lacks_a_check(round_id)
    register_worker(token, "second", {})
    assert not replication.newcomer_lacks_a_check(round_id)
    assert lone.probation
