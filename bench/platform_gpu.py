"""The whole platform on one machine: an embedded server, one worker on its GPU, a 150M run.

    python bench/platform_gpu.py --corpus corpus.jsonl --json docs/figures/platform_gpu.json
    python bench/platform_gpu.py --device cpu --preset tiny --unit-seconds 4 ...  # dry run

bench/platform_gpu.sh runs it (its header says how, and what the GPU machine needs). Here:

1. A fresh embedded ``dipaco server`` (SQLite, filesystem broker, local blobs; Celery on
   the CPU cores with ``--task-concurrency``, its evaluation and proof-of-useful-work
   scoring on ``DIPACO_SERVER_DEVICE``) starts, and meanwhile a probe (this file with
   ``--probe``, a child process) trains the path with the library's inner loop on the
   device for ``--probe-steps`` steps of random tokens: its first step's seconds are the
   compile, its later steps the speed that sizes H, so that a unit of H steps trains
   ``--unit-seconds`` (compiling there also fills torch's compile cache for the worker).
   While it runs, the server prepares the data (tokenizer, router, shards) for a run of
   the same data settings, then cancelled: the sized run reuses them (the server keys
   prepared data by its inputs, H not among them).
2. The run: `RunConfig.paper_150m()` (or tiny) on a 2-level grid of ``--paths`` x 1 modules,
   ``--rounds`` rounds of H steps at ``--batch`` sequences a step, ``outer.overlap``
   ``--overlap``; every unit is H steps (units.target_seconds and calibration_seconds
   are set past any unit, so the calibration and sizing never cut one). Created and
   prepared through the admin API (the server's own preparation, each stage timed).
3. One ``dipaco-worker --device DEVICE --json-logs`` does every unit; the run is followed
   until it finishes and the last round's validation losses are in.

What the JSON holds, and how it is measured: bench/platform_gpu_figures.py. Memory is
sampled every half second: the resident set of the server's process tree (the
server, gunicorn, Celery and its pool) summed, and on CUDA ``nvidia-smi``'s used memory
of the device and of each process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from platform_gpu_figures import MemorySampler, memory_parts, read_events, stamp, summarise
from platform_run import mint_tokens, platform_bytes
from s3_link import SlowLink

from dipaco.config import MAX_INNER_STEPS, LayoutConfig, RunConfig
from dipaco_demo.control import AdminClient, ServerProcess, embedded_environ, free_port
from dipaco_demo.workers import worker_command
from dipaco_server.cli.server import die_with_parent

POLL_S = 1.0
EVAL_WAIT_S = 90.0  # after the run finishes, for the last round's validation losses
MARGIN = 1.02  # H is sized 2% past --unit-seconds at the probe's speed
Log = Any


# --- the probe (a child process: its GPU memory goes when it exits) ----------------------


class RandomTokens:
    """A token source of uniform random ids: the speed does not depend on the text."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def batch(self, position: int, batch_size: int, seq_len: int) -> Any:
        # torch: only the probe (a child process) and the worker need it
        import torch

        g = torch.Generator().manual_seed(position)
        return torch.randint(0, self.vocab, (batch_size, seq_len + 1), generator=g)


