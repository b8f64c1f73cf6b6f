"""Rounds, leases and completions: the scheduling a worker sees, on the real database."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from dipaco.data.windows import unit_start, unit_tokens, unit_windows
from dipaco_server.rounds.lifecycle.close import (
    mark_round_closed,
    mark_round_closing,
    round_ready_to_close,
)
from dipaco_server.rounds.lifecycle.open import open_round, start_run
from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
from dipaco_server.rounds.protocol.grant import LeaseGrant, grant_lease
from dipaco_server.rounds.protocol.leases import expire_leases, heartbeat, release
from dipaco_server.rounds.protocol.pacing import heartbeat_interval_s
from dipaco_server.runs.errors import (
    ContributionConflict,
    ContributionInvalid,
    LeaseExpired,
    LeaseLimitReached,
    LeaseNotYours,
    LeaseSecretInvalid,
    ModulesNotReady,
    RoundClosed,
    RunNotActive,
)
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import transition
from dipaco_server.workers.errors import WorkerRevoked
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import revoke_worker
from tests.test_models import SHARD_TOKENS, make_run, make_worker, prepare_run

T0 = datetime(2030, 1, 1, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


@pytest.fixture
def round0(db: None) -> Round:
    """Round 0 of a running 2x2-path run with 2 replicas per path: 8 queued units."""
    return start_run(prepare_run(make_run(replicas_per_path=2)), now=T0)


def reports(
    grant: LeaseGrant, tokens: int | None = None, sha: str = "ab"
) -> list[ContributionReport]:
    """One well-formed report per module of the lease's path."""
    config = grant.unit.round.run.run_config
    count = tokens or unit_tokens(config)
    return [
        ContributionReport(
            m, 4096, (sha * 32)[:64], count, {"loss": 3.5, "tokens_per_second": 900.0}
        )
        for m in grant.unit.path.modules
    ]


def grant(worker: Worker, now: datetime = T0) -> LeaseGrant:
    granted = grant_lease(worker, now=now)
    assert granted is not None, "a unit should have been waiting"
    return granted


# --- opening a round ---------------------------------------------------------------


def test_open_round_queues_r_units_per_active_path_from_the_current_versions(round0: Round) -> None:
    run = round0.run
    units = list(round0.units.select_related("path").order_by("path__index", "replica"))
    assert len(units) == run.paths.count() * 2
    assert {u.state for u in units} == {WorkUnit.State.QUEUED}
    for unit in units:
        assert unit.base_versions == {m: 0 for m in unit.path.modules}
        # Where dipaco simulate starts unit (0, r): its path's windows, in the same order.
        assert unit.data_windows == unit_windows(run.run_config)
        assert unit.data_position == unit_start(run.run_config, 0, unit.replica)
    run.refresh_from_db()
    assert run.current_round == 0 and round0.deadline is not None


def test_opening_a_round_again_returns_it_without_new_units(round0: Round) -> None:
    again = open_round(round0.run, 0, now=T0 + MINUTE)
    assert again.pk == round0.pk
    assert WorkUnit.objects.count() == 8


def test_starting_a_run_without_module_versions_is_refused_and_it_stays_ready(
    db: None,
) -> None:
    run = make_run()
    run.paths.update(train_tokens=SHARD_TOKENS)
    for state in ("preparing", "ready"):
        transition(run, state)
    with pytest.raises(ModulesNotReady, match="prepare the run"):
        start_run(run)
    assert run.state == "ready" and Run.objects.get(pk=run.pk).state == "ready"
    assert not Round.objects.exists()


def test_starting_a_ready_run_opens_round_zero(db: None) -> None:
    run = prepare_run(make_run())
    round_ = start_run(run, now=T0)
    assert (round_.t, round_.state, run.state) == (0, Round.State.OPEN, Run.State.RUNNING)
    assert round_.units.count() == run.paths.count()


def test_a_round_cannot_open_before_the_previous_one_closed(round0: Round) -> None:
    with pytest.raises(RunNotActive, match=r"round 0 .* is not closed"):
        open_round(round0.run, 1, now=T0)


# --- granting ------------------------------------------------------------------------


def test_grant_lease_returns_none_when_no_unit_is_waiting(db: None) -> None:
    assert grant_lease(make_worker(), now=T0) is None


def test_a_paused_run_gets_no_leases(round0: Round) -> None:
    transition(round0.run, "paused")
    assert grant_lease(make_worker(), now=T0) is None
    transition(round0.run, "running")
    assert grant_lease(make_worker(), now=T0) is not None


