"""POST /runs/<id>/route: the run's own router (the one that sharded its data) on one text.

Routers are parsed once per process and kept by the sha256 of their tokenizer and router
bytes, so a route call costs two small blob reads and one routing, not a reload.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any

from dipaco_server.errors import ServiceError
from dipaco_server.inference.selection import get_run
from dipaco_server.inference.services import (
    RunNotPrepared,
    base_model_bytes,
    router_bytes,
    tokenizer_blob,
)
from dipaco_server.runs.models import Run

if TYPE_CHECKING:
    from dipaco.routing.router import Router  # imports torch: loaded on the first route call

MAX_TEXT_CHARS = 65_536  # 8x the corpus reader's document chunks (DEFAULT_MAX_CHARS)
_CACHE_SIZE = 8
_routers: OrderedDict[str, Router] = OrderedDict()
_lock = threading.Lock()


class TextInvalid(ServiceError):
    """details["reason"]: "empty" or "too_long"."""

    code, status = "text_invalid", 422


def _load(run: Run, tokenizer_json: bytes, router_file: bytes) -> Router:
    # torch (dipaco.routing) and the tokenizers: on the first route call, not at every start
    from safetensors import safe_open
    from tokenizers import Tokenizer

    from dipaco.routing.router import METADATA_KEY, Router, RouterSpec
    from dipaco.tokenizer import RunTokenizer

    tokenizer = RunTokenizer(Tokenizer.from_str(tokenizer_json.decode("utf-8")))
    with tempfile.TemporaryDirectory(prefix="dipaco-router-") as tmp:
        file = FsPath(tmp) / "router.safetensors"
        file.write_bytes(router_file)
        model = None
        with safe_open(str(file), framework="pt") as handle:
            spec_json = (handle.metadata() or {}).get(METADATA_KEY)
        if spec_json and RouterSpec.from_json(spec_json).featurizer == "base-lm":
            model = _base_model(run, FsPath(tmp))  # the model that embedded the training data
        try:
            return Router.load(file, tokenizer, model=model)
        except ValueError as exc:
            raise RunNotPrepared(f"the run's router cannot be served: {exc}") from None


def _base_model(run: Run, tmp: FsPath) -> Any:
    # torch: runs.checkpoint imports it (seconds); the URLs load without it (test_boundaries).
    from dipaco_server.runs.checkpoint import base_model, verify_checkpoint

    file = tmp / "base-model.safetensors"
    file.write_bytes(base_model_bytes(run))
    state = verify_checkpoint(file, run.run_config)
    if run.run_config.model.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return base_model(state, run.run_config)


def run_router(run_id: int) -> Router:
    run = get_run(run_id)
    _, tokenizer_json = tokenizer_blob(run)
    router_file = router_bytes(run)
    # The base model is written once per run, before its router: router bytes name it.
    digest = hashlib.sha256(f"{run.pk}".encode() + tokenizer_json + b"\0" + router_file)
    key = digest.hexdigest()
    with _lock:
        if key in _routers:
            _routers.move_to_end(key)
            return _routers[key]
    router = _load(run, tokenizer_json, router_file)
    with _lock:
        _routers[key] = router
        while len(_routers) > _CACHE_SIZE:
            _routers.popitem(last=False)
    return router


def route_text(run_id: int, text: str) -> dict[str, Any]:
    """{"path", "modules" (module index per level), "scores" (one per path, higher wins)}."""
    if not text.strip():
        raise TextInvalid("the text is empty; send the start of a document", reason="empty")
    if len(text) > MAX_TEXT_CHARS:
        raise TextInvalid(
            f"the text has {len(text):,} characters; the limit is {MAX_TEXT_CHARS:,}. The "
            "router reads only the first tokens of a document: send its start",
            reason="too_long",
            limit=MAX_TEXT_CHARS,
        )
    router = run_router(run_id)
    # The whole text, as when the data was sharded: the router reads its first tokens, and
    # its tie-break hashes all of it.
    scores = router.route_scores(text)  # (P,)
    path = int(scores.argmax())
    return {"path": path, "modules": list(router.modules(path)), "scores": scores.tolist()}