def probe(config: RunConfig, device_name: str, steps: int) -> dict[str, Any]:
    """The path's speed on `device_name` with the worker's split and compile setting."""
    # torch and the inner loop: this child process alone trains here
    import torch

    from dipaco.inner.fit import fit_micro_batch
    from dipaco.inner.loop import run_inner_loop
    from dipaco.model import build_model

    device = torch.device(device_name)
    compiled = device.type == "cuda"
    budget = torch.cuda.mem_get_info(device)[0] if compiled else None
    inner = fit_micro_batch(config, budget, device.type, whole_logits=compiled)
    inner = inner.model_copy(update={"steps": steps, "warmup_steps": 1})
    marks: list[tuple[int, int, float]] = []
    started = time.perf_counter()
    model = build_model(config.model, config.seed).to(device)
    run_inner_loop(
        model, RandomTokens(config.model.vocab_size), inner, seq_len=config.model.seq_len,
        device=device, compile=compiled, on_step=lambda m: marks.append(
            (m.step, m.tokens, m.seconds)),
    )  # fmt: skip
    # steps before this one are warm-up (the first compiles): at least the first, and at
    # least one step after it to time
    warm = max(1, min(len(marks) - 1, steps // 4))
    _, tokens0, seconds0 = marks[warm - 1]
    _, tokens1, seconds1 = marks[-1]
    return {
        "steps": steps,
        "micro_batch": f"{inner.micro_batch_size} x {inner.grad_accum_steps}",
        "first_step_seconds": marks[0][2],
        "tokens_per_second": (tokens1 - tokens0) / (seconds1 - seconds0),
        "seconds": time.perf_counter() - started,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if compiled else None,
    }


def sized_steps(tokens_per_second: float, config: RunConfig, unit_seconds: float) -> int:
    """H: the steps a unit of `unit_seconds` trains at the probe's speed (2% more)."""
    step_tokens = config.inner.batch_size * config.model.seq_len
    steps = math.ceil(MARGIN * unit_seconds * tokens_per_second / step_tokens)
    return max(2, min(MAX_INNER_STEPS, steps))


# --- the run's config ----------------------------------------------------------------------


def run_config(
    preset: str,
    *,
    rounds: int,
    paths: int,
    steps: int,
    batch: int,
    overlap: str,
    corpus: str,
    eval_flops: float | None = None,
) -> RunConfig:
    """The run: `preset`'s model on a 2-level grid of `paths` x 1 modules, every unit H steps."""
    base = RunConfig.paper_150m() if preset == "150m" else RunConfig.tiny()
    layout = LayoutConfig.grid(base.model.num_layers, levels=2, modules=(paths, 1))
    micro = math.gcd(batch, 32)  # the worker fits its own split; this one passes the limits
    sections: dict[str, Any] = {
        "name": f"platform-gpu-{preset}",
        "rounds": rounds,
        "layout": layout.model_dump(),
        "inner": {
            "steps": steps,
            "micro_batch_size": micro,
            "grad_accum_steps": batch // micro,
            "warmup_steps": max(1, steps // 10),
        },
        "outer": {"overlap": overlap},
        # Past any unit here: H steps bound every unit, the first (calibration) one too.
        "units": {"target_seconds": 86_400.0, "calibration_seconds": 3_600.0},
        "data": {"corpus": corpus},
    }
    if eval_flops is not None:  # a round's evaluation budget (eval.flops), cut for a CPU run
        sections["eval"] = {"flops": eval_flops}
    return RunConfig.paper_150m(**sections) if preset == "150m" else RunConfig.tiny(**sections)


# --- the run on the platform ---------------------------------------------------------------


class Clock:
    """Seconds since the script began (the shell's start, so its setup counts too)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return time.time() - self.started

    def mark(self, name: str) -> float:
        self.marks[name] = round(self.now(), 2)
        return self.marks[name]

    def say(self, message: str) -> None:
        print(f"[{self.now():6.1f} s] {message}", flush=True)


def start_server(
    args: argparse.Namespace, root: Path, clock: Clock, link: SlowLink | None = None
) -> tuple[ServerProcess, dict[str, str]]:
    port = free_port()
    environ = embedded_environ(root / "server", f"http://127.0.0.1:{port}")
    if link is not None:  # blobs on the S3 test server, through the slow link
        environ.update(link.environ(link.create_bucket()))
    environ.update(
        DIPACO_DATA_ROOTS=str(args.corpus.resolve().parent),  # the corpus is a data root
        DIPACO_SERVER_DEVICE=args.server_device or args.device,
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
    )  # fmt: skip
    server = ServerProcess(
        environ, port, root / "logs" / "server.log", task_concurrency=args.task_concurrency
    )
    server.start()
    clock.say(f"dipaco server starting at {server.url} (Celery: {args.task_concurrency} at once)")
    return server, environ


def start_probe(args: argparse.Namespace, out: Path) -> subprocess.Popen[bytes] | None:
    if args.steps is not None:
        return None
    command = [sys.executable, __file__, "--probe", "--device", args.device, "--preset",
               args.preset, "--batch", str(args.batch), "--paths", str(args.paths),
               "--probe-steps", str(args.probe_steps), "--corpus", str(args.corpus),
               "--json", str(out)]  # fmt: skip
    with (out.parent / "logs" / "probe.log").open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def sized_config(
    args: argparse.Namespace, probe_run: subprocess.Popen[bytes] | None, out: Path, clock: Clock
) -> tuple[RunConfig, dict[str, Any] | None]:
    """The run's config with H from the probe (or --steps), and the probe's figures."""
    shape = run_config(args.preset, rounds=args.rounds, paths=args.paths, steps=1,
                       batch=args.batch, overlap=args.overlap, corpus=str(args.corpus))  # fmt: skip
    found = None
    steps = args.steps
    if probe_run is not None:
        if probe_run.wait() != 0:
            raise RuntimeError(f"the probe failed; see {out.parent / 'logs' / 'probe.log'}")
        found = json.loads(out.read_text())
        steps = sized_steps(found["tokens_per_second"], shape, args.unit_seconds)
        clock.say(
            f"probe: {found['tokens_per_second']:,.0f} tokens/s after a first step of "
            f"{found['first_step_seconds']:.1f} s: H = {steps} for {args.unit_seconds:g} s units"
        )
    assert steps is not None
    config = run_config(args.preset, rounds=args.rounds, paths=args.paths, steps=steps,
                        batch=args.batch, overlap=args.overlap, corpus=str(args.corpus),
                        eval_flops=args.eval_flops)  # fmt: skip
    return config, found


def prepare(admin: AdminClient, config: RunConfig, corpus: Path, clock: Clock, label: str) -> int:
    """Create the run and prepare it; back once it is ready (the start of each of its
    stages marked on the clock as <label>_<stage>)."""
    dataset = admin.dataset(f"corpus-{corpus.stem}", str(corpus))
    run = admin.create_run(config.name, config.model_dump(mode="json"), dataset["id"])
    run_id = int(run["id"])
    clock.mark(f"{label}_preparation_started")
    admin.move(run_id, "start")
    deadline = time.monotonic() + 1800
    while True:
        status = admin.run(run_id)
        stage = (status.get("progress") or {}).get("stage")
        if stage and f"{label}_{stage}" not in clock.marks:
            clock.mark(f"{label}_{stage}")
        if status["state"] == "ready":
            break
        if status["state"] not in ("draft", "preparing") or time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id} is {status['state']}: {status.get('error')}")
        time.sleep(POLL_S / 2)
    seconds = clock.mark(f"{label}_ready") - clock.marks[f"{label}_preparation_started"]
    clock.say(f"run {run_id} ({label}) prepared in {seconds:.0f} s")
    return run_id


def prepare_data(args: argparse.Namespace, admin: AdminClient, clock: Clock) -> None:
    """The data (tokenizer, router, shards), prepared while the probe runs, by a run of the
    same data settings that is then cancelled: the sized run's preparation reuses them
    (the server keys prepared data by its inputs, not by H)."""
    config = run_config(args.preset, rounds=args.rounds, paths=args.paths, steps=1,
                        batch=args.batch, overlap=args.overlap, corpus=str(args.corpus))  # fmt: skip
    config = config.model_copy(update={"name": "platform-gpu-data"})
    admin.move(prepare(admin, config, args.corpus, clock, "data"), "cancel")


def start_worker(
    args: argparse.Namespace, url: str, enrollment: str, root: Path, environ: dict[str, str]
) -> subprocess.Popen[bytes]:
    command = [*worker_command(), "--server", url, "--enroll", enrollment, "--data-dir",
               str(root / "worker"), "--name", "platform-gpu", "--json-logs", "--device",
               args.device, "--max-units", str(args.rounds * args.paths)]  # fmt: skip
    if args.worker_threads:
        command += ["--threads", str(args.worker_threads)]
    with (root / "logs" / "worker.jsonl").open("ab") as log:
        return subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip


def follow(
    admin: AdminClient,
    run_id: int,
    rounds: int,
    worker: subprocess.Popen[bytes],
    deadline: float,
    clock: Clock,
) -> str:
    """Until the run finishes (then until its last round's losses are in), the worker
    fails or the deadline passes; returns how it ended."""
    last_round = -1
    while True:
        status = admin.run(run_id)
        if status["current_round"] != last_round:
            last_round = status["current_round"]
            clock.say(f"run {run_id}: {status['state']}, round {last_round}")
        if status["state"] == "finished":
            clock.mark("finished")
            break
        if status["state"] not in ("ready", "running"):
            return f"run {status['state']}: {status.get('error')}"
        if worker.poll() not in (None, 0):
            return f"dipaco-worker exited with {worker.returncode}"
        if time.time() - clock.started > deadline:
            return f"stopped: the run was not finished {deadline:.0f} s after the start"
        time.sleep(POLL_S)
    waited = time.monotonic() + EVAL_WAIT_S
    while time.monotonic() < waited:
        if any(p["round"] == rounds - 1 for p in admin.metrics(run_id, "val_loss")):
            break
        time.sleep(POLL_S)
    clock.mark("evaluated")
    return "finished"


def device_name(device: str) -> str:
    """The GPU's name (nvidia-smi: no CUDA context in this process), or "cpu"."""
    if not device.startswith("cuda"):
        return "cpu"
    index = device.partition(":")[2] or "0"
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def on_platform(args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    """Server, probe, run, worker; their figures once the run ended (or failed)."""
    link = None
    if args.store == "s3":
        link = SlowLink(args.latency_ms / 1000, args.bandwidth_mbs * 1e6)
        clock.say(f"S3 test server behind a link of {args.latency_ms:g} ms and "
                  f"{args.bandwidth_mbs:g} MB/s at {link.endpoint_url}")  # fmt: skip
    server, environ = start_server(args, root, clock, link)
    sampler: MemorySampler | None = None
    admin: AdminClient | None = None
    worker: subprocess.Popen[bytes] | None = None
    found: dict[str, Any] = {"ended": "not started", "run_id": None}
    try:
        probe_run = start_probe(args, root / "probe.json")
        server.wait_until_healthy()
        clock.mark("server_ready")
        assert server.process is not None
        sampler = MemorySampler(server.process.pid, args.device.startswith("cuda"))
        sampler.start()
        api_token, enrollment = mint_tokens(environ, "platform_gpu bench", 1)
        admin = AdminClient(server.url, api_token)
        if probe_run is not None:
            prepare_data(args, admin, clock)
        config, found["probe"] = sized_config(args, probe_run, root / "probe.json", clock)
        found["config"] = config
        clock.mark("sized")
        # The worker starts (imports, enrols, asks for work) while the run makes its modules.
        worker = start_worker(args, server.url, enrollment, root, environ)
        sampler.worker_pid = worker.pid
        clock.mark("worker_started")
        found["run_id"] = run_id = prepare(admin, config, args.corpus, clock, "run")
        if link is not None:  # the run's own requests from here (preparation's before)
            found["s3_before_run"] = link.counters()
        admin.move(run_id, "start")
        stop = args.stop_after or args.budget + 80
        found["ended"] = follow(admin, run_id, config.rounds, worker, stop, clock)
        clock.say(f"run {run_id}: {found['ended']}")
        found["rounds"] = admin.call("GET", f"/runs/{run_id}/rounds")
        found["losses"] = admin.metrics(run_id, "val_loss")
        found["traffic"] = platform_bytes(root / "server", run_id)
        if link is not None:
            (r0, d0, u0), (r1, d1, u1) = found["s3_before_run"], link.counters()
            found["s3"] = {"requests": r1 - r0, "bytes_out": d1 - d0, "bytes_in": u1 - u0,
                           "preparation_requests": r0}  # fmt: skip
    except Exception as exc:  # the figures so far are written all the same, with the error
        traceback.print_exc()
        found["ended"] = f"failed: {type(exc).__name__}: {exc}"
    finally:
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
        if sampler is not None:
            found["memory"] = sampler.stop()
        if admin is not None:
            admin.close()
        server.stop()
        if link is not None:
            link.close()
    return found


def phases(marks: dict[str, float]) -> dict[str, float | None]:
    """Where the script's seconds went, from its timeline: setup (wheels, corpus, Python's
    start), the server's start (beside the probe, which also compiles), the data's
    preparation (beside the probe too), the sized run's (reusing the data), the worker's
    start to its first step's end (enrolment, fetch, compile), the training window, and
    after it (the last hand-in, outer step, evaluation)."""

    def span(start: str, end: str) -> float | None:
        return round(marks[end] - marks[start], 2) if start in marks and end in marks else None

    return {
        "setup_seconds": marks.get("begun"),
        "server_start_seconds": span("begun", "server_ready"),
        "sizing_seconds": span("begun", "sized"),
        "data_preparation_seconds": span("data_preparation_started", "data_ready"),
        "preparation_seconds": span("run_preparation_started", "run_ready"),
        "to_first_step_seconds": span("worker_started", "first_step"),
        "training_window_seconds": span("first_step", "last_step"),
        "after_last_step_seconds": span("last_step", "evaluated"),
    }


def report(args: argparse.Namespace, found: dict[str, Any], root: Path, clock: Clock) -> dict:
    # without a sized config (the run failed before it), the unsized one: its shape alone
    unsized = {"rounds": args.rounds, "paths": args.paths, "steps": 1, "batch": args.batch}
    config: RunConfig = found.get("config") or run_config(
        args.preset, overlap=args.overlap, corpus=str(args.corpus), **unsized
    )
    events = read_events(root / "logs" / "worker.jsonl")
    name = device_name(args.device)
    summary = summarise(events, found.get("rounds", []), found.get("losses", []),
                        found.get("traffic", []), config, name)  # fmt: skip
    steps = [e for e in events if e.get("event") == "step"]
    if steps:  # the worker's training window on the script's clock
        clock.marks["first_step"] = round(stamp(steps[0]["time"]) - clock.started, 2)
        clock.marks["last_step"] = round(stamp(steps[-1]["time"]) - clock.started, 2)
    clock.mark("end")
    memory = found.get("memory") or {}
    units = sum(1 for e in events if e.get("event") == "completed") or None
    s3 = found.get("s3")
    return {
        **phases(clock.marks),
        **summary,
        "ended": found["ended"],
        "store": args.store,
        "params": config.num_params(),
        "worker_peak_pss_bytes": memory.get("worker_pss_bytes"),
        "worker_peak_rss_bytes": memory.get("worker_rss_bytes"),
        "server_peak_pss_bytes": memory.get("server_pss_bytes"),
        "worker_memory_parts": memory_parts(config, args.device),
        "units_completed": units,
        "s3": s3,
        "s3_requests_per_unit": round(s3["requests"] / units, 1) if s3 and units else None,
        "s3_bytes_per_unit": round((s3["bytes_out"] + s3["bytes_in"]) / units)
        if s3 and units
        else None,
        "seconds": clock.marks["end"],
        "budget_seconds": args.budget,
        "memory": found.get("memory"),
        "probe": found.get("probe"),
        "timeline": clock.marks,
        "inner_steps": config.inner.steps,
        "paths": config.num_paths,
        "run_id": found["run_id"],
        "config": config.model_dump(mode="json"),
        "work_dir": str(root),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "load_average_end": os.getloadavg(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--device", default="cuda", help="the worker's (and probe's) device (%(default)s)")
    add("--server-device", help="DIPACO_SERVER_DEVICE (default: --device)")
    add("--preset", choices=("150m", "tiny"), default="150m", help="the path (%(default)s)")
    add("--paths", type=int, default=2, help="modules of the grid's first level (%(default)s)")
    add("--rounds", type=int, default=3, help="T (%(default)s)")
    add("--batch", type=int, default=64, help="sequences per step (%(default)s)")
    add("--unit-seconds", type=float, default=60.0, help="a unit's training (%(default)s)")
    add("--steps", type=int, help="H, instead of sizing it with the probe")
    add("--probe-steps", type=int, default=30, help="the probe's steps (%(default)s)")
    add("--overlap", choices=("none", "delayed", "eager"), default="delayed",
        help="outer.overlap (%(default)s)")  # fmt: skip
    add("--corpus", type=Path, required=True, help="a .jsonl corpus or a folder of text")
    add("--task-concurrency", type=int, default=max(2, (os.cpu_count() or 2) // 2),
        help="Celery tasks at once (%(default)s: half the cores)")  # fmt: skip
    add("--worker-threads", type=int, help="the worker's torch threads (default: its own)")
    add("--budget", type=float, default=480.0,
        help="the goal: seconds from --started-at to the end (%(default)s)")  # fmt: skip
    add("--stop-after", type=float,
        help="stop a run not finished this long after --started-at (default: budget + 80)")  # fmt: skip
    add("--started-at", type=float, help="when the whole script began (epoch; default: now)")
    add("--work-dir", type=Path, default=Path("/tmp/platform-gpu"), help="data and logs")
    add("--json", type=Path, required=True, help="where the figures go")
    add("--store", choices=("local", "s3"), default="local",
        help="the server's blob store: the embedded local one, or moto's S3 server behind "
        "a link of --latency-ms and --bandwidth-mbs (bench/s3_link.py) (%(default)s)")  # fmt: skip
    add("--latency-ms", type=float, default=30.0, help="with --store s3 (%(default)s)")
    add("--bandwidth-mbs", type=float, default=200.0, help="with --store s3 (%(default)s)")
    add("--eval-flops", type=float,
        help="eval.flops, a round's evaluation budget (default: the preset's; cut it on a CPU)")  # fmt: skip
    add("--probe", action="store_true", help=argparse.SUPPRESS)  # the probe's child process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_steps < 2:
        raise SystemExit("--probe-steps must be at least 2: the first step compiles and "
                         "warms up, the speed is timed over the steps after it")  # fmt: skip
    if args.probe:
        shape = run_config(args.preset, rounds=1, paths=args.paths, steps=1, batch=args.batch,
                           overlap="none", corpus=str(args.corpus))  # fmt: skip
        args.json.write_text(json.dumps(probe(shape, args.device, args.probe_steps)) + "\n")
        return 0
    clock = Clock(args.started_at or time.time())
    clock.mark("begun")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    (root / "logs").mkdir()
    found = on_platform(args, root, clock)
    figures = report(args, found, root, clock)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2) + "\n")

    def share(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    print(f"{found['ended']}: utilisation {share(figures['utilisation'])}, MFU "
          f"{share(figures['mfu'])} (units' {share(figures['unit_mfu'])}), "
          f"{figures['seconds']:.0f} s of {args.budget:.0f}; wrote {args.json}")  # fmt: skip
    for r in figures["rounds"]:
        stages = ", ".join(f"{k} {v['wall_seconds']:.1f}" for k, v in r["stages"].items())
        print(f"  round {r['round']}: val loss {r['val_loss']}, {stages}")
    return 0 if found["ended"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
