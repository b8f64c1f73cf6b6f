"""What the server's database recorded about a finished run, for the summary: the bytes and
tokens of its completed units, and each phase's time by its rounds' clock.

The demo process opens the run's database through Django (control.setup_django) because the
admin API does not serve these figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dipaco.config import RunConfig


@dataclass
class Traffic:
    upload_bytes: int  # encoded Δs, as recorded by the server (both phases)
    # What each unit's manifest sent down (Lease.download_bytes: fp32 modules, or encoded
    # updates for the versions its worker held); fp32 modules where it was not recorded
    download_bytes: int
    units: int  # units completed (both phases)
    tokens: int  # training tokens of phase 2's completed units (the baselines' budget)
    phase1_units: int = 0
    phase1_tokens: int = 0  # the dense phase's, the head start both sides share
    # Sampled replication's check copies (rounds.verification.replication, both phases): a second worker
    # trains a unit again to vouch for the first. Their Δs are compared, never averaged in,
    # so their tokens are verification, not training: counted here, not above.
    check_units: int = 0
    check_tokens: int = 0


def traffic(run_id: int) -> Traffic:
    """What the run's completed units sent and received (from the server's database)."""
    # Django: set up by control.setup_django once the server is up
    from django.db import connections
    from django.db.models import Sum

    # The server's models: importable once setup_django (control.py) has pointed Django
    # at the demo's database, which this module's importers do not need.
    from dipaco_server.rounds.models import Contribution, Lease, WorkUnit
    from dipaco_server.rounds.verification.replication import CHECK_OFFSET
    from dipaco_server.runs.models import ModuleVersion
    from dipaco_server.runs.phases import DENSE

    # Phase-1 module ids repeat phase 2's ("0.0", "shared"): sizes are keyed by phase too.
    sizes = {
        (phase, module_id, version): size
        for phase, module_id, version, size in ModuleVersion.objects.filter(
            module__run_id=run_id
        ).values_list("module__phase", "module__module_id", "version", "size")
    }
    units = list(
        WorkUnit.objects.filter(round__run_id=run_id, state=WorkUnit.State.DONE).values_list(
            "pk", "path__phase", "base_versions", "replica"
        )
    )
    sent = dict(
        Lease.objects.filter(
            unit__round__run_id=run_id, state=Lease.State.COMPLETED, download_bytes__isnull=False
        ).values_list("unit_id", "download_bytes")
    )
    download = sum(
        sent[pk] if pk in sent else sum(sizes.get((phase, m, v), 0) for m, v in base.items())
        for pk, phase, base, _ in units
    )
    uploads = Contribution.objects.filter(unit__round__run_id=run_id)
    upload = uploads.aggregate(total=Sum("size"))["total"] or 0
    tokens = {phase: 0 for phase in (DENSE, 2)}
    checked = 0
    # One count per unit (each of its modules' contributions repeats it).
    for _, phase, replica, count in set(
        uploads.values_list("unit_id", "unit__path__phase", "unit__replica", "tokens")
    ):
        if replica >= CHECK_OFFSET:
            checked += count
        else:
            tokens[phase] = tokens.get(phase, 0) + count
    connections.close_all()
    originals = [phase for _, phase, _, replica in units if replica < CHECK_OFFSET]
    return Traffic(
        int(upload), int(download), len(originals), tokens[2],
        phase1_units=originals.count(DENSE), phase1_tokens=tokens[DENSE],
        check_units=len(units) - len(originals), check_tokens=checked,
    )  # fmt: skip


@dataclass
class PhaseClock:
    """Seconds of each phase by the server's round clock (first open to last close)."""

    phase1: float | None  # None: no phase 1
    between: float | None  # phase 1's last round closed -> phase 2's first round opened
    phase2: float


def phase_clock(run_id: int, config: RunConfig) -> PhaseClock:
    """Each phase's seconds, from the run's Round rows (opened_at, closed_at)."""
    # Django: set up by control.setup_django once the server is up
    from django.db import connections

    from dipaco_server.rounds.models import Round  # once Django is set up, as above

    times = {
        t: (opened, closed)
        for t, opened, closed in Round.objects.filter(run_id=run_id).values_list(
            "t", "opened_at", "closed_at"
        )
    }
    connections.close_all()

    def seconds(since: int, until: int, *, opened: bool = False) -> float:
        if since not in times or until not in times or times[since][1] is None:
            return math.nan
        end = times[until][0] if opened else times[until][1]
        return math.nan if end is None else float((end - times[since][0]).total_seconds())

    first, last = config.total_rounds - config.rounds, config.total_rounds - 1
    if not first:
        return PhaseClock(None, None, seconds(0, last))
    between = math.nan
    if first - 1 in times and first in times and times[first - 1][1] is not None:
        between = float((times[first][0] - times[first - 1][1]).total_seconds())
    return PhaseClock(seconds(0, first - 1), between, seconds(first, last))
