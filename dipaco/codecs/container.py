"""The codec container: a safetensors file whose ``__metadata__`` says how to decode it.

Layout (see the package docstring for the full format)::

    8 bytes   little-endian u64 N, the length of the JSON header
    N bytes   JSON header: one entry per stored array + "__metadata__", padded with spaces
    D bytes   data region: the stored arrays back to back, F32 first so every array is aligned

This module writes that layout itself and parses it itself, checking every length, offset and
count against hard limits *before* anything the size of the payload is allocated. Hostile
headers therefore cost at most ``MAX_HEADER_BYTES`` of memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dipaco.codecs.registry import REGISTRY

FORMAT = "dipaco.codec"
VERSION = 1

# A module of a few transformer blocks has ~10 tensors per block; 10k tensors and 4 MiB of
# JSON leave two orders of magnitude of headroom while capping what a hostile header costs.
MAX_HEADER_BYTES = 4 << 20
MAX_TENSORS = 10_000
MAX_NDIM = 8
MAX_NAME_CHARS = 1024
MAX_BLOCK_SIZE = 1 << 16
# 2**32 values is 16 GiB in fp32: larger than any module this platform ships.
MAX_ELEMENTS = 1 << 32

# safetensors dtype name -> (torch dtype, bytes per element)
STORED_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
}
STORED_NAME = {dtype: name for name, (dtype, _) in STORED_DTYPES.items()}

# logical dtype name (in the header) -> torch dtype of the tensor the worker encoded
LOGICAL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
LOGICAL_NAME = {dtype: name for name, dtype in LOGICAL_DTYPES.items()}


class CodecError(ValueError):
    """An encoded pseudo-gradient or update that cannot be used, and why.

    ``code`` is a stable id the server can count and show (``truncated``, ``bad_header``,
    ``not_safetensors``, ``unknown_codec``, ``bad_layout``, ``too_large``, ``spec_mismatch``,
    ``non_finite``, ``bad_scales``, ``checksum_mismatch``, ``bad_compression``,
    ``bad_input``); the message says
    what was wrong and what to change.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TensorInfo:
    """One logical tensor: what the encoder was given and the digest of its stored bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sha256: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StoredEntry:
    """One array of the safetensors file, as bytes ``[start, end)`` of the data region."""

    key: str
    dtype: torch.dtype
    length: int  # elements, always 1-D
    start: int
    end: int


@dataclass(frozen=True)
class ContainerHeader:
    """The validated header of a codec file; returned by ``dipaco.codecs.inspect``."""

    version: int
    codec: str
    block_size: int  # 0 for the unblocked codecs fp32, bf16, fp16
    tensors: dict[str, TensorInfo]  # in encoding order
    entries: dict[str, StoredEntry] = field(repr=False)
    header_bytes: int  # 8 + N: where the data region starts
    data_bytes: int
    compression: str = "none"  # "zstd": the container arrived inside a zstd frame
    wire_bytes: int = 0  # the bytes as stored or sent (the frame's size when compressed)

    @property
    def num_elements(self) -> int:
        return sum(info.numel for info in self.tensors.values())

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.data_bytes

    def spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (info.shape, info.dtype) for name, info in self.tensors.items()}


def stored_layout(codec: str, numel: int, block_size: int) -> list[tuple[str, torch.dtype, int]]:
    """The arrays (key suffix, dtype, length) that store one logical tensor of ``numel`` values
    with the registered ``codec`` (``dipaco.codecs.registry``, ``Codec.layout``).

    Block codecs pad the last block with zeros, so payloads are whole blocks.
    """
    return [
        (suffix, STORED_DTYPES[dtype][0], length)
        for suffix, dtype, length in REGISTRY[codec].layout(numel, block_size)
    ]


def check_block_size(block_size: int) -> None:
    if type(block_size) is not int or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(
            "bad_input", f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )


def _short(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:77] + "...")


def build_header(
    codec: str,
    block_size: int,
    infos: Sequence[TensorInfo],
    arrays: Sequence[tuple[str, torch.Tensor]],
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The 8-byte length + padded JSON header, and the arrays in the order they must follow it.

    Arrays are ordered by element size, largest first (as safetensors itself does), so each
    starts at a multiple of its element size when the data region starts at a multiple of 8.
    """
    ordered = sorted(arrays, key=lambda kv: -kv[1].element_size())  # stable: keeps encode order
    table = {
        info.name: {
            "shape": list(info.shape),
            "dtype": LOGICAL_NAME[info.dtype],
            "sha256": info.sha256,
        }
        for info in infos
    }
    header: dict[str, Any] = {
        "__metadata__": {
            "format": FORMAT,
            "version": str(VERSION),
            "codec": codec,
            "block_size": str(block_size if REGISTRY[codec].blocked else 0),
            "tensors": json.dumps(table, separators=(",", ":")),
        }
    }
    offset = 0
    for key, array in ordered:
        nbytes = array.numel() * array.element_size()
        header[key] = {
            "dtype": STORED_NAME[array.dtype],
            "shape": [array.numel()],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise CodecError(
            "bad_input",
            f"header would be {len(text)} bytes (limit {MAX_HEADER_BYTES}): too many or too long tensor names",
        )
    return struct.pack("<Q", len(text)) + text, ordered


def _looks_pickled(prefix: bytes) -> bool:
    # zip (torch.save since 1.6) or a pickle protocol 2-5 opcode pair
    return prefix[:4] == b"PK\x03\x04" or (
        prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    )


_PICKLE_MESSAGE = (
    "this is a torch.save/pickle file, which is never loaded from untrusted sources; "
    "encode the tensors with dipaco.codecs.encode (safetensors container)"
)


def sniff_header_length(prefix: bytes, total: int) -> int:
    """Length N of the JSON header from the first 8 bytes; refuses pickles and absurd lengths."""
    if total < 8:
        raise CodecError(
            "truncated",
            f"file is {total} bytes, shorter than the 8-byte safetensors prefix: the upload was cut off",
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if not 2 <= length <= MAX_HEADER_BYTES:
        if _looks_pickled(prefix):
            raise CodecError("not_safetensors", _PICKLE_MESSAGE)
        raise CodecError(
            "bad_header",
            f"safetensors header length {length} is outside [2, {MAX_HEADER_BYTES}]: "
            "not a dipaco codec file, or its first bytes are corrupt",
        )
    if 8 + length > total:
        if _looks_pickled(prefix):
            raise CodecError("not_safetensors", _PICKLE_MESSAGE)
        raise CodecError(
            "truncated",
            f"file is {total} bytes but its header alone needs {8 + length}: the upload was cut off",
        )
    return int(length)


def check_json_start(prefix: bytes, header_json: bytes) -> None:
    """A safetensors header is a JSON object; anything else is named before JSON parsing."""
    if header_json[:1] != b"{":
        if _looks_pickled(prefix):
            raise CodecError("not_safetensors", _PICKLE_MESSAGE)
        raise CodecError(
            "bad_header", "safetensors header does not start with '{': not a dipaco codec file"
        )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CodecError("bad_header", f"header repeats the key {_short(key)}")
        out[key] = value
    return out


def _refuse_constant(name: str) -> Any:
    raise CodecError("bad_header", f"header contains the non-JSON constant {name}")


def _load_json(text: bytes | str, what: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
    except CodecError:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(
            "bad_header", f"{what} is not valid JSON ({type(exc).__name__}: {exc})"[:300]
        ) from None


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise CodecError(
            "bad_header", f"{what} must be an integer in [{low}, {high}], got {str(value)[:40]}"
        )
    return value


def _str_field(meta: dict[str, Any], key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str):
        raise CodecError(
            "bad_header", f"__metadata__ lacks the string field {key!r}: not a dipaco codec file"
        )
    return value


def _int_field(meta: dict[str, Any], key: str, low: int, high: int) -> int:
    text = _str_field(meta, key)
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise CodecError(
            "bad_header", f"__metadata__ field {key!r} must be a decimal integer, got {text[:40]!r}"
        )
    return _int(int(text), f"__metadata__ field {key!r}", low, high)


def _parse_tensor_table(text: str) -> dict[str, TensorInfo]:
    table = _load_json(text, "the 'tensors' table")
    if not isinstance(table, dict) or not table:
        raise CodecError("bad_header", "the 'tensors' table must be a non-empty JSON object")
    if len(table) > MAX_TENSORS:
        raise CodecError("too_large", f"header lists {len(table)} tensors (limit {MAX_TENSORS})")
    infos: dict[str, TensorInfo] = {}
    for name, spec in table.items():
        check_name(name, "bad_header")
        if not isinstance(spec, dict) or set(spec) != {"shape", "dtype", "sha256"}:
            raise CodecError(
                "bad_header", f"tensor {_short(name)} needs exactly the fields shape, dtype, sha256"
            )
        shape = spec["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise CodecError(
                "bad_header",
                f"tensor {_short(name)}: shape must be a list of at most {MAX_NDIM} sizes",
            )
        dims = tuple(_int(d, f"tensor {_short(name)} shape", 0, MAX_ELEMENTS) for d in shape)
        dtype = LOGICAL_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise CodecError(
                "bad_header",
                f"tensor {_short(name)}: dtype {str(spec['dtype'])[:20]!r} is not one of {sorted(LOGICAL_DTYPES)}",
            )
        digest = spec["sha256"]
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise CodecError(
                "bad_header", f"tensor {_short(name)}: sha256 must be 64 lowercase hex digits"
            )
        infos[name] = TensorInfo(name, dims, dtype, digest)
    return infos


def check_name(name: Any, code: str) -> None:
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= MAX_NAME_CHARS
        or "::" in name
        or name == "__metadata__"
    ):
        raise CodecError(
            code,
            f"tensor name {str(name)[:80]!r} is not allowed: use 1-{MAX_NAME_CHARS} characters, "
            "no '::', not '__metadata__'",
        )


def parse_header(header_json: bytes, total: int) -> ContainerHeader:
    """Validate the JSON header of a file of ``total`` bytes whose header is ``header_json``."""
    header = _load_json(header_json, "safetensors header")
    if not isinstance(header, dict):
        raise CodecError("bad_header", "safetensors header must be a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CodecError(
            "bad_header",
            f"safetensors file without __metadata__ format={FORMAT!r}: encode it with dipaco.codecs.encode",
        )
    version = _int_field(meta, "version", 0, 1 << 20)
    if version != VERSION:
        raise CodecError(
            "bad_header",
            f"codec format version {version}; this dipaco reads version {VERSION}: upgrade dipaco",
        )
    codec = _str_field(meta, "codec")
    if codec not in REGISTRY:
        raise CodecError(
            "unknown_codec", f"unknown codec {codec[:40]!r}; known codecs: {', '.join(REGISTRY)}"
        )
    block_size = _int_field(meta, "block_size", 0, MAX_BLOCK_SIZE)
    if REGISTRY[codec].blocked:
        if block_size == 0:
            raise CodecError("bad_header", f"codec {codec} needs a block_size of at least 1")
    elif block_size != 0:
        raise CodecError(
            "bad_header", f"codec {codec} is not blocked; block_size must be 0, got {block_size}"
        )
    infos = _parse_tensor_table(_str_field(meta, "tensors"))
    total_elements = sum(info.numel for info in infos.values())
    if total_elements > MAX_ELEMENTS:
        raise CodecError(
            "too_large",
            f"header declares {total_elements} values (limit {MAX_ELEMENTS}): refusing to decode it",
        )
    entries = _check_entries(header, _expected_entries(infos, codec, block_size))
    data_bytes = _check_tiling(entries.values())
    available = total - 8 - len(header_json)
    if available < data_bytes:
        raise CodecError(
            "truncated",
            f"header declares {data_bytes} data bytes but only {available} follow it: the upload was cut off",
        )
    if available > data_bytes:
        raise CodecError(
            "bad_layout", f"{available - data_bytes} unexpected bytes after the last tensor"
        )
    return ContainerHeader(
        version, codec, block_size, infos, entries, 8 + len(header_json), data_bytes
    )


def _expected_entries(
    infos: dict[str, TensorInfo], codec: str, block_size: int
) -> dict[str, tuple[torch.dtype, int]]:
    expected: dict[str, tuple[torch.dtype, int]] = {}
    for name, info in infos.items():
        for suffix, dtype, length in stored_layout(codec, info.numel, block_size):
            expected[name + suffix] = (dtype, length)
    return expected


def _check_entries(
    header: dict[str, Any], expected: dict[str, tuple[torch.dtype, int]]
) -> dict[str, StoredEntry]:
    if set(header) != set(expected):
        extra = sorted(set(header) - set(expected))[:3]
        missing = sorted(set(expected) - set(header))[:3]
        raise CodecError(
            "bad_layout",
            f"stored arrays do not match the tensor table: unexpected {extra}, missing {missing}",
        )
    entries: dict[str, StoredEntry] = {}
    for key, (dtype, length) in expected.items():
        raw = header[key]
        if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
            raise CodecError(
                "bad_layout", f"array {_short(key)} needs exactly dtype, shape, data_offsets"
            )
        if raw["dtype"] != STORED_NAME[dtype] or raw["shape"] != [length]:
            raise CodecError(
                "bad_layout",
                f"array {_short(key)} is {str(raw['dtype'])[:8]} {str(raw['shape'])[:40]}; "
                f"the tensor table implies {STORED_NAME[dtype]} [{length}]",
            )
        offsets = raw["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise CodecError(
                "bad_layout", f"array {_short(key)}: data_offsets must be [start, end]"
            )
        start = _int(offsets[0], f"array {_short(key)} start", 0, 1 << 62)
        end = _int(offsets[1], f"array {_short(key)} end", 0, 1 << 62)
        if end - start != length * STORED_DTYPES[STORED_NAME[dtype]][1]:
            raise CodecError(
                "bad_layout", f"array {_short(key)}: offsets [{start}, {end}] do not match its size"
            )
        entries[key] = StoredEntry(key, dtype, length, start, end)
    return entries


def _check_tiling(entries: Iterable[StoredEntry]) -> int:
    """The arrays must cover the data region exactly once, without gaps or overlaps."""
    position = 0
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start != position:
            raise CodecError(
                "bad_layout",
                f"array {_short(entry.key)} starts at {entry.start}, expected {position}",
            )
        position = entry.end
    return position
