"""One module's outer step on the server, against a plain read of the bytes it reads.

    .venv/bin/python bench/outer_step.py                    # 50M parameters, 8 Δs, every codec
    .venv/bin/python bench/outer_step.py --params 5e6 --contributions 4 --codecs fp16

For each codec, `contributions` pseudo-gradients of a `params`-value module are encoded
and stored in a local blob store (a temporary directory), with version `base` and its
momentum. Then `rounds.verification.judge.judge_uploads` and `rounds.outer.step.step_judged`
run exactly as the Celery task runs them: fetch each upload (sha256 while it streams),
verify it, norm outliers, then accumulate the accepted ones into one fp32 sum, and the Nesterov step streaming version `base` and its
momentum in and version t + 1 and its momentum out. Reported:

- **step s**: the whole step, best of ``--repeats``; **read s**: reading the same bytes
  (every upload, the base weights and momentum) from the store, timed just before;
  **step/read**: their ratio; **copy s**: copying just the uploads to local files, which
  the step must do once (they are read twice, and an S3 body only once), and **step/copy**;
- **verify / agg / nesterov s**: the three phases of the best run;
- **peak/module**: peak RSS growth during the step over the module's fp32 size (the
  kernel's high-water mark, reset right before the step; the goal is <= 3, so a server holds a few modules at once).

Figures and the command that produced them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dipaco.codecs.registry import CODECS

KIB = 1024


def setup_django(data_dir: Path) -> None:
    """The server's settings on a throwaway data dir (SQLite is never opened)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")
    os.environ["DIPACO_DATA_DIR"] = str(data_dir)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))
    import django

    django.setup()


