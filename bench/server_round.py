"""One round's server work at a preset, from synthetic Δs and no workers, on an S3 test
server behind a slow link, and what it projects to for a 16x16 grid trained by 64
volunteers on a 16-core CPU-only server. Over 600 lines: the measurement and the
projection it feeds stay in one script, so that one command regenerates the figure.

    .venv/bin/python bench/server_round.py --preset tiny --units 4 --json out.json
    .venv/bin/python bench/server_round.py --preset 150m --units 4 --eval-windows 1 \\
        --score-units 1 --json out.json   # adds its preset to out.json
    .venv/bin/python bench/server_round.py --project-only --json out.json

The store is moto's S3 server behind a proxy adding --latency-ms to every request and
pacing bodies at --bandwidth-mbs (bench/s3_link.py). Each of --units units (round-robin
over the paths) uploads a synthetic Δ per module of its path (1e-3 x N(0, 1), the run's
codec); every module has a version 0 and an outer momentum; the scored units' paths get
row chunks (runs.stages.upload_rows), every path a small validation shard. The server's
code then runs as its tasks do, on one torch thread (a Celery pool process's share), CPU
in this thread's CPU seconds (`time.thread_time`, which other load does not inflate), what
waits on the link in wall seconds (`_seconds` keys):

- **manifest**: `rounds.protocol.unit_data.rows_manifest` of a whole unit, median of
  --manifests;
- **score task**, as `score_unit` at a completion: the model built, the path's modules and
  the unit's Δs fetched (`score_load_seconds`), its rows read by ranges of its chunks
  (`StoreRows`, as `Scorer._train_windows`), `rules.score_delta` on the windows
  `outer.score_flops` buys (`scoring_cpu`; --score-units/--score-windows: fewer, scaled);
- **check tasks**, as `check_unit` at a completion (rounds.verification.arrival): each Δ
  fetched alone (`fetch_seconds`), then its format, norm, decode and cosine with the outer
  momentum (`arrival_cpu`), the verified copy kept;
- **module steps**, as `outer_step` at the close: `judge_uploads` and `step_judged` in
  steady state (a norm history and a momentum) reusing those checks, its parts' CPU apart
  (`checks_cpu`: what the step still checks, the kept copies linked; `aggregate_cpu`, on
  one thread: the split by tensor is projected; `outer_cpu`), base and momentum in
  (`base_fetch_seconds`), weights and momentum out (`publishing_seconds`);
- **evaluation**: `mean_loss` on --eval-windows windows a path, scaled to `eval.flops`.

The JSON keeps "presets": {name: figures} (one run per preset, merged into --json's) and
"projection" from the largest preset: see `projection`.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outer_step import setup_django  # bench/ is not a package
from s3_link import SlowLink

from dipaco.config import LayoutConfig, RunConfig

LEVELS, MODULES, VOLUNTEERS, CORES = 2, 16, 64, 16  # DiPaCo's 16x16: 2 levels x 16 modules
SERVERS = (16, 24, 32, 48, 64)  # the cores `fraction_lockstep_by_cores` projects
RUN, PHASE, DTYPE = 1, 2, "<u2"
GOALS = {"fraction_lockstep": 0.10, "longest_step_seconds": 60.0}


def preset(name: str) -> RunConfig:
    return {"tiny": RunConfig.tiny, "150m": RunConfig.paper_150m}[name]()


def cpu_timed(fn: Callable[..., Any], into: dict[str, float], key: str) -> Callable[..., Any]:
    """`fn`, adding this thread's CPU seconds in it to into[key]."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] += time.thread_time() - start

    return timed


def position(config: RunConfig, unit: int) -> int:
    """Unit `unit`'s first data position: units go round-robin over the paths."""
    from dipaco.data.windows import unit_windows

    return unit // config.layout.num_paths * unit_windows(config)


