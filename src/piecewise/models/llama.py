"""A reference Llama decoder written the way serving engines write models.

Tokens of every sequence in a step are flattened into one dimension (`num_tokens`), each with its
position and the slot of its sequence; there is no batch or padding dimension. Attention is the
splitting op ``piecewise_models::llama_attention``: it writes the step's keys and values into static
per-layer KV caches in place and then attends, so it stays eager while everything between two
attentions can be compiled and captured. Weights are random from a seed; nothing is downloaded.

The forward has no Python branching on tensor values and no data-dependent shapes outside the
attention op, so Dynamo traces it with ``fullgraph=True`` and a dynamic `num_tokens`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..errors import ConfigError
from ..forward_context import forward_context
from ..ops import splitting_op

__all__ = ["LLAMA_ATTENTION_OP", "LlamaConfig", "LlamaForCausalLM", "llama_attention"]

LLAMA_ATTENTION_OP = "piecewise_models::llama_attention"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a reference decoder. Small by default: a CPU forward takes milliseconds.

    `max_num_seqs` and `max_seq_len` size the static KV cache (sequence slots x positions); a
    token's `seq_ids` entry must be < `max_num_seqs` and its position < `max_seq_len`.

    Raises:
        ConfigError (a ValueError): a field is out of range; the message names it.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_num_seqs: int = 8
    max_seq_len: int = 128
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_num_seqs", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"LlamaConfig.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention shares each kv head among num_heads // num_kv_heads query heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig.head_dim={self.head_dim} must be even; rotary embedding rotates pairs")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"LlamaConfig.{name}={value!r} must be a positive number")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"LlamaConfig.dtype={self.dtype!r} must be a floating torch.dtype, e.g. torch.float32")


@splitting_op(LLAMA_ATTENTION_OP, mutates_args=("k_cache", "v_cache"))
def llama_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention over a static KV cache; writes this step's k/v in place.

    Args:
        q: [num_tokens, num_heads, head_dim].
        k, v: [num_tokens, num_kv_heads, head_dim], same dtype as `q`.
        k_cache, v_cache: [max_num_seqs, max_seq_len, num_kv_heads, head_dim]; row
            ``[seq_ids[t], positions[t]]`` is overwritten with ``k[t]`` / ``v[t]``.
        positions: [num_tokens] int64, each token's position in its sequence.
        seq_ids: [num_tokens] int64, each token's sequence slot.
        scale: multiplier of q·k, usually ``head_dim ** -0.5``.

    Returns:
        [num_tokens, num_heads, head_dim] in `q`'s dtype. Token t attends to its own sequence's
        cached positions ``0..positions[t]``, which includes tokens written by this same call.

    Under a forward context only the first ``num_tokens`` rows are real: pad rows (appended after
    them by graph padding) are neither written to the cache nor attended, and their output is zero.
    Positions a token reads must have been written by this or an earlier call; the cache is not
    checked. Inside a full graph (runtime mode ``"full"``) the real count comes from the context's
    device tensor and pad rows write into the cache's last slot, a scratch slot no sequence owns,
    so the op has no Python branch on the count and replays correctly.
    """
    ctx = forward_context()
    if ctx is not None and ctx.runtime_mode == "full" and ctx.num_tokens_device is not None:
        return _attention_graph_safe(q, k, v, k_cache, v_cache, positions, seq_ids, scale, ctx.num_tokens_device)
    n = q.shape[0] if ctx is None else min(ctx.num_tokens, q.shape[0])
    if n == 0:
        return torch.zeros_like(q)
    pos, seq = positions[:n], seq_ids[:n]
    k_cache.index_put_((seq, pos), k[:n])
    v_cache.index_put_((seq, pos), v[:n])
    out = _cached_attention(q[:n], k_cache, v_cache, seq, pos, scale)
    if n < q.shape[0]:  # pad rows: zero
        out = torch.cat((out, q.new_zeros((q.shape[0] - n, *q.shape[1:]))))
    return out


def _cached_attention(q, k_cache, v_cache, seq, pos, scale):
    """[n, num_heads, head_dim] attention of each token over its sequence's cached rows 0..pos.

    One fused ``scaled_dot_product_attention`` call with grouped-query heads and a [n, max_seq_len]
    causal mask: about 10 dispatcher calls a layer instead of ~25 for gather/einsum/softmax, which
    is what the host pays between piecewise graphs on a GPU."""
    keys = k_cache[seq].transpose(1, 2)  # [n, num_kv_heads, max_seq_len, head_dim]
    values = v_cache[seq].transpose(1, 2)
    visible = torch.arange(k_cache.shape[1], device=q.device)[None, :] <= pos[:, None]  # [n, max_seq_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True
    )  # [n, num_heads, 1, head_dim]
    return out.squeeze(2)


