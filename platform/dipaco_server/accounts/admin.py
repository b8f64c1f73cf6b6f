"""Django admin page for API tokens (hashes are never editable)."""

from django.contrib import admin

from dipaco_server.accounts.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "created_at", "last_used", "revoked")
    list_filter = ("revoked",)
    readonly_fields = ("token_hash", "created_at", "last_used", "revoked_at")
