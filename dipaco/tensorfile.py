"""Write a safetensors file tensor by tensor, never holding a serialised copy in memory.

`safetensors.torch.save_file` builds the whole file's bytes before writing them: for a
checkpoint of a 150M path (weights, θ_old, AdamW moments: 20 bytes a parameter) that is a
second copy of everything it writes, 3.5 GB at the moment the worker holds the most.
`write_safetensors` writes the same format (an 8-byte little-endian header length, the
JSON header padded with spaces to a multiple of 8, then each tensor's bytes at its
offsets), streaming each tensor's own bytes from its storage, so it costs no memory beyond
a non-contiguous tensor's contiguous copy. Any safetensors reader (`safe_open`,
`load_file`) reads it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import BinaryIO

import torch
from torch import Tensor

__all__ = ["write_safetensors"]

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
    written."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    ordered = sorted(tensors.items())
    for name, tensor in ordered:
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}: write CPU tensors")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}, which safetensors cannot hold")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    handle.write(struct.pack("<Q", len(text)))
    handle.write(text)
    for _, tensor in ordered:
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            handle.write(flat.view(torch.uint8).numpy().data)  # its storage, not a copy
    return 8 + len(text) + offset
