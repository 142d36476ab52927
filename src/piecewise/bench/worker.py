"""One benchmark measurement in a fresh process; prints one JSON line.

Systems: ``eager``; ``full`` (``torch.compile(fullgraph=True)`` with Inductor, the dynamic dim marked,
what users would pick instead); ``piecewise-inductor``; ``piecewise-eager``. The caller sets
``TORCHINDUCTOR_CACHE_DIR`` / ``PIECEWISE_CACHE_DIR`` to decide cold or warm.

Measured: time to first output (construction excluded), the compile phase inside it (measured
directly, see `compile_phase`), the eager first call of the same model in the same process,
steady-state step latency per batch size (median, p10, p90 over `--steps` calls with fresh
inputs), recompiles across distinct sizes, and this process's peak resident memory.

``--system paired`` measures a ratio instead of two absolute figures: both systems of ``--pair``
(default ``full,piecewise-inductor``) are built in one process from the same weights and called in
turns on the same fresh inputs, the order swapped every step (A B, B A, A B, ...), so a slow spell of
the machine or of this process lands on both. Separate processes of one system differ by up to 2x in
median step on a shared 2-core host (the `suite`'s steady-state rows show it); a ratio of figures
from two processes carries that noise, a ratio of one paired process does not.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch

from .._torch import dynamo


def _model(layers: int):
    from piecewise.serving import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_layers=layers, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                      head_dim=32, max_num_seqs=64, max_seq_len=64)
    return cfg, LlamaForCausalLM(cfg, seed=0)


def _inputs(cfg, n: int, gen: torch.Generator):
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    pos = torch.randint(0, cfg.max_seq_len, (n,), generator=gen)
    seq = torch.arange(n) % cfg.max_num_seqs
    return ids, pos, seq


def _compiled(system: str, model, max_tokens: int):
    if system == "eager":
        return model
    if system == "full":
        fn = torch.compile(model, backend="inductor", fullgraph=True, dynamic=None)
        first = [True]

        def call(ids, pos, seq):
            if first[0]:  # mark the token dim dynamic once, as a user would on the first batch
                for t in (ids, pos, seq):
                    dynamo.mark_dynamic(t, 0)
                first[0] = False
            return fn(ids, pos, seq)

        return call
    import piecewise as pw

    backend = system.split("-", 1)[1]
    # piecewise-partition: Inductor partitions the whole graph at the splitting ops (split_strategy)
    fields = dict(backend="inductor", split_strategy="inductor_partition") if backend == "partition" else dict(backend=backend)
    return pw.compile(model, pw.CompilationConfig(**fields, max_num_tokens=max_tokens, tag=f"bench_{backend}"),
                      dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})


def _dynamo_seconds(key: str) -> float | None:
    """Total seconds Dynamo's `dynamo_timed` recorded under `key` in this process (None: never entered)."""
    runs = dynamo.compilation_time_metrics.get(key)
    return None if runs is None else float(sum(runs))


def compile_phase(system: str, fn) -> tuple[float, str]:
    """Seconds the first call spent tracing, loading and compiling, measured directly, and how.

    * ``full``: Dynamo's own timer around the frame compile (``_compile.compile_inner``: trace, AOT,
      Inductor or its cache, guards) - the first call's execution is outside it.
    * ``piecewise-*``: `CompiledModel.timings`: ``bundle_load`` (warm start from the bundle: key,
      decode, guards, artifact loads; or the failed lookup before a trace) plus the Dynamo trace with
      split and piece compiles (Dynamo's timer ``piecewise_trace``, which holds ``split``,
      ``compile`` and ``cache_load``). Saving the bundle and the first execution are outside it.
    * ``eager``: 0 (nothing is compiled).
    """
    if system == "eager":
        return 0.0, "none"
    if system == "full":
        s = _dynamo_seconds("_compile.compile_inner")
        if s is None:
            raise RuntimeError("torch._dynamo recorded no '_compile.compile_inner' time for the full-graph compile")
        return s, "dynamo _compile.compile_inner"
    t = fn.timings
    traced = _dynamo_seconds("piecewise_trace") or 0.0
    if traced == 0.0 and t.get("dynamo", 0.0) > 0.0:  # a trace happened but Dynamo's timer did not record it
        raise RuntimeError("torch._dynamo recorded no 'piecewise_trace' time for a traced first call")
    return t.get("bundle_load", 0.0) + traced, "timings bundle_load + dynamo piecewise_trace"


