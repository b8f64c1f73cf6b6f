"""Lossless compression of a codec container: one zstd frame around the container's bytes.

``comm.compression = "zstd"`` wraps the safetensors container (unchanged inside) in a single
zstd frame that declares its decompressed size and carries zstd's content checksum. Readers
tell the two apart by the first four bytes: a zstd frame starts with the magic
``28 b5 2f fd``, which as a safetensors header length would be far above ``MAX_HEADER_BYTES``,
so no container can be mistaken for a frame or the reverse.

Decompression is bounded before anything the size of the payload is allocated:

1. the frame must declare its decompressed size, and that size must be within the caller's
   ``max_bytes`` (or, with neither ``max_bytes`` nor ``expected``, ``DEFAULT_MAX_BYTES``);
2. only the container's 8-byte prefix and JSON header (at most ``MAX_HEADER_BYTES``) are
   decompressed first, and validated, against ``expected`` too, exactly as for a plain
   container; the declared size must be what that header implies, so with ``expected`` it is
   derived from the module's own spec;
3. then the frame is decompressed in one call capped at that size; a frame that is cut
   off, corrupt, followed by extra bytes or larger than declared is a ``CodecError``.

The decoder's window is capped at ``MAX_WINDOW_BYTES`` (zstd's own default limit), so a
frame cannot make the decoder itself allocate more.
"""

from __future__ import annotations

from typing import BinaryIO

import zstandard

from dipaco.codecs.container import MAX_HEADER_BYTES, CodecError

COMPRESSIONS = ("none", "zstd")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Level 3 (zstd's default): int8 payloads gain ~4-5% from its Huffman-coded literals; higher
# levels add little on quantised values and cost several times the CPU.
ZSTD_LEVEL = 3
MAX_WINDOW_BYTES = 1 << 27
# Without `expected` and without `max_bytes`, a frame may expand to at most this much.
DEFAULT_MAX_BYTES = 4 << 30
# The longest zstd frame header (magic, descriptor, window, dictionary id, content size).
_FRAME_HEADER_MAX = 18


def check_compression(compression: str) -> None:
    if compression not in COMPRESSIONS:
        raise CodecError(
            "bad_input",
            f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}",
        )


def is_zstd(prefix: bytes) -> bool:
    return prefix[:4] == ZSTD_MAGIC


def compressor() -> zstandard.ZstdCompressor:
    """A compressor whose frames declare their size and carry zstd's checksum."""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)


def compress(data: bytes) -> bytes:
    return compressor().compress(data)


def _decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)


def declared_size(prefix: bytes, max_bytes: int | None, has_spec: bool) -> int:
    """The decompressed size a frame declares, refused if it has none or exceeds the limit."""
    try:
        params = zstandard.get_frame_parameters(prefix[:_FRAME_HEADER_MAX])
    except zstandard.ZstdError as exc:
        raise CodecError(
            "bad_compression", f"corrupt zstd frame header ({exc}): the upload is damaged"
        ) from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise CodecError(
            "bad_compression",
            "the zstd frame does not declare its decompressed size: compress with "
            "dipaco.codecs.encode(..., compression='zstd'), which always writes it",
        )
    limit = max_bytes if max_bytes is not None else None if has_spec else DEFAULT_MAX_BYTES
    if limit is not None and size > limit:
        raise CodecError(
            "too_large",
            f"the zstd frame expands to {size} bytes, more than the {limit} allowed; refusing "
            "to decompress it (pass the module's spec as `expected`, or a larger max_bytes)",
        )
    return int(size)


def read_header(source: bytes | memoryview | BinaryIO, total: int) -> tuple[bytes, bytes]:
    """The container's 8-byte prefix and as much of its JSON header as the prefix declares,
    decompressing no more than ``8 + MAX_HEADER_BYTES`` bytes. Short reads are returned short
    (the caller's length checks name them as truncation)."""
    reader = _decompressor().stream_reader(source, read_across_frames=False)
    try:
        prefix = reader.read(8)
        if len(prefix) < 8:
            return prefix, b""
        length = int.from_bytes(prefix, "little")
        if not 2 <= length <= MAX_HEADER_BYTES or 8 + length > total:
            return prefix, b""  # the caller refuses the length before reading it
        return prefix, reader.read(length)
    except zstandard.ZstdError as exc:
        raise CodecError(
            "bad_compression", f"corrupt zstd frame ({exc}): the upload is damaged"
        ) from None


def decompress(data: bytes | memoryview, size: int) -> bytes:
    """The whole frame, which must expand to exactly ``size`` bytes and end the input."""
    try:
        out = _decompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        text = str(exc)
        if "did not decompress full frame" in text:
            raise CodecError(
                "truncated", "the zstd frame is cut off: the upload is incomplete"
            ) from None
        raise CodecError(
            "bad_compression", f"corrupt zstd frame ({text[:200]}): the upload is damaged"
        ) from None
    if len(out) != size:
        raise CodecError(
            "bad_compression",
            f"the zstd frame expanded to {len(out)} bytes but declares {size}: the upload is damaged",
        )
    return out
