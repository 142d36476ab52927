"""Decode-step benchmark on a CUDA GPU: eager vs piecewise graphs vs full graphs.

``python -m piecewise.bench.gpu_decode`` builds the reference Llama decoder (8 layers, hidden 1024,
GQA 16/8 heads, bf16), then times decode steps of 1, 8, 32 and 64 sequences (one token each,
positions ~128 deep in the KV cache) for: eager; piecewise Inductor pieces replayed as CUDA graphs
(``cudagraph_mode="piecewise"``); the whole forward as one CUDA graph (``"full"``). Prints a
Markdown table of median step microseconds and speedups over eager from the same run.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _step_inputs(cfg, b: int, device: str):
    ids = torch.randint(0, cfg.vocab_size, (b,), device=device)
    pos = torch.full((b,), 128, dtype=torch.long, device=device)
    seq = torch.arange(b, device=device) % cfg.max_num_seqs
    return ids, pos, seq


def _time(fn, inputs, steps: int) -> float:
    for x in inputs[:5]:
        fn(*x)
    torch.cuda.synchronize()
    times = []
    for x in inputs[5:5 + steps]:
        t0 = time.perf_counter()
        fn(*x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(steps: int = 100, batches: tuple[int, ...] = (1, 8, 32, 64)) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU decode benchmark needs one")
        return 1
    import piecewise as pw
    from piecewise.models import LlamaConfig, LlamaForCausalLM

    torch.set_grad_enabled(False)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                      num_kv_heads=8, head_dim=64, max_num_seqs=64, max_seq_len=256, dtype=torch.bfloat16)
    dims = {"input_ids": 0, "positions": 0, "seq_ids": 0}
    systems = {"eager": None, "piecewise graphs": "piecewise", "full graph": "full"}
    rows: dict[str, dict[int, float]] = {}
    compile_s: dict[str, float] = {}
    for name, mode in systems.items():
        model = LlamaForCausalLM(cfg, seed=0).cuda()
        fn = model
        if mode is not None:
            fn = pw.compile(model, pw.CompilationConfig(backend="inductor", max_num_tokens=64, cudagraph_mode=mode,
                                                        tag=f"gpu_decode_{mode}"), dynamic_arg_dims=dims)
        t0 = time.perf_counter()
        fn(*_step_inputs(cfg, 8, "cuda"))
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - t0
        rows[name] = {b: _time(fn, [_step_inputs(cfg, b, "cuda") for _ in range(steps + 5)], steps) for b in batches}
        del fn, model
        torch.cuda.empty_cache()
    print(f"GPU decode step, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, reference Llama "
          f"{cfg.num_layers} layers hidden {cfg.hidden_size} bf16; median of {steps} steps (us)\n")
    print("| batch | " + " | ".join(systems) + " | piecewise speedup | full speedup |")
    print("|---:|" + "---:|" * (len(systems) + 2))
    for b in batches:
        e = rows["eager"][b]
        print(f"| {b} | " + " | ".join(f"{rows[s][b]:.0f}" for s in systems)
              + f" | {e / rows['piecewise graphs'][b]:.2f}x | {e / rows['full graph'][b]:.2f}x |")
    print("\nfirst call (compile + capture) seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
