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

from dipaco_server.inference.services import (
    RunNotPrepared,
    get_run,
    router_bytes,
    tokenizer_blob,
)
from dipaco_server.runs.errors import ServiceError

if TYPE_CHECKING:
    from dipaco.routing.router import Router  # imports torch: loaded on the first route call

MAX_TEXT_CHARS = 65_536  # 8x the corpus reader's document chunks (DEFAULT_MAX_CHARS)
_CACHE_SIZE = 8
_routers: OrderedDict[str, Router] = OrderedDict()
_lock = threading.Lock()


class TextInvalid(ServiceError):
    """details["reason"]: "empty" or "too_long"."""

    code, status = "text_invalid", 422


def _load(tokenizer_json: bytes, router_file: bytes) -> Router:
    from tokenizers import Tokenizer

    from dipaco.data.tokenizer import RunTokenizer
    from dipaco.routing.router import Router

    tokenizer = RunTokenizer(Tokenizer.from_str(tokenizer_json.decode("utf-8")))
    with tempfile.TemporaryDirectory(prefix="dipaco-router-") as tmp:
        file = FsPath(tmp) / "router.safetensors"
        file.write_bytes(router_file)
        try:
            return Router.load(file, tokenizer)
        except ValueError as exc:  # a base-LM router needs a model the server does not keep
            raise RunNotPrepared(f"the run's router cannot be served: {exc}") from None


def run_router(run_id: int) -> Router:
    run = get_run(run_id)
    _, tokenizer_json = tokenizer_blob(run)
    router_file = router_bytes(run)
    digest = hashlib.sha256(tokenizer_json + b"\0" + router_file).hexdigest()
    with _lock:
        if digest in _routers:
            _routers.move_to_end(digest)
            return _routers[digest]
    router = _load(tokenizer_json, router_file)
    with _lock:
        _routers[digest] = router
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