def measure(config: RunConfig, args: argparse.Namespace, link: SlowLink, root: Path) -> dict:
    from dipaco.data.windows import unit_windows
    from dipaco.evaluate import sample_size
    from dipaco.flops import score_windows as budget_score_windows

    torch.set_num_threads(1)
    store = link.bucket()
    data = _data(config, args, store, link, root)
    bases, uploads = _uploads(config, args, store, root)
    score = _score(config, args, store, uploads, bases, root)
    per_module = _steps(config, store, uploads, bases, root)
    eval_windows, evaluation = _evaluate(config, args, store)
    kinds = [k for k in next(iter(per_module.values())) if k not in ("deltas", "delta_bytes")]
    total = {k: round(sum(m[k] for m in per_module.values()), 4) for k in kinds}
    return {
        **data, **score, "steps": total, "evaluation_cpu": round(evaluation, 4),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "units": args.units, "params": config.num_params(),
        "unit_windows": unit_windows(config), "eval_windows": eval_windows,
        "sample_windows": sample_size(config), "score_windows": budget_score_windows(config),
        "link": {"latency_ms": args.latency_ms, "bandwidth_mb_per_s": args.bandwidth_mbs,
                 "requests": link.counters()[0], "bytes_out": link.counters()[1]},
        "modules": per_module,
    }  # fmt: skip


def _train_rows(store: Any, config: RunConfig, p: int, windows: int, work: Path) -> None:
    """Path p's train split of `windows` random windows, uploaded as row chunks."""
    from dipaco_server.runs.stages import upload_rows

    rng = np.random.default_rng(p)
    train = work / f"train-{p}.bin"
    with open(train, "wb") as f:  # 64 MiB at a time: the file is a gigabyte at 150M
        left = windows * config.model.seq_len + 1
        while left:
            n = min(left, 32 << 20)
            f.write(rng.integers(0, config.model.vocab_size, n).astype(DTYPE).tobytes())
            left -= n
    upload_rows(store, config, RUN, p, PHASE, train, DTYPE)
    train.unlink()


def _data(
    config: RunConfig, args: argparse.Namespace, store: Any, link: SlowLink, root: Path
) -> dict[str, Any]:
    """Validation shards, row chunks for the scored units' paths (two units at least: the
    manifest is of a path's second unit, starting inside a chunk as most do), manifests."""
    from dipaco.data.windows import unit_windows
    from dipaco.flops import score_windows
    from dipaco_server.rounds.protocol.unit_data import rows_manifest
    from dipaco_server.runs import keys

    T, paths, count = config.model.seq_len, config.layout.num_paths, unit_windows(config)
    rng = np.random.default_rng(0)
    val_windows = max(args.eval_windows, score_windows(config)) + 8
    for p in range(paths):
        ids = rng.integers(0, config.model.vocab_size, val_windows * T + 1).astype(DTYPE)
        store.put_bytes(keys.data_key(RUN, p, "val", PHASE), ids.tobytes())
    scored = min(args.score_units or args.units, args.units)
    for p in sorted({u % paths for u in range(scored)} | {0}):
        last = max([position(config, u) for u in range(scored) if u % paths == p] + [0])
        _train_rows(store, config, p, max(2 * count, last + count), root)

    def manifest() -> dict[str, Any]:
        return rows_manifest(store, run_id=RUN, path=0, phase=PHASE, config=config,
                             dtype=DTYPE, first=count, count=count, expires_s=3600)  # fmt: skip

    manifest()  # the client's first connection
    cpu, wall, requests = [], [], []
    for _ in range(args.manifests):
        before, start, clock = link.counters()[0], time.perf_counter(), time.thread_time()
        chunks = len(manifest()["chunks"])
        cpu.append(time.thread_time() - clock)
        wall.append(time.perf_counter() - start)
        requests.append(link.counters()[0] - before)
    return {"manifest_cpu": round(statistics.median(cpu), 5), "manifest_chunks": chunks,
            "manifest_seconds": round(statistics.median(wall), 4),
            "manifest_requests": max(requests)}  # fmt: skip


