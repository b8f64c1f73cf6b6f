"""One round's server work at a preset, from synthetic Δs and no workers, and what it projects
to for a 16x16 grid trained by 64 volunteers on a 16-core CPU-only server.

    .venv/bin/python bench/server_round.py --preset tiny --units 4 --json out.json
    .venv/bin/python bench/server_round.py --preset 150m --units 4 --cut-windows 256 \\
        --eval-windows 1 --score-units 1 --json out.json   # adds its preset to out.json
    .venv/bin/python bench/server_round.py --project-only --json out.json

Each of --units units (one per path, round-robin) gets a synthetic Δ per module of its path
(1e-3 x N(0, 1), encoded with the run's upload codec) in a local blob store (a temporary
directory), and each path a synthetic train and validation shard. Then the server's code
runs as its tasks do, timed stage by stage on one torch thread (a Celery pool process's
share of the cores):

- **data_cutting**: `rounds.protocol.unit_data.cut_unit` (ranged reads of the shard) of
  --cut-windows windows per unit (a whole unit is `unit_windows` windows: the per-window
  cost scales it in the projection);
- **score_load** and **scoring**: a unit's proof of useful work as its `score_unit` task
  does it when the unit completes: the model built, the path's modules and the unit's Δs
  read (score_load), then `verification.rules.score_delta` on the windows
  `outer.score_flops` buys (`dipaco.flops.score_windows`); --score-units and
  --score-windows measure fewer, scaled linearly (`scoring_measured`);
- **fetch_decode**: each upload fetched and decoded (`verification.uploads.fetch`,
  `codecs.decode`); **checks**: `compute_step`'s verify pass minus fetch_decode;
- **aggregate** and **outer_step** (Nesterov, streamed): the rest of `compute_step`;
- **publishing**: the new version's weights (and momentum) put in the store;
- **evaluation**: `mean_loss` on --eval-windows validation windows of each path (a round
  scores `sample_size` windows, `eval.flops` at the preset: the per-window cost scales it).

The JSON keeps "presets": {name: {stage: seconds, ..., "peak_rss_bytes"}} (one run per
preset, merged into an existing --json file) and "projection" from the largest preset
run: a 16x16 grid (256 units, one replica a path), 64 volunteers, units of
`units.target_seconds`, a 16-core server (`projection` says how it schedules the tasks).
`server_seconds` is the server work that extends the round (the last scoring's end past
the last completion, then the module steps' span), `round_seconds` the training
(units / volunteers x target) plus it, `fraction` their ratio; `occupancy` is all the
round's server CPU-seconds (scoring, steps, evaluation, data cutting) over cores x
round_seconds. `fraction_lockstep`: the same with each wave of 64 units completing at
once; `fraction_scoring_in_steps`: the design before, each level-0 step scoring its units.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import resource
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outer_step import setup_django  # bench/ is not a package

from dipaco.config import RunConfig

GRID, UNITS, VOLUNTEERS, CORES = (16, 16), 256, 64, 16


def preset(name: str) -> RunConfig:
    if name == "tiny":
        return RunConfig.tiny()
    if name == "150m":
        return RunConfig.paper_150m()
    raise SystemExit(f"unknown preset {name!r}: tiny or 150m")


class Clock:
    def __init__(self) -> None:
        self.stages: dict[str, float] = defaultdict(float)

    def time(self, stage: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.stages[stage] += time.perf_counter() - start
        return out


def shards(store: Any, config: RunConfig, paths: int, windows: int) -> None:
    from dipaco_server.runs import keys  # the server's modules load after django.setup()

    rng = np.random.default_rng(0)
    T, vocab = config.model.seq_len, config.model.vocab_size
    for p in range(paths):
        for split in ("train", "val"):
            ids = rng.integers(0, vocab, windows * T + 1).astype("<u2")
            store.put_bytes(keys.data_key(1, p, split), ids.tobytes())


def measure(config: RunConfig, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco.data.windows import unit_windows
    from dipaco.evaluate import sample_size
    from dipaco.flops import score_windows as budget_score_windows
    from dipaco.model import build_model

    clock = Clock()
    store, bases, uploads = _uploads(config, args, root, clock)
    torch.set_num_threads(1)
    model = build_model(config.model, config.seed)
    score_units, score_windows, scale = _score(config, args, store, uploads, bases, clock)
    per_module = _steps(config, store, uploads, bases, root, clock)
    eval_windows = _evaluate(config, args, store, model, clock)
    return {
        **{k: round(v, 4) for k, v in clock.stages.items()},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "units": args.units,
        "params": config.num_params(),
        "cut_windows_per_unit": args.cut_windows,
        "unit_windows": unit_windows(config),
        "eval_windows": eval_windows,
        "sample_windows": sample_size(config),
        "score_windows": budget_score_windows(config),
        "scoring_measured": {"units": score_units, "windows": score_windows, "scale": scale},
        "modules": {m: {k: round(v, 4) for k, v in s.items()} for m, s in per_module.items()},
    }


def _uploads(
    config: RunConfig, args: argparse.Namespace, root: Path, clock: Clock
) -> tuple[Any, dict[str, Any], dict[str, list[Any]]]:
    """The store with the shards, version 0 of every module and each unit's Δ uploads."""
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco import codecs
    from dipaco.data.windows import path_seed, unit_tokens, unit_windows
    from dipaco.modular import init_modules, modules_of_path
    from dipaco.modules_file import write_module
    from dipaco_server.rounds.outer.aggregate import BaseVersion
    from dipaco_server.rounds.protocol.unit_data import cut_unit
    from dipaco_server.rounds.verification.uploads import Upload
    from dipaco_server.runs import keys
    from dipaco_server.storage.local import LocalBlobStore

    store = LocalBlobStore(root / "blobs", public_url="http://127.0.0.1", secret="bench")
    args.cut_windows = min(args.cut_windows, unit_windows(config))
    T, comm = config.model.seq_len, config.comm
    paths = config.layout.num_paths
    shard_windows = max(args.cut_windows * 4, args.eval_windows + 64, 4096)
    shards(store, config, paths, shard_windows)
    modules = init_modules(config)
    bases = {}
    for module_id, tensors in modules.items():
        file = root / f"{module_id}.safetensors"
        sha, _ = write_module(file, tensors)
        store.put_file(f"base/{module_id}", file)
        bases[module_id] = BaseVersion(0, f"base/{module_id}", sha, "")
        file.unlink()
    uploads: dict[str, list[Any]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for u in range(args.units):
        p = u % paths
        clock.time("data_cutting", cut_unit, store, keys.data_key(1, p, "train"), "<u2", T,
                   path_seed(config, p), u * args.cut_windows, args.cut_windows)  # fmt: skip
        for i, module_id in enumerate(modules_of_path(config, p)):
            g = torch.Generator().manual_seed(u * 1000 + i)
            delta = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in modules[module_id].items()}  # fmt: skip
            data = codecs.encode(delta, comm.codec, block_size=comm.block_size, compression=comm.compression)  # fmt: skip
            key = f"deltas/{u}/{module_id}"
            store.put_bytes(key, data)
            uploads[module_id].append(Upload(len(counts), u, key, len(data), hashlib.sha256(data).hexdigest(), unit_tokens(config), p, unit_id=u, position=u * 8))  # fmt: skip
            counts[module_id] += 1
    return store, bases, uploads


