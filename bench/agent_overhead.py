"""What the worker agent costs: its training path against the best bare PyTorch loop.

    .venv/bin/python bench/agent_overhead.py                          # tiny model, CPU
    python bench/agent_overhead.py --preset 150m --device cuda --batch 64 --steps 500
    .venv/bin/python bench/agent_overhead.py --e2e --rounds 3 --steps 40 # + utilisation
    .venv/bin/python bench/agent_overhead.py --e2e --overlap delayed       # outer.overlap
    .venv/bin/python bench/agent_overhead.py --e2e --overlap eager         # + its rebase

Both sides train the same Llama (dipaco.model.build_model, same seed) on the same
token window with the same batch (micro-batch x accumulation x sequence length), AdamW,
gradient clipping and (on CUDA) bf16 autocast. The *agent* side is exactly what
``dipaco-worker`` runs for a unit: the agent's resident trainer (dipaco.inner.ResidentTrainer:
a PathTrainer built and compiled once and kept across units) over the
token file (memory-mapped, as downloaded) read in the path's shuffled window order
(dipaco.data.windows), with warm inner state from a previous unit of the same path, the
agent's checkpoints by time (written in the background), a progress callback, the Δ split
and its encoding. The *bare* side is the best plain loop: on CUDA the model, head and loss
in one compiled function, fused AdamW, pinned non-blocking copies, no per-step sync, the
whole batch as one micro-batch when it fits; on the CPU the eager loop; it keeps no
checkpoint and reads an in-memory token tensor. ``--batch`` splits a step's
sequences into micro-batches as the worker fits them to the device (fit_micro_batch).

Reported after one untimed warm-up run of each (``--warmup-steps``; compiling happens
there): the median over ``--repeats`` of the ratio of an agent run to the bare run next to
it in time (the order alternates), and on the CPU the same ratio by process CPU time,
which another program's load disturbs far less:
- **inner tokens/s**: wall time of steps 2..H on each side (synchronised at both ends;
  the agent's includes its per-step callback, stop checks and data reads); the ratio is
  the overhead of the agent's inner-loop path (goal >= 0.98);
- **unit tokens/s**: the same tokens over the agent's whole unit (weights and warm state
  into the resident model, training, checkpoints, Δ split, its encoding and the path's
  state kept; the last checkpoint is written meanwhile); it depends on H and the batch,
  since the fixed costs are paid once per unit;
- **MFU** of each (dipaco.flops: the PaLM FLOPs count per token and the device's dense
  bf16 peak, both in the JSON), the per-unit **fixed cost** (seconds outside its steps,
  and by part in ``fixed_cost_parts``: loading, the first step's excess, the final
  snapshot, Δ and moments from it, the split, encoding, saving the state, the wait for
  the final write left after encoding, the rest),
  the **checkpoint's blocking time**, and **peak GPU memory** against
  dipaco.config.estimate_path_memory.

With ``--e2e`` it also measures **utilisation** end to end: a real ``dipaco server``
(embedded mode: SQLite, filesystem broker, local blobs, a Celery worker for the outer
steps) on loopback, a tiny 2x2-path run prepared by the server's own `prepare_run`
(stdlib corpus), and one ``dipaco-worker`` process that does every unit of ``--rounds``
rounds. Utilisation is the worker's training seconds (the sum of its units'
``train_seconds``) over the wall seconds from its first lease to its last completion;
the rest is fetching, encoding, uploading, completing, and waiting for outer steps
(goal >= 0.97: a volunteer's GPU trains almost all the time). ``--overlap delayed`` runs it with one-step-delayed outer steps
(outer.overlap): the next round opens as soon as one closes, so the worker does not wait
for outer steps; its quality cost is bench/overlap_quality.py's. ``--overlap eager`` adds
the eager correction: each unit of an overlapped round waits at step ceil(0.1 H) for the
previous round's versions and rebases onto them (worker_agent.rebase); that wait counts
against utilisation (``rebase_wait_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from agent_e2e import end_to_end  # bench/agent_e2e.py: the --e2e part
from rich.console import Console
from rich.table import Table

from dipaco.config import (
    GiB,
    OuterConfig,
    RunConfig,
)
from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource
from dipaco.flops import flops_per_token, mfu, peak_flops
from dipaco.inner import (
    DEFAULT_CHECKPOINT_INTERVAL_S,
    ResidentTrainer,
    StepMetrics,
    UnitHooks,
    UnitWork,
    fit_micro_batch,
    lr_at,
)
from dipaco.inner.fit import path_memory
from dipaco.model import build_model
from dipaco.modular import init_modules
from worker_agent.payload import encode_deltas
from worker_agent.progress import Reporter
from worker_agent.state import InnerStates


def preset(name: str, steps: int, micro: int | None, accum: int) -> RunConfig:
    if name == "tiny":  # RunConfig.tiny: 2.8M parameters, sequences of 128
        return RunConfig.tiny(
            rounds=100, inner={"steps": steps, "micro_batch_size": micro or 4,
                               "grad_accum_steps": accum, "warmup_steps": 2},
        )  # fmt: skip
    if name == "150m":  # the papers' 150M path: 12 blocks of width 896, sequences of 1024
        return RunConfig.paper_150m(
            inner={"steps": steps, "micro_batch_size": micro or 8, "grad_accum_steps": accum,
                   "warmup_steps": 2},
        )  # fmt: skip
    raise SystemExit(f"unknown preset {name!r}: tiny or 150m")


def with_batch(config: RunConfig, batch: int, device: torch.device, compiled: bool) -> RunConfig:
    """`batch` sequences per step, split into micro-batches as the worker splits them:
    fit_micro_batch against the device's free memory (the whole batch on the CPU), the
    compiled loss's whole logits counted."""
    inner = config.inner.model_copy(update={"micro_batch_size": batch, "grad_accum_steps": 1})
    config = config.model_copy(update={"inner": inner})
    budget = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    fitted = fit_micro_batch(config, budget, device.type, whole_logits=compiled)
    return config.model_copy(update={"inner": fitted})


