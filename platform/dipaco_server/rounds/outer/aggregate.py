"""The arithmetic of one module's outer step, streamed (no database): pass 2 of
rounds.outer.step. `aggregate_uploads` turns the verified Δs into the module's outer
gradient (dipaco.outer's DeltaAccumulator fed the uploads still encoded, or the trimmed
mean chunk by chunk over Δs decoded to raw fp32 files, then the √(contributing paths)
rescale); `apply_step` applies Nesterov chunk by chunk, streaming the base version and
its momentum in and version t + 1 out. The server thereby steps exactly as the simulator
does.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dipaco.config import OuterConfig
from dipaco.modules_file import ModuleReader, ModuleWriter, Spec
from dipaco.outer import (
    DeltaAccumulator,
    outer_step,
    rescale_factor,
    trimmed_mean,
)
from dipaco_server.rounds.verification import rules
from dipaco_server.rounds.verification.uploads import Verdict
from dipaco_server.storage import BlobStore

STEP_CHUNK = 1 << 18  # values per Nesterov chunk: 1 MiB per temporary
TRIM_CHUNK = 1 << 18  # values x contributions per trimmed-mean chunk (sort keeps ~7 copies)


@dataclass(frozen=True)
class BaseVersion:
    """The version the round's contributions were trained from."""

    version: int
    key: str
    sha256: str
    momentum_key: str
    residual_key: str = ""  # its published update's error feedback (rounds.outer.publish)


def contributing_paths(accepted: Sequence[Verdict]) -> int:
    """The distinct paths among the accepted contributions: what DiPaCo's √ rescale counts
    (dipaco.outer.rescale_factor), not the layout's paths through the module; a path that
    is stopped, or whose uploads were all refused, adds no Δ to the mean."""
    return len({v.upload.path for v in accepted})


def aggregate_uploads(
    accepted: Sequence[Verdict],
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    history: Sequence[float] = (),
) -> dict[str, Tensor]:
    """Pass 2: the module's outer gradient in fp32, as dipaco.outer.aggregate computes it
    with ``paths_through=contributing_paths(accepted)``: the library's DeltaAccumulator
    (weights, clipping) fed the verified uploads still encoded, and its trimmed_mean."""
    if cfg.robust == "trimmed-mean":
        grad = _trimmed_mean(accepted, spec, cfg, work)
    else:
        limit = None
        if cfg.robust == "clipped-mean":
            # x the module's reference norm (its history), the round's median at first
            limit = rules.clip_limit([float(v.norm or 0.0) for v in accepted], history, cfg)
        accumulator = DeltaAccumulator(spec, token_weighting=cfg.token_weighting, clip_norm=limit)
        for verdict in accepted:
            if verdict.raw is not None:  # a check decoded it already: read back, not again
                accumulator.add(verdict.decoded(spec), verdict.upload.tokens)
                continue
            assert verdict.file is not None
            # Its sha256 was checked as it downloaded (pass 1).
            accumulator.add_encoded(
                verdict.file, verdict.upload.tokens, norm=verdict.norm, verify_checksum=False
            )
        grad = accumulator.mean(in_place=True)  # no second copy of the module
    factor = rescale_factor(cfg, contributing_paths(accepted))
    if factor != 1.0:
        for tensor in grad.values():
            tensor.mul_(factor)
    return grad


def _trimmed_mean(
    accepted: Sequence[Verdict], spec: Spec, cfg: OuterConfig, work: Path
) -> dict[str, Tensor]:
    """dipaco.outer.trimmed_mean, chunk by chunk over Δs decoded to raw fp32 files."""
    raw_files = []
    for verdict in accepted:  # each decoded to a raw fp32 file, once (Verdict.decoded)
        if verdict.raw is None:
            verdict.decoded(spec)
        raw = verdict.raw
        assert raw is not None
        raw_files.append(raw)
    tokens = [v.upload.tokens for v in accepted]
    chunk = max(1, TRIM_CHUNK // len(accepted))
    result = {name: torch.empty(shape, dtype=torch.float32) for name, (shape, _) in spec.items()}
    handles = [open(raw, "rb") for raw in raw_files]  # noqa: SIM115 (closed below)
    try:
        for name, flat in ((n, t.view(-1)) for n, t in result.items()):
            for start in range(0, flat.numel(), chunk):
                count = min(chunk, flat.numel() - start)
                pieces = [{name: _read_floats(h, count)} for h in handles]  # n x (count,)
                flat[start : start + count] = trimmed_mean(
                    pieces, tokens, cfg.trim_fraction, token_weighting=cfg.token_weighting
                )[name]
    finally:
        for handle in handles:
            handle.close()
    return result


def _read_floats(handle: io.BufferedReader, count: int) -> Tensor:
    values = torch.empty(count, dtype=torch.float32)
    if handle.readinto(values.view(torch.uint8).numpy().data) != 4 * count:
        raise OSError(f"{handle.name} ended early; the work directory was changed under us")
    return values


def apply_step(
    store: BlobStore,
    base: BaseVersion,
    grad: Mapping[str, Tensor],
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    lr: float,
    mu: float,
) -> tuple[Path, str, int, Path | None]:
    """dipaco.outer.outer_step at outer learning rate `lr` and momentum `mu`, chunk by chunk,
    streaming version `base` and its momentum in: (weights file, its sha256, its size,
    momentum file; None at μ = 0, which keeps no buffer)."""
    base_path, base_momentum = work / "base.safetensors", None
    store.download_to(base.key, base_path)
    if base.momentum_key and mu:
        base_momentum = work / "base-momentum.safetensors"
        store.download_to(base.momentum_key, base_momentum)
    weights_path, momentum_path = work / "weights.safetensors", work / "momentum.safetensors"
    with (
        ModuleReader(base_path, spec, base.sha256) as params,
        ModuleReader(base_momentum, spec) if base_momentum else nullcontext() as buffer,
        ModuleWriter(weights_path, spec) as weights_out,
        ModuleWriter(momentum_path, spec) if mu else nullcontext() as momentum_out,
    ):
        for name, (shape, _) in spec.items():
            flat = grad[name].view(-1)
            for start in range(0, math.prod(shape), STEP_CHUNK):
                g = flat[start : start + STEP_CHUNK]  # (c,)
                p = params.read(g.numel())  # (c,)
                m = {name: buffer.read(g.numel())} if buffer is not None else None  # (c,)
                new_p, new_m = outer_step({name: p}, {name: g}, m, cfg, lr=lr, mu=mu)
                weights_out.write(new_p[name])
                if momentum_out is not None:
                    momentum_out.write(new_m[name])
        params.finish()  # raises if version `base` is not the one the database names
        if buffer is not None:
            buffer.finish()
        digest, size = weights_out.close()
        if momentum_out is not None:
            momentum_out.close()
    return weights_path, digest, size, momentum_path if mu else None
