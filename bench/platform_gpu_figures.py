"""bench/platform_gpu.py's measurements: memory while the run goes, and the figures of the
JSON from what the worker printed and the server's API served (pure functions: tests give
them canned inputs)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from dipaco.config import RunConfig
from dipaco.flops import flops_per_token, peak_flops

SAMPLE_S = 0.5

# --- memory: the server's process tree, the GPU --------------------------------------------


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def rss_bytes(pid: int) -> int:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (shared pages split among their sharers), from
    /proc/PID/smaps_rollup: what summing processes' memory should add up."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def memory_parts(config: Any, device: str = "cpu") -> dict[str, int]:
    """What the worker's memory holds at one path of `config`, by design (bytes, from the
    path's parameter count N and the unit's shapes; accounting, not a measurement): the
    resident model's fp32 parameters and AdamW moments, θ_old (the module weights the unit
    started from, for Δ), and either what a unit trains with (its gradients, a
    micro-batch's logits and their gradient, its data: at most two row chunks,
    dipaco.data.rows.UnitRows) or what its hand-in holds (Δ in fp32 until it is encoded,
    and the codec's error-feedback residual). On the CPU the two never meet: a unit's end
    lets the gradients go before Δ is made (dipaco.inner.loop), and the next unit's modules
    are read once the last Δ is encoded (worker_agent.agent), so the peak by design is
    the larger of `training_bytes` and `hand_in_bytes`, given beside the parts. On a GPU
    the hand-in overlaps training in host memory, with the checkpoint's pinned host
    buffers (weights and moments) and the moments' copy a unit's end hands the next unit;
    on the CPU neither exists (dipaco.inner.checkpoint writes the live tensors, and the
    moments are read back from the file). The encoded upload is written to disk a module
    at a time. Activations, module files being read and the runtime are not in it: the
    measured peak less the larger phase is what they and transient copies hold."""
    from dipaco.data.rows import CHUNK_BYTES

    n = config.num_params()
    T, B = config.model.seq_len, config.inner.micro_batch_size
    parts = {
        "parameters": 4 * n,
        "adamw_moments": 8 * n,
        "base_snapshot": 4 * n,
        "gradients": 4 * n,
        "logits": B * T * config.model.vocab_size * 4 * 2,  # a micro-batch's and their grad
        "data": min(
            2 * CHUNK_BYTES, 2 * config.inner.steps * config.inner.batch_size * (T + 1) * 2
        ),
        "delta": 4 * n,
        "residual": 4 * n,
    }
    resident = parts["parameters"] + parts["adamw_moments"] + parts["base_snapshot"]
    training = resident + parts["gradients"] + parts["logits"] + parts["data"]
    hand_in = parts["delta"] + parts["residual"]
    if device != "cpu":
        parts.update(checkpoint_buffers=12 * n, adamw_moments_copy=8 * n)
        training += hand_in + parts["checkpoint_buffers"] + parts["adamw_moments_copy"]
        hand_in = training
    else:
        hand_in += resident
    parts.update(training_bytes=training, hand_in_bytes=hand_in)
    return parts


def gpu_memory() -> tuple[int | None, dict[int, int]]:
    """(device memory used, used memory by pid) in bytes, from nvidia-smi; (None, {})
    where there is none."""
    try:
        device = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, {}
    used = sum(int(x) for x in device.split() if x.strip().isdigit()) * 2**20
    by_pid = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            by_pid[int(parts[0])] = int(parts[1]) * 2**20
    return used, by_pid


class MemorySampler(threading.Thread):
    """Peaks of the server tree's summed RSS, the worker's RSS and GPU memory (device,
    server processes, worker), every SAMPLE_S seconds until stopped, and when the worker's
    summed PSS peaked (`worker_pss_peak_at`, unix seconds)."""

    def __init__(self, server_pid: int, gpu: bool) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.server_pid, self.gpu = server_pid, gpu
        self.worker_pid: int | None = None
        self.peaks: dict[str, float | None] = {
            "server_rss_bytes": 0, "server_processes": 0, "worker_rss_bytes": 0,
            "server_pss_bytes": 0, "worker_pss_bytes": 0, "worker_processes": 0,
            "gpu_bytes": None, "gpu_server_bytes": None, "gpu_worker_bytes": None,
            "worker_pss_peak_at": None,
        }  # fmt: skip
        self.done = threading.Event()

    def _peak(self, key: str, value: int | None) -> None:
        if value is not None:
            self.peaks[key] = max(self.peaks[key] or 0, value)

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            server = process_tree(self.server_pid)
            self._peak("server_rss_bytes", sum(rss_bytes(p) for p in server))
            self._peak("server_processes", len(server))
            self._peak("server_pss_bytes", sum(pss_bytes(p) for p in server))
            worker = process_tree(self.worker_pid) if self.worker_pid else []
            self._peak("worker_rss_bytes", sum(rss_bytes(p) for p in worker))
            worker_pss = sum(pss_bytes(p) for p in worker)
            if worker_pss > (self.peaks["worker_pss_bytes"] or 0):
                # When (unix time): the worker's events (worker.jsonl) say what it was doing.
                self.peaks["worker_pss_peak_at"] = round(time.time(), 1)
            self._peak("worker_pss_bytes", worker_pss)
            self._peak("worker_processes", len(worker))
            if self.gpu:
                used, by_pid = gpu_memory()
                self._peak("gpu_bytes", used)
                self._peak("gpu_server_bytes", sum(by_pid.get(p, 0) for p in server))
                self._peak("gpu_worker_bytes", sum(by_pid.get(p, 0) for p in worker))

    def stop(self) -> dict[str, float | None]:
        self.done.set()
        self.join(timeout=30)
        return dict(self.peaks)


# --- the figures ------------------------------------------------------------------------------


def stamp(value: str) -> float:
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def worker_figures(
    events: list[dict[str, Any]], step_tokens: int, flops_token: float, peak: float | None
) -> dict[str, Any]:
    """Utilisation and MFU from the worker's JSON events (`dipaco-worker --json-logs`).

    A unit's first step event comes after its first step, whose seconds (step tokens over
    that event's tokens/s) hold the compile on the worker's first unit. The window is
    from the first unit's first step event to the last unit's last (its final step):
    **utilisation** = the units' training seconds (``train_seconds`` of each completion)
    less the first unit's first step, over that window; **mfu** = the tokens trained in
    it over it, as a share of the device's peak; **unit_mfu** = the median over units of
    their own tokens/s (the worker's figure for a unit; the first one's without its first
    step). Everything before the window
    (server start, preparation, enrolment, the first fetch, compiling) is the
    "before_first_step" seconds, reported apart.
    """
    steps = [e for e in events if e.get("event") == "step"]
    done = [e for e in events if e.get("event") == "completed"]
    if not steps or not done:
        return {"units": len(done), "utilisation": None, "mfu": None, "unit_mfu": None}
    first = steps[0]
    first_step_s = step_tokens * int(first.get("step", 1)) / float(first["tokens_per_second"])
    window = stamp(steps[-1]["time"]) - stamp(first["time"])
    train = sum(float(e["train_seconds"]) for e in done)
    tokens = sum(float(e["train_seconds"]) * float(e["tokens_per_second"]) for e in done)
    first_tokens = step_tokens * int(first.get("step", 1))
    trained_in_window = tokens - first_tokens
    # each unit's own tokens/s; the first unit's without its first step (the compile)
    speeds = [float(e["tokens_per_second"]) for e in done]
    head = float(done[0]["train_seconds"]) - first_step_s
    if head > 0:
        speeds[0] = (float(done[0]["train_seconds"]) * speeds[0] - first_tokens) / head
    unit_speed = statistics.median(speeds)

    def share(tokens_per_s: float) -> float | None:
        return None if peak is None else tokens_per_s * flops_token / peak

    mfu = share(trained_in_window / window) if window > 0 else None
    unit_mfu = share(unit_speed)
    return {
        "units": len(done),
        "train_seconds": train,
        "window_seconds": window,
        "first_step_seconds": first_step_s,
        "utilisation": (train - first_step_s) / window if window > 0 else None,
        "tokens": tokens,
        "tokens_per_second": trained_in_window / window if window > 0 else None,
        "unit_tokens_per_second": unit_speed,
        "mfu": mfu,
        "unit_mfu": unit_mfu,
        "mfu_vs_unit": mfu / unit_mfu if mfu is not None and unit_mfu else None,
        "unit_seconds": [float(e["train_seconds"]) for e in done],
        "unit_steps": [int(float(e.get("steps", 0))) for e in done],
    }


def round_figures(
    rounds: list[dict[str, Any]], losses: list[dict[str, Any]], traffic: list[dict[str, int]]
) -> list[dict[str, Any]]:
    """Each round (oldest first): its wall seconds, every stage's wall and summed task
    seconds (GET /runs/{id}/rounds), the validation loss after it (mean over paths and
    per path, GET /runs/{id}/metrics?name=val_loss) and the bytes it moved."""
    by_round: dict[int, dict[int, float]] = {}
    for point in losses:
        if point.get("round") is not None and point.get("path") is not None:
            by_round.setdefault(int(point["round"]), {})[int(point["path"])] = point["value"]
    moved = {r["round"]: r for r in traffic}
    out = []
    for r in sorted(rounds, key=lambda r: r["t"]):
        t = r["t"]
        closed = r.get("closed_at")
        paths = by_round.get(t, {})
        out.append({
            "round": t,
            "state": r.get("state"),
            "wall_seconds": stamp(closed) - stamp(r["opened_at"]) if closed else None,
            "stages": {s["stage"]: {"wall_seconds": s["wall_seconds"], "seconds": s["seconds"],
                                    "tasks": s["tasks"]} for s in r.get("stages", [])},
            "val_loss": sum(paths.values()) / len(paths) if paths else None,
            "val_loss_by_path": [paths[p] for p in sorted(paths)],
            "upload_bytes": moved.get(t, {}).get("upload", 0),
            "download_bytes": moved.get(t, {}).get("download", 0),
        })  # fmt: skip
    return out


def summarise(
    events: list[dict[str, Any]],
    rounds: list[dict[str, Any]],
    losses: list[dict[str, Any]],
    traffic: list[dict[str, int]],
    config: RunConfig,
    device: str,
) -> dict[str, Any]:
    """The JSON's figures: "device", "params", "utilisation", "mfu" (worker_figures),
    "rounds" (round_figures) and the bytes moved each way in all."""
    step_tokens = config.inner.batch_size * config.model.seq_len
    peak = peak_flops(device)
    worker = worker_figures(events, step_tokens, flops_per_token(config.model), peak)
    return {
        "device": device,
        "params": config.num_params(),
        "utilisation": worker["utilisation"],
        "mfu": worker["mfu"],
        "unit_mfu": worker["unit_mfu"],
        "rounds": round_figures(rounds, losses, traffic),
        "upload_bytes": sum(r["upload"] for r in traffic),
        "download_bytes": sum(r["download"] for r in traffic),
        "worker": worker,
        "peak_flops": peak,
        "step_tokens": step_tokens,
    }


def read_events(path: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    if not path.is_file():  # no worker started
        return events
    for line in path.read_text("utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events
