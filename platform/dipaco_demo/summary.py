"""The demo's outcome: perplexities against the dense baselines, bytes, a sample; JSON and tables.

Perplexities are exp(validation loss). A run with a phase 1 (the default) trains a dense
DiLoCo model first; its curve is the server's ``val_loss`` of that one model on the
run's validation sample (dipaco.evaluate.sample_plan: seeded windows over every validation
document), round by round. Phase 2's per-path figures are the server's
``val_loss`` after the last round; "start" is where every path of phase 2 starts (the
phase-1 model, or the seeded weights without a phase 1), "initial" the seeded weights
before any training; the dense baselines (one model each, at equal wall-clock and at equal
tokens, from phase 2's start: see dipaco_demo.baseline) are scored on the same windows.
Their ratios are DiPaCo's routed perplexity over theirs: below 1, DiPaCo is better. Routed
figures weigh paths by their validation tokens (each validation document is scored by the
path it routes to).

Bytes are what crossed the network for training, in both phases: every unit downloads its
path's modules in fp32 at their base versions (the workers' cache saves some of that; it is
not subtracted) and uploads one encoded Δ per module (the sizes the server recorded). The
data-parallel figure is dipaco.simulate's: a ring all-reduce of fp32 gradients, 2 x params
x 4 bytes per worker per step, with P·R workers for T·H steps (and phase 1's replicas for
its rounds x H steps).
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
from dipaco.evaluate import perplexity, weighted_mean
from dipaco.simulate.baselines import ALL_REDUCE_FORMULA, data_parallel_bytes
from dipaco_demo.records import PhaseClock, Traffic

SUMMARY_FORMAT = "dipaco-demo-summary/3"


@dataclass
class DenseScore:
    """One dense baseline as the summary shows it (dipaco_demo.baseline trains it)."""

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
    JSON as they are: after "rounds" come the phases ("phase 1", "between the phases",
    "phase 2"; "phases" for a run without phase 1), then the dense baselines."""

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
    # Phase 2's validation loss per round: {"round": t, "routed": x, "paths": {p: loss}},
    # t counted across both phases (phase 2's first is config.phase1.rounds).
    rounds: list[dict[str, Any]]
    before: dict[int, float]  # per path, phase 2's start (the phase-1 model, or seeded)
    dense: list[DenseScore]  # equal wall-clock first, then equal tokens; [] when skipped
    weights: dict[int, int]  # per path, validation tokens
    traffic: Traffic
    sample: dict[str, Any] = field(default_factory=dict)
    initial: dict[int, float] = field(default_factory=dict)  # per path, the seeded weights
    phase1_losses: dict[int, float] = field(default_factory=dict)  # round -> dense val loss
    clock: PhaseClock | None = None
    baselines: bool = True  # False: --no-baselines

    @property
    def dashboard(self) -> str:
        return f"{self.server}/runs/{self.run_id}/"

    @property
    def phase1_rounds(self) -> int:
        return self.config.phase1.rounds if self.config.phase1 is not None else 0

    def routed(self, losses: dict[int, float]) -> float:
        return weighted_mean(losses, self.weights)

    @property
    def final(self) -> dict[int, float]:
        return {int(p): v for p, v in self.rounds[-1]["paths"].items()} if self.rounds else {}

    @property
    def data_parallel_bytes(self) -> int:
        """The all-reduce of the same tokens in both phases (phase 1: its replicas)."""
        dense = data_parallel_bytes(self.config.dense_phase) if self.config.phase1 else 0
        return data_parallel_bytes(self.config) + dense

    @property
    def starts_from(self) -> str:
        return "the phase-1 model" if self.config.phase1 is not None else "the seeded weights"

    def versus_dense(self) -> dict[str, dict[str, Any]]:
        """Per dense baseline: its figures and DiPaCo's routed perplexity over its own."""
        routed = perplexity(self.routed(self.final))
        found = {}
        for d in self.dense:
            loss = self.routed(d.losses)
            found[d.key] = {
                "equal": d.equal, "baseline": d.name, "steps": d.steps, "tokens": d.tokens,
                "train_loss": d.train_loss, "seconds": d.seconds, "loss": loss,
                "perplexity": perplexity(loss), "dipaco_perplexity": routed,
                "ratio": _ratio(routed, perplexity(loss)), "starts_from": self.starts_from,
            }  # fmt: skip
        return found

    def curve(self) -> str:
        """Validation perplexity after each round (counted from 1), phase 2's start marked."""
        start = _f(perplexity(self.routed(self.before)), 1)
        phase2 = ", ".join(
            f"{r['round'] + 1}: {_f(perplexity(r['routed']), 1)}" for r in self.rounds
        )
        if not self.phase1_rounds:
            return (
                f"routed validation perplexity {start} before training; after each round {phase2}"
            )
        phase1 = ", ".join(
            f"{t + 1}: {_f(perplexity(loss), 1)}" for t, loss in sorted(self.phase1_losses.items())
        )
        return (
            f"validation perplexity {_f(perplexity(self.routed(self.initial)), 1)} before training; "
            f"phase 1 (dense) after each round {phase1} | phase 2 (DiPaCo, routed) starts at "
            f"{start} (the phase-1 model on each path's documents), after each round {phase2}"
        )

    def phase_lines(self) -> list[SummaryLine]:
        config, clock = self.config, self.clock
        t, h, p, r = config.rounds, config.inner.steps, config.num_paths, config.replicas_per_path
        first = self.phase1_rounds
        phase2 = (
            f"DiPaCo, rounds {first + 1}-{first + t}: {p} paths x {r} replica(s), {t} rounds x "
            f"{h} inner steps from {self.starts_from}; routed validation perplexity "
            f"{_f(perplexity(self.routed(self.before)), 1)} -> {_f(perplexity(self.routed(self.final)), 1)}"
        )
        if clock is not None and math.isfinite(clock.phase2):
            phase2 += f" ({clock.phase2:.0f} s)"
        if config.phase1 is None:
            return [
                SummaryLine(
                    "phases",
                    f"phase 2 only (--phase1-rounds 0): {phase2}, documents routed by "
                    f"{config.router.featurizer}",
                )
            ]
        dense = config.dense_phase
        last = self.phase1_losses.get(first - 1)
        took = ""
        if clock is not None and clock.phase1 is not None and math.isfinite(clock.phase1):
            took = f" ({clock.phase1:.0f} s)"
        between = "done"
        if clock is not None and clock.between is not None and math.isfinite(clock.between):
            between = f"{clock.between:.0f} s"
        return [
            SummaryLine(
                "phase 1",
                f"dense DiLoCo, rounds 1-{first}: one {config.num_params() / 1e6:.2f}M-parameter "
                f"model x {dense.replicas_per_path} replicas, {first} rounds x "
                f"{dense.inner.steps} inner steps from the seeded weights{took}; final "
                f"validation loss {_f(last, 3)} (perplexity {_f(perplexity(last), 1)}, on the "
                "run's validation sample)",
            ),
            SummaryLine(
                "between the phases",
                f"{between}: the phase-1 model embedded every document's first "
                f"{config.router.prefix_tokens} tokens, the {config.router.method} router was "
                f"fitted on those features, the {p} paths' shards written, and every module "
                "initialised from the phase-1 model",
            ),
            SummaryLine("phase 2", phase2),
        ]

    def lines(self) -> list[SummaryLine]:
        """What the summary says under the table, in order."""
        t, h = self.config.rounds, self.config.inner.steps
        units = self.config.num_paths * self.config.replicas_per_path
        lines = [SummaryLine("rounds", self.curve()), *self.phase_lines()]
        if not self.baselines:
            lines.append(SummaryLine("vs dense", "skipped (--no-baselines)"))
        # Both sides start phase 2 from the same model, so phase 1 is left out of both counts.
        head_start = ", from the phase-1 model as DiPaCo" if self.config.phase1 else ""
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
                    f"which took {what}, {d['tokens']:,} tokens{head_start}",
                )
            )
        sent = self.traffic.upload_bytes + self.traffic.download_bytes
        if sent:
            ratio = self.data_parallel_bytes / sent
            both = " of both phases" if self.config.phase1 else ""
            n = self.traffic.check_units
            checks = f" and {n} check cop{'y' if n == 1 else 'ies'}" if n else ""
            lines.append(
                SummaryLine(
                    "bytes",
                    f"DiPaCo sent {_bytes(sent)} ({_bytes(self.traffic.upload_bytes)} of "
                    f"{self.config.comm.codec} Δs up, {_bytes(self.traffic.download_bytes)} of "
                    f"weights down) for {self.traffic.units} units{both}{checks}; data-parallel "
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
        took = f"{self.seconds / 60:.1f} min"
        if self.dense:
            baselines = sum(d.seconds for d in self.dense)
            took += f" (the dense baselines trained for {baselines:.0f} s of it, beside the run)"
        lines.append(SummaryLine("time", took))
        return lines

    def phases_json(self) -> dict[str, Any]:
        config, clock = self.config, self.clock
        first = self.phase1_rounds
        phase2 = {
            "first_round": first, "rounds": config.rounds, "paths": config.num_paths,
            "replicas_per_path": config.replicas_per_path, "inner_steps": config.inner.steps,
            "starts_from": self.starts_from, "router": config.router.featurizer,
            "units": self.traffic.units - self.traffic.phase1_units,
            "tokens": self.traffic.tokens, "seconds": clock.phase2 if clock else None,
        }  # fmt: skip
        if config.phase1 is None:
            return {"phase1": None, "between": None, "phase2": phase2}
        last = self.phase1_losses.get(first - 1)
        dense = config.dense_phase
        return {
            "phase1": {"first_round": 0, "rounds": first, "replicas": dense.replicas_per_path,
                       "inner_steps": dense.inner.steps,
                       "val_loss": [{"round": t, "loss": x}
                                    for t, x in sorted(self.phase1_losses.items())],
                       "final_loss": last, "final_perplexity": perplexity(last),
                       "units": self.traffic.phase1_units, "tokens": self.traffic.phase1_tokens,
                       "seconds": clock.phase1 if clock else None},
            "between": {"seconds": clock.between if clock else None,
                        "featurizer": config.router.featurizer,
                        "prefix_tokens": config.router.prefix_tokens,
                        "router": config.router.method},
            "phase2": phase2,
        }  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        before, final = self.routed(self.before), self.routed(self.final)
        initial = self.routed(self.initial) if self.initial else before
        versus = self.versus_dense()
        sent = self.traffic.upload_bytes + self.traffic.download_bytes
        paths = []
        for p in sorted(self.weights):
            initial_p = self.initial.get(p, self.before.get(p))
            row = {
                "path": p, "modules": list(self.config.path_modules(p)),
                "val_tokens": self.weights[p],
                "loss_initial": initial_p, "perplexity_initial": perplexity(initial_p),
                "loss_before": self.before.get(p), "loss": self.final.get(p),
                "perplexity_before": perplexity(self.before.get(p)), "perplexity": perplexity(self.final.get(p)),
            }  # fmt: skip
            for d in self.dense:
                row[f"loss_dense_{d.key}"] = d.losses.get(p)
                row[f"perplexity_dense_{d.key}"] = perplexity(d.losses.get(p))
            paths.append(row)
        curve = [{"round": t, "phase": 1, "loss": x} for t, x in sorted(self.phase1_losses.items())]
        curve += [{"round": r["round"], "phase": 2, "loss": r["routed"]} for r in self.rounds]
        return {
            "format": SUMMARY_FORMAT,
            "run": {"id": self.run_id, "name": self.run_name, "paths": self.config.num_paths,
                    "replicas_per_path": self.config.replicas_per_path,
                    "rounds": self.config.rounds, "inner_steps": self.config.inner.steps,
                    "phase1_rounds": self.phase1_rounds,
                    "params_per_path": self.config.num_params(), "workers": self.workers},
            "server": self.server,
            "dashboard": self.dashboard,
            "seconds": self.seconds,
            "phases": self.phases_json(),
            # initial: the seeded weights; before: phase 2's start; rounds: phase 2's (routed);
            # curve: every round of both phases, phase 1's the dense model's loss.
            "routed_val_loss": {"initial": initial, "before": before, "final": final,
                                "rounds": [{"round": r["round"], "loss": r["routed"]}
                                           for r in self.rounds],
                                "phase2_first_round": self.phase1_rounds, "curve": curve},
            "perplexity": {"initial": perplexity(initial), "before": perplexity(before), "routed": perplexity(final)},
            "baselines": "trained" if self.baselines else "skipped",
            "versus_dense": versus,
            "paths": paths,
            "tokens": {"dipaco": self.traffic.tokens, "phase1": self.traffic.phase1_tokens,
                       **{f"dense_{key}": d["tokens"] for key, d in versus.items()},
                       "check_copies": self.traffic.check_tokens},
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
        t, h, first = self.config.rounds, self.config.inner.steps, self.phase1_rounds
        caption = "dense baselines skipped (--no-baselines)"
        if self.dense:
            caption = (
                f"dense: one {self.config.num_params() / 1e6:.2f}M-parameter model, the size "
                f"of a path, from {self.starts_from}; equal wall-clock: as many sequential "
                "steps as each path took; equal tokens: every token the workers trained on"
            )
        after = f", after {first} dense rounds" if first else ""
        table = Table(
            title=f"Validation perplexity after {t} DiPaCo rounds of {h} inner steps{after} "
            "(each document scored by the path it routes to)",
            caption=caption,
        )
        columns = ["path", "modules", "val tokens"]
        columns += ["initial", "phase-1 model"] if first else ["before"]
        columns += ["DiPaCo", *(f"dense, equal {d.equal}" for d in self.dense)]
        for column in columns:
            table.add_column(column, justify="right")
        for row in data["paths"]:
            initial = [_f(row["perplexity_initial"])] if first else []
            table.add_row(
                str(row["path"]), "-".join(map(str, row["modules"])), f"{row['val_tokens']:,}",
                *initial, _f(row["perplexity_before"]), _f(row["perplexity"]),
                *(_f(row[f"perplexity_dense_{d.key}"]) for d in self.dense),
            )  # fmt: skip
        p = data["perplexity"]
        initial = [_f(p["initial"])] if first else []
        table.add_row(
            "routed", "", f"{sum(self.weights.values()):,}", *initial, _f(p["before"]),
            _f(p["routed"]), *(_f(d["perplexity"]) for d in data["versus_dense"].values()),
            style="bold",
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
    # torch and transformers (seconds): only when a sample is generated
    import torch
    from transformers.utils import logging as transformers_logging

    from dipaco.cli.route import route
    from dipaco.client import cached_path_dir
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