def write_window(config: RunConfig, path: Path) -> None:
    tokens = config.inner.steps * config.inner.batch_size * config.model.seq_len + 1
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.model.vocab_size, tokens, dtype=np.int64)
    ids.astype("<u2" if config.model.vocab_size <= 2**16 else "<u4").tofile(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Rates = tuple[float, float]  # tokens/s by wall time, by CPU time


def now() -> tuple[float, float]:
    """(wall, this process's CPU) seconds: on a shared CPU the second is what a loop cost."""
    return time.perf_counter(), time.process_time()


def rates(tokens: int, first: tuple[float, float], last: tuple[float, float]) -> Rates:
    return tokens / (last[0] - first[0]), tokens / (last[1] - first[1])


def bare_loop(
    config: RunConfig, window: torch.Tensor, device: torch.device, *, compiled: bool
) -> Rates:
    """Tokens/s of a plain training loop over steps 2..H: the baseline.

    On CUDA the best plain loop (nanoGPT's and modded-nanogpt's): the model, its head and
    the cross-entropy in one `torch.compile`d function, fused AdamW, bf16 autocast, pinned
    non-blocking copies, no host synchronisation per step, and the whole batch as one
    micro-batch when the device holds it (`with_batch`). On the CPU (compiled False) the
    eager loop with AdamW's default, as the library runs there."""
    cfg, t = config.inner, config.model.seq_len
    model, loss_fn = _bare_model(config, device, compiled)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
        weight_decay=cfg.weight_decay, fused=device.type == "cuda",
    )  # fmt: skip
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    micro, sequence = cfg.micro_batch_size, 0
    pin = device.type == "cuda"
    started = now()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step, cfg.steps)
        for _ in range(cfg.grad_accum_steps):
            starts = (sequence + torch.arange(micro)) * t  # (B,)
            rows = window[starts[:, None] + torch.arange(t + 1)[None, :]]  # (B, T+1)
            if pin:
                rows = rows.pin_memory()
            rows = rows.to(device, non_blocking=True)
            sequence += micro
            with autocast:
                loss = loss_fn(rows[:, :-1], rows[:, 1:])
            (loss / cfg.grad_accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:  # steps 2..H are timed, as on the agent's side
            sync(device)
            started = now()
    sync(device)
    return rates((cfg.steps - 1) * cfg.batch_size * t, started, now())


_BARE: dict[tuple[str, str, bool], tuple[torch.nn.Module, Any]] = {}


def _bare_model(config: RunConfig, device: torch.device, compiled: bool) -> tuple[Any, Any]:
    """The bare loop's model and loss function, built (and compiled) once per bench run, as
    the agent's resident trainer is: each bare run after the first pays no compiling."""
    key = (config.model.model_dump_json(), str(device), compiled)
    if key not in _BARE:
        model = build_model(config.model, config.seed, device=device).train()
        vocab = config.model.vocab_size

        def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=inputs).logits  # (B, T, V)
            return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

        _BARE[key] = (model, torch.compile(loss_of) if compiled else loss_of)
    return _BARE[key]


