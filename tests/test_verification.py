"""Replica disagreement settled by evidence, identical Δs, claimed tokens and credit (issue 34).

Real services as in tests/test_untrusted.py (PostgreSQL, the blob store, the lease and
completion services, the outer step with its scorer reading real shards): a replicated
DiLoCo unit whose two copies disagree, a copy of a refused original, and credit that
follows the work a Δ verifiably did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.config import OuterConfig
from dipaco_server.rounds.models import Contribution, OuterStep
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import rules
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.workers import trust
from dipaco_server.workers.errors import WorkerDistrusted
from dipaco_server.workers.models import Worker
from tests.test_outer_tasks import DILOCO, running_run
from tests.test_untrusted import (
    INNER,
    noise,
    reasons,
    scaled,
    step_round,
    submit,
    two_worker_run,
    with_data,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


def scored_replicated_run(work: Path, settings: Any) -> tuple[Any, Any]:
    """One unit a round, every unit also issued to a second worker, proof of useful work on."""
    settings.DIPACO_REPLICATION_RATE = 1.0
    run = running_run(DILOCO, replicas=1, inner=INNER, data={"val_fraction": 0.2})
    return run, with_data(run, work)


def refreshed(*workers: Worker) -> list[Worker]:
    for worker in workers:
        worker.refresh_from_db()
    return list(workers)


def test_a_replica_disagreement_rejects_only_the_copy_its_score_finds_worse(
    work: Path, settings: Any
) -> None:
    """A lazy check copy (a fifth of the honest Δ: norms 5 x apart, so the copies
    disagree) passes the screen on its own; the two scores settle it, and the honest
    original keeps its acceptance, its credit and its trust."""
    settings.DIPACO_MIN_TRUST = 0.3
    run, sources = scored_replicated_run(work, settings)
    honest, _ = submit(run, "honest", sources)
    lazy, _ = submit(run, "lazy", sources, scaled(0.2))
    step_round(run, 0)

    assert reasons(run, honest) == {""}
    assert reasons(run, lazy) == {"replica_disagrees"}
    honest, lazy = refreshed(honest, lazy)
    assert honest.trust == 1.0 and honest.replicas_disagreed == 0
    assert honest.units_completed == 1 and honest.tokens_processed > 0
    assert lazy.replicas_disagreed == 2 and lazy.trust == pytest.approx(0.49)  # two modules
    assert (lazy.units_completed, lazy.tokens_processed) == (0, 0)
    step = OuterStep.objects.get(round__run=run, round__t=0, module__module_id="shared")
    assert (step.outcome, step.accepted, step.rejected) == ("stepped", 1, 1)
    # Low trust: every unit it takes is replicated; below the minimum, no more work.
    settings.DIPACO_REPLICATION_RATE = 0.0
    assert trust.replication_rate(lazy) == 1.0
    Worker.objects.filter(pk=lazy.pk).update(trust=0.2)
    with pytest.raises(WorkerDistrusted):
        grant_lease(*refreshed(lazy))


def test_an_honest_check_copy_of_a_refused_original_is_aggregated_in_its_place(
    work: Path, settings: Any
) -> None:
    run, sources = scored_replicated_run(work, settings)
    cheat, _ = submit(run, "cheat", sources, noise)  # takes the original
    honest, _ = submit(run, "honest", sources)  # its check copy
    step_round(run, 0)

    assert reasons(run, cheat) == {"no_training_gain"}
    assert reasons(run, honest) == {""}
    checks = Contribution.objects.filter(unit__round__run=run, unit__replica__gte=CHECK_OFFSET)
    assert {c.lease.worker_id for c in checks} == {honest.pk}
    for module_id in ("0.0", "shared"):
        step = OuterStep.objects.get(round__run=run, round__t=0, module__module_id=module_id)
        honest_tokens = checks.get(module__module_id=module_id).tokens
        # The module stepped on the check copy's Δ, weighed by its tokens.
        assert (step.outcome, step.version, step.tokens) == ("stepped", 1, honest_tokens)
    (honest,) = refreshed(honest)
    assert honest.units_completed == 1 and honest.trust == 1.0


def test_identical_honest_deltas_confirm_nothing_and_both_pass_the_other_checks(
    work: Path, settings: Any
) -> None:
    """Training one unit twice on a CPU is bit-identical: no agreement is earned by it."""
    run, sources = scored_replicated_run(work, settings)
    first, _ = submit(run, "first", sources)
    second, _ = submit(run, "second", sources)
    step_round(run, 0)
    assert reasons(run, first) == reasons(run, second) == {""}
    for worker in refreshed(first, second):
        assert (worker.replicas_agreed, worker.replicas_disagreed) == (0, 0)
        assert worker.trust == 1.0


def test_two_colluders_uploading_one_flipped_delta_confirm_nothing_and_are_refused(
    work: Path, settings: Any
) -> None:
    run, sources = scored_replicated_run(work, settings)
    a, _ = submit(run, "colluder-a", sources, scaled(-1.0))
    b, _ = submit(run, "colluder-b", sources, scaled(-1.0))
    step_round(run, 0)
    assert reasons(run, a) == reasons(run, b) == {"no_training_gain"}
    for worker in refreshed(a, b):
        assert (worker.replicas_agreed, worker.units_completed, worker.tokens_processed) == (
            0,
            0,
            0,
        )
        # Not held (rules.held_no_gain): a flip raises its unit's loss past the band, and
        # costs its worker's trust, two modules' refusals each.
        assert worker.trust == pytest.approx(0.7**2)


def test_the_same_delta_twice_within_float_rounding_is_identical_not_agreement() -> None:
    torch.manual_seed(0)
    delta = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    rounded = {k: v * (1 + 1e-9) for k, v in delta.items()}
    other = {k: v + 0.3 * torch.randn_like(v) for k, v in delta.items()}
    cfg = OuterConfig()
    assert rules.settle_replicas(delta, rounded, cfg).kind == "identical"
    assert rules.settle_replicas(delta, other, cfg).kind == "agree"
    # Disagreeing with no score and no momentum: nothing tells which is right.
    flipped = {k: -v for k, v in delta.items()}
    assert rules.settle_replicas(delta, flipped, cfg).kind == "unsettled"
    good, bad = rules.Score(5.0, 4.0, 5.0, 4.9), rules.Score(5.0, 4.8, 5.0, 4.9)
    evidence = (rules.ReplicaEvidence(bad), rules.ReplicaEvidence(good))
    outcome = rules.settle_replicas(delta, flipped, cfg, evidence)
    assert (outcome.kind, outcome.loser) == ("disagree", 0)


def test_a_claim_one_token_short_of_the_unit_costs_what_a_whole_claim_costs(work: Path) -> None:
    run, sources = two_worker_run(work)
    whole = run.run_config.inner.steps * 4 * run.run_config.model.seq_len
    submit(run, "honest", sources)
    short, _ = submit(run, "short", sources, scaled(-1.0), tokens=whole - 1)
    step_round(run, 0)

    assert reasons(run, short) == {"no_training_gain"}
    (short,) = refreshed(short)
    assert short.trust == pytest.approx(0.7**2)  # as a whole unit's two rejections cost


def test_a_lazy_workers_credit_falls_with_its_work_and_the_leaderboard_counts_the_same(
    work: Path,
) -> None:
    from dipaco_web.queries import leaderboard, worker_rows

    run, sources = two_worker_run(work)
    honest, _ = submit(run, "honest", sources)
    lazy, _ = submit(run, "lazy", sources, scaled(0.1))  # a tenth of the work, all tokens
    step_round(run, 0)

    honest, lazy = refreshed(honest, lazy)
    whole = run.run_config.inner.steps * 4 * run.run_config.model.seq_len
    assert honest.tokens_processed == whole
    assert lazy.tokens_processed < whole / 2  # refused, or credited its share of the work
    rows = {r.worker.pk: r for r in worker_rows()}
    board = {r.worker.pk: r.accepted_tokens for r in leaderboard(list(rows.values()))}
    assert board[honest.pk] == honest.tokens_processed
    assert board.get(lazy.pk, 0) == lazy.tokens_processed


def test_in_a_modules_first_step_a_delta_against_its_peers_is_refused(work: Path) -> None:
    """No free first round: with no history and no momentum yet, a sign flip whose own
    unit it still helps (scoring off here) points against the round's other Δs."""
    run = running_run(DILOCO, replicas=3, inner=INNER, data={"val_fraction": 0.2},
                      outer={"score": False})  # fmt: skip
    sources = with_data(run, work)
    honest = [submit(run, f"honest-{i}", sources)[0] for i in range(2)]
    flipper, _ = submit(run, "flipper", sources, scaled(-1.0))
    step_round(run, 0)

    # The round's settlement over whole units takes it first (rounds.verification.first_round):
    # a minority against the rest, in every module.
    assert reasons(run, flipper) == {"first_round_against"}
    for worker in honest:
        assert reasons(run, worker) == {""}


