"""Read-only Django admin pages for rounds, units, leases and contributions."""

from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest

from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit


class ReadOnly(admin.ModelAdmin):
    """Scheduling state changes only through rounds.scheduler (conditional updates)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(Round)
class RoundAdmin(ReadOnly):
    list_display = ("run", "t", "state", "opened_at", "deadline", "closed_at")
    list_filter = ("state",)


@admin.register(WorkUnit)
class WorkUnitAdmin(ReadOnly):
    list_display = ("pk", "round", "path", "replica", "state", "attempts")
    list_filter = ("state",)


@admin.register(Lease)
class LeaseAdmin(ReadOnly):
    list_display = ("pk", "unit", "worker", "state", "attempt", "deadline")
    list_filter = ("state",)
    exclude = ("secret_hash",)


@admin.register(Contribution)
class ContributionAdmin(ReadOnly):
    list_display = ("pk", "unit", "module", "status", "tokens", "size")
    list_filter = ("status",)