@dataclass
class UnitFigures:
    inner: Rates  # tokens/s over steps 2..H
    unit: float  # tokens/s over the whole unit: training, the Δ, its encoding, the state
    fixed_cost_s: float  # the unit's seconds outside its steps: before step 1, after step H
    fixed_cost_parts: dict[str, float]  # fixed_cost_s by part (see agent_unit)
    checkpoint_block_s: float  # seconds the loop stood still for checkpoints
    checkpoints: int
    peak_memory_bytes: int


def agent_unit(
    config: RunConfig,
    window: Path,
    device: torch.device,
    work: Path,
    states: InnerStates,
    trainer: ResidentTrainer,
    checkpoint_interval_s: float,
) -> UnitFigures:
    """One unit as dipaco-worker does it: on its resident trainer, the path's warm state
    (resident after an accepted unit of the same path), the final checkpoint written while
    the Δ is encoded, then the state kept as an accepted completion keeps it."""
    reporter, stamps = Reporter(), []
    steps = config.inner.steps

    def on_step(metrics: StepMetrics) -> None:  # what the agent does after every step
        reporter.status(step=metrics.step, loss=metrics.loss, tokens_per_second=0.0)
        if metrics.step in (1, steps):  # the bench's own sync, to time steps 2..H
            sync(device)
        stamps.append(now())

    source = ShardSource.for_path(TokenShard(window, _dtype(config)), config, 0)
    unit = UnitWork(config, 1, 0, 1, init_modules(config), source)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    result, _ = trainer.train(
        unit, work_dir=work, state=states.load(1, 0, config), hooks=UnitHooks(on_step=on_step),
        checkpoint_interval_s=checkpoint_interval_s, finish_write=False,
    )  # fmt: skip
    trained = time.perf_counter()
    _, state = encode_deltas(result.module_deltas, config, work / "deltas", result.state)
    encoded = time.perf_counter()
    states.save(1, 0, state)  # what the agent keeps for the path's next unit, once accepted
    saved = time.perf_counter()
    result.checkpoint_written()  # the agent joins it before the unit's folder goes
    sync(device)
    wall = time.perf_counter() - started
    shutil.rmtree(work)  # each unit starts clean, as the agent's work dir does
    per_step = config.inner.batch_size * config.model.seq_len
    steps_s = stamps[-1][0] - stamps[0][0]  # steps 2..H
    step_s = steps_s / max(1, len(stamps) - 1)
    training_s = step_s * len(stamps)  # and step 1 at their mean
    timings = result.timings
    parts = {
        "load_s": timings.get("load_s", 0.0),  # weights and warm state into the resident model
        # the first step's excess over a step (the step's start and, cold, compiling)
        "first_step_excess_s": stamps[0][0] - started - timings.get("load_s", 0.0) - step_s,
        "final_snapshot_s": timings.get("final_snapshot_s", 0.0),
        "delta_and_moments_s": timings.get("delta_and_moments_s", 0.0),
        "split_s": timings.get("split_s", 0.0),
        "encode_s": encoded - trained,
        "state_save_s": saved - encoded,
        "final_write_wait_s": time.perf_counter() - saved,  # after encoding: what is left
    }
    parts["other_s"] = (wall - training_s) - sum(parts.values())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return UnitFigures(
        inner=rates(per_step * (len(stamps) - 1), stamps[0], stamps[-1]),
        unit=result.tokens / wall,
        fixed_cost_s=wall - training_s,
        fixed_cost_parts=parts,
        checkpoint_block_s=result.checkpoint_block_s,
        checkpoints=result.checkpoints,
        peak_memory_bytes=peak,
    )


