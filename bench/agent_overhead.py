"""What the worker agent costs: its training path against a bare PyTorch + transformers loop.

    .venv/bin/python bench/agent_overhead.py                          # tiny model, CPU
    .venv/bin/python bench/agent_overhead.py --preset 150m --device cuda --steps 30
    .venv/bin/python bench/agent_overhead.py --e2e --rounds 3 --steps 40 # + utilisation
    .venv/bin/python bench/agent_overhead.py --e2e --overlap delayed       # outer.overlap
    .venv/bin/python bench/agent_overhead.py --e2e --overlap eager         # + its rebase

Both sides train the same Llama (dipaco.model.build_model, same seed) on the same
token window with the same batch (micro-batch x accumulation x sequence length), AdamW,
gradient clipping and (on CUDA) bf16 autocast. The *agent* side is exactly what
``dipaco-worker`` runs for a unit: worker_agent.trainer.train_unit over the token file
(memory-mapped, as downloaded) read in the path's shuffled window order
(dipaco.data.windows), with warm inner state (dipaco.inner.InnerState, from the agent's
cache) from a previous unit of the same path, the library's inner loop, a progress
callback and the end-of-unit checkpoint.
The *bare* side is a plain loop over an in-memory token tensor with no checkpoint.

Reported after one warm-up run of each: the median over ``--repeats`` of the ratio of
an agent run to the bare run next to it in time (the order alternates), and on the CPU
the same ratio by process CPU time, which another program's load disturbs far less:
- **inner tokens/s**: wall time of steps 2..H on each side (synchronised at both ends;
  the agent's includes its per-step callback, stop checks and data reads); the ratio is
  the overhead of the agent's inner-loop path (goal >= 0.97);
- **unit tokens/s**: the same tokens over the agent's whole `train_unit` call (model
  build, loading and saving the warm state, training, final checkpoint, Δ split); it
  depends on H and the batch, since the fixed costs are paid once per unit.

With ``--e2e`` it also measures **utilisation** end to end: a real ``dipaco server``
(embedded mode: SQLite, filesystem broker, local blobs, a Celery worker for the outer
steps) on loopback, a tiny 2x2-path run prepared by the server's own `prepare_run`
(stdlib corpus), and one ``dipaco-worker`` process that does every unit of ``--rounds``
rounds. Utilisation is the worker's training seconds (the sum of its units'
``train_seconds``) over the wall seconds from its first lease to its last completion;
the rest is fetching, encoding, uploading, completing, and waiting for outer steps
(goal >= 0.97, issue 20). ``--overlap delayed`` runs it with one-step-delayed outer steps
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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from dipaco.config import InnerConfig, LayoutConfig, ModelConfig, OuterConfig, RunConfig
from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource
from dipaco.inner import StepMetrics, lr_at
from dipaco.model import build_model
from dipaco.modular import init_modules
from worker_agent.progress import Reporter
from worker_agent.trainer import InnerStates, UnitWork, train_unit


def preset(name: str, steps: int, micro: int | None, accum: int) -> RunConfig:
    if name == "tiny":  # RunConfig.tiny: 2.8M parameters, sequences of 128
        return RunConfig.tiny(
            rounds=100, inner={"steps": steps, "micro_batch_size": micro or 4,
                               "grad_accum_steps": accum, "warmup_steps": 2},
        )  # fmt: skip
    if name == "150m":  # the papers' 150M path: 12 blocks of width 896, sequences of 1024
        return RunConfig(
            rounds=100,
            model=ModelConfig(),
            layout=LayoutConfig.grid(12, 2, 2),
            inner=InnerConfig(steps=steps, micro_batch_size=micro or 8, grad_accum_steps=accum,
                              warmup_steps=2),
        )  # fmt: skip
    raise SystemExit(f"unknown preset {name!r}: tiny or 150m")


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


def bare_loop(config: RunConfig, window: torch.Tensor, device: torch.device) -> Rates:
    """Tokens/s of a plain training loop over steps 2..H: the baseline."""
    cfg, t = config.inner, config.model.seq_len
    model = build_model(config.model, config.seed, device=device).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    vocab, micro, sequence = config.model.vocab_size, cfg.micro_batch_size, 0
    started = now()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step, cfg.steps)
        for _ in range(cfg.grad_accum_steps):
            starts = (sequence + torch.arange(micro)) * t  # (B,)
            rows = window[starts[:, None] + torch.arange(t + 1)[None, :]].to(device)  # (B, T+1)
            sequence += micro
            with autocast:
                logits = model(input_ids=rows[:, :-1]).logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), rows[:, 1:].reshape(-1))
            (loss / cfg.grad_accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:  # steps 2..H are timed, as on the agent's side
            sync(device)
            started = now()
    sync(device)
    return rates((cfg.steps - 1) * cfg.batch_size * t, started, now())


def agent_unit(
    config: RunConfig, window: Path, device: torch.device, work: Path, states: InnerStates
) -> tuple[Rates, float]:
    """(inner tokens/s over steps 2..H, whole-unit tokens/s) of the agent's train_unit."""
    reporter, stamps = Reporter(), []

    def on_step(metrics: StepMetrics) -> None:  # what the agent does after every step
        reporter.status(step=metrics.step, loss=metrics.loss, tokens_per_second=0.0)
        stamps.append(now())  # the step's loss.item() has synchronised

    source = ShardSource.for_path(TokenShard(window, _dtype(config)), config, 0)
    unit = UnitWork(config, 1, 0, 1, init_modules(config), source)
    started = time.perf_counter()
    result, _ = train_unit(
        unit, device=device, work_dir=work, state=states.load(1, 0, config),
        checkpoint_every=50, on_step=on_step,
    )  # fmt: skip
    if result.state is not None:  # what the agent keeps for the path's next unit
        states.save(1, 0, result.state)
    sync(device)
    wall = time.perf_counter() - started
    for file in work.iterdir():  # each unit starts clean, as the agent's work dir does
        file.unlink()
    per_step = config.inner.batch_size * config.model.seq_len
    return rates(per_step * (len(stamps) - 1), stamps[0], stamps[-1]), result.tokens / wall


