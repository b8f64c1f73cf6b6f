"""A first round colluders cannot win: the round where modules take their first step,
settled over whole units (docs/design.md §7).

Before a module's first step it has no history and no momentum, and from a fresh start a
sign-flipped Δ still lowers its own unit's loss (measured on the 2x2 tiny config, 25 inner
steps, seed 0: a unit's training windows 9.03 -> 6.27 honest, -> 8.39 flipped; on another
path 9.03 -> 6.56 against -> 6.96), so the proof of useful work passes it. The module's own
peers (rules.peer_refusals) settle a minority; two colluders out of four make a tie, and
where both colluders' paths share a module, that module sees no dispute at all. So the
round is settled once, over units: two units are *against* each other when their Δs, over
every module they share, have a cosine below rules.PEER_MIN_COSINE (honest Δs from one
start point the same way; unrelated ones sit near 0). Every module's first step then
applies the same verdict to its Δs, so a unit is refused everywhere or nowhere.

The evidence, in order (`settle`):

1. **a third copy** (`_third_copies`, first): two copies of one unit that point against
   each other were trained on the same windows from the same versions, so the one that
   buys less gain there is wrong (a referee's copy always wins); it is refused and takes
   no part in what follows. Probation replicates every newcomer's units, so in a fresh
   run's first round most units have a second copy.
2. **a trusted referee**: a copy trained by one of the operator's trusted machines
   (workers.probation). Units against a referee's copy are refused.
3. **the majority**: units against the best-scoring unit (its gain per token on its own
   windows, rules.gain_rate; without scores, the unit fewest others point against) that
   are fewer than the units with it are refused.
4. **gain per token**, for a tie or worse: from a fresh start an honest Δ buys more gain
   per token than a flipped one. The side whose median gain per token is below
   `TIE_SHARE` x the other side's is refused. Measured (the same config, seeds 0-2, twelve
   units, each trained once and applied as trained and flipped): honest units lower their
   windows' loss by 0.254-0.339 of it, flipped ones by -0.081-0.229; two flipped paths'
   median against the other two paths' honest median, 0.64-0.69 in each seed. Held-out
   windows are no such measure there: on one path the flipped Δ lowered the held-out loss
   more than the honest one (9.02 -> 7.92 against -> 8.16), so the unit's own windows are
   used, as rules.gain_rate does.
5. Nothing decides: both sides' units are held (`UNSETTLED`), neither accepted nor
   counted against their workers' trust, and every module with a held Δ waits: its step
   settles none of its Δs, keeps its version, and keeps them all (`WAITING` for those not
   disputed) for the next round's step, whose settlement sees them with that round's
   units (more units, copies, gains: evidence). A Δ kept is relative to the version the
   module still has, so it aggregates with the next round's as if trained then. In a
   phase's last round there is no next step: the held units are left out and the module
   steps with the rest (outer.step).

Pure functions without Django: bench/attacks.py runs the same rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dipaco_server.rounds.verification import rules

TIE_SHARE = 0.8
AGAINST = "first_round_against"  # refused: the evidence found its side wrong
UNSETTLED = "first_round_unsettled"  # held: nothing decided (weak: no trust lost)
WAITING = "first_round_waiting"  # not disputed, kept with its module's held Δs
KEPT = (UNSETTLED, WAITING)  # the codes of a pending Δ kept for the next round's step


@dataclass(frozen=True)
class UnitFacts:
    """What the settlement knows of one trained copy of a unit (a lease)."""

    worker: int
    rate: float | None  # rules.gain_rate: relative gain on its windows per unit of work
    referee: bool = False  # trained by one of the operator's trusted machines


def against_pairs(cosines: Mapping[tuple[int, int], float | None]) -> set[tuple[int, int]]:
    """The pairs of units whose Δs point against each other."""
    return {
        pair for pair, cos in cosines.items() if cos is not None and cos < rules.PEER_MIN_COSINE
    }


def settle(
    units: Mapping[int, UnitFacts],
    cosines: Mapping[tuple[int, int], float | None],
    copies: Sequence[tuple[int, int]] = (),
) -> dict[int, str]:
    """{unit key: "<code>: <message>"} for every unit the first round refuses or holds.
    `cosines`: (a, b) -> the cosine of the two units' Δs over the modules they share,
    None where they share none; `copies`: (original, check copy) per replicated unit."""
    against = against_pairs(cosines)
    if not against:
        return {}
    out = _third_copies(units, against, copies)
    rest = {k: u for k, u in units.items() if k not in out}
    return {**out, **_sides(rest, against)}


def _third_copies(
    units: Mapping[int, UnitFacts],
    against: set[tuple[int, int]],
    copies: Sequence[tuple[int, int]],
) -> dict[int, str]:
    """Two copies of one unit that point against each other: trained on the same windows
    from the same versions, the one with the smaller gain is wrong (a referee's copy wins)."""
    out = {}
    for a, b in copies:
        if (a, b) not in against and (b, a) not in against:
            continue
        ua, ub = units.get(a), units.get(b)
        if ua is None or ub is None or (ua.referee == ub.referee and (ua.rate == ub.rate)):
            continue
        if ua.referee != ub.referee:
            loser = b if ua.referee else a
        elif ua.rate is None or ub.rate is None:
            continue
        else:
            loser = a if ua.rate < ub.rate else b
        out[loser] = (
            f"{AGAINST}: its copy of a unit points against another worker's copy of the same "
            "unit, which buys more gain on the same windows"
            + (" (a trusted referee's)" if units[a if loser == b else b].referee else "")
        )
    return out


def _sides(units: Mapping[int, UnitFacts], against: set[tuple[int, int]]) -> dict[int, str]:
    """The referee, the majority, gain per token, else held (the module docstring)."""
    foes: dict[int, set[int]] = {k: set() for k in units}
    for a, b in against:
        if a in foes and b in foes:
            foes[a].add(b)
            foes[b].add(a)
    referees = [k for k, u in units.items() if u.referee]
    if referees:
        refused = {k for k in units if not units[k].referee and foes[k] & set(referees)}
        return {k: f"{AGAINST}: its Δs point against a trusted referee's copy" for k in refused}
    rated = [k for k, u in units.items() if u.rate is not None]
    if rated:
        best = max(rated, key=lambda k: (units[k].rate, -k))  # type: ignore[arg-type,return-value]
    else:  # no score: the unit fewest others point against
        best = min(units, key=lambda k: (len(foes[k]), k))
    side_x = {k for k in units if best in foes[k]}
    if not side_x:  # the disputes leave the best unit out: each module's peers judge them
        return {}
    side_h = {k for k in units if k not in side_x and not foes[k] & {best}}
    if len(side_x) < len(side_h):
        why = "its Δs point against most of the round's units"
        return {k: f"{AGAINST}: {why}" for k in side_x}
    rate_x, rate_h = _median_rate(units, side_x), _median_rate(units, side_h)
    if rate_x is not None and rate_h is not None and rate_x < TIE_SHARE * rate_h:
        return {
            k: f"{AGAINST}: its side of a tie buys {rate_x:.3g} of its loss per unit of work "
            f"on its own windows, the other side {rate_h:.3g} (below {TIE_SHARE:g} x)"
            for k in side_x
        }
    return _held(side_x | side_h)


def _median_rate(units: Mapping[int, UnitFacts], keys: set[int]) -> float | None:
    rates = [units[k].rate for k in keys if units[k].rate is not None]
    return statistics.median(rates) if rates else None  # type: ignore[type-var]


def _held(keys: object) -> dict[int, str]:
    return {
        k: f"{UNSETTLED}: its Δs point against other units' in the round where modules take "
        "their first step, and no evidence (a referee, a majority, gain per token) decided "
        "which side is right"
        for k in keys  # type: ignore[attr-defined]
    }
