"""One path: a Llama causal LM in plain torch, with transformers' LlamaForCausalLM names.

Training, evaluation, routing features and the outer step build this module; the files a
path is downloaded as (`dipaco.inference`) open as an ordinary `LlamaForCausalLM`, and a
test holds the two to the same logits. The layers are those of transformers' modeling_llama
(pre-norm RMSNorm in fp32, rotary embeddings with the halves rotated, causal scaled
dot-product attention with grouped key/value heads, a SwiGLU MLP, no biases), written the
way nanoGPT and torchtitan write theirs, because importing transformers' model classes
takes seconds of CPU in every process that trains, scores or serves a path, and those
processes need none of the rest of transformers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dipaco.config import INIT_STD, ModelConfig

__all__ = ["PathModel", "build_model", "count_parameters", "state_shapes"]


class BodyOutput(NamedTuple):
    """The decoder body's output, named as transformers' LlamaModel names it."""

    last_hidden_state: Tensor  # (B, T, C), after the final norm
    hidden_states: tuple[Tensor, ...] | None = None  # embeddings, each block; the last normed


class LMOutput(NamedTuple):
    logits: Tensor  # (B, T, V)
    hidden_states: tuple[Tensor, ...] | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x.to(dtype)  # an fp32 weight promotes: fp32, as transformers'
        # A bf16/fp16 stream (training under autocast) stays in its dtype, the statistics
        # having been taken in fp32; an fp32 one is transformers' arithmetic exactly.
        return out if dtype == torch.float32 else out.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(t: int, head_dim: int, theta: float, like: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary embedding at positions 0..t-1, (t, head_dim), in fp32
    arithmetic and then `like`'s dtype (computed per call: no buffer in the state)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float, device=like.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    positions = torch.arange(t, device=like.device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        c = cfg.hidden_size
        self.q_proj = nn.Linear(c, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.kv_heads != self.heads:  # grouped-query attention: each K/V head serves a group
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """transformers' LlamaModel: embedding, blocks, final norm. The inner loop compiles it
    and reads `.last_hidden_state`; the loss applies the head itself (dipaco.inner.loss)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> BodyOutput:
        x = self.embed_tokens(input_ids)  # (B, T, C)
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            # Under autocast the residual stream is the autocast dtype (bf16 on a GPU), as
            # the memory estimate assumes: half the elementwise traffic of an fp32 stream,
            # and RoPE's cos/sin follow it. The weights, their gradients and AdamW stay fp32.
            x = x.to(torch.get_autocast_dtype(kind))
        t = input_ids.shape[1]
        cos, sin = rotary(t, self.head_dim, self.rope_theta, x)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            # Causal and padded: query i sees the keys j <= i that the mask keeps; a query
            # left with no key (left padding) sees all, rather than giving NaN.
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = causal[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
            mask = mask | ~mask.any(dim=-1, keepdim=True)
        hidden = [x] if output_hidden_states else None  # kept only when asked for
        for block in self.layers:
            x = block(x, cos, sin, mask)
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)
        if hidden is None:
            return BodyOutput(x)
        hidden[-1] = x  # as transformers reports it: the last entry is the normed output
        return BodyOutput(x, tuple(hidden))


class PathModel(nn.Module):
    """A path as a causal LM: `model.model` the body, `model.lm_head` the head.

    `model(input_ids).logits` and `model.model(input_ids=...).last_hidden_state` answer as
    LlamaForCausalLM's do, and the state dict has its names (a tied head is one tensor).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg  # `.hidden_size`, `.vocab_size` as on transformers' config
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> LMOutput:
        out = self.model(input_ids, attention_mask, output_hidden_states)
        return LMOutput(self.lm_head(out.last_hidden_state), out.hidden_states)


def build_model(
    model_cfg: ModelConfig,
    seed: int,
    *,
    device: torch.device | str = "cpu",
) -> PathModel:
    """A freshly initialised fp32 model; the same seed gives the same weights, bit for bit.

    transformers' Llama initialisation: every Linear and the embedding ~ N(0, INIT_STD),
    the norms 1, drawn in state-dict order (a tied head once, as the embedding). The global
    RNG is left as it was, so building a model never shifts a caller's random stream.
    """
    with torch.device("meta"):
        model = PathModel(model_cfg)  # no memory, no default init to throw away
    model = model.to_empty(device="cpu")
    if model_cfg.tie_embeddings:  # to_empty gives each name its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(mean=0.0, std=INIT_STD)
    # Initialised on the CPU so a seed gives the same weights on every device.
    return model.to(device=torch.device(device))


def count_parameters(model: nn.Module) -> int:
    """Distinct trainable values; a tied embedding and LM head count once."""
    return sum(p.numel() for p in model.parameters())


@lru_cache(maxsize=32)
def state_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every state-dict tensor, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = PathModel(model_cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