def _attention_graph_safe(q, k, v, k_cache, v_cache, positions, seq_ids, scale, num_tokens_device):
    t = q.shape[0]
    real = torch.arange(t, device=q.device) < num_tokens_device
    seq = torch.where(real, seq_ids, k_cache.shape[0] - 1)
    pos = torch.where(real, positions, 0)
    k_cache[seq, pos] = k
    v_cache[seq, pos] = v
    out = _cached_attention(q, k_cache, v_cache, seq, pos, scale)
    return torch.where(real[:, None, None], out, 0.0).to(q.dtype)


@llama_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, seq_ids, scale):
    # Without this, seq_ids (read by nothing but this op) keeps a symbolic size of its own and a
    # traced graph shows two dynamic dims where there is one, num_tokens.
    torch._check(seq_ids.shape[0] == q.shape[0])
    return torch.empty_like(q)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32, returned in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each [num_tokens, head_dim] float32.

    The frequencies are rebuilt from constants on every call rather than kept in a buffer, so
    casting the model with ``.to(torch.bfloat16)`` cannot round them; Dynamo folds them anyway.
    """
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [head_dim / 2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, heads, head_dim] by the angles behind `cos`/`sin` (half-split pairing)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class LlamaAttention(nn.Module):
    """q/k/v projections, rotary embedding, the attention splitting op, o projection.

    Owns its layer's KV cache: buffers `k_cache` and `v_cache`, [max_num_seqs + 1, max_seq_len,
    num_kv_heads, head_dim] in `config.dtype`, not saved in the state dict. The extra last slot is
    scratch space for pad rows inside full graphs; no sequence uses it.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        cache_shape = (c.max_num_seqs + 1, c.max_seq_len, c.num_kv_heads, c.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=c.dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=c.dtype), persistent=False)

    def forward(self, x, cos, sin, positions, seq_ids):
        c = self.config
        q = apply_rotary(self.q_proj(x).view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        out = llama_attention(q, k, v, self.k_cache, self.v_cache, positions, seq_ids, c.head_dim**-0.5)
        return self.o_proj(out.reshape(-1, c.num_heads * c.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, positions, seq_ids):
        x = x + self.self_attn(self.input_norm(x), cos, sin, positions, seq_ids)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    """Llama decoder over flattened tokens with a static per-layer KV cache.

    ``LlamaForCausalLM(config, seed=0)`` builds the same weights for the same seed on any machine
    (drawn on the CPU in float32, then cast to `config.dtype`). Move it with ``.to(device)``; build
    another dtype through the config rather than ``.to(dtype)`` so the KV caches match.

    Calls mutate the KV caches: one call per decoding step, and `reset_kv_cache` between
    unrelated runs if stale entries matter to you (greedy decoding never reads a position it has
    not written in the same run).
    """

    def __init__(self, config: LlamaConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config = config if config is not None else LlamaConfig()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(seed)
        self.to(config.dtype)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Unit-variance embeddings and fan-in-scaled projections keep the residual stream O(1);
        # residual outputs are shrunk by depth, and lm_head gives logits a std of ~2 so greedy
        # argmax has margins far above fp32 noise while tokens still vary from step to step.
        gen = torch.Generator().manual_seed(seed)
        depth_scale = 1.0 / math.sqrt(2 * self.config.num_layers)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                continue  # norms start at one
            if name == "embed_tokens.weight":
                std = 1.0
            elif name == "lm_head.weight":
                std = 2.0 / math.sqrt(param.shape[1])
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= depth_scale
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def reset_kv_cache(self) -> None:
        """Zero every layer's KV cache in place (addresses are kept, so captured graphs stay valid)."""
        for layer in self.layers:
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every token of a flattened step.

        Args:
            input_ids: [num_tokens] int64, each < vocab_size.
            positions: [num_tokens] int64, each token's position in its sequence, < max_seq_len.
            seq_ids: [num_tokens] int64, each token's sequence slot, < max_num_seqs.

        Returns:
            [num_tokens, vocab_size] logits in `config.dtype`.

        Writes each token's keys and values into the KV caches at ``[seq_ids, positions]``. Index
        ranges are not checked (that would need a data-dependent branch).
        """
        c = self.config
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, seq_ids)
        return self.lm_head(self.norm(x))