def _score(
    config: RunConfig,
    args: argparse.Namespace,
    store: Any,
    uploads: dict[str, list[Any]],
    bases: dict[str, Any],
    clock: Clock,
) -> tuple[int, int, float]:
    """Proof of useful work as a unit's scoring task does it when the unit completes: the
    model built, its path's modules and the unit's Δs read from the store (`score_load`),
    then `score_delta` on --score-windows windows (`scoring`: forward passes over 4 x that
    many windows), for --score-units units, scaled to every unit and to the windows
    `outer.score_flops` buys at the preset (dipaco.flops.score_windows)."""
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco import codecs
    from dipaco.data.ranged import store_shard
    from dipaco.data.windows import ShardSource, path_seed
    from dipaco.flops import score_windows as budget
    from dipaco.model import build_model
    from dipaco.modular import module_spec, modules_of_path
    from dipaco.modules_file import read_module
    from dipaco_server.rounds.verification.rules import score_delta
    from dipaco_server.rounds.verification.uploads import fetch
    from dipaco_server.runs import keys

    T, paths, work = config.model.seq_len, config.layout.num_paths, Path(tempfile.mkdtemp())
    score_units = min(args.score_units or args.units, args.units)
    windows = args.score_windows or budget(config)
    for u in range(score_units):
        p = u % paths
        start = time.perf_counter()
        model = build_model(config.model, config.seed)
        modules, deltas = {}, {}
        for m in modules_of_path(config, p):
            store.download_to(bases[m].key, work / "base")
            modules[m] = read_module(work / "base", module_spec(config, m), bases[m].sha256)
            up = next(x for x in uploads[m] if x.unit_id == u)
            file, _ = fetch(store, up, work)
            deltas[m] = codecs.decode(file, module_spec(config, m), verify_checksum=False)
            file.unlink()
        loaded = time.perf_counter()
        clock.stages["score_load"] += loaded - start
        train = ShardSource(store_shard(store, keys.data_key(1, p, "train"), "<u2"), T, path_seed(config, p)).batch(u * 8, windows, T)  # fmt: skip
        val = store_shard(store, keys.data_key(1, p, "val"), "<u2")
        held = torch.from_numpy(val.read_windows([i * T for i in range(windows)], T + 1))
        score_delta(config, p, model, modules, deltas, train, held)
        clock.stages["scoring"] += time.perf_counter() - loaded
    shutil.rmtree(work)
    scale = args.units / score_units * budget(config) / windows
    clock.stages["scoring"] *= scale
    clock.stages["score_load"] *= args.units / score_units
    return score_units, windows, scale


