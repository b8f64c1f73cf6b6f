"""The run configuration: one pydantic object, validated once, stored whole with every run.

Its sections live beside it (dipaco.config's docstring maps them); this module holds the
object that joins them and the rules that span sections.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, NamedTuple

from pydantic import BaseModel, Field, ValidationError, model_validator

from dipaco.config import presets
from dipaco.config.corpus import DataConfig, EvalConfig, RouterConfig
from dipaco.config.limits import LimitsConfig, UnitsConfig
from dipaco.config.memory import (
    count_block_params,
    count_part_params,
    count_path_params,
    estimate_path_memory,
)
from dipaco.config.rules import (
    MAX_DATA_POSITION,
    MAX_ROUNDS,
    MAX_SEED,
    MAX_UNIT_TOKENS,
    MAX_UNITS_PER_ROUND,
    GiB,
    Section,
    refuse,
)
from dipaco.config.shape import LayoutConfig, ModelConfig
from dipaco.config.training import CommConfig, DensePhaseConfig, InnerConfig, OuterConfig


class ConfigProblem(NamedTuple):
    field: str
    value: Any
    rule: str


def config_problems(error: ValidationError) -> list[ConfigProblem]:
    """Each refusal as (field, value, rule), for API error bodies and CLI messages."""
    problems = []
    for item in error.errors():
        ctx = item.get("ctx") or {}
        if item["type"] == "config_rule":
            problems.append(ConfigProblem(ctx["field"], ctx["value"], ctx["rule"]))
        else:
            field = ".".join(str(part) for part in item["loc"])
            problems.append(ConfigProblem(field, item.get("input"), item["msg"]))
    return problems


class RunConfig(Section):
    """Everything that defines a training run; JSON round-trips exactly."""

    name: str = Field(
        default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Label."
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="Seed of module initialisation and data order.",
    )
    rounds: int = Field(
        default=100,
        gt=0,
        le=MAX_ROUNDS,
        description="T: outer rounds (of DiPaCo, after phase1).",
    )
    replicas_per_path: int = Field(
        default=1,
        gt=0,
        le=MAX_UNITS_PER_ROUND,
        description="R: work units per path per round.",
    )
    model: ModelConfig = Field(default_factory=lambda: ModelConfig())
    layout: LayoutConfig = Field(
        default_factory=lambda: LayoutConfig.grid(12, 2, 2),
        description="Levels and path-specific parts; default 2 levels x 2 modules.",
    )
    inner: InnerConfig = Field(default_factory=lambda: InnerConfig())
    outer: OuterConfig = Field(default_factory=lambda: OuterConfig())
    comm: CommConfig = Field(default_factory=lambda: CommConfig())
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    router: RouterConfig = Field(default_factory=lambda: RouterConfig())
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig())
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig())
    units: UnitsConfig = Field(default_factory=lambda: UnitsConfig())
    phase1: DensePhaseConfig | None = Field(
        default=None,
        description="A dense DiLoCo phase before the DiPaCo rounds (the paper's recipe); "
        "null: phase 2 starts from the seeded init with the tf-idf router, or from an "
        "uploaded dense checkpoint when router.featurizer is 'base-lm'.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_layout(cls, data: Any) -> Any:
        """Without a layout, two levels of two modules over the model's blocks (4 paths)."""
        if isinstance(data, dict) and "layout" not in data:
            model = data.get("model", {})
            raw = model.model_dump() if isinstance(model, BaseModel) else model
            layers = raw.get("num_layers", 12) if isinstance(raw, dict) else 12
            if isinstance(layers, int) and layers >= 1:
                data = {**data, "layout": LayoutConfig.grid(layers, min(2, layers), 2)}
        return data

    @model_validator(mode="after")
    def _check_layout_fits_model(self) -> RunConfig:
        end = self.layout.levels[-1].blocks[1]
        if end != self.model.num_layers:
            raise refuse(
                "layout.levels",
                [lv.blocks for lv in self.layout.levels],
                f"last level ends at block {end} but model.num_layers = "
                f"{self.model.num_layers}; levels must tile 0..num_layers",
            )
        parts = set(self.layout.path_specific)
        if self.model.tie_embeddings and len(parts & {"embeddings", "lm_head"}) == 1:
            raise refuse(
                "layout.path_specific",
                list(self.layout.path_specific),
                "with model.tie_embeddings, embeddings and lm_head are one tensor: "
                "list both or neither",
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _phase1_routes_with_base_lm(cls, data: Any) -> Any:
        """With phase 1 and no featurizer named, route with the phase-1 model's features."""
        if isinstance(data, dict) and data.get("phase1") is not None:
            router = data.get("router", {})
            if isinstance(router, BaseModel):  # only the fields set count as named
                router = router.model_dump(include=router.model_fields_set)
            if isinstance(router, dict) and "featurizer" not in router:
                data = {**data, "router": {**router, "featurizer": "base-lm"}}
        return data

    @model_validator(mode="after")
    def _check_phase1(self) -> RunConfig:
        if self.phase1 is not None and self.router.featurizer != "base-lm":
            raise refuse(
                "router.featurizer",
                self.router.featurizer,
                "phase1 trains the base model whose features route the documents: use "
                "'base-lm' (or leave router.featurizer out), or drop phase1",
            )
        return self

    @model_validator(mode="after")
    def _check_units(self) -> RunConfig:
        """Opening a round builds paths x replicas units at once: bound it before it is tried."""
        units = self.layout.num_paths * self.replicas_per_path
        if units > MAX_UNITS_PER_ROUND:
            raise refuse(
                "replicas_per_path",
                self.replicas_per_path,
                f"{self.layout.num_paths} paths x {self.replicas_per_path} replicas = {units} "
                f"work units per round exceed {MAX_UNITS_PER_ROUND}; lower replicas_per_path "
                "or layout.levels[*].modules",
            )
        return self

    @model_validator(mode="after")
    def _check_data_extent(self) -> RunConfig:
        """A unit's tokens and the last unit's data position (windows from the run's start)
        fit their columns."""
        steps = max(self.inner.steps, (self.phase1.inner_steps or 0) if self.phase1 else 0)
        windows = steps * self.inner.batch_size
        extent = max(self.rounds, self.phase1.rounds if self.phase1 else 0)
        units = self.replicas_per_path
        if self.phase1 is not None:
            units = max(units, self.phase1.replicas)
        if windows * self.model.seq_len > MAX_UNIT_TOKENS:
            raise refuse(
                "inner.steps",
                steps,
                f"{steps} steps x {self.inner.batch_size} sequences x {self.model.seq_len} "
                f"tokens exceed {MAX_UNIT_TOKENS} tokens per unit; lower inner.steps, "
                "inner.grad_accum_steps or inner.micro_batch_size",
            )
        if extent * units * windows > MAX_DATA_POSITION:
            raise refuse(
                "rounds",
                self.rounds,
                f"{extent} rounds x {units} replicas x {windows} windows per unit (inner.steps "
                f"x inner.batch_size) exceed {MAX_DATA_POSITION} windows of data; lower "
                "rounds, replicas_per_path, inner.steps or the batch",
            )
        return self

    @model_validator(mode="after")
    def _check_memory(self) -> RunConfig:
        estimate = estimate_path_memory(self.model, self.inner)
        limit = self.limits.max_path_memory_bytes
        if estimate.total_bytes > limit:
            raise refuse(
                "limits.max_path_memory_bytes",
                limit,
                f"one path needs about {estimate.total_bytes / GiB:.1f} GiB to train "
                f"({estimate.params:,} params: {estimate.state_bytes / GiB:.1f} GiB of "
                f"weights, grads and AdamW; {estimate.activation_bytes / GiB:.1f} GiB of "
                "activations); shrink model.hidden_size, model.num_layers or "
                "model.vocab_size, or inner.micro_batch_size or model.seq_len "
                "(raise inner.grad_accum_steps to keep the batch)",
            )
        storage = 8 * sum(self.module_param_counts().values())  # fp32 weights + momentum
        if storage > self.limits.max_module_storage_bytes:
            raise refuse(
                "limits.max_module_storage_bytes",
                self.limits.max_module_storage_bytes,
                f"all modules need {storage / GiB:.1f} GiB (fp32 weights + momentum); "
                "lower layout.levels[*].modules, drop layout.path_specific parts "
                "or shrink the model",
            )
        return self

    @property
    def total_rounds(self) -> int:
        """Outer rounds of the whole run: phase 1's, then `rounds` of DiPaCo (phase 2)."""
        return self.rounds + (self.phase1.rounds if self.phase1 is not None else 0)

    @cached_property
    def dense_phase(self) -> RunConfig:
        """Phase 1 as the plain DiLoCo config workers train it with: one level of one module
        (LayoutConfig.diloco), phase1.replicas units per round, phase1.rounds rounds."""
        if self.phase1 is None:
            raise ValueError("this run has no phase 1 (phase1 is null)")
        inner = self.inner.model_dump()
        if self.phase1.inner_steps is not None:
            inner["steps"] = self.phase1.inner_steps
        return RunConfig.model_validate(
            {
                **self.model_dump(exclude={"phase1", "router"}),
                "rounds": self.phase1.rounds,
                "replicas_per_path": self.phase1.replicas,
                "layout": LayoutConfig.diloco(self.model.num_layers),
                "inner": inner,
            }
        )

    def module_param_counts(self) -> dict[str, int]:
        """Parameters per module id (see dipaco.modular), computed without allocation."""
        per_block = count_block_params(self.model)
        part_sizes = count_part_params(self.model)
        counts: dict[str, int] = {}
        for level_index, level in enumerate(self.layout.levels):
            for k in range(level.modules):
                counts[f"{level_index}.{k}"] = level.num_blocks * per_block
        specific = set(self.layout.path_specific)
        shared = sum(n for part, n in part_sizes.items() if part not in specific)
        if shared:
            counts["shared"] = shared
        own = sum(n for part, n in part_sizes.items() if part in specific)
        if own:
            for p in range(self.layout.num_paths):
                counts[f"path.{p}"] = own
        return counts

    @classmethod
    def tiny(cls, **sections: Any) -> RunConfig:
        """A ~2.8M-parameter, 2x2-path run that trains on a CPU in seconds; for tests and demos.

        Keyword arguments change it before validation: a model replaces a whole section, a
        dict changes only the fields it names (`RunConfig.tiny(inner={"steps": 5})`).
        """
        return cls.model_validate(presets.tiny(**sections))

    @classmethod
    def capacity(cls, **sections: Any) -> RunConfig:
        """A module-dominant run for one GPU (dipaco.config.presets.capacity says its sizing).
        Keyword arguments change it as in `tiny`."""
        return cls.model_validate(presets.capacity(**sections))

    @classmethod
    def modular(cls, **sections: Any) -> RunConfig:
        """A module-dominant run for a CPU, 25 paths of tiny's size holding 4.5x a path
        (dipaco.config.presets.modular says its sizing). Keyword arguments change it as in
        `tiny`."""
        return cls.model_validate(presets.modular(**sections))

    @classmethod
    def paper_150m(cls, **sections: Any) -> RunConfig:
        """The papers' 150M path on a 2x2 grid (dipaco.config.presets.paper_150m says what it
        sets). Keyword arguments change it as in `tiny`."""
        return cls.model_validate(presets.paper_150m(**sections))

    def num_params(self) -> int:
        return count_path_params(self.model)

    @property
    def num_paths(self) -> int:
        return self.layout.num_paths

    def path_modules(self, p: int) -> tuple[int, ...]:
        return self.layout.path_modules(p)

    def path_index(self, choices: tuple[int, ...] | list[int]) -> int:
        return self.layout.path_index(choices)
