"""The run configuration: one pydantic object, validated once, stored whole with every run.

A bad config is refused with the field, the value and the rule it breaks; sizes that
cannot fit in memory are refused here, before any tensor is allocated. Defaults are
the papers' (DiLoCo arXiv 2311.08105, DiPaCo arXiv 2403.10616; see docs/design.md §1).

This file is over the house limit of ~500 lines because the whole schema lives in one place,
so a reader sees every setting of a run together.
"""

from __future__ import annotations

import itertools
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from dipaco.codecs.registry import CODECS, UPDATE_CODECS, describe

if TYPE_CHECKING:
    CodecName = str
    UpdateCodecName = str
else:  # the codec registry's names (dipaco.codecs.registry): one table for every choice
    CodecName, UpdateCodecName = Literal[CODECS], Literal[UPDATE_CODECS]

__all__ = [
    "CUDA_LOGITS_PER_CHUNK",
    "MAX_PATHS",
    "MAX_UNITS_PER_ROUND",
    "CommConfig",
    "ConfigProblem",
    "DataConfig",
    "DensePhaseConfig",
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
    "config_problems",
    "count_block_params",
    "count_part_params",
    "count_path_params",
    "estimate_path_memory",
    "refuse",
]

GiB = 1024**3


def refuse(field: str, value: Any, rule: str) -> PydanticCustomError:
    """The one error shape for a broken rule: `field = value: rule`, with all three in ctx."""
    return PydanticCustomError(
        "config_rule", "{field} = {value}: {rule}", {"field": field, "value": value, "rule": rule}
    )


# Every Linear and the embedding start ~ N(0, INIT_STD), as transformers' Llama does
# (LlamaConfig.initializer_range); dipaco.model draws them, config.json records it.
INIT_STD = 0.02


class _Section(BaseModel):
    # Closed (an unknown key is refused, naming it) and finite: no inf or NaN reaches a
    # lease size, an outer step or a JSON column (issue 34).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ModelConfig(_Section):
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
        from dipaco.hf import transformers

        return transformers().LlamaConfig.from_dict(self.hf_config())


PathPart = Literal["embeddings", "final_norm", "lm_head"]
MAX_PATHS = 65536  # a sanity bound: the server queues R units per path per round
# Units the server builds (in one transaction) when it opens a round: paths x replicas.
MAX_UNITS_PER_ROUND = 65536
# Upper bounds of counts, lengths, times, rates and sizes (issue 34): each far above what
# a run of this project can use, so no real config meets one, and small enough that no
# product the server forms of them (data positions, tokens, bytes) leaves a 64-bit column.
MAX_SEED = 2**31 - 1  # every seed consumer takes it; path seeds add fewer than MAX_PATHS
MAX_ROUNDS = 100_000  # DiLoCo/DiPaCo runs have tens to thousands of outer rounds
MAX_INNER_STEPS = 100_000  # H: the papers use 50..2,000 (DiLoCo arXiv 2311.08105 §3)
MAX_BATCH = 65_536  # sequences per micro-batch or per optimiser step's accumulation
MAX_BYTES = 2**50  # 1 PiB: beyond any device's memory or any run's module store
# Data positions (windows, from the run's start) are stored in 63-bit integer columns.
MAX_DATA_POSITION = 2**62
# Tokens of one unit weight its Δ and add up in a worker's credit (64-bit columns): 2^50
# is a million times a 500-step unit at the papers' batch of 512 x 2,048 tokens.
MAX_UNIT_TOKENS = 2**50


class Level(_Section):
    """Blocks [start, end) of the model, with `modules` alternative modules (1 = shared)."""

    blocks: tuple[int, int] = Field(description="Half-open range of block indices [start, end).")
    modules: int = Field(
        default=1, ge=1, le=MAX_PATHS, description="K: alternative modules at this level."
    )

    @property
    def num_blocks(self) -> int:
        return self.blocks[1] - self.blocks[0]


class LayoutConfig(_Section):
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