def dispatch_overhead(layers: int = 16, calls: int = 3000) -> dict:
    """Per-piece cost of piecewise dispatch, with compute made negligible: a toy transformer of
    width 4 at one token, eager vs piecewise with eager pieces, calls interleaved (A, B, A, B...)
    so machine noise hits both alike; medians of per-call times."""
    import piecewise as pw
    from piecewise.testing.toy import ToyTransformer

    model = ToyTransformer(num_layers=layers, dim=4)
    cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=8, tag="bench_dispatch"),
                    dynamic_arg_dims={"x": 0})
    x = torch.randn(1, 4)
    cm(x)
    ta, tb = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        model(x)
        t1 = time.perf_counter()
        cm(x)
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    pieces = len(cm.backend.split.items)
    eager_us, pw_us = statistics.median(ta) * 1e6, statistics.median(tb) * 1e6
    # The stitching cost of one piece: its runner (entry lookup + call) against calling the
    # compiled callable directly, on the arguments the piece really receives.
    split_gm = cm.backend.split.split_module
    runner = cm.backend.runners[1]
    seen: list[tuple] = []
    split_gm.__dict__[runner.name] = lambda *a: (seen.append(a), runner(*a))[1]
    cm(x)
    split_gm.__dict__[runner.name] = runner
    args, direct = seen[0], runner.callables[runner.state.entry]
    tr, td = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        runner(*args)
        t1 = time.perf_counter()
        direct(*args)
        t2 = time.perf_counter()
        tr.append(t1 - t0)
        td.append(t2 - t1)
    return {"system": "dispatch", "layers": layers, "pieces": pieces, "eager_us": eager_us, "piecewise_eager_us": pw_us,
            "model_delta_us_per_piece": (pw_us - eager_us) / pieces,
            "us_per_piece": (statistics.median(tr) - statistics.median(td)) * 1e6}


def replay_overhead(layers: int = 16, calls: int = 3000) -> dict:
    """Python cost of the graph-replay path per piece, on the CPU: a graph platform whose replay
    does nothing (so what is timed is piecewise's own work: forward-context lookup, entry lookup,
    the address check's fast path, copies of non-stable inputs, the replay count), a toy
    transformer of width 4 at one token. A captured piece's wrapper is timed against calling its
    graph's ``replay()`` directly, interleaved; medians of per-call times. Issue 15's target for
    this figure is 3 us a piece."""
    import piecewise as pw
    from piecewise.forward_context import BatchDescriptor, ForwardContext, RuntimeMode, enter_forward, exit_forward
    from piecewise.graphs.platform import GraphPlatform, register_platform
    from piecewise.testing.toy import ToyTransformer

    class _NullGraph:
        def replay(self) -> None:
            pass

    class _NullPlatform(GraphPlatform):
        name = "null"

        def new_graph(self):
            return _NullGraph()

        def new_pool(self):
            return object()

        def capture(self, graph, pool, fn, args, *, flush):
            return fn(*args)

        def synchronize(self) -> None:
            pass

        def memory_allocated(self) -> int:
            return 0

    with register_platform("cpu", _NullPlatform):
        model = ToyTransformer(num_layers=layers, dim=4)
        cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=8, cudagraph_capture_sizes=[1],
                                                    tag="bench_replay"), dynamic_arg_dims={"x": 0})
        x = torch.randn(1, 4)
        cm(x)
        cm(x)  # captured: every compiled piece now replays
        wrapper = cm.backend.stitched_wrappers[1]
        seen: list[tuple] = []
        split_gm = cm.backend.split.split_module
        split_gm.__dict__[wrapper.name] = lambda *a: (seen.append(a), wrapper(*a))[1]
        cm(x)
        split_gm.__dict__[wrapper.name] = wrapper
        args, graph = seen[0], wrapper.entries[1].graph
        tw, tg = [], []
        token = enter_forward(ForwardContext(1, 1, RuntimeMode.PIECEWISE, BatchDescriptor(1), "bench_replay"))
        try:
            for _ in range(calls):
                t0 = time.perf_counter()
                wrapper(*args)
                t1 = time.perf_counter()
                graph.replay()
                t2 = time.perf_counter()
                tw.append(t1 - t0)
                tg.append(t2 - t1)
        finally:
            exit_forward(token)
            wrapper.runner.flush_replays()
    return {"system": "replay", "layers": layers, "pieces": len(cm.backend.runners),
            "us_per_piece": (statistics.median(tw) - statistics.median(tg)) * 1e6,
            "p90_us_per_piece": (sorted(tw)[int(0.9 * calls)] - statistics.median(tg)) * 1e6}


def _steady(fn, cfg, b: int, steps: int, gen: torch.Generator) -> dict[str, float]:
    """Median/p10/p90 microseconds of ``fn`` over `steps` calls of `b` tokens, fresh inputs each call."""
    xs = [_inputs(cfg, b, gen) for _ in range(steps + 5)]
    for x in xs[:5]:
        fn(*x)
    times = []
    for x in xs[5:]:
        t0 = time.perf_counter()
        fn(*x)
        times.append((time.perf_counter() - t0) * 1e6)
    return _percentiles(times)


