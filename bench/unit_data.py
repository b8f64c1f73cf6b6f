"""One unit's training data at the 150M preset's sizes, on an S3 server behind a slow link:
the design that cut a unit's windows inside the manifest request ("before") against row
chunks written in the order units read them ("after", dipaco.data.rows).

    .venv/bin/python bench/unit_data.py --json docs/figures/unit_data.json

A synthetic path of `--shard-units` units of `RunConfig.paper_150m()` windows (T = 1,024,
256,000 windows a unit: 525 MB) is written as the platform writes it: the token file and its
row chunks (runs.stages.upload_rows), uploaded to moto's S3 server through a proxy that adds
`--latency-ms` to every request and paces bodies at `--bandwidth-mbs` (bench/s3_link.py).

After, measured whole at the 150M sizes:
- the manifest (rounds.protocol.unit_data.rows_manifest: the row index read, the chunks'
  URLs signed) for a unit: its milliseconds and this thread's CPU seconds;
- 16 manifests at once: the process's peak RSS over idle (sampled every 2 ms);
- the worker's first batch: the manifest, then dipaco.data.rows.UnitRows fetching the first
  chunk through the worker's own transfer code (worker_agent.transfer.BlobCache: GET, sha256)
  until the first batch of 512 rows is in hand;
- requests a unit costs: the index, and one GET per chunk.

Before: the old cut (positions' windows read from the token file by ranged GETs, windows
within 4 KiB merged, 8 in flight, dipaco.data.ranged; the unit's int64 array; its blob
written, then downloaded by the worker). Its requests are its range plan's, computed
exactly for a whole unit on a path `--before-coverage` units long (the simulation's 1/100);
its CPU and memory are measured on `1/--before-scale` of a unit read by the same ranged
reader from the local token file (4 cuts at once), scaled to the unit and to 16 manifests,
plus the client's CPU per ranged GET measured through the link; its time is the link's
model (the GETs 8 at a time, the blob's upload and download at the link's bandwidth), not
moto's: moto copies a whole object to serve a range of it, so its ranged GETs on a
gigabyte object take far longer than S3's and would overstate the old design's cost.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outer_step import setup_django  # bench/ is not a package
from s3_link import SlowLink

from dipaco.config import RunConfig

PAGE = resource.getpagesize()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """The process's peak RSS while the block runs, sampled every 2 ms."""

    def __enter__(self) -> PeakRss:
        self.idle = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def write_path(store: Any, config: RunConfig, windows: int, work: Path) -> Any:
    """A path's token file of `windows` windows, uploaded with its row chunks."""
    from dipaco_server.runs import keys
    from dipaco_server.runs.stages import upload_rows

    T = config.model.seq_len
    rng = np.random.default_rng(0)
    train = work / "train.bin"
    with open(train, "wb") as f:  # 64 MiB at a time: the file can be gigabytes
        left = windows * T + 1
        while left:
            n = min(left, 32 << 20)
            f.write(rng.integers(0, config.model.vocab_size, n).astype("<u2").tobytes())
            left -= n
    store.put_file(keys.data_key(1, 0, "train"), train)
    rows = upload_rows(store, config, 1, 0, 2, train, "<u2")
    return rows, train


