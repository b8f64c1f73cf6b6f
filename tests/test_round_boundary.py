"""A round boundary without a stampede (issue 23): waiting workers are given jittered
Retry-After slots spread over the next round's expected opening, and get their leases there,
concurrently, without one unit granted twice. Real PostgreSQL, simulated clock."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from django.db import connection

from dipaco_server.rounds.lifecycle.close import mark_round_closed, mark_round_closing
from dipaco_server.rounds.lifecycle.open import open_round, start_run
from dipaco_server.rounds.models import Lease, Round, WorkUnit
from dipaco_server.rounds.protocol import grant as granting
from dipaco_server.rounds.protocol import leases as leasing
from dipaco_server.rounds.protocol import pacing
from dipaco_server.workers.models import Worker
from tests.test_models import make_run, make_worker, prepare_run

T0 = datetime(2030, 1, 1, tzinfo=UTC)
VOLUNTEERS = 200  # 2x2 paths x 50 replicas: one unit each
GRANT_RATE = 20  # grants/s: the 200 waiting workers spread over 10 s
Result = TypeVar("Result")


def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the per-process counts (workers seen, closing round, groups) as a new
    second of a real server would."""
    monkeypatch.setattr(pacing, "_active_workers", (float("-inf"), 0))
    monkeypatch.setattr(pacing, "_closing", (float("-inf"), None))
    monkeypatch.setattr(pacing, "_groups", (float("-inf"), []))


def in_thread(call: Callable[[], Result]) -> Result:
    try:
        return call()
    finally:
        connection.close()  # each pool thread has its own connection


