"""How a run trains: the inner optimiser each worker runs, the outer step the server runs,
how Δs and updates travel, and the dense phase 1 before the paths."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from dipaco.codecs.registry import CODECS, UPDATE_CODECS, describe
from dipaco.config.rules import (
    MAX_BATCH,
    MAX_INNER_STEPS,
    MAX_ROUNDS,
    MAX_UNITS_PER_ROUND,
    Section,
    refuse,
)

if TYPE_CHECKING:
    CodecName = str
    UpdateCodecName = str
else:  # the codec registry's names (dipaco.codecs.registry): one table for every choice
    CodecName, UpdateCodecName = Literal[CODECS], Literal[UPDATE_CODECS]


class InnerConfig(Section):
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


class OuterConfig(Section):
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
        description='"delayed": one-step-delayed outer updates (no idle time). '
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
    # (platform/dipaco_server/rounds/verification/rules.py; docs/reliability.md, "Untrusted workers").
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
        description="Windows of training and of held-out data a Δ is scored on, at most "
        "(score_flops decides how many at the run's model size).",
    )
    score_flops: float = Field(
        # 6 windows of the 150M path (4 passes of 1,024 tokens each: 8.24e12): at fewer the
        # checks refused honest units and accepted lazy scored-window units in the tiny
        # bench at that count (docs/reliability.md, "At the 150M scoring budget"); the tiny
        # and capacity presets' whole score_windows cost under a tenth of it.
        default=8.3e12,
        ge=1e6,
        le=1e21,
        description="Forward FLOPs one unit's proof of useful work may cost (the path's "
        "base losses and the Δ's, on training and held-out windows): the windows follow "
        "for the run's model, at least 1, at most score_windows (dipaco.flops).",
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


def eager_rebase_step(eager_at: float, inner_steps: int) -> int:
    """The step after which an eager unit (outer.overlap "eager") rebases onto the
    previous round's versions: ceil(eager_at x H), at least 1. The platform's lease plan
    (dipaco_server.rounds.protocol.rebase) and `dipaco simulate` both take it from here."""
    return max(1, math.ceil(eager_at * inner_steps))


class CommConfig(Section):
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
        "dipaco simulate and on the platform (rounds.outer.publish, rounds.protocol.downloads; the "
        "worker's manifest request says which versions it holds).",
    )

    @model_validator(mode="after")
    def _check_block(self) -> CommConfig:
        if self.block_size % 2:
            raise refuse("comm.block_size", self.block_size, "must be even (int4 packs pairs)")
        return self


class DensePhaseConfig(Section):
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
