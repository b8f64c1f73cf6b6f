"""A path's parameters and training memory, computed from the config without building it."""

from __future__ import annotations

from typing import NamedTuple

from dipaco.config.shape import ModelConfig, PathPart
from dipaco.config.training import InnerConfig


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
