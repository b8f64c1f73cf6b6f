"""Outer rounds, their work units, the leases that hand units to workers, and contributions.

State changes go through rounds.lifecycle.open / rounds.protocol.leases / rounds.protocol.complete,
each written as a conditional UPDATE so that concurrent requests cannot both win.
"""

from __future__ import annotations

from datetime import datetime

from django.db import models
from django.utils import timezone

from dipaco_server.runs.models import Module, Path, Run
from dipaco_server.workers.models import Worker


class Round(models.Model):
    """Outer round t of a run: open (units handed out), closing (outer step), closed."""

    class State(models.TextChoices):
        OPEN = "open"
        CLOSING = "closing"
        CLOSED = "closed"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="rounds")
    t = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.OPEN)
    opened_at = models.DateTimeField(default=timezone.now)
    deadline = models.DateTimeField(null=True, blank=True)  # quorum closes it after this
    closed_at = models.DateTimeField(null=True, blank=True)
    # When close_round last sent the outer steps: a round closing for long lost them.
    closing_at = models.DateTimeField(null=True, blank=True)
    # When the round began closing (its outer step's start): what the next round's expected
    # opening is counted from (rounds.protocol.leases), whatever the resends do to closing_at.
    closing_started_at = models.DateTimeField(null=True, blank=True)
    # The first round's settlement over whole units (rounds.verification.settlement): lease
    # id -> "<code>: <message>" for each unit it refused or held out; computed by the first
    # module step that needs it, so every module's first step applies the same verdicts.
    first_round = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = (models.UniqueConstraint(fields=["run", "t"], name="round_unique_per_run"),)
        indexes = (models.Index(fields=["state", "deadline"], name="round_state_deadline_idx"),)

    def __str__(self) -> str:
        return f"run {self.run_id} round {self.t} ({self.state})"

    def previous_published(self) -> bool:
        """Whether round t - 1 (if any) is closed: its outer step published its versions.

        With ``outer.overlap`` "delayed", round t opened while round t - 1 was closing, and round
        t's Δs are applied onto the versions round t - 1 publishes: round t may not close (and
        so neither step nor open round t + 1) before that, which bounds the staleness at one
        version. Without overlap round t opens only after round t - 1 closed, so this holds.
        """
        if self.t == 0:
            return True
        previous = Round.objects.filter(run_id=self.run_id, t=self.t - 1)
        return not previous.exclude(state=Round.State.CLOSED).exists()


# A check copy's replica index is this plus its original's (rounds.verification.replication):
# replicas_per_path is far below it.
CHECK_OFFSET = 1_000_000


class WorkUnit(models.Model):
    """One replica of one path in one round: H inner steps on windows of the path's shard."""

    class State(models.TextChoices):
        QUEUED = "queued"
        LEASED = "leased"
        DONE = "done"
        EXPIRED = "expired"  # given up: too many failed attempts, or its round closed first

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="units")
    path = models.ForeignKey(Path, on_delete=models.CASCADE, related_name="units")
    replica = models.PositiveIntegerField()
    # Where the unit starts in its path's seeded window order, and how many windows it
    # reads (dipaco.data.windows: unit_start, unit_windows).
    data_position = models.PositiveBigIntegerField()
    data_windows = models.PositiveBigIntegerField()
    base_versions = models.JSONField()  # {module id: version} the worker starts from
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    attempts = models.PositiveIntegerField(default=0)  # leases granted so far
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = (
            models.UniqueConstraint(
                fields=["round", "path", "replica"], name="unit_unique_per_replica"
            ),
        )
        indexes = (
            # grant_lease: queued units of open rounds; coverage: units per (round, path, state).
            models.Index(fields=["state", "round"], name="unit_state_round_idx"),
            models.Index(fields=["round", "path", "state"], name="unit_round_path_state_idx"),
            # grant_lease: the next queued unit of one (round, path), in replica order,
            # without sorting every queued unit (27 ms with 5,000 queued, 0.1 ms with it).
            models.Index(
                fields=["round", "path", "replica"],
                condition=models.Q(state="queued"),
                name="unit_queued_next_idx",
            ),
        )

    def __str__(self) -> str:
        return f"unit {self.pk} (round {self.round_id}, path {self.path_id}, r{self.replica})"


