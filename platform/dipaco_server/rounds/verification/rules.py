"""Checks on one module's Δs that hold with one or two contributions (docs/design.md §7:
volunteers are untrusted).

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
  applied alone to its path's base weights must lower the loss on most of the drawn
  windows of the unit's own training data by more than ``score_min_gain`` (a fraction of
  each window's loss, times the fraction of a unit's H steps the Δ trained: a lease cut to
  the round's deadline trains a step or two; and times the mean learning rate of its steps
  over the peak, rounds.granted.lr_share: a phase's last round trains late in the cosine
  decay and buys a third of the first's gain): the gain a strict majority of the windows
  reach (dipaco.data.scored.majority_gain), not their mean, which one or two memorised
  windows carried; and it must not raise the mean loss on held-out windows by more than
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
from dataclasses import dataclass, field

from torch import Tensor, nn

from dipaco.config import OuterConfig, RunConfig
from dipaco.data.scored import majority_gain
from dipaco.evaluate import mean_loss, window_losses
from dipaco.modular import assemble_path_state

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
PEER = "against_peers"
# Held, not refused: two workers' copies of one unit agree and neither shows a gain
# (`held_no_gain`). Left out of the step, neither credited nor counted against either worker.
AGREED_NO_GAIN = "agreed_no_gain"


@dataclass(frozen=True)
class BaseLosses:
    """A path's losses with its base modules: each scored training window's, and the mean
    over the held-out windows (what `score_delta` reuses for the path's further units)."""

    train: tuple[float, ...]
    heldout: float

    @property
    def train_mean(self) -> float:
        return statistics.fmean(self.train) if self.train else math.nan


@dataclass(frozen=True)
class Score:
    """Losses of the Δ's path on a small batch, before and after the Δ is applied alone
    (means over the windows), and `train_gain`: the relative gain a strict majority of the
    training windows reach (dipaco.data.scored.majority_gain; None in a score recorded
    before it was kept, then the relative gain of the means)."""

    train_before: float
    train_after: float
    heldout_before: float
    heldout_after: float
    seconds: float = 0.0
    train_gain: float | None = None
    # The base losses it was measured against, for the path's next unit (not recorded).
    base: BaseLosses | None = field(default=None, compare=False, repr=False)

    @property
    def gain(self) -> float:
        """The mean loss drop on the training windows (absolute)."""
        return self.train_before - self.train_after

    @property
    def relative_gain(self) -> float:
        """What the checks and the credit read: the relative loss gain a strict majority of
        the unit's scored training windows reach."""
        if self.train_gain is not None:
            return self.train_gain
        if not self.train_before > 0:
            return 0.0
        return self.gain / self.train_before

    @classmethod
    def from_dict(cls, row: object) -> Score | None:
        """The score `as_dict` recorded (Lease.score), or None when it is not one."""
        if not isinstance(row, dict):
            return None
        try:
            a, b, c, d = (
                float(row[k]) for k in ("train_before", "train_after", "heldout_before",
                                        "heldout_after")
            )  # fmt: skip
            gain = row.get("train_gain")
            train_gain = None if gain is None else float(gain)
        except (KeyError, TypeError, ValueError):
            return None
        return cls(a, b, c, d, train_gain=train_gain)

    def as_dict(self) -> dict[str, float]:
        row = {
            "train_before": self.train_before,
            "train_after": self.train_after,
            "heldout_before": self.heldout_before,
            "heldout_after": self.heldout_after,
            "seconds": self.seconds,
        }
        if self.train_gain is not None:
            row["train_gain"] = self.train_gain
        return row


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
    # The mean learning rate of its steps over the peak (rounds.granted.lr_share): the gain
    # it must show scales with it too, as the gain an honest unit buys does.
    lr_share: float = 1.0


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
        work, lr = min(1.0, max(c.work, 0.0)), min(1.0, max(c.lr_share, 0.0))
        if not s.relative_gain > cfg.score_min_gain * work * lr:
            of_steps = "" if work >= 1.0 else f" x {work:.3g} of the unit's steps it trained"
            of_steps += "" if lr >= 1.0 else f" x {lr:.3g}, its steps' mean lr over the peak"
            return (
                f"{NO_GAIN}: applied alone it moves the loss on its unit's scored training "
                f"windows from {s.train_before:.4f} to {s.train_after:.4f} (mean), and a "
                f"majority of them by {s.relative_gain:.2%} or more; it must lower the loss "
                f"of most of them by more than {cfg.score_min_gain:.1%}{of_steps} "
                "(outer.score_min_gain)"
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
    na, nb = _norm(a), _norm(b)
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


# Two copies of one unit *agree* only this close (cosine). Both train cold from the same
# base on the same windows, so they differ only by what differs between two machines: on
# two CPUs nothing (the same bytes); the tests model two machines as a fresh deviation of
# 0.3 x the Δ's norm on each copy, cosine 1/1.09 = 0.917 (tests/test_probation.py,
# tests/test_replica_bias.py). A fixed direction added at 0.5 x the Δ's norm keeps a
# cosine of 1/√1.25 = 0.894 with an exact honest copy (0.858 with the machines' deviation
# on the honest one) and passed `replicas_agree`'s tolerance (0.2) as agreement: live, a
# sleeper's audits all agreed and it was credited everything it claimed.
# Between the tolerance and this bar a pair is *doubtful* (`settle_replicas`): neither
# copy is refused (nothing tells which one carries the difference), neither confirms the
# other, and both workers' next units are replicated with their credit held until a
# conclusive agreement (workers.trust.doubt). A bias of 0.5 x the Δ's norm never counts as
# agreement; one below about 0.45 x may, and is left to the repetition rule
# (rounds.verification.persistence), which judges every close pair's difference.
AGREE_COSINE = 0.9


def conclusive(a: Tensors, b: Tensors) -> tuple[bool, float]:
    """Whether two copies that `replicas_agree` are close enough to confirm each other
    (cosine at least AGREE_COSINE), and their cosine."""
    cos = cosine(a, b) or 0.0
    return cos >= AGREE_COSINE, cos


# Two uploads this close are one Δ twice: training the same unit twice on a CPU is
# bit-identical (the CPU path is bit-reproducible), and a colluder copies its partner's.
IDENTICAL_COSINE = 1 - 1e-6
IDENTICAL_NORM_RATIO = 1 + 1e-6


@dataclass(frozen=True)
class ReplicaEvidence:
    """What is known of one copy of a replicated unit besides its Δ."""

    score: Score | None = None
    cosine: float | None = None  # with the module's outer momentum
    sha256: str = ""


@dataclass(frozen=True)
class ReplicaOutcome:
    """How a replica pair is settled. `kind`: "agree" (each confirms the other),
    "identical" (one Δ twice: neither confirms the other, the other checks alone judge
    both), "disagree" (`loser`, 0 the original or 1 the check copy, is refused; never
    both), "unsettled" (they disagree and nothing tells which is right: neither refused,
    neither confirmed) or "doubtful" (within the tolerance, but not close enough to confirm
    each other, AGREE_COSINE: neither refused, neither confirmed, both workers audited
    until a conclusive agreement)."""

    kind: str
    loser: int | None = None
    why: str = ""


def settle_replicas(
    original: Tensors,
    check: Tensors,
    cfg: OuterConfig,
    evidence: tuple[ReplicaEvidence, ReplicaEvidence] = (ReplicaEvidence(), ReplicaEvidence()),
    repeated: str = "",
) -> ReplicaOutcome:
    """Two workers' Δs of one unit, settled by evidence (never by who was first).

    Identical Δs prove nothing: an honest pair on deterministic CPUs computes the same
    bytes, and so does a colluder copying its partner, so identity is neither agreement
    nor disagreement. A disagreement rejects only the copy the evidence finds worse: the
    smaller proof-of-useful-work gain on the unit's own windows (both copies start from the
    same base on the same windows, so their gains compare directly: the gain a majority of
    the windows reach, as the proof of useful work reads it; ties go to the lower
    held-out loss), else the lower cosine with the module's outer momentum. Rejecting both
    let one dishonest copy take an honest original down with it. `repeated`: why the pair
    disagrees however close it is (rounds.verification.persistence: one copy differs from
    the other where that worker's copies differed before), else "".
    """
    a, b = evidence
    if a.sha256 and a.sha256 == b.sha256:
        return ReplicaOutcome("identical", why="byte-identical uploads")
    na, nb = _norm(original), _norm(check)
    same_norm = na > 0 and nb > 0 and max(na, nb) / min(na, nb) <= IDENTICAL_NORM_RATIO
    if same_norm and (cosine(original, check) or 0.0) >= IDENTICAL_COSINE:
        return ReplicaOutcome("identical", why="the same Δ within float rounding")
    agree, why = replicas_agree(original, check, cfg)
    if agree and not repeated:
        close, cos = conclusive(original, check)
        if close:
            return ReplicaOutcome("agree")
        return ReplicaOutcome(
            "doubtful",
            why=f"cosine {cos:.3f} is within the tolerance but below {AGREE_COSINE:g}, the "
            "closeness of two honest copies (a fixed direction of half the Δ's norm added to "
            "one of them is this far)",
        )
    why = why or repeated
    if a.score is not None and b.score is not None:
        key_a = (a.score.relative_gain, -a.score.heldout_after)
        key_b = (b.score.relative_gain, -b.score.heldout_after)
        if key_a != key_b:
            loser = 0 if key_a < key_b else 1
            worse, better = (a.score, b.score) if loser == 0 else (b.score, a.score)
            return ReplicaOutcome(
                "disagree",
                loser,
                f"{why}; applied alone it lowers the loss of most of its unit's scored "
                f"windows by {worse.relative_gain:.2%}, the other copy by "
                f"{better.relative_gain:.2%}",
            )
    if a.cosine is not None and b.cosine is not None and a.cosine != b.cosine:
        loser = 0 if a.cosine < b.cosine else 1
        worse_cos, better_cos = sorted((a.cosine, b.cosine))
        return ReplicaOutcome(
            "disagree",
            loser,
            f"{why}; its cosine with the module's outer momentum is {worse_cos:.3f}, the "
            f"other copy's {better_cos:.3f}",
        )
    return ReplicaOutcome("unsettled", why=why)


def held_no_gain(
    reasons: tuple[str, str],
    scores: tuple[Score | None, Score | None],
    original: Tensors,
    check: Tensors,
    cfg: OuterConfig,
    *,
    identical: bool = False,
) -> str:
    """Two workers' copies of one unit, each refused for no gain alone: the reason both get
    instead when they agree (or are one Δ twice) and neither raised the unit's training
    loss by more than ``score_min_gain`` (a fraction of it), else "".

    Then the unit's windows bought nothing from its base this round, and two workers saw
    it: 25 honest steps on ordinary Python windows moved its loss from 6.6748 to 6.6901
    (bench/attacks_live.py, a seed-2 unit: the same numbers in two figures), and both
    copies were refused and their workers' trust cut for it. A held Δ is never aggregated,
    so colluders who agree on a useless Δ gain nothing by it: no step, no credit, no
    probation evidence. The band keeps flips refused: the flip of a Δ that gains g raises
    the loss by about g or more (to first order, and the loss is convex along the line),
    so two copies of one flipped useful Δ are refused and cost their workers' trust as
    before; against the outer momentum a flip is refused for its direction first.
    `identical`: the two uploads' sha256s match.
    """
    if not all(r.startswith(f"{NO_GAIN}:") for r in reasons):
        return ""
    for s in scores:
        # Neither raised the loss of most of the windows by more than score_min_gain.
        if s is None or not s.relative_gain >= -cfg.score_min_gain:
            return ""
    if not identical and not replicas_agree(original, check, cfg)[0]:
        return ""
    return (
        f"{AGREED_NO_GAIN}: held: two workers' copies of its unit agree and neither moves "
        f"the loss on the unit's training windows by more than {cfg.score_min_gain:.1%} "
        "(its data bought nothing from this base); left out of the step, neither credited "
        "nor counted against either worker. Nothing to change"
    )


def _norm(delta: Tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))


def useful_fraction(
    score: Score | None, work: float, peers: Sequence[tuple[Score, float]]
) -> float:
    """The share of a unit's claimed tokens that its verified work earns, 0..1 (a claim alone earns nothing).

    Measured by proof of useful work: the Δ's relative gain on its own windows per unit of
    work it claims (`work`, the fraction of a whole unit's tokens), against the median of
    the same for `peers` (the round's other accepted units, (score, work) each): every
    unit of a round starts from the same versions, so an honest one buys about the same
    gain per token. A Δ scaled to a tenth buys a fraction of the gain and so of the credit;
    claiming fewer tokens raises the rate but the credit is capped at the tokens claimed.
    Without a score or a peer there is nothing to measure against: 1.
    """
    if score is None or not peers:
        return 1.0
    reference = statistics.median(_gain_rate(s, w) for s, w in peers)
    if not reference > 0:
        return 1.0
    return min(1.0, max(0.0, _gain_rate(score, work) / reference))


def _gain_rate(score: Score, work: float) -> float:
    return score.relative_gain / max(work, 1e-6)


# Before a module's first step it has no history and no momentum, and a sign flip of a
# Δ trained from a fresh start still lowers its own unit's loss (measured: 9.04 -> 7.25
# against 6.73 for the honest Δ). What holds then is the round's other Δs through the
# module: trained from the same versions, honest ones point the same way. Unrelated Δs sit
# near 0 (random directions: |cosine| ~ 1/√values), so the bar sits below it: only a Δ
# that points against its peers is refused.
PEER_MIN_COSINE = -0.1


def peer_refusals(
    cosines: Mapping[tuple[int, int], float | None], rates: Mapping[int, float | None]
) -> dict[int, str]:
    """{key: "<code>: <message>"} for the Δs of a module's first step that point against
    most of the others (cosine below PEER_MIN_COSINE with more than half of them). Two Δs
    are symmetric: the one with the lower gain per token (`rates`, `gain_rate`) is
    refused, or neither without both rates. When half of the Δs or more would be refused,
    none is: nothing tells which side is right, and the checks of later rounds (history,
    momentum) still hold. `cosines`: (a, b) -> cos(Δa, Δb) for every pair of the Δs
    (`pairwise_cosines`)."""
    keys = sorted({k for pair in cosines for k in pair})
    if len(keys) < 2:
        return {}
    against: dict[int, int] = dict.fromkeys(keys, 0)
    for (a, b), cos in cosines.items():
        if cos is not None and cos < PEER_MIN_COSINE:
            against[a] += 1
            against[b] += 1
    if len(keys) == 2:
        a, b = keys
        ra, rb = rates.get(a), rates.get(b)
        if not against[a] or ra is None or rb is None or ra == rb:
            return {}
        low = {a if ra < rb else b}
        why = "points against the other Δ through it and buys less gain per token"
    else:
        low = {k for k, n in against.items() if 2 * n > len(keys) - 1}
        if 2 * len(low) >= len(keys):
            return {}
        why = "points against most of the other Δs through it"
    return {
        k: f"{PEER}: in the module's first step (no history yet) it {why} "
        f"(cosine below {PEER_MIN_COSINE:g})"
        for k in low
    }


def pairwise_cosines(deltas: Mapping[int, Tensors]) -> dict[tuple[int, int], float | None]:
    """cos(Δa, Δb) for every pair of `deltas`, as `peer_refusals` takes them."""
    keys = list(deltas)
    return {(a, b): cosine(deltas[a], deltas[b]) for n, a in enumerate(keys) for b in keys[n + 1 :]}


def gain_rate(score: Score | None, work: float) -> float | None:
    """A score's relative gain on its unit's windows per unit of work claimed."""
    if score is None:
        return None
    return _gain_rate(score, work)


# --- proof of useful work ------------------------------------------------------------------


def _loss(model: nn.Module, windows: Tensor) -> float:
    return mean_loss(model, windows)  # no_grad, eval mode


def _window_losses(model: nn.Module, windows: Tensor) -> tuple[float, ...]:
    return tuple(float(x) for x in window_losses(model, windows))  # no_grad, eval mode


def score_delta(
    config: RunConfig,
    p: int,
    model: nn.Module,
    modules: Mapping[str, Tensors],
    deltas: Mapping[str, Tensors],
    train: Tensor,
    heldout: Tensor,
    before: BaseLosses | None = None,
) -> Score:
    """Path p's losses on `train` and `heldout` windows with its base `modules`, then with
    the unit's Δ applied alone: each module in `deltas` replaced by base - Δ, as an outer
    step of lr 1 with that unit as its only contribution would. `deltas` holds every
    module the unit trained (its Δ is one thing: a level module's part alone is no
    measure of the work). `before` reuses the base losses of an earlier unit of the same
    path, base and windows (`base_losses`, or that unit's `Score.base`), so each further
    unit costs two forward passes. Each training window's loss is kept: `Score.train_gain`
    is the gain a majority of them reach (dipaco.data.scored.majority_gain).
    """
    clock = time.perf_counter()
    if before is None:
        before = base_losses(config, p, model, modules, train, heldout)
    shifted = dict(modules)
    for module_id, delta in deltas.items():
        base = modules[module_id]
        shifted[module_id] = {n: base[n] - delta[n].to(base[n].dtype) for n in base}
    model.load_state_dict(assemble_path_state(config, p, shifted))
    train_after, heldout_after = _window_losses(model, train), _loss(model, heldout)
    return Score(
        before.train_mean,
        statistics.fmean(train_after) if train_after else math.nan,
        before.heldout,
        heldout_after,
        time.perf_counter() - clock,
        train_gain=majority_gain(before.train, train_after),
        base=before,
    )


def base_losses(
    config: RunConfig,
    p: int,
    model: nn.Module,
    modules: Mapping[str, Tensors],
    train: Tensor,
    heldout: Tensor,
) -> BaseLosses:
    """Path p's losses with its base modules: each training window's, the held-out mean."""
    model.load_state_dict(assemble_path_state(config, p, modules))
    return BaseLosses(_window_losses(model, train), _loss(model, heldout))
