"""Routing: features, k-means, balanced biases, and the saved router."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dipaco.data.corpus import Document, load_corpus
from dipaco.routing.balance import fit_biases, load_bounds, tie_break
from dipaco.routing.featurize import PrecomputedFeaturizer, TfidfFeaturizer
from dipaco.routing.kmeans import kmeans, product_kmeans
from dipaco.routing.router import Router, modules_to_path, path_to_modules
from dipaco.tokenizer import RunTokenizer, train_tokenizer

ODD_TEXTS = ["", " ", "\x00", "日本語 😀", "x" * 100_000, "<|endoftext|>"]


@pytest.fixture(scope="module")
def docs() -> list[Document]:
    return load_corpus("stdlib", max_files=40, max_chars=3000, val_fraction=0.0).train


@pytest.fixture(scope="module")
def texts(docs: list[Document]) -> list[str]:
    return [d.text for d in docs]


@pytest.fixture(scope="module")
def tokenizer(docs: list[Document]) -> RunTokenizer:
    return train_tokenizer(docs, vocab_size=512, max_chars=300_000)


@pytest.fixture(scope="module")
def product_router(texts: list[str], tokenizer: RunTokenizer) -> Router:
    return Router.fit(
        texts, tokenizer, factors=(2, 3), method="product-kmeans", max_imbalance=1.2, seed=3
    )


def _loads(router: Router, texts: list[str]) -> torch.Tensor:
    return torch.bincount(torch.tensor(router.route_batch(texts)), minlength=router.num_paths)


def test_kmeans_finds_well_separated_clusters() -> None:
    gen = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]], dtype=torch.float64)
    truth = torch.arange(3).repeat_interleave(50)
    x = centres[truth] + 0.5 * torch.randn(150, 2, generator=gen, dtype=torch.float64)
    result = kmeans(x, 3, seed=1)
    # Each found cluster is exactly one true cluster.
    pairs = set(zip(result.labels.tolist(), truth.tolist(), strict=True))
    assert len(pairs) == 3


def test_kmeans_is_deterministic_for_a_seed() -> None:
    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    a, b = kmeans(x, 6, seed=7), kmeans(x, 6, seed=7)
    assert torch.equal(a.centroids, b.centroids)
    assert torch.equal(a.labels, b.labels)


def test_kmeans_leaves_no_cluster_empty_even_with_duplicate_points() -> None:
    x = torch.cat([torch.zeros(50, 3), torch.ones(3, 3), 2 * torch.ones(2, 3)]).double()
    result = kmeans(x, 4, seed=0)
    assert torch.bincount(result.labels, minlength=4).min() >= 1


def test_product_kmeans_clusters_one_subvector_per_level() -> None:
    x = torch.randn(120, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    levels = product_kmeans(x, (2, 3), seed=0)
    assert [tuple(r.centroids.shape) for r in levels] == [(2, 5), (3, 5)]


def test_biases_balance_scores_that_all_prefer_one_path() -> None:
    scores = torch.zeros(100, 4, dtype=torch.float64)
    scores[:, 0] = 1.0  # every document prefers path 0
    scores += tie_break([f"doc {i}" for i in range(100)], 4)
    bias = fit_biases(scores, max_imbalance=1.1)
    loads = torch.bincount((scores + bias).argmax(dim=1), minlength=4)
    low, high = load_bounds(100, 4, 1.1)
    assert (low, high) == (23, 27)
    assert int(loads.min()) >= low and int(loads.max()) <= high


def test_identical_documents_are_split_by_their_text_not_their_prefix() -> None:
    # Same features (scores) for all; only the tie-break of their full text differs.
    texts = [f"same prefix, different tail {i}" for i in range(40)]
    scores = tie_break(texts, 4)
    bias = fit_biases(scores, max_imbalance=1.0)
    assert torch.bincount((scores + bias).argmax(dim=1), minlength=4).tolist() == [10] * 4


def test_too_few_documents_for_the_paths_is_an_error_that_says_why() -> None:
    with pytest.raises(ValueError, match="cannot fill 4 paths"):
        fit_biases(torch.zeros(3, 4, dtype=torch.float64), 2.0)
    with pytest.raises(ValueError, match=r"max_imbalance must be >= 1\.0"):
        load_bounds(10, 2, 0.5)


def test_tfidf_features_are_unit_vectors_weighted_by_idf() -> None:
    feat = TfidfFeaturizer(dim=64).fit([[1, 2, 3], [1, 2], [1, 4]])
    x = feat.features([[1, 2, 3], [], [1, 1, 1]])
    assert torch.allclose(x[0].norm(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.equal(x[1], torch.zeros(64, dtype=torch.float64))
    # Token 1 is in every document: lowest idf of all the unigrams seen.
    buckets = feat.counts([[1], [3]]).argmax(dim=1)
    assert feat.idf[buckets[0]] < feat.idf[buckets[1]]


@pytest.mark.parametrize(("method", "factors"), [("kmeans", (4,)), ("product-kmeans", (2, 3))])
def test_routers_balance_paths_and_leave_none_empty(
    texts: list[str], tokenizer: RunTokenizer, method: str, factors: tuple[int, ...]
) -> None:
    router = Router.fit(texts, tokenizer, factors=factors, method=method, max_imbalance=1.2)
    loads = _loads(router, texts)
    assert loads.tolist() == list(router.spec.train_loads)
    assert int(loads.min()) >= 1
    assert float(loads.max()) / float(loads.double().mean()) <= 1.2


def test_the_same_seed_gives_the_same_router(
    texts: list[str], tokenizer: RunTokenizer, product_router: Router
) -> None:
    again = Router.fit(
        texts, tokenizer, factors=(2, 3), method="product-kmeans", max_imbalance=1.2, seed=3
    )
    for a, b in zip(again.centroids, product_router.centroids, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(again.bias, product_router.bias)
    assert again.route_batch(texts) == product_router.route_batch(texts)


def test_a_saved_router_loads_and_routes_identically(
    texts: list[str], tokenizer: RunTokenizer, product_router: Router, tmp_path: Path
) -> None:
    product_router.save(tmp_path)
    spec = json.loads((tmp_path / "router.json").read_text())
    assert (spec["featurizer"], spec["method"], spec["factors"]) == (
        "tfidf",
        "product-kmeans",
        [2, 3],
    )
    assert spec["prefix_tokens"] == 32 and spec["version"] == 1
    for source in (tmp_path, tmp_path / "router.safetensors"):
        loaded = Router.load(source, tokenizer)
        sample = texts[::7] + ODD_TEXTS
        assert torch.equal(
            loaded.route_scores_batch(sample), product_router.route_scores_batch(sample)
        )


def test_a_router_refuses_another_tokenizer(
    docs: list[Document], product_router: Router, tmp_path: Path
) -> None:
    product_router.save(tmp_path)
    other = train_tokenizer(docs, vocab_size=300, max_chars=50_000)
    with pytest.raises(ValueError, match="another tokenizer"):
        Router.load(tmp_path, other)


def test_a_tampered_router_file_is_refused(
    tokenizer: RunTokenizer, product_router: Router, tmp_path: Path
) -> None:
    file = product_router.save(tmp_path)
    tensors = load_file(str(file))
    tensors["bias"] = torch.zeros(5, dtype=torch.float64)  # the spec says 6 paths
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    save_file(tensors, str(file), metadata=metadata)
    with pytest.raises(ValueError, match=r"do not match router\.json"):
        Router.load(tmp_path, tokenizer)


def test_any_text_routes_to_a_valid_path(product_router: Router) -> None:
    for text in ODD_TEXTS:
        path = product_router.route(text)
        assert 0 <= path < 6
        assert product_router.route_scores(text).argmax().item() == path


def test_paths_number_modules_in_mixed_radix_with_level_zero_first() -> None:
    factors = (2, 3, 4)
    assert path_to_modules(0, factors) == (0, 0, 0)
    assert path_to_modules(1 * 12 + 2 * 4 + 3, factors) == (1, 2, 3)
    for p in range(math.prod(factors)):
        assert modules_to_path(path_to_modules(p, factors), factors) == p
    with pytest.raises(ValueError, match="outside"):
        path_to_modules(24, factors)


def test_product_router_scores_are_sums_over_levels(
    texts: list[str], product_router: Router
) -> None:
    x = product_router.features(texts[:5])
    d = product_router.distances(x)  # (5, 6)
    d0 = torch.cdist(x[:, :1024], product_router.centroids[0]) ** 2  # (5, 2)
    d1 = torch.cdist(x[:, 1024:], product_router.centroids[1]) ** 2  # (5, 3)
    for p in range(6):
        k0, k1 = path_to_modules(p, (2, 3))
        assert torch.allclose(d[:, p], d0[:, k0] + d1[:, k1], atol=1e-9)


def test_the_base_lm_featurizer_routes_with_a_model(
    texts: list[str], tokenizer: RunTokenizer, tmp_path: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    sample = texts[:120]
    router = Router.fit(sample, tokenizer, factors=(2, 2), featurizer="base-lm", model=model)
    loads = _loads(router, sample)
    assert int(loads.min()) >= 1 and float(loads.max()) / 30.0 <= 1.25
    # One text routes the same alone as in a batch (fixed padding width).
    assert [router.route(t) for t in sample[:10]] == router.route_batch(sample[:10])
    assert 0 <= router.route("") < 4
    router.save(tmp_path)
    with pytest.raises(ValueError, match="needs the base model"):
        Router.load(tmp_path, tokenizer)
    loaded = Router.load(tmp_path, tokenizer, model=model)
    assert loaded.route_batch(sample) == router.route_batch(sample)


def test_a_fitted_router_shards_with_the_features_it_was_fitted_on(
    texts: list[str], tokenizer: RunTokenizer, tmp_path: Path
) -> None:
    router = Router.fit(texts, tokenizer, factors=(2, 2))
    assert isinstance(router.featurizer, PrecomputedFeaturizer)  # no second featurizing pass
    routes = router.route_batch(texts)
    loaded = Router.load(router.save(tmp_path / "router"), tokenizer)
    assert not isinstance(loaded.featurizer, PrecomputedFeaturizer)
    assert loaded.route_batch(texts) == routes  # what was fitted is what is served
    assert torch.bincount(torch.tensor(routes), minlength=4).tolist() == list(
        router.spec.train_loads
    )
