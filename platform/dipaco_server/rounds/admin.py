"""Read-only Django admin pages for rounds, units, leases, contributions and outer steps.

Nothing here can be added, changed or deleted from the admin, superusers included:
scheduling state changes only through the round protocol (rounds.protocol.leases, complete,
outer_step), and contributions and outer steps are the immutable record of what each
module version was computed from.
"""

from django.contrib import admin

from dipaco_server.core.admin import ReadOnly
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round, WorkUnit


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


@admin.register(OuterStep)
class OuterStepAdmin(ReadOnly):
    list_display = ("pk", "round", "module", "outcome", "version", "accepted", "rejected")
    list_filter = ("outcome",)
