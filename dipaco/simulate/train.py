"""DiPaCo (and DiLoCo, its 1x1 case) in one process, on the same library calls as the platform.

One outer round, as the server runs it (docs/design.md §4):
1. every (path p, replica r) unit assembles path p from the current modules and trains H
   AdamW steps (dipaco.inner.train_path) on its own window of p's training stream;
2. each module's Δ is encoded with the run's codec (dipaco.codecs) and decoded again
   exactly as the server would, so int8/int4 rounding reaches the outer step;
3. per module, the token-weighted aggregate over every unit of every path through it, the
   √(paths) rescale, and the Nesterov outer step (dipaco.outer);
4. with ``comm.download_codec`` int8 or fp16, the step is published as an encoded update
   (error feedback on the server's side) and every module becomes its old weights plus
   exactly the decoded update: what a worker holding the previous version rebuilds.

Bytes are counted as they travel: each unit uploads its encoded Δs; it downloads its
path's modules in fp32 in round 0 and, with a download codec, only the encoded updates
after that (its worker holds the version before).

Each (path, replica) keeps its inner AdamW state from round to round (train_path takes
and returns it, as the worker agent keeps one per (run, path)), and with it the codec's
error-feedback residual. The inner lr schedule is run-long (warm-up once, cosine over
T·H steps); the outer lr and momentum follow dipaco.outer.outer_lr (its warm-up rounds) and
dipaco.outer.round_momentum (none in the first round from the base model).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dipaco import codecs
from dipaco.config import RunConfig, eager_rebase_step
from dipaco.data.rows import rows_per_chunk
from dipaco.data.shards import token_dtype
from dipaco.data.windows import path_seed, unit_start
from dipaco.evaluate import PathLoss, ValWindows, evaluate_model, routed_mean
from dipaco.inner import InnerResult, InnerState, PathTrainer, StepMetrics, path_shift, train_path
from dipaco.model import build_model
from dipaco.modular import (
    assemble_path_state,
    init_modules,
    init_modules_from_base,
    module_ids,
    module_spec,
    modules_of_path,
)
from dipaco.outer import aggregate, outer_lr, outer_step, round_momentum
from dipaco.simulate.prepare import PreparedData, ShardSource
from dipaco.updates import apply_update, publish_update

__all__ = [
    "DipacoRun",
    "RoundRecord",
    "apply_update",  # dipaco.updates's, re-exported
    "evaluate_paths",
    "publish_update",  # dipaco.updates's, re-exported
    "train_dipaco",
    "training_sources",
]

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
    modules: Modules = field(default_factory=dict)  # every module after the last round


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
    per_chunk = rows_per_chunk(config, token_dtype(config.model.vocab_size).itemsize)
    return [
        data.train_source(p, seq_len, path_seed(config, p), per_chunk)
        for p in range(config.num_paths)
    ]


def evaluate_paths(
    config: RunConfig, modules: Modules, windows: ValWindows, device: torch.device | str = "cpu"
) -> list[PathLoss]:
    """Every path, assembled from `modules`, on its own validation windows, in fp32 on
    `device` (a simulation on a GPU scores there: on the CPU one evaluation of 16 paths of
    8.5M parameters takes about a minute)."""
    model: nn.Module = build_model(config.model, config.seed)
    model.to(device)
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
    published: dict[str, dict[str, Tensor]] | None = None,
    *,
    trained_start: bool = False,
) -> dict[str, int]:
    """Aggregate each module's encoded (path, Δ, tokens) and take its outer step (in place).

    With ``comm.download_codec`` other than fp32 the step is published as an encoded
    update (`publish_update`), and the module becomes its old weights plus exactly the
    decoded update, as on the platform; `published` keeps each module's error-feedback
    residual between rounds. Returns the encoded update's bytes per stepped module.
    """
    lr = outer_lr(config.outer, round_index)
    mu = round_momentum(config.outer, round_index, trained_start=trained_start)
    sizes: dict[str, int] = {}
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
        old = modules[module_id]
        new, momentum[module_id] = outer_step(
            old, delta, momentum.get(module_id), config.outer, lr=lr, mu=mu
        )
        if config.comm.download_codec == "fp32":
            modules[module_id] = new
            sizes[module_id] = sum(4 * t.numel() for t in new.values())
            continue
        residual = (published or {}).get(module_id)
        modules[module_id], data, kept = publish_update(
            old,
            new,
            config.comm.download_codec,
            residual,
            block_size=config.comm.block_size,
            compression=config.comm.compression,
        )
        sizes[module_id] = len(data)
        if published is not None:
            published[module_id] = kept
    return sizes


def _eager(
    config: RunConfig, p: int, old: Modules, new: Modules, eager_at: float | None
) -> Callable[[int], dict[str, Tensor] | None] | None:
    """`train_dipaco`'s eager correction for one unit of path p: after step
    ceil(eager_at x H), the shift from the version it trained from to the newest one."""
    if eager_at is None or old is new:
        return None
    at = eager_rebase_step(eager_at, config.inner.steps)

    def rebase(step: int) -> dict[str, Tensor] | None:
        if step != at:
            return None
        return path_shift(config, p, old, new)

    return rebase


def _eager_fraction(config: RunConfig, eager_at: float | None, eval_every: int) -> float | None:
    """`train_dipaco`'s arguments checked; the eager fraction it trains with (the config's
    under outer.overlap "eager" when none is given)."""
    if eager_at is not None and not 0 < eager_at <= 1:
        raise ValueError(f"eager_at = {eager_at}: a fraction of the unit's steps, in (0, 1]")
    if eval_every < 1:
        raise ValueError(f"eval_every = {eval_every}: validate every 1 or more rounds")
    if config.outer.overlap == "eager" and eager_at is None:
        return config.outer.eager_at
    return eager_at


def _train_unit(
    config: RunConfig,
    trainer: PathTrainer,
    unit: tuple[int, int, int],
    train_from: Modules,
    source: ShardSource,
    states: dict[tuple[int, int], InnerState],
    on_step: OnStep | None,
    rebase: Callable[[int], dict[str, Tensor] | None] | None,
    device: torch.device | str,
) -> tuple[InnerResult, list[tuple[str, bytes]]]:
    """Unit (path p, replica r, round t): trained from `train_from` with the replica's warm
    state (kept in `states`), and its Δs encoded as the worker uploads them."""
    p, r, t = unit
    label = f"round {t + 1}/{config.rounds} path {p} replica {r}"
    result = train_path(
        config,
        p,
        train_from,
        source,
        round_index=t,
        device=device,
        # Where the server starts unit (t, r) (dipaco.data.windows), so a platform
        # run reads the same windows; a path's stream wraps at its end.
        start_position=unit_start(config, t, r),
        on_step=None if on_step is None else _labelled(on_step, label),
        state=states.get((p, r)),
        rebase=rebase,
        trainer=trainer,
    )
    state = result.state or InnerState()
    deltas = list(codecs.encode_module_deltas(result.module_deltas, config.comm, state))
    states[(p, r)] = state
    return result, deltas


def _download_bytes(
    config: RunConfig, p: int, t: int, modules: Modules, update_bytes: Mapping[str, int]
) -> int:
    """What a unit of path p downloaded first: its modules whole in fp32 the first time;
    after that its worker (one per path and replica) holds the version before and fetches
    only the published update, in comm.download_codec."""
    ids = modules_of_path(config, p)
    if t == 0 or config.comm.download_codec == "fp32":
        return _fp32_bytes(modules, ids)
    return sum(update_bytes.get(m, 0) for m in ids)  # a module no step moved has no update


def train_dipaco(
    config: RunConfig,
    data: PreparedData,
    windows: ValWindows,
    *,
    on_step: OnStep | None = None,
    device: torch.device | str = "cpu",
    base_state: Mapping[str, Tensor] | None = None,
    eager_at: float | None = None,
    eval_every: int = 1,
) -> DipacoRun:
    """T outer rounds of P paths x R replicas; validation before training, after every
    `eval_every`-th round and after the last (`run.rounds` holds the validated rounds: on
    the CPU one validation of the 1,024-window sample costs about what a tiny path's round
    of training does, so a bench that needs only the final loss validates less often).

    Modules start from `base_state` (every module of a level equal) when given, else from
    the run's seeded initialisation. With ``outer.overlap`` "delayed", `eager_at` in (0, 1]
    models the eager correction: the version the previous round's step publishes lands
    after that fraction of each unit's steps, and the unit adds it to its live weights and
    rebases its Δ on it (dipaco.inner.run_inner_loop's `rebase`). ``outer.overlap`` "eager"
    is that with ``outer.eager_at`` (what the platform's agent does, worker_agent.rebase).
    """
    eager_at = _eager_fraction(config, eager_at, eval_every)
    started = time.perf_counter()
    sources = training_sources(config, data)
    modules: Modules = (
        init_modules(config) if base_state is None else init_modules_from_base(config, base_state)
    )
    momentum: Modules = {}
    losses = evaluate_paths(config, modules, windows, device)
    run = DipacoRun(rounds=[RoundRecord(0, losses, routed_mean(losses))])
    reps = config.replicas_per_path
    states: dict[tuple[int, int], InnerState] = {}  # warm AdamW (+ residual) per replica
    published: dict[str, dict[str, Tensor]] = {}  # the update's error feedback per module
    update_bytes: dict[str, int] = {}  # the last published update's size per module
    # outer.overlap "delayed" (or "eager"): round t's units train from the versions before round t - 1's
    # step (the latest published when round t opened, while that step ran), and round t's
    # step applies their Δs onto the versions round t - 1 published (staleness 1).
    previous: Modules = modules
    # One resident model for every unit (built, and compiled on CUDA, once): a unit loads
    # its path's weights and warm AdamW state into it, bit-identical to a fresh build.
    trainer = PathTrainer(config, device)
    for t in range(config.rounds):
        train_from = previous if config.outer.overlap != "none" else modules
        round_started = time.perf_counter()
        contributions: dict[str, list[tuple[int, bytes, int]]] = defaultdict(list)
        record = RoundRecord(t + 1, [], 0.0)
        last_losses = []
        for p in range(config.num_paths):
            for r in range(reps):
                rebase = _eager(config, p, train_from, modules, eager_at)
                result, deltas = _train_unit(
                    config, trainer, (p, r, t), train_from, sources[p], states, on_step, rebase,
                    device,
                )  # fmt: skip
                last_losses.append(result.losses[-1])
                for module_id, encoded in deltas:
                    contributions[module_id].append((p, encoded, result.tokens))
                    record.upload_bytes += len(encoded)
                record.download_bytes += _download_bytes(config, p, t, modules, update_bytes)
                run.tokens += result.tokens
                run.units += 1
        previous = dict(modules)  # _outer_round replaces each stepped module's dict
        update_bytes = _outer_round(
            config, modules, momentum, contributions, t, published,
            trained_start=base_state is not None,
        )  # fmt: skip
        record.train_loss = sum(last_losses) / len(last_losses)
        run.upload_bytes += record.upload_bytes
        run.download_bytes += record.download_bytes
        if (t + 1) % eval_every and t + 1 < config.rounds:
            continue  # not validated this round: its bytes count, it keeps no record
        record.paths = evaluate_paths(config, modules, windows, device)
        record.routed_loss = routed_mean(record.paths)
        record.seconds = time.perf_counter() - round_started
        run.rounds.append(record)
    run.seconds = time.perf_counter() - started
    run.modules = modules
    return run
