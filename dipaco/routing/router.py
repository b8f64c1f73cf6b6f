"""The router: text -> path, once per document (docs/design.md §1).

Pipeline: the first ``prefix_tokens`` token ids of the text -> features
(`featurize.py`) -> negative squared distance to each path's centroid -> plus a
tie-break and a per-path bias (`balance.py`) -> argmax.

Paths are indexed p in [0, P), P = product of ``factors`` (modules per level),
in mixed radix with level 0 most significant: p = k0*K1*K2... + k1*K2... + ...
With ``method="product-kmeans"`` level l's module is a centroid of sub-vector l
(`kmeans.py`); with ``method="kmeans"`` one k-means makes all P centroids and
the mixed radix only names the modules of each path.

Saved as ``router.safetensors`` (centroids, idf, bias; the JSON spec also in its
metadata, so the file alone loads) plus ``router.json`` (the same spec, for
people). The router is bound to one tokenizer: the spec records its
fingerprint and `Router.load` refuses another.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import track
from safetensors import safe_open
from safetensors.torch import save_file

from dipaco.routing.balance import fit_biases, tie_break
from dipaco.routing.featurize import (
    DEFAULT_TFIDF_DIM,
    BaseLMFeaturizer,
    Featurizer,
    PrecomputedFeaturizer,
    TfidfFeaturizer,
)
from dipaco.routing.kmeans import feature_chunks, kmeans, product_kmeans, squared_distances
from dipaco.tokenizer import RunTokenizer

ROUTER_VERSION = 1
FEATURIZERS = ("tfidf", "base-lm")
METHODS = ("kmeans", "product-kmeans")
# Only this many characters are tokenised to find the first prefix_tokens
# tokens: 64 characters per token is far beyond any real token, and routing,
# sharding and serving all cut the same way, so they always agree.
CHARS_PER_PREFIX_TOKEN = 64
METADATA_KEY = "dipaco.router"
# A fitted router keeps its training documents' features for the sharding that follows
# when they fit in this many values (512 MiB of float64; 50,000 documents of a 256-wide
# base model take 12.8M).
KEEP_FEATURES_MAX_VALUES = 2**26


def path_to_modules(path: int, factors: Sequence[int]) -> tuple[int, ...]:
    """Module index per level of ``path`` (mixed radix, level 0 most significant)."""
    num_paths = math.prod(factors)
    if not 0 <= path < num_paths:
        raise ValueError(f"path {path} is outside [0, {num_paths})")
    modules = []
    for k in reversed(factors):
        path, module = divmod(path, k)
        modules.append(module)
    return tuple(reversed(modules))


def modules_to_path(modules: Sequence[int], factors: Sequence[int]) -> int:
    path = 0
    for module, k in zip(modules, factors, strict=True):
        if not 0 <= module < k:
            raise ValueError(f"module {module} is outside [0, {k})")
        path = path * k + module
    return path


def prefix_ids(
    tokenizer: RunTokenizer, texts: Sequence[str], prefix_tokens: int
) -> list[list[int]]:
    """The first ``prefix_tokens`` token ids of each text, cut as routing cuts them."""
    limit = prefix_tokens * CHARS_PER_PREFIX_TOKEN
    ids = tokenizer.encode_batch([t[:limit] for t in texts])
    return [row[:prefix_tokens] for row in ids]


@dataclass(frozen=True)
class RouterSpec:
    featurizer: str
    method: str
    factors: tuple[int, ...]
    prefix_tokens: int
    seed: int
    max_imbalance: float
    feature_dim: int
    tokenizer_fingerprint: str
    vocab_size: int
    train_loads: tuple[int, ...]  # documents per path on the data the biases were fitted on
    version: int = ROUTER_VERSION

    @property
    def num_paths(self) -> int:
        return math.prod(self.factors)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RouterSpec:
        raw = json.loads(text)
        if raw.get("version") != ROUTER_VERSION:
            raise ValueError(
                f"router format version {raw.get('version')} is not {ROUTER_VERSION}; "
                "rebuild the router with this dipaco version"
            )
        raw["factors"] = tuple(raw["factors"])
        raw["train_loads"] = tuple(raw["train_loads"])
        return cls(**raw)


class Router:
    def __init__(
        self,
        spec: RouterSpec,
        tokenizer: RunTokenizer,
        featurizer: Featurizer,
        centroids: list[torch.Tensor],
        bias: torch.Tensor,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.featurizer = featurizer
        self.centroids = [c.double() for c in centroids]
        self.bias = bias.double()

    @property
    def num_paths(self) -> int:
        return self.spec.num_paths

    # -- routing -----------------------------------------------------------------

    def prefix_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """The first ``prefix_tokens`` token ids of each text."""
        return prefix_ids(self.tokenizer, texts, self.spec.prefix_tokens)

    def features(self, texts: Sequence[str]) -> torch.Tensor:
        return self.featurizer.features(self.prefix_ids(texts))  # (N, D)

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """(N, P) squared distance from features x (N, D) to each path's centroid."""
        if self.spec.method == "kmeans":
            return squared_distances(x, self.centroids[0])  # (N, P)
        total = torch.zeros((x.shape[0], 1), dtype=torch.float64)  # (N, 1)
        for chunk, centroids in zip(
            feature_chunks(x, len(self.centroids)), self.centroids, strict=True
        ):
            d = squared_distances(chunk, centroids)  # (N, K_l)
            # Broadcast-add the new level as the least significant digit.
            total = (total[:, :, None] + d[:, None, :]).flatten(1)  # (N, prod K so far)
        return total

    def route_scores_batch(self, texts: Sequence[str]) -> torch.Tensor:
        """(N, P) float64 routing scores, higher is better; route = argmax."""
        x = self.features(texts)
        return -self.distances(x) + tie_break(texts, self.num_paths) + self.bias

    def route_scores(self, text: str) -> torch.Tensor:
        return self.route_scores_batch([text])[0]  # (P,)

    def route_batch(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [int(p) for p in self.route_scores_batch(texts).argmax(dim=1)]

    def route_prefixes(self, texts: Sequence[str], prefixes: Sequence[Any]) -> list[int]:
        """route_batch with each text's first ``prefix_tokens`` ids already known, e.g. from
        the encoding a shard writer made anyway (dipaco.data.stream): one tokenisation, not
        two. Equal to route_batch unless one pre-token straddles prefix_ids' character cut."""
        if not texts:
            return []
        x = self.featurizer.features([list(p[: self.spec.prefix_tokens]) for p in prefixes])
        scores = -self.distances(x) + tie_break(texts, self.num_paths) + self.bias  # (N, P)
        return [int(p) for p in scores.argmax(dim=1)]

    def route(self, text: str) -> int:
        return self.route_batch([text])[0]

    def route_tails(self, ids: Sequence[Sequence[int]]) -> list[int]:
        """The path of each token-id sequence read from its end: the router's features of
        its last ``prefix_tokens`` ids (re-routing while generating reads the text so far,
        not a document's first tokens). The tie-break hashes the decoded tail, as `route`
        hashes its text."""
        tails = [list(row[-self.spec.prefix_tokens :]) for row in ids]
        if not tails:
            return []
        if any(not tail for tail in tails):
            raise ValueError("route_tails: every sequence needs at least one token id")
        texts = [self.tokenizer.decode(tail) for tail in tails]
        x = self.featurizer.features(tails)  # (N, D)
        scores = -self.distances(x) + tie_break(texts, self.num_paths) + self.bias
        return [int(p) for p in scores.argmax(dim=1)]

    def route_tail(self, ids: Sequence[int]) -> int:
        """`route_tails` of one sequence: the path for the text so far."""
        return self.route_tails([ids])[0]

    def modules(self, path: int) -> tuple[int, ...]:
        return path_to_modules(path, self.spec.factors)

    # -- fitting -----------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        texts: Sequence[str],
        tokenizer: RunTokenizer,
        *,
        factors: Sequence[int],
        featurizer: str = "tfidf",
        method: str = "kmeans",
        prefix_tokens: int = 32,
        max_imbalance: float = 1.25,
        seed: int = 0,
        model: Any = None,
        tfidf_dim: int = DEFAULT_TFIDF_DIM,
        max_kmeans_docs: int = 50_000,
        progress: bool = False,
        features: Featurizer | None = None,
    ) -> Router:
        """Fit centroids on (a sample of) ``texts`` and biases on all of them.

        ``factors``: modules per level, e.g. (2, 2) for 4 paths on 2 levels.
        ``model``: the base LM, required for ``featurizer="base-lm"``.
        ``max_kmeans_docs``: k-means runs on at most this many documents
        (an evenly spaced, deterministic subset); the biases see every document.
        ``features``: a featurizer of kind ``featurizer`` to use as it is, e.g. a
        `PrecomputedFeaturizer` holding features computed ahead in chunks.
        """
        factors = tuple(int(k) for k in factors)
        _check_fit(len(texts), factors, featurizer, method, prefix_tokens, features)
        feat = features or _make_featurizer(
            featurizer, tokenizer, prefix_tokens, model, tfidf_dim, None
        )
        draft = cls(
            RouterSpec(
                featurizer=featurizer,
                method=method,
                factors=factors,
                prefix_tokens=prefix_tokens,
                seed=seed,
                max_imbalance=float(max_imbalance),
                feature_dim=feat.dim,
                tokenizer_fingerprint=tokenizer.fingerprint,
                vocab_size=tokenizer.vocab_size,
                train_loads=(),
            ),
            tokenizer,
            feat,
            centroids=[],
            bias=torch.zeros(math.prod(factors), dtype=torch.float64),
        )
        prefixes = _batched(draft.prefix_ids, texts, "Tokenising prefixes", progress)
        if isinstance(feat, TfidfFeaturizer):
            feat.fit(prefixes)
        x = torch.cat(_batched(feat.features, prefixes, "Featurising", progress, concat=False))
        stride = max(1, math.ceil(len(texts) / max_kmeans_docs))
        sample = x[::stride]  # (N', D)
        if method == "kmeans":
            draft.centroids = [kmeans(sample, math.prod(factors), seed=seed).centroids]
        else:
            draft.centroids = [r.centroids for r in product_kmeans(sample, factors, seed=seed)]
        scores = -draft.distances(x) + tie_break(texts, draft.num_paths)  # (N, P)
        draft.bias = fit_biases(scores, max_imbalance)
        loads = torch.bincount((scores + draft.bias).argmax(dim=1), minlength=draft.num_paths)
        spec = RouterSpec(**{**asdict(draft.spec), "train_loads": tuple(loads.tolist())})
        if x.numel() <= KEEP_FEATURES_MAX_VALUES and not isinstance(feat, PrecomputedFeaturizer):
            # Sharding routes these same documents next: the features just computed (those
            # the biases balance) serve it instead of a second pass through the featurizer.
            # A router loaded from disk computes them afresh, as before.
            table = dict(zip((tuple(p) for p in prefixes), x, strict=True))
            feat = PrecomputedFeaturizer(feat, table)
        return cls(spec, tokenizer, feat, draft.centroids, draft.bias)

    # -- persistence -------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write router.safetensors and router.json into ``directory``; returns the former."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"centroids.{i}": c.contiguous() for i, c in enumerate(self.centroids)}
        tensors["bias"] = self.bias.contiguous()
        tensors.update(self.featurizer.state_tensors())
        spec_json = self.spec.to_json()
        target = out / "router.safetensors"
        tmp = out / ".router.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={METADATA_KEY: spec_json})
        os.replace(tmp, target)
        tmp_json = out / ".router.json.tmp"
        tmp_json.write_text(spec_json + "\n", encoding="utf-8")
        os.replace(tmp_json, out / "router.json")
        return target

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], tokenizer: RunTokenizer, *, model: Any = None
    ) -> Router:
        """Open a saved router (its directory or router.safetensors) for ``tokenizer``."""
        file = Path(path)
        if file.is_dir():
            file = file / "router.safetensors"
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        if METADATA_KEY not in metadata:
            raise ValueError(f"{file} is not a dipaco router (no {METADATA_KEY!r} metadata)")
        spec = RouterSpec.from_json(metadata[METADATA_KEY])
        if tokenizer.fingerprint != spec.tokenizer_fingerprint:
            raise ValueError(
                f"router at {file} was fitted with another tokenizer; load the tokenizer "
                "saved with the same run (tokenizer.json next to router.safetensors)"
            )
        feat = _make_featurizer(
            spec.featurizer, tokenizer, spec.prefix_tokens, model, spec.feature_dim, tensors
        )
        levels = 1 if spec.method == "kmeans" else len(spec.factors)
        centroids = [tensors[f"centroids.{i}"] for i in range(levels)]
        _check_shapes(spec, feat, centroids, tensors["bias"])
        return cls(spec, tokenizer, feat, centroids, tensors["bias"])


