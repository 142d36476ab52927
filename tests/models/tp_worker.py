"""One rank of the tensor-parallel checks (run by torchrun from test_tensor_parallel.py).

Builds the reference decoder with full weights, shards a second copy for this rank
(`piecewise.serving.tensor_parallel.shard_llama`), compiles the shard with piecewise and compares
it, for each token count given, with the full single-process model in eager mode, on fresh data
each call (the same on every rank). Writes ``<out>/rank_<r>.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import piecewise as pw
from piecewise.errors import ConfigError
from piecewise.serving import LlamaConfig, LlamaForCausalLM
from piecewise.serving.tensor_parallel import shard_llama


def main() -> None:
    backend, out_dir, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    if backend == "code":  # the cache tests' fast artifact-saving adaptor
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cache"))
        import cachehelp  # noqa: F401
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=int(os.environ.get("TP_HEADS", 4)),
                      num_kv_heads=int(os.environ.get("TP_KV_HEADS", 2)), head_dim=16, max_num_seqs=64, max_seq_len=64,
                      o_bias=True, mlp_bias=True)
    refused = ""
    try:
        shard_llama(LlamaForCausalLM(LlamaConfig(num_heads=4, num_kv_heads=1, intermediate_size=96 + 1)))
    except ConfigError as e:
        refused = str(e)
    full = LlamaForCausalLM(cfg, seed=0)
    shard = shard_llama(LlamaForCausalLM(cfg, seed=0))
    cm = pw.compile(shard, pw.CompilationConfig(backend=backend, max_num_tokens=64),
                    dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    before = pw.counters.snapshot()
    for n in sizes:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        pos = torch.randint(0, cfg.max_seq_len, (n,), generator=gen)
        seq = torch.randperm(cfg.max_num_seqs, generator=gen)[:n]
        with torch.no_grad():
            ref = full(ids, pos, seq)
        got = cm(ids, pos, seq)
        worst = max(worst, (got - ref).abs().max().item())
    report = {"rank": rank, "world": world, "worst": worst, "refused": refused,
              "kv_heads": shard.layers[0].self_attn.k_cache.shape[2], "counters": pw.counters.delta_since(before)}
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