class Lease(models.Model):
    """A worker's claim on a unit; it must heartbeat before ``deadline`` to keep it."""

    class State(models.TextChoices):
        ACTIVE = "active"
        COMPLETED = "completed"
        RELEASED = "released"
        EXPIRED = "expired"

    unit = models.ForeignKey(WorkUnit, on_delete=models.CASCADE, related_name="leases")
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="leases")
    secret_hash = models.CharField(max_length=64)
    attempt = models.PositiveIntegerField()  # 1 for the unit's first lease
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    granted_at = models.DateTimeField(default=timezone.now)
    # Liveness: a heartbeat moves it to now + the heartbeat timeout, never past hard_deadline,
    # which is set once from the worker's measured speed.
    deadline = models.DateTimeField()
    hard_deadline = models.DateTimeField()
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # Inner steps of the unit this lease may train, counted from the unit's start (<= H),
    # sized to the worker's measured speed (rounds.protocol.sizing.size_unit); 0 on leases granted
    # before sizing existed, meaning H. Its tokens cap the Δ's weight (rounds.protocol.complete).
    steps = models.PositiveIntegerField(default=0)
    seconds_limit = models.FloatField(null=True, blank=True)  # a calibration unit's time
    size_reason = models.CharField(max_length=240, blank=True, default="")
    # Bytes its manifest sent the worker to (rounds.protocol.api.manifest, the last one asked for):
    # encoded updates for the modules it holds an earlier version of, fp32 files for the
    # rest, 0 for those it holds already. Null on leases from before it was recorded.
    download_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    # Proof of useful work scores the unit's whole Δ (every module of its path) at once, so the
    # first module step of the round that scores it records the result here, with the versions
    # it was relative to, and the path's other module steps reuse it (rounds.verification.scorer)
    # instead of fetching the unit's other Δs and running the same forward passes again.
    score = models.JSONField(null=True, blank=True)
    # The half of that score that does not depend on the Δ: the path's base losses on the
    # unit's scored windows, computed while the unit trains (rounds.verification.unit_score
    # .score_granted), with the versions and the windows it is of; the score at completion
    # then runs only the passes with the Δ applied.
    base_losses = models.JSONField(null=True, blank=True)
    # Not a column: the round's deadline as a heartbeat read it (rounds.protocol.leases.heartbeat).
    round_deadline: datetime | None = None

    class Meta:
        indexes = (
            models.Index(fields=["state", "deadline"], name="lease_state_deadline_idx"),
            models.Index(fields=["worker", "state"], name="lease_worker_state_idx"),
        )

    def __str__(self) -> str:
        return f"lease {self.pk} of unit {self.unit_id} by worker {self.worker_id} ({self.state})"


class Contribution(models.Model):
    """One module's pseudo-gradient from one completed lease, pending server verification."""

    class Status(models.TextChoices):
        PENDING = "pending"
        ACCEPTED = "accepted"
        REJECTED = "rejected"

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="contributions")
    unit = models.ForeignKey(WorkUnit, on_delete=models.CASCADE, related_name="contributions")
    module = models.ForeignKey(Module, on_delete=models.CASCADE, related_name="contributions")
    blob_key = models.CharField(max_length=1024)  # built from ids by the server (runs.keys)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    tokens = models.PositiveBigIntegerField()
    metrics = models.JSONField(default=dict, blank=True)
    # The module version the Δ is relative to: the unit's base version, or with
    # outer.overlap eager the version round t - 1 published, when the unit rebased onto it
    # (rounds.protocol.rebase). Null on contributions from before it was recorded: the unit's base.
    base_version = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    # When a second worker's copy of its unit was compared with it: its Δ minus that copy's,
    # as a count sketch (rounds.verification.persistence), its worker's evidence of what it
    # keeps adding, and that copy's worker; null otherwise.
    replica_sketch = models.BinaryField(null=True, blank=True)
    replica_partner = models.ForeignKey(
        Worker, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The other copy's worker when the two copies agreed (or were identical): with every
    # Δ of its unit accepted and agreeing with the same worker, probation's evidence.
    agreed_with = models.ForeignKey(
        Worker, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # What the checks that need no other Δ found when its completion arrived (the
    # check_unit task, rounds.verification.arrival): {"sha256", "norm"} and the cosine with
    # the outer momentum of version "momentum_version", or {"sha256", "code", "message"}
    # when refused. The outer step reuses it for these bytes; null: the step checks inline.
    arrival_check = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = (
            models.UniqueConstraint(fields=["lease", "module"], name="contribution_once_per_lease"),
            # One live Δ per unit and module: a duplicate can never be averaged in twice.
            models.UniqueConstraint(
                fields=["unit", "module"],
                condition=models.Q(status__in=["pending", "accepted"]),
                name="contribution_once_per_unit",
            ),
        )
        indexes = (models.Index(fields=["module", "status"], name="contribution_module_idx"),)

    def __str__(self) -> str:
        return f"contribution {self.pk} of unit {self.unit_id} to {self.module_id} ({self.status})"


class OuterStep(models.Model):
    """One module's outer step in one round: its outcome, recorded once (rounds.outer.step).

    The row is written in the same transaction that publishes version t + 1 and settles
    the contributions, so its existence is what makes a retried step a no-op.
    """

    class Outcome(models.TextChoices):
        STEPPED = "stepped"  # version t + 1 was written
        KEPT = "kept"  # no contribution was accepted: the module keeps its version

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="outer_steps")
    module = models.ForeignKey(Module, on_delete=models.CASCADE, related_name="outer_steps")
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    base_version = models.PositiveIntegerField(null=True, blank=True)
    version = models.PositiveIntegerField(null=True, blank=True)  # None when kept
    accepted = models.PositiveIntegerField(default=0)
    rejected = models.PositiveIntegerField(default=0)
    tokens = models.PositiveBigIntegerField(default=0)  # behind the accepted contributions
    median_norm = models.FloatField(null=True, blank=True)  # of the verified Δs
    update_norm = models.FloatField(null=True, blank=True)  # of the aggregated outer gradient
    seconds = models.FloatField(default=0.0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = (
            models.UniqueConstraint(fields=["round", "module"], name="outer_step_once_per_round"),
        )

    def __str__(self) -> str:
        return f"round {self.round_id} module {self.module_id}: {self.outcome}"


class RoundStage(models.Model):
    """Where a round's server time went (rounds.stages): one stage's wall span, first task
    started to last task ended, and its tasks' summed seconds. Training is not stored: it
    is the round's opening to its last completion (rounds.stages.round_stages)."""

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="stages")
    stage = models.CharField(max_length=32)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    seconds = models.FloatField(default=0.0)
    tasks = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = (models.UniqueConstraint(fields=["round", "stage"], name="round_stage_once"),)

    def __str__(self) -> str:
        return f"round {self.round_id} {self.stage}: {self.seconds:.1f} s"
