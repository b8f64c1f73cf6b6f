"""Completing a lease: the worker's report of its uploads, recorded for the outer step.

Nothing here reads the uploaded bytes: contributions are recorded *pending*, and
the outer step verifies size, checksum and content before using one (docs/design.md §7).
What is checked here is what the report claims: exactly one contribution per
module of the unit's path, well-formed checksums, sizes within what an fp32
encoding of the module can take, and no more tokens than the unit holds (the
token count weights the average, so an inflated one would let a worker dominate).

A unit's Δ may be partial (docs/design.md §4): its lease allows `Lease.steps` steps,
sized to the worker's speed, and an agent stopped early (SIGTERM, its lease expiring
while it is alive, the round's deadline) uploads what it trained. Its tokens must lie
between ``units.min_partial_steps`` steps and the lease's steps, and the outer step
weights it by them. A lease that expired while its worker was still training is
*salvaged*: its completion is accepted as long as the round is open and no other lease
took the unit meanwhile.

With ``outer.overlap`` "eager" the completion may name the versions its Δs are relative
to (``base_versions``: those its unit rebased onto, rounds.protocol.rebase); each contribution
records its module's (`Contribution.base_version`), and anything but the unit's base
versions or, all together, the rebased ones is refused.

A completion is recorded once. Replaying it with identical content (a worker
that lost the response) returns the same contributions; different content is
refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from dipaco.config import RunConfig
from dipaco.data.windows import step_tokens
from dipaco_server.errors import ApiError
from dipaco_server.rounds.granted import lease_tokens
from dipaco_server.rounds.models import Contribution, Lease, WorkUnit
from dipaco_server.rounds.protocol.leases import (
    check_lease_live,
    check_salvage,
    fetch_lease,
    load_own_lease,
)
from dipaco_server.rounds.protocol.rebase import check_delta_base
from dipaco_server.rounds.protocol.worker_metrics import worker_metrics
from dipaco_server.runs.errors import (
    ContributionConflict,
    ContributionInvalid,
    LeaseExpired,
    LeaseNotActive,
)
from dipaco_server.runs.keys import contribution_key
from dipaco_server.runs.models import Module
from dipaco_server.runs.phases import phase_config
from dipaco_server.storage import BlobNotFound, BlobStore
from dipaco_server.workers import speed
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A safetensors header: 8 bytes of length plus JSON naming each tensor; 1 MiB covers
# any module this project builds with a wide margin.
HEADER_ALLOWANCE = 1024 * 1024
SPEED_METRIC = "tokens_per_second"


@dataclass(frozen=True)
class ContributionReport:
    """What a worker says it uploaded for one module (the API's request body, parsed)."""

    module_id: str
    size: int
    sha256: str
    tokens: int
    metrics: Mapping[str, float] = field(default_factory=dict)


def max_upload_bytes(config: RunConfig, module_id: str) -> int:
    """The largest encoded Δ of a module: fp32 (the widest codec) plus its header."""
    counts = config.module_param_counts()
    if module_id not in counts:
        raise ContributionInvalid(f"module {module_id!r} is not part of this run")
    return 4 * counts[module_id] + HEADER_ALLOWANCE


def upload_key(lease: Lease, module_id: str) -> str:
    """Where the worker uploads module `module_id`'s Δ under `lease` (ids only, docs/design.md §5)."""
    unit = lease.unit
    if module_id not in unit.path.modules:
        raise ContributionInvalid(
            f"module {module_id!r} is not part of path {unit.path.index} "
            f"(its modules: {', '.join(unit.path.modules)})",
            module=module_id,
        )
    return contribution_key(unit.round.run_id, unit.round.t, unit.pk, lease.pk, module_id)


def complete(
    worker: Worker,
    lease_id: int,
    secret: str,
    reports: Sequence[ContributionReport],
    *,
    now: datetime | None = None,
    lease: Lease | None = None,
    base_versions: Mapping[str, int] | None = None,
) -> list[Contribution]:
    """Record the unit as done and its contributions as pending verification.

    `lease`: the lease as `load_own_lease(worker, lease_id, secret)` just returned it, when
    the caller has it (the API view does), to save reading it again. `base_versions`: the
    version each module's Δ is relative to (rounds.protocol.rebase.check_delta_base; None: the
    unit's base versions).
    """
    now = now or timezone.now()
    if lease is None or lease.pk != lease_id or lease.worker_id != worker.pk:
        lease = load_own_lease(worker, lease_id, secret)
    if lease.state == Lease.State.COMPLETED:
        return _replay(lease, reports, base_versions)
    salvage = check_salvage(lease, now)  # raises unless live, or expired but salvageable
    clean = _validated(lease, reports)
    relative_to = check_delta_base(lease.unit, base_versions)
    modules = {
        m.module_id: m
        for m in Module.objects.filter(
            run_id=lease.unit.round.run_id, phase=lease.unit.path.phase, module_id__in=list(clean)
        )
    }
    with transaction.atomic():
        if salvage:
            _claim_salvaged(lease, now)
        else:
            live = Lease.objects.filter(pk=lease.pk, state=Lease.State.ACTIVE, deadline__gte=now)
            if not live.update(state=Lease.State.COMPLETED, ended_at=now):
                lease = fetch_lease(lease.pk) or lease
                if lease.state == Lease.State.COMPLETED:  # a concurrent identical request won
                    return _replay(lease, reports, base_versions)
                check_lease_live(lease, now)  # raises: it expired or was released meanwhile
                raise LeaseNotActive(f"lease {lease.pk} is {lease.state}", state=lease.state)
            WorkUnit.objects.filter(pk=lease.unit_id, state=WorkUnit.State.LEASED).update(
                state=WorkUnit.State.DONE, done_at=now, updated_at=now
            )
        rows = Contribution.objects.bulk_create(
            Contribution(
                lease=lease,
                unit_id=lease.unit_id,
                module=modules[module_id],
                blob_key=upload_key(lease, module_id),
                size=report.size,
                sha256=report.sha256,
                tokens=report.tokens,
                metrics=dict(report.metrics),
                base_version=relative_to[module_id],
                created_at=now,
            )
            for module_id, report in clean.items()
        )
        # No credit yet: units_completed and tokens_processed count a unit once the outer
        # step accepted every one of its Δs (rounds.outer.step._credit): a rejected Δ earns nothing.
        Worker.objects.filter(pk=worker.pk).update(
            last_seen=now,
            measured_speed=_smoothed_speed(worker, lease, clean, now),
        )
    lease.state, lease.ended_at = Lease.State.COMPLETED, now
    logger.info("lease %s completed: %d contribution(s)", lease.pk, len(rows))
    return rows


def _claim_salvaged(lease: Lease, now: datetime) -> None:
    """Lease and unit to completed and done for a salvaged Δ, inside the caller's
    transaction; the unit row's lock serialises this with a grant of the same unit
    (grants skip locked units), so one of the two wins, never both."""
    unit = WorkUnit.objects.select_for_update().filter(pk=lease.unit_id).first()
    others = Lease.objects.filter(unit_id=lease.unit_id, state=Lease.State.ACTIVE).exclude(
        pk=lease.pk
    )
    if unit is None or unit.state == WorkUnit.State.DONE or others.exists():
        raise LeaseExpired(
            f"lease {lease.pk} expired and its unit went to another lease; its Δ is not "
            "needed, ask for a new lease",
            deadline=lease.deadline.isoformat(),
        )
    Lease.objects.filter(pk=lease.pk, state__in=[Lease.State.ACTIVE, Lease.State.EXPIRED]).update(
        state=Lease.State.COMPLETED, ended_at=now
    )
    WorkUnit.objects.filter(pk=unit.pk).update(
        state=WorkUnit.State.DONE, done_at=now, updated_at=now
    )
    logger.info("lease %s: salvaged after it expired (unit %s)", lease.pk, unit.pk)


def _smoothed_speed(
    worker: Worker, lease: Lease, clean: Mapping[str, ContributionReport], now: datetime
) -> float | None:
    """The unit's speed (tokens/s) smoothed into the worker's estimate, which sizes only
    that worker's own leases (within DIPACO_LEASE_MIN_S..DIPACO_LEASE_MAX_S).

    The worker's claim counts only up to what the server measured itself (its tokens
    over the lease's wall time) and a device's plausible top (workers.speed). Without a
    (positive) report, the estimate stays as it was.
    """
    report = next(iter(clean.values()))
    unit = speed.unit_speed(report.metrics.get(SPEED_METRIC), report.tokens, lease.granted_at, now)
    worker.measured_speed = speed.smoothed_speed(worker.measured_speed, unit)
    return worker.measured_speed


def check_uploads(lease: Lease, reports: Sequence[ContributionReport], store: BlobStore) -> None:
    """Each reported module's upload is in the store, of the size the report declares;
    else ContributionInvalid naming the module. One HEAD per module: sha256 and content
    are the outer step's to check, as they need the bytes (rounds.verification.rules). A module the
    path lacks is left to `complete`, whose refusal lists the missing and unexpected."""
    for report in reports:
        if report.module_id not in lease.unit.path.modules:
            continue
        key = upload_key(lease, report.module_id)
        try:
            size = store.size(key)
        except BlobNotFound:
            raise ContributionInvalid(
                f"{report.module_id}: nothing was uploaded for it under lease {lease.pk}; "
                "upload its Δ with the URLs from upload-urls, then complete",
                module=report.module_id,
            ) from None
        except Exception as exc:
            # S3 or the disk out of reach: the worker's Δ is not at fault, so a 503, which
            # the agent hands in again, not a 500.
            logger.warning("cannot check upload %s: %s", key, exc)
            raise ApiError(
                503,
                "store_unavailable",
                f"{report.module_id}: the server cannot reach its blob store to check the "
                "upload right now; send the completion again in a few seconds",
                module=report.module_id,
            ) from None
        if size != report.size:
            raise ContributionInvalid(
                f"{report.module_id}: the upload holds {size} bytes, the completion says "
                f"{report.size}; upload it again or report its size",
                module=report.module_id,
                uploaded=size,
            )


def _replay(
    lease: Lease,
    reports: Sequence[ContributionReport],
    base_versions: Mapping[str, int] | None = None,
) -> list[Contribution]:
    """The recorded contributions if `reports` says the same thing, else ContributionConflict."""
    recorded = list(lease.contributions.select_related("module").order_by("pk"))
    unit_base = dict(lease.unit.base_versions)
    try:
        clean = _validated(lease, reports)
    except ContributionInvalid:
        clean = None
    relative_to = base_versions if base_versions is not None else unit_base
    before = {
        c.module.module_id: (
            c.size, c.sha256, c.tokens, c.metrics,
            c.base_version if c.base_version is not None else unit_base.get(c.module.module_id),
        )
        for c in recorded
    }  # fmt: skip
    now_said = (
        {
            m: (r.size, r.sha256, r.tokens, dict(r.metrics), relative_to.get(m))
            for m, r in clean.items()
        }
        if clean is not None
        else None
    )
    if before != now_said:
        raise ContributionConflict(
            f"lease {lease.pk} was already completed with other contributions; "
            "a completion cannot be changed, ask for a new lease",
        )
    return recorded


def _validated(
    lease: Lease, reports: Sequence[ContributionReport]
) -> dict[str, ContributionReport]:
    """Reports keyed by module id, with metrics as plain floats; ContributionInvalid if not."""
    path = lease.unit.path
    expected = list(path.modules)
    if isinstance(reports, str | bytes) or not isinstance(reports, Sequence) or not reports:
        raise ContributionInvalid(
            f"report one contribution per module of path {path.index}: {expected}"
        )
    given = [getattr(r, "module_id", None) for r in reports]
    if len(set(given)) != len(given):
        raise ContributionInvalid(f"a module is reported twice: {given}")
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected), key=str)
    if missing or extra:
        raise ContributionInvalid(
            f"path {path.index} has modules {expected}: missing {missing}, unexpected {extra}",
            missing=missing,
            unexpected=[str(e) for e in extra],
        )
    config = phase_config(lease.unit.round.run.run_config, path.phase)
    # The lease's own allowance, never the completion's claim: the Δ's weight is its tokens.
    most_tokens = lease_tokens(lease, config)
    fewest = min(most_tokens, config.units.min_partial_steps * step_tokens(config))
    clean = {}
    for report in reports:
        module_id = report.module_id
        limit = max_upload_bytes(config, module_id)
        if not _is_int(report.size) or not 0 < report.size <= limit:
            raise ContributionInvalid(
                f"{module_id}: size {report.size!r} must be 1..{limit} bytes", module=module_id
            )
        if not isinstance(report.sha256, str) or not _SHA256.match(report.sha256):
            raise ContributionInvalid(
                f"{module_id}: sha256 must be 64 lowercase hex digits", module=module_id
            )
        if not _is_int(report.tokens) or not fewest <= report.tokens <= most_tokens:
            raise ContributionInvalid(
                f"{module_id}: tokens {report.tokens!r} must be {fewest}..{most_tokens} "
                "(units.min_partial_steps up to the lease's steps, x batch x seq_len)",
                module=module_id,
            )
        clean[module_id] = ContributionReport(
            module_id,
            report.size,
            report.sha256,
            report.tokens,
            _metrics(module_id, report.metrics),
        )
    if len({r.tokens for r in clean.values()}) != 1:
        raise ContributionInvalid("every module of one unit saw the same tokens; report one count")
    return clean


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _metrics(module_id: str, metrics: Any) -> dict[str, float]:
    """The worker's own training metrics, closed and bounded (rounds.protocol.worker_metrics)."""
    try:
        return worker_metrics(metrics)
    except ValueError as exc:
        raise ContributionInvalid(
            f"{module_id}: metrics refused: {exc}", module=module_id
        ) from None
