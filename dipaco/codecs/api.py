"""encode, decode, accumulate, verify, inspect: the functions the worker and the server call."""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import torch

from dipaco.codecs import compression as zstd
from dipaco.codecs import kernels
from dipaco.codecs.container import (
    LOGICAL_NAME,
    MAX_ELEMENTS,
    MAX_NDIM,
    MAX_TENSORS,
    CodecError,
    ContainerHeader,
    TensorInfo,
    build_header,
    check_block_size,
    check_json_start,
    check_name,
    parse_header,
    sniff_header_length,
    stored_layout,
)
from dipaco.codecs.kernels import check_scales, has_non_finite, sq_norm
from dipaco.codecs.registry import REGISTRY, codec_named

TensorSpec = tuple[Sequence[int], torch.dtype]
Source = bytes | bytearray | memoryview | str | os.PathLike[str]


# Below this many bytes a thread pool costs more than the hashing it spreads.
_PARALLEL_HASH_BYTES = 8 << 20


@dataclass(frozen=True)
class CodecStats:
    """What ``verify`` and ``accumulate`` learnt about one encoded Δ.

    ``sq_norm`` is the squared L2 norm of the decoded values (before ``weight``), summed in fp32
    per chunk; it is ``inf`` when it exceeds fp32 range. Non-finite values never get this far:
    they raise ``CodecError(code="non_finite")``. ``encoded_bytes`` is the size as stored or
    sent: the zstd frame's when the container was compressed.
    """

    codec: str
    num_tensors: int
    num_elements: int
    encoded_bytes: int
    sq_norm: float
    checksum_verified: bool

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq_norm)


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The ``expected`` mapping that matches these tensors (e.g. a module's current weights)."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]


def _sha256(parts: Sequence[memoryview]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)  # releases the GIL for large buffers
    return digest.hexdigest()


def _digests(groups: Sequence[Sequence[memoryview]]) -> list[str]:
    """sha256 of each group, spread over torch's thread budget when it is worth it."""
    total = sum(part.nbytes for group in groups for part in group)
    workers = min(len(groups), torch.get_num_threads())
    if workers < 2 or total < _PARALLEL_HASH_BYTES:
        return [_sha256(group) for group in groups]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_sha256, groups))