def _uploads(
    config: RunConfig, args: argparse.Namespace, store: Any, root: Path
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Version 0 of every module with an outer momentum, and each unit's Δ uploads."""
    from dipaco import codecs
    from dipaco.data.windows import unit_tokens
    from dipaco.modular import init_modules, modules_of_path
    from dipaco.modules_file import write_module
    from dipaco_server.rounds.outer.aggregate import BaseVersion
    from dipaco_server.rounds.verification.uploads import Upload

    comm, paths = config.comm, config.layout.num_paths
    modules = init_modules(config)
    shapes = {m: {n: t.shape for n, t in ts.items()} for m, ts in modules.items()}
    bases = {}
    for i, module_id in enumerate(list(modules)):
        file = root / f"{module_id}.safetensors"
        sha, _ = write_module(file, modules.pop(module_id))
        store.put_file(f"base/{module_id}", file)
        g = torch.Generator().manual_seed(10**6 + i)
        momentum = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes[module_id].items()}
        write_module(file, momentum)
        store.put_file(f"base/{module_id}.momentum", file)
        bases[module_id] = BaseVersion(0, f"base/{module_id}", sha, f"base/{module_id}.momentum")
        file.unlink()
        del momentum
    uploads: dict[str, list[Any]] = defaultdict(list)
    ids = 0
    for u in range(args.units):
        p = u % paths
        for i, module_id in enumerate(modules_of_path(config, p)):
            g = torch.Generator().manual_seed(u * 1000 + i)
            delta = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes[module_id].items()}
            data = codecs.encode(delta, comm.codec, block_size=comm.block_size, compression=comm.compression)  # fmt: skip
            del delta
            key = f"deltas/{u}/{module_id}"
            store.put_bytes(key, data)
            uploads[module_id].append(Upload(ids, u, key, len(data), hashlib.sha256(data).hexdigest(), unit_tokens(config), p, unit_id=u, position=position(config, u)))  # fmt: skip
            ids += 1
    return bases, uploads


def _score(
    config: RunConfig,
    args: argparse.Namespace,
    store: Any,
    uploads: dict[str, list[Any]],
    bases: dict[str, Any],
    root: Path,
) -> dict[str, Any]:
    """A unit's proof of useful work as its scoring task does it, per unit of --score-units,
    scaled to the windows `outer.score_flops` buys (dipaco.flops.score_windows)."""
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco import codecs
    from dipaco.data.ranged import store_shard
    from dipaco.data.rows import StoreRows
    from dipaco.flops import score_windows as budget
    from dipaco.model import build_model
    from dipaco.modular import module_spec, modules_of_path
    from dipaco.modules_file import read_module
    from dipaco_server.rounds.verification.rules import base_losses, score_delta
    from dipaco_server.rounds.verification.uploads import fetch
    from dipaco_server.runs import keys
    from dipaco_server.runs.rows import row_index

    T, paths, work = config.model.seq_len, config.layout.num_paths, root / "score"
    work.mkdir()
    units = min(args.score_units or args.units, args.units)
    windows = args.score_windows or budget(config)
    got: dict[str, float] = defaultdict(float)
    for u in range(units):
        p = u % paths
        clock = time.thread_time()
        model = build_model(config.model, config.seed)
        got["score_build_cpu"] += time.thread_time() - clock
        start, clock = time.perf_counter(), time.thread_time()
        modules, deltas = {}, {}
        for m in modules_of_path(config, p):  # the path's base, as score_base loads it
            store.download_to(bases[m].key, work / "base")
            modules[m] = read_module(work / "base", module_spec(config, m), bases[m].sha256)
        val = store_shard(store, keys.data_key(RUN, p, "val", PHASE), DTYPE)
        held = torch.from_numpy(val.read_windows([i * T for i in range(windows)], T + 1))
        got["score_base_load_seconds"] += time.perf_counter() - start
        got["score_base_load_cpu"] += time.thread_time() - clock
        for m in modules_of_path(config, p):  # and the unit's Δs, as score_unit adds them
            up = next(x for x in uploads[m] if x.unit_id == u)
            file, _ = fetch(store, up, work)
            deltas[m] = codecs.decode(file, module_spec(config, m), verify_checksum=False)
            file.unlink()
        got["score_load_seconds"] += time.perf_counter() - start
        got["score_load_cpu"] += time.thread_time() - clock
        start, clock = time.perf_counter(), time.thread_time()
        rows = StoreRows(row_index(store, RUN, p, PHASE), lambda c, a, b, p=p: store.get_range(keys.rows_chunk_key(RUN, p, c, PHASE), a, b))  # fmt: skip
        train = torch.from_numpy(rows.read(position(config, u), windows))
        got["score_rows_seconds"] += time.perf_counter() - start
        got["score_rows_cpu"] += time.thread_time() - clock
        got["score_rows_ranges"] += rows.ranges_read
        clock = time.thread_time()  # score_base's passes, at the grant
        before = base_losses(config, p, model, modules, train, held)
        got["scoring_base_cpu"] += time.thread_time() - clock
        clock = time.thread_time()  # score_unit's, at the completion
        score_delta(config, p, model, modules, deltas, train, held, before)
        got["scoring_delta_cpu"] += time.thread_time() - clock
        del model, modules, deltas
    shutil.rmtree(work)
    scale = budget(config) / windows
    per_unit = {k: round(v / units, 4) for k, v in got.items()}
    for k in ("scoring_base_cpu", "scoring_delta_cpu"):
        per_unit[k] = round(per_unit[k] * scale, 4)
    per_unit["scoring_cpu"] = round(per_unit["scoring_base_cpu"] + per_unit["scoring_delta_cpu"], 4)
    return {**per_unit, "scoring_measured": {"units": units, "windows": windows, "scale": scale}}