class InnerConfig(_Section):
    """The inner optimiser each worker runs on its path (DiLoCo: AdamW, warm-up, cosine)."""

    # An AdamW lr above 1 diverges at once; 10 leaves room for any schedule experiment.
    lr: float = Field(default=4e-4, gt=0, le=10.0, description="Peak AdamW learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW beta1, beta2.")
    eps: float = Field(default=1e-8, gt=0, le=1.0, description="AdamW epsilon.")
    # Decoupled decay shrinks weights by lr x wd a step: past 1 / lr it flips their sign.
    weight_decay: float = Field(
        default=0.1, ge=0, le=10.0, description="AdamW decoupled weight decay."
    )
    warmup_steps: int = Field(
        default=1000,
        ge=0,
        le=MAX_ROUNDS * MAX_INNER_STEPS,  # at most the whole run's steps
        description="Linear warm-up steps from 0 to lr.",
    )
    min_lr_ratio: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Cosine decays lr to lr x min_lr_ratio at the last step.",
    )
    # Gradient norms of LMs are O(1); 10^6 is "no clipping" with a finite number.
    grad_clip: float = Field(
        default=1.0, gt=0, le=1e6, description="Clip the global gradient norm to this."
    )
    micro_batch_size: int = Field(
        default=8, gt=0, le=MAX_BATCH, description="Sequences per forward/backward pass."
    )
    grad_accum_steps: int = Field(
        default=64,
        gt=0,
        le=MAX_BATCH,
        description="Micro-batches per optimiser step (batch = micro x accum).",
    )
    steps: int = Field(
        default=500, gt=0, le=MAX_INNER_STEPS, description="H: inner steps per outer round."
    )

    @model_validator(mode="after")
    def _check_betas(self) -> InnerConfig:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise refuse(f"inner.betas[{i}]", beta, "must be in [0, 1)")
        return self

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps


