"""What each worker is doing now, and whether a run's round has stalled, from the rows alone.

A worker is in exactly one of STATES, the first that applies:

- ``revoked``: its token is refused;
- ``distrusted``: its trust fell below DIPACO_MIN_TRUST, so it gets no work;
- ``offline``: not heard from within one lease timeout (DIPACO_LEASE_TIMEOUT_S; agents
  heartbeat every third), or within the minute by which ``last_seen`` is recorded;
- ``stuck``: it heartbeats, holds a lease, and has completed nothing for
  STUCK_AFTER_TIMEOUTS lease timeouts (the timeout leases live by now, which grows with
  the workers about: rounds.protocol.pacing) while holding work the whole time (a lease of it
  granted that long ago was still held, or ended, within that window): a hung data loader,
  a wedged GPU, an agent that keeps a lease alive and never trains;
- ``training``: it holds a live lease;
- ``idle``: heard from, holds no lease (waiting for a round, or for a unit).

Probation is a standing, not an activity: a worker on probation is also in one of the
states above (`on_probation` counts them).

A round is *stalled* when it has stayed open (or closing) more than STALL_FACTOR times its
expected duration: the median of the run's last EXPECTED_FROM closed rounds (opening to
close), or, before any closed, the round's own deadline from its opening
(DIPACO_ROUND_DEADLINE_S, or the adaptive deadline once it moved).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.dispatch import receiver
from django.utils import timezone

from dipaco_server.rounds.models import Lease, Round
from dipaco_server.rounds.policy import current_policy
from dipaco_server.rounds.protocol import pacing
from dipaco_server.runs.models import Run
from dipaco_server.workers import signals, trust
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import LAST_SEEN_RESOLUTION

STATES = ("training", "idle", "stuck", "offline", "distrusted", "revoked")
STUCK_AFTER_TIMEOUTS = (
    3  # lease timeouts without a completion: a dead agent's lease is gone after one
)
STALL_FACTOR = 2.0  # a round open past twice its expected duration is flagged
EXPECTED_FROM = 5  # closed rounds whose median duration a round is expected to take


@dataclass(frozen=True)
class Window:
    """The instants the states are judged against."""

    now: datetime
    alive_since: datetime  # heard from after this: online
    stuck_since: datetime  # no completion after this while holding work: stuck

    @classmethod
    def at(cls, now: datetime | None = None) -> Window:
        now = now or timezone.now()
        online = max(timedelta(seconds=current_policy().lease_timeout_s), LAST_SEEN_RESOLUTION)
        timeout = timedelta(seconds=pacing.lease_timeout_s())
        return cls(now, now - online, now - STUCK_AFTER_TIMEOUTS * timeout)


def _usable(window: Window) -> QuerySet[Worker]:
    """Workers that may get work and were heard from lately."""
    return Worker.objects.filter(
        revoked=False,
        trust__gte=trust.setting("DIPACO_MIN_TRUST"),
        last_seen__gte=window.alive_since,
    )


def _holding() -> Exists:
    return Exists(Lease.objects.filter(worker=OuterRef("pk"), state=Lease.State.ACTIVE))


def stuck_workers(window: Window | None = None) -> QuerySet[Worker]:
    """Workers that heartbeat, hold a lease and completed nothing for three lease timeouts."""
    window = window or Window.at()
    since = window.stuck_since
    completed = Lease.objects.filter(
        worker=OuterRef("pk"), state=Lease.State.COMPLETED, ended_at__gte=since
    )
    # Work held since before the window and not handed in: still held, or given up
    # (expired, released) inside the window, so that a worker idle for a while before its
    # current lease is not counted as stuck for the idle time.
    held_since = (
        Lease.objects.filter(worker=OuterRef("pk"), granted_at__lte=since)
        .exclude(state=Lease.State.COMPLETED)
        .filter(Q(ended_at__isnull=True) | Q(ended_at__gte=since))
    )
    return _usable(window).filter(_holding(), Exists(held_since), ~Exists(completed))


def worker_counts(window: Window | None = None) -> dict[str, int]:
    """How many workers are in each of STATES (every state present, zeros included), in two
    queries: one aggregate over the workers, one count of the stuck."""
    window = window or Window.at()
    usable = Q(revoked=False, trust__gte=trust.setting("DIPACO_MIN_TRUST"))
    online = usable & Q(last_seen__gte=window.alive_since)
    totals = Worker.objects.aggregate(
        n_revoked=Count("pk", filter=Q(revoked=True)),
        n_distrusted=Count("pk", filter=Q(revoked=False) & ~usable),
        n_offline=Count("pk", filter=usable & ~Q(last_seen__gte=window.alive_since)),
        n_online=Count("pk", filter=online),
        n_holding=Count("pk", filter=online & Q(_holding())),
    )
    counts = dict.fromkeys(STATES, 0)
    counts["revoked"], counts["distrusted"] = totals["n_revoked"], totals["n_distrusted"]
    counts["offline"] = totals["n_offline"]
    counts["stuck"] = stuck_workers(window).count()
    counts["training"] = totals["n_holding"] - counts["stuck"]
    counts["idle"] = totals["n_online"] - totals["n_holding"]
    return counts


def on_probation() -> int:
    """Workers on probation (not revoked), whatever their state."""
    return Worker.objects.filter(revoked=False, probation=True).count()


def worker_state(worker: Worker, window: Window | None = None) -> str:
    """The one state of STATES that `worker` is in now."""
    window = window or Window.at()
    if worker.revoked:
        return "revoked"
    if worker.trust < trust.setting("DIPACO_MIN_TRUST"):
        return "distrusted"
    if worker.last_seen is None or worker.last_seen < window.alive_since:
        return "offline"
    if stuck_workers(window).filter(pk=worker.pk).exists():
        return "stuck"
    holding = Lease.objects.filter(worker=worker, state=Lease.State.ACTIVE).exists()
    return "training" if holding else "idle"


@receiver(signals.state_asked, dispatch_uid="rounds.reports.activity")
def _answer_state(sender: Any, worker: Worker, **kwargs: Any) -> str:
    return worker_state(worker)


# --- rounds ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundAge:
    """A run's oldest round not yet closed: how long it has been open, and for how long it
    was expected to be."""

    t: int
    state: str
    age_s: float
    expected_s: float

    @property
    def stalled(self) -> bool:
        return self.age_s > STALL_FACTOR * self.expected_s


def expected_round_s(run: Run, round_: Round) -> float:
    """Seconds `round_` is expected to stay open (the module docstring says how)."""
    closed = (
        Round.objects.filter(run=run, state=Round.State.CLOSED, closed_at__isnull=False)
        .order_by("-t")
        .values_list("opened_at", "closed_at")[:EXPECTED_FROM]
    )
    durations = [(end - start).total_seconds() for start, end in closed]
    if durations:
        return max(1.0, statistics.median(durations))
    if round_.deadline is not None:
        return max(1.0, (round_.deadline - round_.opened_at).total_seconds())
    return current_policy().round_deadline_s


def round_age(run: Run, now: datetime | None = None) -> RoundAge | None:
    """The run's oldest round still open or closing, or None when every round is closed."""
    now = now or timezone.now()
    round_ = run.rounds.exclude(state=Round.State.CLOSED).order_by("t").first()
    if round_ is None:
        return None
    age = max(0.0, (now - round_.opened_at).total_seconds())
    return RoundAge(round_.t, round_.state, age, expected_round_s(run, round_))
