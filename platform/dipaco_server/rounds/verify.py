"""Checks on one module's Δs that hold with one or two contributions (docs/design.md §7, issue 19).

A round's median says nothing when a module gets two Δs: the attacker's own norm is half
of it. These checks compare each Δ with what the module itself did before and with what
the Δ does, never only with the round's other Δs:

- **replay**: an upload byte-identical (same sha256) to one of an earlier round of the run
  is a copy, not work (within a round, identical bytes say only that two units computed
  the same thing; the other checks judge them).
- **norm against history**: the median norm of the module's accepted Δs over its last
  ``outer.history_rounds`` rounds is its reference; a Δ above ``history_norm_factor`` x
  or below ``min_norm_factor`` x it is refused (a zero Δ is refused even without one).
- **direction against momentum**: the module's outer momentum is the running sum of its
  accepted outer gradients; an honest Δ points roughly along it. A Δ whose cosine with it
  is below ``min_momentum_cosine`` is refused (a sign flip scores about -1).
- **proof of useful work** (`score_delta`): the unit's Δ (every module it trained)
  applied alone to its path's base weights must lower the loss on windows of the unit's
  own training data by more than ``score_min_gain`` (a fraction of it, times the fraction of
  a unit's H steps the Δ trained: a lease cut to the round's deadline trains a step or two)
  and must not raise the loss on held-out windows by more than
  ``score_heldout_tolerance`` (relative). Two forward
  passes per contribution, on ``score_windows`` windows each, plus one pair per
  (path, base) shared by its units. A module's part of a Δ alone is no measure: measured
  on honest units, a level module's part alone raised the unit's training loss as often
  as it lowered it, while the whole Δ lowers it every time.
- **clipping**: what passes is aggregated with every norm clipped to ``clip_factor`` x the
  history reference (the round's median in a module's first round).

Pure functions without Django, so bench/attacks.py measures exactly these rules.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from dipaco.config import OuterConfig, RunConfig
from dipaco.evaluate import mean_loss

Tensors = Mapping[str, Tensor]

# Reasons, as recorded on the Contribution ("<code>: <message>") and counted per worker.
REPLAYED = "replayed"
NORM_HIGH = "norm_above_history"
NORM_LOW = "norm_below_history"
ZERO = "zero_delta"
DIRECTION = "against_momentum"
NO_GAIN = "no_training_gain"
HELDOUT = "heldout_loss_up"
REPLICA = "replica_disagrees"


@dataclass(frozen=True)
class Score:
    """Losses of the Δ's path on a small batch, before and after the Δ is applied alone."""

    train_before: float
    train_after: float
    heldout_before: float
    heldout_after: float
    seconds: float = 0.0

    @property
    def gain(self) -> float:
        return self.train_before - self.train_after

    def as_dict(self) -> dict[str, float]:
        return {
            "train_before": self.train_before,
            "train_after": self.train_after,
            "heldout_before": self.heldout_before,
            "heldout_after": self.heldout_after,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class Candidate:
    """What the checks need to know about one verified Δ."""

    key: int
    norm: float
    sha256: str = ""
    cosine: float | None = None  # with the module's outer momentum; None without one
    score: Score | None = None
    replayed: bool = False  # the server saw these bytes in an earlier round (sha256)
    # The fraction of a whole unit's H steps the Δ trained (a lease sized to the round's
    # deadline, a salvaged partial): the gain it must show scales with it.
    work: float = 1.0


def norm_reference(history: Sequence[float]) -> float | None:
    """The module's reference norm: the median of its recent accepted Δ norms."""
    usable = [n for n in history if math.isfinite(n) and n > 0]
    return statistics.median(usable) if usable else None


def cosine(delta: Tensors, other: Tensors) -> float | None:
    """cos(Δ, other) over every tensor of the module; None when either is zero."""
    dot, a, b = 0.0, 0.0, 0.0
    for name, tensor in delta.items():
        if name not in other:
            continue
        x, y = tensor.double().reshape(-1), other[name].double().reshape(-1)
        dot += float(x @ y)
        a += float(x @ x)
        b += float(y @ y)
    if a <= 0 or b <= 0:
        return None
    return dot / math.sqrt(a * b)


def screen(
    candidates: Sequence[Candidate],
    history: Sequence[float],
    cfg: OuterConfig,
    *,
    seen: set[str] | None = None,
) -> dict[int, str]:
    """{candidate key: "<code>: <message>"} for every Δ the checks refuse.

    `history`: accepted norms of the module's earlier rounds; `seen`: sha256s of every
    earlier upload (replays). With ``cfg.verify`` off nothing is refused here.
    """
    if not cfg.verify:
        return {}
    refused: dict[int, str] = {}
    reference = norm_reference(history)
    for c in candidates:
        reason = _refusal(c, reference, cfg, seen or set())
        if reason:
            refused[c.key] = reason
    return refused


def _refusal(c: Candidate, reference: float | None, cfg: OuterConfig, seen: set[str]) -> str:
    if c.replayed or (c.sha256 and c.sha256 in seen):
        return f"{REPLAYED}: the same bytes were uploaded in an earlier round"
    if not c.norm > 0:
        return f"{ZERO}: the Δ is all zeros; no work was done"
    if reference is not None:
        if c.norm > cfg.history_norm_factor * reference:
            return (
                f"{NORM_HIGH}: norm {c.norm:.4g} exceeds {cfg.history_norm_factor:g} x the "
                f"module's reference {reference:.4g} (outer.history_norm_factor)"
            )
        if c.norm < cfg.min_norm_factor * reference:
            return (
                f"{NORM_LOW}: norm {c.norm:.4g} is below {cfg.min_norm_factor:g} x the "
                f"module's reference {reference:.4g} (outer.min_norm_factor)"
            )
    if c.cosine is not None and c.cosine < cfg.min_momentum_cosine:
        return (
            f"{DIRECTION}: cosine {c.cosine:.3f} with the module's outer momentum is below "
            f"{cfg.min_momentum_cosine:g} (outer.min_momentum_cosine)"
        )
    if c.score is not None:
        s = c.score
        work = min(1.0, max(c.work, 0.0))
        if not s.gain > cfg.score_min_gain * work * s.train_before:
            of_steps = "" if work >= 1.0 else f" x {work:.3g} of the unit's steps it trained"
            return (
                f"{NO_GAIN}: applied alone it moves the loss on its unit's training windows "
                f"from {s.train_before:.4f} to {s.train_after:.4f}; it must lower it by more "
                f"than {cfg.score_min_gain:.1%}{of_steps} (outer.score_min_gain)"
            )
        limit = s.heldout_before * (1 + cfg.score_heldout_tolerance)
        if not s.heldout_after <= limit:
            return (
                f"{HELDOUT}: applied alone it raises the held-out loss from "
                f"{s.heldout_before:.4f} to {s.heldout_after:.4f}, more than "
                f"{cfg.score_heldout_tolerance:.0%} (outer.score_heldout_tolerance)"
            )
    return ""


def clip_limit(
    accepted_norms: Sequence[float], history: Sequence[float], cfg: OuterConfig
) -> float:
    """clipped-mean's limit: clip_factor x the history reference, else x the round median."""
    reference = norm_reference(history) if cfg.verify else None
    if reference is None:
        reference = statistics.median(accepted_norms)
    return cfg.clip_factor * reference


def replicas_agree(a: Tensors, b: Tensors, cfg: OuterConfig) -> tuple[bool, str]:
    """Two Δs of one unit by two workers: (agree, why not). Training is not bit-exact
    across machines (kernels, warm AdamW moments), so the test is a tolerance: their cosine
    at least ``replica_min_cosine`` and their norms within ``replica_norm_ratio`` x."""
    na = math.sqrt(sum(float(t.double().pow(2).sum()) for t in a.values()))
    nb = math.sqrt(sum(float(t.double().pow(2).sum()) for t in b.values()))
    if na == 0 or nb == 0:
        return (na == nb), "one of the two Δs is zero"
    ratio = max(na, nb) / min(na, nb)
    if ratio > cfg.replica_norm_ratio:
        return False, (
            f"norms {na:.4g} and {nb:.4g} differ by {ratio:.2f} x, more than "
            f"outer.replica_norm_ratio = {cfg.replica_norm_ratio:g}"
        )
    cos = cosine(a, b) or 0.0
    if cos < cfg.replica_min_cosine:
        return False, f"cosine {cos:.3f} < outer.replica_min_cosine = {cfg.replica_min_cosine:g}"
    return True, ""


# --- proof of useful work ------------------------------------------------------------------


def _loss(model: nn.Module, windows: Tensor) -> float:
    return mean_loss(model, windows)  # no_grad, eval mode


def score_delta(
    config: RunConfig,
    p: int,
    model: nn.Module,
    modules: Mapping[str, Tensors],
    deltas: Mapping[str, Tensors],
    train: Tensor,
    heldout: Tensor,
    before: tuple[float, float] | None = None,
) -> Score:
    """Path p's losses on `train` and `heldout` windows with its base `modules`, then with
    the unit's Δ applied alone: each module in `deltas` replaced by base - Δ, as an outer
    step of lr 1 with that unit as its only contribution would. `deltas` holds every
    module the unit trained (its Δ is one thing: a level module's part alone is no
    measure of the work). `before` reuses the base losses of an earlier unit of the same
    path and base (`base_losses`), so each further unit costs two forward passes.
    """
    from dipaco.modular import assemble_path_state  # transformers: seconds to import

    clock = time.perf_counter()
    if before is None:
        before = base_losses(config, p, model, modules, train, heldout)
    shifted = dict(modules)
    for module_id, delta in deltas.items():
        base = modules[module_id]
        shifted[module_id] = {n: base[n] - delta[n].to(base[n].dtype) for n in base}
    model.load_state_dict(assemble_path_state(config, p, shifted))
    after = (_loss(model, train), _loss(model, heldout))
    return Score(before[0], after[0], before[1], after[1], time.perf_counter() - clock)


def base_losses(
    config: RunConfig,
    p: int,
    model: nn.Module,
    modules: Mapping[str, Tensors],
    train: Tensor,
    heldout: Tensor,
) -> tuple[float, float]:
    """Path p's (train, held-out) losses with its base modules."""
    from dipaco.modular import assemble_path_state

    model.load_state_dict(assemble_path_state(config, p, modules))
    return _loss(model, train), _loss(model, heldout)
