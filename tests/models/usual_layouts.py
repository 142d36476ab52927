"""Decoders written the way users write them (not the project's reference models), for the tests of
dynamic sizes: nanoGPT's ``[B, T, ...]`` attention, a fused-QKV layout with a causal mask built
from ``T``, GQA with ``repeat_interleave`` and RoPE applied before the attention op. Each model's
attention is a splitting op registered the way the docs show (a fake returning ``empty_like``),
but nanoGPT's plain ``F.scaled_dot_product_attention`` (``sdpa``: one piece, no splitting op)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import piecewise as pw


@pw.splitting_op("usual_layouts::causal_attention", mutates_args=())
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, h, T, d]`` each -> ``[B, h, T, d]``, causal."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@causal_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@pw.splitting_op("usual_layouts::masked_attention", mutates_args=())
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, h, T, d]`` each and a bool mask ``[T, T]`` (True: attend) -> ``[B, h, T, d]``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@masked_attention.register_fake
def _(q, k, v, mask):
    return torch.empty_like(q)


class NanoBlock(nn.Module):
    """nanoGPT's block: ``qkv(x).split``, ``view(B, T, h, d).transpose(1, 2)``, attention, then
    ``transpose(1, 2).reshape(B, T, D)``."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, h: int = 4, n_layer: int = 2, max_len: int = 512) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(NanoBlock(d, h) for _ in range(n_layer))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(T, device=input_ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class FusedQKVBlock(nn.Module):
    """One fused projection unpacked with ``unflatten`` and ``unbind``; a causal mask built from T."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.norm = nn.RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.RMSNorm(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.wqkv(self.norm(x)).unflatten(-1, (3, self.h, D // self.h))  # [B, T, 3, h, d]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, h, T, d]
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = masked_attention(q, k, v, mask)
        x = x + self.wo(y.permute(0, 2, 1, 3).flatten(2))
        return x + self.mlp(x)


class FusedQKV(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, h: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(FusedQKVBlock(d, h) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``[B, h, T, d]`` with ``cos``/``sin`` ``[T, d]`` (half-rotation layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GQABlock(nn.Module):
    """Llama-style: separate q/k/v projections, fewer KV heads expanded with
    ``repeat_interleave``, RoPE applied before the attention op."""

    def __init__(self, d: int, h: int, kv_h: int) -> None:
        super().__init__()
        self.h, self.kv_h, self.hd = h, kv_h, d // h
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_h * self.hd, bias=False)
        self.v = nn.Linear(d, kv_h * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k(h).view(B, T, self.kv_h, self.hd).transpose(1, 2)
        v = self.v(h).view(B, T, self.kv_h, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = k.repeat_interleave(self.h // self.kv_h, dim=1)
        v = v.repeat_interleave(self.h // self.kv_h, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, -1)
        x = x + self.o(y)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GQADecoder(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, h: int = 4, kv_h: int = 2, n_layer: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(GQABlock(d, h, kv_h) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // h
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        t = torch.arange(T, device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


@pw.splitting_op("usual_layouts::causal_attention_new_empty", mutates_args=())
def causal_attention_new_empty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """As `causal_attention`, with a fake that is contiguous like the op's result."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@causal_attention_new_empty.register_fake
def _(q, k, v):
    return q.new_empty(q.shape)


class ExpandGQABlock(nn.Module):
    """GQA by ``k[:, :, None].expand(B, hk, rep, T, d).reshape(B, h, T, d)``, a fused KV projection
    unpacked with ``unflatten``/``unbind``, and ``reshape(B, T, -1)`` after attention: the pieces'
    compiles take guards on one token or one sequence (a view that is one only there)."""

    def __init__(self, d: int, h: int, kv_h: int) -> None:
        super().__init__()
        self.h, self.kv_h, self.hd = h, kv_h, d // h
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_h * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hx = self.norm1(x)
        q = self.q(hx).unflatten(-1, (self.h, self.hd)).transpose(1, 2)
        k, v = self.kv(hx).unflatten(-1, (2, self.kv_h, self.hd)).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.h // self.kv_h
        k = k[:, :, None].expand(B, self.kv_h, rep, T, self.hd).reshape(B, self.h, T, self.hd)
        v = v[:, :, None].expand(B, self.kv_h, rep, T, self.hd).reshape(B, self.h, T, self.hd)
        y = causal_attention_new_empty(q, k, v).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(y)
        g, u = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class ExpandGQADecoder(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, h: int = 4, kv_h: int = 2, n_layer: int = 1, max_len: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(ExpandGQABlock(d, h, kv_h) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // h
        freqs = torch.outer(torch.arange(max_len).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[-1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


class SDPABlock(nn.Module):
    """nanoGPT's ``CausalSelfAttention`` as written there: no splitting op, plain
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on ``view(B, T, h, d).transpose(1, 2)``
    of a split, then ``transpose(1, 2).contiguous().view(B, T, C)`` (the graph is one piece)."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        k = k.view(B, T, self.h, C // self.h).transpose(1, 2)
        q = q.view(B, T, self.h, C // self.h).transpose(1, 2)
        v = v.view(B, T, self.h, C // self.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln2(x))))


class SDPAGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, h: int = 4, n_layer: int = 1, max_len: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(SDPABlock(d, h) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        x = self.wte(input_ids) + self.wpe(torch.arange(0, T, dtype=torch.long, device=input_ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


MODELS = {"nanogpt": NanoGPT, "fused_qkv": FusedQKV, "gqa_rope": GQADecoder, "expand_gqa": ExpandGQADecoder,
          "sdpa": SDPAGPT}