def after(link: SlowLink, store: Any, config: RunConfig, args: argparse.Namespace) -> dict:
    from dipaco.data.rows import Segment, UnitRows, rows_of
    from dipaco.data.windows import unit_windows
    from dipaco_server.rounds.protocol.unit_data import rows_manifest
    from worker_agent.transfer import BlobCache, Transfers

    count, T = unit_windows(config), config.model.seq_len
    first = count  # the path's second unit: it starts inside a chunk, as most do

    def manifest() -> dict[str, Any]:
        return rows_manifest(store, run_id=1, path=0, phase=2, config=config, dtype="<u2",
                             first=first, count=count, expires_s=3600)  # fmt: skip

    manifest()  # the boto3 client's first connection
    requests0 = link.counters()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    data = manifest()
    manifest_s, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    manifest_requests = link.counters()[0] - requests0

    with PeakRss() as memory:
        threads = [threading.Thread(target=manifest) for _ in range(args.concurrent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with tempfile.TemporaryDirectory() as tmp:
        transfers = Transfers(Path(tmp))
        cache = BlobCache(Path(tmp) / "cache", transfers)
        start = time.perf_counter()
        data = manifest()
        chunks = data["chunks"]

        def load(i: int) -> np.ndarray:
            ref = chunks[i]
            path = cache.fetch(ref["url"], ref["sha256"], ref["size"], what="rows")
            return rows_of(path, "<u2", ref["rows"], T, ref["chunk"])

        segments = [Segment(c["chunk"], c["start"], c["count"], c["perm_seed"]) for c in chunks]
        source = UnitRows(segments, [c["rows"] for c in chunks], load, first, T)
        source.batch(first, config.inner.batch_size, T)
        first_step_s = time.perf_counter() - start
        source.close()
        transfers.close()
    return {
        "requests_per_unit": manifest_requests + len(chunks),
        "manifest_requests": manifest_requests,
        "chunks_per_unit": len(chunks),
        "chunk_bytes": max(c["size"] for c in chunks),
        "server_cpu_s_per_unit": round(cpu_s, 4),
        "manifest_ms": round(manifest_s * 1000, 1),
        "server_peak_rss_bytes": memory.peak - memory.idle,
        "worker_first_step_s": round(first_step_s, 3),
        "measured": "whole, at the 150M sizes",
    }


def before(link: SlowLink, store: Any, config: RunConfig, args: argparse.Namespace,
           train: Path) -> dict:  # fmt: skip
    """The old cut: its requests from its range plan, its CPU and memory measured on a
    fraction of a unit read from the local token file by the same ranged reader, plus the
    client's CPU per GET measured through the link, its time from the link's model."""
    from dipaco.data.ranged import RangedShard, plan_ranges
    from dipaco.data.rows import first_pass
    from dipaco.data.windows import path_seed, unit_windows

    count, T = unit_windows(config), config.model.seq_len
    row_bytes = (T + 1) * 2
    # The old plan's requests for a whole unit on a path `coverage` units long.
    big = first_pass(count * args.before_coverage, path_seed(config, 0))
    plan = plan_ranges([int(w) * T * 2 for w in big[count : 2 * count]], row_bytes)
    del big
    # The cut (gather, int64 array, blob), on a fraction, from the local file by ranges.
    part = count // args.before_scale
    windows = (train.stat().st_size // 2 - 1) // T
    order = first_pass(windows, path_seed(config, 0))

    def read_range(start: int, end: int) -> bytes:
        with open(train, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    shard = RangedShard(read_range, train.stat().st_size, "<u2", "train.bin")

    def cut(n: int) -> float:
        cpu = time.thread_time()
        rows = shard.read_windows([int(w) * T for w in order[count : count + n]], T + 1)
        rows.astype("<u2").tobytes()
        return time.thread_time() - cpu

    cut(part)  # warm
    cut_cpu = sum(cut(part) for _ in range(3)) / 3
    with PeakRss() as memory:
        threads = [threading.Thread(target=cut, args=(part,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # The client's CPU for one ranged GET of a window through the link (boto3, signing).
    key = "units/one-window.bin"
    store.put_bytes(key, bytes(row_bytes * 64))
    gets = 100
    cpu = time.process_time()
    for i in range(gets):
        store.get_range(key, (i % 64) * row_bytes, (i % 64 + 1) * row_bytes)
    per_get_cpu = (time.process_time() - cpu) / gets
    scale = count / part
    blob_bytes = count * row_bytes
    link_s = args.latency_ms / 1000
    gets_s = len(plan) * (link_s + row_bytes / (args.bandwidth_mbs * 1e6)) / 8  # 8 in flight
    blob_s = link_s + blob_bytes / (args.bandwidth_mbs * 1e6)  # the unit's blob, up or down
    return {
        "requests_per_unit": len(plan) + 2,  # the cut's ranged GETs, the blob's PUT and GET
        "server_cpu_s_per_unit": round(cut_cpu * scale + len(plan) * per_get_cpu, 2),
        "manifest_ms": round((gets_s + blob_s) * 1000, 1),
        "server_peak_rss_bytes": int((memory.peak - memory.idle) / 4 * scale * args.concurrent),
        "worker_first_step_s": round(gets_s + 2 * blob_s, 2),
        "measured": (
            f"requests: the old range plan for a whole unit of a path {args.before_coverage} "
            f"units long; CPU and memory: the cut of 1/{args.before_scale} of a unit "
            f"({part} windows, 4 at once) scaled by {scale:.0f} (and to "
            f"{args.concurrent} manifests), plus the client's CPU per ranged GET through "
            "the link; time: the link's model (8 GETs in flight, then the unit's blob up, "
            "and down to the worker)"
        ),
        "fraction": {
            "windows": part,
            "cut_cpu_s": round(cut_cpu, 4),
            "peak_rss_bytes_4_at_once": memory.peak - memory.idle,
            "client_cpu_s_per_get": round(per_get_cpu, 5),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Goals (after): requests_per_unit <= 16, server_cpu_s_per_unit <= 0.1, "
        "server_peak_rss_bytes <= 1 GiB for 16 manifests at once, worker_first_step_s <= 10.",
    )
    parser.add_argument("--latency-ms", type=float, default=30.0, help="per request (30)")
    parser.add_argument("--bandwidth-mbs", type=float, default=200.0,
                        help="MB/s per request (200)")  # fmt: skip
    parser.add_argument("--shard-units", type=int, default=2,
                        help="the path's length in units (2: 1 GB of tokens)")  # fmt: skip
    parser.add_argument("--before-scale", type=int, default=16,
                        help="the old cut runs on 1/N of a unit (16)")  # fmt: skip
    parser.add_argument(
        "--before-coverage",
        type=int,
        default=100,
        help="the old plan's path length in units (100: a unit is 1/100)",
    )
    parser.add_argument("--concurrent", type=int, default=16, help="manifests at once (16)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    config = RunConfig.paper_150m()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="unit-data-") as tmp:
        work = Path(tmp)
        setup_django(work / "server")
        link = SlowLink(args.latency_ms / 1000, args.bandwidth_mbs * 1e6)
        try:
            store = link.bucket()
            from dipaco.data.windows import unit_windows

            windows = args.shard_units * unit_windows(config)
            print(f"writing a path of {windows:,} windows and its row chunks ...", flush=True)
            rows, train = write_path(store, config, windows, work)
            print(f"{len(rows.chunks)} chunks of {rows.rows_per_chunk:,} rows", flush=True)
            new = after(link, store, config, args)
            print("after:", json.dumps(new), flush=True)
            old = before(link, store, config, args, train)
            print("before:", json.dumps(old), flush=True)
        finally:
            link.close()
    keys = ("requests_per_unit", "server_cpu_s_per_unit", "manifest_ms",
            "server_peak_rss_bytes", "worker_first_step_s")  # fmt: skip
    figures = {
        "preset": "150m",
        "unit_windows": unit_windows(config),
        "seq_len": config.model.seq_len,
        "latency_ms": args.latency_ms,
        "bandwidth_mb_per_s": args.bandwidth_mbs,
        "concurrent_manifests": args.concurrent,
        "path_windows": windows,
        "before": old,
        "after": new,
        "ratios_after_over_before": {
            k: round(new[k] / old[k], 5) if old[k] else None for k in keys
        },
        "goals": {
            "requests_per_unit": new["requests_per_unit"] <= 16,
            "server_cpu_s_per_unit": new["server_cpu_s_per_unit"] <= 0.1,
            "server_peak_rss_bytes": new["server_peak_rss_bytes"] <= 1 << 30,
            "worker_first_step_s": new["worker_first_step_s"] <= 10,
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    for k in keys:
        print(f"{k:24s} before {old[k]:>14,} after {new[k]:>12,}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