def _dtype(config: RunConfig) -> str:
    return "<u2" if config.model.vocab_size <= 2**16 else "<u4"


# --- end to end: a server, a run, one worker process ----------------------------------------

SERVICE_VARIABLES = ("DATABASE_URL", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET",
                     "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY", "S3_REGION",
                     "DIPACO_PUBLIC_URL", "ALLOWED_HOSTS")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(root: Path) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    environ = {k: v for k, v in os.environ.items() if k not in SERVICE_VARIABLES}
    environ.update(DIPACO_DATA_DIR=str(root / "server"), DIPACO_PUBLIC_URL=url,
                   DJANGO_SETTINGS_MODULE="dipaco_server.settings")  # fmt: skip
    command = [str(Path(sys.executable).with_name("dipaco")), "server", "--port", str(port),
               "--web-workers", "1", "--task-concurrency", "1"]  # fmt: skip
    with (root / "server.log").open("ab") as log:
        server = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dipaco server exited; see {root / 'server.log'}")
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                return server, url, environ
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"dipaco server did not become healthy; see {root / 'server.log'}")


def _prepared_run(
    environ: dict[str, str], rounds: int, steps: int, overlap: str, eager_at: float | None = None
) -> tuple[int, str, int]:
    """(run id, enrollment token, units) of a started tiny run, prepared by the server's code."""
    os.environ.update(environ)
    from dipaco_server.cli.admin import setup_django

    setup_django()
    from dipaco_server.rounds.open import start_run
    from dipaco_server.runs.prepare import prepare_run
    from dipaco_server.runs.services import create_run
    from dipaco_server.workers.services import create_enrollment_token

    outer: dict[str, Any] = {"overlap": overlap}
    if eager_at is not None:
        outer["eager_at"] = eager_at
    config = RunConfig.tiny(rounds=rounds, inner={"steps": steps, "warmup_steps": 2}, outer=outer)
    spec = config.model_dump(mode="json")
    del spec["name"]
    run = prepare_run(create_run("utilisation", spec), max_files=200)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=1)
    return run.pk, enrollment, rounds * config.num_paths * config.replicas_per_path


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()