def _percentiles(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10], "p90_us": times[(len(times) * 9) // 10]}


def paired_steady(pair: tuple[str, str], layers: int, batches: list[int], steps: int, sizes: int) -> dict:
    """Both systems of `pair` in this process, same weights (seed 0), called in turns on the same
    fresh inputs with the order swapped every step; per batch size each one's median/p10/p90
    microseconds and ``ratio`` = median of the second / median of the first. Before timing, each
    system sees every size 1..`sizes` once (its compiles and captures happen there)."""
    gen = torch.Generator().manual_seed(0)
    fns = []
    for system in pair:
        cfg, model = _model(layers)
        fns.append(_compiled(system, model, max(64, sizes)))
    for n in range(1, max(sizes, max(batches)) + 1):
        x = _inputs(cfg, n, gen)
        for fn in fns:
            fn(*x)
    lat: dict[str, dict[int, dict[str, float]]] = {s: {} for s in pair}
    ratio = {}
    for b in batches:
        xs = [_inputs(cfg, b, gen) for _ in range(steps + 5)]
        for x in xs[:5]:
            for fn in fns:
                fn(*x)
        times: list[list[float]] = [[], []]
        for i, x in enumerate(xs[5:]):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                fns[k](*x)
                times[k].append((time.perf_counter() - t0) * 1e6)
        for k, system in enumerate(pair):
            lat[system][b] = _percentiles(times[k])
        ratio[b] = lat[pair[1]][b]["median_us"] / lat[pair[0]][b]["median_us"]
    return {"system": "paired", "pair": list(pair), "layers": layers, "steps": steps, "latency": lat, "ratio": ratio}


def main() -> int:
    ap = argparse.ArgumentParser()
    systems = ["eager", "full", "piecewise-inductor", "piecewise-partition", "piecewise-eager"]
    ap.add_argument("--system", required=True, choices=[*systems, "dispatch", "replay", "paired"])
    ap.add_argument("--pair", default="full,piecewise-inductor", help="with --system paired: baseline,system")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=0, help="steady-state steps per batch size (0: skip)")
    ap.add_argument("--sizes", type=int, default=0, help="also run this many distinct sizes and count recompiles")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.system == "dispatch":
        print(json.dumps(dispatch_overhead()))
        return 0
    if args.system == "replay":
        print(json.dumps(replay_overhead()))
        return 0
    if args.system == "paired":
        pair = tuple(args.pair.split(","))
        if len(pair) != 2 or not set(pair) <= set(systems):
            ap.error(f"--pair {args.pair!r}: give two of {', '.join(systems)}, comma-separated")
        print(json.dumps(paired_steady(pair, args.layers, [int(s) for s in args.batches.split(",")], args.steps or 200,
                                       args.sizes)))
        return 0
    gen = torch.Generator().manual_seed(0)
    cfg, model = _model(args.layers)
    max_tokens = max(64, args.sizes)

    # eager first call of this model in this process: what a compile-free start costs
    x = _inputs(cfg, 8, gen)
    t0 = time.perf_counter()
    model(*x)
    eager_first = time.perf_counter() - t0

    fn = _compiled(args.system, model, max_tokens)
    x = _inputs(cfg, 8, gen)
    t0 = time.perf_counter()
    fn(*x)
    first = time.perf_counter() - t0
    compile_s, method = compile_phase(args.system, fn)
    # compile_s is measured directly (never a difference of two wall times, never clamped); the
    # rest of the first call (its execution, lazy imports, saving the bundle) is first - compile_s
    out = {"system": args.system, "layers": args.layers, "first_output_s": first, "eager_first_s": eager_first,
           "compile_s": compile_s, "compile_method": method, "first_rest_s": first - compile_s}

    import piecewise as pw

    if args.sizes:
        dyn0 = dynamo.compiled_frames()
        before = pw.counters.snapshot()
        for n in range(1, args.sizes + 1):
            fn(*_inputs(cfg, n, gen))
        d = pw.counters.delta_since(before)
        out["recompiles"] = (dynamo.compiled_frames() - dyn0) + d.get("recompiles", 0) + d.get("graphs_seen", 0)
    if args.steps:
        lat = {}
        for b in [int(s) for s in args.batches.split(",")]:
            lat[b] = _steady(fn, cfg, b, args.steps, gen)
        out["latency"] = lat
    if args.system.startswith("piecewise"):
        out["pieces"] = len(fn.backend.split.items) if fn.backend else 0
        out["counters"] = {k: v for k, v in pw.counters.snapshot().items() if v}
        out["timings"] = fn.timings
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
