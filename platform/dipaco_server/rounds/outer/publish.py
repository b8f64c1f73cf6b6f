"""The update a published version carries (protocol step 5, docs/design.md): the step from
the version before, encoded with ``comm.download_codec``.

The outer step (rounds.outer.step) encodes it here and records the version with
runs.versions.publish_module_version, which makes it current.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from dipaco.config import CommConfig
from dipaco.modules_file import Spec, read_module, write_module
from dipaco.updates import publish_update


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
