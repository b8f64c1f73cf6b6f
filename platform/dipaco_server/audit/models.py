"""One row per admin action, written once and never changed.

Append-only in the code: saving an existing row, deleting one and bulk updates or
deletes through the manager all raise AuditLogIsAppendOnly. The API and the Django
admin only read. (Someone with the database's credentials can still edit it; a
tamper-proof log would need a store outside this database.)
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.utils import timezone


class AuditLogIsAppendOnly(Exception):
    """An attempt to change or delete audit rows: they are only ever added."""


class AuditQuerySet(models.QuerySet["AuditEntry"]):
    def update(self, **kwargs: Any) -> int:
        raise AuditLogIsAppendOnly("audit entries cannot be updated")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AuditLogIsAppendOnly("audit entries cannot be deleted")


class AuditEntry(models.Model):
    """Who did what to which object, from where, when, and how it turned out."""

    class Outcome(models.TextChoices):
        OK = "ok"
        REFUSED = "refused"  # a 4xx: the action did not happen
        FAILED = "failed"  # a server error

    class Channel(models.TextChoices):
        API = "api"
        DASHBOARD = "dashboard"

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    # The user as a name and an id, not a foreign key: the row outlives the user.
    actor = models.CharField(max_length=150)
    actor_id = models.BigIntegerField(null=True, blank=True)
    channel = models.CharField(max_length=16, choices=Channel.choices)
    api_token_id = models.BigIntegerField(null=True, blank=True)
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    params = models.JSONField(default=dict, blank=True)
    address = models.GenericIPAddressField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True)

    objects = AuditQuerySet.as_manager()

    class Meta:
        ordering = ("-created_at", "-pk")
        indexes = (models.Index(fields=("target_type", "target_id")),)
        verbose_name = "audit entry"
        verbose_name_plural = "audit log"

    def __str__(self) -> str:
        target = f" {self.target_type} {self.target_id}" if self.target_type else ""
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor}: {self.action}{target}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AuditLogIsAppendOnly(f"audit entry {self.pk} cannot be changed")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AuditLogIsAppendOnly(f"audit entry {self.pk} cannot be deleted")