def _build(
    tensors: Mapping[str, torch.Tensor], codec: str, block_size: int
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    spec = codec_named(codec)
    if spec is None:
        raise CodecError(
            "unknown_codec", f"unknown codec {codec!r}; choose one of {', '.join(REGISTRY)}"
        )
    if spec.blocked:
        check_block_size(block_size)
    if not tensors or len(tensors) > MAX_TENSORS:
        raise CodecError(
            "bad_input", f"encode takes 1 to {MAX_TENSORS} tensors, got {len(tensors)}"
        )
    total = 0
    for name, tensor in tensors.items():
        check_name(name, "bad_input")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() > MAX_NDIM:
            raise CodecError(
                "bad_input", f"tensor {name!r} must be a torch.Tensor of at most {MAX_NDIM} dims"
            )
        if tensor.dtype not in LOGICAL_NAME:
            raise CodecError(
                "bad_input",
                f"tensor {name!r} is {tensor.dtype}; codecs take float32/float64/float16/bfloat16",
            )
        total += tensor.numel()
    if total > MAX_ELEMENTS:
        raise CodecError("bad_input", f"{total} values exceed the codec limit of {MAX_ELEMENTS}")
    arrays: list[tuple[str, torch.Tensor]] = []
    groups: list[list[memoryview]] = []
    encoder = getattr(kernels, spec.encoder)
    for name, tensor in tensors.items():
        stored = encoder(name, tensor.detach().reshape(-1), spec, block_size)
        layout = stored_layout(codec, tensor.numel(), block_size)
        arrays += [
            (name + suffix, array) for (suffix, _, _), array in zip(layout, stored, strict=True)
        ]
        groups.append([_bytes_of(array) for array in stored])
    infos = [
        TensorInfo(name, tuple(tensor.shape), tensor.dtype, digest)
        for (name, tensor), digest in zip(tensors.items(), _digests(groups), strict=True)
    ]
    return build_header(codec, block_size, infos, arrays)


def encode(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    *,
    block_size: int = 64,
    compression: str = "none",
) -> bytes:
    """Encode ``tensors`` (any float dtype, any device) with ``codec`` into container bytes;
    with ``compression="zstd"``, one zstd frame of those bytes (every reader takes both)."""
    zstd.check_compression(compression)
    header, ordered = _build(tensors, codec, block_size)
    data = b"".join([header, *(_bytes_of(array) for _, array in ordered)])
    return zstd.compress(data) if compression == "zstd" else data


def encode_with_feedback(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    residual: Mapping[str, torch.Tensor] | None,
    *,
    block_size: int = 64,
    compression: str = "none",
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Error feedback (1-bit SGD, Seide et al. 2014; EF21): encode Δ + e, keep the new error.

    The sender adds the rounding error it kept from its previous Δ (`residual`, by tensor
    name; None or missing names: zero) before quantising, and returns the error of this
    encoding as the residual for next time, so quantisation errors cancel over rounds
    instead of accumulating. For the exact codecs (fp32) the residual stays zero.
    Returns (container bytes, zstd-compressed with ``compression="zstd"``; new residual:
    fp32 CPU tensors).
    """
    zstd.check_compression(compression)
    residual = residual or {}
    corrected, owned = {}, set()
    for name, tensor in tensors.items():
        value = tensor.detach().to("cpu", torch.float32)
        previous = residual.get(name)
        if previous is not None and tuple(previous.shape) == tuple(value.shape):
            value = value + previous.to(torch.float32)
            owned.add(name)  # a tensor of its own: the new residual may be made in place
        corrected[name] = value
    data = encode(corrected, codec, block_size=block_size)
    wire = zstd.compress(data) if compression == "zstd" else data
    if REGISTRY[codec].exact:
        return wire, {}
    sent = decode(data)
    errors = {}
    for name, value in corrected.items():
        decoded = sent.pop(name)
        errors[name] = value.sub_(decoded) if name in owned else value - decoded
    return wire, errors


def encode_to_file(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    path: str | os.PathLike[str],
    *,
    block_size: int = 64,
    compression: str = "none",
) -> int:
    """Like ``encode`` but streams to ``path`` (written whole, then renamed); returns its size."""
    zstd.check_compression(compression)
    header, ordered = _build(tensors, codec, block_size)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "wb") as out:
            if compression == "zstd":
                size = len(header) + sum(_bytes_of(array).nbytes for _, array in ordered)
                with zstd.compressor().stream_writer(out, size=size, closefd=False) as writer:
                    writer.write(header)
                    for _, array in ordered:
                        writer.write(_bytes_of(array))
            else:
                out.write(header)
                for _, array in ordered:
                    out.write(_bytes_of(array))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)  # after a failure: never leave half a file behind
    return target.stat().st_size


def _check_max(total: int, max_bytes: int | None) -> None:
    if max_bytes is not None and total > max_bytes:
        raise CodecError("too_large", f"{total} bytes exceed the {max_bytes} allowed")


def _read_zstd(
    frame: memoryview | BinaryIO,
    wire_bytes: int,
    expected: Mapping[str, TensorSpec] | None,
    with_data: bool,
    max_bytes: int | None,
) -> tuple[ContainerHeader, memoryview]:
    """`_read` for a zstd frame (`dipaco.codecs.compression`): the frame's declared size is
    checked against the limit, then the container header against ``expected``, and only
    then is the whole frame decompressed, to exactly the size that header implies."""
    start = frame[:32] if isinstance(frame, memoryview) else frame.read(32)
    total = zstd.declared_size(bytes(start), max_bytes, expected is not None)
    if not isinstance(frame, memoryview):
        frame.seek(0)
    prefix, header_json = zstd.read_header(frame, total)
    length = sniff_header_length(prefix, total) if len(prefix) == 8 else None
    if length is None or len(header_json) != length:
        raise CodecError(
            "truncated", "the zstd frame ends inside the container header: the upload was cut off"
        )
    check_json_start(prefix, header_json)
    header = parse_header(header_json, total)
    _check_spec(header, expected)
    header = replace(header, compression="zstd", wire_bytes=wire_bytes)
    if not with_data:
        return header, memoryview(b"")
    if not isinstance(frame, memoryview):
        frame.seek(0)
        frame = memoryview(frame.read())
        if frame.nbytes != wire_bytes:
            raise CodecError(
                "truncated", "file changed while it was read: read it once it is complete"
            )
    return header, memoryview(zstd.decompress(frame, total))[header.header_bytes :]


def _read(
    data: Source,
    expected: Mapping[str, TensorSpec] | None,
    with_data: bool,
    max_bytes: int | None = None,
) -> tuple[ContainerHeader, memoryview]:
    """The validated header and, if asked, the data region (else an empty view).

    Bytes are used in place. A file is read only once its header, its size and ``expected``
    check out, so a hostile header costs at most ``MAX_HEADER_BYTES``. A zstd frame is
    decompressed only once the same checks pass on its declared size and header
    (``_read_zstd``). ``max_bytes`` caps the container's size (decompressed).
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        view = view if view.format == "B" else view.cast("B")
        if zstd.is_zstd(bytes(view[:4])):
            return _read_zstd(view, view.nbytes, expected, with_data, max_bytes)
        _check_max(view.nbytes, max_bytes)
        prefix = bytes(view[:8])
        length = sniff_header_length(prefix, view.nbytes)
        header_json = bytes(view[8 : 8 + length])
        check_json_start(prefix, header_json)
        header = parse_header(header_json, view.nbytes)
        _check_spec(header, expected)
        header = replace(header, wire_bytes=view.nbytes)
        return header, view[header.header_bytes :] if with_data else view[:0]
    if not isinstance(data, (str, os.PathLike)):
        raise TypeError(f"expected bytes or a path, got {type(data).__name__}")
    with open(data, "rb") as file:
        total = os.fstat(file.fileno()).st_size
        if zstd.is_zstd(file.read(4)):
            file.seek(0)
            return _read_zstd(file, total, expected, with_data, max_bytes)
        file.seek(0)
        _check_max(total, max_bytes)
        prefix = file.read(8)
        length = sniff_header_length(prefix, total)
        header_json = file.read(length)
        check_json_start(prefix, header_json)
        header = parse_header(header_json, total)
        _check_spec(header, expected)
        header = replace(header, wire_bytes=total)
        buffer = bytearray(header.data_bytes if with_data else 0)
        if with_data and file.readinto(buffer) != header.data_bytes:
            raise CodecError(
                "truncated", "file shrank while it was read: read it once it is complete"
            )
    return header, memoryview(buffer)


def inspect(
    data: Source,
    expected: Mapping[str, TensorSpec] | None = None,
    *,
    max_bytes: int | None = None,
) -> ContainerHeader:
    """Validate the header alone (for a path, only the header is read; for a zstd frame,
    only the header is decompressed); raises CodecError."""
    return _read(data, expected, with_data=False, max_bytes=max_bytes)[0]


def _check_spec(header: ContainerHeader, expected: Mapping[str, TensorSpec] | None) -> None:
    if expected is None:
        return
    missing = [name for name in expected if name not in header.tensors]
    extra = [name for name in header.tensors if name not in expected]
    if missing or extra:
        raise CodecError(
            "spec_mismatch",
            f"tensor names differ from the module: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}; the worker used another model layout",
        )
    budget = sum(math.prod(shape) for shape, _ in expected.values())
    if header.num_elements > budget:
        raise CodecError(
            "too_large", f"upload declares {header.num_elements} values but the module has {budget}"
        )
    for name, (shape, dtype) in expected.items():
        info = header.tensors[name]
        if info.shape != tuple(shape) or info.dtype != dtype:
            raise CodecError(
                "spec_mismatch",
                f"tensor {name!r} is {info.dtype} {list(info.shape)} in the upload but the module expects "
                f"{dtype} {list(shape)}; the worker used another model config",
            )


def _check_into(
    header: ContainerHeader,
    into: Mapping[str, torch.Tensor],
    names: Collection[str] | None = None,
) -> None:
    for name, target in into.items():
        if target.dtype != torch.float32 or not target.is_contiguous():
            raise TypeError(
                f"accumulate needs contiguous float32 tensors in `into`; {name!r} is not"
            )
    if names is not None:  # a part of the Δ: `into` holds exactly those, all in the upload
        if set(into) != set(names):
            raise ValueError("accumulate's `into` must hold exactly the tensors in `names`")
        if not set(names) <= set(header.tensors):
            missing = sorted(set(names) - set(header.tensors))[:3]
            raise CodecError("spec_mismatch", f"upload lacks tensors {missing}")
    elif set(into) != set(header.tensors):
        missing = sorted(set(into) - set(header.tensors))[:3]
        extra = sorted(set(header.tensors) - set(into))[:3]
        raise CodecError(
            "spec_mismatch", f"upload lacks tensors {missing} and/or has unexpected tensors {extra}"
        )
    for name, info in header.tensors.items():
        if name not in into:
            continue
        if tuple(into[name].shape) != info.shape:
            raise CodecError(
                "spec_mismatch",
                f"tensor {name!r} is {list(info.shape)} in the upload but {list(into[name].shape)} in the module",
            )


def _open(
    data: Source,
    expected: Mapping[str, TensorSpec] | None,
    verify_checksum: bool,
    max_bytes: int | None = None,
) -> tuple[ContainerHeader, dict[str, list[torch.Tensor]]]:
    """Validate everything but the decoded values; return each tensor's stored arrays."""
    header, region = _read(data, expected, with_data=True, max_bytes=max_bytes)
    layouts = {
        name: stored_layout(header.codec, info.numel, header.block_size)
        for name, info in header.tensors.items()
    }
    entries = {
        name: [header.entries[name + suffix] for suffix, _, _ in layout]
        for name, layout in layouts.items()
    }
    if verify_checksum:
        groups = [[region[e.start : e.end] for e in group] for group in entries.values()]
        for (name, info), digest in zip(header.tensors.items(), _digests(groups), strict=True):
            if digest != info.sha256:
                raise CodecError(
                    "checksum_mismatch",
                    f"tensor {name!r} does not match its sha256: the upload is corrupt",
                )
    with warnings.catch_warnings():
        # zero-copy views of the caller's bytes, which are only ever read
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        stored = {
            name: [
                torch.frombuffer(region, dtype=e.dtype, count=e.length, offset=e.start)
                if e.length
                else torch.empty(0, dtype=e.dtype)
                for e in group
            ]
            for name, group in entries.items()
        }
    for name, arrays in stored.items():
        if REGISTRY[header.codec].blocked:
            check_scales(name, header.codec, arrays[1])  # then every decoded value is finite
        elif has_non_finite(arrays[0]):
            raise CodecError(
                "non_finite",
                f"tensor {name!r} has NaN or Inf values: the worker's training diverged",
            )
    return header, stored


def _decoded(
    header: ContainerHeader, numel: int, arrays: list[torch.Tensor]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, end, fp32 values)`` of one tensor, chunk by chunk (the codec's decoder)."""
    codec = REGISTRY[header.codec]
    return getattr(kernels, codec.decoder)(codec, header.block_size, numel, arrays)


def _norm_pass(header: ContainerHeader, stored: dict[str, list[torch.Tensor]]) -> float:
    total = 0.0
    for name, info in header.tensors.items():
        for _, _, values in _decoded(header, info.numel, stored[name]):
            total += sq_norm(values)
    return total


def _stats(header: ContainerHeader, sq: float, verified: bool) -> CodecStats:
    return CodecStats(
        header.codec, len(header.tensors), header.num_elements, header.wire_bytes, sq, verified
    )


def verify(
    data: Source,
    expected: Mapping[str, TensorSpec] | None = None,
    *,
    verify_checksum: bool = True,
    max_bytes: int | None = None,
) -> CodecStats:
    """Check an encoded Δ completely (header, checksum, finiteness) and measure its norm."""
    header, stored = _open(data, expected, verify_checksum, max_bytes)
    return _stats(header, _norm_pass(header, stored), verify_checksum)


def decode(
    data: Source,
    expected: Mapping[str, TensorSpec] | None = None,
    *,
    verify_checksum: bool = True,
    max_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode to fp32 tensors of the logical shapes; raises CodecError on any bad input."""
    header, stored = _open(data, expected, verify_checksum, max_bytes)
    out: dict[str, torch.Tensor] = {}
    for name, info in header.tensors.items():
        flat = torch.empty(info.numel, dtype=torch.float32)  # (n,): size validated against the data
        for start, end, values in _decoded(header, info.numel, stored[name]):
            flat[start:end] = values
        out[name] = flat.view(info.shape)
    return out


def accumulate(
    data: Source,
    into: Mapping[str, torch.Tensor],
    weight: float,
    expected: Mapping[str, TensorSpec] | None = None,
    *,
    verify_checksum: bool = True,
    max_bytes: int | None = None,
    names: Collection[str] | None = None,
) -> CodecStats:
    """``into[name] += weight * decoded[name]`` in fp32, one chunk at a time.

    All-or-nothing: every check (header, ``expected``, shapes of ``into``, checksum, scales,
    finiteness) passes before the first write, so a CodecError leaves ``into`` untouched.
    Pass ``verify_checksum=False`` only for bytes whose sha256 the caller has just checked.
    ``names``: only these tensors (``into`` holds exactly them), for a caller that splits
    one sum by tensor; each value gets the same arithmetic as in a whole-Δ call, and the
    returned norm is of these tensors only.
    """
    if not math.isfinite(weight):
        raise ValueError(f"weight must be finite, got {weight}")
    header, stored = _open(data, expected, verify_checksum, max_bytes)
    _check_into(header, into, names)
    sq = 0.0
    for name, info in header.tensors.items():
        if name not in into:
            continue
        target = into[name].view(-1)  # (n,)
        for start, end, values in _decoded(header, info.numel, stored[name]):
            sq += sq_norm(values)
            target[start:end].add_(values, alpha=weight)
    return _stats(header, sq, verify_checksum)