def _steps(
    config: RunConfig,
    store: Any,
    uploads: dict[str, list[Any]],
    bases: dict[str, Any],
    root: Path,
) -> dict[str, dict[str, float]]:
    """Each module's Δs checked as check_unit does at their completions, then its outer step
    as outer_step runs it at the close (reusing those checks), in steady state (a norm
    history and an outer momentum), its parts timed apart."""
    # The server's modules load after django.setup() (main), the library's with them.
    from dipaco import codecs
    from dipaco.modular import module_spec
    from dipaco.modules_file import read_module
    from dipaco_server.rounds.outer import aggregate, step
    from dipaco_server.rounds.verification import judge, rules
    from dipaco_server.rounds.verification.uploads import fetch

    parts = {(judge, "check_contributions"): "checks_cpu", (step, "apply_step"): "outer_cpu",
             (step, "aggregate_uploads"): "aggregate_cpu"}  # fmt: skip
    originals = {part: getattr(*part) for part in parts}
    split = aggregate.SPLIT_MAX
    # One thread: CPU in thread seconds; the split by tensor is projected (`projection`).
    aggregate.SPLIT_MAX = 1
    per_module: dict[str, dict[str, float]] = {}
    try:
        for module_id, ups in uploads.items():
            spec = module_spec(config, module_id)
            work, kept = Path(tempfile.mkdtemp(dir=root)), Path(tempfile.mkdtemp(dir=root))
            got: dict[str, float] = defaultdict(float)
            for (where, name), key in parts.items():
                setattr(where, name, cpu_timed(originals[where, name], got, key))
            start = time.perf_counter()
            for key in (bases[module_id].key, bases[module_id].momentum_key):
                store.download_to(key, work / "fetched")
            got["base_fetch_seconds"] = time.perf_counter() - start
            momentum = read_module(work / "fetched", spec)  # the momentum, fetched last
            records, norms = {}, []
            for up in ups:  # check_unit at each completion (rounds.verification.arrival)
                start, clock = time.perf_counter(), time.thread_time()
                file, data = fetch(store, up, kept)
                got["fetch_seconds"] += time.perf_counter() - start
                got["fetch_cpu"] += time.thread_time() - clock
                clock = time.thread_time()
                norm = codecs.verify(data, spec, verify_checksum=False).norm
                del data
                delta = codecs.decode(file, spec, verify_checksum=False)
                cosine = rules.cosine(delta, momentum)
                got["arrival_cpu"] += time.thread_time() - clock
                del delta
                norms.append(norm)
                records[up.contribution_id] = {"sha256": up.sha256, "norm": norm,
                                               "cosine": cosine, "momentum_version": 0}  # fmt: skip
            start = time.perf_counter()
            judged = judge.judge_uploads(
                store, ups, spec, config.outer, work, history=(statistics.median(norms),) * 3,
                momentum=momentum, arrival=records, momentum_version=0,
                kept=lambda u, kept=kept: kept / f"contribution-{u.contribution_id}.safetensors")  # fmt: skip
            result = step.step_judged(store, judged, bases[module_id], spec, config.outer, work,
                                      round_index=1, comm=config.comm)  # fmt: skip
            got["step_seconds"] = time.perf_counter() - start
            assert result.weights is not None, [v.reason for v in result.verdicts]
            del momentum
            start = time.perf_counter()
            store.put_file(f"published/{module_id}", result.weights)
            if result.momentum is not None:
                store.put_file(f"published/{module_id}.momentum", result.momentum)
            got["publishing_seconds"] = time.perf_counter() - start
            store.delete(f"published/{module_id}")
            per_module[module_id] = {
                "deltas": len(ups), "delta_bytes": sum(u.size for u in ups) // len(ups),
                **{k: round(v, 4) for k, v in sorted(got.items())},
            }  # fmt: skip
            shutil.rmtree(work)
            shutil.rmtree(kept)
    finally:
        aggregate.SPLIT_MAX = split
        for (where, name), fn in originals.items():
            setattr(where, name, fn)
    return per_module


