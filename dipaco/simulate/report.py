"""A simulation's outcome: the JSON it writes and the tables it prints.

Perplexity ratios are the simulated method's perplexity over the baseline's (below 1: the
method is better). Bytes are what crosses the network: DiPaCo/DiLoCo units download their
path's modules in fp32 and upload each module's encoded Δ (the real encoded sizes); the
data-parallel baseline would ring-all-reduce fp32 gradients every step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from dipaco.config import RunConfig
from dipaco.evaluate import PathLoss, ValWindows, perplexity
from dipaco.simulate.baselines import ALL_REDUCE_FORMULA, BaselineRun, data_parallel_bytes
from dipaco.simulate.prepare import DataBudget, PreparedData
from dipaco.simulate.train import DipacoRun

__all__ = ["RESULT_FORMAT", "SimulationResult", "render"]

RESULT_FORMAT = "dipaco-simulate-result/1"
SHORT = {"data-parallel": "DP", "dense": "dense", "dense-steps": "dense (equal steps)"}


def _path_json(losses: list[PathLoss]) -> list[dict[str, Any]]:
    return [
        {"path": x.path, "loss": x.loss, "perplexity": x.perplexity, "tokens": x.tokens}
        for x in losses
    ]


@dataclass
class SimulationResult:
    config: RunConfig
    budget: DataBudget
    data: PreparedData
    windows: ValWindows
    run: DipacoRun
    baselines: dict[str, BaselineRun]
    threads: int
    base_steps: int = 0

    @property
    def method(self) -> str:
        return "diloco" if self.config.num_paths == 1 else "dipaco"

    @property
    def loss(self) -> float:
        return self.run.rounds[-1].routed_loss

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss) or math.nan

    @property
    def bytes_total(self) -> int:
        return self.run.upload_bytes + self.run.download_bytes

    @property
    def data_parallel_bytes(self) -> int:
        return data_parallel_bytes(self.config)

    def perplexity_ratio(self, baseline: str) -> float:
        return math.exp(min(self.loss - self.baselines[baseline].loss, 700.0))

    def docs_per_path(self, split: str) -> list[int]:
        return self.data.docs(split)

    def to_json(self) -> dict[str, Any]:
        final = self.run.rounds[-1]
        return {
            "format": RESULT_FORMAT,
            "method": self.method,
            "config": self.config.model_dump(mode="json"),
            "budget": asdict(self.budget),
            "threads": self.threads,
            "base_steps": self.base_steps,
            "data": {
                "work_dir": str(self.data.directory),
                "key": self.data.key,
                "reused": self.data.reused,
                "train_docs_per_path": self.docs_per_path("train"),
                "val_docs_per_path": self.docs_per_path("val"),
                "train_tokens_per_path": self.data.tokens("train"),
                "val_tokens_per_path": self.data.tokens("val"),
                "val_tokens_scored_per_path": self.windows.tokens,
                **{k: v for k, v in self.data.meta.items() if k != "inputs"},
            },
            "rounds": [
                {
                    "round": r.round,
                    "routed_loss": r.routed_loss,
                    "routed_perplexity": perplexity(r.routed_loss),
                    "train_loss": r.train_loss,
                    "upload_bytes": r.upload_bytes,
                    "download_bytes": r.download_bytes,
                    "seconds": r.seconds,
                    "paths": _path_json(r.paths),
                }
                for r in self.run.rounds
            ],
            "final": {
                "routed_loss": final.routed_loss,
                "routed_perplexity": perplexity(final.routed_loss),
                "paths": _path_json(final.paths),
            },
            "tokens": self.run.tokens,
            "units": self.run.units,
            "seconds": self.run.seconds,
            "bytes": {
                "upload": self.run.upload_bytes,
                "download": self.run.download_bytes,
                "total": self.bytes_total,
                "data_parallel": self.data_parallel_bytes,
                "data_parallel_formula": ALL_REDUCE_FORMULA,
                "ratio_vs_data_parallel": self.bytes_total / self.data_parallel_bytes,
            },
            "baselines": {
                name: {
                    "loss": b.loss,
                    "perplexity": perplexity(b.loss),
                    "perplexity_ratio": self.perplexity_ratio(name),
                    "steps": b.steps,
                    "batch_size": b.batch_size,
                    "tokens": b.tokens,
                    "train_loss": b.train_loss,
                    "seconds": b.seconds,
                    "paths": _path_json(b.paths),
                }
                for name, b in self.baselines.items()
            },
        }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


def _path_table(result: SimulationResult) -> Table:
    table = Table(title="Validation loss per path; each document scored by the path it routes to")
    for column in ("path", "modules", "docs", "val tok", "loss@0", "loss", "ppl"):
        table.add_column(column, justify="right")
    for baseline in result.baselines:
        table.add_column(f"{SHORT[baseline]} ppl", justify="right")
    first, last = result.run.rounds[0], result.run.rounds[-1]
    train_docs = result.docs_per_path("train")
    for p, (start, end) in enumerate(zip(first.paths, last.paths, strict=True)):
        modules = "-".join(str(k) for k in result.config.path_modules(p))
        row = [str(p), modules, str(train_docs[p]), str(end.tokens)]
        row += [_fmt(start.loss), _fmt(end.loss), _fmt(end.perplexity, 2)]
        row += [_fmt(b.paths[p].perplexity, 2) for b in result.baselines.values()]
        table.add_row(*row)
    mean = ["routed", "", str(sum(train_docs)), str(sum(result.windows.tokens))]
    mean += [_fmt(first.routed_loss), _fmt(last.routed_loss), _fmt(result.perplexity, 2)]
    mean += [_fmt(perplexity(b.loss), 2) for b in result.baselines.values()]
    table.add_row(*mean, style="bold")
    return table


def _method_table(result: SimulationResult) -> Table:
    cfg = result.config
    workers = cfg.num_paths * cfg.replicas_per_path
    table = Table(
        title="Same data, same training tokens, same validation tokens",
        caption=(
            f"bytes: units download fp32 modules, upload {cfg.comm.codec} Δs; DP = ring "
            f"all-reduce, {ALL_REDUCE_FORMULA} ({cfg.num_params():,} params, {workers} workers)"
        ),
    )
    for column in ("method", "loss", "ppl", "ppl/ours", "tokens", "steps x seqs", "bytes"):
        table.add_column(column, justify="right")
    dp = result.data_parallel_bytes
    label = f"{result.method} {cfg.num_paths}p x {cfg.replicas_per_path}r"
    steps = f"{cfg.rounds}x{cfg.inner.steps} x {cfg.inner.batch_size}"
    table.add_row(
        label, _fmt(result.loss), _fmt(result.perplexity, 2), "1.000",
        f"{result.run.tokens:,}", steps, f"{_bytes(result.bytes_total)}",
        style="bold",
    )  # fmt: skip
    for name, b in result.baselines.items():
        sent = _bytes(dp) if name == "data-parallel" else "0"
        table.add_row(
            name, _fmt(b.loss), _fmt(perplexity(b.loss), 2),
            f"{1 / result.perplexity_ratio(name):.3f}", f"{b.tokens:,}",
            f"{b.steps} x {b.batch_size}", sent,
        )  # fmt: skip
    return table


def render(result: SimulationResult, console: Console) -> None:
    """Print the per-path table, the per-round curve and the method comparison."""
    if result.base_steps:
        console.print(
            f"every method and baseline started from one dense base model trained "
            f"{result.base_steps} steps (its tokens are not counted below)"
        )
    console.print(_path_table(result))
    curve = "  ".join(f"r{r.round}: {r.routed_loss:.3f}" for r in result.run.rounds)
    console.print(f"routed validation loss by round: {curve}")
    console.print(_method_table(result))
    for name in result.baselines:
        console.print(
            f"perplexity ratio {result.method} / {name}: {result.perplexity_ratio(name):.4f}"
        )
    console.print(
        f"bytes {result.method} / data-parallel: {result.bytes_total / result.data_parallel_bytes:.5f}"
        f" ({_bytes(result.bytes_total)} vs {_bytes(result.data_parallel_bytes)})"
    )
