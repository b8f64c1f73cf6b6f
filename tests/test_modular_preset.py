"""RunConfig.modular(): the CPU preset whose modules, not the shared embedding, hold the capacity."""

from __future__ import annotations

from types import ModuleType

from dipaco.config import RunConfig
from tests.bench_modules import bench_module


def quality_module() -> ModuleType:
    return bench_module("quality")


def test_the_modular_grid_holds_at_least_four_paths_worth_of_parameters() -> None:
    config = RunConfig.modular()
    total = sum(config.module_param_counts().values())

    assert total / config.num_params() >= 4
    assert total / config.num_params() > 3 * (
        sum(RunConfig.tiny().module_param_counts().values()) / RunConfig.tiny().num_params()
    )


def test_the_modular_grid_has_at_least_two_levels_of_four_modules() -> None:
    levels = RunConfig.modular().layout.levels

    assert len(levels) >= 2
    assert all(level.modules >= 4 for level in levels)
    assert RunConfig.modular().num_paths >= 16


def test_a_modular_path_is_mostly_its_own_modules() -> None:
    config, tiny = RunConfig.modular(), RunConfig.tiny()
    counts = config.module_param_counts()
    path = config.num_params()

    assert (path - counts["shared"]) / path > 0.8  # tiny: 0.26
    assert config.model.vocab_size < tiny.model.vocab_size
    blocks = config.layout.levels[0].num_blocks
    assert blocks > tiny.layout.levels[0].num_blocks  # deeper modules
    assert config.model.hidden_size > tiny.model.hidden_size  # wider
    assert counts["0.0"] > 2 * tiny.module_param_counts()["0.0"]
    # a path of tiny's size: the same CPU cost a step, within 10% in parameters
    assert abs(path / tiny.num_params() - 1) < 0.1


def test_the_modular_preset_takes_changes_as_tiny_does() -> None:
    config = RunConfig.modular(rounds=2, inner={"steps": 3}, model={"seq_len": 64})

    assert (config.rounds, config.inner.steps, config.model.seq_len) == (2, 3, 64)
    assert config.model.hidden_size == RunConfig.modular().model.hidden_size
    assert config.num_paths == RunConfig.modular().num_paths


def test_the_quality_bench_sizes_a_modular_run_from_the_preset_unless_told() -> None:
    quality = quality_module()
    sizes = quality.BENCH_DEFAULTS["modular"]

    args = quality.parse_args(["--preset", "modular"])
    cfgs = quality.configs(args)
    assert (args.rounds, args.inner_steps, args.codec_seeds) == (
        sizes["rounds"], sizes["inner_steps"], sizes["codec_seeds"],
    )  # fmt: skip
    assert cfgs["b-fp32"].num_paths == RunConfig.modular().num_paths
    assert cfgs["b-fp32"].model == RunConfig.modular().model
    assert cfgs["d"].replicas_per_path == cfgs["b-fp32"].num_paths  # DiLoCo at equal tokens

    told = quality.parse_args(["--preset", "modular", "--rounds", "3", "--codec-seeds", "2"])
    assert (told.rounds, told.codec_seeds) == (3, 2)
    assert quality.parse_args([]).rounds == quality.BENCH_DEFAULTS["tiny"]["rounds"]
