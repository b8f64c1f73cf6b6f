"""Per-tensor encode and chunked decode for each codec, as vectorised torch ops.

``dipaco.codecs.registry`` names, for each codec, its ``encode_*`` and ``decode_*`` here;
every encoder takes ``(tensor name, flat tensor, codec, block_size)`` and returns the stored
arrays in the order of ``Codec.layout``; every decoder yields fp32 chunks.

Block codecs: the flattened tensor is cut into blocks of ``B`` values (the last one
zero-padded); each block stores one fp32 scale ``s`` and integers ``q``; decoding is ``q * s``.
int8 (absmax): ``s = fl(absmax / 127)``, ``q = clamp(round(x / s), -127, 127)``. int4 (least
squares): of the scales ``fl(absmax / c)``, c in ``INT4_DIVISORS`` (7 = absmax first), the one
whose ``q = clamp(round(x / s), -8, 7)`` decodes closest to the block in squared error; the
larger c clip a block's few largest values but refine the 15-level grid for the rest
(squared error -18% on real DiPaCo Δs at blocks of 128 and 32, -25% on Gaussian blocks of
128). The decoder and the container are unchanged; encoding takes ~5x absmax's time.
int4 stores two's-complement nibbles: with H = ceil(blocks / 2), byte i holds element i in its
low nibble and element i + H*B in its high nibble, so decoding reads contiguous bytes and
never interleaves (an interleaving ``stack`` made int4 accumulate 2.7x slower than int8,
docs/benchmarks.md).

Error bound, per block with absmax m (what tests/test_codecs.py asserts; for int4, which may
clip single values, the bound holds for the absmax candidate, so the block's squared error
is at most n times its square: the least-squares choice never does worse). With u = 2**-24:
s = (m/Q)(1+d1); the quotient x/s (|x/s| <= Q(1+2u), so the clamp never bites on the
encoder's own data) and the decoded product q*s each add a relative error <= u, and rounding
to an integer costs <= 1/2 step, so

    |x - decode(x)| <= s(1/2 + 4Qu) <= m/(2Q) * (1 + 8Qu) <= m/(2Q) * (1 + 2**-14)   (Q <= 127)

When s is subnormal it is rounded by up to 2**-150 absolute, which costs up to Q * 2**-150
more; the test adds Q * 2**-149.

Across devices the encoding is bit-identical: abs, amax, rounding, casts and tensor-by-tensor
division are exact IEEE operations on CPU and CUDA alike (``_divisor``), so a check copy from
a GPU worker and one from a CPU worker compare as equals and the server decodes either.

Decoding walks each tensor in chunks of ``CHUNK_ELEMENTS`` values so temporaries stay in cache
and the decoded module is never materialised at once (chunk size: bench/codec.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dipaco.codecs.container import STORED_DTYPES, CodecError
from dipaco.codecs.registry import Codec

CHUNK_ELEMENTS = 1 << 20
INT8_QMAX = 127
INT4_QMAX = 7  # absmax maps to ±7; the least-squares scales also use the nibble's -8
# int4's candidate scales m / c (kernels._int4_least_squares); 7 first: absmax, the fallback.
INT4_DIVISORS = (7.0, 7.5, 8.0, 8.5, 9.0, 10.0)
FP32_MAX = torch.finfo(torch.float32).max
# Decoded values |q * s| must stay finite even for hostile q (-128 in int8, -8 in int4): any
# scale up to FP32_MAX / 256 is safe for both.
SCALE_LIMIT = FP32_MAX / 256


def _divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d fp32 tensor on ``like``'s device, for a division that is exact IEEE
    on every device. CUDA divides a tensor by a Python scalar as a product with the scalar's
    reciprocal (ATen's div_true_kernel_cuda), which differs from the correctly rounded
    quotient by one ulp in some block scales (about a third of an int8 norm weight's blocks);
    CPU divides. Tensor by tensor, both divide, so the encoding is bit-identical across
    devices (tests/test_codecs.py asserts it on a GPU; bench/gpu_check.sh runs it)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _chunk(device: torch.device) -> int:
    # On an accelerator one kernel over the whole tensor is faster than a loop.
    return CHUNK_ELEMENTS if device.type == "cpu" else 1 << 62


def sq_norm(values: torch.Tensor) -> float:
    """Sum of squares in fp32 (inf past fp32 range; NaN if any value is not finite)."""
    return float(torch.dot(values, values)) if values.numel() else 0.0


# Half types: exponent bits all ones means Inf or NaN, one cheap pass over the raw integers.
_EXPONENT_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def has_non_finite(payload: torch.Tensor) -> bool:
    """Whether a float codec's stored payload holds NaN or Inf."""
    step = _chunk(payload.device)
    for start in range(0, payload.numel(), step):
        part = payload[start : start + step]
        if payload.dtype in _EXPONENT_MASK:
            mask = _EXPONENT_MASK[payload.dtype]
            if int((part.view(torch.int16) & mask).amax()) == mask:
                return True
        # fp32: a sum is 4x faster than the masks (bench/codec.py) and is NaN/Inf if any value
        # is; only a sum that overflowed on finite values needs the exact scan
        elif not torch.isfinite(part.sum()) and not bool(torch.isfinite(part).all()):
            return True
    return False


