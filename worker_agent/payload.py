"""What a unit moves: module weights in (fp32 safetensors), encoded pseudo-gradients out.

Module files are read with ``safetensors`` only (never pickle; docs/design.md §7), and every
tensor's name and shape is checked against the run's module spec before it is used:
a blob for another layout is refused with the module it belongs to. The server writes
plain fp32 safetensors (rounds.outer.step's ModuleWriter); a dipaco codec container is read
too, so the two formats stay interchangeable.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from dipaco import codecs
from dipaco.codecs.compression import is_zstd
from dipaco.config import RunConfig
from dipaco.inner import InnerState, state_fingerprint
from dipaco.modular import module_spec
from dipaco.modules_file import CorruptModule, load_module_file
from worker_agent.transfer import sha256_of

__all__ = ["EncodedDelta", "ModuleFileInvalid", "encode_deltas", "load_module"]

MAX_HEADER_BYTES = 64 << 20


class ModuleFileInvalid(ValueError):
    """A module blob that does not fit the run (names, shapes, format)."""


@dataclass(frozen=True)
class EncodedDelta:
    module_id: str
    path: Path
    sha256: str
    size: int


def _metadata(path: Path) -> dict[str, str]:
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if is_zstd(prefix):  # only dipaco.codecs writes zstd frames
            return {"format": codecs.FORMAT}
        if len(prefix) != 8:
            raise ModuleFileInvalid(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ModuleFileInvalid(f"{path} declares a {length}-byte header; refusing it")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise ModuleFileInvalid(f"{path} is not a safetensors file ({exc})") from exc
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def load_module(path: Path, config: RunConfig, module_id: str) -> dict[str, Tensor]:
    """The module's fp32 tensors, checked against ``module_spec(config, module_id)``."""
    spec = module_spec(config, module_id)
    if _metadata(path).get("format") == codecs.FORMAT:
        try:
            return codecs.decode(path, expected=spec)
        except codecs.CodecError as exc:
            raise ModuleFileInvalid(f"module {module_id}: {exc}") from exc
    try:
        return load_module_file(path, config, module_id)
    except CorruptModule as exc:
        raise ModuleFileInvalid(f"{exc}; the server sent weights of another model layout") from exc


def encode_deltas(
    deltas: Mapping[str, Mapping[str, Tensor]],
    config: RunConfig,
    directory: Path,
    state: InnerState | None = None,
    *,
    release: bool = False,
) -> tuple[list[EncodedDelta], InnerState]:
    """Each module's Δ encoded with the run's codec into ``<directory>/delta-<module>...``,
    with error feedback (`codecs.encode_module_deltas`) from the residual kept in `state`.

    Returns the encoded files and a copy of `state` whose residual is the error of these
    encodings: the path's state to keep once the server has accepted them (not before: a
    Δ it never received must not leave its rounding error behind as if it had).
    `release`: `deltas` (a mutable mapping, then) gives each module's Δ up once it is
    encoded, so the fp32 Δ still held shrinks as the residual grows (at 150M the two
    would otherwise meet whole: 8 bytes a parameter).
    """
    directory.mkdir(parents=True, exist_ok=True)
    after = InnerState(fingerprint=state_fingerprint(config))
    before = InnerState()
    if state is not None:
        # The moments' mapping itself (not a copy): the resident trainer knows it by identity.
        after = InnerState(state.adam, {}, state.fingerprint)
        before = state
    feedback = _Feedback(before, after)
    encoded = []
    for module_id in list(deltas):
        one = {module_id: deltas[module_id]}
        if release:
            assert isinstance(deltas, MutableMapping)
            del deltas[module_id]
        for _, data in codecs.encode_module_deltas(one, config.comm, feedback):
            path = directory / f"delta-{module_id}.safetensors"
            tmp = path.with_name(f"{path.name}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            encoded.append(EncodedDelta(module_id, path, sha256_of(path), len(data)))
    # Modules without a Δ this time keep their residual (read only now, and only theirs).
    sent = {e.module_id for e in encoded}
    kept = {k: before.residual[k] for k in before.residual if k.split("/")[0] not in sent}
    after.residual = {**kept, **after.residual}
    return encoded, after


class _Feedback:
    """Error feedback from `before`'s residual (read a module at a time: a lazy one stays
    on disk) into `after`'s (the new residuals only), leaving `before` as it was."""

    def __init__(self, before: InnerState, after: InnerState) -> None:
        self.before, self.after = before, after

    def module_residual(self, module_id: str) -> dict[str, Tensor]:
        return self.before.module_residual(module_id)

    def set_module_residual(self, module_id: str, tensors: Mapping[str, Tensor]) -> None:
        self.after.set_module_residual(module_id, tensors)