def test_a_grant_leases_the_unit_with_a_secret_and_deadlines(round0: Round) -> None:
    granted = grant(make_worker())
    lease = Lease.objects.get(pk=granted.lease.pk)
    assert lease.state == Lease.State.ACTIVE and lease.attempt == 1
    assert lease.unit.state == WorkUnit.State.LEASED
    assert granted.secret not in lease.secret_hash
    policy = current_policy()
    assert lease.deadline == T0 + timedelta(seconds=policy.lease_timeout_s)
    assert lease.hard_deadline == T0 + timedelta(seconds=policy.lease_default_s)


@override_settings(DIPACO_LEASE_TIMEOUT_S=30, DIPACO_HEARTBEAT_RATE=0.1)
def test_with_more_workers_about_than_the_heartbeat_rate_allows_heartbeats_slow_down(
    round0: Round,
) -> None:
    """Five workers seen at 0.1 heartbeats/s: every 50 s instead of the timeout's 10 s, and a
    lease lives three intervals (150 s) without one; told in every heartbeat answer."""
    from dipaco_server.rounds.protocol import pacing

    pacing._heartbeating = (-math.inf, 0)  # this process's count from earlier tests
    workers = [make_worker(f"crowd{i}") for i in range(5)]
    Worker.objects.filter(pk__in=[w.pk for w in workers]).update(last_seen=timezone.now())
    assert pacing.heartbeat_interval_s() == 50.0 and pacing.lease_timeout_s() == 150.0
    held = grant(workers[0])
    assert held.lease.deadline == T0 + timedelta(seconds=150)
    renewed = heartbeat(workers[0], held.lease.pk, held.secret, now=T0 + MINUTE)
    assert renewed.deadline == T0 + MINUTE + timedelta(seconds=150)
    with override_settings(DIPACO_HEARTBEAT_RATE=100):
        pacing._heartbeating = (-math.inf, 0)
        assert pacing.heartbeat_interval_s() == 10.0, "few workers: the timeout's third"


