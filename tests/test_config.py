"""RunConfig: paper defaults, JSON round trip, refusals that name field, value and rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dipaco.config import (
    CUDA_LOGITS_PER_CHUNK,
    GiB,
    LayoutConfig,
    Level,
    RunConfig,
    config_problems,
    count_path_params,
    estimate_path_memory,
)
from dipaco.model import build_model, count_parameters


def refusal(**sections: object) -> tuple[str, object, str]:
    with pytest.raises(ValidationError) as caught:
        RunConfig.tiny(**sections)
    problems = config_problems(caught.value)
    assert len(problems) == 1, problems
    return problems[0]


def test_defaults_are_the_papers_except_the_measured_outer_step() -> None:
    cfg = RunConfig()
    assert (cfg.inner.lr, cfg.inner.betas, cfg.inner.weight_decay) == (4e-4, (0.9, 0.95), 0.1)
    assert (cfg.inner.grad_clip, cfg.inner.steps, cfg.inner.batch_size) == (1.0, 500, 512)
    # Nesterov as in the papers; lr, momentum and no √ rescale chosen by the sweep recorded
    # in docs/benchmarks.md ("Outer-step defaults").
    outer = cfg.outer
    assert (outer.lr, outer.momentum, outer.nesterov) == (1.0, 0.7, True)
    assert (outer.sqrt_paths_rescale, outer.warmup_rounds) == (False, 0)
    assert cfg.router.prefix_tokens == 32
    assert 140e6 < cfg.num_params() < 200e6  # the papers' "150M" path


def test_every_field_carries_a_description() -> None:
    sections = [RunConfig, *(type(getattr(RunConfig(), f)) for f in RunConfig.model_fields)]
    for section in sections:
        if hasattr(section, "model_fields"):
            for name, info in section.model_fields.items():
                assert info.description or name in RunConfig.model_fields, (section, name)


def test_it_round_trips_through_json_unchanged() -> None:
    cfg = RunConfig.tiny(layout=LayoutConfig.grid(4, 2, (2, 3), ("embeddings", "lm_head")))
    again = RunConfig.model_validate_json(cfg.model_dump_json())
    assert again == cfg
    assert again.model_dump_json() == cfg.model_dump_json()


def test_it_refuses_unknown_fields() -> None:
    field, value, rule = refusal(inner={"step": 10})
    assert field == "inner.step" and value == 10 and "Extra inputs" in rule


def test_overlap_eager_takes_a_fraction_of_the_unit_and_refuses_anything_else() -> None:
    cfg = RunConfig.tiny(outer={"overlap": "eager"})
    assert (cfg.outer.overlap, cfg.outer.eager_at) == ("eager", 0.1)
    assert RunConfig().outer.overlap == "none"  # the default stays: no overlap
    assert RunConfig.tiny(outer={"overlap": "eager", "eager_at": 1.0}).outer.eager_at == 1.0
    for bad in (0.0, -0.1, 1.5, float("nan")):
        field, value, rule = refusal(outer={"overlap": "eager", "eager_at": bad})
        expected = "finite" if bad != bad else "(0, 1]"  # NaN: refused before the range rule
        assert field == "outer.eager_at" and expected in rule, (bad, rule)
        assert value == bad or bad != bad
    field, _, rule = refusal(outer={"overlap": "soon"})
    assert field == "outer.overlap" and "eager" in rule


def test_it_refuses_levels_that_leave_a_gap() -> None:
    gap = {"levels": [{"blocks": (0, 1), "modules": 2}, {"blocks": (2, 4)}]}
    field, value, rule = refusal(layout=gap)
    assert field == "layout.levels"
    assert value == [(0, 1), (2, 4)]
    assert rule == (
        "blocks (0, 1) and (2, 4) leave block 1 uncovered; levels must tile 0..num_layers"
    )


def test_it_refuses_overlapping_levels() -> None:
    field, _, rule = refusal(layout={"levels": [{"blocks": (0, 3)}, {"blocks": (2, 4)}]})
    assert field == "layout.levels" and "overlap" in rule


def test_it_refuses_levels_that_stop_short_of_the_last_block() -> None:
    field, _, rule = refusal(model={"num_layers": 6})
    assert field == "layout.levels"
    assert "model.num_layers = 6" in rule


def test_it_refuses_a_level_with_no_modules() -> None:
    field, value, rule = refusal(layout={"levels": [{"blocks": (0, 4), "modules": 0}]})
    assert (field, value) == ("layout.levels.0.modules", 0)
    assert "greater than or equal to 1" in rule


def test_it_refuses_heads_that_do_not_divide_the_width() -> None:
    assert refusal(model={"hidden_size": 130}) == (
        "model.num_heads",
        4,
        "must divide model.hidden_size = 130",
    )


def test_it_refuses_kv_heads_that_do_not_divide_the_heads() -> None:
    field, value, _ = refusal(model={"num_kv_heads": 3})
    assert (field, value) == ("model.num_kv_heads", 3)


def test_it_refuses_untying_a_tied_embedding_and_head() -> None:
    layout = LayoutConfig.grid(4, 2, 2, ("embeddings",))
    field, _, rule = refusal(model={"tie_embeddings": True}, layout=layout)
    assert field == "layout.path_specific" and "both or neither" in rule


def test_it_refuses_an_unknown_codec() -> None:
    field, value, _ = refusal(comm={"codec": "int3"})
    assert (field, value) == ("comm.codec", "int3")


def test_it_refuses_a_path_too_large_for_memory_before_building_anything() -> None:
    huge = {"hidden_size": 16384, "num_heads": 128, "num_kv_heads": 8, "intermediate_size": 53248}
    field, _, rule = refusal(model=huge)
    assert field == "limits.max_path_memory_bytes"
    assert "model.hidden_size" in rule and "inner.micro_batch_size" in rule


def test_it_refuses_a_layout_whose_modules_exceed_the_storage_limit() -> None:
    field, _, rule = refusal(
        layout=LayoutConfig.grid(4, 2, 64, ("embeddings",)),
        limits={"max_module_storage_bytes": GiB},
    )
    assert field == "limits.max_module_storage_bytes"
    assert "layout.path_specific" in rule


def test_memory_estimate_grows_with_the_micro_batch() -> None:
    cfg = RunConfig()
    small = estimate_path_memory(cfg.model, cfg.inner.model_copy(update={"micro_batch_size": 1}))
    large = estimate_path_memory(cfg.model, cfg.inner)
    assert large.activation_bytes == 8 * small.activation_bytes
    assert small.state_bytes == large.state_bytes == 20 * cfg.num_params()


def test_the_cuda_estimate_counts_bf16_activations_and_one_chunk_of_logits() -> None:
    cfg = RunConfig()
    cpu = estimate_path_memory(cfg.model, cfg.inner)
    cuda = estimate_path_memory(cfg.model, cfg.inner, device="cuda")
    assert cuda.state_bytes == cpu.state_bytes
    m, tokens = cfg.model, cfg.inner.micro_batch_size * cfg.model.seq_len
    blocks = tokens * m.num_layers * (10 * m.hidden_size + 4 * m.intermediate_size)
    chunk = min(tokens, CUDA_LOGITS_PER_CHUNK // m.vocab_size)
    assert cuda.activation_bytes == 2 * blocks + 12 * chunk * m.vocab_size
    assert cpu.activation_bytes == 4 * blocks + 12 * tokens * m.vocab_size


@pytest.mark.parametrize("tied", [False, True])
def test_the_parameter_count_matches_the_built_model(tied: bool) -> None:
    cfg = RunConfig.tiny(model={"tie_embeddings": tied}, layout=LayoutConfig.diloco(4))
    assert count_path_params(cfg.model) == count_parameters(build_model(cfg.model, 0))
    assert sum(cfg.module_param_counts().values()) == count_path_params(cfg.model)


def test_path_indices_are_mixed_radix_with_level_zero_most_significant() -> None:
    layout = LayoutConfig(levels=(Level(blocks=(0, 1), modules=2), Level(blocks=(1, 4), modules=3)))
    assert [layout.path_modules(p) for p in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2),
    ]  # fmt: skip
    assert all(layout.path_index(layout.path_modules(p)) == p for p in range(6))
    with pytest.raises(ValueError, match="out of range"):
        layout.path_modules(6)


def test_grid_splits_blocks_into_near_equal_consecutive_levels() -> None:
    layout = LayoutConfig.grid(7, levels=3, modules=(1, 2, 3))
    assert [lv.blocks for lv in layout.levels] == [(0, 3), (3, 5), (5, 7)]
    assert layout.num_paths == 6
    assert LayoutConfig.diloco(12).num_paths == 1


def test_the_hf_config_carries_every_model_field() -> None:
    cfg = RunConfig.tiny(model={"rope_theta": 5e5, "tie_embeddings": True}).model
    hf = cfg.to_hf_config()
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads) == (128, 4, 2)
    assert (hf.max_position_embeddings, hf.tie_word_embeddings) == (128, True)
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert theta == 5e5


def test_without_a_layout_the_default_grid_follows_the_model_depth() -> None:
    cfg = RunConfig.model_validate({"model": {"num_layers": 6}})
    assert [lv.blocks for lv in cfg.layout.levels] == [(0, 3), (3, 6)]
    assert cfg.num_paths == 4