class OuterConfig(_Section):
    """The outer optimiser the server runs per module (DiLoCo: Nesterov SGD on mean Δ)."""

    # Defaults chosen by a sweep (docs/benchmarks.md, "Outer-step defaults"): DiPaCo 2x2 and
    # DiLoCo R=4 from a dense base, 8 rounds; lr 1.0 / μ 0.7 without the √ rescale beat the
    # papers' 0.7 / 0.9 (+√paths), plain averaging and outer-lr warm-ups in every pairing.
    # DiLoCo's sweep tops out near 1; an outer lr of 10 already multiplies every Δ tenfold.
    lr: float = Field(default=1.0, gt=0, le=10.0, description="Outer learning rate η.")
    momentum: float = Field(default=0.7, ge=0, lt=1, description="Outer momentum μ.")
    nesterov: bool = Field(default=True, description="Nesterov momentum, as torch.optim.SGD.")
    token_weighting: bool = Field(default=True, description="Weight each Δ by the tokens it saw.")
    sqrt_paths_rescale: bool = Field(
        default=False,
        description="Multiply a module's mean Δ by √(paths that contributed to it this round) "
        "(DiPaCo).",
    )
    overlap: Literal["none", "delayed", "eager"] = Field(
        default="none",
        description='"delayed": one-step-delayed outer updates (issue 20, no idle time). '
        "When round t closes, round t + 1 opens at once from the latest published versions "
        "while round t's outer step runs; round t + 1's Δs (relative to that base) are "
        "applied onto the versions round t published, never earlier (staleness at most 1). "
        '"eager": as delayed, plus the eager correction: after step ceil(eager_at x H) a '
        "unit adds (the versions round t publishes - its base) to its live weights and "
        "reports its Δ relative to round t's versions (no staleness); a unit that cannot "
        "get them in time reports it relative to its base, as delayed. "
        '"none": round t + 1 opens after round t\'s step, from its versions. Quality cost '
        'measured with dipaco simulate: docs/benchmarks.md, "Overlapped outer steps".',
    )
    eager_at: float = Field(
        default=0.1,
        description='overlap "eager": the fraction of a unit\'s H inner steps after which it '
        "rebases onto the previous round's versions (waiting there until they are published); "
        "in (0, 1].",
    )
    warmup_rounds: int = Field(
        default=0,
        ge=0,
        le=MAX_ROUNDS,
        description="Outer lr ramps linearly over the first rounds: round t (0-based) "
        "steps with lr x (t + 1) / (warmup_rounds + 1); 0: full lr from the first round.",
    )
    robust: Literal["mean", "clipped-mean", "trimmed-mean"] = Field(
        default="clipped-mean",
        description="Aggregation rule for the Δs of one module; clipped-mean bounds what any "
        "one Δ can move, whatever its norm (volunteers are untrusted).",
    )
    clip_factor: float = Field(
        default=2.0,
        gt=0,
        le=1000.0,  # a clip 1,000 x the reference norm no longer bounds anything
        description="clipped-mean: clip each Δ's norm to this x the module's reference norm "
        "(the median of its accepted norms in recent rounds; the round's median at first).",
    )
    trim_fraction: float = Field(
        default=0.1,
        ge=0,
        lt=0.5,
        description="trimmed-mean: drop this fraction at each end per value.",
    )
    reject_norm_factor: float = Field(
        default=10.0,
        gt=1,
        le=1e6,  # norm factors: past 10^6 x a check passes every Δ a float can hold
        description="Drop a Δ whose norm exceeds this x the round's median norm.",
    )
    # Checks against the module's own history, which hold with one or two Δs a round
    # (platform/dipaco_server/rounds/verify.py; docs/reliability.md, "Untrusted workers").
    verify: bool = Field(
        default=True,
        description="Screen each Δ against the module's history and score it (proof of "
        "useful work) before aggregating; off: only the codec and round-median checks.",
    )
    history_rounds: int = Field(
        default=8,
        ge=1,
        le=MAX_ROUNDS,
        description="Rounds of accepted Δ norms that form a module's reference.",
    )
    history_norm_factor: float = Field(
        default=4.0,
        gt=1,
        le=1e6,
        description="Drop a Δ whose norm exceeds this x the module's reference.",
    )
    min_norm_factor: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Drop a Δ whose norm is below this x the module's reference (free riders).",
    )
    min_momentum_cosine: float = Field(
        default=-0.5,
        ge=-1,
        le=1,
        description=(
            "Drop a Δ whose cosine with the module's outer momentum is below this. At H = 500 "
            "honest Δs measured -0.20 to -0.24 (the Nesterov step overshoots, and the next "
            "Δs point back), so the bar sits well below; a sign flip of an aligned Δ scores "
            "near -1, and the proof of useful work catches the rest."
        ),
    )
    score: bool = Field(
        default=True,
        description="Proof of useful work: apply each Δ alone to its path and measure the loss.",
    )
    score_windows: int = Field(
        default=8,
        ge=1,
        le=1024,  # each window is a forward pass of the outer step per Δ
        description="Windows of training and of held-out data a Δ is scored on.",
    )
    score_min_gain: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="The Δ applied alone must lower the loss on its unit's windows by more "
        "than this fraction (an untrained model's loss is ln(vocab); a Δ that only flattens "
        "the logits towards uniform gains a fraction of a percent there).",
    )
    score_heldout_tolerance: float = Field(
        default=0.05,
        ge=0,
        le=100.0,  # a fraction of the loss: 100 x is no check at all
        description="The Δ applied alone may raise the held-out loss by at most this fraction.",
    )
    replica_min_cosine: float = Field(
        # Two honest workers' Δs of one unit differ by more than kernels: each continues its
        # own warm AdamW state (dipaco.inner). In `dipaco demo` an honest pair measured
        # 0.45; noise or another path's Δ is near 0 and a sign flip is -1.
        default=0.2,
        ge=-1,
        le=1,
        description="Sampled replication: two workers' Δs of one unit agree above this cosine.",
    )
    replica_norm_ratio: float = Field(
        # A worker starting cold AdamW moments steps further than one continuing warm ones:
        # honest pairs measured 1.56-1.94 x in `dipaco demo` (H = 10) and 1.62 x at H = 50
        # (tests/test_untrusted.py), so 1.5 rejected honest work; the scaled attacks of
        # bench/attacks.py start at 10 x.
        default=3.0,
        ge=1,
        le=1e6,
        description="... and with norms within this ratio of each other.",
    )

    @model_validator(mode="after")
    def _check_eager_at(self) -> OuterConfig:
        if isinstance(self.eager_at, bool) or not 0 < self.eager_at <= 1:
            raise refuse(
                "outer.eager_at",
                self.eager_at,
                "must be in (0, 1]: the fraction of a unit's inner steps after which it "
                "rebases (outer.overlap eager), e.g. 0.1",
            )
        return self


