"""A fixed-direction bias caught over rounds by what a worker's copies keep adding.

Real services as in tests/test_verification.py: a DiLoCo run of new workers, each unit
of theirs also trained by a second worker (probation), proof of useful work on. An honest Δ plus the same vector every round
(half the Δ's norm) agrees with its honest copy in any one round; its difference from that
copy repeats round after round, whoever the partner and whichever copy it trains, while two
honest copies differ by what differs between two machines, new every round (here: fresh
noise at 0.3 x the Δ's norm).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco import codecs
from dipaco.config import OuterConfig
from dipaco.data.windows import ShardSource
from dipaco_server.rounds.models import Contribution
from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification import persistence
from dipaco_server.rounds.verification.checks import compare_replicas
from dipaco_server.rounds.verification.uploads import Upload, Verdict
from dipaco_server.runs.models import Run
from dipaco_server.storage import get_blob_store
from dipaco_server.workers import probation
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_outer_tasks import DILOCO, running_run
from tests.test_untrusted import INNER, Deltas, honest_deltas, step_round, with_data

pytestmark = pytest.mark.django_db


def added(deltas: Deltas, seed: int, size: float) -> Deltas:
    """Each module's Δ plus a unit vector drawn from `seed`, at `size` x the Δ's norm."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for module_id, delta in deltas.items():
        direction = {k: torch.randn(v.shape, generator=generator) for k, v in delta.items()}
        scale = size * _norm(delta) / _norm(direction)
        out[module_id] = {k: v + scale * direction[k] for k, v in delta.items()}
    return out


def _norm(delta: dict[str, torch.Tensor]) -> float:
    return float(sum(v.double().pow(2).sum() for v in delta.values()) ** 0.5)


def hand_in(worker: Worker, granted: Any, deltas: Deltas, tokens: int) -> None:
    """Upload `deltas` (fp16) for `granted`'s lease and complete it, claiming `tokens`."""
    reports = []
    for module_id, delta in deltas.items():
        data = codecs.encode(delta, "fp16")
        get_blob_store().put_bytes(upload_key(granted.lease, module_id), data)
        reports.append(
            ContributionReport(module_id, len(data), hashlib.sha256(data).hexdigest(), tokens)
        )
    complete(worker, granted.lease.pk, granted.secret, reports)


def contribute(run: Run, worker: Worker, sources: dict[int, ShardSource], seed: int) -> None:
    """`worker` leases a unit, trains it and uploads its Δs plus `seed`'s vector."""
    granted = grant_lease(worker)
    assert granted is not None
    deltas = added(honest_deltas(run, granted.unit, sources), seed, 0.5 if seed < 100 else 0.3)
    tokens = run.run_config.inner.steps * 4 * run.run_config.model.seq_len
    hand_in(worker, granted, deltas, tokens)


def statuses(worker: Worker) -> list[tuple[int, str, str]]:
    rows = Contribution.objects.filter(lease__worker=worker).order_by("unit__round__t", "pk")
    return [(c.unit.round.t, c.module.module_id, c.reason.partition(":")[0]) for c in rows]


# Who trains each round's unit, then its check copy. Every worker is new, so on probation
# (workers.probation): each unit gets a check copy, and the next worker to ask is handed it.
# The biased worker is checked as the check copy by honest-a and honest-b, then trains an
# original that honest-c checks: two earlier differences against two distinct partners,
# enough evidence (persistence.enough); honest-c then checks honest-a.
PAIRS = (("honest-a", "biased"), ("honest-b", "biased"), ("biased", "honest-c"),
         ("honest-c", "honest-a"))  # fmt: skip


