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
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dipaco import codecs
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

SPLIT_MIN_VALUES = 1 << 22  # a module's sum is split by tensor from 4M values (split_parts)
SPLIT_MIN_DELTAS = 8  # ... and from this many Δs
SPLIT_MAX = 4  # threads at most
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
        groups = tensor_groups(spec, split_parts(spec, len(accepted)))
        if len(groups) > 1 and all(v.raw is None and v.file is not None for v in accepted):
            grad = _split_sum(accepted, spec, accumulator, groups)
            factor = rescale_factor(cfg, contributing_paths(accepted))
            if factor != 1.0:
                for tensor in grad.values():
                    tensor.mul_(factor)
            return grad
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


def split_parts(spec: Spec, deltas: int) -> int:
    """How many threads a module's sum is split into (`tensor_groups`): as many as its
    largest tensor divides it into, at most SPLIT_MAX, and 1 for a module below
    SPLIT_MIN_VALUES values or with fewer than SPLIT_MIN_DELTAS Δs (not worth a thread)."""
    sizes = [math.prod(shape) for shape, _ in spec.values()]
    if not sizes or sum(sizes) < SPLIT_MIN_VALUES or deltas < SPLIT_MIN_DELTAS:
        return 1
    return max(1, min(SPLIT_MAX, len(sizes), round(sum(sizes) / max(sizes))))


def tensor_groups(spec: Spec, parts: int) -> list[list[str]]:
    """The module's tensors in `parts` groups of about equal size, largest first onto the
    lightest group (Graham's LPT); each group keeps the spec's order. One group when
    `parts` is 1."""
    names = list(spec)
    if parts <= 1 or len(names) <= 1:
        return [names]
    loads = [0] * parts
    members: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(names, key=lambda n: -math.prod(spec[n][0])):
        lightest = loads.index(min(loads))
        loads[lightest] += math.prod(spec[name][0])
        members[lightest].append(name)
    order = {name: i for i, name in enumerate(names)}
    return [sorted(group, key=order.__getitem__) for group in members if group]


def _split_sum(
    accepted: Sequence[Verdict],
    spec: Spec,
    accumulator: DeltaAccumulator,
    groups: Sequence[Sequence[str]],
) -> dict[str, Tensor]:
    """The accumulator's mean, its sums split by tensor over threads: each thread adds
    every accepted Δ, in order, into its own group of tensors (codecs.accumulate with
    ``names``), with the factor `DeltaAccumulator.add_encoded` would give it. Each value
    gets the same additions in the same order as in one thread, so the mean is the same
    bit for bit; the wall time is the largest group's. torch releases the GIL in its
    kernels, so the threads run on as many cores; a step at a round's close has them, its
    other modules' steps being shorter (docs/benchmarks.md)."""
    factors, total = [], 0.0
    for verdict in accepted:
        weight = accumulator.weight(verdict.upload.tokens)
        factors.append(weight * accumulator.scale(verdict.norm or 0.0))
        total += weight
    sums = {name: torch.zeros(shape, dtype=torch.float32) for name, (shape, _) in spec.items()}

    def add(group: Sequence[str]) -> None:
        into = {name: sums[name] for name in group}
        for verdict, factor in zip(accepted, factors, strict=True):
            assert verdict.file is not None
            # Its sha256 was checked as it downloaded (pass 1, or at its completion).
            codecs.accumulate(verdict.file, into, factor, spec, verify_checksum=False, names=group)

    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="outer-sum") as pool:
        for done in [pool.submit(add, group) for group in groups]:
            done.result()  # re-raises a thread's error
    accumulator.sums, accumulator.total_weight, accumulator.count = sums, total, len(accepted)
    return accumulator.mean(in_place=True)


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
