"""Document features for routing, computed from the first ``prefix_tokens`` token
ids of a document (docs/design.md §1: routing reads the first 32 tokens).

- `TfidfFeaturizer`: hashed unigram + bigram counts of the prefix, tf-idf
  weighted (idf fitted on the training documents and saved with the router),
  L2-normalised. Needs no model, so it serves before a base LM exists.
- `BaseLMFeaturizer`: the mean last-layer hidden state of a causal LM over the
  prefix (the paper's features), L2-normalised so that distances compare
  directions, as with tf-idf.

Both return float64 features: routing compares scores whose gaps can be tiny
(see `balance.py`), and a training document must route the same way in a batch
of 256 as alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

DEFAULT_TFIDF_DIM = 2048

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixer (Steele et al., SplitMix64): the same hash on every
    platform and Python version, unlike ``hash()``. uint64 arithmetic wraps."""
    z = (x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Featurizer(Protocol):
    name: str

    @property
    def dim(self) -> int: ...

    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """(N, dim) float64 features of N token-id prefixes."""
        ...

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors saved with the router (safetensors)."""
        ...


class TfidfFeaturizer:
    """Hashed uni+bigram tf-idf of a token prefix."""

    name = "tfidf"

    def __init__(self, dim: int = DEFAULT_TFIDF_DIM, idf: torch.Tensor | None = None) -> None:
        if dim < 2:
            raise ValueError(f"tfidf dim must be at least 2, got {dim}")
        self._dim = dim
        # Until fitted every bucket weighs 1 (plain hashed counts).
        self.idf = torch.ones(dim, dtype=torch.float64) if idf is None else idf.double()
        if self.idf.shape != (dim,):
            raise ValueError(f"idf has shape {tuple(self.idf.shape)}, expected ({dim},)")

    @property
    def dim(self) -> int:
        return self._dim

    def _buckets(self, ids: Sequence[int]) -> np.ndarray:
        """Hashed n-gram buckets of one prefix: unigram keys are id+1 (< 2**32),
        bigram keys (a+1) * 2**32 + (b+1), so the two kinds never collide before
        hashing."""
        tok = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
        keys = np.concatenate([tok, (tok[:-1] << np.uint64(32)) | tok[1:]])
        return (splitmix64(keys) % np.uint64(self._dim)).astype(np.int64)

    def counts(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """(N, dim) raw n-gram counts."""
        out = np.zeros((len(prefixes), self._dim), dtype=np.float64)
        for row, ids in enumerate(prefixes):
            if len(ids):
                np.add.at(out[row], self._buckets(ids), 1.0)
        return torch.from_numpy(out)

    def fit(self, prefixes: Sequence[Sequence[int]]) -> TfidfFeaturizer:
        """Smoothed idf, log((1 + N) / (1 + df)) + 1 (scikit-learn's default)."""
        df = (self.counts(prefixes) > 0).sum(dim=0).double()  # (dim,)
        n = float(len(prefixes))
        self.idf = torch.log((1.0 + n) / (1.0 + df)) + 1.0
        return self

    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        x = self.counts(prefixes) * self.idf  # (N, dim)
        # An empty prefix stays the zero vector (clamp avoids 0/0).
        return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"idf": self.idf.contiguous()}


class BaseLMFeaturizer:
    """Mean last-layer hidden state of a causal LM over a token prefix.

    ``model`` is any transformers causal LM (or module) accepting ``input_ids``,
    ``attention_mask`` and ``output_hidden_states``. The separator id is put in
    front of each prefix, as in the shards where every document follows one, so
    an empty text still has a defined feature; the mean runs over the text's
    tokens only (over the separator alone for an empty text).
    """

    name = "base-lm"

    def __init__(
        self, model: Any, separator_id: int, *, prefix_tokens: int = 32, batch_size: int = 64
    ) -> None:
        self.model = model
        self.separator_id = separator_id
        self.prefix_tokens = prefix_tokens
        self.batch_size = batch_size
        config = getattr(model, "config", None)
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int):
            raise ValueError("base-lm featurizer needs a model with config.hidden_size")
        self._dim = hidden

    @property
    def dim(self) -> int:
        return self._dim

    @torch.no_grad()
    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        chunks = []
        for start in range(0, len(prefixes), self.batch_size):
            batch = prefixes[start : start + self.batch_size]
            # One fixed width, so a prefix sees the same shapes alone as in a batch.
            width = 1 + max(self.prefix_tokens, *(len(p) for p in batch))
            ids = torch.full((len(batch), width), self.separator_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, 1 : 1 + len(p)] = torch.tensor(list(p), dtype=torch.long)
                mask[row, : 1 + len(p)] = 1  # right padding: causal attention ignores it
            out = self.model(
                input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
            )
            hidden = out.hidden_states[-1].double().cpu()  # (B, T, C)
            weight = mask.double()  # (B, T)
            has_text = weight[:, 1:].sum(dim=1) > 0  # (B,)
            weight[has_text, 0] = 0.0  # mean over the text, the separator only if empty
            mean = (hidden * weight[:, :, None]).sum(dim=1) / weight.sum(dim=1, keepdim=True)
            chunks.append(mean)  # (B, C)
        if was_training:
            self.model.train()
        x = torch.cat(chunks) if chunks else torch.zeros((0, self._dim), dtype=torch.float64)
        return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}  # the base model is stored with the run, not inside the router


class PrecomputedFeaturizer:
    """Features computed ahead (e.g. in chunks, by several processes), looked up by prefix.

    A prefix not in ``table`` is featurised by ``fallback``, the featurizer that made the
    table, so the result never depends on what was precomputed.
    """

    def __init__(self, fallback: Featurizer, table: Mapping[tuple[int, ...], torch.Tensor]):
        self.fallback = fallback
        self.name = fallback.name
        self.table = table

    @property
    def dim(self) -> int:
        return self.fallback.dim

    def features(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        keys = [tuple(p) for p in prefixes]
        missing = [k for k in dict.fromkeys(keys) if k not in self.table]
        computed = (
            dict(zip(missing, self.fallback.features(missing), strict=True)) if missing else {}
        )
        rows = [self.table[k] if k in self.table else computed[k] for k in keys]
        if not rows:
            return torch.zeros((0, self.dim), dtype=torch.float64)
        return torch.stack(rows).double()  # (N, dim)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.fallback.state_tensors()
