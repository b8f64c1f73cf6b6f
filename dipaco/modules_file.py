"""The module file: one module's weights (or momentum) as plain fp32 safetensors.

One home for the format, for every side that writes or reads it: the server writes module
versions and momenta (data preparation, the outer step) and reads them back streaming
(`ModuleWriter`, `ModuleReader`, whose header is a function of the module's spec alone,
byte for byte); the worker and ``dipaco download`` open files that came over the network
(`load_module_file`, refused unless names, shapes and dtypes are the module's). Any
safetensors reader opens these files; nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from dipaco.config import RunConfig
from dipaco.modular import module_spec

Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # dipaco.modular.module_spec

__all__ = [
    "CorruptModule",
    "ModuleReader",
    "ModuleWriter",
    "Spec",
    "load_module_file",
    "module_bytes",
    "module_header",
    "read_module",
    "write_module",
]


class CorruptModule(ValueError):
    """A stored module version that is not what the database says it is."""


def module_header(spec: Spec) -> bytes:
    """The safetensors header of a module file: a function of the spec alone, byte for byte."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, _) in spec.items():
        size = 4 * math.prod(shape)
        entries[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(text)) + text


def module_bytes(spec: Spec) -> int:
    return len(module_header(spec)) + 4 * sum(math.prod(shape) for shape, _ in spec.values())


class ModuleWriter:
    """Writes a module file sequentially: the tensors of `spec` in order, in any chunks."""

    def __init__(self, path: Path, spec: Spec) -> None:
        self.path = path
        self._expected = module_bytes(spec)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close or __exit__)
        self._digest = hashlib.sha256()
        self._size = 0
        self._put(memoryview(module_header(spec)))

    def _put(self, data: memoryview) -> None:
        self._digest.update(data)
        self._file.write(data)
        self._size += data.nbytes

    def write(self, values: Tensor) -> None:
        """The next values of the current tensor (flat, any length, cast to fp32)."""
        flat = values.detach().to(torch.float32).contiguous().view(-1)
        self._put(flat.view(torch.uint8).numpy().data)

    def close(self) -> tuple[str, int]:
        """(sha256, size) of the complete file; raises if fewer or more values came."""
        self._file.close()
        if self._size != self._expected:
            raise ValueError(f"{self.path}: wrote {self._size} B of a {self._expected} B module")
        return self._digest.hexdigest(), self._size

    def __enter__(self) -> ModuleWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._file.close()
        if kind is not None:
            self.path.unlink(missing_ok=True)


class ModuleReader:
    """Reads a module file sequentially; `finish` checks it was whole and matched `sha256`."""

    def __init__(self, path: Path, spec: Spec, sha256: str | None = None) -> None:
        self.path, self.sha256 = path, sha256
        header = module_header(spec)
        self._file = open(path, "rb")  # noqa: SIM115 (closed by finish or __exit__)
        self._left = os.fstat(self._file.fileno()).st_size - len(header)
        self._digest = hashlib.sha256()
        if self._left + len(header) != module_bytes(spec) or self._file.read(len(header)) != header:
            self._file.close()
            raise CorruptModule(
                f"{path} is not a module file of this spec (size or header); module versions "
                "are written by dipaco.modules_file.write_module (plain fp32 safetensors)"
            )
        self._digest.update(header)

    def read(self, count: int) -> Tensor:
        values = torch.empty(count, dtype=torch.float32)  # (count,)
        view = values.view(torch.uint8).numpy().data  # the tensor's bytes, written in place
        if 4 * count > self._left or self._file.readinto(view) != 4 * count:
            raise CorruptModule(f"{self.path} ended early")
        self._digest.update(view)
        self._left -= 4 * count
        return values

    def finish(self) -> None:
        self._file.close()
        if self._left:
            raise CorruptModule(f"{self.path}: {self._left} B were left unread")
        if self.sha256 is not None and self._digest.hexdigest() != self.sha256:
            raise CorruptModule(f"{self.path} does not match its recorded sha256")

    def __enter__(self) -> ModuleReader:
        return self

    def __exit__(self, *_: object) -> None:
        self._file.close()


def write_module(path: Path, tensors: Mapping[str, Tensor]) -> tuple[str, int]:
    """Write whole tensors as a module file; returns (sha256, size)."""
    spec = {name: (tuple(t.shape), torch.float32) for name, t in tensors.items()}
    with ModuleWriter(path, spec) as writer:
        for tensor in tensors.values():
            writer.write(tensor)
        return writer.close()


def read_module(path: Path, spec: Spec, sha256: str | None = None) -> dict[str, Tensor]:
    """A whole module file as tensors of the spec's shapes, checked against `sha256`."""
    with ModuleReader(path, spec, sha256) as reader:
        tensors = {
            name: reader.read(math.prod(shape)).view(shape) for name, (shape, _) in spec.items()
        }
        reader.finish()
    return tensors


def load_module_file(
    path: str | os.PathLike[str], config: RunConfig, module_id: str
) -> dict[str, Tensor]:
    """One module's fp32 weights from a safetensors file, refused unless names, shapes and
    dtypes are the module's (module_spec): the file came over the network."""
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on a bad file
        raise CorruptModule(f"module {module_id} file {path} is not safetensors ({exc})") from exc
    spec = module_spec(config, module_id)
    if set(tensors) != set(spec):
        missing, extra = sorted(set(spec) - set(tensors)), sorted(set(tensors) - set(spec))
        raise CorruptModule(f"module {module_id} file {path}: missing {missing}, extra {extra}")
    for name, (shape, dtype) in spec.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CorruptModule(
                f"module {module_id} file {path}: {name} is {tensor.dtype} "
                f"{tuple(tensor.shape)}, expected {dtype} {shape}"
            )
    return tensors
