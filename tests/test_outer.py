"""The outer step: aggregation rules and equality with torch.optim.SGD(nesterov=True)."""

from __future__ import annotations

import math

import pytest
import torch

from dipaco import codecs
from dipaco.config import OuterConfig
from dipaco.outer import (
    DeltaAccumulator,
    aggregate,
    clip_threshold,
    delta_norm,
    norm_outliers,
    outer_lr,
    outer_step,
    rescale_factor,
    round_momentum,
    trimmed_mean,
)

SHAPES = {"w": (5, 3), "b": (3,)}


def random_delta(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, False)])
def test_outer_step_equals_torch_sgd_fed_the_mean_delta(momentum: float, nesterov: bool) -> None:
    cfg = OuterConfig(lr=0.7, momentum=momentum, nesterov=nesterov)
    params = random_delta(0)
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    sgd = torch.optim.SGD(reference.values(), lr=0.7, momentum=momentum, nesterov=nesterov)
    state: dict[str, torch.Tensor] | None = None
    for round_ in range(6):
        contributions = [(random_delta(100 * round_ + i), 1000 * (i + 1)) for i in range(3)]
        mean = aggregate(contributions, cfg.model_copy(update={"sqrt_paths_rescale": False}))
        params, state = outer_step(params, mean, state, cfg)
        for name, param in reference.items():
            param.grad = mean[name].clone()
        sgd.step()
        for name, param in reference.items():
            torch.testing.assert_close(params[name], param.detach(), rtol=0, atol=1e-6)
    assert state is not None and (momentum == 0) == (state == {})


def test_outer_step_does_not_modify_its_inputs() -> None:
    params, delta, momentum = random_delta(1), random_delta(2), random_delta(3)
    copies = [{n: t.clone() for n, t in d.items()} for d in (params, delta, momentum)]
    outer_step(params, delta, momentum, OuterConfig())
    for original, copy in zip((params, delta, momentum), copies, strict=True):
        assert all(torch.equal(original[n], copy[n]) for n in original)


def test_the_mean_is_weighted_by_tokens() -> None:
    a, b = random_delta(1), random_delta(2)
    acc = DeltaAccumulator()
    acc.add(a, 100)
    acc.add(b, 300)
    mean = acc.mean()
    for name in SHAPES:
        torch.testing.assert_close(mean[name], 0.25 * a[name] + 0.75 * b[name])
    unweighted = DeltaAccumulator(token_weighting=False)
    unweighted.add(a, 100)
    unweighted.add(b, 300)
    torch.testing.assert_close(unweighted.mean()["w"], 0.5 * (a["w"] + b["w"]))


def test_it_accumulates_half_precision_deltas_in_fp32() -> None:
    acc = DeltaAccumulator()
    halves = {n: t.half() for n, t in random_delta(4).items()}
    for _ in range(3):
        acc.add(halves, 10)
    assert acc.mean()["w"].dtype == torch.float32
    torch.testing.assert_close(acc.mean()["w"], halves["w"].float())


def test_the_sqrt_paths_rescale_multiplies_the_mean() -> None:
    contributions = [(random_delta(i), 10) for i in range(4)]
    plain = aggregate(contributions, OuterConfig(sqrt_paths_rescale=False), paths_through=4)
    scaled = aggregate(contributions, OuterConfig(sqrt_paths_rescale=True), paths_through=4)
    torch.testing.assert_close(scaled["w"], 2.0 * plain["w"])


def test_clipped_mean_bounds_an_outlier_norm() -> None:
    honest = [(random_delta(i), 10) for i in range(4)]
    attack = (random_delta(9, scale=1e4), 10)
    cfg = OuterConfig(robust="clipped-mean", clip_factor=1.0, sqrt_paths_rescale=False)
    result = aggregate([*honest, attack], cfg)
    norms = [delta_norm(d) for d, _ in [*honest, attack]]
    assert delta_norm(result) <= clip_threshold(norms, 1.0) + 1e-4
    # Plain mean lets it through; clipping is the default (issue 19).
    assert delta_norm(aggregate([*honest, attack], OuterConfig(robust="mean"))) > 1e3
    assert OuterConfig().robust == "clipped-mean"
    assert delta_norm(aggregate([*honest, attack], OuterConfig())) < 1e3


def test_trimmed_mean_ignores_extremes_per_value() -> None:
    deltas = [{"x": torch.tensor([float(v), -float(v)])} for v in (1, 2, 3, 1000)]
    tokens = [1, 1, 1, 1]
    result = trimmed_mean(deltas, tokens, trim_fraction=0.25)
    torch.testing.assert_close(result["x"], torch.tensor([2.5, -2.5]))
    weighted = trimmed_mean(deltas, [1, 3, 1, 1], trim_fraction=0.25)
    torch.testing.assert_close(weighted["x"], torch.tensor([2.25, -2.25]))


def test_trimmed_mean_without_trimming_is_the_weighted_mean() -> None:
    contributions = [(random_delta(i), 7 * (i + 1)) for i in range(3)]
    cfg = OuterConfig(sqrt_paths_rescale=False)
    trimmed = aggregate(contributions, cfg.model_copy(update={"robust": "trimmed-mean"}))
    torch.testing.assert_close(trimmed["w"], aggregate(contributions, cfg)["w"])


