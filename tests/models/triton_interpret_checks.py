"""Run by test_triton_attention.py in a subprocess, under TRITON_INTERPRET=1 with Triton on the path:
the reference decoder's Triton attention kernel against SDPA on the CPU. Prints one JSON line per
check; the test asserts on them. Not a test module itself (Triton must not enter the test process:
torch would import it for every compile)."""

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"


def emit(name, **fields):
    print(json.dumps({"check": name, **fields}), flush=True)


def mixed_batch(slots, length, kv, heads, dim, dtype, seed):
    """Random caches and a batch of decode tokens and two prefills, one slot used twice, positions
    crossing several kernel blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots, length, kv, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, length, kv, dim, generator=g).to(dtype)
    seq = [0] * 5 + [3] * 3 + [1, 2, 4] + [0] * 2
    pos = list(range(5)) + list(range(130, 133)) + [length - 1, 0, 63] + [64, 65]
    q = torch.randn(len(seq), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(seq), torch.tensor(pos)


def main() -> int:
    from piecewise.serving import llama
    from piecewise.serving.llama import LlamaConfig, LlamaForCausalLM, _gathered_attention
    from piecewise.serving.triton_attention import cached_attention

    # 1. the kernel against the SDPA gather path: fp32 and fp16, GQA groups 1 and 3, a head dim
    #    that is a power of two and one that is not (the kernel masks the rest of its block)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for kv, heads, dim in ((2, 6, 16), (3, 3, 24)):
            q, k_cache, v_cache, seq, pos = mixed_batch(5, 160, kv, heads, dim, dtype, seed=dim + heads)
            want = _gathered_attention(q.float(), k_cache.float(), v_cache.float(), seq, pos, dim**-0.5)
            out = torch.full_like(q, float("nan"))
            cached_attention(q, k_cache, v_cache, seq, pos, dim**-0.5, out)
            emit("kernel", dtype=str(dtype), kv=kv, heads=heads, dim=dim, tol=tol,
                 max_abs=(out.float() - want).abs().max().item(), nan=bool(out.isnan().any()))

    # 2. pad rows by a device-side count (full graphs): zeros, real rows unchanged
    q, k_cache, v_cache, seq, pos = mixed_batch(5, 160, 2, 4, 16, torch.float32, seed=9)
    want = _gathered_attention(q, k_cache, v_cache, seq, pos, 0.25)
    out = torch.full_like(q, float("nan"))
    cached_attention(q, k_cache, v_cache, seq, pos, 0.25, out, num_real=torch.tensor(7))
    emit("num_real", real_max_abs=(out[:7] - want[:7]).abs().max().item(), pad_zero=bool((out[7:] == 0).all()))

    # 3. the reference decoder end to end, its op on the kernel (PIECEWISE_LLAMA_ATTENTION=triton),
    #    against the same weights on SDPA: a prefill of three prompts, then decode steps
    cfg = LlamaConfig(num_layers=2, max_num_seqs=4, max_seq_len=96)
    prompts = [[5, 17, 99, 3, 250, 8, 41], [7], [120, 33, 61, 200]]

    def greedy(impl):
        llama._attention_impl = impl
        model = LlamaForCausalLM(cfg, seed=3)
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        seq_ids = torch.tensor([s for s, p in enumerate(prompts) for _ in p])
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        tokens = [[] for _ in prompts]
        with torch.no_grad():
            logits = model(ids, positions, seq_ids)[last]
            for step in range(6):
                nxt = logits.argmax(-1)
                for s in range(len(prompts)):
                    tokens[s].append(int(nxt[s]))
                pos = torch.tensor([len(p) + step for p in prompts])
                logits = model(nxt, pos, torch.arange(len(prompts)))
        return tokens, logits

    sdpa_tokens, sdpa_logits = greedy("sdpa")
    triton_tokens, triton_logits = greedy("triton")
    emit("decoder", equal=sdpa_tokens == triton_tokens, tokens=triton_tokens,
         max_abs=(sdpa_logits - triton_logits).abs().max().item())
    return 0


if __name__ == "__main__":
    sys.exit(main())
