"""Datasets, runs, modules with their immutable versions, paths, and metric points.

Models hold data and constraints only; every state change goes through
``runs.services`` (the run state machine lives in one place there).
"""

from __future__ import annotations

from functools import cached_property

from django.db import models
from django.utils import timezone

from dipaco.config import RunConfig


class Dataset(models.Model):
    """A corpus prepared for training: its tokenizer, router and statistics."""

    class State(models.TextChoices):
        PENDING = "pending"
        PREPARING = "preparing"
        READY = "ready"
        FAILED = "failed"

    name = models.CharField(max_length=100, unique=True)
    source = models.CharField(
        max_length=1000,
        help_text='"stdlib", a local file, directory or glob, or s3://bucket/prefix '
        "(text, JSON Lines .gz/.zst, Parquet, a saved datasets directory).",
    )
    # The column (Parquet, Arrow) or field (JSON Lines) that holds each record's text.
    text_field = models.CharField(max_length=100, default="text")
    # Prepare at most about this many training tokens: a seeded subset of the records.
    token_budget = models.BigIntegerField(null=True, blank=True)
    stats = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    tokenizer_key = models.CharField(max_length=1024, blank=True)
    router_key = models.CharField(max_length=1024, blank=True)
    error = models.TextField(blank=True)
    # What prepare_dataset is doing now: {"stage", "step", "steps", "detail", "updated_at"}.
    progress = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class Run(models.Model):
    """A training run: its whole validated config and where it is in its life."""

    class State(models.TextChoices):
        DRAFT = "draft"
        PREPARING = "preparing"
        READY = "ready"
        RUNNING = "running"
        PAUSED = "paused"
        FINISHED = "finished"
        FAILED = "failed"
        CANCELLED = "cancelled"

    class Phase(models.TextChoices):
        """docs/design.md §1: a dense DiLoCo phase, the Celery tasks between, then DiPaCo rounds."""

        DENSE = "1"  # phase 1: one dense path-size model, config.phase1.rounds rounds
        PREPARING = "preparing"  # routing and module initialisation from the phase-1 model
        PATHS = "2"  # phase 2: DiPaCo rounds (a run without phase1 starts here)

    name = models.CharField(max_length=64, unique=True)
    # RunConfig.model_dump(mode="json"), defaults filled in: stored whole (STYLE: config).
    config = models.JSONField()
    dataset = models.ForeignKey(
        Dataset, null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.DRAFT)
    current_round = models.PositiveIntegerField(default=0)
    # Rounds are numbered across both phases: 0 .. phase1.rounds - 1 train the dense model,
    # the rest are DiPaCo rounds (runs.phases).
    phase = models.CharField(max_length=16, choices=Phase.choices, default=Phase.PATHS)
    # Document chunks written for routing after phase 1, one embedding task each.
    phase_chunks = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)
    # What prepare_run is doing now: {"stage", "step", "steps", "detail", "updated_at"}.
    progress = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = (models.Index(fields=["state"], name="run_state_idx"),)

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"

    @cached_property
    def run_config(self) -> RunConfig:
        """The stored config as the library's object (validated when the run was created)."""
        return RunConfig.model_validate(self.config)


class Module(models.Model):
    """One module of a run (dipaco.modular ids: "<level>.<k>", "shared", "path.<p>").

    Phase-1 modules are those of the run's dense DiLoCo config (``RunConfig.dense_phase``:
    "0.0" and "shared"), so their ids repeat phase 2's; ``phase`` tells them apart, and
    their blobs live under ``runs/<run>/phase1/`` (runs.keys).
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="modules")
    phase = models.PositiveSmallIntegerField(default=2)  # 1: the dense phase, 2: DiPaCo
    module_id = models.CharField(max_length=32)
    level = models.PositiveSmallIntegerField(null=True, blank=True)  # None: shared, path.<p>
    index = models.PositiveIntegerField(default=0)  # k in its level, p for path.<p>
    # The only thing that moves when an outer step lands (docs/design.md §4); blobs never change.
    current_version = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        constraints = (
            models.UniqueConstraint(
                fields=["run", "phase", "module_id"], name="module_unique_per_run_phase"
            ),
        )

    def __str__(self) -> str:
        return f"run {self.run_id} module {self.module_id}"


class ModuleVersion(models.Model):
    """Weights of a module after outer step t (version 0: the initial weights)."""

    module = models.ForeignKey(Module, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    blob_key = models.CharField(max_length=1024)
    sha256 = models.CharField(max_length=64)
    size = models.PositiveBigIntegerField()
    momentum_key = models.CharField(max_length=1024, blank=True)
    # With comm.download_codec int8/fp16 (rounds.outer.publish): the encoded update from the
    # version before (a dipaco.codecs container; the weights are exactly the version before
    # plus its decoded values) and the encoding's residual (error feedback); blank when the
    # version was not made by an outer step, or with fp32 downloads.
    update_key = models.CharField(max_length=1024, blank=True, default="")
    update_sha256 = models.CharField(max_length=64, blank=True, default="")
    update_size = models.PositiveBigIntegerField(null=True, blank=True)
    residual_key = models.CharField(max_length=1024, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = (
            models.UniqueConstraint(fields=["module", "version"], name="module_version_unique"),
        )

    def __str__(self) -> str:
        return f"{self.module} v{self.version}"


class Path(models.Model):
    """A path: one module per level, its data shard and its early-stopping record."""

    class State(models.TextChoices):
        ACTIVE = "active"
        FINISHED = "finished"  # early-stopped or out of rounds: gets no more work units

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="paths")
    phase = models.PositiveSmallIntegerField(default=2)  # 1: the dense model's one path
    index = models.PositiveIntegerField()
    choices = models.JSONField()  # module index per level, e.g. [1, 0]
    modules = models.JSONField()  # module ids, e.g. ["0.1", "1.0", "shared"]
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    best_val_loss = models.FloatField(null=True, blank=True)
    best_round = models.PositiveIntegerField(null=True, blank=True)
    routing_share = models.FloatField(null=True, blank=True)  # share of documents routed here
    train_tokens = models.PositiveBigIntegerField(default=0)  # set when the shard is written
    val_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = (
            models.UniqueConstraint(
                fields=["run", "phase", "index"], name="path_unique_per_run_phase"
            ),
        )

    def __str__(self) -> str:
        return f"run {self.run_id} path {self.index}"


class MetricPoint(models.Model):
    """One value of a named series (loss, tokens/s...) for the dashboard's curves."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metrics")
    path = models.ForeignKey(
        Path, null=True, blank=True, on_delete=models.CASCADE, related_name="metrics"
    )
    round = models.PositiveIntegerField(null=True, blank=True)  # outer round t
    name = models.CharField(max_length=64)
    value = models.FloatField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = (models.Index(fields=["run", "name", "round"], name="metric_series_idx"),)

    def __str__(self) -> str:
        return f"{self.name}={self.value} (run {self.run_id}, round {self.round})"
