"""Where a CPU decode step goes, and what the Inductor options, dtype and thread count do to it (issue 48 §1).

``PIECEWISE_CACHE_DIR=/tmp/x TORCHINDUCTOR_CACHE_DIR=/tmp/y .venv/bin/python benchmarks/cpu_decode_profile.py``

Everything in ONE process, so a shared host's load hits every system alike:

* the floor: bytes of the model's weights (each storage once; the tied embedding is read whole by the
  vocabulary projection) over the memory bandwidth measured here (``torch.sum`` over a 512 MB fp32
  tensor at the process's threads, median of 7), printed before and after the timing rounds;
* systems (SmolLM2-135M-Instruct, real weights, 128-token prompts; `piecewise.bench.generation`'s
  builders): ``hf_eager``, ``pw_generate``, ``pw_engine``, each in the variants asked for
  (``base``; ``freezing``: ``inductor_options={"freezing": True}``; ``dynamic_threads``:
  ``{"cpp.dynamic_threads": True}``; ``bf16``: weights in bfloat16; ``bf16_packed``: with
  ``cpu_packed_linear=True``; ``bf16_freezing``), each on its
  own copy of the weights, built for the largest batch and serving every batch;
* timing: ``--rounds`` rounds; in each, for every thread count and batch, every (system, variant)
  generates ``--steps`` + 1 tokens once, the order rotated each round; the decode step is
  (whole - time to first token) / steps. Median (min-max) over rounds, and the median of each
  round's ratio to ``hf_eager`` of the same dtype, thread count and batch;
* correctness: the greedy tokens of every system against ``hf_eager`` of the same dtype (same prompts);
  piecewise's recompile counter after the warm-up and at the end;
* ``--profile``: `torch.profiler` (CPU) of one generate of ``steps`` + 1 tokens minus one of 1 token
  (the prefill), per op: self CPU ms per decode step, top ``--top``, per system (base variant) and batch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch

#: variant -> (weight dtype, Inductor options, other CompilationConfig fields)
VARIANTS = {
    "base": (torch.float32, {}, {}),
    "freezing": (torch.float32, {"freezing": True}, {}),
    "dynamic_threads": (torch.float32, {"cpp.dynamic_threads": True}, {}),
    "bf16": (torch.bfloat16, {}, {}),
    "bf16_packed": (torch.bfloat16, {}, {"cpu_packed_linear": True}),
    "bf16_freezing": (torch.bfloat16, {"freezing": True}, {}),
}


def bandwidth_gbs(threads: int, reps: int = 7) -> float:
    """GB/s of ``torch.sum`` over a 512 MB fp32 tensor at `threads` threads (median of `reps`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(128 * 1024 * 1024)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    torch.set_num_threads(before)
    return x.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@contextlib.contextmanager
def inductor_options(opts: dict[str, Any], fields: dict[str, Any] | None = None):
    """`piecewise.CompilationConfig` made with `opts` as its ``inductor_options`` (and `fields`)
    while inside."""
    import piecewise as pw

    orig = pw.CompilationConfig
    extra = {**({"inductor_options": dict(opts)} if opts else {}), **(fields or {})}
    pw.CompilationConfig = lambda **kw: orig(**kw, **extra)
    try:
        yield
    finally:
        pw.CompilationConfig = orig


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def profile_table(gen, n: int, steps: int, top: int) -> list[tuple[str, float, int]]:
    """(op, self CPU ms per decode step, calls per step): a generate of `steps` + 1 tokens minus one of 1."""
    from torch.profiler import ProfilerActivity, profile

    def run(tokens: int) -> dict[str, tuple[float, int]]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gen(7, n=n, tokens=tokens)
        return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}

    full, pre = run(steps + 1), run(1)
    rows = [(k, (v[0] - pre.get(k, (0, 0))[0]) / steps / 1e3, round((v[1] - pre.get(k, (0, 0))[1]) / steps))
            for k, v in full.items()]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="hf_eager,pw_generate,pw_engine")
    p.add_argument("--variants", default="base,freezing,dynamic_threads,bf16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", default="2,1", help="thread counts measured in turn each round")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--weights", default=None, help="weight cache root (default: the user cache dir)")
    args = p.parse_args(argv)

    import piecewise as pw
    from piecewise.bench.generation import _build
    from platformdirs import user_cache_dir

    root = args.weights or user_cache_dir("piecewise")
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    systems = args.systems.split(",")
    variants = args.variants.split(",")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()}", flush=True)

    built: dict[tuple[str, str], Any] = {}
    for variant in variants:
        dtype, opts, fields = VARIANTS[variant]
        for system in systems:
            if system == "hf_eager" and (opts or fields):
                continue  # nothing compiled: one eager per dtype
            t = time.perf_counter()
            before = pw.counters.recompiles
            try:
                with inductor_options(opts, fields):
                    gen, rec = _build(system, max(batches), root, new_tokens=args.steps + 1, dtype=dtype)
                    with torch.no_grad():
                        for b in batches:
                            gen(0, n=b, tokens=2)  # compile / warm
            except Exception as e:
                print(f"build {system}/{variant}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                continue
            built[(system, variant)] = gen
            print(f"built {system}/{variant} in {time.perf_counter() - t:.1f} s, recompiles {pw.counters.recompiles - before}",
                  flush=True)

    # the floor
    model, _ = __import__("piecewise.hf.gguf", fromlist=["load_smollm2"]).load_smollm2(root)
    wbytes = weight_bytes(model)
    del model
    bw = {n: bandwidth_gbs(n) for n in threads}
    floor_lines = [f"floor: weights {wbytes / 1e6:.0f} MB fp32 ({wbytes / 2e6:.0f} MB bf16); bandwidth " +
                   ", ".join(f"{n} thr {g:.1f} GB/s -> fp32 {wbytes / g / 1e6:.1f} ms, bf16 {wbytes / 2 / g / 1e6:.1f} ms"
                             for n, g in bw.items())]
    print(floor_lines[0], flush=True)

    # correctness: tokens against eager of the same dtype
    tokens: dict[tuple[str, str, int], list] = {}
    torch.set_num_threads(threads[0])
    for (system, variant), gen in built.items():
        for b in batches:
            out: list = []
            with torch.no_grad():
                gen(3, n=b, tokens=args.steps + 1, out=out)
            tokens[(system, variant, b)] = out
    rec_after_warm = pw.counters.recompiles
    for (system, variant, b), out in tokens.items():
        ref_variant = "bf16" if VARIANTS[variant][0] == torch.bfloat16 else "base"
        ref = tokens.get(("hf_eager", ref_variant, b))
        if ref is None or system == "hf_eager":
            continue
        same = sum(x == y for r, o in zip(ref, out) for x, y in zip(r, o))
        total = sum(len(r) for r in ref)
        print(f"tokens {system}/{variant} b{b}: {same}/{total} equal to hf_eager/{ref_variant}", flush=True)

    if args.profile:
        torch.set_num_threads(threads[0])
        for (system, variant), gen in built.items():
            if variant != "base":
                continue
            for b in batches:
                rows = profile_table(gen, b, args.steps, args.top)
                print(f"\nprofile {system} batch {b}, {threads[0]} threads: self CPU ms per decode step (calls per step)")
                print("| op | self ms/step | calls/step |\n|---|---:|---:|")
                for k, ms, c in rows:
                    print(f"| {k[:80]} | {ms:.2f} | {c} |", flush=True)

    # timing rounds
    step: dict[tuple[str, str, int, int], list[float]] = {}
    keys = list(built)
    for r in range(args.rounds):
        for n in threads:
            torch.set_num_threads(n)
            for b in batches:
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                    with torch.no_grad():
                        ttft, total = built[key](10 + r, n=b, tokens=args.steps + 1)
                    step.setdefault((*key, n, b), []).append((total - ttft) / args.steps * 1e3)
                    print(f"round {r} threads {n} batch {b} {key[0]}/{key[1]}: {step[(*key, n, b)][-1]:.1f} ms/step", flush=True)
        print(f"round {r} done, load {os.getloadavg()}", flush=True)
    torch.set_num_threads(threads[0])
    bw_after = bandwidth_gbs(threads[0])
    print(f"bandwidth after the rounds, {threads[0]} thr: {bw_after:.1f} GB/s", flush=True)

    print("\n| threads | batch | system | variant | decode ms/step median (min-max) | vs hf_eager same dtype, median "
          "(min-max) of per-round ratios |\n|---:|---:|---|---|---:|---:|")
    for n in threads:
        for b in batches:
            for system, variant in keys:
                s = step[(system, variant, n, b)]
                ref = step.get(("hf_eager", "bf16" if VARIANTS[variant][0] == torch.bfloat16 else "base", n, b))
                ratio = spread([x / y for x, y in zip(s, ref)], 2) if ref else "-"
                print(f"| {n} | {b} | {system} | {variant} | {spread(s)} | {ratio} |")
    print(f"\nrecompiles after warm-up {rec_after_warm}, at the end {pw.counters.recompiles}; load {os.getloadavg()}")

    return 0


if __name__ == "__main__":
    sys.exit(main())
