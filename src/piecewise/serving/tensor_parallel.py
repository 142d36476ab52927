"""Tensor parallelism for the reference decoder over `torch.distributed` ranks.

`shard_llama(model, group)` turns a `LlamaForCausalLM` holding the full weights into this rank's
shard, Megatron-style (the layout vLLM and SGLang use for Llama):

- q/k/v and gate/up projections are column-parallel: each rank keeps a contiguous block of output
  features (``num_heads / world`` query heads, ``num_kv_heads / world`` kv heads, ``intermediate /
  world`` MLP features), so attention runs on the rank's own heads with no communication and the
  KV cache holds only them; with fewer kv heads than ranks, each rank keeps the one kv head its
  query heads read (replicated over ``world / num_kv_heads`` ranks);
- o and down projections are row-parallel: each rank multiplies its block of input features and
  one all-reduce (sum) per attention block and per MLP block combines the partial results before
  the bias is added once;
- embeddings, norms and the vocabulary projection stay replicated.

The all-reduce is `torch.distributed._functional_collectives.all_reduce`, which Dynamo traces into
the graph as ``_c10d_functional.all_reduce`` + ``wait_tensor``: the collectives live inside the
compiled pieces, and the attention splitting op is unchanged. Every rank must run the same calls
with the same shapes (the usual SPMD contract); the backend is ``gloo`` on the CPU and ``nccl`` on
GPUs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import ConfigError
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

__all__ = ["RowParallelLinear", "shard_llama"]


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: this rank's block of input features of a
    linear layer, summed over the group.

    Args:
        linear: the full layer; its weight is [out, in].
        rank, world: this rank and the group's size; ``in`` must divide by `world`.
        group: the process group (None: the default group).

    Input [tokens, in / world], output [tokens, out], in the layer's dtype."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group=None) -> None:
        super().__init__()
        n = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        #: the group by name: a plain string in the traced graph and its guards (a ProcessGroup object
        #: cannot be saved in a warm-start bundle)
        self.group_name = (group if group is not None else torch.distributed.group.WORLD).group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .._torch.distributed import functional_collectives as funcol

        y = funcol.all_reduce(nn.functional.linear(x, self.weight), "sum", self.group_name)
        return y if self.bias is None else y + self.bias


def _column(linear: nn.Linear, block: int, blocks: int) -> nn.Linear:
    """Block `block` of `blocks` equal contiguous blocks of a linear layer's output features."""
    n = linear.out_features // blocks
    out = nn.Linear(linear.in_features, n, bias=linear.bias is not None, dtype=linear.weight.dtype,
                    device=linear.weight.device)
    with torch.no_grad():
        out.weight.copy_(linear.weight[block * n:(block + 1) * n])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[block * n:(block + 1) * n])
    return out.requires_grad_(False)


def shard_llama(model: LlamaForCausalLM, group=None) -> LlamaForCausalLM:
    """Make `model` (full weights, identical on every rank, e.g. the same seed) this rank's
    tensor-parallel shard, in place; returns it.

    Raises:
        ConfigError: torch.distributed is not initialised, ``num_heads`` or ``intermediate_size``
            does not divide by the group's size, or ``num_kv_heads`` and the group's size do not
            divide one another (the message names which).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("shard_llama needs torch.distributed initialised (torchrun, then "
                          "dist.init_process_group('gloo' or 'nccl'))")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    c = model.config
    for name in ("num_heads", "intermediate_size"):
        if getattr(c, name) % world:
            raise ConfigError(f"LlamaConfig.{name}={getattr(c, name)} does not divide by the {world} ranks of the "
                              "tensor-parallel group; pick a world size that divides it")
    if c.num_kv_heads % world and world % c.num_kv_heads:
        raise ConfigError(f"LlamaConfig.num_kv_heads={c.num_kv_heads} and the {world} ranks of the tensor-parallel "
                          "group must divide one another (kv heads are split, or replicated when there are fewer "
                          "kv heads than ranks); pick another world size")
    # kv heads: split when there are at least as many as ranks, else each rank keeps the one its
    # query heads read (replicated on world / num_kv_heads ranks), as vLLM does
    kv_local = max(1, c.num_kv_heads // world)
    kv_block = rank if c.num_kv_heads >= world else rank * c.num_kv_heads // world
    local = dataclasses.replace(c, num_heads=c.num_heads // world, num_kv_heads=kv_local,
                                intermediate_size=c.intermediate_size // world)
    for layer in model.layers:
        attn: LlamaAttention = layer.self_attn
        attn.q_proj = _column(attn.q_proj, rank, world)
        attn.k_proj = _column(attn.k_proj, kv_block, c.num_kv_heads // kv_local)
        attn.v_proj = _column(attn.v_proj, kv_block, c.num_kv_heads // kv_local)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group)
        attn.config = local
        kv = attn.k_cache.shape
        attn.k_cache = torch.zeros(kv[0], kv[1], local.num_kv_heads, kv[3], dtype=attn.k_cache.dtype,
                                   device=attn.k_cache.device)
        attn.v_cache = torch.zeros_like(attn.k_cache)
        mlp: LlamaMLP = layer.mlp
        mlp.gate_proj = _column(mlp.gate_proj, rank, world)
        mlp.up_proj = _column(mlp.up_proj, rank, world)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)
    return model
