"""Publishing: a module's next version becomes current (protocol step 5, docs/design.md).

Versions are immutable: publishing the same content again is a no-op (a retried task),
other content under an existing version is refused, and the current pointer only moves
forward. Workers lease against the current versions (rounds.open, rounds.lease).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from django.db import transaction
from django.db.models import Q

from dipaco.config import CommConfig
from dipaco_server.runs.errors import VersionConflict
from dipaco_server.runs.models import Module, ModuleVersion, Run

if TYPE_CHECKING:
    from dipaco.modules_file import Spec


@dataclass(frozen=True)
class EncodedUpdate:
    """A version's published update (comm.download_codec): its container file, and the
    residual its encoding left for the next one (error feedback)."""

    path: Path
    sha256: str
    size: int
    residual: Path


def encode_update(
    base: Path,
    base_sha256: str,
    weights: Path,
    residual: Path | None,
    spec: Spec,
    comm: CommConfig,
    work: Path,
) -> tuple[str, int, EncodedUpdate]:
    """Publish the step from module file `base` to `weights` as an encoded update.

    The update θ_new − θ_base, plus the base version's `residual` (None before the
    module's first encoded update), is encoded with ``comm.download_codec``
    (dipaco.updates.publish_update, as dipaco simulate does), and `weights` is rewritten
    as θ_base + decode(update): exactly what a worker holding the base version rebuilds
    from the update's bytes. Returns the new weights' (sha256, size) and the update.
    Holds a few whole copies of the module in memory (base, new, update, residual).
    """
    # torch here, not at the top: every server process imports this module (current_versions).
    from dipaco.modules_file import read_module, write_module
    from dipaco.updates import publish_update

    old = read_module(base, spec, base_sha256)
    new = read_module(weights, spec)
    kept = read_module(residual, spec) if residual is not None else None
    published, data, left = publish_update(
        old,
        new,
        comm.download_codec,
        kept,
        block_size=comm.block_size,
        compression=comm.compression,
    )
    del old, new, kept
    update = work / "update.safetensors"
    update.write_bytes(data)
    residual_out = work / "residual.safetensors"
    write_module(residual_out, {name: left[name] for name in spec})
    digest, size = write_module(weights, {name: published[name] for name in spec})
    encoded = EncodedUpdate(update, hashlib.sha256(data).hexdigest(), len(data), residual_out)
    return digest, size, encoded


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