def _dtype(config: RunConfig) -> str:
    return "<u2" if config.model.vocab_size <= 2**16 else "<u4"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="bench/gpu_check.sh runs it on a GPU with the issue's batch and H >= 500.",
    )
    add = parser.add_argument
    add("--preset", default="tiny", choices=["tiny", "150m"])
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--steps", type=int, default=20, help="H: inner steps per unit (the most, with "
        "--time-budget)")  # fmt: skip
    add("--micro-batch", type=int, help="sequences per micro-batch")
    add("--accum", type=int, default=1, help="micro-batches per step")
    add("--batch", type=int, help="sequences per step, split into micro-batches as the worker "
        "fits them to the device's free memory (overrides --micro-batch and --accum)")  # fmt: skip
    add("--warmup-steps", type=int, help="steps of the untimed warm-up run of each side "
        "(compiling, allocator, thread pools; default: H)")  # fmt: skip
    add("--time-budget", type=float, metavar="SECONDS", help="size H to what the measured "
        "runs can do in this many seconds from the bench's start, warm-up included, at the "
        "warm-up's speed (at most --steps; 'steps_sized' in the JSON)")  # fmt: skip
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the agent's loop and the bare loop (default: on CUDA only, as "
        "dipaco-worker); --no-compile measures both eager")  # fmt: skip
    add("--checkpoint-interval", type=float, default=DEFAULT_CHECKPOINT_INTERVAL_S,
        metavar="SECONDS", help="the agent's checkpoint interval (default %(default)s s, "
        "dipaco-worker's); shorter to measure a checkpoint's blocking time in a short unit")  # fmt: skip
    add("--repeats", type=int, default=3)
    add("--threads", type=int, help="torch CPU threads")
    add("--json", type=Path, help="also write the figures here")
    add("--e2e", action="store_true", help="also measure utilisation (minutes)")
    add("--rounds", type=int, default=3, help="--e2e: outer rounds")
    add("--overlap", choices=["none", "delayed", "eager"], default=OuterConfig().overlap,
        help="--e2e: the run's outer.overlap (default %(default)s, the run default)")  # fmt: skip
    add("--eager-at", type=float, help="--e2e with --overlap eager: outer.eager_at, the "
        "fraction of a unit's steps after which it waits for and rebases onto the previous "
        "round's versions (default: the run default, 0.1); later waits less when the outer "
        "step is long")  # fmt: skip
    add("--keep", type=Path, help="--e2e: copy the server log and the worker's events here")
    return parser.parse_args(argv)


def with_steps(config: RunConfig, steps: int) -> RunConfig:
    return config.model_copy(update={"inner": config.inner.model_copy(update={"steps": steps})})


def sized_steps(
    config: RunConfig, warm: tuple[Rates, UnitFigures], left_s: float, repeats: int
) -> int:
    """The most steps (up to H) that `repeats` pairs of runs can do in `left_s` seconds at
    the warm-up's speed, each unit also paying its fixed cost (less the warm-up's compiling,
    which is done)."""
    bare, unit = warm
    tokens = config.inner.batch_size * config.model.seq_len
    per_step = tokens / bare[0] + tokens / unit.inner[0]
    parts = unit.fixed_cost_parts
    fixed = sum(v for k, v in parts.items() if k != "first_step_excess_s")
    margin = 0.9  # the speed varies from run to run; the budget is a hard one
    steps = int((margin * left_s / repeats - fixed) / per_step)
    return max(2, min(config.inner.steps, steps))