def module_spec(params: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Six tensors totalling `params` values, one of odd size (a partial codec block)."""
    shares = {"attn.qkv": 0.3, "attn.out": 0.1, "mlp.up": 0.25, "mlp.down": 0.25, "mlp.gate": 0.1}
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    left = params
    for name, share in shares.items():
        rows = int(params * share) // 1024
        spec[name] = ((rows, 1024), torch.float32)
        left -= rows * 1024
    spec["norm"] = ((left,), torch.float32)
    return spec


def random_tensors(spec: dict, seed: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) * scale for name, (shape, _) in spec.items()
    }


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def read_all(store: object, keys: list[str]) -> None:
    for key in keys:
        for _ in store.iter_chunks(key):  # type: ignore[attr-defined]
            pass


def copy_all(store: object, keys: list[str], directory: Path) -> None:
    """What pass 1 cannot avoid: each upload copied to a local file (then deleted)."""
    for key in keys:
        target = directory / "copy"
        store.download_to(key, target)  # type: ignore[attr-defined]
        target.unlink()


def measure(codec: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    from dipaco.codecs import encode
    from dipaco.config import OuterConfig
    from dipaco.modules_file import write_module
    from dipaco_server.rounds.outer.step import BaseVersion, step_judged
    from dipaco_server.rounds.verification.judge import judge_uploads
    from dipaco_server.rounds.verification.uploads import Upload
    from dipaco_server.storage.local import LocalBlobStore

    store = LocalBlobStore(root / "blobs", public_url="http://127.0.0.1", secret="bench")
    spec = module_spec(int(args.params))
    base = root / "base.safetensors"
    sha, _ = write_module(base, random_tensors(spec, 0, 0.02))
    store.put_file("base", base)
    write_module(base, random_tensors(spec, 1, 1e-3))
    store.put_file("momentum", base)
    base.unlink()
    uploads, encoded = [], 0
    for i in range(args.contributions):
        data = encode(random_tensors(spec, 10 + i, 1e-3), codec, block_size=64)
        store.put_bytes(f"delta/{i}", data)
        digest = hashlib.sha256(data).hexdigest()  # the Δs spread over --paths paths
        uploads.append(Upload(i, 0, f"delta/{i}", len(data), digest, 1000, i % args.paths))
        encoded += len(data)
        del data
    version = BaseVersion(0, "base", sha, "momentum")
    cfg = OuterConfig()
    read_keys = [u.key for u in uploads] + ["base", "momentum"]
    best: dict[str, float] = {"step_s": float("inf")}
    peak_growth = 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        read_all(store, read_keys)
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        copy_all(store, [u.key for u in uploads], root)
        copy_s = time.perf_counter() - start
        work = Path(tempfile.mkdtemp(dir=root))
        exact = reset_peak()
        before = rss_kib("VmRSS:") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        judgement = judge_uploads(store, uploads, spec, cfg, work)
        result = step_judged(store, judgement, version, spec, cfg, work, round_index=0)
        step_s = time.perf_counter() - start
        after = rss_kib("VmHWM:") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert result.weights is not None and all(v.accepted for v in result.verdicts)
        peak_growth = max(peak_growth, after - before)
        shutil.rmtree(work)
        if step_s < best["step_s"]:
            timings = result.timings
            best = {
                "step_s": step_s,
                "read_s": read_s,
                "copy_s": copy_s,
                "verify_s": timings["verify"],
                "aggregate_s": timings["aggregate"] - timings["verify"],
                "nesterov_s": step_s - timings["aggregate"],
            }
    fp32_bytes = 4 * sum(math.prod(shape) for shape, _ in spec.values())
    shutil.rmtree(root / "blobs")
    return {
        **best,
        "step_x_read": best["step_s"] / best["read_s"],
        "step_x_copy": best["step_s"] / best["copy_s"],
        "encoded_mb": encoded / 1e6,
        "read_mb": (encoded + 2 * fp32_bytes) / 1e6,
        "peak_x_module": peak_growth * KIB / fp32_bytes,
        "peak_exact": float(exact),
    }


COLUMNS = {
    "uploads MB": ("encoded_mb", "{:.0f}"),
    "read s": ("read_s", "{:.2f}"),
    "step s": ("step_s", "{:.2f}"),
    "step/read": ("step_x_read", "{:.1f}"),
    "copy s": ("copy_s", "{:.2f}"),
    "step/copy": ("step_x_copy", "{:.1f}"),
    "verify s": ("verify_s", "{:.2f}"),
    "agg s": ("aggregate_s", "{:.2f}"),
    "nesterov s": ("nesterov_s", "{:.2f}"),
    "peak/module": ("peak_x_module", "{:.2f}"),
}


def render(results: dict[str, dict[str, float]], args: argparse.Namespace) -> Table:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table = Table(
        title=f"outer step: {args.params / 1e6:.0f}M-value module, {args.contributions} Δs, "
        f"{torch.get_num_threads()} torch threads, load {load}",
        caption="read: the same bytes read from the store; copy: the uploads copied to files; "
        "step: fetch + sha256, verify, accumulate, Nesterov with momentum, write v+1; "
        "peak: RSS growth / fp32 module",
    )
    table.add_column("codec")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for codec, row in results.items():
        table.add_row(codec, *(fmt.format(row[key]) for key, fmt in COLUMNS.values()))
    return table


# glibc raises its mmap threshold after big frees (up to 32 MiB), then keeps freed memory
# resident for reuse: a later step would reuse it without raising RSS and look smaller than
# it is. A fixed threshold maps every big buffer afresh and unmaps it on free.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def main() -> None:
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=50e6, help="module values (default 50M)")
    parser.add_argument("--contributions", type=int, default=8, help="Δs in the round (default 8)")
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    parser.add_argument(
        "--paths", type=int, default=2, help="paths the contributions come from (√ rescale)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="best of this many steps")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: repeatable on a shared machine, see bench/codec.py)",
    )
    parser.add_argument("--dir", help="where the blobs go (default: a temporary directory)")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.dir is not None:  # a folder that does not exist yet is made, not refused
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dipaco-bench-outer-", dir=args.dir))
    try:
        setup_django(root / "data")
        results = {codec: measure(codec, args, root) for codec in args.codecs}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Console(width=130).print(render(results, args))
    if args.json_path:
        machine = {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
            "load_average": os.getloadavg(),
        }
        report = {"args": vars(args), "machine": machine, "codecs": results}
        with open(args.json_path, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
