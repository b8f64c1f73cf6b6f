"""The demo's outcome: perplexities against the dense baseline, bytes, a sample; JSON and tables.

Perplexities are exp(validation loss). Per path, the run's figure is the server's
``val_loss`` after the last round; "before" is every path's shared starting point; the
dense baselines (one model each, at equal wall-clock and at equal tokens: see
dipaco.demo.baseline) are scored on the same windows. Their ratios are DiPaCo's routed
perplexity over theirs: below 1, DiPaCo is better. Routed figures weigh paths by their
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
from rich.text import Text

from dipaco.config import RunConfig
from dipaco.simulate.baselines import ALL_REDUCE_FORMULA, data_parallel_bytes

SUMMARY_FORMAT = "dipaco-demo-summary/2"


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
class DenseScore:
    """One dense baseline as the summary shows it (dipaco.demo.baseline trains it)."""

    key: str  # "equal_wall_clock" or "equal_tokens"
    equal: str  # what it shares with DiPaCo: "wall-clock" or "tokens"
    name: str  # its dipaco.simulate.baselines name
    steps: int  # sequential AdamW steps at the inner batch
    tokens: int
    train_loss: float
    seconds: float  # its training on this machine, beside the run
    losses: dict[int, float]  # per path: the validation loss of the one model


@dataclass
class SummaryLine:
    """One labelled line under the table. Lines are printed in order and written to the
    JSON as they are: a two-phase run's boundary is one more line after "rounds"."""

    label: str
    text: str


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
    dense: list[DenseScore]  # equal wall-clock first, then equal tokens
    weights: dict[int, int]  # per path, validation tokens
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

    def versus_dense(self) -> dict[str, dict[str, Any]]:
        """Per dense baseline: its figures and DiPaCo's routed perplexity over its own."""
        routed = ppl(self.routed(self.final))
        found = {}
        for d in self.dense:
            loss = self.routed(d.losses)
            found[d.key] = {
                "equal": d.equal, "baseline": d.name, "steps": d.steps, "tokens": d.tokens,
                "train_loss": d.train_loss, "seconds": d.seconds, "loss": loss,
                "perplexity": ppl(loss), "dipaco_perplexity": routed,
                "ratio": _ratio(routed, ppl(loss)),
            }  # fmt: skip
        return found

    def lines(self) -> list[SummaryLine]:
        """What the summary says under the table, in order."""
        t, h = self.config.rounds, self.config.inner.steps
        units = self.config.num_paths * self.config.replicas_per_path
        curve = ", ".join(f"{r['round'] + 1}: {_f(ppl(r['routed']), 1)}" for r in self.rounds)
        lines = [
            SummaryLine(
                "rounds",
                f"routed validation perplexity {_f(ppl(self.routed(self.before)), 1)} before "
                f"training; after each round {curve}",
            ),
        ]
        for d in self.versus_dense().values():
            label = f"vs dense, equal {d['equal']}"
            if d["ratio"] is None:
                lines.append(SummaryLine(label, "no perplexity to compare"))
                continue
            if d["equal"] == "wall-clock":
                what = f"{d['steps']} sequential steps, as each path: {t} rounds x {h}"
            else:
                what = f"{d['steps']} steps: the {units} units of each round one after another"
            verdict = "DiPaCo is better" if d["ratio"] < 1 else "the dense model is better"
            lines.append(
                SummaryLine(
                    label,
                    f"perplexity ratio {d['ratio']:.3f} ({verdict}): DiPaCo "
                    f"{_f(d['dipaco_perplexity'], 1)} / dense {_f(d['perplexity'], 1)}, "
                    f"which took {what}, {d['tokens']:,} tokens",
                )
            )
        sent = self.traffic.upload_bytes + self.traffic.download_bytes
        if sent:
            ratio = self.data_parallel_bytes / sent
            lines.append(
                SummaryLine(
                    "bytes",
                    f"DiPaCo sent {_bytes(sent)} ({_bytes(self.traffic.upload_bytes)} of "
                    f"{self.config.comm.codec} Δs up, {_bytes(self.traffic.download_bytes)} of "
                    f"fp32 modules down) for {self.traffic.units} units; data-parallel "
                    f"training of the same tokens would all-reduce "
                    f"{_bytes(self.data_parallel_bytes)} ({ALL_REDUCE_FORMULA}): "
                    f"{ratio:.0f}x less",
                )
            )
        else:
            lines.append(SummaryLine("bytes", "nothing was sent"))
        if self.sample:
            s = self.sample
            lines.append(
                SummaryLine(
                    "sample",
                    f"(path {s['path']}, downloaded as a Hugging Face model):\n"
                    f"{s['prompt']}{s['continuation']}",
                )
            )
        lines.append(SummaryLine("dashboard", self.dashboard))
        baselines = sum(d.seconds for d in self.dense)
        lines.append(
            SummaryLine(
                "time",
                f"{self.seconds / 60:.1f} min (the dense baselines trained for "
                f"{baselines:.0f} s of it, beside the run)",
            )
        )
        return lines

    def to_json(self) -> dict[str, Any]:
        before, final = self.routed(self.before), self.routed(self.final)
        versus = self.versus_dense()
        sent = self.traffic.upload_bytes + self.traffic.download_bytes
        paths = []
        for p in sorted(self.weights):
            row = {
                "path": p, "modules": list(self.config.path_modules(p)),
                "val_tokens": self.weights[p],
                "loss_before": self.before.get(p), "loss": self.final.get(p),
                "perplexity_before": ppl(self.before.get(p)), "perplexity": ppl(self.final.get(p)),
            }  # fmt: skip
            for d in self.dense:
                row[f"loss_dense_{d.key}"] = d.losses.get(p)
                row[f"perplexity_dense_{d.key}"] = ppl(d.losses.get(p))
            paths.append(row)
        return {
            "format": SUMMARY_FORMAT,
            "run": {"id": self.run_id, "name": self.run_name, "paths": self.config.num_paths,
                    "replicas_per_path": self.config.replicas_per_path,
                    "rounds": self.config.rounds, "inner_steps": self.config.inner.steps,
                    "params_per_path": self.config.num_params(), "workers": self.workers},
            "server": self.server,
            "dashboard": self.dashboard,
            "seconds": self.seconds,
            "routed_val_loss": {"before": before, "final": final,
                                "rounds": [{"round": r["round"], "loss": r["routed"]}
                                           for r in self.rounds]},
            "perplexity": {"before": ppl(before), "routed": ppl(final)},
            "versus_dense": versus,
            "paths": paths,
            "tokens": {"dipaco": self.traffic.tokens,
                       **{f"dense_{key}": d["tokens"] for key, d in versus.items()}},
            "bytes": {**asdict(self.traffic), "total": sent,
                      "data_parallel": self.data_parallel_bytes,
                      "data_parallel_formula": ALL_REDUCE_FORMULA,
                      "ratio_vs_data_parallel": _ratio(sent, self.data_parallel_bytes)},
            "lines": [asdict(line) for line in self.lines()],
            "sample": self.sample,
            "config": self.config.model_dump(mode="json"),
        }  # fmt: skip

    def render(self, console: Console) -> None:
        data = self.to_json()
        t, h = self.config.rounds, self.config.inner.steps
        table = Table(
            title=f"Validation perplexity after {t} rounds of {h} inner steps "
            "(each document scored by the path it routes to)",
            caption=f"dense: one {self.config.num_params() / 1e6:.2f}M-parameter model, the "
            "size of a path; equal wall-clock: as many sequential steps as each path took; "
            "equal tokens: every token the workers trained on",
        )
        columns = ["path", "modules", "val tokens", "before", "DiPaCo"]
        columns += [f"dense, equal {d.equal}" for d in self.dense]
        for column in columns:
            table.add_column(column, justify="right")
        for row in data["paths"]:
            table.add_row(
                str(row["path"]), "-".join(map(str, row["modules"])), f"{row['val_tokens']:,}",
                _f(row["perplexity_before"]), _f(row["perplexity"]),
                *(_f(row[f"perplexity_dense_{d.key}"]) for d in self.dense),
            )  # fmt: skip
        p = data["perplexity"]
        table.add_row(
            "routed", "", f"{sum(self.weights.values()):,}", _f(p["before"]), _f(p["routed"]),
            *(_f(d["perplexity"]) for d in data["versus_dense"].values()), style="bold",
        )  # fmt: skip
        console.print(table)
        for line in self.lines():
            console.print(Text.assemble((line.label, "bold"), ": ", line.text), highlight=False)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


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
