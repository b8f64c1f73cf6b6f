"""Published outer updates: how version t + 1 of a module travels as θ_t + decode(u).

With ``comm.download_codec`` int8 or fp16, the outer step does not publish its new
weights as they came out of the Nesterov step: it encodes the update u = θ_new − θ_t with
error feedback (`dipaco.codecs.encode_with_feedback`, the residual carried from the
module's previous update) and publishes θ_t + decode(u). A worker that holds θ_t
rebuilds the new version from the update's bytes alone (`apply_update`), with the same
fp32 addition, so the two sides hold the same weights bit for bit. One home for the
simulator (dipaco.simulate.train), the server (rounds.outer.step) and the worker agent.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from dipaco import codecs
from dipaco.codecs import TensorSpec
from dipaco.codecs.api import Source

__all__ = ["apply_update", "publish_update"]


def publish_update(
    old: Mapping[str, Tensor],
    new: Mapping[str, Tensor],
    codec: str,
    residual: Mapping[str, Tensor] | None,
    *,
    block_size: int = 64,
    compression: str = "none",
) -> tuple[dict[str, Tensor], bytes, dict[str, Tensor]]:
    """The outer update θ_new − θ_old encoded with `codec` and error feedback: (the
    published version, which is θ_old plus exactly the decoded update, as a worker holding
    θ_old rebuilds it with `apply_update`; the update's bytes; the residual for the next
    update, which carries what this encoding rounded off). `compression`: comm.compression,
    lossless, so it changes the bytes on the wire and nothing else."""
    update = {name: new[name] - old[name] for name in new}
    data, kept = codecs.encode_with_feedback(
        update, codec, residual, block_size=block_size, compression=compression
    )
    return apply_update(old, data), data, kept


def apply_update(
    old: Mapping[str, Tensor],
    data: Source,
    expected: Mapping[str, TensorSpec] | None = None,
) -> dict[str, Tensor]:
    """Version t + 1 from version t and the published update's bytes (fp32 addition).

    `data` is checked completely before use (header, names and shapes against `expected`
    when given, per-tensor sha256, finite values); a CodecError names what is wrong.
    """
    decoded = codecs.decode(data, expected)
    missing = sorted(set(old) - set(decoded))
    if missing:
        raise codecs.CodecError(
            "spec_mismatch", f"the update lacks tensors {missing[:3]}: it is for another module"
        )
    return {name: old[name] + decoded[name] for name in old}