class CommConfig(_Section):
    """How pseudo-gradients and published module updates travel (dipaco.codecs)."""

    codec: CodecName = Field(
        default="fp16",
        description=f"Pseudo-gradient encoding: {describe()}. fp16 is lossless in practice "
        "(OpenDiLoCo).",
    )
    block_size: int = Field(
        default=128,
        ge=2,
        le=2**20,  # one scale per million values is already no scaling to speak of
        description="Values per scale for int8 (absmax) and int4 (least squares). 128: "
        "int8 + zstd traffic at H = 500 is 2,034x below data-parallel at quality int8/fp32 "
        "0.9997; 256 gives 2,124x at 1.0042, 512 2,199x at 1.0057 (docs/benchmarks.md, "
        '"Traffic").',
    )
    compression: Literal["none", "zstd"] = Field(
        default="zstd",
        description="Lossless compression of every encoded Δ and published update: zstd "
        "wraps the codec container in one frame (int8 Δs shrink ~5%, fp16 ~8%); readers "
        "detect it and decompress within the module's size. none: the bare container.",
    )
    download_codec: UpdateCodecName = Field(
        default="fp32",
        description="How each outer update is published: a worker holding version t "
        "downloads only update t -> t + 1 in this encoding, and the server applies exactly "
        "the decoded update (with error feedback), so both hold the same weights bit for "
        "bit; fp32: whole fp32 modules, as new workers always get them. The same in "
        "dipaco simulate and on the platform (rounds.publish, rounds.downloads; the "
        "worker's manifest request says which versions it holds).",
    )

    @model_validator(mode="after")
    def _check_block(self) -> CommConfig:
        if self.block_size % 2:
            raise refuse("comm.block_size", self.block_size, "must be even (int4 packs pairs)")
        return self


class DataConfig(_Section):
    """Where the run's text comes from; the vocabulary size is model.vocab_size."""

    corpus: str = Field(
        default="stdlib",
        min_length=1,
        max_length=4096,  # PATH_MAX on Linux
        description='"stdlib", a directory of text, or a .jsonl path.',
    )
    text_field: str = Field(
        default="text", min_length=1, max_length=256, description="Field holding text in .jsonl."
    )
    val_fraction: float = Field(
        default=0.01,
        ge=0,
        lt=0.5,
        description="Share of each path's shard held out for evaluation.",
    )


class RouterConfig(_Section):
    """Offline routing of documents to paths (DiPaCo: features of the first 32 tokens)."""

    featurizer: Literal["tfidf", "base-lm"] = Field(
        default="tfidf",
        description="Hashed n-gram TF-IDF, or the base LM's mean last hidden state.",
    )
    method: Literal["kmeans", "product-kmeans"] = Field(
        default="kmeans", description="One k-means over all paths, or one factor per level."
    )
    prefix_tokens: int = Field(
        default=32, gt=0, le=131_072, description="Tokens of each document the router reads."
    )
    max_imbalance: float = Field(
        default=1.5,
        ge=1.0,
        le=float(MAX_PATHS),  # one shard holding everything is MAX_PATHS x the mean at most
        description="Largest shard at most this x the mean shard size.",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of the clustering.")


class DensePhaseConfig(_Section):
    """Phase 1 of the DiPaCo recipe (docs/design.md §1): one dense, path-size model trained with DiLoCo.

    Its features route the documents (router.featurizer "base-lm") and its layers start
    every module of phase 2; `RunConfig.dense_phase` is the plain DiLoCo config it runs as.
    """

    rounds: int = Field(gt=0, le=MAX_ROUNDS, description="Outer rounds of the dense DiLoCo phase.")
    replicas: int = Field(
        default=4,
        gt=0,
        le=MAX_UNITS_PER_ROUND,
        description="Work units per round (DiLoCo replicas), each on its own window of the "
        "one shard of all training documents.",
    )
    inner_steps: int | None = Field(
        default=None,
        gt=0,
        le=MAX_INNER_STEPS,
        description="H of phase 1; null: the run's inner.steps.",
    )


class EvalConfig(_Section):
    """Held-out evaluation after every round, and per-path early stopping (DiPaCo §4)."""

    batches: int = Field(default=4, ge=1, le=1024, description="Validation batches per path.")
    batch_size: int = Field(default=8, ge=1, le=4096, description="Windows per validation batch.")
    patience: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ROUNDS,
        description="Rounds without improvement before a path stops training; null: never.",
    )
    min_delta: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,  # nats: a loss is at most ln(vocab_size) < 14 at the start of training
        description="A loss improvement smaller than this does not count.",
    )


