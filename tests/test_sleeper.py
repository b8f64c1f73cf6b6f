"""Trust earned once keeps being earned (issue 61), on the real services: a sleeper (honest
for its first units, then a fixed direction at half its Δ's norm added to every unit) is
audited within a bounded number of units of turning (rounds.verification.replication:
audit_rate, audit_overdue), its audit is doubtful rather than an agreement
(rules.AGREE_COSINE), and from then on every unit of it is replicated and its credit held
(workers.trust.doubt) until the repetition rule refuses it; honest workers are never
refused. And six honest newcomers all leave probation within a bounded number of rounds."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.config import OuterConfig
from dipaco_server.rounds.models import Contribution, WorkUnit
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import replication, rules
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import Run
from dipaco_server.workers import probation, trust
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_outer_tasks import DILOCO, GRID, running_run
from tests.test_probation import ALL_MODULES, TOKENS
from tests.test_replica_bias import added, hand_in
from tests.test_untrusted import INNER, honest_deltas, step_round, with_data


def test_half_the_norm_added_is_doubtful_and_two_machines_agree() -> None:
    """The comparison's bar: an honest copy against the same Δ plus a fixed direction at
    0.5 x its norm (cosine 0.894) is doubtful, not agreement; two honest copies, each off
    by a fresh 0.3 x the norm (the tests' model of two machines, cosine 0.917), agree; a
    flip still disagrees."""
    generator = torch.Generator().manual_seed(3)
    delta = {
        "w": torch.randn(256, 64, generator=generator),
        "b": torch.randn(64, generator=generator),
    }
    cfg = OuterConfig()

    def plus(size: float, seed: int) -> dict[str, torch.Tensor]:
        return added({"m": delta}, seed, size)["m"]

    biased = rules.settle_replicas(delta, plus(0.5, 7), cfg)
    assert biased.kind == "doubtful" and "0.9" in biased.why
    assert rules.replicas_agree(delta, plus(0.5, 7), cfg)[0]  # within the old tolerance
    assert rules.settle_replicas(plus(0.3, 1), plus(0.3, 2), cfg).kind == "agree"
    flipped = {k: -v for k, v in delta.items()}
    assert rules.settle_replicas(delta, flipped, cfg).kind == "unsettled"


class _NeverDrawn:
    """replication._rng whose draws never audit: only the bound does."""

    def random(self) -> float:
        return 0.999999

    def choice(self, seq: Any) -> Any:
        return seq[0]


def _sleeper_units(run: Run, sleeper: Worker) -> list[WorkUnit]:
    return list(
        WorkUnit.objects.filter(
            round__run=run, replica__lt=CHECK_OFFSET, leases__worker=sleeper
        ).order_by("round__t", "pk")
    )


@pytest.mark.django_db
def test_a_sleeper_is_audited_within_the_bound_doubted_and_its_credit_held(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four established workers on a DiLoCo run of two units a round, the sleeper asking
    first, the others in an order that turns each round (the repetition rule needs
    differences against two partners besides the current one: four workers); the sleeper
    turns after `turn` honest units. Random audits are switched off, so
    only the bound (`audit_overdue`: one audit at most ceil(AUDIT_SPREAD / rate) units
    apart) checks it: its first unit after turning that is replicated comes within that
    many units. The comparison with the honest copy is doubtful; from the next round every
    unit of the sleeper is replicated and its credit held, until the repetition rule
    refuses a copy and the held credit is forfeited. No honest Δ is refused."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.1
    settings.DIPACO_MIN_TRUST = 0.0  # refused copies cost it trust; it keeps getting work
    # The scored windows' draw, fixed: else it follows each checkout's generated SECRET_KEY.
    # It is keyed by the lease too, whose ids follow the tests run before in the database
    # (sequences are not rolled back): some draws find a unit whose two agreeing copies buy
    # nothing on its windows, held (rules.AGREED_NO_GAIN), never refused (below).
    settings.DIPACO_SCORE_SECRET = "test-sleeper"
    monkeypatch.setattr(replication, "_rng", _NeverDrawn())
    turn, rounds = 2, 12
    run = running_run(DILOCO, replicas=2, rounds=rounds, inner=INNER, data={"val_fraction": 0.2})
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    names = ("sleeper", "h1", "h2", "h3")
    sleeper, *honest = (register_worker(token, n, {})[0] for n in names)
    Worker.objects.all().update(probation=False)
    tokens = TOKENS * run.run_config.model.seq_len
    handed_in = 0
    bound: int | None = None
    doubted_at: int | None = None
    credit_at_doubt = 0
    for t in range(rounds):
        order = [sleeper, *honest[t % 3 :], *honest[: t % 3]]  # the others' order turns
        while True:
            granted = [(w, grant_lease(Worker.objects.get(pk=w.pk))) for w in order]
            granted = [(w, g) for w, g in granted if g is not None]
            if not granted:
                break
            for w, g in granted:
                deltas = honest_deltas(run, g.unit, sources)
                if w.pk == sleeper.pk:
                    if g.unit.replica < CHECK_OFFSET:
                        handed_in += 1
                    if handed_in > turn:
                        deltas = added(deltas, 7, 0.5)  # the same direction every unit
                    if handed_in == turn + 1 and bound is None:
                        rate = replication.audit_rate(Worker.objects.get(pk=w.pk), g.unit)
                        bound = math.ceil(replication.AUDIT_SPREAD / rate)
                hand_in(w, g, deltas, tokens)
        step_round(run, t)
        row = Worker.objects.get(pk=sleeper.pk)
        if row.doubted and doubted_at is None:
            doubted_at, credit_at_doubt = t, row.tokens_processed
    assert bound is not None and bound <= 8, bound  # 0.1 x (1 + 4 x its share of 1/2)
    units = _sleeper_units(run, sleeper)
    audited = [replication.replicated(u) for u in units]
    after = audited[turn:]
    assert True in after[:bound], (bound, audited)
    assert doubted_at is not None, audited
    first_doubt = turn + after.index(True)
    # From its doubt on, every unit of it is replicated until a copy of it is refused
    refused = Contribution.objects.filter(
        lease__worker=sleeper, reason__startswith=f"{rules.REPLICA}:"
    )
    assert refused.exists(), audited
    lost_at = min(refused.values_list("unit__round__t", flat=True))
    doubted_units = [u for u in units if doubted_at < u.round.t <= lost_at]
    assert doubted_units and all(replication.replicated(u) for u in doubted_units)
    assert all("a fixed direction added to every unit" in c.reason for c in refused)
    row = Worker.objects.get(pk=sleeper.pk)
    # Credit after its doubt: held, then forfeited with the lost comparison (on probation
    # again); only the units between turning and its first audit were granted.
    assert row.tokens_processed == credit_at_doubt and row.probation
    assert first_doubt - turn < bound
    for w in honest:
        refused = Contribution.objects.filter(lease__worker=w).exclude(reason="")
        assert not refused.exclude(reason__startswith=f"{rules.AGREED_NO_GAIN}:").exists()
        w.refresh_from_db()
        assert w.replicas_disagreed == 0 and w.contributions_rejected == 0
        # doubted beside the sleeper, cleared by agreeing with another honest copy
        assert not w.doubted and w.held_tokens == 0 and w.tokens_processed > 0


@pytest.mark.django_db
def test_six_honest_newcomers_all_leave_probation_within_three_rounds(
    tmp_path: Path, settings: Any
) -> None:
    """Six honest newcomers on the 2x2 grid, three partners needed each, on CPUs (two
    copies of a unit are the same bytes, as live): partners are scarce (four units a round for six
    workers), and live one honest worker of six never left probation in 8 rounds. After
    replication.PROBATION_ROUNDS rounds of work two partners suffice, so every one leaves
    within three rounds of work, and its held credit is granted."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0
    rounds = 5
    run = running_run(GRID, replicas=1, rounds=rounds, inner=INNER, data={"val_fraction": 0.2})
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    workers = [register_worker(token, f"n{i}", {})[0] for i in range(6)]
    left: dict[int, int] = {}
    for t in range(rounds):
        cpu_wave_round(run, workers, sources, t)
        for w in Worker.objects.filter(pk__in=[w.pk for w in workers], probation=False):
            left.setdefault(w.pk, t)
    assert set(left) == {w.pk for w in workers}, left
    assert max(left.values()) <= 2, left  # on probation for three rounds at most
    for row in Worker.objects.filter(pk__in=left):
        assert row.held_units == row.held_tokens == 0 and row.tokens_processed > 0
    assert not Contribution.objects.filter(unit__round__run=run).exclude(reason="").exists()


def cpu_wave_round(run: Run, workers: list[Worker], sources: Any, t: int) -> None:
    """tests.test_probation.wave_round with CPU workers: honest copies of a unit are the
    same bytes (both cold, a deterministic CPU)."""
    wave = 0
    while True:
        order = workers[wave % len(workers) :] + workers[: wave % len(workers)]
        granted = [(w, grant_lease(Worker.objects.get(pk=w.pk))) for w in order]
        granted = [(w, g) for w, g in granted if g is not None]
        if not granted:
            break
        for w, g in granted:
            hand_in(
                w, g, honest_deltas(run, g.unit, sources), TOKENS * run.run_config.model.seq_len
            )
        wave += 1
    step_round(run, t, ALL_MODULES)


@pytest.mark.django_db
def test_the_leaderboard_lists_held_credit_marked_held(client: Any) -> None:
    """A worker whose credit is all held (on probation, or doubted) is on the leaderboard,
    after those with credit granted, its tokens marked held; one with none is not."""
    token = create_enrollment_token(max_uses=None)[1]
    a, b, _ = (register_worker(token, n, {})[0] for n in ("granted", "held-only", "nothing"))
    Worker.objects.filter(pk=a.pk).update(tokens_processed=500, held_tokens=0, probation=False)
    Worker.objects.filter(pk=b.pk).update(tokens_processed=0, held_tokens=300)
    html = client.get("/workers/").content.decode()
    board = html[html.index('id="workers-leaderboard"') : html.index('id="workers-table"')]
    assert re.findall(r'<span class="name">([\w-]+)', board) == ["granted", "held-only"]
    assert 'data-held="300"' in board and "300 held" in board
    assert board.count("data-held=") == 1


@pytest.mark.django_db
def test_a_doubted_workers_copy_goes_to_an_undoubted_third_whose_agreement_ends_the_doubt(
    tmp_path: Path, settings: Any
) -> None:
    """A doubtful pair (a sleeper and its honest partner) is not left to check each other:
    an established worker that is not doubted takes a doubted worker's queued check copy
    before its own originals, the doubted partner does not; an agreement with the other
    doubted worker ends no doubt, one with the undoubted third does, and grants the credit
    held since."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_REPLICATION_RATE = 0.0  # no audits: only doubt replicates
    run = running_run(GRID, replicas=1, rounds=2, inner=INNER, data={"val_fraction": 0.2})
    with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    honest, sleeper, third = (register_worker(token, n, {})[0] for n in ("h", "s", "r"))
    Worker.objects.all().update(probation=False)
    Worker.objects.filter(pk__in=[honest.pk, sleeper.pk]).update(doubted=True)
    first = grant_lease(Worker.objects.get(pk=honest.pk))
    assert first is not None and first.unit.replica < CHECK_OFFSET
    assert replication.replicated(first.unit)  # doubted: its unit has a check copy queued
    partner = grant_lease(Worker.objects.get(pk=sleeper.pk))
    assert partner is not None and partner.unit.replica < CHECK_OFFSET  # not the copy
    assert replication.replicated(partner.unit)
    taken = grant_lease(Worker.objects.get(pk=third.pk))
    assert taken is not None and taken.unit.replica >= CHECK_OFFSET
    # a copy of either doubted worker's unit, drawn at random among them
    assert taken.unit.path_id in {first.unit.path_id, partner.unit.path_id}
    Worker.objects.filter(pk=honest.pk).update(held_units=1, held_tokens=100)
    trust.record_agreement(honest.pk, sleeper.pk, as_check=False)
    assert Worker.objects.get(pk=honest.pk).doubted  # a doubted partner vouches for nothing
    trust.record_agreement(honest.pk, third.pk, as_check=False)
    row = Worker.objects.get(pk=honest.pk)
    assert not row.doubted and row.held_tokens == 0 and row.tokens_processed == 100
    assert Worker.objects.get(pk=sleeper.pk).doubted
