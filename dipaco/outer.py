"""The outer step of one module: aggregate the pseudo-gradients Δ of every contribution to
it, then take a Nesterov SGD step with the aggregate as the gradient (docs/design.md §1).

Aggregation rules (OuterConfig.robust):
- ``mean``: token-weighted mean, streamed (DeltaAccumulator): one fp32 sum in memory.
- ``clipped-mean``: the same stream, each Δ's norm first clipped to clip_factor x the
  median norm of the round; the server learns the norms while it verifies the uploads
  (it needs them for reject_norm_factor too), then streams with `clip_norm`.
- ``trimmed-mean``: per value, drop the trim_fraction largest and smallest of the Δs
  and average the rest (token-weighted). It needs every Δ of the module in memory at
  once: n x module size.
Momentum is a plain dict of tensors, named like the module's tensors, for the server to
persist next to the weights.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from dipaco import codecs
from dipaco.config import OuterConfig

__all__ = [
    "DeltaAccumulator",
    "aggregate",
    "clip_threshold",
    "delta_norm",
    "norm_outliers",
    "outer_lr",
    "outer_step",
    "rescale_factor",
    "trimmed_mean",
]

Tensors = Mapping[str, Tensor]


def delta_norm(delta: Tensors) -> float:
    """Global L2 norm of one module's Δ, over all its tensors."""
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in delta.values()))


def clip_threshold(norms: Sequence[float], clip_factor: float) -> float:
    """clipped-mean's norm limit: clip_factor x the median of the round's Δ norms."""
    return clip_factor * statistics.median(norms)


def norm_outliers(norms: Sequence[float], reject_norm_factor: float) -> list[bool]:
    """True for each Δ whose norm exceeds reject_norm_factor x the median (to be dropped)."""
    limit = reject_norm_factor * statistics.median(norms)
    return [n > limit for n in norms]


class DeltaAccumulator:
    """Streaming (weighted) mean of one module's Δs in fp32: add them one by one, then mean().

    Each Δ is checked against the names and shapes of the first one (or `spec`, the
    module's name -> (shape, dtype) from dipaco.modular.module_spec) and must be finite.
    `add_encoded` takes a Δ still encoded (the server's outer step, which never decodes a
    whole one): the same weights, clipping and sums, with the same arithmetic.
    """

    def __init__(
        self,
        spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        *,
        token_weighting: bool = True,
        clip_norm: float | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.spec = dict(spec) if spec else None
        self.shapes = {name: tuple(shape) for name, (shape, _) in spec.items()} if spec else None
        self.token_weighting = token_weighting
        self.clip_norm = clip_norm
        self.device = torch.device(device)
        self.sums: dict[str, Tensor] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, delta: Tensors, tokens: int) -> None:
        """Add one contribution that trained on `tokens` tokens."""
        if tokens <= 0:
            raise ValueError(f"a contribution must report tokens > 0, got {tokens}")
        shapes = self.shapes or {name: tuple(t.shape) for name, t in delta.items()}
        given = {name: tuple(t.shape) for name, t in delta.items()}
        if given != shapes:
            raise ValueError(f"Δ tensors {given} do not match the module's {shapes}")
        if not all(bool(torch.isfinite(t).all()) for t in delta.values()):
            raise ValueError("Δ holds NaN or infinite values")
        self.shapes = shapes
        weight = self._weight(tokens)
        scale = self._scale(delta_norm(delta) if self.clip_norm is not None else 0.0)
        for name, t in delta.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros(t.shape, dtype=torch.float32, device=self.device)
            self.sums[name].add_(t.to(self.device, torch.float32), alpha=weight * scale)
        self.total_weight += weight
        self.count += 1

    def add_encoded(
        self,
        data: bytes | str | os.PathLike[str],
        tokens: int,
        *,
        norm: float | None = None,
        verify_checksum: bool = True,
    ) -> None:
        """Add one encoded Δ (a dipaco.codecs container: bytes or a file), streamed into the
        sums chunk by chunk by codecs.accumulate, which checks it against the spec (needed
        here) first. Under clip_norm, `norm` is the Δ's global norm (codecs.verify's)."""
        if self.spec is None:
            raise ValueError("add_encoded needs the module's spec to check and size the sums")
        if self.clip_norm is not None and norm is None:
            raise ValueError("clipped-mean needs each encoded Δ's norm")
        weight = self._weight(tokens)
        scale = self._scale(norm or 0.0)
        if not self.sums:
            self.sums = {
                name: torch.zeros(shape, dtype=torch.float32, device=self.device)
                for name, (shape, _) in self.spec.items()
            }
        codecs.accumulate(
            data, self.sums, weight * scale, self.spec, verify_checksum=verify_checksum
        )
        self.total_weight += weight
        self.count += 1

    def _weight(self, tokens: int) -> float:
        if tokens <= 0:
            raise ValueError(f"a contribution must report tokens > 0, got {tokens}")
        return float(tokens) if self.token_weighting else 1.0

    def _scale(self, norm: float) -> float:
        """clipped-mean's factor for a Δ of this norm (1 without clipping or for a zero Δ)."""
        if self.clip_norm is None or norm <= 0:
            return 1.0
        return min(1.0, self.clip_norm / norm)

    def mean(self, *, in_place: bool = False) -> dict[str, Tensor]:
        """The weighted mean; `in_place` divides the sums themselves (no second copy of the
        module; the accumulator is spent)."""
        if self.count == 0:
            raise ValueError("no contribution was added; a module without Δs keeps its weights")
        if in_place:
            for s in self.sums.values():
                s.div_(self.total_weight)
            return self.sums
        return {name: s / self.total_weight for name, s in self.sums.items()}


