"""Publishing: a module's next version becomes current (protocol step 5, docs/design.md).

Versions are immutable: publishing the same content again is a no-op (a retried task),
other content under an existing version is refused, and the current pointer only moves
forward. Preparation publishes version 0 of every module (runs.prepare), each outer step
the next (rounds.outer.step); workers lease against the current versions (rounds.lifecycle.open,
rounds.protocol.leases).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Q

from dipaco_server.runs.errors import VersionConflict
from dipaco_server.runs.models import Module, ModuleVersion, Run


def publish_module_version(
    module: Module,
    version: int,
    *,
    blob_key: str,
    sha256: str,
    size: int,
    momentum_key: str = "",
    update_key: str = "",
    update_sha256: str = "",
    update_size: int | None = None,
    residual_key: str = "",
) -> ModuleVersion:
    """Record version `version` of `module` and make it current, idempotently.

    Publishing the same content again (a retried task) is a no-op; other content
    under an existing version raises VersionConflict. The current pointer only
    moves forward. `update_*` and `residual_key`: the encoded update from the version
    before, where the run publishes one (`encode_update`).
    """
    with transaction.atomic():
        row, created = ModuleVersion.objects.get_or_create(
            module=module,
            version=version,
            defaults={
                "blob_key": blob_key,
                "sha256": sha256,
                "size": size,
                "momentum_key": momentum_key,
                "update_key": update_key,
                "update_sha256": update_sha256,
                "update_size": update_size,
                "residual_key": residual_key,
            },
        )
        if not created and (row.blob_key, row.sha256, row.size) != (blob_key, sha256, size):
            raise VersionConflict(
                f"module {module.module_id} v{version} exists with other content; "
                "versions are immutable, write the next version instead",
                module=module.module_id,
                version=version,
            )
        behind = Q(current_version__isnull=True) | Q(current_version__lt=version)
        Module.objects.filter(behind, pk=module.pk).update(current_version=version)
    module.refresh_from_db(fields=["current_version"])
    return row


def current_versions(run: Run, phase: int = 2) -> dict[str, int | None]:
    """module id -> its current version (None before version 0 exists), in one phase."""
    modules = run.modules.filter(phase=phase).order_by("pk")
    return dict(modules.values_list("module_id", "current_version"))
