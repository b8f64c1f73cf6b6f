"""RunConfig.capacity(): the module-dominant preset of the GPU quality run (bench/quality_gpu.sh)."""

from __future__ import annotations

from dipaco.config import RunConfig


def test_the_capacity_preset_puts_most_of_a_path_in_its_modules_and_several_paths_in_all() -> None:
    config = RunConfig.capacity()
    counts = config.module_param_counts()
    path = config.num_params()

    assert (path - counts["shared"]) / path > 0.7  # the blocks, not the embeddings
    assert sum(counts.values()) / path > 3  # DiPaCo's capacity over a path's
    assert config.num_paths == 16 and len(config.layout.levels) == 2
    tokens = config.rounds * config.inner.steps * config.inner.batch_size * config.model.seq_len
    assert tokens * config.num_paths / path > 20  # the dense path-size model: capacity-bound


def test_the_capacity_preset_takes_changes_as_tiny_does() -> None:
    config = RunConfig.capacity(rounds=2, inner={"micro_batch_size": 4}, model={"seq_len": 64})

    assert (config.rounds, config.inner.micro_batch_size, config.model.seq_len) == (2, 4, 64)
    assert config.inner.steps == RunConfig.capacity().inner.steps  # the rest stays
    assert config.model.hidden_size == RunConfig.capacity().model.hidden_size
