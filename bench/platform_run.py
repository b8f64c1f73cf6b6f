"""The platform trains as the library's simulator does: one run both ways, one figure.

    .venv/bin/python bench/platform_run.py                    # 2x2 paths, 3 rounds x 25 steps
    .venv/bin/python bench/platform_run.py --json platform_run.json
    .venv/bin/python bench/platform_run.py --model-size micro --rounds 2 --inner-steps 8

1. A short real platform run on the embedded default (SQLite, filesystem broker, local
   blobs) in a fresh data dir: `dipaco server` with its Celery worker (the demo's
   ServerProcess), a staff token and the admin API to create a dataset and the run, and
   two `dipaco-worker` processes (the demo's WorkerPool), until the run finishes.
2. `dipaco.simulate.train.train_dipaco` in this process on the same config and seed and on
   the platform's own prepared data (its tokenizer, router, shards and shard index, read
   from the blob store), so both read the same windows in the same order
   (dipaco.data.windows).
3. Both module sets, round by round (the platform's module versions v0..vT from the blob
   store), scored by the simulator's evaluator on the same validation windows
   (PreparedData.val_windows, routed mean).

The figure is ``platform_vs_simulate`` = platform loss / simulator loss, the final routed
validation losses' ratio (issue: "final routed validation loss ratio"); the expectation is
1 within 2%. Both train with one torch thread (the workers' --threads 1) and the server
sums a module's Δs in path order as the simulator does, so the same arithmetic gives the
same bits: measured 1.0000 at the default size, every unit's loss equal to the
simulator's (docs/benchmarks.md). What can still differ is listed in ``cold_units``: a
worker keeps the AdamW state (and codec residual) of the paths it trained itself, while the
simulator keeps one per (path, replica) whatever machine would have run it, so a unit
that went to a worker that did not train its path the round before starts colder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.codecs.registry import CODECS, UPDATE_CODECS
from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.shards import ShardIndex
from dipaco.evaluate import ValWindows, routed_mean
from dipaco.modular import module_ids
from dipaco.routing.router import Router
from dipaco.simulate.baselines import data_parallel_bytes
from dipaco.simulate.prepare import PreparedData
from dipaco.simulate.train import DipacoRun, evaluate_paths, train_dipaco
from dipaco.tokenizer import RunTokenizer
from dipaco_demo import plan
from dipaco_demo.control import (
    AdminClient,
    DemoError,
    ServerProcess,
    embedded_environ,
    free_port,
    log_tail,
)
from dipaco_demo.workers import WorkerPool
from worker_agent.payload import load_module

__all__ = ["default_config", "platform_vs_simulate", "prepared_from_blobs"]

Log = Callable[[str], None]
DEFAULT_ROUNDS = 3
DEFAULT_INNER_STEPS = 25
DEFAULT_WORKERS = 2
# ~1M characters of stdlib: ~300k tokens with the 8k BPE, so no path's shard wraps within
# 3 rounds x 25 steps x 4 x 128 tokens (38k per path), and it prepares in seconds.
DEFAULT_CORPUS_CHARS = 1_000_000
DEFAULT_EVAL_WINDOWS = 128
RUN_TIMEOUT_S = 900.0
POLL_S = 1.0


def default_config(
    *,
    rounds: int = DEFAULT_ROUNDS,
    inner_steps: int = DEFAULT_INNER_STEPS,
    seed: int = 0,
    model_size: str = "tiny",
    name: str = "platform-vs-simulate",
    preset: str = "tiny",
) -> RunConfig:
    """RunConfig.tiny(): 2x2 paths (`model_size` as dipaco demo's), or with `preset`
    "modular" RunConfig.modular(): 2 levels x 5 modules, 25 paths; one replica each, tf-idf
    router, random start, one phase."""
    common: dict[str, Any] = {
        "name": name, "seed": seed, "rounds": rounds, "replicas_per_path": 1,
        "inner": {"steps": inner_steps, "warmup_steps": max(1, inner_steps // 4)},
        "data": {"val_fraction": plan.VAL_FRACTION}, "router": {"featurizer": "tfidf"},
    }  # fmt: skip
    if preset == "modular":
        return RunConfig.modular(**common)
    if preset != "tiny":
        raise ValueError(f"preset {preset!r}: choose tiny or modular")
    model = {**RunConfig.tiny().model.model_dump(mode="json"), **plan.MODEL_SIZES[model_size]}
    layout = LayoutConfig.grid(model["num_layers"], 2, 2).model_dump()
    return RunConfig.tiny(**common, model=model, layout=layout)


# --- the platform run ---------------------------------------------------------------------


def corpus_file(corpus: str | Path, directory: Path, chars: int) -> Path:
    """The corpus file: for "stdlib" a JSON Lines sample written as the demo does."""
    if str(corpus) == "stdlib":
        return plan.stdlib_sample(directory, chars)
    path = Path(corpus).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"--corpus {corpus}: no such file or directory")
    return path


def mint_tokens(environ: dict[str, str], label: str, workers: int) -> tuple[str, str]:
    """(staff API token, enrollment token) from the demo's mint_tokens, in a child process:
    this one never configures Django (a pytest session has its own settings)."""
    code = (
        "import json, sys; from dipaco_demo import control; "
        "control.setup_django(dict(__import__('os').environ)); "
        f"print(json.dumps(control.mint_tokens({label!r}, {workers})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=180
    )
    if done.returncode != 0:
        raise RuntimeError(f"minting tokens failed:\n{done.stderr[-2000:]}")
    api_token, enrollment = json.loads(done.stdout.strip().splitlines()[-1])
    return str(api_token), str(enrollment)


def wait_for_state(
    admin: AdminClient, run_id: int, wanted: str, passing: tuple[str, ...], deadline: float
) -> dict[str, Any]:
    while True:
        status = admin.run(run_id)
        if status["state"] == wanted:
            return status
        if status["state"] not in passing:
            raise RuntimeError(f"run {run_id} is {status['state']}: {status.get('error')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {status['state']} at the deadline")
        time.sleep(POLL_S)


def run_platform(
    config: RunConfig, corpus: Path, data_dir: Path, *, workers: int, timeout_s: float, log: Log
) -> dict[str, Any]:
    """One run on a fresh embedded server; returns its id and timings once it finished."""
    started = time.monotonic()
    deadline = started + timeout_s
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environ = embedded_environ(data_dir, url)
    # The corpus lies beside the server's data dir: name its folder a data root.
    environ["DIPACO_DATA_ROOTS"] = str(corpus.resolve().parent)
    logs = data_dir / "logs"
    server = ServerProcess(environ, port, logs / "server.log")
    pool: WorkerPool | None = None
    admin: AdminClient | None = None
    run_id: int | None = None
    try:
        server.start()
        server.wait_until_healthy()
        log(f"dipaco server up at {url} (data dir {data_dir})")
        api_token, enrollment = mint_tokens(environ, "platform_run bench", workers)
        admin = AdminClient(url, api_token)
        dataset = admin.dataset(f"corpus-{corpus.stem}", str(corpus))
        run = admin.create_run(config.name, config.model_dump(mode="json"), dataset["id"])
        run_id = int(run["id"])
        admin.move(run_id, "start")
        wait_for_state(admin, run_id, "ready", ("draft", "preparing"), deadline)
        prepared_at = time.monotonic()
        log(f"run {run_id} prepared in {prepared_at - started:.0f} s; starting {workers} workers")
        admin.move(run_id, "start")
        pool = WorkerPool(data_dir / "workers", logs, workers)
        pool.start(url, enrollment, environ)
        while True:
            status = admin.run(run_id)
            if status["state"] == "finished":
                break
            if status["state"] not in ("ready", "running"):
                raise RuntimeError(f"run {run_id} is {status['state']}: {status.get('error')}")
            for worker, code in pool.failed():
                raise RuntimeError(f"{worker.name} exited with {code}; see {worker.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {run_id} did not finish in {timeout_s:.0f} s (round "
                    f"{status['current_round']}); logs in {logs}"
                )
            time.sleep(POLL_S)
        finished_at = time.monotonic()
        log(f"run {run_id} finished {config.rounds} rounds in {finished_at - prepared_at:.0f} s")
        return {
            "run_id": run_id,
            "seconds": finished_at - started,
            "train_seconds": finished_at - prepared_at,
            "units": unit_assignments(pool),
        }
    except DemoError as exc:  # e.g. "the server does not answer": say what the server said
        server_log = logs / "server.log"
        raise RuntimeError(f"{exc}\nthe end of {server_log}:\n{log_tail(server_log, 40)}") from None
    finally:
        if pool is not None:
            pool.stop()
        if admin is not None:
            if run_id is not None:
                try:
                    if admin.run(run_id)["state"] in ("preparing", "ready", "running", "paused"):
                        admin.move(run_id, "cancel")
                except Exception as exc:  # the server may be gone already; say so, go on
                    log(f"could not cancel run {run_id}: {exc}")
            admin.close()
        server.stop()


def unit_assignments(pool: WorkerPool) -> list[dict[str, Any]]:
    """Each completed unit's (round, path, worker), from the workers' JSON logs."""
    units = []
    for worker in pool.workers:
        # by lease id: a unit's hand-in may complete after the worker's next lease
        leases: dict[Any, dict[str, Any]] = {}
        for line in worker.log_path.read_text("utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if event.get("event") == "lease":
                leases[event.get("lease_id")] = event
            elif event.get("event") == "completed":
                lease = leases.pop(event.get("lease_id"), None)
                if lease is not None:
                    units.append({"round": lease.get("round"), "path": lease.get("path"),
                                  "worker": worker.name, "loss": event.get("loss")})  # fmt: skip
    return sorted(units, key=lambda u: (u["round"], u["path"]))


def unit_loss(losses: list[float]) -> float | None:
    """A unit's loss as the agent reports it: the mean of its last tenth of steps."""
    if not losses:
        return None
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def cold_units(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Units whose worker did not train the unit's path in the round before: they started
    from fresh or older AdamW state, where the simulator's (path, replica) state is warm.
    (With several replicas a path counts as warm for any worker that trained one of them.)"""
    trained: dict[tuple[int, int], set[str]] = {}
    for u in units:
        trained.setdefault((u["round"], u["path"]), set()).add(u["worker"])
    return [
        u for u in units
        if u["round"] > 0 and u["worker"] not in trained.get((u["round"] - 1, u["path"]), set())
    ]  # fmt: skip


# --- the platform's data and modules, read from its blob store ----------------------------


def prepared_from_blobs(blobs: Path, run_id: int, directory: Path) -> PreparedData:
    """The simulator's PreparedData over a platform run's blobs (runs.prepare's keys):
    runs/<run>/tokenizer.json, router.safetensors and data/ (index.json, <p>/{train,val}.bin),
    copied into `directory` in prepare_data's layout (shards/ is the platform's data/)."""
    run = blobs / "runs" / str(run_id)
    shutil.copytree(run / "data", directory / "shards")
    shutil.copy(run / "tokenizer.json", directory / "tokenizer.json")
    tokenizer = RunTokenizer.load(directory / "tokenizer.json")
    shards = ShardIndex.load(directory / "shards")
    router = None
    if (run / "router.safetensors").is_file():
        shutil.copy(run / "router.safetensors", directory / "router.safetensors")
        router = Router.load(directory / "router.safetensors", tokenizer)
    # `everything` (the baselines' stream of all documents) is not used by train_dipaco.
    meta = {"source": f"platform run {run_id}", "blobs": str(blobs)}
    return PreparedData(directory, f"run-{run_id}", False, tokenizer, router, shards, shards, meta)


def platform_modules(blobs: Path, run_id: int, config: RunConfig, version: int) -> dict[str, Any]:
    """Every module's weights after outer step `version` (v0: initial), from the blob store;
    a module no unit trained in a round keeps its previous version."""
    modules = {}
    for module_id in module_ids(config):
        folder = blobs / "runs" / str(run_id) / "modules" / module_id
        found = [v for v in range(version, -1, -1) if (folder / f"v{v}.safetensors").is_file()]
        if not found:
            raise FileNotFoundError(f"module {module_id} has no version <= {version} in {folder}")
        modules[module_id] = load_module(folder / f"v{found[0]}.safetensors", config, module_id)
    return modules


def platform_curve(
    blobs: Path, run_id: int, config: RunConfig, windows: ValWindows
) -> list[dict[str, Any]]:
    curve = []
    for t in range(config.rounds + 1):
        losses = evaluate_paths(config, platform_modules(blobs, run_id, config, t), windows)
        curve.append({"round": t, "routed_loss": routed_mean(losses),
                      "paths": [x.loss for x in losses]})  # fmt: skip
    return curve


# --- the comparison -----------------------------------------------------------------------


def platform_bytes(data_dir: Path, run_id: int) -> list[dict[str, int]]:
    """Bytes per round as the dashboard's "Communication" counts them (dipaco_web.curves):
    every contribution's upload, and what each completed lease's manifest sent down
    (Lease.download_bytes: encoded updates, fp32 files, nothing for a version held)."""
    # only the embedded server's database is read here
    import sqlite3

    rounds = (
        "JOIN rounds_workunit u ON u.id = {}.unit_id JOIN rounds_round r ON r.id = u.round_id "
        "WHERE r.run_id = ?"
    )
    with sqlite3.connect(data_dir / "db.sqlite3") as db:
        up = dict(
            db.execute(
                "SELECT r.t, SUM(c.size) FROM rounds_contribution c "
                + rounds.format("c")
                + " GROUP BY r.t",
                (run_id,),
            ).fetchall()
        )
        down = dict(db.execute(
            "SELECT r.t, SUM(l.download_bytes) FROM rounds_lease l " + rounds.format("l")
            + " AND l.state = 'completed' GROUP BY r.t", (run_id,)
        ).fetchall())  # fmt: skip
    return [
        {"round": t, "upload": int(up.get(t) or 0), "download": int(down.get(t) or 0)}
        for t in sorted(set(up) | set(down))
    ]


def _simulate(
    config: RunConfig, data: PreparedData, windows: ValWindows
) -> tuple[DipacoRun, dict[str, list[float]], float]:
    """The simulation of the run, each unit's step losses by its label, and its seconds."""
    started = time.perf_counter()
    unit_steps: dict[str, list[float]] = {}
    simulated = train_dipaco(
        config, data, windows,
        on_step=lambda label, m: unit_steps.setdefault(label, []).append(m.loss),
    )  # fmt: skip
    return simulated, unit_steps, time.perf_counter() - started


def _traffic(
    config: RunConfig, data_dir: Path, run_id: int, simulated: DipacoRun
) -> dict[str, Any]:
    """Bytes each round moved: the platform's (from its database) and the simulation's."""
    return {
        "platform": platform_bytes(data_dir, run_id),
        "simulate": [
            {"round": r.round - 1, "upload": r.upload_bytes, "download": r.download_bytes}
            for r in simulated.rounds[1:]
        ],
        "data_parallel_per_round": data_parallel_bytes(config) // config.rounds,
    }


def _with_simulated_losses(
    units: list[dict[str, Any]], unit_steps: dict[str, list[float]], config: RunConfig
) -> list[dict[str, Any]]:
    """Each platform unit with the simulator's figure for the same unit, as the agent
    reports it (None with replicas: the agent's log does not name the replica)."""
    for unit in units:
        label = f"round {unit['round'] + 1}/{config.rounds} path {unit['path']} replica 0"
        one = config.replicas_per_path == 1
        unit["simulate_loss"] = unit_loss(unit_steps.get(label, [])) if one else None
    return units


def platform_vs_simulate(
    config: RunConfig | None = None,
    *,
    corpus: str | Path = "stdlib",
    corpus_chars: int = DEFAULT_CORPUS_CHARS,
    workers: int = DEFAULT_WORKERS,
    eval_windows: int = DEFAULT_EVAL_WINDOWS,
    threads: int = 1,
    timeout_s: float = RUN_TIMEOUT_S,
    work_dir: Path | None = None,
    keep: bool = False,
    log: Log = lambda _: None,
) -> dict[str, Any]:
    """One platform run and one simulation of `config` on the same data; both evaluated alike.

    Returns {"platform_loss", "simulate_loss", "platform_vs_simulate" (their ratio),
    "rounds", "config", "platform_seconds", "simulate_seconds", "curves" ({"platform",
    "simulate"}: routed loss per round, round 0 before training), "paths" (final loss per
    path, both), "units" (round, path, worker of every platform unit), "cold_units" (those
    whose worker had not trained the path the round before), "platform_train_seconds",
    "eval_windows", "run_id", "data_dir"}.
    `work_dir` holds the server's data dir and the data copy (default: a fresh temporary
    directory, removed at the end unless `keep`).
    """
    config = config or default_config()
    if config.phase1 is not None or config.router.featurizer != "tfidf":
        raise ValueError("platform_vs_simulate compares one-phase runs with a tf-idf router")
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="platform-run-", dir=work_dir))
    threads_before = torch.get_num_threads()
    try:
        data_dir = root / "server"
        source = corpus_file(corpus, root / "corpus", corpus_chars)
        config = config.model_copy(update={"data": config.data.model_copy(
            update={"corpus": str(source)})})  # fmt: skip
        torch.set_num_threads(threads)
        platform_run = run_platform(
            config, source, data_dir, workers=workers, timeout_s=timeout_s, log=log
        )
        run_id = platform_run["run_id"]
        blobs = data_dir / "blobs"
        data = prepared_from_blobs(blobs, run_id, root / "prepared")
        windows = data.val_windows(config.model.seq_len, eval_windows)
        log(f"simulating the same run in this process ({threads} torch thread(s))")
        simulated, unit_steps, simulate_seconds = _simulate(config, data, windows)
        traffic = _traffic(config, data_dir, run_id, simulated)
        curve = platform_curve(blobs, run_id, config, windows)
        platform_loss = curve[-1]["routed_loss"]
        simulate_loss = simulated.rounds[-1].routed_loss
        units = _with_simulated_losses(platform_run["units"], unit_steps, config)
        return {
            "platform_loss": platform_loss,
            "simulate_loss": simulate_loss,
            "platform_vs_simulate": platform_loss / simulate_loss,
            "rounds": config.rounds,
            "config": config.model_dump(mode="json"),
            "platform_seconds": platform_run["seconds"],
            "platform_train_seconds": platform_run["train_seconds"],
            "simulate_seconds": simulate_seconds,
            "curves": {
                "platform": [point["routed_loss"] for point in curve],
                "simulate": [record.routed_loss for record in simulated.rounds],
            },
            "paths": {
                "platform": curve[-1]["paths"],
                "simulate": [x.loss for x in simulated.rounds[-1].paths],
            },
            "units": units,
            "cold_units": cold_units(units),
            "bytes": traffic,
            "eval_windows": [int(w.shape[0]) for w in windows.per_path],
            "run_id": run_id,
            "data_dir": str(data_dir) if keep else None,
        }
    finally:
        torch.set_num_threads(threads_before)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


