"""The first round's settlement over whole units (first_round), read from the database and
the store once per round and kept on the round (`Round.first_round`), so that every
module's first step applies the same verdict to its Δs. The units a waiting step kept
from earlier rounds (`carried`) are settled again with the round's own."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from django.db.models import Q

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.data.windows import unit_tokens
from dipaco_server.rounds.models import Contribution, Round
from dipaco_server.rounds.verification import first_round, rules
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.rounds.verification.scorer import Scorer, delta_bases
from dipaco_server.rounds.verification.uploads import Upload, fetch
from dipaco_server.storage import BlobStore

logger = logging.getLogger(__name__)

_Pair = tuple[int, int]


def first_round_verdicts(
    store: BlobStore, round_: Round, config: Any, work: Path, scorer: Scorer | None
) -> dict[int, str]:
    """Lease id -> "<code>: <message>" for the round's units that its first-step settlement
    refuses or holds out (first_round.settle). The first module step to finish computing
    it stores it on the round (a conditional UPDATE, no lock held while computing: on
    SQLite a transaction open that long would block the whole server), and every step
    applies what is stored, so all apply the same verdicts."""
    stored = Round.objects.filter(pk=round_.pk).values_list("first_round", flat=True).first()
    if not isinstance(stored, dict):
        rows = list(
            Contribution.objects.filter(Q(unit__round=round_) | carried(round_.run_id, round_.t))
            .select_related("module", "unit__path", "lease__worker")
            .order_by("lease_id", "module_id")
        )
        verdicts = _settle(store, rows, config, work, scorer)
        Round.objects.filter(pk=round_.pk, first_round__isnull=True).update(
            first_round={str(k): v for k, v in verdicts.items()}
        )
        if verdicts:
            logger.info("round %s's first steps: %s", round_.pk, verdicts)
        stored = Round.objects.filter(pk=round_.pk).values_list("first_round", flat=True).get()
    return {int(k): str(v) for k, v in (stored or {}).items()}


def carried(run_id: int, t: int) -> Q:
    """The Δs of earlier rounds that a waiting first step kept for round t's step
    (first_round.KEPT: still pending, their reason says why): round t's settlement and its
    modules' steps take them with the round's own."""
    kept = Q(reason__startswith=first_round.UNSETTLED) | Q(reason__startswith=first_round.WAITING)
    return (
        Q(unit__round__run_id=run_id, unit__round__t__lt=t, status=Contribution.Status.PENDING)
        & kept
    )


def _settle(
    store: BlobStore, rows: Sequence[Contribution], config: Any, work: Path, scorer: Scorer | None
) -> dict[int, str]:
    from dipaco.modular import module_spec  # transformers: seconds to import

    dots: dict[_Pair, list[float]] = {}  # (a, b) -> [a·b, |a|², |b|²] over shared modules
    by_module: dict[str, list[Contribution]] = {}
    for c in rows:
        by_module.setdefault(c.module.module_id, []).append(c)
    for module_id, contributions in by_module.items():
        spec = module_spec(config, module_id)
        flat: dict[int, Any] = {}
        for c in contributions:  # one module's Δs at a time
            upload = Upload(c.pk, c.lease.worker_id, c.blob_key, c.size, c.sha256, c.tokens)
            try:
                path, _ = fetch(store, upload, work)
                delta = codecs.decode(path, spec)
                path.unlink(missing_ok=True)
            except CodecError:
                continue  # the format check refuses it in its own step
            flat[c.lease_id] = _flatten(delta)
        keys = sorted(flat)
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                acc = dots.setdefault((a, b), [0.0, 0.0, 0.0])
                acc[0] += float(flat[a] @ flat[b])
                acc[1] += float(flat[a] @ flat[a])
                acc[2] += float(flat[b] @ flat[b])
    cosines: dict[_Pair, float | None] = {
        pair: (ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else None)
        for pair, (ab, aa, bb) in dots.items()
    }
    if not first_round.against_pairs(cosines):
        return {}
    units = _facts(rows, config, scorer)
    copies = _copies(rows)
    return first_round.settle(units, cosines, copies)


def _flatten(delta: dict[str, Any]) -> Any:
    return torch.cat([t.double().reshape(-1) for t in delta.values()])


def _facts(
    rows: Sequence[Contribution], config: Any, scorer: Scorer | None
) -> dict[int, first_round.UnitFacts]:
    """Each lease's worker, whether it referees, and its unit's gain per unit of work."""
    whole = unit_tokens(config)
    # The versions each unit's Δ is relative to, as the steps score it: a score recorded
    # when the unit completed (rounds.verification.unit_score) or by a step is reused.
    bases = delta_bases(rows)
    out: dict[int, first_round.UnitFacts] = {}
    for c in rows:
        if c.lease_id in out:
            continue
        score = None
        if scorer is not None:
            upload = Upload(c.pk, c.lease.worker_id, c.blob_key, c.size, c.sha256, c.tokens,
                            c.unit.path.index, unit_id=c.unit_id, lease_id=c.lease_id,
                            position=c.unit.data_position, delta_base=bases[c.lease_id])  # fmt: skip
            try:
                score = scorer.whole_unit(upload)
            except CodecError:
                score = None
        work = min(1.0, c.tokens / whole) if whole > 0 else 1.0
        out[c.lease_id] = first_round.UnitFacts(
            c.lease.worker_id, rules.gain_rate(score, work), bool(c.lease.worker.operator_trusted)
        )
    return out


def _copies(rows: Sequence[Contribution]) -> list[_Pair]:
    """(original's lease, check copy's lease) per replicated unit of the round."""
    originals: dict[tuple[int, int], int] = {}
    checks: dict[tuple[int, int], set[int]] = {}
    for c in rows:
        where = (c.unit.path_id, c.unit.data_position)
        if c.unit.replica < CHECK_OFFSET:
            originals[where] = c.lease_id
        else:
            checks.setdefault(where, set()).add(c.lease_id)
    return [
        (originals[where], lease) for where, leases in checks.items() if where in originals
        for lease in sorted(leases)
    ]  # fmt: skip
