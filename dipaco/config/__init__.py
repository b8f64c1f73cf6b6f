"""The run configuration: one pydantic object, validated once, stored whole with every run.

A bad config is refused with the field, the value and the rule it breaks; sizes that
cannot fit in memory are refused here, before any tensor is allocated. Defaults are
the papers' (DiLoCo arXiv 2311.08105, DiPaCo arXiv 2403.10616; see docs/design.md §1).

Import every name from here (`from dipaco.config import RunConfig`); the modules say
where a setting goes:

- ``rules``: the one error shape (`refuse`), the closed section base and the bounds;
- ``shape``: what a path is: ModelConfig, LayoutConfig and its Levels;
- ``training``: InnerConfig, OuterConfig, CommConfig and the dense phase 1;
- ``corpus``: DataConfig, RouterConfig and EvalConfig;
- ``limits``: UnitsConfig (a work unit's size) and LimitsConfig;
- ``memory``: parameter counts and the training-memory estimate;
- ``presets``: named runs (`RunConfig.tiny`, `RunConfig.capacity`, `RunConfig.modular`);
- ``run``: RunConfig, which joins the sections and checks the rules that span them.
"""

from dipaco.config.corpus import DataConfig, EvalConfig, RouterConfig
from dipaco.config.limits import LimitsConfig, UnitsConfig
from dipaco.config.memory import (
    CUDA_LOGITS_PER_CHUNK,
    MemoryEstimate,
    count_block_params,
    count_part_params,
    count_path_params,
    estimate_path_memory,
)
from dipaco.config.rules import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_DATA_POSITION,
    MAX_INNER_STEPS,
    MAX_PATHS,
    MAX_ROUNDS,
    MAX_SEED,
    MAX_UNIT_TOKENS,
    MAX_UNITS_PER_ROUND,
    GiB,
    refuse,
)
from dipaco.config.run import ConfigProblem, RunConfig, config_problems
from dipaco.config.shape import INIT_STD, LayoutConfig, Level, ModelConfig, PathPart
from dipaco.config.training import (
    CodecName,
    CommConfig,
    DensePhaseConfig,
    InnerConfig,
    OuterConfig,
    UpdateCodecName,
    eager_rebase_step,
)

__all__ = [
    "CUDA_LOGITS_PER_CHUNK",
    "INIT_STD",
    "MAX_BATCH",
    "MAX_BYTES",
    "MAX_DATA_POSITION",
    "MAX_INNER_STEPS",
    "MAX_PATHS",
    "MAX_ROUNDS",
    "MAX_SEED",
    "MAX_UNITS_PER_ROUND",
    "MAX_UNIT_TOKENS",
    "CodecName",
    "CommConfig",
    "ConfigProblem",
    "DataConfig",
    "DensePhaseConfig",
    "EvalConfig",
    "GiB",
    "InnerConfig",
    "LayoutConfig",
    "Level",
    "LimitsConfig",
    "MemoryEstimate",
    "ModelConfig",
    "OuterConfig",
    "PathPart",
    "RouterConfig",
    "RunConfig",
    "UnitsConfig",
    "UpdateCodecName",
    "config_problems",
    "count_block_params",
    "count_part_params",
    "count_path_params",
    "eager_rebase_step",
    "estimate_path_memory",
    "refuse",
]