@pytest.mark.django_db(transaction=True)
def test_200_waiting_volunteers_get_leases_within_the_jitter_window_without_a_duplicate(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.DIPACO_GRANT_RATE = GRANT_RATE
    round0 = start_run(prepare_run(make_run(replicas_per_path=VOLUNTEERS // 4)), now=T0)
    workers = [make_worker(f"volunteer-{i}") for i in range(VOLUNTEERS)]
    closing_at = T0 + timedelta(hours=1)
    Worker.objects.update(last_seen=closing_at)
    assert mark_round_closing(round0, now=closing_at)

    # Every volunteer asks while the outer step runs: nothing to grant, and a slot.
    fresh_caches(monkeypatch)
    asked_at = closing_at + timedelta(seconds=1)
    slots = {}
    for i, worker in enumerate(workers):
        assert granting.grant_lease(worker, now=asked_at) is None
        wait = pacing.retry_after_s(now=asked_at, rng=random.Random(i))
        slots[worker.pk] = asked_at + timedelta(seconds=wait)
    opens_at = closing_at + timedelta(seconds=pacing.DEFAULT_OUTER_S)  # no history yet
    window_end = opens_at + timedelta(seconds=VOLUNTEERS / GRANT_RATE + 1)
    assert min(slots.values()) >= opens_at, "nobody is sent back before the expected opening"
    assert max(slots.values()) <= window_end
    per_second = Counter(slots.values())
    assert len(per_second) >= 8, f"slots jittered over the window, not one instant: {per_second}"
    assert max(per_second.values()) <= 2 * GRANT_RATE, per_second

    # The outer step publishes and round 1 opens; each volunteer comes back at its slot.
    mark_round_closed(round0, now=opens_at - timedelta(seconds=1))
    round1 = open_round(round0.run, 1, now=opens_at)
    fresh_caches(monkeypatch)
    pending = dict(slots)
    granted_at: dict[int, datetime] = {}
    by_pk = {w.pk: w for w in workers}
    with ThreadPoolExecutor(max_workers=8) as pool:
        while pending:
            at = min(pending.values())
            due = [pk for pk, slot in pending.items() if slot == at]

            def ask(pk: int, at: datetime = at) -> tuple[int, granting.LeaseGrant | None, int]:
                def call() -> tuple[int, granting.LeaseGrant | None, int]:
                    grant = granting.grant_lease(by_pk[pk], now=at)
                    wait = 0 if grant is not None else pacing.retry_after_s(now=at)
                    return pk, grant, wait

                return in_thread(call)

            for pk, grant, wait in pool.map(ask, due):  # the due ones concurrently
                if grant is None:  # ahead of the pace: a later slot
                    pending[pk] = at + timedelta(seconds=wait)
                else:
                    granted_at[pk] = at
                    del pending[pk]
            assert at <= window_end + timedelta(seconds=5), f"still waiting at {at}"

    leases = list(Lease.objects.filter(unit__round=round1).values_list("unit_id", "worker_id"))
    assert len(leases) == VOLUNTEERS
    assert len({unit for unit, _ in leases}) == VOLUNTEERS, "a unit was granted twice"
    assert len({worker for _, worker in leases}) == VOLUNTEERS, "a worker got two leases"
    assert not WorkUnit.objects.filter(round=round1, state=WorkUnit.State.QUEUED).exists()
    assert Round.objects.get(pk=round1.pk).state == Round.State.OPEN
    assert max(granted_at.values()) <= window_end + timedelta(seconds=5)


@pytest.mark.django_db(transaction=True)
def test_grants_ahead_of_the_pace_of_an_opening_wait_for_a_later_slot(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after an opening only GRANT_BURST_S x DIPACO_GRANT_RATE units go out at once;
    the next request is told when its turn comes, and gets its unit then."""
    settings.DIPACO_GRANT_RATE = 2  # a burst of 4 units
    round0 = start_run(prepare_run(make_run(replicas_per_path=2)), now=T0)
    fresh_caches(monkeypatch)
    workers = [make_worker(f"w{i}") for i in range(5)]
    burst = [granting.grant_lease(w, now=T0) for w in workers[:4]]
    assert all(g is not None for g in burst)
    assert granting.grant_lease(workers[4], now=T0) is None
    wait = pacing.retry_after_s(now=T0, rng=random.Random(0))
    assert 1 <= wait <= 2, wait  # one grant over the pace at 2/s: half a second, then jitter
    later = granting.grant_lease(workers[4], now=T0 + timedelta(seconds=wait))
    assert later is not None and later.unit.round_id == round0.pk


def test_an_idle_retry_after_is_jittered_above_the_idle_wait(
    db: None, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing queued, nothing closing: between the idle wait and 1.5 times it, so waiters
    that asked together drift apart."""
    settings.DIPACO_IDLE_POLL_RATE = 1
    fresh_caches(monkeypatch)
    seen = [make_worker(f"idle-{i}") for i in range(10)]
    Worker.objects.filter(pk__in=[w.pk for w in seen]).update(last_seen=T0)
    waits = {pacing.retry_after_s(now=T0, rng=random.Random(i)) for i in range(50)}
    assert min(waits) >= 10 and max(waits) <= 15 and len(waits) >= 4, waits


@pytest.mark.django_db(transaction=True)
def test_a_grant_whose_answer_was_lost_is_given_again_under_a_new_secret_until_it_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker at its lease limit that asks again never heard its grant (it would have
    heartbeated): it gets the same lease back, the lost secret stops working, and once the
    lease is in use asking again is refused as before (issue 23)."""
    from dipaco_server.runs.errors import LeaseLimitReached, LeaseSecretInvalid

    start_run(prepare_run(make_run(replicas_per_path=2)), now=T0)
    worker = make_worker("lossy-connection")
    fresh_caches(monkeypatch)
    first = granting.grant_lease(worker, now=T0)
    assert first is not None
    again = granting.grant_lease(worker, now=T0 + timedelta(seconds=31))
    assert again is not None and again.lease.pk == first.lease.pk
    assert again.secret != first.secret
    assert Lease.objects.filter(worker=worker).count() == 1
    assert WorkUnit.objects.filter(state=WorkUnit.State.LEASED).count() == 1
    with pytest.raises(LeaseSecretInvalid):
        leasing.load_own_lease(worker, first.lease.pk, first.secret)
    assert leasing.load_own_lease(worker, again.lease.pk, again.secret).pk == first.lease.pk

    # Heard now (a heartbeat): asking again is the worker's mistake, refused with 409.
    leasing.heartbeat(worker, again.lease.pk, again.secret, now=T0 + timedelta(seconds=32))
    with pytest.raises(LeaseLimitReached):
        granting.grant_lease(worker, now=T0 + timedelta(seconds=33))


def test_waiters_of_an_outer_step_slower_than_expected_ask_at_the_grant_rate_not_twice_it(
    db: None, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the expected opening (round 0's prior, or a step slower than the last), each
    waiter asks again after waiting workers / DIPACO_GRANT_RATE seconds on average: their
    asks add up to the grant rate, the most the opening will grant. (Drawn over [0, spread]
    before: twice the rate, every extra ask a 204 on the cores the outer step runs on.)"""
    settings.DIPACO_GRANT_RATE = GRANT_RATE
    round0 = start_run(prepare_run(make_run(replicas_per_path=2)), now=T0)
    seen = [make_worker(f"waiting-{i}") for i in range(VOLUNTEERS)]
    closing_at = T0 + timedelta(minutes=10)
    Worker.objects.filter(pk__in=[w.pk for w in seen]).update(last_seen=closing_at)
    assert mark_round_closing(round0, now=closing_at)
    fresh_caches(monkeypatch)
    late = closing_at + timedelta(seconds=pacing.DEFAULT_OUTER_S + 60)
    waits = [pacing.retry_after_s(now=late, rng=random.Random(i)) for i in range(400)]
    spread = VOLUNTEERS / GRANT_RATE  # 10 s
    assert min(waits) >= 1 and max(waits) <= 2 * spread
    mean = sum(waits) / len(waits)  # ceil adds about half a second
    # mean >= waiting / rate: their asks add up to at most the grant rate
    assert spread <= mean <= spread + 1.5, mean


@pytest.mark.django_db(transaction=True)
def test_a_slow_outer_step_is_not_sent_again_while_its_modules_keep_stepping(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beat's sweep sends a closing round's steps again only when none of its modules stepped
    within DIPACO_ROUND_CLOSE_RETRY_S (the broker lost them), not merely because the round has
    been closing that long; and the next round's expected opening counts from when the round
    began closing, whatever the resend does to closing_at."""
    from types import SimpleNamespace

    from dipaco_server.rounds.lifecycle.tasks import resend_stalled_rounds
    from dipaco_server.rounds.models import OuterStep
    from tests.test_worker_api import sent_tasks

    settings.DIPACO_ROUND_CLOSE_RETRY_S = 600
    round0 = start_run(prepare_run(make_run(replicas_per_path=1)), now=T0)
    began = datetime.now(UTC) - timedelta(minutes=15)
    assert mark_round_closing(round0, now=began)
    module = round0.run.modules.first()
    assert module is not None
    step = OuterStep.objects.create(round=round0, module=module, outcome="kept")
    task = SimpleNamespace(request=SimpleNamespace(delivery_info=None))
    sent_tasks()  # the broker folder from empty

    assert resend_stalled_rounds(task) == [], "a module stepped a minute ago: slow, not lost"
    assert not [name for name, _ in sent_tasks() if name.endswith("close_round")]

    OuterStep.objects.filter(pk=step.pk).update(created_at=began + timedelta(minutes=1))
    assert resend_stalled_rounds(task) == [(round0.run_id, 0)], "no step for 14 minutes: lost"
    assert [name for name, _ in sent_tasks() if name.endswith("close_round")]
    resent = Round.objects.get(pk=round0.pk)
    assert resent.closing_at > began and resent.closing_started_at == began

    fresh_caches(monkeypatch)
    assert pacing._closing_round() == (began, pacing.DEFAULT_OUTER_S)

    # Round 1's waiters expect its close to take as long as round 0's did: from when round 0
    # began closing to round 1's opening, 20 minutes, not the 5 since the resend.
    opened = began + timedelta(minutes=20)
    mark_round_closed(round0, now=opened)
    round1 = open_round(round0.run, 1, now=opened)
    round1_closing = opened + timedelta(minutes=30)
    assert mark_round_closing(round1, now=round1_closing)
    fresh_caches(monkeypatch)
    assert pacing._closing_round() == (round1_closing, 20 * 60.0)