def _check_fit(
    documents: int,
    factors: tuple[int, ...],
    featurizer: str,
    method: str,
    prefix_tokens: int,
    features: Featurizer | None,
) -> None:
    """`Router.fit`'s arguments, refused with what to change."""
    if featurizer not in FEATURIZERS or method not in METHODS:
        raise ValueError(
            f"routing.featurizer must be one of {FEATURIZERS} and routing.method one of "
            f"{METHODS}; got {featurizer!r}, {method!r}"
        )
    if not factors or min(factors) < 1 or prefix_tokens < 1:
        raise ValueError(f"factors must be positive ints and prefix_tokens >= 1: {factors}")
    if documents < math.prod(factors):
        raise ValueError(
            f"{documents} documents cannot fill {math.prod(factors)} paths; "
            "use more data or fewer modules per level"
        )
    if features is not None and features.name != featurizer:
        raise ValueError(f"features are {features.name!r}, not {featurizer!r}")


def _make_featurizer(
    name: str,
    tokenizer: RunTokenizer,
    prefix_tokens: int,
    model: Any,
    dim: int,
    tensors: dict[str, torch.Tensor] | None,
) -> Featurizer:
    if name == "tfidf":
        if tensors is None:
            return TfidfFeaturizer(dim)
        if "idf" not in tensors:
            raise ValueError("router file lacks the tfidf 'idf' tensor; rebuild the router")
        return TfidfFeaturizer(dim, tensors["idf"])
    if name == "base-lm":
        if model is None:
            raise ValueError("routing.featurizer='base-lm' needs the base model: pass model=")
        return BaseLMFeaturizer(model, tokenizer.separator_id, prefix_tokens=prefix_tokens)
    raise ValueError(f"unknown featurizer {name!r}; use one of {FEATURIZERS}")