pairs = rules.pairwise_cosines


def test_peer_refusals_settle_a_pair_by_gain_and_never_refuse_half_or_more() -> None:
    torch.manual_seed(1)
    honest = {"w": torch.randn(256)}
    near = {k: v + 0.5 * torch.randn_like(v) for k, v in honest.items()}
    flip = {k: -v for k, v in honest.items()}
    assert rules.peer_refusals(pairs({1: honest, 2: flip}), {1: 0.2, 2: 0.1}).keys() == {2}
    assert rules.peer_refusals(pairs({1: honest, 2: flip}), {1: None, 2: 0.1}) == {}
    assert rules.peer_refusals(pairs({1: honest, 2: near}), {1: 0.2, 2: 0.1}) == {}
    assert rules.peer_refusals(pairs({1: honest, 2: near, 3: flip}), {}).keys() == {3}
    two_against_two = {1: honest, 2: near, 3: flip, 4: {k: -v for k, v in near.items()}}
    assert rules.peer_refusals(pairs(two_against_two), {}) == {}


def test_credit_follows_the_gain_per_token_against_the_rounds_other_units() -> None:
    honest, lazy = rules.Score(6.0, 5.0, 6.0, 5.5), rules.Score(6.0, 5.8, 6.0, 5.9)
    peers = [(honest, 1.0), (rules.Score(6.0, 5.1, 6.0, 5.5), 1.0)]
    assert rules.useful_fraction(honest, 1.0, peers) == 1.0
    assert rules.useful_fraction(lazy, 1.0, peers) == pytest.approx(0.2 / 0.95, rel=1e-6)
    # Claiming half the tokens doubles the rate per token but credit stays within the claim.
    assert rules.useful_fraction(lazy, 0.5, peers) == pytest.approx(0.4 / 0.95, rel=1e-6)
    assert rules.useful_fraction(rules.Score(6.0, 6.2, 6.0, 6.0), 1.0, peers) == 0.0
    assert rules.useful_fraction(None, 1.0, peers) == 1.0  # nothing to measure against
