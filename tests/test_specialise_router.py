"""bench/specialise.py's discriminative router and bench/quality.py's router and outer flags."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dipaco.data.corpus import load_corpus
from dipaco.routing.router import Router
from dipaco.tokenizer import train_tokenizer
from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def routed_windows() -> tuple[Router, torch.Tensor]:
    docs = load_corpus("stdlib", max_files=60, max_chars=4000, val_fraction=0.0).train
    tokenizer = train_tokenizer(docs, vocab_size=512, max_chars=300_000)
    texts = [d.text for d in docs]
    router = Router.fit(texts, tokenizer, factors=(2, 2), seed=0, prefix_tokens=16)
    ids = [row for row in tokenizer.encode_batch(texts) if len(row) >= 33]
    windows = torch.tensor([row[:33] for row in ids], dtype=torch.long)  # (n, 33)
    return router, windows


def test_ridge_recovers_a_planted_linear_map() -> None:
    specialise = bench_module("specialise")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(400, 5, generator=gen, dtype=torch.float64)
    weights, penalty = specialise.ridge_fit(x[:200], y[:200])
    predicted = specialise.with_bias(x[200:]) @ weights
    assert (predicted.argmin(1) == y[200:].argmin(1)).double().mean() > 0.9
    assert penalty in specialise.RIDGE_PENALTIES


def test_the_discriminative_router_learns_which_path_scores_a_window_best(
    routed_windows: tuple[Router, torch.Tensor],
) -> None:
    """Each window's per-path losses follow its features (a planted linear map the k-means
    router does not know): the fitted router beats k-means and agrees with the oracle more
    often; with losses unrelated to the features it cannot."""
    specialise = bench_module("specialise")
    router, windows = routed_windows
    n = windows.shape[0]
    x = router.featurizer.features(windows[:, :16].tolist()).double()  # (n, D)
    gen = torch.Generator().manual_seed(1)
    planted = x @ torch.randn(x.shape[1], 4, generator=gen, dtype=torch.float64)  # (n, P)
    per_window = (3.0 + planted / planted.std()).T  # (P, n)
    halves = torch.arange(n) % 2 == 1
    data = SimpleNamespace(router=router)

    figures = specialise.discriminative_figures(data, windows, per_window, halves)
    assert figures["discriminative_vs_kmeans"] < 0.98
    assert figures["discriminative_agreement"] > figures["kmeans_agreement"] + 0.1
    assert figures["oracle_vs_discriminative"] <= 1.0

    noise = 3.0 + 0.1 * torch.randn(4, n, generator=gen, dtype=torch.float64)
    blind = specialise.discriminative_figures(data, windows, noise, halves)
    assert blind["discriminative_agreement"] < 0.5  # chance is 0.25


def test_the_quality_bench_passes_router_and_outer_fields_to_dipaco() -> None:
    quality = bench_module("quality")
    args = quality.parse_args([
        "--preset", "modular", "--router", '{"method": "product-kmeans", "prefix_tokens": 64}',
        "--outer", '{"sqrt_paths_rescale": true}',
    ])  # fmt: skip
    cfgs = quality.configs(args)
    assert cfgs["b-fp32"].router.method == "product-kmeans"
    assert cfgs["b-fp32"].router.prefix_tokens == 64
    assert cfgs["b-fp32"].router.featurizer == "base-lm"  # the paper's, unless told
    assert cfgs["f"].router.method == "product-kmeans"
    assert cfgs["b-fp32"].outer.sqrt_paths_rescale
    assert cfgs["d"].router.method == "kmeans"  # DiLoCo has one path: no router to change
    plain = quality.configs(quality.parse_args(["--preset", "modular"]))
    assert plain["b-fp32"].router.method == "kmeans"
    assert not plain["b-fp32"].outer.sqrt_paths_rescale


def test_the_quality_bench_records_which_corpus_file_it_read(tmp_path: Path) -> None:
    quality = bench_module("quality")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "a manual page"}\n')
    first = quality.corpus_sha256(str(corpus))
    assert first is not None and len(first) == 64
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "another manual page"}\n')
    assert quality.corpus_sha256(str(other)) != first
    assert quality.corpus_sha256("stdlib") is None
    assert quality.corpus_sha256(str(tmp_path)) is None  # a folder of text files