def measure(
    args: argparse.Namespace, config: RunConfig, device: torch.device, compiled: bool
) -> tuple[RunConfig, list[Rates], list[UnitFigures]]:
    """A warm-up of each side, then `--repeats` adjacent (bare, agent) pairs, the order
    alternating so that neither side is always first; H sized to --time-budget if given."""
    started = time.monotonic()
    warm = with_steps(config, args.warmup_steps or config.inner.steps)
    trainer = ResidentTrainer(device, compile=compiled)  # the agent's, kept across units
    with tempfile.TemporaryDirectory(prefix="agent-overhead-") as tmp:
        root = Path(tmp)
        window_path = root / "window.bin"
        write_window(config, window_path)
        window = torch.from_numpy(np.fromfile(window_path, dtype=_dtype(config)).astype(np.int64))
        states, work = InnerStates(root / "inner"), root / "work"
        interval = args.checkpoint_interval
        # warm-up: compiling, allocator, kernels, thread pools; it also makes AdamW warm
        warm_bare = bare_loop(warm, window, device, compiled=compiled)
        warm_unit = agent_unit(warm, window_path, device, work, states, trainer, interval)
        if args.time_budget is not None:
            left = args.time_budget - (time.monotonic() - started)
            steps = sized_steps(config, (warm_bare, warm_unit), left, args.repeats)
            config = with_steps(config, steps)
        bare: list[Rates] = []
        units: list[UnitFigures] = []
        for repeat in range(args.repeats):
            if repeat % 2 == 0:
                bare.append(bare_loop(config, window, device, compiled=compiled))
            units.append(agent_unit(config, window_path, device, work, states, trainer, interval))
            if repeat % 2 == 1:
                bare.append(bare_loop(config, window, device, compiled=compiled))
    return config, bare, units


def figures_of(
    args: argparse.Namespace,
    config: RunConfig,
    device: torch.device,
    compiled: bool,
    measured: tuple[list[Rates], list[UnitFigures]],
) -> dict[str, Any]:
    """The figures of the runs: each repeat's agent run sits next to a bare run in time,
    and the median of those paired ratios cancels most of a shared machine's drifting
    load; the best-of figures follow."""
    bare, units = measured
    pairs = [
        (u.inner[0] / b[0], u.inner[1] / b[1], u.unit / b[0])
        for u, b in zip(units, bare, strict=True)
    ]
    ratio, ratio_cpu, unit_ratio = (statistics.median(p[k] for p in pairs) for k in range(3))
    cpu = device.type == "cpu"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    best = max(units, key=lambda u: u.unit)
    tokens = config.inner.steps * config.inner.batch_size * config.model.seq_len
    return {
        "preset": args.preset,
        "device": name,
        "threads": torch.get_num_threads(),
        "params": config.num_params(),
        "steps": config.inner.steps,
        "steps_sized": args.time_budget is not None,
        "batch": f"{config.inner.micro_batch_size} x {config.inner.grad_accum_steps} x "
        f"{config.model.seq_len}",
        "repeats": args.repeats,
        "compile": compiled,
        "bare_loop": "loss compiled, fused AdamW" if compiled else "eager",
        "bare_tokens_per_s": max(b[0] for b in bare),
        "agent_inner_tokens_per_s": max(u.inner[0] for u in units),
        "agent_unit_tokens_per_s": best.unit,
        "inner_ratio": ratio,
        "inner_ratio_cpu_time": ratio_cpu if cpu else None,
        "unit_ratio": unit_ratio,
        "pairs": pairs,
        # MFU: dipaco.flops (the PaLM count; the device's dense bf16 peak by its name)
        "flops_per_token": flops_per_token(config.model),
        "peak_flops": peak_flops(name),
        "bare_mfu": mfu(max(b[0] for b in bare), config.model, name),
        "agent_inner_mfu": mfu(max(u.inner[0] for u in units), config.model, name),
        "unit_mfu": mfu(best.unit, config.model, name),
        "fixed_cost_s": statistics.median(u.fixed_cost_s for u in units),
        # by part, the median over the repeats of each (so they need not add up exactly)
        "fixed_cost_parts": {
            key: statistics.median(u.fixed_cost_parts[key] for u in units)
            for key in units[0].fixed_cost_parts
        },
        "checkpoint_interval_s": args.checkpoint_interval,
        "checkpoints": best.checkpoints,
        "checkpoint_block_s": statistics.median(u.checkpoint_block_s for u in units),
        "unit_wall_s": tokens / best.unit,
        "peak_memory_bytes": max(u.peak_memory_bytes for u in units),
        "estimated_memory_bytes": path_memory(
            config, config.inner, device.type, whole_logits=compiled
        ),
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def print_figures(console: Console, figures: dict[str, Any]) -> None:
    cpu = figures["device"] == "cpu"
    table = Table(title=f"agent vs bare loop: {figures['preset']} ({figures['params'] / 1e6:.1f}M"
                  f" params), {figures['device']}, H={figures['steps']}, batch "
                  f"{figures['batch']}, {'compiled' if figures['compile'] else 'eager'}")  # fmt: skip
    for column in ("loop", "best tokens/s", "ratio to bare", "by CPU time", "MFU"):
        table.add_column(column, justify="right")
    by_cpu = (lambda r: f"{r:.3f}") if cpu else (lambda r: "-")
    share = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    table.add_row(f"bare loop ({figures['bare_loop']})", f"{figures['bare_tokens_per_s']:,.0f}",
                  "1.000", by_cpu(1.0), share(figures["bare_mfu"]))  # fmt: skip
    table.add_row("agent inner loop", f"{figures['agent_inner_tokens_per_s']:,.0f}",
                  f"{figures['inner_ratio']:.3f}", by_cpu(figures["inner_ratio_cpu_time"]),
                  share(figures["agent_inner_mfu"]))  # fmt: skip
    table.add_row("agent whole unit", f"{figures['agent_unit_tokens_per_s']:,.0f}",
                  f"{figures['unit_ratio']:.3f}", "", share(figures["unit_mfu"]))  # fmt: skip
    console.print(table)
    parts = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in figures["fixed_cost_parts"].items())
    console.print(
        f"ratios: median of {figures['repeats']} adjacent (agent, bare) pairs; per unit: fixed "
        f"cost {figures['fixed_cost_s']:.2f} s ({parts}), {figures['checkpoints']} "
        f"checkpoint(s) blocking {figures['checkpoint_block_s']:.3f} s; peak memory "
        f"{figures['peak_memory_bytes'] / GiB:.2f} GiB (estimate "
        f"{figures['estimated_memory_bytes'] / GiB:.2f}); threads {figures['threads']}; "
        f"load {figures['load']}"
    )