def trimmed_mean(
    deltas: Sequence[Tensors],
    tokens: Sequence[int],
    trim_fraction: float,
    *,
    token_weighting: bool = True,
) -> dict[str, Tensor]:
    """Per value: sort the n Δs, drop floor(trim_fraction·n) at each end, weighted mean of the rest."""
    n = len(deltas)
    if n == 0 or n != len(tokens):
        raise ValueError(f"need one token count per Δ and at least one Δ (got {n}, {len(tokens)})")
    k = int(trim_fraction * n)  # < n/2 because trim_fraction < 0.5
    weights = torch.tensor([float(t) if token_weighting else 1.0 for t in tokens])  # (n,)
    result = {}
    for name in deltas[0]:
        stacked = torch.stack([d[name].to(torch.float32) for d in deltas])  # (n, *shape)
        values, order = stacked.sort(dim=0)  # (n, *shape) each
        kept, kept_weights = values[k : n - k], weights[order[k : n - k]]  # (n-2k, *shape)
        result[name] = (kept * kept_weights).sum(0) / kept_weights.sum(0)  # (*shape)
    return result


def rescale_factor(cfg: OuterConfig, contributing_paths: int) -> float:
    """DiPaCo's √n on a module's mean Δ, n = the paths that contributed to it this round.

    Counting contributors, not the layout's paths through the module: a stopped path, or
    one whose units all failed, adds no independent Δ to the average, so it must not
    scale it up either.
    """
    if not cfg.sqrt_paths_rescale or contributing_paths <= 1:
        return 1.0
    return math.sqrt(contributing_paths)


