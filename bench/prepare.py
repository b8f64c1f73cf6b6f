"""Streaming preparation at size: a generated Parquet corpus of real text, tokenised, routed
and written in pieces by 1 and 2 processes (dipaco.data.stream, what runs.pieces runs).

    .venv/bin/python bench/prepare.py --scale 1 --json docs/figures/prepare.json

The corpus is the running Python's standard library (sources and docs, chunked as the
corpus reader chunks them), repeated in a new seeded order until the size is reached, as
Parquet files of equal size: 0.5 GB and 2 GB of text times ``--scale`` (``--scale 0.1``:
50 MB and 200 MB), 16 and 64 files, so every piece holds the same text at both sizes.

Per size it runs pass 1 (scan, tokenizer, router; timed apart), then pass 2 (the pieces) on
2 Celery worker processes (and on 1 at the small size), each ``--concurrency 1`` and held to
one thread (torch, Rayon, OpenMP), then pass 3 (the join). It reports:

- ``chars_per_s_per_process``: characters tokenised, routed and written per second per
  process, from pass 2's wall time (tokenizer training and the scan excluded);
- ``chars_per_cpu_s``: the same per CPU-second the worker processes used, which the
  machine's other load does not dilute;
- ``speedup_2_vs_1``: pass 2's throughput with 2 processes over 1, small size;
- ``peak_rss_mib``: the largest peak RSS of a worker's pool process (each one's is in
  ``runs``), and ``rss_ratio_large_vs_small`` of the two sizes;
- ``bytes_written``: the parts and the shards, what the server uploads (runs.pieces);
- ``resume_s``: after both workers are killed (SIGKILL) once half the pieces are done
  (small size), the time to finish: fresh workers, the pieces left sent again (those
  without a manifest, as a resent ``prepare_run`` does), then the join.

The workers are real ``celery worker`` processes (``--concurrency 1``, prefork, one task
prefetched) on the embedded default's broker (kombu's filesystem transport) in the
scratch directory, consuming one task per piece that runs what a ``prepare_piece`` task runs
(dipaco.data.stream.write_piece), without the database and the blob store (their cost is
one upload per part, measured by bench/control_plane.py). The machine's load average is
printed with the figures: on a shared machine the 2-process speedup is pessimistic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from celery import Celery

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"small": (0.5e9, 16), "large": (2e9, 64)}  # characters of text, files
VOCAB = 32_768
BROKER_ENV = "BENCH_PREPARE_BROKER"  # the broker's folder, for the worker processes
app = Celery("bench_prepare", set_as_current=False)  # `celery -A prepare worker` runs it


def one_thread() -> None:
    for name in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def real_text() -> list[str]:
    from dipaco.data.corpus import CorpusStats, iter_corpus

    return [doc.text for doc in iter_corpus("stdlib", CorpusStats())]


def write_corpus(root: Path, chars: float, files: int, texts: list[str]) -> int:
    """``files`` Parquet files of about chars/files characters each; returns the total."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    per_file, total, order, rng = chars / files, 0, list(texts), random.Random(0)
    cursor = len(order)
    for f in range(files):
        rows, size = [], 0
        while size < per_file:
            if cursor == len(order):  # the next repetition, in a new seeded order
                rng.shuffle(order)
                cursor = 0
            rows.append(order[cursor])
            size += len(order[cursor])
            cursor += 1
        pq.write_table(pa.table({"text": rows}), root / f"part-{f:05d}.parquet")
        total += size
    return total


def config() -> Any:
    from dipaco.config import LayoutConfig, RunConfig

    return RunConfig.tiny(
        model={"vocab_size": VOCAB, "num_layers": 2},
        layout=LayoutConfig.grid(2, levels=2, modules=2),
    )


