"""The demo's outcome: perplexities against the dense baseline, bytes, a sample; JSON and tables.

Perplexities are exp(validation loss). Per path, the run's figure is the server's
``val_loss`` after the last round; "before" is every path's shared starting point; the
dense baseline is scored on the same windows. Routed figures weigh paths by their
validation tokens (each validation document is scored by the path it routes to).

Bytes are what crossed the network for training: every unit downloads its path's
modules in fp32 at their base versions (the workers' cache saves some of that; it is not
subtracted) and uploads one encoded Δ per module (the sizes the server recorded). The
data-parallel figure is dipaco.simulate's: a ring all-reduce of fp32 gradients, 2 x
params x 4 bytes per worker per step, with P·R workers for T·H steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from dipaco.config import RunConfig
from dipaco.simulate.baselines import ALL_REDUCE_FORMULA, data_parallel_bytes

SUMMARY_FORMAT = "dipaco-demo-summary/1"


def ppl(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(min(loss, 700.0))


@dataclass
class Traffic:
    upload_bytes: int  # encoded Δs, as recorded by the server
    download_bytes: int  # fp32 modules at each unit's base versions
    units: int  # units completed
    tokens: int  # training tokens of the completed units


def traffic(run_id: int) -> Traffic:
    """What the run's completed units sent and received (from the server's database)."""
    from django.db import connections
    from django.db.models import Sum

    from dipaco_server.rounds.models import Contribution, WorkUnit
    from dipaco_server.runs.models import ModuleVersion

    sizes = {
        (module_id, version): size
        for module_id, version, size in ModuleVersion.objects.filter(
            module__run_id=run_id
        ).values_list("module__module_id", "version", "size")
    }
    units = list(
        WorkUnit.objects.filter(round__run_id=run_id, state=WorkUnit.State.DONE).values_list(
            "pk", "base_versions"
        )
    )
    download = sum(sizes.get((m, v), 0) for _, base in units for m, v in base.items())
    uploads = Contribution.objects.filter(unit__round__run_id=run_id)
    upload = uploads.aggregate(total=Sum("size"))["total"] or 0
    per_unit = dict(uploads.values_list("unit_id", "tokens"))  # one count per unit
    connections.close_all()
    return Traffic(int(upload), int(download), len(units), int(sum(per_unit.values())))


@dataclass
class DemoSummary:
    run_id: int
    run_name: str
    server: str
    config: RunConfig
    seconds: float
    workers: int
    # Validation loss per round: {"round": t, "routed": x, "paths": {p: loss}}.
    rounds: list[dict[str, Any]]
    before: dict[int, float]  # per path, the shared initial weights
    dense: dict[int, float]  # per path, the dense baseline
    weights: dict[int, int]  # per path, validation tokens
    dense_steps: int
    dense_tokens: int
    dense_train_loss: float
    traffic: Traffic
    sample: dict[str, Any] = field(default_factory=dict)

    @property
    def dashboard(self) -> str:
        return f"{self.server}/runs/{self.run_id}/"

    def routed(self, losses: dict[int, float]) -> float:
        from dipaco.demo.baseline import routed

        return routed(losses, self.weights)

    @property
    def final(self) -> dict[int, float]:
        return {int(p): v for p, v in self.rounds[-1]["paths"].items()} if self.rounds else {}

    @property
    def data_parallel_bytes(self) -> int:
        return data_parallel_bytes(self.config)

    def to_json(self) -> dict[str, Any]:
        before, final, dense = (self.routed(x) for x in (self.before, self.final, self.dense))
        sent = self.traffic.upload_bytes + self.traffic.download_bytes
        paths = []
        for p in sorted(self.weights):
            paths.append({
                "path": p, "modules": list(self.config.path_modules(p)),
                "val_tokens": self.weights[p],
                "loss_before": self.before.get(p), "loss": self.final.get(p),
                "loss_dense": self.dense.get(p), "perplexity_before": ppl(self.before.get(p)),
                "perplexity": ppl(self.final.get(p)), "perplexity_dense": ppl(self.dense.get(p)),
            })  # fmt: skip
        return {
            "format": SUMMARY_FORMAT,
            "run": {"id": self.run_id, "name": self.run_name, "paths": self.config.num_paths,
                    "rounds": self.config.rounds, "inner_steps": self.config.inner.steps,
                    "params_per_path": self.config.num_params(), "workers": self.workers},
            "server": self.server,
            "dashboard": self.dashboard,
            "seconds": self.seconds,
            "routed_val_loss": {"before": before, "final": final, "dense": dense,
                                "rounds": [{"round": r["round"], "loss": r["routed"]}
                                           for r in self.rounds]},
            "perplexity": {"before": ppl(before), "routed": ppl(final), "dense": ppl(dense),
                           "ratio_vs_dense": _ratio(ppl(final), ppl(dense))},
            "paths": paths,
            "tokens": {"dipaco": self.traffic.tokens, "dense": self.dense_tokens},
            "dense": {"steps": self.dense_steps, "train_loss": self.dense_train_loss},
            "bytes": {**asdict(self.traffic), "total": sent,
                      "data_parallel": self.data_parallel_bytes,
                      "data_parallel_formula": ALL_REDUCE_FORMULA,
                      "ratio_vs_data_parallel": _ratio(sent, self.data_parallel_bytes)},
            "sample": self.sample,
            "config": self.config.model_dump(mode="json"),
        }  # fmt: skip

    def render(self, console: Console) -> None:
        data = self.to_json()
        table = Table(
            title=f"Validation perplexity after {self.config.rounds} rounds "
            "(each document scored by the path it routes to)",
            caption=f"dense: one {self.config.num_params() / 1e6:.2f}M-parameter model, "
            f"{self.dense_steps} sequential steps on the same {self.dense_tokens:,} tokens; "
            f"each DiPaCo path took {self.config.rounds * self.config.inner.steps} steps, "
            "the paths in parallel",
        )
        for column in ("path", "modules", "val tokens", "before", "DiPaCo", "dense", "ratio"):
            table.add_column(column, justify="right")
        for row in data["paths"]:
            table.add_row(
                str(row["path"]), "-".join(map(str, row["modules"])), f"{row['val_tokens']:,}",
                _f(row["perplexity_before"]), _f(row["perplexity"]),
                _f(row["perplexity_dense"]), _f(_ratio(row["perplexity"], row["perplexity_dense"]), 3),
            )  # fmt: skip
        p = data["perplexity"]
        table.add_row(
            "routed", "", f"{sum(self.weights.values()):,}", _f(p["before"]), _f(p["routed"]),
            _f(p["dense"]), _f(p["ratio_vs_dense"], 3), style="bold",
        )  # fmt: skip
        console.print(table)
        b = data["bytes"]
        console.print(
            f"[bold]bytes[/]: DiPaCo sent {_bytes(b['total'])} ({_bytes(b['upload_bytes'])} of "
            f"{self.config.comm.codec} Δs up, {_bytes(b['download_bytes'])} of fp32 modules down) "
            f"for {b['units']} units; data-parallel training of the same tokens would all-reduce "
            f"{_bytes(b['data_parallel'])} ({ALL_REDUCE_FORMULA}): "
            f"[bold]{1 / b['ratio_vs_data_parallel']:.0f}x less[/]"
            if b["ratio_vs_data_parallel"]
            else "[bold]bytes[/]: nothing was sent"
        )
        if self.sample:
            s = self.sample
            console.print(
                f"[bold]sample[/] (path {s['path']}, downloaded as a Hugging Face model):\n"
                f"[dim]{s['prompt']}[/]{s['continuation']}"
            )
        console.print(f"[bold]dashboard[/]: {self.dashboard}")
        console.print(f"[bold]time[/]: {self.seconds / 60:.1f} min")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def sample(
    server: str, run_id: int, prompt: str, cache_dir: str, seed: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Route `prompt`, download that path through the inference API, continue the prompt."""
    import torch
    from transformers.utils import logging as transformers_logging

    from dipaco.cli.download import cached_path_dir
    from dipaco.cli.route import route
    from dipaco.inference import open_path_dir

    path = int(route(server, run_id, prompt)["path"])
    # What dipaco.load_path does, with the download's per-file lines kept out of the panel.
    directory = cached_path_dir(server, run_id, path, cache_dir, log=lambda _: None)
    log(f"routed the prompt to path {path} and downloaded it to {directory}")
    transformers_logging.disable_progress_bar()
    model, tokenizer = open_path_dir(directory)
    # Training documents start with the separator (BOS), so prompts do too (dipaco generate).
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(prompt)]])
    torch.manual_seed(seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=True,
        temperature=0.8, top_k=50,
    )  # fmt: skip
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return {"path": path, "prompt": prompt, "continuation": text, "directory": str(directory)}
