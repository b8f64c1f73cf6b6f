"""Where a step of the worker's loop spends its time: torch.profiler over one 150M step.

    python3 bench/profile_step.py                                   # on a GPU: 150m, 64 x 1,024
    DIPACO_COMPILE_MODE=max-autotune-no-cudagraphs python3 bench/profile_step.py
    .venv/bin/python bench/profile_step.py --device cpu --preset tiny --batch 4   # dry run

It builds the agent's trainer (dipaco.inner.ResidentTrainer: compiled on CUDA, the loss
inside the compiled graph, fused AdamW, the micro-batch fitted to the device's free
memory), trains `--warmup-steps` steps (compiling, autotuning), then profiles a unit of
`--steps` steps (1: one step plus the unit's start and end) and prints the top entries by
device time (by CPU time on the CPU), and the trace's path for chrome://tracing or
Perfetto. `--sdpa` also times each scaled-dot-product-attention backend at the model's
head dimension (56 at 150m: FlashAttention takes multiples of 8) and names the one that
the default call runs. Nothing is written unless `--trace` names a file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from dipaco.config import RunConfig
from dipaco.data.windows import ShardSource
from dipaco.inner import InMemoryTokenSource, ResidentTrainer, UnitWork, fit_micro_batch
from dipaco.modular import init_modules


def preset(name: str, batch: int, steps: int) -> RunConfig:
    inner = {"steps": steps, "micro_batch_size": batch, "grad_accum_steps": 1}
    if name == "tiny":
        return RunConfig.tiny(rounds=10, inner={**inner, "warmup_steps": 1})
    if name == "150m":
        return RunConfig.paper_150m(rounds=10, inner={**inner, "warmup_steps": 1})
    raise SystemExit(f"unknown preset {name!r}: tiny or 150m")


def fitted(config: RunConfig, device: torch.device, compiled: bool) -> RunConfig:
    budget = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    inner = fit_micro_batch(config, budget, device.type, whole_logits=compiled)
    return config.model_copy(update={"inner": inner})


def unit(config: RunConfig, steps: int) -> UnitWork:
    model = config.model
    tokens = torch.randint(model.vocab_size, ((steps + 1) * config.inner.batch_size
                                              * (model.seq_len + 1),))  # fmt: skip
    source: ShardSource | InMemoryTokenSource = InMemoryTokenSource(tokens)
    return UnitWork(config, 1, 0, 0, init_modules(config), source)


def with_steps(config: RunConfig, steps: int) -> RunConfig:
    return config.model_copy(update={"inner": config.inner.model_copy(update={"steps": steps})})


def sdpa_backends(config: RunConfig, device: torch.device, micro: int) -> None:
    """Each backend's forward and backward at the model's attention shape, bf16, causal."""
    m = config.model
    shape = (micro, m.num_heads, m.seq_len, m.head_dim)  # (B, H, T, D)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    print(f"SDPA at head dim {m.head_dim}, {shape}:")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):  # fmt: skip
        try:
            with sdpa_kernel(backend):
                for _ in range(3):  # warm-up, then the timed call
                    started = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
            print(f"  {backend.name:20s} {1e3 * (time.perf_counter() - started):8.2f} ms")
        except RuntimeError as error:
            print(f"  {backend.name:20s} not available ({str(error).splitlines()[0][:80]})")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])  # fmt: skip
    with profile(activities=activities) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    names = {e.key for e in prof.key_averages() if "attention" in e.key.lower()
             or "fmha" in e.key.lower() or "flash" in e.key.lower()}  # fmt: skip
    print(f"  the default call runs: {sorted(names)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="150m", choices=["tiny", "150m"])
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps in the profiled unit")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--top", type=int, default=25, help="entries of the table")
    parser.add_argument("--trace", type=Path, help="write the chrome trace here")
    parser.add_argument("--sdpa", action="store_true", help="time the SDPA backends too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    compiled = device.type == "cuda" if args.compile is None else args.compile
    config = fitted(preset(args.preset, args.batch, args.warmup_steps), device, compiled)
    inner = config.inner
    print(f"{args.preset} on {device}, batch {inner.micro_batch_size} x "
          f"{inner.grad_accum_steps} x {config.model.seq_len}, compiled {compiled}")  # fmt: skip
    trainer = ResidentTrainer(device, compile=compiled)
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        trainer.train(unit(config, args.warmup_steps), work_dir=Path(tmp) / "warm")
        profiled = with_steps(config, args.steps)
        work = unit(profiled, args.steps)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            result, _ = trainer.train(work, work_dir=Path(tmp) / "unit")
        result.checkpoint_written()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    print(f"the unit's parts outside its steps (s): {result.timings}")
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
        print(f"trace: {args.trace}")
    if args.sdpa:
        sdpa_backends(config, device, inner.micro_batch_size)


if __name__ == "__main__":
    main(sys.argv[1:])
