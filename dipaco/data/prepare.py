"""Data preparation, one pipeline for the simulator and the server: documents → tokenizer
→ router → one shard per path.

`dipaco simulate` (dipaco.simulate.prepare, which caches the result by its inputs) and
the control plane (dipaco_server.runs.prepare, which uploads each piece and reports
progress) both call `prepare_documents`; they differ only in where documents come from and
where the files go. A router exists only with more than one path; a phase-1 run shards
every document into one path and routes after the dense phase (dipaco_server.runs.between).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dipaco.config import RunConfig
from dipaco.data.corpus import Document
from dipaco.data.shards import ShardIndex, build_shards
from dipaco.routing.router import Router
from dipaco.tokenizer import DEFAULT_TRAIN_CHARS, RunTokenizer, train_tokenizer

__all__ = ["Prepared", "fit_router", "fit_router_on", "prepare_documents"]

# (stage, detail): "tokenizer", "router" or "shards", as each stage starts.
Stage = Callable[[str, str], None]


@dataclass(frozen=True)
class Prepared:
    tokenizer: RunTokenizer
    tokenizer_dir: Path
    router: Router | None
    router_file: Path | None  # router.safetensors (router.json beside it)
    shards: ShardIndex
    shard_dir: Path


def fit_router(
    config: RunConfig, train: Sequence[Document], tokenizer: RunTokenizer, model: Any = None
) -> Router:
    """The run's (product) k-means router on the training documents' first tokens, with
    tf-idf features or, for ``router.featurizer = "base-lm"``, a base model's (`model`)."""
    if config.router.featurizer == "base-lm" and model is None:
        raise ValueError(
            "router.featurizer = 'base-lm' routes with a trained base model, and none was "
            "given: train phase 1 (or base steps) first, or use router.featurizer = 'tfidf'"
        )
    return Router.fit(
        [doc.text for doc in train],
        tokenizer,
        factors=config.layout.modules_per_level,
        featurizer=config.router.featurizer,
        model=model if config.router.featurizer == "base-lm" else None,
        method=config.router.method,
        prefix_tokens=config.router.prefix_tokens,
        max_imbalance=config.router.max_imbalance,
        seed=config.router.seed,
    )


def fit_router_on(
    config: RunConfig, texts: Sequence[str], tokenizer: RunTokenizer, model: Any = None
) -> Router:
    """fit_router on texts (the streaming preparation's sample of prefixes)."""
    docs = [Document(str(i), text, str(i)) for i, text in enumerate(texts)]
    return fit_router(config, docs, tokenizer, model)


def prepare_documents(
    config: RunConfig,
    train: Sequence[Document],
    val: Sequence[Document],
    out: Path,
    *,
    tokenizer: RunTokenizer | None = None,
    model: Any = None,
    num_paths: int | None = None,
    tokenizer_chars: int = DEFAULT_TRAIN_CHARS,
    on_stage: Stage = lambda stage, detail: None,
    unrouted_dir: Path | None = None,
) -> Prepared:
    """Tokenizer (trained on `train` unless given), router (when `num_paths` > 1) and
    shards, written under `out` (tokenizer/, router/, shards/).

    `num_paths` defaults to the layout's; 1 writes one shard of every document (no
    router). `model` is the base model a "base-lm" router reads its features with.
    `unrouted_dir`: also one shard of every document there, from the same tokenisation
    (build_shards).
    """
    paths = config.layout.num_paths if num_paths is None else num_paths
    if tokenizer is None:
        on_stage("tokenizer", "training the tokenizer")
        tokenizer = train_tokenizer(train, config.model.vocab_size, max_chars=tokenizer_chars)
    else:
        on_stage("tokenizer", "the given tokenizer")
    tokenizer_dir = tokenizer.save(out / "tokenizer")
    router, router_file = None, None
    if paths > 1:
        on_stage("router", f"fitting a {config.router.method} {config.router.featurizer} router")
        router = fit_router(config, train, tokenizer, model)
        router_file = router.save(out / "router")
    else:
        on_stage("router", "one path: no router")
    on_stage("shards", f"tokenising and routing {len(train)} + {len(val)} documents")
    shard_dir = out / "shards"
    shards = build_shards(
        train, val, tokenizer, router, shard_dir, num_paths=paths, progress=False,
        unrouted_dir=unrouted_dir,
    )  # fmt: skip
    return Prepared(tokenizer, tokenizer_dir, router, router_file, shards, shard_dir)
