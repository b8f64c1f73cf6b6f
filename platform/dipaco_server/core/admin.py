"""What the Django admin pages of every app share."""

from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest


class ReadOnly(admin.ModelAdmin):
    """Listed and viewed; never added, changed or deleted through the admin."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False
