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
    "round_momentum",
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
        weight = self.weight(tokens)
        scale = self.scale(delta_norm(delta) if self.clip_norm is not None else 0.0)
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
        weight = self.weight(tokens)
        scale = self.scale(norm or 0.0)
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

    def weight(self, tokens: int) -> float:
        """A contribution's weight in the mean (its tokens, or 1 without token weighting)."""
        if tokens <= 0:
            raise ValueError(f"a contribution must report tokens > 0, got {tokens}")
        return float(tokens) if self.token_weighting else 1.0

    def scale(self, norm: float) -> float:
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


def outer_lr(cfg: OuterConfig, round_index: int) -> float:
    """The outer learning rate of 0-based round `round_index`: a linear warm-up over
    cfg.warmup_rounds, then cfg.lr."""
    if round_index < 0:
        raise ValueError(f"round_index = {round_index}: rounds count from 0")
    return cfg.lr * min(1.0, (round_index + 1) / (cfg.warmup_rounds + 1))


def round_momentum(cfg: OuterConfig, round_index: int, *, trained_start: bool = False) -> float:
    """The outer momentum μ of 0-based round `round_index`: cfg.momentum, except in the first
    round of a phase that starts from trained weights (`trained_start`: phase 2 from the
    phase-1 model or an uploaded checkpoint, DiLoCo from a checkpoint, `dipaco simulate`
    from its base), which takes none: its step is the mean Δ itself and it leaves no buffer,
    so the second round is torch.optim.SGD's first step and the rounds after it SGD's own.

    Why the first round: Nesterov's first step is lr x (1 + μ) x Δ (the look-ahead takes the
    one Δ there is as the next one too), at the defaults (lr 1.0, μ 0.7) 70% past the mean of
    where the units ended. From trained weights that is a step backwards: the tiny 2x2
    DiPaCo run of bench/quality.py from its 300-step base (H = 25) went from a routed loss
    of 6.465 to 6.644 in its first round, while the units' own weights scored 6.472 and the
    same round without momentum 6.446.

    Why no buffer: the mean-Δ first step used to keep SGD's buffer (Δ1), so the second step
    was lr x ((1 + μ) Δ2 + μ² Δ1), Δ1 applied a second time from weights that already hold
    it; it stepped back in 2 of the quality run's 3 seeds (6.516 -> 6.499 -> 6.605 and
    6.522 -> 6.445 -> 6.506). Measured on the bench's b/dipaco-fp32 job (seed 0, base at
    6.472), routed loss after rounds 1-8 with the buffer kept: 6.428, 6.345, 6.300, 6.071,
    5.948, 5.904, 5.860, 5.816; without it: 6.428, 6.320, 6.308, 6.065, 5.947, 5.883, 5.840,
    **5.797** (docs/benchmarks.md, "The phase boundary").

    From random weights the look-ahead costs nothing: tiny DiLoCo, 2 replicas, H = 30,
    5 rounds ended at 6.882 with SGD's first step and 6.957 with the mean Δ, so a random
    start keeps cfg.momentum from round 0. The server's outer step
    (dipaco_server.rounds.outer.step) and `dipaco simulate` both take μ here, with the
    phase's own round index.
    """
    if round_index < 0:
        raise ValueError(f"round_index = {round_index}: rounds count from 0")
    return 0.0 if trained_start and round_index == 0 else cfg.momentum


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
    mu: float | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """New (params, momentum) after one SGD step with `delta` as the gradient.

    `lr` overrides cfg.lr (`outer_lr(cfg, t)` gives round t's under the warm-up); `mu`
    overrides cfg.momentum for this step (`round_momentum(cfg, t)`: none in the first round
    from trained weights). A step at μ = 0 is plain SGD and returns no buffer, as a run
    without momentum; the next step with μ > 0 then starts one, as SGD's first.

    The arithmetic of torch.optim.SGD(lr, momentum=μ, nesterov, dampening=0, weight_decay=0):
    buf = μ·buf + g (buf = g on the first step, when `momentum` is None or empty);
    update = g + μ·buf with Nesterov, else buf; θ = θ − η·update. Inputs are not modified.
    """
    factor = cfg.momentum if mu is None else mu
    new_params, new_momentum = {}, {}
    for name, param in params.items():
        grad = delta[name].to(param.device, torch.float32)
        update = grad
        if factor > 0:
            if momentum:
                buf = momentum[name].to(torch.float32).mul(factor).add_(grad)
            else:
                buf = grad.clone()
            new_momentum[name] = buf
            update = grad.add(buf, alpha=factor) if cfg.nesterov else buf
        new_params[name] = param.to(torch.float32).add(
            update, alpha=-(cfg.lr if lr is None else lr)
        )
    return new_params, new_momentum