def _check_shapes(
    spec: RouterSpec, feat: Featurizer, centroids: list[torch.Tensor], bias: torch.Tensor
) -> None:
    """Saved tensors are untrusted input: refuse any that disagree with the spec."""
    counts = (spec.num_paths,) if spec.method == "kmeans" else spec.factors
    dims = [c.shape[1] if c.ndim == 2 else -1 for c in centroids]
    # The sub-vector widths `feature_chunks` will cut at routing time.
    expected = [len(c) for c in torch.tensor_split(torch.arange(spec.feature_dim), len(dims))]
    ok = (
        feat.dim == spec.feature_dim
        and tuple(c.shape[0] for c in centroids) == tuple(counts)
        and dims == expected
        and tuple(bias.shape) == (spec.num_paths,)
        and all(bool(torch.isfinite(t).all()) for t in [*centroids, bias])
    )
    if not ok:
        raise ValueError(
            "router tensors do not match router.json (centroid counts, feature dims or "
            "bias shape, or non-finite values); rebuild the router"
        )


def _batched(
    fn: Any,
    items: Sequence[Any],
    label: str,
    progress: bool,
    *,
    concat: bool = True,
    size: int = 512,
) -> list[Any]:
    starts = range(0, len(items), size)
    out: list[Any] = []
    for start in track(starts, description=label) if progress else starts:
        result = fn(items[start : start + size])
        if concat:
            out.extend(result)
        else:
            out.append(result)
    return out
