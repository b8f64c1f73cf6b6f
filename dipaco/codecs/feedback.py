"""A unit's Δ, module by module, encoded with the run's codec and error feedback.

The worker agent (``worker_agent.payload``) and the simulator (``dipaco.simulate.train``)
both encode through ``encode_module_deltas``, so a platform run and ``dipaco simulate``
send the same bytes and keep the same residuals.

The run config's ``comm`` section (``dipaco.config.CommConfig``) is read through the
``Comm`` protocol below: the config validates its codec names against this package's
registry, so this package imports nothing of the config (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from torch import Tensor

from dipaco.codecs.api import encode_with_feedback


class Comm(Protocol):
    """What encoding reads of the run's ``comm`` section (``dipaco.config.CommConfig``)."""

    @property
    def codec(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def compression(self) -> str: ...


class Residuals(Protocol):
    """Where a replica keeps each module's error-feedback residual (``InnerState``)."""

    def module_residual(self, module_id: str) -> dict[str, Tensor]: ...

    def set_module_residual(self, module_id: str, tensors: Mapping[str, Tensor]) -> None: ...


def encode_module_deltas(
    deltas: Mapping[str, Mapping[str, Tensor]], comm: Comm, residuals: Residuals
) -> Iterator[tuple[str, bytes]]:
    """``(module id, bytes as sent)`` for each module's Δ, one module at a time.

    Each module's Δ gets the residual ``residuals`` kept from its previous encoding added
    before quantising (``encode_with_feedback``); that residual is replaced by this
    encoding's error as the module's bytes are yielded. The bytes are ``comm.codec`` with
    ``comm.block_size``, in a zstd frame when ``comm.compression`` says so. A caller that
    must not keep the new residuals before the Δs are accepted passes a copy.
    """
    for module_id, tensors in deltas.items():
        data, residual = encode_with_feedback(
            tensors,
            comm.codec,
            residuals.module_residual(module_id),
            block_size=comm.block_size,
            compression=comm.compression,
        )
        residuals.set_module_residual(module_id, residual)
        yield module_id, data
