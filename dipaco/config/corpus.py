"""Where a run's text comes from, how documents route to paths, and held-out evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dipaco.config.rules import MAX_PATHS, MAX_ROUNDS, MAX_SEED, Section


class DataConfig(Section):
    """Where the run's text comes from; the vocabulary size is model.vocab_size."""

    corpus: str = Field(
        default="stdlib",
        min_length=1,
        max_length=4096,  # PATH_MAX on Linux
        description='"stdlib", a directory of text, or a .jsonl path.',
    )
    text_field: str = Field(
        default="text", min_length=1, max_length=256, description="Field holding text in .jsonl."
    )
    val_fraction: float = Field(
        default=0.01,
        ge=0,
        lt=0.5,
        description="Share of each path's shard held out for evaluation.",
    )


class RouterConfig(Section):
    """Offline routing of documents to paths (DiPaCo: features of the first 32 tokens)."""

    featurizer: Literal["tfidf", "base-lm"] = Field(
        default="tfidf",
        description="Hashed n-gram TF-IDF, or the base LM's mean last hidden state.",
    )
    method: Literal["kmeans", "product-kmeans"] = Field(
        default="kmeans", description="One k-means over all paths, or one factor per level."
    )
    prefix_tokens: int = Field(
        default=32, gt=0, le=131_072, description="Tokens of each document the router reads."
    )
    max_imbalance: float = Field(
        default=1.5,
        ge=1.0,
        le=float(MAX_PATHS),  # one shard holding everything is MAX_PATHS x the mean at most
        description="Largest shard at most this x the mean shard size.",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of the clustering.")


class EvalConfig(Section):
    """Held-out evaluation after every round, and per-path early stopping (DiPaCo §4)."""

    batches: int = Field(default=4, ge=1, le=1024, description="Validation batches per path.")
    batch_size: int = Field(default=8, ge=1, le=4096, description="Windows per validation batch.")
    flops: float = Field(
        # 291 windows of the 150M path (3.43e11 FLOPs each); the tiny and capacity presets'
        # whole 1,024-window sample costs under a twentieth of it.
        default=1e14,
        ge=1e6,
        le=1e21,
        description="Forward FLOPs a round's evaluation may cost: the sample's windows "
        "follow for the run's model, at least 1, at most the 1,024-window sample "
        "(dipaco.flops).",
    )
    patience: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ROUNDS,
        description="Evaluations without improvement before a path stops training (rounds "
        "when every path is scored every round; a rotated evaluation scores each path every "
        "few rounds, dipaco.evaluate.eval_plan); null: never.",
    )
    min_delta: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,  # nats: a loss is at most ln(vocab_size) < 14 at the start of training
        description="A loss improvement smaller than this does not count.",
    )
    min_path_windows: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Windows a path is scored on at least when the budget cannot give every "
        "path as many: each round then scores a rotating group of the paths, and every path "
        "is scored every few rounds (dipaco.evaluate.eval_plan).",
    )
