"""Pseudo-gradient codecs: how a Δ (or a published update) travels between worker and server.

Codecs: one table, ``dipaco.codecs.registry.REGISTRY`` (name, bits, stored layout, encoder,
decoder), from which the run config's and the CLI's choices come:
    ``fp32``  exact.
    ``bf16``  round to nearest even; relative error <= 2**-8.
    ``fp16``  round to nearest even; relative error <= 2**-11 (subnormals below 6.1e-5 lose
              relative precision; values beyond ±65504 are refused at encode).
    ``int8``  blockwise absmax: per block of B values (default 64) one fp32 scale m/127 and
              B int8 values; |error| <= m/254 per block (m = the block's absmax).
    ``int4``  two's-complement nibbles, two per byte, and per block the scale m/c (c from
              7, absmax, to 10) whose rounding has the least squared error; squared error
              <= B (m/14)**2 per block. Exact bounds: ``dipaco.codecs.kernels``.

Container (format version 1): a plain safetensors file, readable by ``safetensors`` itself.
Its ``__metadata__`` (string to string, as safetensors requires) holds::

    format      "dipaco.codec"
    version     "1"
    codec       a name of the registry
    block_size  "64" for int8/int4, "0" for the unblocked codecs
    tensors     JSON: {name: {"shape": [..], "dtype": "float32", "sha256": "<64 hex>"}, ...}
                in encoding order; shape and dtype are those of the tensor that was encoded.

Each logical tensor ``name`` is stored as the 1-D array ``name`` (F32/BF16/F16 with its
values, I8 with the zero-padded blocks, or U8 with the packed nibbles) and, for int8/int4,
``name::scales`` (F32, one per block). Its ``sha256`` is the digest of those arrays' bytes,
payload then scales. Arrays are ordered by element size (F32 first) and the header is padded
to a multiple of 8 bytes, so every array is aligned.

Reading is defensive: the 8-byte header length, the JSON, every shape, offset and count are
checked against hard limits and against each other before the payload is touched; files
never allocate more than their declared (and, with ``expected``, the module's) size;
``accumulate`` is all-or-nothing. Every refusal is a ``CodecError`` with a stable ``code``.

Compression (``comm.compression``): ``encode(..., compression="zstd")`` wraps the container in
one zstd frame (lossless; int8 payloads shrink by a few percent). Every reader (``inspect``,
``verify``, ``decode``, ``accumulate``) recognises the frame by its magic and decompresses it
with a hard bound: the frame's declared size within ``max_bytes`` (or the limit the
``expected`` spec implies; see ``dipaco.codecs.compression``), header validated first, so a
zip bomb or a cut-off frame is a ``CodecError``, never an allocation of what it claims.

    data = encode({"w": delta}, "int8")                 # worker
    stats = accumulate(data, into, weight, expected)    # server, streaming outer step
"""

import importlib
from typing import TYPE_CHECKING, Any

from dipaco.codecs.registry import CODECS

if TYPE_CHECKING:
    from dipaco.codecs.api import (
        CodecStats,
        TensorSpec,
        accumulate,
        decode,
        encode,
        encode_to_file,
        encode_with_feedback,
        inspect,
        spec_of,
        verify,
    )
    from dipaco.codecs.compression import COMPRESSIONS
    from dipaco.codecs.container import FORMAT, VERSION, CodecError, ContainerHeader, TensorInfo
    from dipaco.codecs.feedback import encode_module_deltas

__all__ = [
    "CODECS",
    "COMPRESSIONS",
    "FORMAT",
    "VERSION",
    "CodecError",
    "CodecStats",
    "ContainerHeader",
    "TensorInfo",
    "TensorSpec",
    "accumulate",
    "decode",
    "encode",
    "encode_module_deltas",
    "encode_to_file",
    "encode_with_feedback",
    "inspect",
    "spec_of",
    "verify",
]

# Loaded on first use, so that the registry (read by the run config and the CLI) does not
# pull in torch: importing dipaco.codecs.registry runs this file first.
_HOMES = {
    "COMPRESSIONS": "compression",
    "FORMAT": "container",
    "VERSION": "container",
    "CodecError": "container",
    "ContainerHeader": "container",
    "TensorInfo": "container",
    "encode_module_deltas": "feedback",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'dipaco.codecs' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dipaco.codecs.{_HOMES.get(name, 'api')}"), name)
    globals()[name] = value
    return value
