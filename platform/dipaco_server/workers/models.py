"""Workers (volunteer machines) and the enrollment tokens that let them register.

Only hashes of tokens are stored (see core.tokens); logic is in workers.services.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class EnrollmentToken(models.Model):
    """A secret an operator hands to volunteers; each use registers one worker."""

    token_hash = models.CharField(max_length=64, unique=True)
    label = models.CharField(max_length=100, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)  # None: never
    max_uses = models.PositiveIntegerField(null=True, blank=True, default=1)  # None: unlimited
    uses = models.PositiveIntegerField(default=0)
    revoked = models.BooleanField(default=False)
    # The operator's own machines: the workers it registers are trusted from the start, never
    # on probation, and referee the round where evidence is thinnest (workers.probation).
    trusted = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"enrollment token {self.pk} ({self.label or 'no label'})"


class Worker(models.Model):
    """One registered machine, authenticated by its own revocable bearer token."""

    name = models.CharField(max_length=64)
    owner = models.CharField(max_length=100, blank=True)
    token_hash = models.CharField(max_length=64, unique=True)  # the index authenticate() hits
    enrollment = models.ForeignKey(
        EnrollmentToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="workers"
    )
    device = models.JSONField(default=dict, blank=True)  # as the worker reported it: untrusted
    measured_speed = models.FloatField(null=True, blank=True)  # training tokens per second
    created_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Counters for the dashboard and for judging a worker (docs/design.md §4: drops count against it).
    # units_completed and tokens_processed count only units whose every Δ was accepted.
    units_completed = models.PositiveIntegerField(default=0)
    leases_expired = models.PositiveIntegerField(default=0)
    contributions_accepted = models.PositiveIntegerField(default=0)
    contributions_rejected = models.PositiveIntegerField(default=0)
    tokens_processed = models.PositiveBigIntegerField(default=0)
    # How far the server trusts its work, 0..1 (workers.trust): failed checks and replica
    # disagreements lower it, accepted work raises it; it sets how many of its units are
    # replicated, and below DIPACO_MIN_TRUST it gets no more work.
    trust = models.FloatField(default=1.0)
    replicas_agreed = models.PositiveIntegerField(default=0)
    replicas_disagreed = models.PositiveIntegerField(default=0)
    # Trust is earned (workers.probation): a worker registered through an enrollment token
    # starts on probation (every unit it takes replicated, and it checks others' units) until
    # its copies agreed with `probation.PARTNERS` distinct workers' in both roles. Rows that
    # existed before probation keep their standing (the migration sets False).
    probation = models.BooleanField(default=False)
    # Registered with a token the operator marked trusted: never on probation, never
    # audited, and its copies referee a module's first step (rounds.verification).
    operator_trusted = models.BooleanField(default=False)
    # Units of its that were also issued as a check copy (probation, audit, suspicion).
    audits = models.PositiveIntegerField(default=0)
    # [worker id, 1 if this worker's copy was the check copy else 0] per pair whose copies
    # agreed, newest last, at most probation.KEEP_PARTNERS: its evidence for leaving probation.
    partners = models.JSONField(default=list, blank=True)
    # Credit held while on probation (BOINC grants credit once a result validates): the
    # units and tokens of its accepted work, moved to units_completed and tokens_processed
    # when it leaves probation, forfeited when one of its copies loses a comparison.
    held_units = models.PositiveIntegerField(default=0)
    held_tokens = models.PositiveBigIntegerField(default=0)
    # An established worker one of whose copies was close to another worker's without
    # confirming it (rounds.verification.rules.AGREE_COSINE: a bias of 0.5 x the Δ's norm or
    # more): every unit it takes is replicated and its credit held, as on probation, until
    # a copy of its agrees conclusively (workers.trust.doubt). Never a refusal by itself.
    doubted = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"worker {self.pk} ({self.name})"