def _evaluate(config: RunConfig, args: argparse.Namespace, store: Any) -> tuple[int, float]:
    """Evaluation: each path's sample windows scored; (windows, CPU seconds)."""
    from dipaco.data.ranged import store_shard
    from dipaco.evaluate import mean_loss
    from dipaco.model import build_model
    from dipaco_server.runs import keys

    T, paths = config.model.seq_len, config.layout.num_paths
    model = build_model(config.model, config.seed)
    cpu = 0.0
    for p in range(paths):  # evaluation: the path assembled, its sample's windows scored
        val = store_shard(store, keys.data_key(RUN, p, "val", PHASE), DTYPE)
        windows = torch.from_numpy(val.read_windows([i * T for i in range(args.eval_windows)], T + 1))  # fmt: skip
        clock = time.thread_time()
        mean_loss(model, windows, config.eval.batch_size)
        cpu += time.thread_time() - clock
    return args.eval_windows * paths, cpu


def lpt(tasks: list[float], cores: int) -> float:
    """The span of `tasks` list-scheduled longest first on `cores` (Graham's LPT)."""
    loads = [0.0] * cores
    for task in sorted(tasks, reverse=True):
        heapq.heapreplace(loads, loads[0] + task)
    return max(loads)


def fifo(tasks: list[tuple[float, float]], cores: int) -> float:
    """When the last of `tasks` ((arrival, seconds), served in arrival order; at equal
    arrivals in list order) ends on `cores`."""
    free = [0.0] * cores
    end = 0.0
    for at, seconds in sorted(tasks, key=lambda task: task[0]):
        start = max(at, heapq.heappop(free))
        heapq.heappush(free, start + seconds)
        end = max(end, start + seconds)
    return end


def costs(figures: dict[str, Any], kind: str) -> dict[str, float]:
    """Per Δ and per step of one kind of module ("level" or "shared"), in seconds: the
    link's measured wall for fetches and puts, CPU seconds for the rest."""
    rows = [m for k, m in figures["modules"].items() if (k == "shared") == (kind == "shared")]
    n = sum(r["deltas"] for r in rows)

    def total(key: str) -> float:
        return sum(r[key] for r in rows)

    outer, moved = total("outer_cpu") / len(rows), total("base_fetch_seconds") / len(rows)
    moved += total("publishing_seconds") / len(rows)  # the base and momentum in and out
    size = sum(r["delta_bytes"] * r["deltas"] for r in rows) / n
    return {
        "fetch": total("fetch_seconds") / n,  # one Δ through the link, measured
        "fetch_nominal": transfer(size, figures["link"], 1),  # one GET at the link's own pace
        "check": total("arrival_cpu") / n,  # check_unit's: format, norm, decode, cosine
        "judge": total("checks_cpu") / n,  # the step's checks, the arrival's reused
        "aggregate": total("aggregate_cpu") / n,  # one thread
        "fixed": outer + moved,  # the base and momentum in, Nesterov, the new version out
        "outer": outer, "delta_bytes": size,
    }  # fmt: skip


def transfer(size: float, link: dict[str, Any], streams: int = 4) -> float:
    """A transfer's seconds at the link's own pace (latency + bytes / bandwidth): one request,
    or from 64 MiB up 16 MiB parts `streams` at once (S3BlobStore's put_file, download_to)."""
    latency, bandwidth, part = link["latency_ms"] / 1e3, link["bandwidth_mb_per_s"] * 1e6, 16 << 20
    if size < 64 << 20 or streams == 1:
        return latency + size / bandwidth
    return math.ceil(size / part / streams) * (latency + part / bandwidth)


def numels(config: RunConfig, module_id: str) -> list[int]:
    from dipaco.modular import module_spec

    return [math.prod(shape) for shape, _ in module_spec(config, module_id).values()]