def test_norm_outliers_flags_norms_far_above_the_median() -> None:
    assert norm_outliers([1.0, 1.1, 0.9, 50.0], reject_norm_factor=10) == [
        False, False, False, True,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        ({"w": torch.zeros(5, 3)}, "do not match"),
        ({"w": torch.zeros(5, 3), "b": torch.zeros(4)}, "do not match"),
        ({"w": torch.full((5, 3), math.nan), "b": torch.zeros(3)}, "NaN"),
        ({"w": torch.zeros(5, 3), "b": torch.tensor([0.0, math.inf, 0.0])}, "infinite"),
    ],
)
def test_the_accumulator_refuses_malformed_deltas(delta: dict, message: str) -> None:
    spec = {n: (s, torch.float32) for n, s in SHAPES.items()}
    with pytest.raises(ValueError, match=message):
        DeltaAccumulator(spec).add(delta, 10)


def test_a_module_without_contributions_is_refused() -> None:
    with pytest.raises(ValueError, match="no contribution"):
        aggregate([], OuterConfig())


def test_the_rescale_counts_the_paths_that_contributed() -> None:
    cfg = OuterConfig(sqrt_paths_rescale=True)
    assert rescale_factor(cfg, 4) == 2.0
    assert rescale_factor(cfg, 1) == 1.0  # a lone contributor is not scaled up
    assert rescale_factor(cfg.model_copy(update={"sqrt_paths_rescale": False}), 4) == 1.0
    # aggregate takes the contributing count: two contributions of one path are not √2 x.
    deltas = [({"w": torch.ones(2)}, 1), ({"w": torch.ones(2)}, 1)]
    assert torch.equal(aggregate(deltas, cfg, paths_through=1)["w"], torch.ones(2))
    assert torch.allclose(aggregate(deltas, cfg, paths_through=2)["w"], torch.ones(2) * 2**0.5)


def test_the_outer_lr_warms_up_linearly_to_its_peak() -> None:
    cfg = OuterConfig(lr=0.7, warmup_rounds=3, momentum=0.0)
    assert [outer_lr(cfg, t) for t in range(5)] == pytest.approx([0.175, 0.35, 0.525, 0.7, 0.7])
    assert outer_lr(OuterConfig(lr=0.7, momentum=0.0), 0) == 0.7
    params, delta = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    new, _ = outer_step(params, delta, None, cfg.model_copy(update={"momentum": 0.0}), lr=0.25)
    assert torch.equal(new["w"], torch.full((2,), 0.75))


def test_from_trained_weights_the_first_step_is_the_mean_delta_then_sgd_from_scratch() -> None:
    cfg = OuterConfig(lr=1.0, momentum=0.7, nesterov=True)
    mus = [round_momentum(cfg, t, trained_start=True) for t in range(3)]
    assert mus == [0.0, 0.7, 0.7]
    # from random weights SGD's own μ from the first step (it costs nothing to overshoot there)
    assert [round_momentum(cfg, t) for t in range(2)] == [0.7, 0.7]
    params, delta = {"w": torch.ones(3)}, {"w": torch.full((3,), 0.5)}
    later = {"w": torch.full((3,), 0.25)}

    first, kept = outer_step(params, delta, None, cfg, lr=outer_lr(cfg, 0), mu=mus[0])
    second, buffer = outer_step(first, later, kept, cfg, lr=outer_lr(cfg, 1), mu=mus[1])
    third, _ = outer_step(second, later, buffer, cfg, lr=outer_lr(cfg, 2), mu=mus[2])

    assert torch.equal(first["w"], torch.full((3,), 0.5))  # the mean Δ, not 1 - 1.7 x 0.5
    assert kept == {}, "no buffer: the first Δ is not applied again"
    assert torch.equal(buffer["w"], later["w"])  # SGD's first step: buffer = Δ2
    assert torch.allclose(second["w"], first["w"] - 1.7 * 0.25)
    sgd = torch.optim.SGD([w := torch.nn.Parameter(second["w"].clone())], lr=1.0, momentum=0.7,
                          nesterov=True)  # fmt: skip
    sgd.state[w]["momentum_buffer"] = buffer["w"].clone()
    w.grad = later["w"].clone()
    sgd.step()
    assert torch.allclose(third["w"], w.detach()), "then SGD's own steps"
    with pytest.raises(ValueError, match="rounds count from 0"):
        round_momentum(cfg, -1, trained_start=True)


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_an_encoded_delta_adds_exactly_what_its_decoded_tensors_add(
    clip_norm: float | None,
) -> None:
    spec = {n: (s, torch.float32) for n, s in SHAPES.items()}
    decoded, encoded = (
        DeltaAccumulator(spec, clip_norm=clip_norm),
        DeltaAccumulator(spec, clip_norm=clip_norm),
    )
    for i, scale in enumerate([0.1, 1.0, 3.0]):
        data = codecs.encode(random_delta(40 + i, scale), "int8", block_size=4)
        delta = codecs.decode(data)  # what the simulator adds
        decoded.add(delta, 100 + i)
        encoded.add_encoded(data, 100 + i, norm=delta_norm(delta))  # what the server adds
    expected = decoded.mean()
    got = encoded.mean(in_place=True)
    assert got is encoded.sums, "in place: no second copy of the module"
    for name in SHAPES:
        assert torch.equal(got[name], expected[name]), name
    with pytest.raises(ValueError, match="norm"):
        DeltaAccumulator(spec, clip_norm=1.0).add_encoded(data, 1)
