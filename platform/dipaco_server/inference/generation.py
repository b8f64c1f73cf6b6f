"""Text generation on a run's paths, re-routing every k tokens (dipaco.generation's loop).

The run's router (inference.routing, the one that sharded its data) routes the prompt, from
its first tokens; with `reroute_every` k > 0 it reads the last ``router.prefix_tokens``
tokens of the text so far every k new tokens, and the path it picks goes on with a fresh
prefill. A run of one path has no router: its path writes everything. The answer names
every path used and where the path changed, for the API (POST /runs/{id}/generate) and the
dashboard's prompt box.

Models are opened from a path directory's files (the zip's, dipaco.inference) through
transformers and kept for the last few module versions asked, so re-routing between a
handful of paths does not reload them.
"""

from __future__ import annotations

import tempfile
import threading
from collections import OrderedDict
from pathlib import Path as FsPath
from typing import Any

from dipaco_server.errors import ServiceError
from dipaco_server.inference import routing, services
from dipaco_server.inference.selection import Selection, get_run, select
from dipaco_server.runs.phases import PATHS
from dipaco_server.storage import get_blob_store

MAX_NEW_TOKENS = 256  # the API's bound; the dashboard's is settings.DIPACO_GENERATE_...
_MODELS: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
_MODELS_KEPT = 4  # paths whose models stay loaded (a re-routed answer visits a few)
_lock = threading.Lock()


class GenerateInvalid(ServiceError):
    """details["field"]: which argument is out of bounds."""

    code, status = "generate_invalid", 422


def open_selection(selection: Selection) -> tuple[Any, Any]:
    """The path's transformers model and tokenizer, from its directory's files (kept for
    the last few paths asked; the key names the module versions, so new weights reload)."""
    key = services.model_blob_key(selection)
    with _lock:
        if key in _MODELS:
            _MODELS.move_to_end(key)
            return _MODELS[key]
    # transformers and torch: imported on the first generation, not when the server starts
    from dipaco.inference import open_path_dir

    store = get_blob_store()
    with tempfile.TemporaryDirectory(prefix="dipaco-generate-") as tmp:
        for file in services.path_files(selection):
            target = FsPath(tmp) / file.name
            if file.data is not None:
                target.write_bytes(file.data)
            else:
                assert file.blob_key is not None
                store.download_to(file.blob_key, target)
        loaded = open_path_dir(tmp)
    with _lock:
        _MODELS[key] = loaded
        while len(_MODELS) > _MODELS_KEPT:
            _MODELS.popitem(last=False)
    return loaded


def _check(max_new_tokens: int, reroute_every: int, temperature: float, limit: int) -> None:
    if not 1 <= max_new_tokens <= limit:
        raise GenerateInvalid(
            f"max_new_tokens = {max_new_tokens}: ask for 1 to {limit} tokens",
            field="max_new_tokens", limit=limit,
        )  # fmt: skip
    if reroute_every < 0:
        raise GenerateInvalid(
            f"reroute_every = {reroute_every}: 0 (route once) or a token count",
            field="reroute_every",
        )  # fmt: skip
    if not 0 <= temperature <= 2:
        raise GenerateInvalid(f"temperature = {temperature}: 0 (greedy) to 2", field="temperature")


def generate_text(
    run_id: int,
    prompt: str,
    max_new_tokens: int,
    *,
    reroute_every: int = 0,
    temperature: float = 0.0,
    seed: int = 0,
    path: int | None = None,
    round: int | None = None,
    limit: int = MAX_NEW_TOKENS,
) -> dict[str, Any]:
    """Continue `prompt` on the run's paths (module doc). `path` skips routing: that path
    alone writes everything, as a downloaded path does."""
    # torch (through dipaco.generation's loop): imported on the first generation
    from dipaco.generation import generate

    _check(max_new_tokens, reroute_every, temperature, limit)
    run = get_run(run_id)
    routed = path is None and run.paths.filter(phase=PATHS).count() > 1
    first = int(routing.route_text(run_id, prompt)["path"]) if routed else (path or 0)
    selections = {first: select(run_id, first, round)}

    def open_path(p: int) -> Any:
        if p not in selections:
            selections[p] = select(run_id, p, round)
        return open_selection(selections[p])[0]

    tokenizer = open_selection(selections[first])[1]
    # Training documents start with the separator (BOS); a long prompt keeps its end, so
    # prompt and continuation fit the model's context.
    tokens = [tokenizer.bos_token_id, *tokenizer.encode(prompt)]
    room = max(1, run.run_config.model.seq_len - max_new_tokens)
    prompt_ids = tokens[-room:]
    router = routing.run_router(run_id) if routed and reroute_every else None
    done = generate(
        open_path, prompt_ids, first, max_new_tokens,
        route_tail=router.route_tail if router is not None else None,
        reroute_every=reroute_every, temperature=temperature, seed=seed,
        stop=tokenizer.eos_token_id,
    )  # fmt: skip
    segments = [
        {"path": s.path, "start": s.start, "end": s.end,
         "text": tokenizer.decode(done.tokens[s.start : s.end], skip_special_tokens=True)}
        for s in done.segments
    ]  # fmt: skip
    return {
        "path": first,
        "routed": routed,
        "prompt": prompt,
        "continuation": tokenizer.decode(done.tokens, skip_special_tokens=True),
        "tokens": len(done.tokens),
        "round": selections[first].round,
        "reroute_every": reroute_every if router is not None else 0,
        "paths": done.paths,
        "segments": segments,
        "switches": done.switches,
        "seed": seed,
        "temperature": temperature,
    }
