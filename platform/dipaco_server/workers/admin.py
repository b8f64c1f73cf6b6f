"""Django admin pages for workers and enrollment tokens (hashes are never editable)."""

from django.contrib import admin

from dipaco_server.workers.models import EnrollmentToken, Worker


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "owner",
        "revoked",
        "last_seen",
        "units_completed",
        "trust",
        "contributions_rejected",
        "measured_speed",
    )
    list_filter = ("revoked",)
    readonly_fields = ("token_hash", "enrollment", "device", "created_at", "last_seen")


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(admin.ModelAdmin):
    list_display = ("label", "uses", "max_uses", "expires_at", "revoked", "created_by")
    readonly_fields = ("token_hash", "uses", "created_at")