def outer_lr(cfg: OuterConfig, round_index: int, *, trained_start: bool = False) -> float:
    """The outer learning rate of 0-based round `round_index` (linear warm-up, then cfg.lr),
    divided by 1 + μ in the first round of a phase that starts from trained weights
    (`trained_start`) under Nesterov momentum.

    Why the first round: Nesterov's first step is lr x (1 + μ) x Δ (the look-ahead takes the
    one Δ there is as the next one too), so at the defaults (lr 1.0, μ 0.7) it moves the
    weights 70% past the mean of where the units ended. From a trained start (phase 2 from
    the phase-1 model, DiLoCo from a checkpoint) that overshoot is a step backwards: the
    tiny 2x2 DiPaCo run of bench/quality.py from its 300-step base (H = 25) went from a
    routed loss of 6.465 to 6.644 in its first round, while the units' own weights before
    the outer step scored 6.472 and the same round without momentum 6.446: neither the cold
    AdamW of the units nor the average across paths, but the look-ahead. Dividing the first
    lr by 1 + μ makes that step the mean Δ itself (the plain average of the units), with the
    momentum buffer starting at Δ as torch.optim.SGD's does; from round 2 on the step is
    SGD's own. Measured: 6.465 -> 6.447, 6.438, 6.283 over three rounds (SGD's first step:
    6.644, 6.397, 6.263; the later rounds catch up). From random weights it costs: tiny
    DiLoCo, 2 replicas, H = 30, 5 rounds ended at 6.957 against SGD's first step's 6.882
    (its first round is better, 7.196 against 8.480, but the momentum the first Δ leaves
    overshoots in the second), so a start from random weights keeps SGD's first step. The
    server (phase 2 with a base model: phase 1's or an uploaded checkpoint) and
    `dipaco simulate` (modules from the base) both take their lr here, with the phase's own
    round index.
    """
    if round_index < 0:
        raise ValueError(f"round_index = {round_index}: rounds count from 0")
    lr = cfg.lr * min(1.0, (round_index + 1) / (cfg.warmup_rounds + 1))
    if trained_start and round_index == 0 and cfg.nesterov and cfg.momentum > 0:
        lr /= 1.0 + cfg.momentum
    return lr


def aggregate(
    contributions: Iterable[tuple[Tensors, int]],
    cfg: OuterConfig,
    *,
    paths_through: int = 1,
    spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> dict[str, Tensor]:
    """One module's outer gradient from (Δ, tokens) pairs under cfg.robust, then the
    √(contributing paths) rescale (`rescale_factor`): averaging n paths' roughly
    independent Δs shrinks the norm by up to √n, and DiPaCo restores it so shared modules
    keep pace. `paths_through` is the number of distinct paths among the contributions.
    "mean" streams `contributions`; the robust rules hold them all.
    """
    if cfg.robust == "mean":
        accumulator = DeltaAccumulator(spec, token_weighting=cfg.token_weighting)
        for delta, tokens in contributions:
            accumulator.add(delta, tokens)
        result = accumulator.mean()
    else:
        items = list(contributions)
        if not items:
            raise ValueError("no contribution was given; a module without Δs keeps its weights")
        if cfg.robust == "clipped-mean":
            limit = clip_threshold([delta_norm(d) for d, _ in items], cfg.clip_factor)
            accumulator = DeltaAccumulator(
                spec, token_weighting=cfg.token_weighting, clip_norm=limit
            )
            for delta, tokens in items:
                accumulator.add(delta, tokens)
            result = accumulator.mean()
        else:
            result = trimmed_mean(
                [d for d, _ in items],
                [t for _, t in items],
                cfg.trim_fraction,
                token_weighting=cfg.token_weighting,
            )
    factor = rescale_factor(cfg, paths_through)
    if factor != 1.0:
        result = {name: t * factor for name, t in result.items()}
    return result


def outer_step(
    params: Tensors,
    delta: Tensors,
    momentum: Tensors | None,
    cfg: OuterConfig,
    *,
    lr: float | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """New (params, momentum) after one SGD step with `delta` as the gradient.

    `lr` overrides cfg.lr (`outer_lr(cfg, t)` gives round t's under the warm-up).

    The arithmetic of torch.optim.SGD(lr, momentum, nesterov, dampening=0, weight_decay=0):
    buf = μ·buf + g (buf = g on the first step, when `momentum` is None or empty);
    update = g + μ·buf with Nesterov, else buf; θ = θ − η·update. Inputs are not modified.
    """
    new_params, new_momentum = {}, {}
    for name, param in params.items():
        grad = delta[name].to(param.device, torch.float32)
        update = grad
        if cfg.momentum > 0:
            if momentum:
                buf = momentum[name].to(torch.float32).mul(cfg.momentum).add_(grad)
            else:
                buf = grad.clone()
            new_momentum[name] = buf
            update = grad.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
        new_params[name] = param.to(torch.float32).add(
            update, alpha=-(cfg.lr if lr is None else lr)
        )
    return new_params, new_momentum