# --- the script ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="T (%(default)s)")
    parser.add_argument(
        "--inner-steps", type=int, default=DEFAULT_INNER_STEPS, help="H (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (%(default)s)")
    parser.add_argument("--model-size", choices=sorted(plan.MODEL_SIZES), default="tiny",
                        help="path size, as dipaco demo's (%(default)s)")  # fmt: skip
    parser.add_argument("--preset", choices=("tiny", "modular"), default="tiny",
                        help="tiny: 2x2 paths of --model-size; modular: RunConfig.modular()'s "
                        "2 levels x 5 modules (25 paths), --model-size ignored (%(default)s)")  # fmt: skip
    parser.add_argument(
        "--corpus", default="stdlib",
        help='"stdlib" (a JSON Lines sample of it, as the demo writes), a directory or a '
        ".jsonl file (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--corpus-chars", type=int, default=DEFAULT_CORPUS_CHARS,
                        help="characters of the stdlib sample (%(default)s)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help="dipaco-worker processes (%(default)s)")  # fmt: skip
    parser.add_argument("--eval-windows", type=int, default=DEFAULT_EVAL_WINDOWS,
                        help="validation windows in all (%(default)s)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S,
                        help="seconds the platform run may take (%(default)s)")  # fmt: skip
    parser.add_argument("--work-dir", type=Path, help="where the temporary data dir goes")
    parser.add_argument("--keep", action="store_true", help="keep the data dir and logs")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the result as JSON")
    parser.add_argument("--codec", choices=CODECS,
                        help="comm.codec of the uploaded Δs (default: the config's)")  # fmt: skip
    parser.add_argument("--download-codec", choices=UPDATE_CODECS, default="fp32",
                        help="comm.download_codec: published outer updates in this encoding "
                        "(workers holding the version before fetch only those) (%(default)s)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    config = default_config(rounds=args.rounds, inner_steps=args.inner_steps, seed=args.seed,
                            model_size=args.model_size, preset=args.preset)  # fmt: skip
    comm = config.comm.model_copy(
        update={"download_codec": args.download_codec, "codec": args.codec or config.comm.codec}
    )
    config = config.model_copy(update={"comm": comm})  # fmt: skip

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    result = platform_vs_simulate(
        config, corpus=args.corpus, corpus_chars=args.corpus_chars, workers=args.workers,
        eval_windows=args.eval_windows, timeout_s=args.timeout, work_dir=args.work_dir,
        keep=args.keep, log=say,
    )  # fmt: skip
    wall = time.perf_counter() - started
    curves = result["curves"]
    for name in ("platform", "simulate"):
        print(f"{name:>9} routed val loss by round: "
              + " ".join(f"{loss:.4f}" for loss in curves[name]))  # fmt: skip
    print(f"cold units (worker had not trained the path the round before): "
          f"{len(result['cold_units'])} of {len(result['units'])}")  # fmt: skip
    print(
        f"platform_vs_simulate = {result['platform_loss']:.4f} / {result['simulate_loss']:.4f}"
        f" = {result['platform_vs_simulate']:.4f} (expected 0.98-1.02); perplexities "
        f"{math.exp(result['platform_loss']):.2f} / {math.exp(result['simulate_loss']):.2f}"
    )
    traffic = result["bytes"]
    dp = traffic["data_parallel_per_round"]
    for name in ("platform", "simulate"):
        for r in traffic[name]:
            moved = r["upload"] + r["download"]
            print(f"{name:>9} round {r['round']}: down {r['download']:,} B, up {r['upload']:,} B;"
                  f" data-parallel {dp:,} B: {dp / moved:,.1f}x less")  # fmt: skip
    print(f"wall time {wall:.0f} s (platform {result['platform_seconds']:.0f} s, simulator "
          f"{result['simulate_seconds']:.0f} s)")  # fmt: skip
    if args.json is not None:
        report = {
            **result,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "wall_seconds": wall,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__},
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
