"""Prepare a simulation's data: corpus -> tokenizer -> router -> per-path token shards.

Everything is cached in ``<work_dir>/<key>/`` where the key hashes every input that changes
the result (corpus, budget, split, vocabulary, router settings, modules per level, seed).
A second run with the same inputs opens the directory instead of re-tokenising.

Layout of a prepared directory::

    meta.json     inputs, document counts, corpus statistics
    tokenizer/    a Hugging Face tokenizer directory (dipaco.tokenizer)
    router/       router.safetensors + router.json (absent with one path)
    shards/       per-path train/val shards, as the platform stores them (dipaco.data.shards)
    all/          one shard of every document: the i.i.d. stream the baselines read
                  (absent with one path, where shards/ is that stream already)

Documents are written in a seeded hash order, so a path's stream and the stream of all
documents are both shuffled the same way.

With ``router.featurizer = "base-lm"`` (the DiPaCo paper's recipe) the router reads the
mean last hidden state of a base model (`base_state`, the dense phase-1 model: see
dipaco.simulate.base) over each document's first tokens; the base's digest joins the key.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dipaco.config import RunConfig
from dipaco.data.corpus import CorpusStats, Document, iter_corpus, split_documents
from dipaco.data.prepare import prepare_documents
from dipaco.data.shards import ShardIndex
from dipaco.data.windows import ShardSource  # the platform's window order (re-exported)
from dipaco.evaluate import ValWindows, sample_streams
from dipaco.model import build_model
from dipaco.routing.router import Router
from dipaco.tokenizer import RunTokenizer

__all__ = ["DataBudget", "PreparedData", "ShardSource", "default_work_dir", "prepare_data"]

PREPARE_FORMAT = "dipaco-simulate-data/2"
Log = Callable[[str], None]


@dataclass(frozen=True)
class DataBudget:
    """How much of the corpus a simulation reads: a hash-ordered sample, so any budget
    covers every part of the corpus (a sorted stdlib cut would be all `asyncio`)."""

    max_docs: int | None = 2000  # documents (file chunks of <= 8192 chars) kept at most
    max_chars: int | None = None  # characters kept at most, over train and validation
    tokenizer_chars: int = 4_000_000  # BPE training sample (dipaco.tokenizer default)


@dataclass
class PreparedData:
    directory: Path
    key: str
    reused: bool
    tokenizer: RunTokenizer
    router: Router | None
    shards: ShardIndex  # one entry per path
    everything: ShardIndex  # one path holding every document
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_paths(self) -> int:
        return self.shards.num_paths

    def _root(self, index: ShardIndex) -> Path:
        return self.directory / ("shards" if index is self.shards else "all")

    def train_source(
        self, path: int | None, seq_len: int, seed: int, rows_per_chunk: int | None = None
    ) -> ShardSource:
        """Training windows of one path, or of every document (path=None), shuffled;
        `rows_per_chunk`: the platform's row chunks (dipaco.data.rows), which order passes
        after the first."""
        index = self.shards if path is not None else self.everything
        shard = index.open(self._root(index), path or 0, "train")
        return ShardSource(shard, seq_len, seed, rows_per_chunk)

    def val_tokens(self, path: int) -> Tensor:
        """Path's whole validation stream, (N,) int64 (empty when no document routes there)."""
        info = self.shards.info(path, "val")
        if info.tokens == 0:
            return torch.zeros(0, dtype=torch.int64)
        shard = self.shards.open(self._root(self.shards), path, "val")
        return torch.from_numpy(shard.read_window(0, len(shard)))

    def docs(self, split: str) -> list[int]:
        """Documents per path in `split` ("train" or "val")."""
        return [self.shards.info(p, split).docs for p in range(self.num_paths)]

    def tokens(self, split: str) -> list[int]:
        return [self.shards.info(p, split).tokens for p in range(self.num_paths)]

    def val_windows(self, seq_len: int, count: int, seed: int = 0) -> ValWindows:
        """The run's validation sample of `count` windows (dipaco.evaluate.sample_plan, the
        server's and the demo's too; `seed` is the run's): the DiPaCo run and every
        baseline are scored on the very same windows."""
        streams = [self.val_tokens(p) for p in range(self.num_paths)]
        return sample_streams(streams, seq_len, count, seed)


def default_work_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "dipaco" / "simulate"


