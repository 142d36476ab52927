"""Decode-step benchmark on a CUDA GPU: eager, ``torch.compile`` and piecewise side by side.

``python -m piecewise.bench.gpu_decode`` builds the reference Llama decoder (8 layers, hidden 1024,
GQA 16/8 heads, bf16), then times decode steps of 1, 8, 32 and 64 sequences (one token each,
positions ~128 deep in the KV cache) for:

* ``eager``;
* ``torch.compile`` with Inductor, full graph, no CUDA graphs (``compile default``);
* ``torch.compile(mode="reduce-overhead")``: Inductor plus PyTorch's own CUDA graph trees, one graph
  recorded per distinct batch size (``compile reduce-overhead``);
* piecewise Inductor pieces replayed as CUDA graphs per capture size (``piecewise graphs``);
* piecewise with the whole forward as one CUDA graph (``piecewise full``);
* piecewise with ``split_strategy="inductor_partition"``: one Inductor compile of the whole graph,
  its partitions between the splitting ops replayed as CUDA graphs (``piecewise partition``).

Each system times ``steps`` steps per batch size after 5 warm-up steps of that size, fresh token ids
on every step; the figure is the median wall time per step in microseconds, the device synchronized
after each step. Prints a Markdown table and the first call's seconds (compile + capture); run it
twice with the same ``TORCHINDUCTOR_CACHE_DIR`` and ``PIECEWISE_CACHE_DIR`` for cold and warm start.
``--json PATH`` also writes the figures; ``--attention sdpa|triton`` picks the reference decoder's
attention kernel (default ``auto``: Triton on CUDA when it is installed). The host cost per piece
has a benchmark of its own, `piecewise.bench.overhead`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from .._torch import dynamo

SYSTEMS = ("eager", "compile default", "compile reduce-overhead", "piecewise graphs", "piecewise full", "piecewise partition")


def _step_inputs(cfg, b: int, device: str):
    ids = torch.randint(0, cfg.vocab_size, (b,), device=device)
    pos = torch.full((b,), 128, dtype=torch.long, device=device)
    seq = torch.arange(b, device=device) % cfg.max_num_seqs
    return ids, pos, seq


def _time(fn, inputs, steps: int) -> tuple[float, float, float]:
    """(median, p10, p90) microseconds per step over ``steps`` steps after 5 warm-up steps."""
    for x in inputs[:5]:
        fn(*x)
    torch.cuda.synchronize()
    times = []
    for x in inputs[5:5 + steps]:
        t0 = time.perf_counter()
        fn(*x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[0], q[-1]


def _build(name: str, model, dims):
    import piecewise as pw

    if name == "eager":
        return model
    if name == "compile default":
        return torch.compile(model, backend="inductor", fullgraph=True)
    if name == "compile reduce-overhead":
        return torch.compile(model, backend="inductor", fullgraph=True, mode="reduce-overhead")
    mode, strategy = {"piecewise graphs": ("piecewise", "fx"), "piecewise full": ("full", "fx"),
                      "piecewise partition": ("piecewise", "inductor_partition")}[name]
    return pw.compile(model, pw.CompilationConfig(backend="inductor", max_num_tokens=64, cudagraph_mode=mode,
                                                  split_strategy=strategy, tag=f"gpu_decode_{mode}_{strategy}"),
                      dynamic_arg_dims=dims)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--attention", default="auto", choices=("auto", "sdpa", "triton"),
                    help="the reference decoder's attention kernel (PIECEWISE_LLAMA_ATTENTION): auto is Triton on CUDA "
                         "when it is installed")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU decode benchmark needs one")
        return 1
    from piecewise.serving import LlamaConfig, LlamaForCausalLM, llama

    llama._attention_impl = a.attention

    batches = tuple(int(b) for b in a.batches.split(","))
    systems = [s.strip() for s in a.systems.split(",")]
    torch.set_grad_enabled(False)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=a.layers, num_heads=16,
                      num_kv_heads=8, head_dim=64, max_num_seqs=64, max_seq_len=256, dtype=torch.bfloat16)
    dims = {"input_ids": 0, "positions": 0, "seq_ids": 0}
    rows: dict[str, dict[int, tuple[float, float, float]]] = {}
    first_s: dict[str, float] = {}
    for name in systems:
        dynamo.reset()
        model = LlamaForCausalLM(cfg, seed=0).cuda()
        fn = _build(name, model, dims)
        t0 = time.perf_counter()
        fn(*_step_inputs(cfg, 8, "cuda"))
        torch.cuda.synchronize()
        first_s[name] = time.perf_counter() - t0
        rows[name] = {b: _time(fn, [_step_inputs(cfg, b, "cuda") for _ in range(a.steps + 5)], a.steps)
                      for b in batches}
        print(f"{name}: first call {first_s[name]:.1f} s; median us per step "
              + ", ".join(f"b{b} {v[0]:.0f}" for b, v in rows[name].items()), flush=True)
        if a.json:  # after every system: a run cut short by its time limit keeps what it measured
            _write_json(a.json, a, first_s, rows)
        del fn, model
        torch.cuda.empty_cache()
    print(f"GPU decode step, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, reference Llama "
          f"{cfg.num_layers} layers hidden {cfg.hidden_size} bf16, attention {a.attention}; median (p10-p90) of {a.steps} steps, us\n")
    print("| batch | " + " | ".join(systems) + " | " + " | ".join(f"{s} / eager" for s in systems[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(systems) - 1))
    for b in batches:
        e = rows[systems[0]][b][0]
        print(f"| {b} | " + " | ".join(f"{rows[s][b][0]:.0f} ({rows[s][b][1]:.0f}-{rows[s][b][2]:.0f})" for s in systems)
              + " | " + " | ".join(f"{rows[s][b][0] / e:.2f}" for s in systems[1:]) + " |")
    print("\nfirst call (trace + compile or cache load + capture), s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in first_s.items()))
    return 0


def _write_json(path: str, a: argparse.Namespace, first_s: dict[str, float],
                rows: dict[str, dict[int, tuple[float, float, float]]]) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": a.layers, "attention": a.attention,
                   "steps": a.steps, "first_call_s": first_s,
                   "step_us": {s: {str(b): v for b, v in r.items()} for s, r in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
