"""Per-tensor encode and chunked decode for each codec, as vectorised torch ops.

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

from collections.abc import Iterator

import torch

from dipaco.codecs.container import LOGICAL_NAME, CodecError

CHUNK_ELEMENTS = 1 << 20
QMAX = {"int8": 127, "int4": 7}
# int4's candidate scales m / c (kernels._int4_least_squares); 7 first: absmax, the fallback.
INT4_DIVISORS = (7.0, 7.5, 8.0, 8.5, 9.0, 10.0)
FLOAT_CODEC_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
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
_EXPONENT_MASK = {"bf16": 0x7F80, "fp16": 0x7C00}


def has_non_finite(codec: str, payload: torch.Tensor) -> bool:
    """Whether a float codec's stored payload holds NaN or Inf."""
    step = _chunk(payload.device)
    for start in range(0, payload.numel(), step):
        part = payload[start : start + step]
        if codec in _EXPONENT_MASK:
            mask = _EXPONENT_MASK[codec]
            if int((part.view(torch.int16) & mask).amax()) == mask:
                return True
        # fp32: a sum is 4x faster than the masks (bench/codec.py) and is NaN/Inf if any value
        # is; only a sum that overflowed on finite values needs the exact scan
        elif not torch.isfinite(part.sum()) and not bool(torch.isfinite(part).all()):
            return True
    return False


def encode_tensor(
    name: str, tensor: torch.Tensor, codec: str, block_size: int
) -> list[torch.Tensor]:
    """The stored arrays for one tensor (CPU, contiguous, 1-D), in ``stored_layout`` order."""
    if tensor.dtype not in LOGICAL_NAME:
        raise CodecError(
            "bad_input",
            f"tensor {name!r} is {tensor.dtype}; codecs take float32/float64/float16/bfloat16",
        )
    flat = tensor.detach().reshape(-1)  # (n,)
    if codec not in FLOAT_CODEC_DTYPE:
        return _encode_blocks(name, flat, codec, block_size)
    stored = flat.to(FLOAT_CODEC_DTYPE[codec]).cpu().contiguous()
    if has_non_finite(codec, stored):
        if not bool(torch.isfinite(flat).all()):
            raise CodecError(
                "non_finite", f"tensor {name!r} has NaN or Inf values: the inner loop diverged"
            )
        raise CodecError(
            "bad_input",
            f"tensor {name!r} has values beyond the range of {codec}: "
            f"encode it with {'bf16' if codec == 'fp16' else 'fp32'}",
        )
    return [stored]


def _encode_blocks(name: str, flat: torch.Tensor, codec: str, block: int) -> list[torch.Tensor]:
    qmax = QMAX[codec]
    blocks = -(-flat.numel() // block)
    # int4 quantises into a buffer of whole blocks, then packs its two halves into nibbles
    rows = blocks if codec == "int8" else 2 * (-(-blocks // 2))
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
                f"tensor {name!r} has |values| up to {top:.3g}, beyond what {codec} encodes "
                f"({SCALE_LIMIT * qmax:.3g}); a Δ this large means training diverged",
            )
        if codec == "int4":
            q, scale = _int4_least_squares(values, absmax)
        else:
            scale = absmax / _divisor(qmax, absmax)  # (r1-r0,)
            safe = torch.where(scale > 0, scale, 1.0)  # all-zero (or tiny) blocks quantise to 0
            q = torch.div(values, safe[:, None]).round_().clamp_(-qmax, qmax)  # (r1-r0, B)
        quantised[r0 * block : r1 * block] = q.view(-1)
        scales[r0:r1] = scale
    if codec == "int8":
        return [quantised.cpu(), scales.cpu()]
    low, high = quantised.view(2, -1)  # (H*B,) each: blocks [0, H) and [H, 2H)
    packed = (low & 15) | (high << 4)  # (H*B,) two's-complement nibbles
    return [packed.view(torch.uint8).cpu(), scales.cpu()]


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


def iter_decoded(
    codec: str, block: int, numel: int, stored: list[torch.Tensor]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, end, values)``: fp32 values of flat elements [start, end), chunk by chunk.

    ``values`` may be a view of the input: use it before the next step, never write to it.
    """
    if codec in FLOAT_CODEC_DTYPE:
        for start in range(0, numel, CHUNK_ELEMENTS):
            end = min(numel, start + CHUNK_ELEMENTS)
            yield start, end, stored[0][start:end].float()  # .float() is a no-op view for fp32
        return
    payload, scales = stored
    blocks = scales.numel()
    half = -(-blocks // 2)  # int4: blocks [0, half) sit in the low nibbles, the rest in the high
    spans = [(0, blocks, 0)] if codec == "int8" else [(0, half, 0), (half, blocks, half)]
    rows_per_chunk = max(1, CHUNK_ELEMENTS // block)
    for first, last, base in spans:
        for r0 in range(first, last, rows_per_chunk):
            r1 = min(last, r0 + rows_per_chunk)
            raw = payload[(r0 - base) * block : (r1 - base) * block]  # ((r1-r0)*B,)
            if codec == "int4":
                nibbles = raw.view(torch.int8)
                # arithmetic shifts sign-extend the two's-complement nibbles
                raw = (nibbles << 4) >> 4 if base == 0 else nibbles >> 4
            values = raw.float()  # ((r1-r0)*B,)
            values.view(-1, block).mul_(scales[r0:r1, None])  # (r1-r0, B) * (r1-r0, 1)
            start, end = r0 * block, min(numel, r1 * block)
            yield start, end, values[: end - start]