def plan(corpus: Path, out: Path) -> dict[str, Any]:
    """Pass 1: scan, tokenizer, router, saved under ``out``."""
    from dipaco.data.corpus import corpus_listing
    from dipaco.data.prepare import fit_router_on
    from dipaco.data.stream import ReadOptions, prefix_chars, scan_corpus
    from dipaco.tokenizer import train_tokenizer_on

    cfg = config()
    listing = corpus_listing(str(corpus))
    t0 = time.perf_counter()
    scan = scan_corpus(listing, ReadOptions(), prefix_chars=prefix_chars(cfg))
    t1 = time.perf_counter()
    tokenizer = train_tokenizer_on(scan.tokenizer_texts, VOCAB)
    tokenizer.save(out / "tokenizer")
    fit_router_on(cfg, scan.router_texts, tokenizer).save(out / "router")
    t2 = time.perf_counter()
    return {
        "pieces": scan.pieces,
        "spans": [asdict(span) for span in scan.spans],
        "chars": scan.train_chars + scan.val_chars,
        "scan_s": t1 - t0,
        "tokenizer_router_s": t2 - t1,
    }


_TOOLS: dict[str, Any] = {}


def peak_rss_kib() -> int:
    """This process's peak RSS: VmHWM, which starts afresh at exec (ru_maxrss carries the
    spawning parent's peak over an exec on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cpu_seconds() -> float:
    """This process's CPU time (user + system): what a piece cost whatever else ran."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_tools(corpus: str, out: str) -> None:
    import torch

    from dipaco.data.corpus import corpus_listing
    from dipaco.routing.router import Router
    from dipaco.tokenizer import RunTokenizer

    if not _TOOLS:
        torch.set_num_threads(1)
        tokenizer = RunTokenizer.load(Path(out) / "tokenizer")
        _TOOLS.update(
            listing=corpus_listing(corpus),
            tokenizer=tokenizer,
            router=Router.load(Path(out) / "router", tokenizer),
        )


def write_one(corpus: str, out: str, piece: int, span: dict[str, Any]) -> dict[str, Any]:
    """Pass 2 for one piece, in a worker's pool process: what runs.pieces.write_piece does."""
    from dipaco.data.sources import Span
    from dipaco.data.stream import ReadOptions, write_piece

    load_tools(corpus, out)
    cpu0 = cpu_seconds()
    part = Path(out) / "parts" / str(piece)
    tools = (_TOOLS["tokenizer"], _TOOLS["router"], ReadOptions())
    result = write_piece(_TOOLS["listing"], piece, part, *tools, span=Span.from_json(span))
    (part / "manifest.json").write_text(result.to_json())  # last, as the server uploads it
    return {
        "chars": result.chars,
        "cpu_s": cpu_seconds() - cpu0,
        "pid": os.getpid(),
        "peak_rss_kib": peak_rss_kib(),
    }


def configure(folder: Path) -> Celery:
    """The app on the embedded default's broker in ``folder`` (dipaco_server.env: kombu's
    filesystem transport, messages renamed into place), without Django: tasks acknowledged
    late, one prefetched per process."""
    # The server package, for its transport; imported after the app exists, so Celery's
    # Django fix-up (decided when an app is made) stays off.
    from dipaco_server.env import celery_transport

    app.conf.update(
        **celery_transport(folder, None),
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
    )
    return app


if os.environ.get(BROKER_ENV):  # a worker process
    configure(Path(os.environ[BROKER_ENV]))


@app.task(name="bench.prepare.warm")
def warm(corpus: str, out: str) -> int:
    """Load what a piece needs in this process and hold it a moment, so that each worker
    takes one of these; returns the process id."""
    load_tools(corpus, out)
    time.sleep(1.0)
    return os.getpid()


@app.task(name="bench.prepare.piece")
def piece_task(corpus: str, out: str, piece: int, span: dict[str, Any]) -> dict[str, Any]:
    return write_one(corpus, out, piece, span)


