"""Write a safetensors file tensor by tensor, never holding a serialised copy in memory.

`safetensors.torch.save_file` builds the whole file's bytes before writing them: for a
checkpoint of a 150M path (weights, θ_old, AdamW moments: 20 bytes a parameter) that is a
second copy of everything it writes, 3.5 GB at the moment the worker holds the most.
`write_safetensors` writes the same format (an 8-byte little-endian header length, the
JSON header padded with spaces to a multiple of 8, then each tensor's bytes at its
offsets), streaming each tensor's own bytes from its storage, so it costs no memory beyond
a non-contiguous tensor's contiguous copy. Any safetensors reader (`safe_open`,
`load_file`) reads it.

`FileTensors` reads such a file back lazily, one tensor per access, with plain reads
through a file descriptor it keeps open (no mmap: mapped pages would count in the
process's resident memory for as long as they stay mapped): a mapping of the file's
tensors that costs no memory until a tensor is read, and each read costs that tensor
only. The descriptor keeps the bytes readable after the file is replaced or deleted.
`write_safetensors` takes such a mapping too (any mapping with a `spec(name)`), reading
each tensor only while it writes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

__all__ = ["FileTensors", "write_safetensors"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    handle: BinaryIO, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write `tensors` (CPU) to the open binary `handle` as a safetensors file; the bytes
    written. A mapping with a `spec(name) -> (dtype, shape)` (FileTensors) is read one
    tensor at a time, as it is written."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    names = sorted(tensors)
    spec = getattr(tensors, "spec", None)
    for name in names:
        if spec is not None:
            dtype, shape = spec(name)
        else:
            tensor = tensors[name]
            if tensor.device.type != "cpu":
                raise ValueError(f"{name} is on {tensor.device}: write CPU tensors")
            dtype, shape = tensor.dtype, tuple(tensor.shape)
        if dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {dtype}, which safetensors cannot hold")
        size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    handle.write(struct.pack("<Q", len(text)))
    handle.write(text)
    for name in names:
        flat = tensors[name].detach().contiguous().reshape(-1)
        if flat.numel():
            handle.write(flat.view(torch.uint8).numpy().data)  # its storage, not a copy
    return 8 + len(text) + offset


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_FROM_CODE = {code: dtype for dtype, code in _DTYPES.items()}


class FileTensors(Mapping[str, Tensor]):
    """A safetensors file's tensors, read one at a time on access (module doc).

    `keys`: {our name: the file's name} to expose a subset under other names (default: every
    tensor under its own name). Each `[name]` reads a new tensor; `spec(name)` its dtype and
    shape without reading it. Thread-safe (positioned reads)."""

    def __init__(self, path: str | Path, keys: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if length > 100_000_000:
                raise ValueError(f"{self.path}: a safetensors header of {length} bytes")
            header = json.loads(os.pread(self._fd, length, 8))
        except (OSError, ValueError, struct.error) as error:
            os.close(self._fd)
            raise ValueError(f"{self.path} is not a safetensors file: {error}") from error
        header.pop("__metadata__", None)
        self._base = 8 + length
        self._header = header
        self._keys = dict(keys) if keys is not None else {name: name for name in header}
        missing = [k for k, v in self._keys.items() if v not in header]
        if missing:
            os.close(self._fd)
            raise ValueError(f"{self.path} holds no tensor for {missing[:3]}")

    def reopen(self, path: str | Path, keys: Mapping[str, str] | None = None) -> None:
        """Read the same names from another file (a copy of these tensors written elsewhere),
        keeping this mapping's identity; the old descriptor is closed."""
        other = FileTensors(path, keys)
        if set(other) != set(self._keys):
            raise ValueError(f"{path} holds other tensors than {self.path}")
        old, self._fd = self._fd, other._fd
        other._fd = -1
        self.path, self._base = Path(path), other._base
        self._header, self._keys = other._header, other._keys
        os.close(old)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        entry = self._header[self._keys[name]]
        return _FROM_CODE[entry["dtype"]], tuple(entry["shape"])

    def __getitem__(self, name: str) -> Tensor:
        entry = self._header[self._keys[name]]
        start, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=_FROM_CODE[entry["dtype"]])
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        done = 0
        while done < end - start:
            got = os.preadv(self._fd, [view[done:]], self._base + start + done)
            if got <= 0:
                raise ValueError(f"{self.path} ends inside {name}: the file is torn")
            done += got
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