def _steps(
    config: RunConfig,
    store: Any,
    uploads: dict[str, list[Any]],
    bases: dict[str, Any],
    root: Path,
    clock: Clock,
) -> dict[str, dict[str, float]]:
    """Each module's outer step over its uploads, timed stage by stage."""
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco import codecs
    from dipaco.modular import module_spec
    from dipaco_server.rounds.outer.step import compute_step
    from dipaco_server.rounds.verification.uploads import fetch

    comm = config.comm
    per_module: dict[str, dict[str, float]] = {}
    for module_id, ups in uploads.items():
        spec = module_spec(config, module_id)
        work = Path(tempfile.mkdtemp(dir=root))
        start = time.perf_counter()
        for up in ups:
            file, _ = fetch(store, up, work)
            codecs.decode(file, spec, verify_checksum=True)
            file.unlink()
        fetch_decode = time.perf_counter() - start
        start = time.perf_counter()
        result = compute_step(store, ups, bases[module_id], spec, config.outer, work, round_index=0, comm=comm)  # fmt: skip
        total = time.perf_counter() - start
        assert result.weights is not None, [v.reason for v in result.verdicts]
        start = time.perf_counter()
        store.put_file(f"published/{module_id}", result.weights)
        if result.momentum is not None:
            store.put_file(f"published/{module_id}.momentum", result.momentum)
        publish = time.perf_counter() - start
        verify_s, agg = result.timings["verify"], result.timings["aggregate"]
        per_module[module_id] = {
            "deltas": len(ups), "fetch_decode": fetch_decode,
            "checks": max(0.0, verify_s - fetch_decode), "aggregate": agg - verify_s,
            "outer_step": total - agg, "publishing": publish,
        }  # fmt: skip
        shutil.rmtree(work)
    for stage in ("fetch_decode", "checks", "aggregate", "outer_step", "publishing"):
        clock.stages[stage] = sum(m[stage] for m in per_module.values())
    return per_module


def _evaluate(
    config: RunConfig, args: argparse.Namespace, store: Any, model: Any, clock: Clock
) -> int:
    """Evaluation: each path assembled, its sample's windows scored; returns the windows."""
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco.data.ranged import store_shard
    from dipaco.evaluate import mean_loss
    from dipaco_server.runs import keys

    T, paths = config.model.seq_len, config.layout.num_paths
    eval_windows = 0
    for p in range(paths):  # evaluation: the path assembled, its sample's windows scored
        val = store_shard(store, keys.data_key(1, p, "val"), "<u2")
        start = time.perf_counter()
        windows = torch.from_numpy(val.read_windows([i * T for i in range(args.eval_windows)], T + 1))  # fmt: skip
        mean_loss(model, windows, config.eval.batch_size)
        clock.stages["evaluation"] += time.perf_counter() - start
        eval_windows += args.eval_windows
    return eval_windows


def lpt(tasks: list[float], cores: int) -> float:
    """The span of `tasks` list-scheduled longest first on `cores` (Graham's LPT)."""
    loads = [0.0] * cores
    for task in sorted(tasks, reverse=True):
        heapq.heapreplace(loads, loads[0] + task)
    return max(loads)


def fifo(arrivals: list[float], task: float, cores: int) -> float:
    """When the last of tasks of `task` seconds arriving at `arrivals` ends on `cores`."""
    free = [0.0] * cores
    end = 0.0
    for at in sorted(arrivals):
        start = max(at, heapq.heappop(free))
        heapq.heappush(free, start + task)
        end = max(end, start + task)
    return end


