"""Codec throughput on a module-sized Δ, as ratios to a plain memory copy of the same bytes.

    .venv/bin/python bench/codec.py                  # 50M parameters, every codec
    .venv/bin/python bench/codec.py --params 5e6 --json out.json

For each codec: encode and decode speed in GB/s of fp32 input, encoded size against fp32, and
the server's hot path, ``accumulate`` (decode + ``into += w * Δ`` + norm, checksum included or
not), as a multiple of ``dst.copy_(src)`` over the module's fp32 bytes. Each time is the best
of ``--repeats`` runs. Figures and the command that produced them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from dipaco import codecs


def make_module(params: int, seed: int) -> dict[str, torch.Tensor]:
    """A handful of tensors totalling ``params`` values, scaled like a real Δ (~1e-3)."""
    generator = torch.Generator().manual_seed(seed)
    shares = {"attn.qkv": 0.3, "attn.out": 0.1, "mlp.up": 0.25, "mlp.down": 0.25, "mlp.gate": 0.1}
    module: dict[str, torch.Tensor] = {}
    left = params
    for name, share in shares.items():
        rows = int(params * share) // 1024
        module[name] = torch.randn(rows, 1024, generator=generator) * 1e-3
        left -= rows * 1024
    module["norm"] = torch.randn(left, generator=generator) * 1e-3  # odd size: a partial block
    return module


def best_seconds(action: Callable[[], object], repeats: int) -> float:
    action()  # warm-up: page faults, allocator, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def make_copy(values: int) -> Callable[[], object]:
    """The baseline: one fp32 memory copy of the module's size."""
    source = torch.randn(values)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def measure(
    module: dict[str, torch.Tensor],
    codec: str,
    block: int,
    repeats: int,
    copy: Callable[[], object],
) -> dict[str, float]:
    fp32_bytes = 4 * sum(t.numel() for t in module.values())
    data = codecs.encode(module, codec, block_size=block)
    expected = codecs.spec_of(module)
    into = {name: torch.zeros_like(t) for name, t in module.items()}
    decoded = codecs.decode(data, expected)
    error = torch.stack([(decoded[n] - t).pow(2).sum() for n, t in module.items()]).sum().sqrt()
    norm = torch.stack([t.pow(2).sum() for t in module.values()]).sum().sqrt()
    del decoded
    encode_s = best_seconds(lambda: codecs.encode(module, codec, block_size=block), repeats)
    decode_s = best_seconds(lambda: codecs.decode(data, expected), repeats)
    # the baseline is timed right before the figures divided by it: other load drifts
    copy_s = best_seconds(copy, repeats)
    accumulate_s = best_seconds(lambda: codecs.accumulate(data, into, 0.5, expected), repeats)
    unchecked_s = best_seconds(
        lambda: codecs.accumulate(data, into, 0.5, expected, verify_checksum=False), repeats
    )
    return {
        "bytes_vs_fp32": len(data) / fp32_bytes,
        "encode_gb_s": fp32_bytes / encode_s / 1e9,
        "decode_gb_s": fp32_bytes / decode_s / 1e9,
        "copy_ms": copy_s * 1e3,
        "accumulate_ms": accumulate_s * 1e3,
        "accumulate_x_copy": accumulate_s / copy_s,
        "accumulate_unchecked_x_copy": unchecked_s / copy_s,
        "relative_l2_error": float(error / norm),
    }


COLUMNS = {
    "size": ("bytes_vs_fp32", "{:.3f}"),
    "enc GB/s": ("encode_gb_s", "{:.2f}"),
    "dec GB/s": ("decode_gb_s", "{:.2f}"),
    "copy ms": ("copy_ms", "{:.1f}"),
    "acc ms": ("accumulate_ms", "{:.1f}"),
    "acc/copy": ("accumulate_x_copy", "{:.2f}"),
    "no-sha/copy": ("accumulate_unchecked_x_copy", "{:.2f}"),
    "rel err": ("relative_l2_error", "{:.1e}"),
}


def render(results: dict[str, dict[str, float]], total: int, threads: int) -> Table:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table = Table(
        title=f"codecs on {total / 1e6:.1f}M fp32 values, {threads} torch threads, load {load}",
        caption="size: encoded/fp32 bytes; GB/s of fp32 values; acc: accumulate (decode, "
        "into += w·Δ, norm) with sha256 check; no-sha: verify_checksum=False; "
        "rel err: |decoded − Δ| / |Δ|",
    )
    table.add_column("codec")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for codec, row in results.items():
        table.add_row(codec, *(fmt.format(row[key]) for key, fmt in COLUMNS.values()))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--params", type=float, default=50e6, help="values in the module (default 50M)"
    )
    parser.add_argument("--codecs", nargs="+", default=list(codecs.CODECS), choices=codecs.CODECS)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs per figure")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        # On a shared machine an OpenMP worker whose core is taken stalls every parallel op
        # (10-100x swings seen on the 2-core dev box); one thread gives repeatable ratios.
        help="torch intra-op threads (default 1; the copy baseline uses the same)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    module = make_module(int(args.params), args.seed)
    total = sum(t.numel() for t in module.values())
    copy = make_copy(total)
    results = {
        codec: measure(module, codec, args.block_size, args.repeats, copy) for codec in args.codecs
    }

    Console(width=130).print(render(results, total, torch.get_num_threads()))
    if args.json_path:
        machine = {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
            "load_average": os.getloadavg(),
        }
        report = {
            "params": total,
            "block_size": args.block_size,
            "machine": machine,
            "codecs": results,
        }
        with open(args.json_path, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
