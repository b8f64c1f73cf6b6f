"""Which accelerator to train on, what it is, and how fast it trains a tiny model.

``--device auto`` takes CUDA, then Apple's MPS, then the CPU. When a machine has an
NVIDIA driver but torch was built without CUDA, the agent says so instead of silently
training on the CPU (the most common "GPU not detected" cause). The speed probe trains
a two-block Llama for about a second; its tokens/s goes to the server with the device
description, so the first lease gets a sensible deadline before any unit was timed.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dipaco.config import ModelConfig
from dipaco.model import build_model
from worker_agent.errors import UsageError

__all__ = ["DeviceInfo", "apply_memory_cap", "detect_device", "speed_probe"]

log = logging.getLogger(__name__)


@dataclass
class DeviceInfo:
    device: torch.device
    name: str  # "NVIDIA H100 80GB HBM3", "Apple MPS", "cpu (x86_64, 16 threads)"
    memory_bytes: int | None  # accelerator memory, or None when unknown (CPU, MPS)
    probe_tokens_per_second: float | None = None

    def describe(self) -> dict[str, Any]:
        """The JSON the server stores for the dashboard (workers.Worker.device)."""
        described: dict[str, Any] = {
            "kind": self.device.type,
            "name": self.name,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "os": platform.system(),
        }
        if self.memory_bytes is not None:
            described["memory_gb"] = round(self.memory_bytes / 1024**3, 1)
        if self.probe_tokens_per_second is not None:
            described["probe_tokens_per_second"] = round(self.probe_tokens_per_second, 1)
        return described


def select_gpus(gpus: str | None) -> None:
    """Restrict CUDA to the listed GPUs (``--gpus 0,2``); must run before CUDA starts."""
    if gpus is None:
        return
    ids = [part.strip() for part in gpus.split(",") if part.strip()]
    if not ids or not all(part.isdigit() for part in ids):
        raise UsageError(f"--gpus {gpus!r}: give GPU indices separated by commas, e.g. 0 or 0,1")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)


def detect_device(requested: str = "auto") -> DeviceInfo:
    """The device for `requested` (auto, cuda, cuda:N, mps, cpu), or UsageError saying why not."""
    kind = requested.split(":")[0]
    if kind not in ("auto", "cuda", "mps", "cpu"):
        raise UsageError(f"--device {requested!r}: choose auto, cuda, cuda:N, mps or cpu")
    cuda = torch.cuda.is_available()
    mps = torch.backends.mps.is_available()
    if kind == "cuda" or (kind == "auto" and cuda):
        if not cuda:
            raise UsageError(f"--device {requested}: {_why_no_cuda()}")
        device = torch.device(requested if ":" in requested else "cuda:0")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {requested}: only {torch.cuda.device_count()} GPU(s) are visible"
            )
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(device, props.name, int(props.total_memory))
    if kind == "mps" or (kind == "auto" and mps):
        if not mps:
            raise UsageError(f"--device {requested}: this torch build or machine has no MPS")
        return DeviceInfo(torch.device("mps"), "Apple MPS", None)
    if kind == "auto" and shutil.which("nvidia-smi"):
        log.warning("an NVIDIA driver is installed but %s; training on the CPU", _why_no_cuda())
    name = f"cpu ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"
    return DeviceInfo(torch.device("cpu"), name, None)


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} was built without CUDA; install a CUDA build of "
            "torch (https://pytorch.org/get-started/locally/) and run again"
        )
    return "torch has CUDA but sees no GPU; check nvidia-smi and CUDA_VISIBLE_DEVICES"


def apply_memory_cap(info: DeviceInfo, cap_bytes: int | None) -> int | None:
    """Limit this process to `cap_bytes` of accelerator memory; returns the budget to plan
    micro-batches with (None without a cap: the out-of-memory fallback finds the size, since
    the library's memory estimate is a deliberately rough upper bound)."""
    if cap_bytes is None:
        return None
    if info.device.type == "cuda" and info.memory_bytes:
        fraction = min(1.0, cap_bytes / info.memory_bytes)
        torch.cuda.set_per_process_memory_fraction(fraction, info.device)
    return cap_bytes if info.memory_bytes is None else min(cap_bytes, info.memory_bytes)


def speed_probe(device: torch.device, seconds: float = 1.0) -> float:
    """Training tokens/s of a two-block, 128-wide Llama (batch 4 x 128): a relative speed."""
    cfg = ModelConfig(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=352,
        vocab_size=2048, seq_len=128,
    )  # fmt: skip
    model = build_model(cfg, seed=0, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=generator).to(device)

    def step() -> None:
        logits = model(batch).logits[:, :-1]  # next-token cross-entropy
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: kernels, allocator
    _sync(device)
    steps, started = 0, time.perf_counter()
    while steps < 2 or time.perf_counter() - started < seconds:
        step()
        steps += 1
    _sync(device)
    return steps * batch.numel() / (time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
