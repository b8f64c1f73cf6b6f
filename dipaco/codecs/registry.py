"""Every pseudo-gradient codec, in one table: its name, bits, stored layout, encoder and decoder.

The run config's choices (``comm.codec``, ``comm.download_codec``), the CLI's ``--codec`` and
the container's reader all come from ``REGISTRY`` below, so adding a codec is one row here
(and its kernels, if it needs new ones) plus its tests.

The table is torch-free and imports nothing of the package: the run config and the CLI read
it, and they load without torch (tests/test_boundaries.py). Each row names its kernels in
``dipaco.codecs.kernels``, which ``dipaco.codecs.api`` calls by those names.

Stored layout of one logical tensor of ``numel`` values: the payload array, 1-D, of dtype
``payload`` (safetensors' names), holding ``values_per_element`` values per element; a
blocked codec pads its values to whole blocks of ``block_size`` and adds the array
``<name>::scales`` (F32, one scale per block). int4 packs two blocks into one block of
bytes (low and high nibbles; ``dipaco.codecs.kernels``), hence ceil(blocks / 2) of them.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALES_SUFFIX = "::scales"
# safetensors dtype name -> bits per element, for the payload arrays the table may name
PAYLOAD_BITS = {"F32": 32, "BF16": 16, "F16": 16, "I8": 8, "U8": 8}


@dataclass(frozen=True)
class Codec:
    """One codec: what ``encode`` writes and how ``decode`` reads it back."""

    name: str
    bits: int  # per value in the payload; a blocked codec adds 32 per block (its scale)
    payload: str  # safetensors dtype of the payload array
    blocked: bool  # values in blocks of block_size, one F32 scale each
    exact: bool  # decodes to the very fp32 values encoded: error feedback keeps no residual
    for_updates: bool  # offered for published outer updates (comm.download_codec)
    # Names of its functions in dipaco.codecs.kernels, which the codec's users
    # (dipaco.codecs.api) call, so the table imports no kernel (and no torch):
    encoder: str  # (tensor name, flat tensor, codec, block_size) -> stored arrays
    decoder: str  # (codec, block_size, numel, stored arrays) -> (start, end, fp32 values)
    summary: str  # one line for the config's and the CLI's help

    @property
    def values_per_element(self) -> int:
        return PAYLOAD_BITS[self.payload] // self.bits

    def layout(self, numel: int, block_size: int) -> list[tuple[str, str, int]]:
        """The arrays (key suffix, safetensors dtype, length) that store ``numel`` values."""
        if not self.blocked:
            return [("", self.payload, -(-numel // self.values_per_element))]
        blocks = -(-numel // block_size)
        payload = -(-blocks // self.values_per_element) * block_size
        return [("", self.payload, payload), (SCALES_SUFFIX, "F32", blocks)]


def _float(
    name: str, bits: int, payload: str, *, exact: bool, for_updates: bool, summary: str
) -> Codec:
    """A float codec: the values cast to ``payload``, rounding to nearest even."""
    encoder, decoder = "encode_float", "decode_float"
    return Codec(name, bits, payload, False, exact, for_updates, encoder, decoder, summary)


def _blocked(name: str, bits: int, payload: str, *, for_updates: bool, summary: str) -> Codec:
    """A block codec; its kernels are ``encode_<name>`` and ``decode_<name>``."""
    encoder, decoder = f"encode_{name}", f"decode_{name}"
    return Codec(name, bits, payload, True, False, for_updates, encoder, decoder, summary)


REGISTRY: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        _float("fp32", 32, "F32", exact=True, for_updates=True, summary="exact"),
        _float(
            "bf16",
            16,
            "BF16",
            exact=False,
            for_updates=False,
            summary="relative error <= 2**-8",
        ),
        _float(
            "fp16",
            16,
            "F16",
            exact=False,
            for_updates=True,
            summary="relative error <= 2**-11 within |x| <= 65504",
        ),
        _blocked(
            "int8",
            8,
            "I8",
            for_updates=True,
            summary="blockwise absmax, one fp32 scale m/127 per block: |error| <= m/254",
        ),
        _blocked(
            "int4",
            4,
            "U8",
            for_updates=False,
            summary="blockwise least squares, scale m/c with c in 7..10, nibbles in [-8, 7]",
        ),
    )
}
CODECS = tuple(REGISTRY)  # the names, in the table's order
UPDATE_CODECS = tuple(name for name, codec in REGISTRY.items() if codec.for_updates)


def codec_named(name: str) -> Codec | None:
    """The codec called ``name``, or None (callers refuse it with their own error)."""
    return REGISTRY.get(name) if isinstance(name, str) else None


def describe(names: tuple[str, ...] = CODECS) -> str:
    """``name (summary); ...`` for help texts and schema descriptions."""
    return "; ".join(f"{name} ({REGISTRY[name].summary})" for name in names)