@pytest.mark.django_db(transaction=True)
def test_concurrent_grants_never_hand_out_one_unit_twice() -> None:
    start_run(prepare_run(make_run(replicas_per_path=1)), now=T0)  # 4 units for 8 workers
    workers = [make_worker(f"w{i}") for i in range(8)]
    barrier, granted, lock = threading.Barrier(len(workers)), [], threading.Lock()

    def ask(worker: Worker) -> None:
        try:
            barrier.wait()
            result = grant_lease(worker, now=T0)
            with lock:
                granted.append(result.lease.unit_id if result else None)
        finally:
            connection.close()

    threads = [threading.Thread(target=ask, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    units = [u for u in granted if u is not None]
    assert len(granted) == 8
    assert len(units) == len(set(units)) == 4
    assert Lease.objects.count() == 4
    assert not WorkUnit.objects.filter(state=WorkUnit.State.QUEUED).exists()


@pytest.mark.django_db(transaction=True)
def test_on_postgresql_a_grant_skips_a_unit_another_grant_holds_locked() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SKIP LOCKED is PostgreSQL's; SQLite serialises writers instead")
    start_run(prepare_run(make_run(replicas_per_path=1)), now=T0)
    first = WorkUnit.objects.order_by("path__index").first()
    assert first is not None
    locked, done, granted = threading.Event(), threading.Event(), []

    def hold_first_unit() -> None:  # what a concurrent grant does mid-transaction
        try:
            with transaction.atomic():
                WorkUnit.objects.select_for_update().get(pk=first.pk)
                locked.set()
                done.wait(timeout=30)
        finally:
            connection.close()

    def ask() -> None:
        try:
            result = grant_lease(make_worker(), now=T0)
            granted.append(result.lease.unit_id if result else None)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_first_unit)
    holder.start()
    assert locked.wait(timeout=30)
    asker = threading.Thread(target=ask)
    asker.start()
    asker.join(timeout=10)
    blocked = asker.is_alive()
    done.set()
    holder.join(timeout=30)
    asker.join(timeout=30)
    assert not blocked, "the grant waited for the locked unit instead of skipping it"
    assert granted and granted[0] not in (None, first.pk)


def test_a_worker_gets_the_path_it_completed_last(round0: Round) -> None:
    worker = make_worker()
    first = grant(worker)
    complete(worker, first.lease.pk, first.secret, reports(first))
    for other in range(2):  # others take units, so coverage alone would pick another path
        grant(make_worker(f"other{other}"))
    second = grant(worker)
    assert second.unit.path_id == first.unit.path_id


def test_a_worker_gets_back_every_path_it_trained_not_only_the_last(db: None) -> None:
    """Two workers, four paths: each trains two paths a round. In the next round the one
    that finishes first must get its other path back (its AdamW state is warm there), not
    the lowest-numbered path, which the other worker trained (bench/platform_run.py: such
    cold units made a platform run drift from dipaco simulate)."""
    round0 = start_run(prepare_run(make_run(replicas_per_path=1)), now=T0)
    a, b = make_worker("a"), make_worker("b")
    trained: dict[int, list[int]] = {a.pk: [], b.pk: []}  # path ids, in completion order
    for worker in (a, b, a, b):  # round 0: a and b alternate, two units each
        unit = grant(worker)
        complete(worker, unit.lease.pk, unit.secret, reports(unit))
        trained[worker.pk].append(unit.unit.path_id)
    assert len(set(trained[a.pk] + trained[b.pk])) == 4
    assert mark_round_closing(round0) and mark_round_closed(round0)
    open_round(round0.run, 1, now=T0)
    first_a, first_b = grant(a), grant(b)
    assert first_a.unit.path_id == trained[a.pk][-1]  # the path each completed last
    assert first_b.unit.path_id == trained[b.pk][-1]
    complete(b, first_b.lease.pk, first_b.secret, reports(first_b))  # b finishes first
    assert grant(b).unit.path_id == trained[b.pk][0]  # not the lowest path left, a's
    complete(a, first_a.lease.pk, first_a.secret, reports(first_a))
    assert grant(a).unit.path_id == trained[a.pk][0]


def test_a_new_worker_gets_the_least_covered_path(round0: Round) -> None:
    paths = [grant(make_worker(f"w{i}")).unit.path_id for i in range(4)]
    assert len(set(paths)) == 4, "each path gets one replica before any gets a second"
    fifth = grant(make_worker("w5"))
    assert fifth.unit.replica == 1


@override_settings(DIPACO_WORKER_MAX_LEASES=1)
def test_a_worker_cannot_hold_more_leases_than_the_limit(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    heartbeat(worker, held.lease.pk, held.secret, now=T0)  # heard: not a lost answer
    with pytest.raises(LeaseLimitReached, match=str(held.lease.pk)):
        grant_lease(worker, now=T0)
    release(worker, held.lease.pk, held.secret, now=T0)
    assert grant_lease(worker, now=T0) is not None


def test_a_revoked_worker_gets_no_lease_and_loses_the_ones_it_holds(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    revoke_worker(worker)
    with pytest.raises(WorkerRevoked):
        grant_lease(worker, now=T0)
    with pytest.raises(WorkerRevoked):
        heartbeat(worker, held.lease.pk, held.secret, now=T0)
    assert expire_leases(now=T0) == 1  # before its deadline: revocation is enough
    assert WorkUnit.objects.get(pk=held.unit.pk).state == WorkUnit.State.QUEUED


def test_lease_budget_follows_the_workers_measured_speed(round0: Round) -> None:
    policy = current_policy()
    tokens = unit_tokens(round0.run.run_config)  # 10,240 tokens
    assert policy.lease_budget_s(tokens, None) == policy.lease_default_s
    assert policy.lease_budget_s(tokens, 1.0) == policy.lease_max_s  # hours: capped
    assert policy.lease_budget_s(tokens, 1e6) == policy.lease_min_s  # instant: floored
    slow = policy.lease_budget_s(tokens, 3.0)
    assert slow == pytest.approx(tokens / 3.0 * policy.lease_speed_margin)
    worker = make_worker()
    Worker.objects.filter(pk=worker.pk).update(measured_speed=3.0)
    worker.refresh_from_db()
    lease = grant(worker).lease
    # The unit is sized to units.target_seconds at 3 tokens/s: 900 x 3 // 512 = 5 steps,
    # and the budget is that unit's, not the whole one's.
    config = round0.run.run_config
    per_step = config.inner.batch_size * config.model.seq_len
    assert lease.steps == int(config.units.target_seconds * 3.0 // per_step) == 5
    sized = policy.lease_budget_s(lease.steps * per_step, 3.0)
    assert sized < slow and lease.hard_deadline == T0 + timedelta(seconds=sized)


# --- heartbeats, expiry, release ---------------------------------------------------------


def test_a_heartbeat_extends_the_deadline_but_never_past_the_hard_deadline(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    timeout = timedelta(seconds=current_policy().lease_timeout_s)
    lease = heartbeat(worker, held.lease.pk, held.secret, now=T0 + 4 * MINUTE)
    assert lease.deadline == T0 + 4 * MINUTE + timeout
    late = held.lease.hard_deadline - MINUTE
    Lease.objects.filter(pk=held.lease.pk).update(deadline=late)
    lease = heartbeat(worker, held.lease.pk, held.secret, now=late - MINUTE)
    assert lease.deadline == held.lease.hard_deadline
    with pytest.raises(LeaseExpired):
        heartbeat(worker, held.lease.pk, held.secret, now=held.lease.hard_deadline + MINUTE)


def test_an_expired_lease_returns_its_unit_to_the_queue(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    assert expire_leases(now=held.lease.deadline) == 0, "at the deadline it is still valid"
    assert expire_leases(now=held.lease.deadline + MINUTE) == 1
    assert Lease.objects.get(pk=held.lease.pk).state == Lease.State.EXPIRED
    assert WorkUnit.objects.get(pk=held.unit.pk).state == WorkUnit.State.QUEUED
    assert Worker.objects.get(pk=worker.pk).leases_expired == 1
    # All 8 units are waiting again: the requeued one is handed out once more, as attempt 2.
    grants = [grant(make_worker(f"w{i}"), now=T0 + 10 * MINUTE) for i in range(8)]
    again = [g for g in grants if g.unit.pk == held.unit.pk]
    assert len(again) == 1 and again[0].lease.attempt == 2
    assert grant_lease(make_worker("late"), now=T0 + 10 * MINUTE) is None


def test_the_beat_sweep_requeues_units_of_leases_past_their_deadline(round0: Round) -> None:
    from dipaco_server.rounds.lifecycle.tasks import sweep_leases

    held = grant(make_worker(), now=timezone.now() - timedelta(hours=1))  # long silent
    fresh = grant(make_worker("fresh"), now=timezone.now())
    assert sweep_leases.apply().get() == 1
    assert WorkUnit.objects.get(pk=held.unit.pk).state == WorkUnit.State.QUEUED
    assert Lease.objects.get(pk=fresh.lease.pk).state == Lease.State.ACTIVE


@override_settings(DIPACO_UNIT_MAX_ATTEMPTS=2)
def test_a_unit_is_given_up_after_too_many_attempts(db: None) -> None:
    one_path = make_run(replicas_per_path=1, layout={"levels": [{"blocks": [0, 4]}]})
    start_run(prepare_run(one_path), now=T0)  # one path, one unit
    now = T0
    for _ in range(2):
        held = grant(make_worker(f"w{now.minute}"), now=now)
        now = held.lease.deadline + MINUTE
        expire_leases(now=now)
    assert WorkUnit.objects.get().state == WorkUnit.State.EXPIRED
    assert grant_lease(make_worker("last"), now=now) is None


def test_release_puts_the_unit_back_and_twice_is_a_no_op(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    assert release(worker, held.lease.pk, held.secret, now=T0).state == Lease.State.RELEASED
    assert release(worker, held.lease.pk, held.secret, now=T0).state == Lease.State.RELEASED
    assert WorkUnit.objects.get(pk=held.unit.pk).state == WorkUnit.State.QUEUED
    assert Worker.objects.get(pk=worker.pk).leases_expired == 0


# --- completing -------------------------------------------------------------------------


def test_complete_records_pending_contributions_under_server_built_keys(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    rows = complete(worker, held.lease.pk, held.secret, reports(held), now=T0 + MINUTE)
    unit = held.unit
    assert {c.module.module_id for c in rows} == set(unit.path.modules)
    for row in rows:
        assert row.status == Contribution.Status.PENDING
        assert row.blob_key == (
            f"runs/{round0.run_id}/rounds/0/{unit.pk}/{held.lease.pk}/"
            f"{row.module.module_id}.safetensors"
        )
        assert row.blob_key == upload_key(held.lease, row.module.module_id)
    assert WorkUnit.objects.get(pk=unit.pk).state == WorkUnit.State.DONE
    stored = Worker.objects.get(pk=worker.pk)
    # The claim (900 tokens/s) counts up to the server's measure: tokens over the minute
    # between grant and completion (workers.speed).
    measured = unit_tokens(round0.run.run_config) / MINUTE.total_seconds()
    assert stored.measured_speed == pytest.approx(min(900.0, measured))
    # No credit before the outer step accepted its Δs (issue 19: rounds.outer.step._credit).
    assert stored.units_completed == 0 and stored.tokens_processed == 0


def test_complete_under_an_expired_lease_is_salvaged_while_its_unit_is_free(
    round0: Round,
) -> None:
    """A worker still alive when its lease ran out uploads its (partial) Δ: accepted while
    no other lease holds the unit, swept or not yet swept."""
    worker = make_worker()
    held = grant(worker)
    late = held.lease.deadline + MINUTE
    expire_leases(now=late)
    assert WorkUnit.objects.get(pk=held.unit.pk).state == WorkUnit.State.QUEUED
    half = unit_tokens(round0.run.run_config) // 2
    rows = complete(worker, held.lease.pk, held.secret, reports(held, half), now=late)
    assert {r.tokens for r in rows} == {half}
    assert Lease.objects.get(pk=held.lease.pk).state == Lease.State.COMPLETED
    assert WorkUnit.objects.get(pk=held.unit.pk).state == WorkUnit.State.DONE
    assert not Lease.objects.filter(unit=held.unit, state=Lease.State.ACTIVE).exists()


def test_complete_under_an_expired_lease_is_refused_once_another_lease_took_the_unit(
    round0: Round,
) -> None:
    worker = make_worker()
    held = grant(worker)
    late = held.lease.deadline + MINUTE
    expire_leases(now=late)
    WorkUnit.objects.exclude(pk=held.unit.pk).update(state=WorkUnit.State.DONE)
    other = grant(make_worker("other"), now=late)
    assert other.unit.pk == held.unit.pk
    with pytest.raises(LeaseExpired, match="ask for a new lease"):
        complete(worker, held.lease.pk, held.secret, reports(held), now=late)
    assert not Contribution.objects.exists()


def test_a_completion_claiming_more_tokens_than_its_lease_allowed_is_refused(
    round0: Round,
) -> None:
    config = round0.run.run_config
    per_step = config.inner.batch_size * config.model.seq_len
    worker = make_worker()
    Worker.objects.filter(pk=worker.pk).update(measured_speed=3.0)  # 5-step units
    worker.refresh_from_db()
    held = grant(worker)
    assert held.lease.steps == 5 and "900 s target" in held.lease.size_reason
    with pytest.raises(ContributionInvalid, match=f"must be {per_step}..{5 * per_step}"):
        complete(worker, held.lease.pk, held.secret, reports(held), now=T0 + MINUTE)
    rows = complete(worker, held.lease.pk, held.secret, reports(held, 3 * per_step), now=T0)
    assert {r.tokens for r in rows} == {3 * per_step}


def test_units_are_sized_to_the_workers_speed_and_a_new_worker_calibrates() -> None:
    from dipaco.config import RunConfig
    from dipaco_server.rounds.protocol.sizing import size_unit

    config = RunConfig.tiny(inner={"steps": 500}, units={"target_seconds": 900})
    per_step = config.inner.batch_size * config.model.seq_len
    new = size_unit(config, None)
    assert new.steps == 500 and new.seconds == config.units.calibration_seconds
    slow = size_unit(config, per_step / 10)  # 10 s a step: 90 steps in 900 s
    assert (slow.steps, slow.seconds) == (90, None) and "= 90 steps" in slow.reason
    fast = size_unit(config, per_step * 100.0)
    assert fast.steps == 500 and "capped at H = 500" in fast.reason
    crawl = size_unit(config, per_step / 10_000)  # a step takes longer than the target
    assert crawl.steps == 1 and "raised to 1" in crawl.reason
    soon = size_unit(config, per_step / 10, round_deadline=T0 + MINUTE, now=T0)
    assert soon.steps == 6 and "before the round's deadline" in soon.reason
    # The agent stops a heartbeat interval early: a unit sized to the deadline itself would
    # be cut short again, so the margin comes off the time it is sized to.
    margin = size_unit(config, per_step / 10, round_deadline=T0 + MINUTE, now=T0, stop_margin_s=20)
    assert margin.steps == 4 and "the 40 s left to train" in margin.reason
    back = size_unit(config, per_step / 10, resumed_steps=90)
    assert (back.steps, back.trained_steps) == (180, 90) and "resumes" in back.reason


def test_a_worker_whose_lease_expired_gets_its_unit_back_to_resume_it(round0: Round) -> None:
    """After a crash the agent keeps its checkpoint per unit: the unit comes back to it,
    not the path the usual order (warm path, least covered, lowest index) would pick."""
    w = [make_worker(f"w{i}") for i in range(7)]
    first = grant(w[0])  # path 0 r0
    complete(w[0], first.lease.pk, first.secret, reports(first), now=T0)
    for i in (1, 2, 3, 4, 5, 6):  # p1 r0, p2 r0, p3 r0, then p0 r1, p1 r1, p2 r1
        grant(w[i])
    held = grant(w[0])
    assert (held.unit.path.index, held.unit.replica) == (3, 1)
    Lease.objects.filter(pk=held.lease.pk).update(deadline=T0)
    expire_leases(now=T0 + MINUTE)
    out = Lease.objects.get(worker=w[5], state=Lease.State.ACTIVE)
    Lease.objects.filter(pk=out.pk).update(deadline=T0)
    expire_leases(now=T0 + MINUTE)  # p1 r1 is queued too, and comes first in the order
    again = grant(w[0], now=T0 + MINUTE)
    assert again.unit.pk == held.unit.pk and again.lease.pk != held.lease.pk
    assert again.lease.steps == round0.run.run_config.inner.steps
    assert grant(w[5], now=T0 + MINUTE).unit.pk == out.unit_id  # its own, likewise


def test_a_duplicate_complete_with_identical_content_is_a_no_op(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    first = complete(worker, held.lease.pk, held.secret, reports(held), now=T0 + MINUTE)
    again = complete(worker, held.lease.pk, held.secret, reports(held), now=T0 + 2 * MINUTE)
    assert [c.pk for c in again] == [c.pk for c in first]
    assert Contribution.objects.count() == len(first)


def test_a_duplicate_complete_with_different_content_is_refused(round0: Round) -> None:
    worker = make_worker()
    held = grant(worker)
    complete(worker, held.lease.pk, held.secret, reports(held), now=T0 + MINUTE)
    with pytest.raises(ContributionConflict, match="already completed"):
        complete(worker, held.lease.pk, held.secret, reports(held, sha="cd"), now=T0 + MINUTE)
    assert set(Contribution.objects.values_list("sha256", flat=True)) == {"ab" * 32}


def test_another_workers_lease_or_a_wrong_secret_is_refused(round0: Round) -> None:
    owner, intruder = make_worker("owner"), make_worker("intruder")
    held = grant(owner)
    with pytest.raises(LeaseNotYours):
        complete(intruder, held.lease.pk, held.secret, reports(held))
    with pytest.raises(LeaseNotYours):
        heartbeat(intruder, held.lease.pk, held.secret, now=T0)
    with pytest.raises(LeaseSecretInvalid):
        complete(owner, held.lease.pk, "dpl_guess", reports(held), now=T0)
    assert Lease.objects.get(pk=held.lease.pk).state == Lease.State.ACTIVE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop-module", "missing"),
        ("extra-module", "unexpected"),
        ("inflate-tokens", "tokens"),
        ("huge-size", "size"),
        ("bad-sha", "sha256"),
        ("nan-metric", "finite"),
    ],
)
def test_complete_refuses_reports_that_do_not_fit_the_unit(
    round0: Round, change: str, message: str
) -> None:
    worker = make_worker()
    held = grant(worker)
    given = reports(held)
    first = given[0]
    if change == "drop-module":
        given = given[1:]
    elif change == "extra-module":
        given.append(ContributionReport("9.9", 1, "0" * 64, first.tokens))
    elif change == "inflate-tokens":
        given = [ContributionReport(r.module_id, r.size, r.sha256, r.tokens * 100) for r in given]
    elif change == "huge-size":
        given[0] = ContributionReport(first.module_id, 10**12, first.sha256, first.tokens)
    elif change == "bad-sha":
        given[0] = ContributionReport(first.module_id, first.size, "../../x", first.tokens)
    else:
        given[0] = ContributionReport(
            first.module_id, first.size, first.sha256, first.tokens, {"loss": float("nan")}
        )
    with pytest.raises(ContributionInvalid, match=message):
        complete(worker, held.lease.pk, held.secret, given, now=T0 + MINUTE)
    assert Lease.objects.get(pk=held.lease.pk).state == Lease.State.ACTIVE


def test_upload_keys_refuse_a_module_outside_the_path(round0: Round) -> None:
    held = grant(make_worker())
    other = next(m for m in ("0.0", "0.1") if m not in held.unit.path.modules)
    with pytest.raises(ContributionInvalid, match="not part of path"):
        upload_key(held.lease, other)


# --- closing -------------------------------------------------------------------------------


def finish(units: int, now: datetime) -> Iterator[LeaseGrant]:
    for i in range(units):
        worker = make_worker(f"finisher{i}")
        held = grant(worker, now=now)
        complete(worker, held.lease.pk, held.secret, reports(held), now=now)
        yield held


def test_a_round_is_ready_to_close_when_every_unit_is_done(round0: Round) -> None:
    list(finish(7, T0 + 10 * MINUTE))
    assert not round_ready_to_close(round0, now=T0 + 10 * MINUTE)
    list(finish(1, T0 + 10 * MINUTE))
    assert round_ready_to_close(round0, now=T0 + 10 * MINUTE)


@override_settings(DIPACO_ROUND_QUORUM=0.5)
def test_a_quorum_closes_a_round_only_after_its_deadline(round0: Round) -> None:
    assert round0.deadline is not None
    list(finish(3, round0.deadline - MINUTE))
    assert not round_ready_to_close(round0, now=round0.deadline + MINUTE)  # 3 of 8
    list(finish(1, round0.deadline - MINUTE))  # a quorum, just before the fixed deadline
    assert not round_ready_to_close(round0, now=round0.deadline - MINUTE)  # 4 of 8, early
    assert round_ready_to_close(round0, now=round0.deadline)  # never later than it


@override_settings(DIPACO_ROUND_QUORUM=0.5, DIPACO_ROUND_DEADLINE_MADS=3.0)
def test_a_quorum_moves_the_deadline_up_to_median_plus_k_mad_of_durations_then_waits_for_partials(
    round0: Round,
) -> None:
    """Units that took 10, 10, 12 and 14 min: median 11, MAD 1 (under 10 % of the median,
    so 1.1), and the last unit out was granted at 5 min: the deadline moves from an hour to
    5 + 11 + 3 x 1.1 = 19.3 min plus the heartbeat interval by which agents stop before a
    deadline, but only once every unit has started. A unit still leased then gets
    DIPACO_ROUND_SALVAGE_GRACE_S to hand in its partial Δ."""
    finishers = [grant(make_worker(f"finisher{i}"), now=T0) for i in range(4)]
    for held, minutes in zip(finishers[:3], (10, 10, 12), strict=True):
        complete(held.lease.worker, held.lease.pk, held.secret, reports(held),
                 now=T0 + minutes * MINUTE)  # fmt: skip
    assert not round_ready_to_close(round0, now=T0 + 14 * MINUTE)  # 3 of 8: no quorum
    held = finishers[3]
    complete(held.lease.worker, held.lease.pk, held.secret, reports(held), now=T0 + 14 * MINUTE)
    assert not round_ready_to_close(round0, now=T0 + 50 * MINUTE)  # 4 units never started
    round0.refresh_from_db()
    assert round0.deadline == T0 + timedelta(seconds=current_policy().round_deadline_s)
    out = [grant(make_worker(f"late{i}"), now=T0 + i * MINUTE) for i in range(2)]
    straggler = grant(make_worker("straggler"), now=T0 + 5 * MINUTE)
    more = grant(make_worker("slow"), now=T0 + 5 * MINUTE)
    assert len(out) == 2 and more
    assert not round_ready_to_close(round0, now=T0 + 16 * MINUTE)
    round0.refresh_from_db()
    margin = timedelta(seconds=heartbeat_interval_s())
    expected = T0 + timedelta(minutes=5 + 11 + 3 * 1.1) + margin
    assert abs((round0.deadline - expected).total_seconds()) < 1e-3
    # The last unit out can train its expected median + k·MAD before its agent stops.
    trains = round0.deadline - margin - more.lease.granted_at
    assert abs((trains - timedelta(minutes=11 + 3 * 1.1)).total_seconds()) < 1e-3
    grace = timedelta(seconds=current_policy().round_salvage_grace_s)
    assert not round_ready_to_close(round0, now=expected + grace / 2), "the stragglers' turn"
    assert round_ready_to_close(round0, now=expected + grace)
    half = unit_tokens(round0.run.run_config) // 2  # a partial Δ, still in time
    complete(straggler.lease.worker, straggler.lease.pk, straggler.secret,
             reports(straggler, half), now=expected + grace / 2)  # fmt: skip
    assert WorkUnit.objects.get(pk=straggler.unit.pk).state == WorkUnit.State.DONE


@override_settings(DIPACO_ROUND_QUORUM=0.5, DIPACO_ROUND_DEADLINE_MADS=3.0)
def test_the_completion_path_recomputes_the_adaptive_deadline_at_most_every_few_seconds(
    round0: Round,
) -> None:
    """Every completion asks whether its round may close; the adaptive deadline reads all of
    the round's completed leases, so the completion path (adapt_every_s) recomputes it once
    per ADAPT_EVERY_S per process and round, and beat's sweep (no throttle) every time."""
    from dipaco_server.rounds.lifecycle import close

    close._adapted_at.clear()
    finishers = [grant(make_worker(f"finisher{i}"), now=T0) for i in range(4)]
    for held, minutes in zip(finishers, (10, 10, 12, 14), strict=True):
        complete(held.lease.worker, held.lease.pk, held.secret, reports(held),
                 now=T0 + minutes * MINUTE)  # fmt: skip
    for i in range(4):
        grant(make_worker(f"late{i}"), now=T0 + i * MINUTE)
    margin = timedelta(seconds=heartbeat_interval_s())
    expected = T0 + timedelta(minutes=3 + 11 + 3 * 1.1) + margin
    fixed = T0 + timedelta(seconds=current_policy().round_deadline_s)

    assert not round_ready_to_close(round0, now=T0 + 16 * MINUTE, adapt_every_s=60.0)
    round0.refresh_from_db()
    assert abs((round0.deadline - expected).total_seconds()) < 1e-3, "the first one recomputes"
    Round.objects.filter(pk=round0.pk).update(deadline=fixed)
    round0.refresh_from_db()
    assert not round_ready_to_close(round0, now=T0 + 16 * MINUTE, adapt_every_s=60.0)
    round0.refresh_from_db()
    assert round0.deadline == fixed, "within the interval the stored deadline decides"
    assert not round_ready_to_close(round0, now=T0 + 16 * MINUTE)  # beat's sweep: always
    round0.refresh_from_db()
    assert abs((round0.deadline - expected).total_seconds()) < 1e-3


def test_closing_wins_once_and_refuses_late_work(round0: Round) -> None:
    list(finish(4, T0))
    straggler = make_worker("straggler")
    held = grant(straggler)
    assert mark_round_closing(round0, now=T0 + MINUTE)
    assert not mark_round_closing(round0, now=T0 + MINUTE), "only one caller runs the outer step"
    with pytest.raises(RoundClosed, match="no longer needed"):
        complete(straggler, held.lease.pk, held.secret, reports(held), now=T0 + MINUTE)
    assert grant_lease(make_worker("late"), now=T0 + MINUTE) is None
    assert round0.units.filter(state=WorkUnit.State.DONE).count() == 4
    assert mark_round_closed(round0, now=T0 + 2 * MINUTE) and round0.state == Round.State.CLOSED
    next_round = open_round(round0.run, 1, now=T0 + 3 * MINUTE)
    assert next_round.units.count() == 8
    assert Run.objects.get(pk=round0.run_id).current_round == 1


def test_a_cancelled_runs_round_never_closes_and_its_leases_stop(round0: Round) -> None:
    list(finish(7, T0))
    worker = make_worker("last")
    held = grant(worker)
    complete_later = reports(held)
    transition(round0.run, "cancelled")
    assert not round_ready_to_close(round0, now=round0.deadline)
    with pytest.raises(RunNotActive, match="stop training"):
        heartbeat(worker, held.lease.pk, held.secret, now=T0)
    with pytest.raises(RunNotActive):
        complete(worker, held.lease.pk, held.secret, complete_later, now=T0)


def test_the_idle_retry_after_grows_with_the_workers_seen_lately(
    db: None, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dipaco_server.rounds.protocol import pacing

    def fresh() -> int:
        monkeypatch.setattr(pacing, "_active_workers", (float("-inf"), 0))
        return pacing.idle_retry_after_s(now=T0)

    seen = [make_worker() for _ in range(5)]
    Worker.objects.filter(pk__in=[w.pk for w in seen]).update(last_seen=T0 - MINUTE)
    gone, revoked = make_worker(), make_worker()
    Worker.objects.filter(pk=gone.pk).update(last_seen=T0 - 10 * MINUTE)
    Worker.objects.filter(pk=revoked.pk).update(last_seen=T0, revoked=True)
    settings.DIPACO_IDLE_POLL_RATE = 1
    assert fresh() == 5, "five live workers at one poll per second: every 5 s each"
    settings.DIPACO_IDLE_POLL_RATE = 100
    assert fresh() == 1, "a handful of workers asks again after a second"
    settings.DIPACO_IDLE_POLL_RATE = 0.001
    assert fresh() == 60, "never more than a minute"


def test_grants_from_cached_groups_skip_a_path_stopped_meanwhile(round0: Round) -> None:
    """The (round, path) counts are cached for a second per process; a unit of a path
    that finished within that second is still never granted."""
    from dipaco_server.runs.models import Path

    first = grant(make_worker("first"))  # counts the groups and caches them
    stopped = first.unit.path_id
    Path.objects.filter(pk=stopped).update(state=Path.State.FINISHED)
    granted = [grant(make_worker(f"w{i}")) for i in range(6)]
    paths = {g.unit.path_id for g in granted if g is not None}
    assert stopped not in paths and len(paths) == 3, paths
    assert WorkUnit.objects.filter(path_id=stopped, state=WorkUnit.State.QUEUED).count() == 1


def test_a_round_opened_within_the_cache_second_is_granted_at_once(db: None) -> None:
    from dipaco_server.rounds.protocol import pacing

    assert grant_lease(make_worker("early"), now=T0) is None  # nothing queued yet
    pacing.cached_groups(refresh=True)  # caches "no groups"
    start_run(prepare_run(make_run(replicas_per_path=1)), now=T0)
    assert grant_lease(make_worker("prompt"), now=T0) is not None
