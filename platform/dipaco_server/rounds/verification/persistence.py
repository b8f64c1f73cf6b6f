"""A fixed-direction bias, caught by what a worker's copy of a unit keeps adding round after
round (an attack each single round lets through).

An honest Δ plus the same vector every round, at half the Δ's norm, passes every check of
one round: its norm, its cosine with the momentum and its gain stay within what honest Δs
show. Nor does its deviation from the module's other Δs give it away: honest workers stay on
their path (warm AdamW moments), so their deviations repeat round over round as well
(bench/attacks.py's 2x2 run: the cosine of a worker's deviation with its earlier ones
0.14-0.65 honest, 0.27-0.66 for the biased worker; in a module with two contributors the two
deviations are exact opposites).

A check copy tells them apart: two workers train the same unit (same path, windows, base,
and both from fresh AdamW moments: the lease's `cold`, rounds.verification.replication), so
their Δs differ only by what differs between the two machines (nothing at all on two CPUs),
while a bias is the same vector whatever the unit, whoever checks it and whichever copy the
worker trains. Each compared pair's difference is kept, as a seeded count sketch (`SKETCH`
values), on both copies' contributions, signed from each side, with the other copy's
worker. When a worker's difference points where its earlier differences in the module
against *other* workers pointed (cosine with their mean direction at least
`REPEAT_COSINE`), and is not float rounding (at least `MIN_DIFFERENCE` x the smaller Δ's
norm), its copy is refused however close the two copies are. When both copies repeat, the
pair is a disagreement settled by evidence as any other
(rounds.verification.rules.settle_replicas).

Why other workers only: an honest worker paired with a biased one sees the bias mirrored,
so a partner's differences are no evidence about the worker. Why both copies train cold:
an original continuing its worker's warm moments differs from a cold copy by those
moments, which repeat round over round for the worker that holds them (the rule once had
to look only at differences in the other role, original against check copy, to stay clear
of them: measured in bench/attacks.py's 2x2 run, an honest worker's repeats reached cosine
0.43 within a role), and it made honest pairs differ by 3.1-9.6 x in norm (eight live
rounds, bench/attacks_live.py). Proof of useful work cannot settle a pair instead: a
random direction at half the Δ's norm moved a unit's gain less than honest noise did
(tests/test_replica_bias.py: 0.4552 biased, 0.4521 honest).

How much evidence (`MIN_PAST`, `MIN_PARTNERS`): at least two earlier differences, against
at least two distinct partners. One earlier copy is not evidence: a single difference
holds that partner's own deviation and the worker's warm moments as much as any bias, and
the live platform refused an honest worker on exactly that (eight rounds of four real
workers at the defaults, seed 1: its shared-module copy's difference had a cosine of 0.27
with its one earlier difference). The mean direction of differences against
several partners keeps what the worker adds every time (a bias) and averages the rest
away, as its cosine with a random part falls with the number of partners.

rounds.verification.checks applies it (compare_replicas); pure functions without Django,
so bench/attacks.py runs the same rule. The sketch's seed is fixed: a worker that knows it
could hide a bias in the sketch's null space (the difference's norm is exact). A worker
that is never checked, or only ever by one partner, gives no evidence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dipaco.modules_file import Spec

SKETCH = 1024  # values per sketch: cosines between sketches are within ~1/√SKETCH of the true
SKETCH_SEED = 34
SKETCH_CHUNK = 1 << 20  # values hashed at a time
PAST = 8  # a worker's earlier differences in a module held against a new one
MIN_PAST = 2  # earlier differences needed before a repeat is evidence (docstring)
MIN_PARTNERS = 2  # ...against this many distinct partners
REPEAT_COSINE = 0.2
MIN_DIFFERENCE = 0.05


def difference_sketch(
    a: Mapping[str, Tensor], b: Mapping[str, Tensor], spec: Spec
) -> tuple[Tensor, float]:
    """(count sketch of a - b, (SKETCH,) float64; the exact norm of a - b). Each value goes to
    a bucket with a sign, both drawn from one seeded generator in the spec's order, so every
    sketch of a module is the same linear map and cosines between sketches estimate the
    cosines between the differences."""
    generator = torch.Generator().manual_seed(SKETCH_SEED)
    out = torch.zeros(SKETCH, dtype=torch.float64)
    squares = 0.0
    for name in spec:
        flat = (a[name].double() - b[name].double()).reshape(-1)
        for start in range(0, flat.numel(), SKETCH_CHUNK):
            part = flat[start : start + SKETCH_CHUNK]
            buckets = torch.randint(SKETCH, (part.numel(),), generator=generator)
            signs = torch.randint(2, (part.numel(),), generator=generator).double().mul_(2).sub_(1)
            out.index_add_(0, buckets, part * signs)
            squares += float(part.pow(2).sum())
    return out, math.sqrt(squares)


def to_bytes(sketch: Tensor) -> bytes:
    return sketch.float().numpy().tobytes()


def from_bytes(data: bytes) -> Tensor:
    if len(data) != 4 * SKETCH:
        raise ValueError(f"a difference sketch holds {SKETCH} float32 values, not {len(data)} B")
    return torch.frombuffer(bytearray(data), dtype=torch.float32).double()


def repeat_cosine(now: Tensor, past: Sequence[Tensor]) -> float | None:
    """The cosine of `now` with the mean direction of `past` (each unit-normalised); None
    without a past or with zero vectors."""
    directions = [p / p.norm() for p in past if float(p.norm()) > 0]
    if not directions or float(now.norm()) == 0:
        return None
    mean = torch.stack(directions).sum(0)
    scale = float(now.norm() * mean.norm())
    return float(now @ mean) / scale if scale > 0 else None


def enough(past: Sequence[tuple[int, object]]) -> bool:
    """Whether earlier differences ((partner, sketch) each) are evidence: MIN_PAST of them,
    against MIN_PARTNERS distinct partners. Only the partners are read, so a caller that
    has not loaded the sketches passes None for them (replication.judged_agreement)."""
    return len(past) >= MIN_PAST and len({partner for partner, _ in past}) >= MIN_PARTNERS


def repeated(
    sides: Sequence[tuple[int, Tensor, Sequence[tuple[int, Tensor]]]],
    difference: float,
    smaller: float,
) -> list[str]:
    """Per copy of a pair, why its difference repeats what its worker's copies kept adding,
    or "": `sides` holds (worker, its signed difference sketch, its earlier ones in the
    module against other workers, each (partner, sketch)) per copy; `difference` the exact
    norm of the difference, `smaller` the smaller of the two Δs' norms. Without enough
    earlier differences (`enough`) nothing repeats."""
    out = []
    for worker, now, past in sides:
        cosine = repeat_cosine(now, [sketch for _, sketch in past]) if enough(past) else None
        small = smaller <= 0 or difference < MIN_DIFFERENCE * smaller  # float rounding
        if small or cosine is None or cosine < REPEAT_COSINE:
            out.append("")
        else:
            partners = len({partner for partner, _ in past})
            out.append(
                f"worker {worker}'s copy differs from the other by {difference / smaller:.2f} x "
                f"the Δ's norm, in the direction its {len(past)} earlier copies in this module "
                f"differed from {partners} other workers' (cosine {cosine:.2f} >= "
                f"{REPEAT_COSINE:g}): a fixed direction added to every unit"
            )
    return out
