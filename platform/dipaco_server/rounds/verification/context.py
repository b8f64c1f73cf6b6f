"""What the checks compare a round's uploads against, read from the database and the
store: earlier rounds' bytes (replays), each check copy's original (replication), what
the paired workers' copies differed by before (persistence), the module's accepted norms
(history) and its outer momentum (direction)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from dipaco.modules_file import Spec, read_module
from dipaco_server.rounds.models import Contribution, OuterStep
from dipaco_server.rounds.verification.persistence import PAST
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import Module
from dipaco_server.storage import BlobStore


def check_copies(rows: Sequence[Contribution]) -> dict[int, int]:
    """Check copy's contribution -> its original's (same path and windows), among `rows`.
    A copy whose original brought no Δ is an ordinary contribution."""
    originals = {
        (c.unit.path_id, c.unit.data_position): c.pk for c in rows if c.unit.replica < CHECK_OFFSET
    }
    return {
        c.pk: originals[(c.unit.path_id, c.unit.data_position)]
        for c in rows
        if c.unit.replica >= CHECK_OFFSET and (c.unit.path_id, c.unit.data_position) in originals
    }


def replica_past(
    module: Module, rows: Sequence[Contribution], checks: dict[int, int]
) -> dict[int, tuple[tuple[int, bool, bytes], ...]]:
    """Worker -> (the other copy's worker, whether it was the check copy, the difference
    sketch) of its earlier compared copies in `module`, newest first, at most persistence.PAST: for each worker with a
    copy in one of the round's replica pairs (`checks`, check_copies)."""
    paired = set(checks) | set(checks.values())
    workers = {c.lease.worker_id for c in rows if c.pk in paired}
    if not workers:
        return {}
    earlier = Contribution.objects.filter(module=module, replica_sketch__isnull=False).exclude(
        pk__in=[c.pk for c in rows]
    )
    out: dict[int, tuple[tuple[int, bool, bytes], ...]] = {}
    for worker_id in sorted(workers):  # one bounded query per paired worker (index: module)
        kept = earlier.filter(lease__worker_id=worker_id).order_by("-pk")[:PAST]
        found = kept.values_list("replica_partner_id", "unit__replica", "replica_sketch")
        out[worker_id] = tuple(
            (partner or 0, replica >= CHECK_OFFSET, bytes(sketch))
            for partner, replica, sketch in found
        )
    return out


def replayed(run_id: int, t: int, rows: Sequence[Contribution]) -> set[int]:
    """The contributions whose bytes (sha256) a contribution of an earlier round carried.

    Within one round, identical bytes from two units say only that both computed the same
    thing (a deterministic machine, the same base and windows): which one copied cannot be
    told, and the first to complete is not always the honest one (bench/attacks.py
    measured an honest worker refused that way), so they are left to the other checks.
    """
    earlier = (
        Contribution.objects.filter(
            unit__round__run_id=run_id, unit__round__t__lt=t, sha256__in={c.sha256 for c in rows}
        )
        .exclude(
            pk__in=[c.pk for c in rows]
        )  # a Δ kept from an earlier round is no replay of itself
        .values_list("sha256", flat=True)
    )
    seen = set(earlier)
    return {c.pk for c in rows if c.sha256 in seen}


def norm_history(module: Module, t: int, rounds: int) -> list[float]:
    """The module's accepted median Δ norms of its last `rounds` steps before round t."""
    steps = OuterStep.objects.filter(
        module=module, round__t__lt=t, median_norm__isnull=False, accepted__gt=0
    ).order_by("-round__t")
    return [float(n) for n in steps.values_list("median_norm", flat=True)[:rounds]]


def outer_momentum(
    store: BlobStore, momentum_key: str, spec: Spec, work: Path
) -> dict[str, Tensor] | None:
    """The module's outer momentum at the base version (None before its first step)."""
    if not momentum_key:
        return None
    path = work / "momentum-check.safetensors"
    store.download_to(momentum_key, path)
    try:
        return read_module(path, spec)
    finally:
        path.unlink(missing_ok=True)