class UnitsConfig(_Section):
    """How big a work unit is on the platform: sized to each worker's measured speed.

    A unit is at most H = inner.steps steps; a worker whose H steps would take longer
    than `target_seconds` gets fewer (its lease says how many), and the outer step weights
    its Δ by the tokens it trained on (outer.token_weighting). The lr schedule stays the
    run's: a shorter unit is the first steps of the full one, so resuming and salvage
    (a partial Δ after SIGTERM, lease expiry or the round closing) mean the same thing.
    """

    # A unit longer than a day would outlive most volunteers' sessions and every lease.
    target_seconds: float = Field(
        default=900.0,
        gt=0,
        le=86_400.0,
        description="Wall time a unit should take at the worker's speed.",
    )
    calibration_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600.0,  # measuring a speed takes a minute; an hour is ample
        description="A new worker's first unit stops after this long (it uploads the steps "
        "done): its completion measures the speed that sizes its next units.",
    )
    min_partial_steps: int = Field(
        default=1,
        ge=1,
        le=MAX_INNER_STEPS,
        description="A salvaged partial Δ of fewer steps is dropped, not uploaded.",
    )


class LimitsConfig(_Section):
    """Refuse configs that cannot fit, before anything is allocated."""

    max_path_memory_bytes: int = Field(
        default=80 * GiB,
        gt=0,
        le=MAX_BYTES,
        description="Largest training memory estimate accepted for one path.",
    )
    max_module_storage_bytes: int = Field(
        default=1024 * GiB,
        gt=0,
        le=MAX_BYTES,
        description="Largest fp32 weights + momentum over all modules.",
    )


class MemoryEstimate(NamedTuple):
    params: int
    state_bytes: int  # weights, grads, AdamW moments, θ_old: 20 bytes per parameter
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def count_block_params(model: ModelConfig) -> int:
    """Parameters of one transformer block."""
    h, kv_width = model.hidden_size, model.num_kv_heads * model.head_dim
    attention = 2 * h * h + 2 * h * kv_width  # q, o: (h, h); k, v: (kv_width, h)
    mlp = 3 * h * model.intermediate_size  # gate, up, down
    return attention + mlp + 2 * h  # + two RMSNorm weights


def count_part_params(model: ModelConfig) -> dict[PathPart, int]:
    """Parameters of the non-block parts; a tied LM head has none of its own."""
    table = model.vocab_size * model.hidden_size
    return {
        "embeddings": table,
        "final_norm": model.hidden_size,
        "lm_head": 0 if model.tie_embeddings else table,
    }


def count_path_params(model: ModelConfig) -> int:
    """Parameters of one path (a full LlamaForCausalLM), computed without building it."""
    return model.num_layers * count_block_params(model) + sum(count_part_params(model).values())


# The CUDA inner loop's logits per loss chunk (dipaco.inner.loss.LOGITS_PER_CHUNK is this),
# defined here for the memory estimate, below the loop in the library's layers.
CUDA_LOGITS_PER_CHUNK = 2**25


