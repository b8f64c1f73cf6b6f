"""The two phases of a run (docs/design.md §1), in one place: which rounds, config and rows each has.

A run with ``phase1`` set trains a dense DiLoCo model first and DiPaCo paths after:

    rounds 0 .. R1 - 1        phase 1: RunConfig.dense_phase (one level, one module,
                              phase1.replicas units per round), Module/Path rows phase=1
    (between)                 runs.between: embed, fit the router, shard, init modules
    rounds R1 .. R1 + T - 1   phase 2: the run's own config, Module/Path rows phase=2

Rounds are numbered across both phases (one Round table, one ``current_round``, one x axis
on the dashboard), and outer round t writes module version t + 1 in either phase. Workers
see each phase as a run of its own: a lease carries the phase's config and the round's
index within the phase (`local_round`), so the worker's lr schedule and module ids are
those of that config and the worker protocol is unchanged.

A run without ``phase1`` is phase 2 from round 0, as before.
"""

from __future__ import annotations

from dipaco.config import RunConfig

DENSE = 1  # Module.phase / Path.phase of phase 1
PATHS = 2


def first_round(config: RunConfig, phase: int = PATHS) -> int:
    """The global index of the phase's first round."""
    if phase == DENSE:
        return 0
    return config.phase1.rounds if config.phase1 is not None else 0


def round_phase(config: RunConfig, t: int) -> int:
    """The phase round t belongs to."""
    return DENSE if config.phase1 is not None and t < config.phase1.rounds else PATHS


def phase_config(config: RunConfig, phase: int) -> RunConfig:
    """The config a phase trains with: the dense DiLoCo config in phase 1, else the run's."""
    return config.dense_phase if phase == DENSE else config


def local_round(config: RunConfig, t: int) -> int:
    """Round t's index within its phase (what the phase's config and workers count)."""
    return t - first_round(config, round_phase(config, t))


def round_config(config: RunConfig, t: int) -> tuple[int, RunConfig]:
    """(phase, the phase's config) of round t."""
    phase = round_phase(config, t)
    return phase, phase_config(config, phase)


def overlaps(run_config: RunConfig, t: int) -> bool:
    """Whether round t + 1 opens as soon as round t starts closing (``outer.overlap``
    "delayed" or "eager"): not after a phase's last round or the run's, nor with
    ``eval.patience`` (early stopping after round t's evaluation decides which paths round
    t + 1 trains)."""
    phase, config = round_config(run_config, t)
    if config.outer.overlap == "none" or t + 1 >= run_config.total_rounds:
        return False
    return round_config(run_config, t + 1)[0] == phase and run_config.eval.patience is None
