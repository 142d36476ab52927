"""Small models for tests, benchmarks and the demo: no weights to download, seconds to compile.

`ToyTransformer(L)` is L pre-norm blocks whose attention is the splitting op
``piecewise_models::toy_attention``; split there it yields 2L+1 pieces, L+1 of them compiled, and
3 distinct piece fingerprints (first, middle, last). `TwoSplitModel` is elementwise code around two
splitting ops (5 pieces, 3 compiled).
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_context import forward_context
from ..ops import splitting_op

__all__ = ["toy_attention", "ToyTransformer", "TwoSplitModel"]


@splitting_op("piecewise_models::toy_attention")
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of every real token over every real token: q, k, v ``[num_tokens, dim]``
    float; returns ``[num_tokens, dim]``. Mixing rows makes padding mistakes visible. Under graph
    padding only the first ``forward_context().num_tokens`` rows are real: pad rows are neither
    attended to nor computed (they come back as zeros), as a serving attention kernel does. The real
    count is read from the device tensor of the forward context when there is one, so the op stays
    correct when captured inside a full graph."""
    ctx = forward_context()
    if ctx is None or (ctx.num_tokens == ctx.padded_num_tokens and ctx.runtime_mode != "full"):
        scores = (q.float() @ k.float().t()) / q.shape[-1] ** 0.5
        return (scores.softmax(-1) @ v.float()).to(q.dtype)
    rows = torch.arange(q.shape[0], device=q.device)
    real = rows < (ctx.num_tokens_device if ctx.num_tokens_device is not None else ctx.num_tokens)
    scores = (q.float() @ k.float().t()) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~real[None, :], float("-inf"))
    out = scores.softmax(-1) @ v.float()
    return torch.where(real[:, None], out, 0.0).to(q.dtype)


@toy_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.ops.piecewise_models.toy_attention(q, k, v))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class ToyTransformer(nn.Module):
    """``forward(x [num_tokens, dim]) -> [num_tokens, dim]``; fixed-seed weights."""

    def __init__(self, num_layers: int = 3, dim: int = 32, seed: int = 0) -> None:
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(num_layers))
            self.norm = nn.LayerNorm(dim)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class TwoSplitModel(nn.Module):
    """Elementwise ops around two splitting ops: ``forward(x [num_tokens, dim])``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sin(x) + 1
        x = torch.ops.piecewise_models.toy_attention(x, x, x)
        x = x * 2 - torch.cos(x)
        x = torch.ops.piecewise_models.toy_attention(x, x * 0.5, x)
        return torch.tanh(x) + x