def state_digest(state: Mapping[str, Tensor]) -> str:
    """A short content hash of a state dict (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_inputs(
    config: RunConfig, budget: DataBudget, base_state: Mapping[str, Tensor] | None = None
) -> dict[str, Any]:
    """Everything the prepared data depends on (and nothing it does not, e.g. H or lr)."""
    routes_with_base = config.router.featurizer == "base-lm" and config.layout.num_paths > 1
    return {
        "base": state_digest(base_state) if routes_with_base and base_state else None,
        "format": PREPARE_FORMAT,
        "data": config.data.model_dump(mode="json"),
        "vocab_size": config.model.vocab_size,
        "router": config.router.model_dump(mode="json"),
        "modules_per_level": list(config.layout.modules_per_level),
        "seed": config.seed,
        "max_docs": budget.max_docs,
        "max_chars": budget.max_chars,
        "tokenizer_chars": budget.tokenizer_chars,
    }


def _doc_hash(seed: int, doc: Document) -> bytes:
    return hashlib.sha256(f"{seed}:{doc.id}".encode("utf-8", "surrogatepass")).digest()


def select_documents(
    config: RunConfig, budget: DataBudget, stats: CorpusStats
) -> tuple[list[Document], list[Document]]:
    """The budgeted sample, split into (train, val) by source, both in seeded hash order."""
    docs: Iterable[Document] = iter_corpus(
        config.data.corpus, stats, text_field=config.data.text_field
    )
    key = lambda doc: _doc_hash(config.seed, doc)  # noqa: E731
    if budget.max_docs is not None:
        chosen = heapq.nsmallest(budget.max_docs, docs, key=key)  # streams: holds max_docs
    else:
        chosen = sorted(docs, key=key)
    if budget.max_chars is not None:
        total, kept = 0, list[Document]()
        for doc in chosen:
            if total + len(doc.text) > budget.max_chars and kept:
                break
            kept.append(doc)
            total += len(doc.text)
        chosen = kept
    return split_documents(chosen, config.data.val_fraction)


def _base_model(
    config: RunConfig, base_state: Mapping[str, Tensor] | None, device: torch.device | str = "cpu"
) -> Any:
    if config.router.featurizer != "base-lm" or config.layout.num_paths == 1:
        return None
    if base_state is None:
        raise ValueError(
            "router.featurizer = 'base-lm' routes with a trained base model: give base "
            "steps (--base-steps) or use router.featurizer = 'tfidf'"
        )
    model: nn.Module = build_model(config.model, config.seed)
    model.load_state_dict(base_state)
    return model.to(device).eval()


def _build(
    config: RunConfig,
    budget: DataBudget,
    out: Path,
    log: Log,
    base_state: Mapping[str, Tensor] | None = None,
    model: Any = None,
) -> dict[str, Any]:
    stats = CorpusStats()
    train_docs, val_docs = select_documents(config, budget, stats)
    if not val_docs:
        raise ValueError(
            f"the sample of {len(train_docs)} documents left none for validation; raise "
            "data.val_fraction (--val-fraction) or the budget (--max-docs)"
        )
    log(f"corpus: {len(train_docs)} train + {len(val_docs)} val documents")
    prepared = prepare_documents(
        config, train_docs, val_docs, out, model=model,
        tokenizer_chars=budget.tokenizer_chars, on_stage=lambda stage, detail: log(detail),
        # the baselines' i.i.d. stream of every document, from the same tokenisation
        unrouted_dir=out / "all" if config.layout.num_paths > 1 else None,
    )  # fmt: skip
    tokenizer = prepared.tokenizer
    return {
        "inputs": cache_inputs(config, budget, base_state),
        "train_docs": len(train_docs),
        "val_docs": len(val_docs),
        "corpus_files": stats.files,
        "corpus_skipped": dict(stats.skipped),
        "tokenizer_vocab": tokenizer.vocab_size,
    }


def _load(directory: Path, key: str, reused: bool, model: Any = None) -> PreparedData:
    meta = json.loads((directory / "meta.json").read_text("utf-8"))
    tokenizer = RunTokenizer.load(directory / "tokenizer")
    shards = ShardIndex.load(directory / "shards")
    router = (
        Router.load(directory / "router", tokenizer, model=model) if shards.num_paths > 1 else None
    )
    everything = ShardIndex.load(directory / "all") if router is not None else shards
    return PreparedData(directory, key, reused, tokenizer, router, shards, everything, meta)


def prepare_data(
    config: RunConfig,
    budget: DataBudget,
    work_dir: Path | None = None,
    *,
    log: Log = lambda _: None,
    base_state: Mapping[str, Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> PreparedData:
    """Prepared data for `config`, built once per distinct input and then reused.

    `base_state` is the base model a "base-lm" router reads its features with, on `device`
    (fp32: a GPU featurises tens of thousands of documents in seconds)."""
    inputs = cache_inputs(config, budget, base_state)
    model = _base_model(config, base_state, device)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(work_dir) if work_dir is not None else default_work_dir()
    directory = root / key
    if (directory / "meta.json").is_file():
        log(f"reusing prepared data in {directory}")
        return _load(directory, key, True, model)
    root.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed into place: a crash never leaves a half-prepared directory
    # that a later run would trust.
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        meta = _build(config, budget, staging, log, base_state, model)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", "utf-8")
        try:
            os.replace(staging, directory)
        except OSError:  # another process finished the same key first: use theirs
            if not (directory / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"prepared data in {directory}")
    return _load(directory, key, False, model)