class Workers:
    """``processes`` Celery worker processes, each ``--concurrency 1``, ready and warm."""

    def __init__(self, work: Path, processes: int, corpus: Path, out: Path) -> None:
        folder = work / "celery"  # one broker for the bench: the app connects once
        if app.conf.broker_url is None:
            configure(folder)
        for message in (folder / "broker" / "queue").iterdir():  # what killed workers left
            message.unlink()
        environ = {**os.environ, BROKER_ENV: str(folder)}
        environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), str(ROOT)])
        environ.pop("DJANGO_SETTINGS_MODULE", None)  # Celery's Django fix-up: not here
        command = [sys.executable, "-m", "celery", "-A", "prepare", "worker", "--concurrency",
                   "1", "--pool", "prefork", "--loglevel", "WARNING", "--without-gossip",
                   "--without-mingle", "--without-heartbeat"]  # fmt: skip
        self.procs = []
        for i in range(processes):
            log = (folder / f"worker-{i}.log").open("ab")
            self.procs.append(
                subprocess.Popen(
                    [*command, "-n", f"bench{i}@%h"],
                    env=environ,
                    cwd=ROOT,
                    start_new_session=True,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        pids: set[int] = set()
        deadline = time.monotonic() + 300
        while len(pids) < processes:  # every pool process has loaded the tools
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.kill()
                raise RuntimeError(f"the Celery workers did not start; see {folder}")
            warming = [warm.delay(str(corpus), str(out)) for _ in range(processes)]
            pids.update(r.get(timeout=300) for r in warming)

    def kill(self) -> None:
        """SIGKILL to each worker's process group (the worker and its pool process)."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_pieces(
    corpus: Path, out: Path, planned: dict[str, Any], processes: int, stop_after: int | None = None
) -> dict[str, Any]:
    """Pass 2 over the pieces without a manifest, one Celery task each, on ``processes``
    fresh workers; ``stop_after``: kill the workers then."""
    parts = out / "parts"
    todo = [p for p in planned["pieces"] if not (parts / str(p) / "manifest.json").exists()]
    peaks: dict[int, int] = {}
    chars, done, cpu = 0, 0, 0.0
    workers = Workers(out.parent, processes, corpus, out)
    t0 = time.perf_counter()
    try:
        spans = planned["spans"]
        pending = [piece_task.delay(str(corpus), str(out), p, spans[p]) for p in todo]
        while pending and (stop_after is None or done < stop_after):
            states = [(r, r.ready()) for r in pending]  # once each: a result readied
            pending = [r for r, ready in states if not ready]  # meanwhile waits a turn
            for result in (r for r, ready in states if ready):
                r = result.get()
                chars += r["chars"]
                cpu += r["cpu_s"]
                peaks[r["pid"]] = max(peaks.get(r["pid"], 0), r["peak_rss_kib"])
                done += 1
            time.sleep(0.05)
    finally:
        workers.kill()
    seconds = time.perf_counter() - t0
    return {
        "chars": chars, "seconds": seconds, "cpu_s": cpu, "pieces": done,
        "peak_rss_kib": max(peaks.values()), "peak_rss_kib_per_process": sorted(peaks.values()),
        "chars_per_cpu_s": chars / cpu if cpu else 0.0,
    }  # fmt: skip


def join(corpus: Path, out: Path, pieces: list[int]) -> tuple[float, int]:
    """Pass 3; returns (seconds, bytes of parts and shards)."""
    from dipaco.data.stream import PieceResult, join_parts
    from dipaco.tokenizer import RunTokenizer

    t0 = time.perf_counter()
    results = [
        PieceResult.from_json((out / "parts" / str(p) / "manifest.json").read_text())
        for p in pieces
    ]
    tokenizer = RunTokenizer.load(out / "tokenizer")
    shutil.rmtree(out / "shards", ignore_errors=True)
    index = join_parts(
        results,
        lambda r, part: open(out / "parts" / str(r.piece) / f"{part}.bin", "rb"),  # noqa: SIM115 (join_parts closes it)
        out / "shards",
        tokenizer,
        4,
    )
    seconds = time.perf_counter() - t0
    shard_bytes = sum(e[s].tokens for e in index.paths for s in e) * 2
    return seconds, 2 * shard_bytes  # every byte once as a part, once in a shard


def copy_plan(plan_dir: Path, out: Path) -> Path:
    for name in ("tokenizer", "router"):
        shutil.copytree(plan_dir / name, out / name)
    return out


def measure(work: Path, texts: list[str], scale: float) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for size, (chars, files) in SIZES.items():
        corpus = work / f"corpus-{size}"
        written = write_corpus(corpus, chars * scale, files, texts)
        print(f"{size}: {written / 1e6:.0f}M characters in {files} Parquet files", flush=True)
        runs = (1, 2) if size == "small" else (2,)
        planned = plan(corpus, work / f"plan-{size}")
        for processes in runs:
            out = copy_plan(work / f"plan-{size}", work / f"out-{size}-{processes}")
            r = run_pieces(corpus, out, planned, processes)
            join_s, written_bytes = join(corpus, out, planned["pieces"])
            key = f"{size}_{processes}p"
            figures[key] = {
                **{k: v for k, v in planned.items() if k not in ("pieces", "spans")}, **r, "join_s": join_s, "bytes_written": written_bytes,
                "chars_per_s_per_process": r["chars"] / r["seconds"] / processes,
            }  # fmt: skip
            print(key, json.dumps(figures[key]), "load", os.getloadavg(), flush=True)
            shutil.rmtree(out / "parts") if size == "large" else None
        if size == "small":
            out = copy_plan(work / "plan-small", work / "out-small-resume")
            half = len(planned["pieces"]) // 2
            run_pieces(corpus, out, planned, 2, stop_after=half)
            t0 = time.perf_counter()
            rest = run_pieces(corpus, out, planned, 2)
            join(corpus, out, planned["pieces"])
            figures["resume"] = {
                "pieces_left": rest["pieces"],
                "resume_s": time.perf_counter() - t0,
            }
            same = (out / "shards" / "index.json").read_text() == (
                work / "out-small-2" / "shards" / "index.json"
            ).read_text()
            figures["resume"]["same_shards_as_uninterrupted"] = same
            print("resume", json.dumps(figures["resume"]), flush=True)
        shutil.rmtree(corpus)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=1.0, help="of 0.5 GB and 2 GB (%(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    one_thread()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    started = time.time()
    texts = real_text()
    print(f"real text: {len(texts)} stdlib documents, {sum(map(len, texts)) / 1e6:.0f}M chars")
    runs = measure(work, texts, args.scale)
    small1, small2, large2 = runs["small_1p"], runs["small_2p"], runs["large_2p"]
    figures = {
        "command": "python bench/prepare.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "scale": args.scale,
        "chars": {"small": small2["chars"], "large": large2["chars"]},
        "chars_per_s_per_process": small1["chars_per_s_per_process"],
        "chars_per_s_per_process_2p": small2["chars_per_s_per_process"],
        # Per CPU-second of the pool processes: the throughput a process with a core of
        # its own would reach, whatever the load (wall-clock figures above are shared).
        "chars_per_cpu_s": small1["chars_per_cpu_s"],
        "chars_per_cpu_s_2p": small2["chars_per_cpu_s"],
        "speedup_2_vs_1": (small2["chars"] / small2["seconds"]) / (small1["chars"] / small1["seconds"]),
        "peak_rss_mib": {"small": small2["peak_rss_kib"] / 1024, "large": large2["peak_rss_kib"] / 1024},
        "rss_ratio_large_vs_small": large2["peak_rss_kib"] / small2["peak_rss_kib"],
        "bytes_written": {"small": small2["bytes_written"], "large": large2["bytes_written"]},
        "resume_s": runs["resume"]["resume_s"],
        "resume": runs["resume"],
        "runs": runs,
        "load_average_at_end": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "wall_s": time.time() - started,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in figures.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
