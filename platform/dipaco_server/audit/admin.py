"""The audit log in the Django admin: listed, filtered and searched, never edited."""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from dipaco_server.audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = (
        "created_at", "actor", "channel", "action", "target_type", "target_id", "outcome",
        "status", "address",
    )  # fmt: skip
    list_filter = ("action", "outcome", "channel")
    search_fields = ("actor", "action", "target_id", "address")
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
