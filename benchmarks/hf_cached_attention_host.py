"""Host cost of one call of the transformers generation attention op (`hf_cached_attention`'s
Python body, as the FX split calls it between pieces; without the KV cache write, which is
compiled into the piece before except in the decode step with graphs), one thread, median of 7 round medians of
300 calls (min-max of the rounds), microseconds.

    .venv/bin/python benchmarks/hf_cached_attention_host.py          # tiny shapes: host cost alone
    .venv/bin/python benchmarks/hf_cached_attention_host.py smollm2  # a SmolLM2 decode shape, batch 8

Tiny: batch 1, 2 heads / 1 KV head, head_dim 8, 16 cache positions, 6 attended. SmolLM2: batch 8,
9 heads / 3 KV heads, head_dim 64, 192 cache positions, 141 attended.
"""

import statistics
import sys
import time

import torch

from piecewise.hf import generate as hf_generate

torch.set_grad_enabled(False)
torch.set_num_threads(1)
B, H, KV, D, L, past = (8, 9, 3, 64, 192, 140) if sys.argv[1:] == ["smollm2"] else (1, 2, 1, 8, 16, 5)
q = torch.randn(B, H, 1, D)
k_cache, v_cache = torch.randn(B, KV, L, D), torch.randn(B, KV, L, D)
write_pos = torch.tensor([past])
mask = hf_generate.attention_mask_for_step(write_pos, torch.ones(B, L, dtype=torch.bool), torch.float32)  # as a step builds it
out = torch.empty(B, 1, H, D)
body = hf_generate.hf_cached_attention._init_fn
token = hf_generate._step_attention.set(hf_generate.StepAttention(past + 1))  # as GenerationRoute sets it (mask kept)
rounds = []
for _ in range(7):
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        body(q, None, None, k_cache, v_cache, write_pos, mask, D**-0.5, out)
        times.append(time.perf_counter() - t0)
    rounds.append(statistics.median(times) * 1e6)
print(f"hf_cached_attention, {sys.argv[1] if sys.argv[1:] else 'tiny'} shapes: {statistics.median(rounds):.1f} us a call "
      f"(rounds {min(rounds):.1f}-{max(rounds):.1f})")
