"""What a path is: the model's shape, and how its blocks split into levels of modules."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import Field, model_validator

from dipaco.config.rules import MAX_PATHS, Section, refuse
from dipaco.hf import transformers

# Every Linear and the embedding start ~ N(0, INIT_STD), as transformers' Llama does
# (LlamaConfig.initializer_range); dipaco.model draws them, config.json records it.
INIT_STD = 0.02

PathPart = Literal["embeddings", "final_norm", "lm_head"]


class ModelConfig(Section):
    """A Llama-family causal LM (dipaco.model; downloaded as transformers' LlamaForCausalLM).
    Defaults: the papers' 150M."""

    # Sizes: the largest open models are 16,384 wide with 126 blocks and 128 heads
    # (Llama 3.1 405B); the bounds sit above them, and the memory limit refuses the rest.
    hidden_size: int = Field(
        default=896, gt=0, le=65_536, description="Width of the residual stream."
    )
    num_layers: int = Field(default=12, gt=0, le=1024, description="Number of transformer blocks.")
    num_heads: int = Field(default=16, gt=0, le=1024, description="Attention (query) heads.")
    num_kv_heads: int = Field(default=16, gt=0, le=1024, description="Key/value heads (GQA).")
    # SwiGLU: 8/3 x hidden, rounded up to a multiple of 64 (the Llama convention).
    intermediate_size: int = Field(
        default=2432, gt=0, le=262_144, description="SwiGLU hidden width."
    )
    # Token ids are stored as uint16 or uint32 (dipaco.data.shards); 2^20 is 4x Gemma's.
    vocab_size: int = Field(default=32000, gt=1, le=2**20, description="Tokenizer vocabulary size.")
    seq_len: int = Field(
        default=1024, gt=1, le=131_072, description="Training sequence length in tokens."
    )
    # Llama 3 uses 500,000; long-context models up to ~10^7.
    rope_theta: float = Field(default=10000.0, gt=0, le=1e9, description="RoPE base frequency.")
    rms_norm_eps: float = Field(default=1e-5, gt=0, le=1.0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(default=False, description="LM head = input embedding.")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.hidden_size % heads:
            rule = f"must divide model.hidden_size = {self.hidden_size}"
            raise refuse("model.num_heads", heads, rule)
        if heads % kv_heads:
            raise refuse("model.num_kv_heads", kv_heads, f"must divide model.num_heads = {heads}")
        if self.head_dim % 2:
            raise refuse("model.num_heads", heads, f"head size {self.head_dim} must be even (RoPE)")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self) -> dict[str, Any]:
        """transformers' LlamaConfig of this model, as the keys of a config.json (written
        without importing transformers: seconds of CPU in every server process)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.seq_len,
            # transformers 5 reads rope_parameters, 4.x rope_theta
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": INIT_STD,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "use_cache": False,
        }

    def to_hf_config(self) -> Any:
        """The equivalent `transformers.LlamaConfig` (returned as Any: transformers' stubs vary)."""
        return transformers().LlamaConfig.from_dict(self.hf_config())


class Level(Section):
    """Blocks [start, end) of the model, with `modules` alternative modules (1 = shared)."""

    blocks: tuple[int, int] = Field(description="Half-open range of block indices [start, end).")
    modules: int = Field(
        default=1, ge=1, le=MAX_PATHS, description="K: alternative modules at this level."
    )

    @property
    def num_blocks(self) -> int:
        return self.blocks[1] - self.blocks[0]


class LayoutConfig(Section):
    """How the blocks split into levels and which non-block parts are owned by each path.

    Paths are numbered in mixed radix over the levels' module counts, level 0 most
    significant: with K = (2, 3), path 4 picks module 1 of level 0 and module 1 of level 1.
    """

    levels: tuple[Level, ...] = Field(description="Levels, in block order.")
    path_specific: tuple[PathPart, ...] = Field(
        default=(),
        description="Non-block parts each path owns; the others are shared by all paths.",
    )

    @model_validator(mode="after")
    def _check_tiling(self) -> LayoutConfig:
        spans = [level.blocks for level in self.levels]
        if not spans:
            raise refuse("layout.levels", spans, "need at least one level")
        for i, (start, end) in enumerate(spans):
            if not 0 <= start < end:
                raise refuse(f"layout.levels[{i}].blocks", (start, end), "need 0 <= start < end")
        if spans[0][0] != 0:
            raise refuse(
                "layout.levels",
                spans,
                f"first level starts at block {spans[0][0]}; levels must tile 0..num_layers",
            )
        for a, b in itertools.pairwise(spans):
            if a[1] < b[0]:
                gap = f"block {a[1]}" if b[0] - a[1] == 1 else f"blocks {a[1]}..{b[0] - 1}"
                rule = f"blocks {a} and {b} leave {gap} uncovered"
                raise refuse("layout.levels", spans, f"{rule}; levels must tile 0..num_layers")
            if a[1] > b[0]:
                rule = f"blocks {a} and {b} overlap"
                raise refuse("layout.levels", spans, f"{rule}; levels must tile 0..num_layers")
        if len(set(self.path_specific)) != len(self.path_specific):
            raise refuse("layout.path_specific", list(self.path_specific), "lists a part twice")
        if self.num_paths > MAX_PATHS:
            raise refuse(
                "layout.levels",
                [level.modules for level in self.levels],
                f"{self.num_paths} paths (product of modules) exceed {MAX_PATHS}",
            )
        return self

    @classmethod
    def grid(
        cls,
        num_layers: int,
        levels: int = 2,
        modules: int | tuple[int, ...] = 2,
        path_specific: tuple[PathPart, ...] = (),
    ) -> LayoutConfig:
        """`levels` near-equal levels of consecutive blocks, `modules` per level (DiPaCo 16x16)."""
        if not 1 <= levels <= num_layers:
            raise ValueError(f"levels = {levels}: need 1 <= levels <= num_layers = {num_layers}")
        counts = (modules,) * levels if isinstance(modules, int) else tuple(modules)
        if len(counts) != levels:
            raise ValueError(f"modules = {modules}: need one count per level ({levels})")
        sizes = [num_layers // levels + (i < num_layers % levels) for i in range(levels)]
        starts = [sum(sizes[:i]) for i in range(levels)]
        spans = [
            Level(blocks=(s, s + n), modules=k)
            for s, n, k in zip(starts, sizes, counts, strict=True)
        ]
        return cls(levels=tuple(spans), path_specific=path_specific)

    @classmethod
    def diloco(cls, num_layers: int) -> LayoutConfig:
        """Plain DiLoCo: one level, one module; replicas come from RunConfig.replicas_per_path."""
        return cls.grid(num_layers, levels=1, modules=1)

    @property
    def modules_per_level(self) -> tuple[int, ...]:
        return tuple(level.modules for level in self.levels)

    @property
    def num_paths(self) -> int:
        total = 1
        for k in self.modules_per_level:
            total *= k
        return total

    def path_modules(self, p: int) -> tuple[int, ...]:
        """Module choice per level of path p (mixed radix, level 0 most significant)."""
        if not 0 <= p < self.num_paths:
            raise ValueError(f"path {p} is out of range: this layout has {self.num_paths} paths")
        choices = []
        for k in reversed(self.modules_per_level):
            p, digit = divmod(p, k)
            choices.append(digit)
        return tuple(reversed(choices))

    def path_index(self, choices: tuple[int, ...] | list[int]) -> int:
        """Inverse of path_modules."""
        counts = self.modules_per_level
        if len(choices) != len(counts) or any(
            not 0 <= c < k for c, k in zip(choices, counts, strict=False)
        ):
            raise ValueError(f"module choices {tuple(choices)} do not fit modules {counts}")
        p = 0
        for c, k in zip(choices, counts, strict=True):
            p = p * k + c
        return p