def projection(figures: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """The round of a 16x16 grid from the measured per-Δ, per-unit and per-window costs.

    Each unit's scoring task starts when the unit completes (completions spread evenly
    over the training), so only the last one's, or a backlog's, end extends the round;
    the module steps (recorded scores reused) follow on the cores; evaluation runs while
    the next round trains and data cutting while workers start their units: neither
    extends the round, both count in the cores' occupancy."""
    mods = figures["modules"]

    def per_delta(kind: str) -> float:
        rows = [m for k, m in mods.items() if (k == "shared") == (kind == "shared")]
        return sum(r["fetch_decode"] + r["checks"] + r["aggregate"] for r in rows) / sum(
            r["deltas"] for r in rows
        )

    def per_module(kind: str, stage: str) -> float:
        rows = [m for k, m in mods.items() if (k == "shared") == (kind == "shared")]
        return sum(r[stage] for r in rows) / len(rows)

    levels, choices = GRID
    level = per_delta("level") * (UNITS // choices)
    level += per_module("level", "outer_step") + per_module("level", "publishing")
    shared = per_delta("shared") * UNITS
    shared += per_module("shared", "outer_step") + per_module("shared", "publishing")
    steps = [level] * choices * levels + [shared]
    score_task = (figures["scoring"] + figures.get("score_load", 0.0)) / figures["units"]
    training = math.ceil(UNITS / VOLUNTEERS) * config.units.target_seconds
    arrivals = [training * (i + 1) / UNITS for i in range(UNITS)]
    scoring_tail = fifo(arrivals, score_task, CORES) - training
    span = lpt(steps, CORES)
    critical = scoring_tail + span
    # The design before, for comparison: each level-0 step scores its 16 units inline.
    inline = lpt([level + UNITS // choices * figures["scoring"] / figures["units"]] * choices + steps[choices:], CORES)  # fmt: skip
    # The worst case: volunteers in lockstep, each wave of units completing at once.
    waves = [config.units.target_seconds * (i // VOLUNTEERS + 1) for i in range(UNITS)]
    lockstep = fifo(waves, score_task, CORES) - training + span
    cut_unit = figures["data_cutting"] / figures["units"] / figures["cut_windows_per_unit"]
    cutting = cut_unit * figures["unit_windows"] * UNITS
    evaluation = figures["evaluation"] / figures["eval_windows"] * figures["sample_windows"]
    round_seconds = training + critical
    cpu = sum(steps) + score_task * UNITS + evaluation + cutting
    return {
        "grid": f"{levels}x{choices}", "units": UNITS, "volunteers": VOLUNTEERS,
        "cores": CORES, "unit_seconds": config.units.target_seconds,
        "training_seconds": training, "scoring_tail_seconds": round(scoring_tail, 1),
        "steps_span_seconds": round(span, 1), "server_seconds": round(critical, 1),
        "round_seconds": round(round_seconds, 1),
        "fraction": round(critical / round_seconds, 4),
        "fraction_lockstep": round(lockstep / (training + lockstep), 4),
        "fraction_scoring_in_steps": round(inline / (training + inline), 4),
        "cpu_seconds": round(cpu, 1),
        "occupancy": round(cpu / (CORES * round_seconds), 4),
        "occupancy_without_cutting": round((cpu - cutting) / (CORES * round_seconds), 4),
        "score_task_seconds": round(score_task, 2),
        "scoring_seconds": round(score_task * UNITS, 1),
        "evaluation_seconds": round(evaluation, 1), "cutting_seconds": round(cutting, 1),
        "steps_seconds": round(sum(steps), 1), "shared_step_seconds": round(shared, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "150m"])
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--cut-windows", type=int, default=256, help="windows cut per unit")
    parser.add_argument("--eval-windows", type=int, default=64, help="per path")
    parser.add_argument("--score-units", type=int, help="units scored (default: every unit)")
    parser.add_argument("--score-windows", type=int, help="(default: outer.score_windows)")
    parser.add_argument("--json", type=Path, help="merge this preset's figures into it")
    parser.add_argument(
        "--project-only", action="store_true", help="measure nothing: --json's projection anew"
    )
    args = parser.parse_args()
    out: dict[str, Any] = {"presets": {}}
    if args.json is not None and args.json.exists():
        out = json.loads(args.json.read_text())
    if not args.project_only:
        root = Path(tempfile.mkdtemp(prefix="server-round-"))
        try:
            setup_django(root / "data")
            out["presets"][args.preset] = measure(preset(args.preset), args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    largest = max(out["presets"], key=lambda name: out["presets"][name]["params"])
    out["projection"] = projection(out["presets"][largest], preset(largest))
    out["projection"]["preset"] = largest
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
