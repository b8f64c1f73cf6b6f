"""Trust is earned: probation, audits and the operator's trusted machines (workers.probation).

The rules as pure functions first; then on the real services (PostgreSQL, the blob store,
the lease and completion services and the outer step with its scorer on real shards), as
tests/test_replica_bias.py runs them: real honest Δs (dipaco.inner.train_path), each
worker's copy differing from another's by what differs between two machines (noise drawn
anew per unit).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import pytest

from dipaco import codecs
from dipaco.data.windows import ShardSource
from dipaco.inner import train_path
from dipaco_server.rounds.models import Contribution, WorkUnit
from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import Run
from dipaco_server.storage import get_blob_store
from dipaco_server.workers import probation
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_outer_tasks import DILOCO, running_run
from tests.test_replica_bias import added
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
    newcomer = probation.Standing(probation=True)
    assert probation.prefer_check(newcomer, False)
    assert probation.prefer_check(probation.Standing(operator_trusted=True), False)
    assert not probation.prefer_check(probation.Standing(), False)
    assert probation.prefer_check(probation.Standing(), True)  # a newcomer's unit waits


# --- on the real services ----------------------------------------------------------------------

TOKENS = INNER["steps"] * 4  # x seq_len below


def device(seed: int) -> Attack:
    """What differs between two honest machines: a fresh deviation every unit."""
    return lambda deltas: added(deltas, seed, 0.3)


def train(run: Run, worker: Worker, sources: dict[int, ShardSource], attack: Attack) -> WorkUnit:
    """`worker` asks for work, trains what it is given, uploads and completes."""
    granted = grant_lease(worker)
    assert granted is not None
    deltas = attack(honest_deltas(run, granted.unit, sources))
    tokens = TOKENS * run.run_config.model.seq_len
    reports = []
    for module_id, delta in deltas.items():
        data = codecs.encode(delta, "fp16")
        get_blob_store().put_bytes(upload_key(granted.lease, module_id), data)
        reports.append(
            ContributionReport(module_id, len(data), hashlib.sha256(data).hexdigest(), tokens)
        )
    complete(worker, granted.lease.pk, granted.secret, reports)
    return granted.unit


@pytest.mark.django_db
def test_a_new_worker_is_replicated_in_both_roles_until_trusted_and_honest_ones_pass(
    tmp_path: Path, settings: Any
) -> None:
    """Three newcomers, two partners needed: each round one trains the unit and another,
    asking next, is handed its check copy before anything else. After agreeing with both
    others, once in each role, a worker leaves probation, its next unit is not replicated
    (audit rate 0 here), and no honest copy was ever refused."""
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
        step_round(run, t)
    for w in workers:
        w.refresh_from_db()
        assert not w.probation, (w.name, w.partners)
        assert w.contributions_rejected == 0 and w.trust == 1.0
        assert w.audits == 1  # its one original, replicated
        assert w.units_completed == 2  # the check copy it trained is credited too
    assert not Contribution.objects.filter(unit__round__run=run).exclude(reason="").exists()
    established = train(run, workers[0], sources, device(200))
    assert not WorkUnit.objects.filter(
        round_id=established.round_id, replica__gte=CHECK_OFFSET
    ).exists()


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
    reports = []
    for module_id, delta in deltas.items():
        data = codecs.encode(delta, "fp16")
        get_blob_store().put_bytes(upload_key(granted.lease, module_id), data)
        reports.append(
            ContributionReport(module_id, len(data), hashlib.sha256(data).hexdigest(), tokens)
        )
    complete(worker, granted.lease.pk, granted.secret, reports)
    return unit


@pytest.mark.django_db
def test_honest_copies_differing_by_warm_and_cold_moments_are_never_refused(
    tmp_path: Path, settings: Any
) -> None:
    """Four honest newcomers over eight rounds, every pair and both roles: originals from
    warm moments, check copies cold, another device each. Their differences repeat for the
    worker that holds the moments (with the opposite sign in the other role), which the
    persistence rule must not take for a bias however often it sees them."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
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