def write_json(path: Path, figures: dict[str, Any]) -> None:
    """The issues' keys first: end-to-end utilisation (with --e2e), the inner loop's and the
    whole unit's tokens/s against the bare loop, and the GPU check's figures."""
    e2e = figures.get("e2e")
    head = {
        "device": figures["device"],
        "params": figures["params"],
        "tokens_per_s": figures["agent_unit_tokens_per_s"],
        "mfu": figures["unit_mfu"],
        "utilisation": e2e["utilisation"] if e2e else None,
        "inner_vs_bare": figures["inner_ratio"],
        "unit_vs_bare": figures["unit_ratio"],
        "fixed_cost_s": figures["fixed_cost_s"],
        "fixed_cost_parts": figures["fixed_cost_parts"],
        "checkpoint_block_s": figures["checkpoint_block_s"],
        "peak_memory_gib": figures["peak_memory_bytes"] / GiB if figures["device"] != "cpu"
        else None,
        "estimated_memory_gib": figures["estimated_memory_bytes"] / GiB,
        "compile": figures["compile"],
    }  # fmt: skip
    command = " ".join([Path(sys.executable).name, *sys.argv])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**head, "command": command, **figures}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    compiled = device.type == "cuda" if args.compile is None else args.compile
    config = preset(args.preset, args.steps, args.micro_batch, args.accum)
    if args.batch:
        config = with_batch(config, args.batch, device, compiled)
    console = Console()
    config, bare, units = measure(args, config, device, compiled)
    figures = figures_of(args, config, device, compiled, (bare, units))
    print_figures(console, figures)
    if args.e2e:
        figures["e2e"] = e2e = end_to_end(
            args.rounds, args.steps, args.threads or 1, args.keep, args.overlap, args.eager_at
        )
        console.print(
            f"end to end: {e2e['units']} units over {e2e['rounds']} rounds, training "
            f"{e2e['train_s']:.1f} s of {e2e['wall_s']:.1f} s wall: utilisation "
            f"{e2e['utilisation']:.3f}; fetching {e2e['fetch_s']:.1f} s, between units "
            f"{e2e['between_units_s']:.1f} s ({e2e['idle_polls']} idle polls), the rest "
            f"{e2e['train_to_complete_s']:.1f} s (model build, checkpoints, encode, upload)"
        )
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