def end_to_end(
    rounds: int,
    steps: int,
    threads: int,
    keep: Path | None = None,
    overlap: str = "none",
    eager_at: float | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agent-e2e-") as tmp:
        root = Path(tmp)
        server, url, environ = _start_server(root)
        worker: subprocess.CompletedProcess[str] | None = None
        try:
            run_id, enrollment, units = _prepared_run(environ, rounds, steps, overlap, eager_at)
            command = [str(Path(sys.executable).with_name("dipaco-worker")), "--server", url,
                       "--enroll", enrollment, "--data-dir", str(root / "worker"),
                       "--json-logs", "--threads", str(threads), "--max-units", str(units),
                       "--checkpoint-every", "1000"]  # fmt: skip
            worker = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            events = [json.loads(line) for line in worker.stdout.splitlines()
                      if line.startswith("{")]  # fmt: skip
            if worker.returncode != 0:
                raise SystemExit(f"dipaco-worker failed:\n{worker.stdout[-3000:]}{worker.stderr}")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
            if keep is not None:  # the server's log and the worker's JSON events, for a look
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / "server.log", keep / "server.log")
                if worker is not None:
                    (keep / "worker.jsonl").write_text(worker.stdout)
    leases = [e for e in events if e["event"] == "lease"]
    fetched = [e for e in events if e["event"] == "fetched"]
    done = [e for e in events if e["event"] == "completed"]
    wall = _stamp(done[-1]) - _stamp(leases[0])
    train = sum(float(e["train_seconds"]) for e in done)
    fetch = sum(_stamp(f) - _stamp(lease) for lease, f in zip(leases, fetched, strict=True))
    waiting = sum(_stamp(lease) - _stamp(d) for d, lease in zip(done, leases[1:], strict=False))
    return {"run_id": run_id, "rounds": rounds, "units": len(done), "steps": steps,
            "wall_s": wall, "train_s": train, "utilisation": train / wall,
            "fetch_s": fetch, "between_units_s": waiting,
            "train_to_complete_s": wall - train - fetch - waiting,
            "idle_polls": sum(e["event"] == "idle" for e in events), "overlap": overlap,
            "eager_at": eager_at,
            # outer.overlap eager: units that rebased, fell back to delayed, seconds waited
            "rebased": sum(e["event"] == "rebase" for e in events),
            "rebase_fallbacks": sum(e["event"] == "rebase_fallback" for e in events),
            "rebase_wait_s": sum(float(e.get("rebase_wait_s") or 0.0) for e in done),
            "load": os.getloadavg() if hasattr(os, "getloadavg") else None}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "150m"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="H: inner steps per unit")
    parser.add_argument("--micro-batch", type=int, help="sequences per micro-batch")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--e2e", action="store_true", help="also measure utilisation (minutes)")
    parser.add_argument("--rounds", type=int, default=3, help="--e2e: outer rounds")
    parser.add_argument(
        "--overlap",
        choices=["none", "delayed", "eager"],
        default=OuterConfig().overlap,
        help="--e2e: the run's outer.overlap (default %(default)s, the run default)",
    )
    parser.add_argument(
        "--eager-at",
        type=float,
        help="--e2e with --overlap eager: outer.eager_at, the fraction of a unit's steps after "
        "which it waits for and rebases onto the previous round's versions (default: the "
        "run default, 0.1); later waits less when the outer step is long",
    )
    parser.add_argument(
        "--keep", type=Path, help="--e2e: copy the server log and the worker's events here"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = preset(args.preset, args.steps, args.micro_batch, args.accum)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="agent-overhead-") as tmp:
        root = Path(tmp)
        window_path = root / "window.bin"
        write_window(config, window_path)
        window = torch.from_numpy(np.fromfile(window_path, dtype=_dtype(config)).astype(np.int64))
        states, work = InnerStates(root / "inner"), root / "work"
        bare_loop(config, window, device)  # warm-up: allocator, kernels, thread pools
        agent_unit(config, window_path, device, work, states)  # also makes the AdamW state warm
        bare: list[Rates] = []
        inner: list[Rates] = []
        unit: list[float] = []
        for repeat in range(args.repeats):  # the order alternates: neither side always first
            if repeat % 2 == 0:
                bare.append(bare_loop(config, window, device))
            agent = agent_unit(config, window_path, device, work, states)
            inner.append(agent[0])
            unit.append(agent[1])
            if repeat % 2 == 1:
                bare.append(bare_loop(config, window, device))
    # Each repeat's agent run sits next to a bare run in time: the median of those paired
    # ratios cancels most of a shared machine's drifting load; the best-of figures follow.
    pairs = [
        (i[0] / b[0], i[1] / b[1], u / b[0]) for i, b, u in zip(inner, bare, unit, strict=True)
    ]
    ratio, ratio_cpu, unit_ratio = (statistics.median(p[k] for p in pairs) for k in range(3))
    cpu = device.type == "cpu"
    figures: dict[str, Any] = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "params": config.num_params(),
        "steps": config.inner.steps,
        "batch": f"{config.inner.micro_batch_size} x {config.inner.grad_accum_steps} x "
        f"{config.model.seq_len}",
        "repeats": args.repeats,
        "bare_tokens_per_s": max(b[0] for b in bare),
        "agent_inner_tokens_per_s": max(i[0] for i in inner),
        "agent_unit_tokens_per_s": max(unit),
        "inner_ratio": ratio,
        "inner_ratio_cpu_time": ratio_cpu if cpu else None,
        "unit_ratio": unit_ratio,
        "pairs": pairs,
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    table = Table(title=f"agent vs bare loop: {args.preset} ({figures['params'] / 1e6:.1f}M "
                  f"params), {figures['device']}, H={config.inner.steps}, "
                  f"batch {figures['batch']}")  # fmt: skip
    for column in ("loop", "best tokens/s", "ratio to bare", "by CPU time"):
        table.add_column(column, justify="right")
    by_cpu = (lambda r: f"{r:.3f}") if cpu else (lambda r: "-")
    table.add_row("bare PyTorch + transformers", f"{figures['bare_tokens_per_s']:,.0f}",
                  "1.000", by_cpu(1.0))  # fmt: skip
    table.add_row("agent inner loop", f"{figures['agent_inner_tokens_per_s']:,.0f}",
                  f"{ratio:.3f}", by_cpu(ratio_cpu))  # fmt: skip
    table.add_row("agent whole unit", f"{max(unit):,.0f}", f"{unit_ratio:.3f}", "")
    console.print(table)
    console.print(
        f"ratios: median of {args.repeats} adjacent (agent, bare) pairs; threads "
        f"{figures['threads']}; load {figures['load']}"
    )
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
        # The keys first: end-to-end utilisation (with --e2e) and the inner loop's
        # tokens/s against the bare loop.
        utilisation = figures["e2e"]["utilisation"] if args.e2e else None
        head = {"utilisation": utilisation, "inner_vs_bare": figures["inner_ratio"]}
        command = " ".join([Path(sys.executable).name, *sys.argv])
        args.json.write_text(json.dumps({**head, "command": command, **figures}, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
