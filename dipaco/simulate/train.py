"""DiPaCo (and DiLoCo, its 1x1 case) in one process, on the same library calls as the platform.

One outer round, as the server runs it (DESIGN §4):
1. every (path p, replica r) unit assembles path p from the current modules and trains H
   AdamW steps (dipaco.inner.train_path) on its own window of p's training stream;
2. each module's Δ is encoded with the run's codec (dipaco.codecs) and decoded again
   exactly as the server would, so int8/int4 rounding reaches the outer step;
3. per module, the token-weighted aggregate over every unit of every path through it, the
   √(paths) rescale, and the Nesterov outer step (dipaco.outer).

Each (path, replica) keeps its inner AdamW state from round to round (train_path takes
and returns it, as the worker agent keeps one per (run, path)), and with it the codec's
error-feedback residual. The inner lr schedule is run-long (warm-up once, cosine over
T·H steps); the outer lr follows dipaco.outer.outer_lr (its warm-up rounds).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dipaco import codecs
from dipaco.config import RunConfig
from dipaco.data.windows import path_seed, unit_start
from dipaco.inner import InnerState, StepMetrics, train_path
from dipaco.model import build_model
from dipaco.modular import (
    assemble_path_state,
    init_modules,
    init_modules_from_base,
    module_ids,
    module_spec,
    modules_of_path,
)
from dipaco.outer import aggregate, outer_lr, outer_step
from dipaco.simulate.evaluate import PathLoss, ValWindows, evaluate_model, routed_mean
from dipaco.simulate.prepare import PreparedData, ShardSource

__all__ = ["DipacoRun", "RoundRecord", "evaluate_paths", "train_dipaco", "training_sources"]

OnStep = Callable[[str, StepMetrics], None]
Modules = dict[str, dict[str, Tensor]]


@dataclass
class RoundRecord:
    round: int  # 0: before any training; t: after outer step t
    paths: list[PathLoss]
    routed_loss: float
    train_loss: float | None = None  # mean last inner-step loss over the round's units
    upload_bytes: int = 0
    download_bytes: int = 0
    seconds: float = 0.0


@dataclass
class DipacoRun:
    rounds: list[RoundRecord] = field(default_factory=list)
    tokens: int = 0
    units: int = 0
    upload_bytes: int = 0
    download_bytes: int = 0
    seconds: float = 0.0


def training_sources(config: RunConfig, data: PreparedData) -> list[ShardSource]:
    """One training stream per path (DiLoCo's single path: every document, i.i.d.)."""
    if data.num_paths != config.num_paths:
        raise ValueError(f"data prepared for {data.num_paths} paths, config has {config.num_paths}")
    for p, tokens in enumerate(data.tokens("train")):
        if tokens <= config.model.seq_len:
            raise ValueError(
                f"path {p} has {tokens} training tokens, fewer than one window of "
                f"{config.model.seq_len + 1}; raise the budget (--max-docs) or use fewer paths"
            )
    seq_len = config.model.seq_len
    return [data.train_source(p, seq_len, path_seed(config, p)) for p in range(config.num_paths)]


def evaluate_paths(config: RunConfig, modules: Modules, windows: ValWindows) -> list[PathLoss]:
    """Every path, assembled from `modules`, on its own validation windows."""
    model = build_model(config.model, config.seed)
    losses = []
    for p in range(config.num_paths):
        model.load_state_dict(assemble_path_state(config, p, modules))
        losses.extend(evaluate_model(model, windows, [p]))
    return losses


def _labelled(on_step: OnStep, label: str) -> Callable[[StepMetrics], None]:
    return lambda metrics: on_step(label, metrics)


def _fp32_bytes(modules: Modules, ids: list[str]) -> int:
    return sum(4 * t.numel() for m in ids for t in modules[m].values())


def _outer_round(
    config: RunConfig,
    modules: Modules,
    momentum: Modules,
    contributions: dict[str, list[tuple[int, bytes, int]]],
    round_index: int,
) -> None:
    """Aggregate each module's encoded (path, Δ, tokens) and take its outer step (in place)."""
    lr = outer_lr(config.outer, round_index)
    for module_id in module_ids(config):
        encoded = contributions.get(module_id)
        if not encoded:
            continue  # no unit trained a path through it: the module keeps its weights
        spec = module_spec(config, module_id)
        decoded = ((codecs.decode(data, spec), tokens) for _, data, tokens in encoded)  # streamed
        delta = aggregate(
            decoded,
            config.outer,
            paths_through=len({p for p, _, _ in encoded}),  # the paths that contributed
            spec=spec,
        )
        modules[module_id], momentum[module_id] = outer_step(
            modules[module_id], delta, momentum.get(module_id), config.outer, lr=lr
        )


def train_dipaco(
    config: RunConfig,
    data: PreparedData,
    windows: ValWindows,
    *,
    on_step: OnStep | None = None,
    device: torch.device | str = "cpu",
    base_state: Mapping[str, Tensor] | None = None,
) -> DipacoRun:
    """T outer rounds of P paths x R replicas; validation before training and after each round.

    Modules start from `base_state` (every module of a level equal) when given, else from
    the run's seeded initialisation.
    """
    started = time.perf_counter()
    sources = training_sources(config, data)
    modules: Modules = (
        init_modules(config) if base_state is None else init_modules_from_base(config, base_state)
    )
    momentum: Modules = {}
    losses = evaluate_paths(config, modules, windows)
    run = DipacoRun(rounds=[RoundRecord(0, losses, routed_mean(losses))])
    reps = config.replicas_per_path
    states: dict[tuple[int, int], InnerState] = {}  # warm AdamW (+ residual) per replica
    for t in range(config.rounds):
        round_started = time.perf_counter()
        contributions: dict[str, list[tuple[int, bytes, int]]] = defaultdict(list)
        record = RoundRecord(t + 1, [], 0.0)
        last_losses = []
        for p in range(config.num_paths):
            for r in range(reps):
                label = f"round {t + 1}/{config.rounds} path {p} replica {r}"
                step_hook = None if on_step is None else _labelled(on_step, label)
                result = train_path(
                    config,
                    p,
                    modules,
                    sources[p],
                    round_index=t,
                    device=device,
                    # Where the server starts unit (t, r) (dipaco.data.windows), so a platform
                    # run reads the same windows; a path's stream wraps at its end.
                    start_position=unit_start(config, t, r),
                    on_step=step_hook,
                    state=states.get((p, r)),
                )
                last_losses.append(result.losses[-1])
                state = result.state or InnerState()
                for module_id, delta in result.module_deltas.items():
                    encoded, residual = codecs.encode_with_feedback(
                        delta,
                        config.comm.codec,
                        state.module_residual(module_id),
                        block_size=config.comm.block_size,
                    )
                    state.set_module_residual(module_id, residual)
                    contributions[module_id].append((p, encoded, result.tokens))
                    record.upload_bytes += len(encoded)
                states[(p, r)] = state
                # The unit first downloaded the path's modules, in fp32.
                record.download_bytes += _fp32_bytes(modules, modules_of_path(config, p))
                run.tokens += result.tokens
                run.units += 1
        _outer_round(config, modules, momentum, contributions, t)
        record.paths = evaluate_paths(config, modules, windows)
        record.routed_loss = routed_mean(record.paths)
        record.train_loss = sum(last_losses) / len(last_losses)
        record.seconds = time.perf_counter() - round_started
        run.upload_bytes += record.upload_bytes
        run.download_bytes += record.download_bytes
        run.rounds.append(record)
    run.seconds = time.perf_counter() - started
    return run
