"""Read-mostly Django admin pages for operators; state changes belong to the services."""

from django.contrib import admin

from dipaco_server.core.admin import ReadOnly
from dipaco_server.runs.models import Dataset, MetricPoint, Module, ModuleVersion, Path, Run


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "current_round", "created_at", "started_at")
    list_filter = ("state",)
    # Through runs.services.transition only, so the state machine stays in one place.
    readonly_fields = ("state", "config", "current_round", "started_at", "finished_at")


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "source", "created_at")


@admin.register(Module)
class ModuleAdmin(admin.ModelAdmin):
    list_display = ("run", "module_id", "level", "index", "current_version")
    list_filter = ("run",)


@admin.register(ModuleVersion)
class ModuleVersionAdmin(ReadOnly):
    """Immutable: a published version is what workers trained from and downloads serve."""

    list_display = ("module", "version", "size", "sha256", "created_at")


@admin.register(Path)
class PathAdmin(admin.ModelAdmin):
    list_display = ("run", "index", "state", "best_val_loss", "train_tokens")
    list_filter = ("run", "state")


@admin.register(MetricPoint)
class MetricPointAdmin(admin.ModelAdmin):
    list_display = ("run", "path", "round", "name", "value", "created_at")
    list_filter = ("name",)