def estimate_path_memory(
    model: ModelConfig, inner: InnerConfig, *, device: str = "cpu"
) -> MemoryEstimate:
    """A deliberately rough upper bound of one path's training memory.

    State: fp32 weights, grads, two AdamW moments and the θ_old copy for Δ (20 B/param).
    Activations (no recomputation, fused attention): about 10·h + 4·ffn values per token
    per block, plus logits, their fp32 copy and gradient (3·vocab per token). On the CPU
    (`device` "cpu", also the schema's bound) they are fp32 and the logits whole; on "cuda"
    the inner loop trains under bf16 autocast with a chunked loss, so block activations take
    2 bytes and one chunk's logits live at a time. Measured on one H100 at 150M parameters,
    micro-batch 32 x 1,024, compiled (docs/figures/gpu.json): a peak of 15.7 GiB, where
    "cuda" estimates 17.3 and "cpu" 42.3 (which made the worker halve its micro-batch).
    """
    params = count_path_params(model)
    tokens = inner.micro_batch_size * model.seq_len
    per_token_block = 10 * model.hidden_size + 4 * model.intermediate_size
    blocks = tokens * model.num_layers * per_token_block
    if device == "cuda":
        chunk = min(tokens, max(1, CUDA_LOGITS_PER_CHUNK // model.vocab_size))
        return MemoryEstimate(params, 20 * params, 2 * blocks + 4 * 3 * chunk * model.vocab_size)
    return MemoryEstimate(params, 20 * params, 4 * (blocks + tokens * 3 * model.vocab_size))


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


class RunConfig(_Section):
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
        base: dict[str, Any] = {
            "name": "tiny",
            "rounds": 3,
            "model": ModelConfig(
                hidden_size=128,
                num_layers=4,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=352,
                vocab_size=8192,
                seq_len=128,
            ),
            "layout": LayoutConfig.grid(4, levels=2, modules=2),
            "inner": InnerConfig(
                lr=3e-3, warmup_steps=5, micro_batch_size=4, grad_accum_steps=1, steps=20
            ),
        }
        plain = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in base.items()}
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(plain.get(key), dict):
                plain[key] = {**plain[key], **value}  # a dict changes fields of the section
            else:
                plain[key] = value.model_dump() if isinstance(value, BaseModel) else value
        return cls.model_validate(plain)

    @classmethod
    def capacity(cls, **sections: Any) -> RunConfig:
        """A module-dominant run for one GPU: DiPaCo's capacity claim at a scale it can show.

        Paths of 8.5M parameters (width 256, 8 blocks, vocabulary 4,096, sequences of 256)
        whose blocks are 75% of a path, on 2 levels x 4 modules (16 paths): 2 x 4 x 3.2M of
        modules plus the 2.1M shared embedding and head make 27.8M in all, 3.26x a path. At
        the batch of 256 sequences, 240 steps a path (4 rounds x 60) are 15.7M tokens a
        path and 252M for DiPaCo: 29.5 tokens per parameter for the dense path-size model
        trained on the same tokens, past the ~20 that is compute-optimal at its size
        (arXiv 2203.15556), so more data buys it less than more parameters would. Sizing
        from the one-H100 throughputs: bench/quality_gpu.sh. Keyword arguments change it as
        in `tiny`.
        """
        base: dict[str, Any] = {
            "name": "capacity",
            "rounds": 4,
            "model": {
                "hidden_size": 256,
                "num_layers": 8,
                "num_heads": 4,
                "num_kv_heads": 4,
                "intermediate_size": 704,
                "vocab_size": 4096,
                "seq_len": 256,
            },
            "layout": LayoutConfig.grid(8, levels=2, modules=4).model_dump(),
            "inner": {
                "lr": 2e-3,
                "warmup_steps": 24,
                "micro_batch_size": 256,
                "grad_accum_steps": 1,
                "steps": 60,
            },
        }
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}  # a dict changes fields of the section
            else:
                base[key] = value
        return cls.tiny(**base)

    def num_params(self) -> int:
        return count_path_params(self.model)

    @property
    def num_paths(self) -> int:
        return self.layout.num_paths

    def path_modules(self, p: int) -> tuple[int, ...]:
        return self.layout.path_modules(p)

    def path_index(self, choices: tuple[int, ...] | list[int]) -> int:
        return self.layout.path_index(choices)
