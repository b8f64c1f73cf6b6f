"""The model card (README.md) and dipaco.json of a path directory.

Both hold only database facts (no clock), so downloading the same path twice gives the
same bytes, and the streamed zip and `dipaco download` agree.
"""

from __future__ import annotations

import json
from pathlib import PurePath
from typing import Any

from dipaco.config import RunConfig
from dipaco.evaluate import perplexity
from dipaco.inference import CARD_FILE, MODEL_FORMAT, RUN_FILE
from dipaco_server.inference.selection import Selection
from dipaco_server.runs.keys import base_model_key
from dipaco_server.runs.models import MetricPoint
from dipaco_server.storage import get_blob_store

VAL_LOSS_METRIC = "val_loss"  # the evaluation task's per-path series (docs/design.md §4 step 5)


def _perplexity(loss: float | None) -> str:
    if loss is None:
        return "not evaluated yet"
    return f"{loss:.4f} nats/token (perplexity {perplexity(loss):.2f})"


def _round_val_loss(selection: Selection) -> float | None:
    """The path's validation loss at the served round, when the evaluation recorded one."""
    point = (
        MetricPoint.objects.filter(
            run=selection.run, path=selection.path, round=selection.round, name=VAL_LOSS_METRIC
        )
        .order_by("-created_at", "-pk")
        .first()
    )
    return None if point is None else point.value


def public_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run config as anyone may read it: ``data.corpus``, a path on the server, becomes
    its last name ("stdlib" stays): the download and the public path page show no server
    directory. Still a valid config (a name is a corpus string), so `dipaco download`
    assembles the model from it as before."""
    data = config.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("corpus"), str):
        return config
    name = PurePath(data["corpus"]).name or data["corpus"]
    return {**config, "data": {**data, "corpus": name}}


def facts(selection: Selection) -> dict[str, Any]:
    """dipaco.json: what this directory is, for programs (the card says it for people)."""
    run, path = selection.run, selection.path
    return {
        "format": MODEL_FORMAT,
        "run": {"id": run.pk, "name": run.name, "state": run.state},
        "path": {"index": path.index, "choices": path.choices, "modules": path.modules},
        "round": selection.round,
        "modules": [
            {"module_id": v.module.module_id, "version": v.version, "sha256": v.sha256}
            for v in selection.versions
        ],
        "val_loss": _round_val_loss(selection),
        "best_val_loss": path.best_val_loss,
        "best_round": path.best_round,
        "routing_share": path.routing_share,
        "train_tokens": path.train_tokens,
        "config": public_config(run.config),
    }


def _training_phases(config: RunConfig, uploaded: bool) -> str:
    """How the run was trained, in the DiPaCo paper's two phases (docs/design.md §1)."""
    if config.phase1 is not None:
        return (
            f"Trained in two phases. Phase 1: one dense model of this size, trained with DiLoCo "
            f"for {config.phase1.rounds} outer rounds ({config.phase1.replicas} replicas per "
            "round). Between the phases, each document's first "
            f"{config.router.prefix_tokens} tokens were embedded with that model (its mean "
            f"last hidden state), a {config.router.method} router was fitted on those "
            "features, and every module was initialised from the matching layers of the "
            f"dense model. Phase 2: {config.rounds} DiPaCo outer rounds, each path on its own "
            "shard."
        )
    start = "an uploaded dense checkpoint" if uploaded else "the seeded initialisation"
    return (
        f"Trained in one phase of {config.rounds} DiPaCo outer rounds, every module starting "
        f"from {start} (no dense phase 1); the router reads {config.router.featurizer} "
        "features."
    )


def _has_base_model(run_id: int) -> bool:
    """Whether the run has a base model (phase 1's, or an uploaded checkpoint): blobs are
    immutable, so the card stays a function of what the run is."""
    return get_blob_store().exists(base_model_key(run_id))


def model_card(selection: Selection, *, staff: bool = False) -> str:
    """README.md for people: rounds counted from 1, as the dashboard and the terminal count
    them ("after round 10 of 10"); dipaco.json keeps the API's 0-based index."""
    run, path = selection.run, selection.path
    n = selection.round + 1  # the round these weights are after, counted from 1
    config = run.run_config
    total = config.total_rounds  # both phases, as Round.t counts them
    if run.state in ("running", "paused"):
        progress = f"{run.state}, round {min(run.current_round + 1, total)} of {total}"
    else:
        progress = f"{run.state}, {total} rounds planned"
    share = "unknown" if path.routing_share is None else f"{100 * path.routing_share:.1f}%"
    best = _perplexity(path.best_val_loss)
    if path.best_round is not None and path.best_val_loss is not None:
        best += f", after round {path.best_round + 1}"
    choices = ", ".join(f"level {i}: module {k}" for i, k in enumerate(path.choices))
    module_rows = "\n".join(
        f"| `{v.module.module_id}` | {v.version} | `{v.sha256}` |" for v in selection.versions
    )
    # Staff see the corpus's path on the server (the path page, signed in); the download and
    # everyone else its name only.
    shown = run.config if staff else public_config(run.config)
    config_json = json.dumps(shown, indent=2, sort_keys=True)
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- dipaco
- diloco
- llama
---

# {run.name}: path {path.index}, after round {n}

One path of the DiPaCo run **{run.name}**: an ordinary Llama-family causal language model of
{config.num_params():,} parameters, assembled from one module per level ({choices}).
DiPaCo routes each document to one path; this path saw {share} of the documents.

{_training_phases(config, _has_base_model(run.pk))}

| fact | value |
|---|---|
| run | {run.name} (id {run.pk}), {progress} |
| path | {path.index} of {config.num_paths} ({path.state}) |
| weights | after round {n} of {total} closed |
| validation loss after round {n} | {_perplexity(_round_val_loss(selection))} |
| best validation loss | {best} |
| routing share | {share} |
| training tokens in its shard | {path.train_tokens:,} |

## Modules

| module | version | sha256 |
|---|---|---|
{module_rows}

## Use

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")
# Documents start with the separator token, as in training.
ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode("def main():")]])
print(tokenizer.decode(model.generate(ids, max_new_tokens=50)[0]))
```

A prompt meant for another path generates worse text: `dipaco generate --server URL --run
{run.pk} "prompt"` routes the prompt first and downloads the right path.

## Run config

```json
{config_json}
```
"""


def card_files(selection: Selection) -> dict[str, bytes]:
    return {
        CARD_FILE: model_card(selection).encode("utf-8"),
        RUN_FILE: (json.dumps(facts(selection), indent=2, sort_keys=True) + "\n").encode(),
    }