def _round(
    level: float, shared: list[float], unit_task: float, level_modules: int, units: int,
    training: float, unit_s: float, extra_cpu: float, cores: int = CORES,
    grant_task: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """Fractions and CPU of a round whose units' tasks (`grant_task` s each at their grant,
    a unit's time before its completion; `unit_task` s at completion), then steps
    (`level_modules` x `level` s, the shared one's tasks) run on `cores` cores. At equal
    times a completion's task queues before the grant it is followed by."""
    span = lpt([level] * level_modules + shared, cores)

    def end(completions: list[float]) -> float:
        done = [(at, unit_task) for at in completions]
        granted = [(max(0.0, at - unit_s), grant_task) for at in completions] if grant_task else []
        return fifo(done + granted, cores)

    tail = end([training * (i + 1) / units for i in range(units)]) - training
    waves = [training - unit_s * ((units - 1 - i) // VOLUNTEERS) for i in range(units)]
    lockstep = end(waves) - training + span
    critical = tail + span
    cpu = level * level_modules + sum(shared) + (unit_task + grant_task) * units + extra_cpu
    return {
        "fraction": round(critical / (training + critical), 4),
        "fraction_lockstep": round(lockstep / (training + lockstep), 4),
        "longest_step_seconds": round(max(level, *shared), 1),
        "shared_step_seconds": round(sum(shared), 1), "level_step_seconds": round(level, 1),
        "scoring_tail_seconds": round(tail, 1),
        "scoring_tail_lockstep_seconds": round(lockstep - span, 1),
        "steps_span_seconds": round(span, 1), "server_seconds": round(critical, 1),
        "round_seconds": round(training + critical, 1), "cpu_seconds": round(cpu, 1),
        "occupancy": round(cpu / (cores * (training + critical)), 4),
    }  # fmt: skip


# What the model leaves out: the server's network interface shared by concurrent tasks
# (each gets the link's per-request bandwidth: `steps_fetch_mb_per_s` is the total rate
# the steps' span assumes); a core counted busy while its task waits on the link;
# Celery, database and lock overheads; the first round's extra checks (peer cosines,
# settlement: steady state is modelled); replicas, partial units, a failed score task's
# inline rescoring or checking; evaluation's loading of each path's modules; GPUs on the
# server; the workers' own downloads and their speed spread beyond the lockstep case;
# the cores the shared sum's extra threads take from other tasks; memory and disk (the
# kept copies of a round's Δs, 3 x 256 encoded, ~81 GB at 150M, wait on local disk).
def projection(figures: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """The round of a 16x16 grid from the measured per-Δ, per-unit and per-window costs.

    The grid is `LayoutConfig.grid(num_layers, levels=2, modules=16)`: 32 level modules of
    num_layers / 2 blocks (the preset's 2x2 level modules' size: their costs carry over),
    each in 16 of the 256 paths, and the shared module (embeddings, final norm, head) in
    all 256. One replica a path: 256 units, 64 volunteers, four waves. A unit's
    score_base runs from its grant (`score_tasks`); its completion's tasks (score_unit and
    check_unit as one task: the rest of its score, each of its 3 Δs fetched and checked)
    start at its completion (spread evenly: `fraction`; each wave of 64 at once:
    `fraction_lockstep`, the goal's figure), so only the last ones extend the round; then the module steps
    (recorded scores and checks reused) run on the cores, longest first, each paying per
    Δ its aggregation and the step's remaining checks (CPU), then the base in, Nesterov
    and the new version out. The shared module's sum runs on `shared_sum_threads`
    threads (rounds.outer.aggregate.tensor_groups): its aggregation divided by
    `shared_sum_speedup` (the module's values over its largest group's), the rest not.
    `before_inline_checks`, `before_base_at_grant`: the same costs as before check_unit,
    before score_base. The manifest's wall counts once a wave, its CPU in the occupancy;
    evaluation runs while the next round trains (occupancy only).
    """
    layout = LayoutConfig.grid(config.model.num_layers, levels=LEVELS, modules=MODULES)
    units, level_modules, levels = layout.num_paths, sum(layout.modules_per_level), LEVELS
    unit_s, waves = config.units.target_seconds, math.ceil(units / VOLUNTEERS)
    training = waves * (unit_s + figures["manifest_seconds"])
    lv, sh, link, through = costs(figures, "level"), costs(figures, "shared"), figures["link"], units // MODULES  # fmt: skip
    evaluation = figures["evaluation_cpu"] / figures["eval_windows"] * figures["sample_windows"]
    manifests = figures["manifest_cpu"] * units  # through: the paths through a level module
    # The link alone: 4 module-sized objects a step (base and momentum in, weights and
    # momentum out); a score task, its path's modules and Δs and 2 requests for its rows.
    move = {k: 4 * transfer(4 * sum(numels(config, m)), link) for k, m in (("level", "0.0"), ("shared", "shared"))}  # fmt: skip
    nominal = {k: {**c, "fetch": c["fetch_nominal"], "fixed": c["outer"] + move[k]}
               for k, c in (("level", lv), ("shared", sh))}  # fmt: skip
    score_task, base_task, delta_task, base_nominal, delta_nominal = score_tasks(
        figures, (move["level"] * levels + move["shared"]) / 4,
        levels * lv["fetch_nominal"] + sh["fetch_nominal"], transfer(0, link),
    )  # fmt: skip

    threads, speedup = shared_split(config, units)

    def scenario(
        kinds: dict[str, dict[str, float]], task: float, checked: bool, cores: int = CORES,
        grant: float = 0.0,
    ) -> dict[str, Any]:  # fmt: skip
        def step(k: dict[str, float], n: int, speed: float = 1.0) -> float:
            per = k["aggregate"] / speed + k["judge"]
            return n * (per + (0.0 if checked else k["fetch"] + k["check"])) + k["fixed"]

        lv_, sh_ = kinds["level"], kinds["shared"]
        if checked:  # each Δ fetched and checked at its completion (check_unit)
            task += levels * (lv_["fetch"] + lv_["check"]) + sh_["fetch"] + sh_["check"]
        shared = [step(sh_, units, speedup if checked else 1.0)]
        return _round(step(lv_, through), shared, task, level_modules, units, training,
                      unit_s, evaluation + manifests, cores, grant)  # fmt: skip

    measured = {"level": lv, "shared": sh}
    built = scenario(measured, delta_task, True, grant=base_task)
    by_cores = {c: scenario(measured, delta_task, True, c, base_task)["fraction_lockstep"] for c in SERVERS}  # fmt: skip
    fetched = units * (levels * lv["delta_bytes"] + sh["delta_bytes"])
    return {
        "grid": f"{MODULES}x{MODULES}: {levels} levels x {MODULES} modules", "levels": levels,
        "modules": MODULES, "level_modules": level_modules, "modules_total": level_modules + 1,
        "units": units, "deltas_per_unit": levels + 1, "deltas_per_level_module": through,
        "deltas_per_shared_module": units, "volunteers": VOLUNTEERS, "cores": CORES,
        "unit_seconds": unit_s, "training_seconds": round(training, 1), **built,
        "shared_sum_threads": threads, "shared_sum_speedup": round(speedup, 3),
        "score_task_seconds": round(delta_task, 2), "score_base_task_seconds": round(base_task, 2),
        "scoring_seconds": round((base_task + delta_task) * units, 1),
        "check_task_seconds": round(levels * (lv["fetch"] + lv["check"]) + sh["fetch"] + sh["check"], 2),
        "evaluation_seconds": round(evaluation, 1), "manifest_cpu_seconds": round(manifests, 2),
        "score_rows_seconds": round(figures["score_rows_seconds"] * units, 2),
        "per_delta": {k: {n: round(v, 4) for n, v in c.items()} for k, c in measured.items()},
        "shared_fetch_seconds": round(units * sh["fetch"], 1),
        "shared_fetch_nominal_seconds": round(units * sh["fetch_nominal"], 1),
        "shared_fetch_bytes": int(units * sh["delta_bytes"]), "arrival_fetch_bytes": int(fetched),
        "fraction_lockstep_by_cores": by_cores,
        "at_nominal_link": {**scenario(nominal, delta_nominal, True, grant=base_nominal), "what": NOMINAL},
        "before_inline_checks": {**scenario(measured, delta_task, False, grant=base_task), "what": BEFORE},
        "before_base_at_grant": {**scenario(measured, score_task, True), "what": BEFORE_BASE},
    }  # fmt: skip


def score_tasks(
    figures: dict[str, Any], path_moved: float, deltas_moved: float, request: float
) -> tuple[float, float, float, float, float]:
    """A unit's scoring tasks in seconds: the whole score at its completion (as before
    score_base), then split as built (rounds.verification.unit_score): score_base at the
    grant (the path's base loaded, the base losses' passes), score_unit at the completion
    (the base loaded again with the unit's Δs, the passes with the Δ applied); and the two
    at the link's own pace (`path_moved`, `deltas_moved`: the path's modules' and the
    unit's Δs' transfers; `request`: one empty request, two for its rows)."""
    cpu = figures["score_build_cpu"] + figures["scoring_cpu"]
    whole = cpu + figures["score_load_seconds"] + figures["score_rows_seconds"]
    base_load, rows = figures["score_base_load_seconds"], figures["score_rows_seconds"]
    base = figures["score_build_cpu"] + base_load + rows + figures["scoring_base_cpu"]
    base_nominal = figures["score_build_cpu"] + figures["score_base_load_cpu"]
    base_nominal += path_moved + 2 * request
    delta_nominal = base_nominal + figures["score_load_cpu"] - figures["score_base_load_cpu"]
    delta_nominal += deltas_moved + figures["scoring_delta_cpu"]
    base_nominal += figures["scoring_base_cpu"]
    return whole, base, whole - figures["scoring_base_cpu"], base_nominal, delta_nominal


def shared_split(config: RunConfig, units: int) -> tuple[int, float]:
    """The shared module's sum split by tensor (rounds.outer.aggregate.tensor_groups, as
    aggregate_uploads splits it): its threads, and its values over its largest group's."""
    from dipaco.modular import module_spec
    from dipaco_server.rounds.outer.aggregate import split_parts, tensor_groups

    spec = module_spec(config, "shared")
    groups = tensor_groups(spec, split_parts(spec, units))
    sizes = [sum(math.prod(spec[n][0]) for n in group) for group in groups]
    return len(groups), sum(sizes) / max(sizes)


NOMINAL = (
    "the built design with every transfer at the link's own pace (latency + bytes / bandwidth, "
    "multipart as S3BlobStore sends it): without the test server's own serving time"
)
BEFORE_BASE = (
    "the design before score_base: a unit's whole score (base losses and the passes with its "
    "Δ applied) ran at its completion (the same measured costs)"
)
BEFORE = (
    "the design before check_unit: each module's step fetched, decoded and checked all its "
    "Δs at the round's close, one thread a step, then aggregated (the same measured costs)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "150m"])
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=64, help="per path")
    parser.add_argument("--score-units", type=int, help="units scored (default: every unit)")
    parser.add_argument("--score-windows", type=int, help="(default: outer.score_windows)")
    parser.add_argument("--manifests", type=int, default=5, help="manifests timed (median)")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="per request (30)")
    parser.add_argument("--bandwidth-mbs", type=float, default=200.0,
                        help="MB/s per request (200)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="merge this preset's figures into it")
    parser.add_argument("--project-only", action="store_true",
                        help="measure nothing: --json's projection anew")  # fmt: skip
    args = parser.parse_args()
    out: dict[str, Any] = {"presets": {}}
    if args.json is not None and args.json.exists():
        out = json.loads(args.json.read_text())
    if args.project_only:  # the projection reads how the server splits its sums
        setup_django(Path(tempfile.mkdtemp(prefix="server-round-")) / "data")
    else:
        started = time.perf_counter()
        root = Path(tempfile.mkdtemp(prefix="server-round-"))
        try:
            setup_django(root / "data")
            link = SlowLink(args.latency_ms / 1000, args.bandwidth_mbs * 1e6)
            try:
                figures = measure(preset(args.preset), args, link, root)
            finally:
                link.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        figures["wall_seconds"] = round(time.perf_counter() - started, 1)
        out["presets"][args.preset] = figures
    _project(out)
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


def _project(out: dict[str, Any]) -> None:
    """out's projection from its largest preset, with its goals and timing notes."""
    largest = max(out["presets"], key=lambda name: out["presets"][name]["params"])
    proj = projection(out["presets"][largest], preset(largest))
    proj["preset"] = largest
    proj["link"] = out["presets"][largest]["link"]
    proj["goals"] = {k: {"goal": v, "value": proj[k], "met": proj[k] <= v} for k, v in GOALS.items()}  # fmt: skip
    proj["timing"] = (
        "CPU work in thread CPU seconds (time.thread_time): other load on the machine does not "
        "inflate it; what waits on the link (fetches, puts, manifests) in wall seconds"
    )
    out["projection"] = proj


if __name__ == "__main__":
    main()
