"""Which CPU linear kernel is faster at how many rows: torch's ``mm`` against oneDNN with the weight
packed once (what `piecewise.passes.PackedLinear` runs), per dtype (issue 48 §1).

    .venv/bin/python benchmarks/cpu_linear_kernels.py [--threads 2] [--rounds 5] [--out benchmarks/results]

SmolLM2-135M's shapes: a decoder's 30 layers of q/k/v/o/gate/up/down weights (576 wide, 1536 in the
MLP, 3 KV heads of 64), each layer its own copy so every weight is read from memory as in a decode
step, the 49152 x 576 vocabulary projection, and each weight shape alone (30 copies; ``out x in``
features), with two of a small model's (hidden 128). For each dtype and row count, each round times one
pass over every weight with each kernel in turn (order alternating between rounds); a figure is the
median (min-max) over rounds of ms a pass, and the ratio packed / ``mm`` is taken per round.
``PackedLinear``'s choice for float32 (`FLOAT32_PACKED_ROWS`, `FLOAT32_MIN_OUT_FEATURES`) comes from
this table.

Writes ``cpu-linear-<time>.json`` and ``.md`` under ``--out`` (the docs' CPU guide shows the latest). The
top level imports no torch: ``scripts/bench_tables.py`` renders the table with `to_markdown`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
          (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def _spread(xs: list[float]) -> dict:
    return {"value": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def measure(dtype: Any, rows: int, weights: list[Any], rounds: int) -> dict:
    """ms of one pass over `weights` with ``mm`` and with the packed kernel, and their ratio."""
    import torch

    from piecewise._torch.onednn import pack_linear_weight, packed_linear

    packed = [pack_linear_weight(w) for w in weights]
    xs = {k: torch.randn(rows, k, dtype=dtype) for k in {w.shape[1] for w in weights}}

    def run_mm() -> None:
        for w in weights:
            torch.mm(xs[w.shape[1]], w.t())

    def run_packed() -> None:
        for w, p in zip(weights, packed):
            packed_linear(xs[w.shape[1]], p, None)

    kernels = {"mm": run_mm, "packed": run_packed}
    for f in kernels.values():
        f()  # warm
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for r in range(rounds):
        for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
            t = time.perf_counter()
            kernels[name]()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {"mm_ms": _spread(times["mm"]), "packed_ms": _spread(times["packed"]),
            "ratio": _spread([p / m for p, m in zip(times["packed"], times["mm"])])}


def to_markdown(d: dict) -> str:
    lines = [f"Threads {d['threads']}, {d['rounds']} rounds, torch {d['torch']}, {d['processor']}; ms a pass over the "
             "weights, median (min-max) over rounds; ratio = packed / mm per round (below 1: packed faster).\n",
             "| weights | dtype | rows | mm ms | packed ms | packed / mm |", "|---|---|---:|---:|---:|---:|"]
    f = lambda s, k=1: f"{s['value']:.{k}f} ({s['min']:.{k}f}-{s['max']:.{k}f})"  # noqa: E731
    for r in d["rows"]:
        lines.append(f"| {r['weights']} | {r['dtype']} | {r['rows']} | {f(r['mm_ms'])} | {f(r['packed_ms'])} | "
                     f"{f(r['ratio'], 2)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shape-rows", default="1,8,64", help="rows for each weight shape alone")
    p.add_argument("--out", default=None, help="folder for cpu-linear-<time>.json and .md")
    a = p.parse_args(argv)
    import torch

    from piecewise._torch.onednn import packable_dtypes

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"threads": a.threads, "rounds": a.rounds, "torch": torch.__version__,
           "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_start": os.getloadavg()[0], "rows": []}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in packable_dtypes():
                print(f"{dtype}: this CPU does not run it in oneDNN; skipped", flush=True)
                continue
            sets = {"30 layers": [torch.randn(n, k, dtype=dtype) for _ in range(LAYERS) for n, k in SHAPES],
                    "vocabulary projection": [torch.randn(VOCAB, HIDDEN, dtype=dtype)]}
            # each weight shape alone (30 copies), and a small model's (hidden 128): which ones gain
            for n, k in [*dict.fromkeys(SHAPES), (128, 128), (4096, 128)]:
                sets[f"{n} x {k}"] = [torch.randn(n, k, dtype=dtype) for _ in range(LAYERS)]
            for name, weights in sets.items():
                for rows in (int(x) for x in (a.rows if name in ("30 layers", "vocabulary projection")
                                              else a.shape_rows).split(",")):
                    m = measure(dtype, rows, weights, a.rounds)
                    row = {"weights": name, "dtype": str(dtype).replace("torch.", ""), "rows": rows, **m}
                    out["rows"].append(row)
                    print(f"{name} {row['dtype']} rows {rows}: mm {m['mm_ms']['value']:.2f} ms, packed "
                          f"{m['packed_ms']['value']:.2f} ms, ratio {m['ratio']['value']:.2f}", flush=True)
            del sets
    out["load_end"] = os.getloadavg()[0]
    md = to_markdown(out)
    print("\n" + md)
    if a.out:
        stamp = time.strftime("%Y%m%d-%H%M")
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"cpu-linear-{stamp}.json"), "w") as f:
            json.dump(out, f, indent=1)
        with open(os.path.join(a.out, f"cpu-linear-{stamp}.md"), "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