def encode_float(
    name: str, flat: torch.Tensor, codec: Codec, block_size: int
) -> list[torch.Tensor]:
    """The payload: the values cast to the codec's float type (block_size is not used)."""
    dtype = STORED_DTYPES[codec.payload][0]
    stored = flat.to(dtype).cpu().contiguous()  # (n,)
    if has_non_finite(stored):
        if not bool(torch.isfinite(flat).all()):
            raise CodecError(
                "non_finite", f"tensor {name!r} has NaN or Inf values: the inner loop diverged"
            )
        raise CodecError(
            "bad_input",
            f"tensor {name!r} has values beyond the range of {codec.name} "
            f"(|x| <= {torch.finfo(dtype).max:.6g}): encode it with bf16 or fp32",
        )
    return [stored]


def encode_int8(name: str, flat: torch.Tensor, codec: Codec, block: int) -> list[torch.Tensor]:
    """The payload of int8 codes, one block after another, and one scale per block."""
    blocks = -(-flat.numel() // block)
    quantised, scales = _quantise(name, flat, codec, block, blocks, INT8_QMAX, _int8_absmax)
    return [quantised.cpu(), scales.cpu()]


def encode_int4(name: str, flat: torch.Tensor, codec: Codec, block: int) -> list[torch.Tensor]:
    """The payload of packed nibbles (blocks [0, H) low, [H, 2H) high) and one scale per block."""
    blocks = -(-flat.numel() // block)
    rows = 2 * (-(-blocks // 2))  # quantise into whole pairs of blocks, then pack the halves
    quantised, scales = _quantise(name, flat, codec, block, rows, INT4_QMAX, _int4_least_squares)
    low, high = quantised.view(2, -1)  # (H*B,) each: blocks [0, H) and [H, 2H)
    packed = (low & 15) | (high << 4)  # (H*B,) two's-complement nibbles
    return [packed.view(torch.uint8).cpu(), scales.cpu()]


Quantiser = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _quantise(
    name: str, flat: torch.Tensor, codec: Codec, block: int, rows: int, qmax: int, choose: Quantiser
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of ``rows`` blocks (those past the data stay 0) and each block's scale, by
    ``choose(values, absmax) -> (q, scale)`` chunk by chunk."""
    blocks = -(-flat.numel() // block)
    quantised = torch.zeros(rows * block, dtype=torch.int8, device=flat.device)  # (rows*B,)
    scales = torch.empty(blocks, dtype=torch.float32, device=flat.device)
    rows_per_chunk = max(1, _chunk(flat.device) // block)
    for r0 in range(0, blocks, rows_per_chunk):
        r1 = min(blocks, r0 + rows_per_chunk)
        chunk = flat[r0 * block : r1 * block].to(torch.float32)  # (<= (r1-r0)*B,)
        if chunk.numel() < (r1 - r0) * block:  # the last block: pad with zeros
            chunk = torch.nn.functional.pad(chunk, (0, (r1 - r0) * block - chunk.numel()))
        values = chunk.view(-1, block)  # (r1-r0, B)
        absmax = values.abs().amax(dim=1)  # (r1-r0,)
        top = float(absmax.max())
        if top != top or top == float("inf"):
            raise CodecError(
                "non_finite", f"tensor {name!r} has NaN or Inf values: the inner loop diverged"
            )
        if top / qmax > SCALE_LIMIT:
            raise CodecError(
                "bad_input",
                f"tensor {name!r} has |values| up to {top:.3g}, beyond what {codec.name} encodes "
                f"({SCALE_LIMIT * qmax:.3g}); a Δ this large means training diverged",
            )
        q, scale = choose(values, absmax)  # (r1-r0, B), (r1-r0,)
        quantised[r0 * block : r1 * block] = q.view(-1)
        scales[r0:r1] = scale
    return quantised, scales


def _int8_absmax(values: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8's (q, scale) per block: scale absmax / 127. values: (rows, B), absmax: (rows,)."""
    scale = absmax / _divisor(INT8_QMAX, absmax)  # (rows,)
    safe = torch.where(scale > 0, scale, 1.0)  # all-zero (or tiny) blocks quantise to 0
    q = torch.div(values, safe[:, None]).round_().clamp_(-INT8_QMAX, INT8_QMAX)  # (rows, B)
    return q, scale


def _int4_least_squares(
    values: torch.Tensor, absmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """int4's (q, scale) per block: of the scales m / c, c in ``INT4_DIVISORS``, the one
    whose decoded block is closest to ``values`` in squared error (ties: the first, absmax).

    c = 7 is plain absmax (q in [-7, 7]); larger c use the nibble's -8 and clip the few
    largest values to 7s or -8s, which at 15 levels costs less than the coarser grid
    (squared error -25% on Gaussian blocks of 128 values). values: (rows, B), absmax: (rows,).
    """
    safe_max = torch.where(absmax > 0, absmax, 1.0)  # (rows,)
    unit = values / safe_max[:, None]  # (rows, B) in [-1, 1]: errors neither overflow nor vanish
    # Squares of fp32 values are exact in fp64, so the sums (hence the choice) agree across
    # devices but for ties within 2**-50; MPS has no fp64.
    wide = torch.float32 if values.device.type == "mps" else torch.float64
    best_q = best_scale = best_error = None
    for divisor in INT4_DIVISORS:
        by = _divisor(divisor, absmax)  # a tensor: see _divisor
        scale = absmax / by  # (rows,)
        safe = torch.where(scale > 0, scale, 1.0)  # all-zero (or tiny) blocks quantise to 0
        q = torch.div(values, safe[:, None]).round_().clamp_(-8, 7)  # (rows, B)
        error = (q / by - unit).to(wide).square_().sum(dim=1)  # (rows,): in absmax**2
        if best_q is None or best_scale is None or best_error is None:
            best_q, best_scale, best_error = q, scale, error
            continue
        better = error < best_error  # (rows,)
        best_q = torch.where(better[:, None], q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.minimum(error, best_error)
    assert best_q is not None and best_scale is not None
    return best_q, best_scale


def check_scales(name: str, codec: str, scales: torch.Tensor) -> None:
    """Scales must be finite, >= 0 and small enough that every decoded value is finite."""
    if not scales.numel():
        return
    low, high = torch.aminmax(scales)
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise CodecError(
            "non_finite", f"tensor {name!r} has NaN or Inf block scales: the upload is corrupt"
        )
    if float(low) < 0 or float(high) > SCALE_LIMIT:
        raise CodecError(
            "bad_scales",
            f"tensor {name!r} has block scales in [{float(low):.3g}, {float(high):.3g}]; "
            f"{codec} scales lie in [0, {SCALE_LIMIT:.3g}]: the upload was not written by dipaco.codecs",
        )


def decode_float(
    codec: Codec, block: int, numel: int, stored: list[torch.Tensor]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, end, values)``: fp32 values of flat elements [start, end), chunk by chunk.

    ``values`` may be a view of the input: use it before the next step, never write to it
    (the same holds for every decoder here).
    """
    for start in range(0, numel, CHUNK_ELEMENTS):
        end = min(numel, start + CHUNK_ELEMENTS)
        yield start, end, stored[0][start:end].float()  # .float() is a no-op view for fp32


def decode_int8(
    codec: Codec, block: int, numel: int, stored: list[torch.Tensor]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    payload, scales = stored
    yield from _decode_blocks(payload, scales, block, numel, 0, scales.numel(), 0, None)


def decode_int4(
    codec: Codec, block: int, numel: int, stored: list[torch.Tensor]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    payload, scales = stored
    blocks = scales.numel()
    half = -(-blocks // 2)  # blocks [0, half) sit in the low nibbles, the rest in the high
    nibbles = payload.view(torch.int8)
    # arithmetic shifts sign-extend the two's-complement nibbles
    yield from _decode_blocks(
        nibbles, scales, block, numel, 0, half, 0, lambda raw: (raw << 4) >> 4
    )
    yield from _decode_blocks(
        nibbles, scales, block, numel, half, blocks, half, lambda raw: raw >> 4
    )


def _decode_blocks(
    payload: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    numel: int,
    first: int,
    last: int,
    base: int,
    unpack: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Blocks [first, last), stored from payload block ``first - base`` on, as fp32 chunks."""
    rows_per_chunk = max(1, CHUNK_ELEMENTS // block)
    for r0 in range(first, last, rows_per_chunk):
        r1 = min(last, r0 + rows_per_chunk)
        raw = payload[(r0 - base) * block : (r1 - base) * block]  # ((r1-r0)*B,)
        values = (raw if unpack is None else unpack(raw)).float()  # ((r1-r0)*B,)
        values.view(-1, block).mul_(scales[r0:r1, None])  # (r1-r0, B) * (r1-r0, 1)
        start, end = r0 * block, min(numel, r1 * block)
        yield start, end, values[: end - start]