def test_a_biased_newcomer_with_honest_partners_is_refused_within_its_probation(
    tmp_path: Path, settings: Any
) -> None:
    """ "biased" adds one fixed vector (seed 7) to every unit; an honest worker adds noise
    drawn anew each round (another machine's kernels). Probation at its default, no
    replication forced: the schedule replicates every newcomer's unit."""
    settings.DIPACO_PROBATION_PARTNERS = probation.PARTNERS
    settings.DIPACO_MIN_TRUST = 0.0
    run = running_run(
        DILOCO, replicas=1, rounds=len(PAIRS), inner=INNER, data={"val_fraction": 0.2}
    )
    sources = with_data(run, tmp_path)
    token = create_enrollment_token(max_uses=None)[1]
    names = ("honest-a", "honest-b", "honest-c", "biased")
    workers = {name: register_worker(token, name, {})[0] for name in names}
    for t, pair in enumerate(PAIRS):
        for i, name in enumerate(pair):
            contribute(run, workers[name], sources, 7 if name == "biased" else 100 + 10 * t + i)
        step_round(run, t)

    # Rounds 0 and 1: one earlier difference or none is no evidence, and each pair agrees
    # (cosine about 0.9). Round 2: its original differs from honest-c's copy where its
    # check copies differed from honest-a's and honest-b's originals.
    biased = statuses(workers["biased"])
    assert {reason for t, _, reason in biased if t < 2} == {""}
    assert {reason for t, _, reason in biased if t == 2} == {"replica_disagrees"}
    refused = Contribution.objects.filter(lease__worker=workers["biased"], unit__round__t=2)
    assert all("a fixed direction added to every unit" in c.reason for c in refused)
    assert all("from 2 other workers'" in c.reason for c in refused)
    assert Worker.objects.get(pk=workers["biased"].pk).probation  # refused within it
    for name in ("honest-a", "honest-b", "honest-c"):
        assert all(reason == "" for _, _, reason in statuses(workers[name]))
        worker = Worker.objects.get(pk=workers[name].pk)
        assert worker.trust == 1.0 and worker.contributions_rejected == 0
        assert worker.replicas_disagreed == 0
    biased_row = Worker.objects.get(pk=workers["biased"].pk)
    assert biased_row.contributions_rejected == 2
    # Its accepted check copies of rounds 0 and 1 were held, then forfeited with its
    # agreements: it starts probation over, and was credited nothing.
    assert (biased_row.units_completed, biased_row.tokens_processed) == (0, 0)
    assert (biased_row.held_units, biased_row.held_tokens, biased_row.partners) == (0, 0, [])
    # Each compared copy keeps its side of the difference and the other copy's worker.
    for c in Contribution.objects.filter(unit__round__run=run):
        assert c.replica_sketch is not None and len(c.replica_sketch) == 4 * persistence.SKETCH
        assert c.replica_partner_id not in (None, c.lease.worker_id)


def test_repetition_needs_two_partners_a_real_difference_and_a_repeated_direction() -> None:
    generator = torch.Generator().manual_seed(0)
    fixed = torch.randn(persistence.SKETCH, generator=generator)
    past = [fixed + 0.8 * torch.randn(persistence.SKETCH, generator=generator) for _ in range(3)]
    fresh = [torch.randn(persistence.SKETCH, generator=generator) for _ in range(3)]
    now = fixed + 0.8 * torch.randn(persistence.SKETCH, generator=generator)
    partners = list(enumerate(past, start=10))  # (partner, sketch): three distinct partners
    fresh_ = list(enumerate(fresh, start=10))
    found = persistence.repeated([(1, now, partners), (2, -now, fresh_)], 0.5, 1.0)
    assert found[0].startswith("worker 1's copy") and found[1] == ""
    assert persistence.repeated([(1, now, [])], 0.5, 1.0) == [""]
    assert persistence.repeated([(1, now, partners)], 0.01, 1.0) == [""]  # float rounding
    # One earlier difference is not evidence, nor are several against one partner.
    assert persistence.repeated([(1, now, partners[:1])], 0.5, 1.0) == [""]
    assert persistence.repeated([(1, now, [(10, s) for _, s in partners])], 0.5, 1.0) == [""]
    stored = persistence.from_bytes(persistence.to_bytes(now))
    assert torch.allclose(stored, now.double(), rtol=1e-6)
    with pytest.raises(ValueError, match="float32 values"):
        persistence.from_bytes(b"\0" * 12)


def verdict(tmp_path: Path, pk: int, worker: int, delta: torch.Tensor, **upload: Any) -> Any:
    """A verdict of the step whose Δ (one tensor "w") is already decoded to its raw copy."""
    raw = tmp_path / f"{pk}.f32"
    raw.write_bytes(delta.float().contiguous().view(torch.uint8).numpy().tobytes())
    sha = hashlib.sha256(raw.read_bytes()).hexdigest()
    up = Upload(pk, worker, f"k{pk}", 0, sha, 1, unit_id=1, **upload)
    return Verdict(up, norm=float(delta.norm()), raw=raw)


def test_a_copy_far_from_a_lazy_one_goes_to_the_evidence_not_the_repetition_rule(
    tmp_path: Path,
) -> None:
    """An honest original whose earlier differences as the check copy (cold minus warm,
    against two partners) point along its Δ, paired with a lazy check copy (0.1 x): its
    difference is 0.9 x its Δ, which repeats them. The two disagree anyway (norms 10 x
    apart), so the evidence settles them (none here: neither refused), never the
    repetition alone; a close copy whose difference repeats them is still refused."""
    spec = {"w": ((4096,), torch.float32)}
    direction = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    cold_minus_warm = [
        persistence.to_bytes(
            persistence.difference_sketch({"w": k * direction}, {"w": 0 * direction}, spec)[0]
        )
        for k in (0.4, 0.5)
    ]
    past = ((20, True, cold_minus_warm[0]), (21, True, cold_minus_warm[1]))
    cfg = OuterConfig()
    for partner, refused in ((0.1, False), (0.7, True)):
        honest = verdict(tmp_path, 1, 7, direction, replica_past=past)
        other = verdict(tmp_path, 2, 8, partner * direction, check_of=1)
        compare_replicas([honest, other], spec, cfg)
        assert honest.accepted != refused, honest.reason
        assert other.accepted
        # a difference from a far-off copy is no evidence in later rounds; a close one is
        assert (honest.sketch is None) == (partner == 0.1)
