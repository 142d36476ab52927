"""Markdown tables of the latest benchmark results, read from ``benchmarks/results/*.json``.

The documentation site renders these at build time (``scripts/mkdocs_hooks.py``), and the README's
headline table is this script's ``headline`` table (``tests/test_docs.py`` checks that it is
current; ``python scripts/bench_tables.py --write-readme`` rewrites it). History stays in the JSON
files: only the latest run of each benchmark is shown, and no table carries a date.

    python scripts/bench_tables.py [TABLE ...]     # print tables (default: every table)
    python scripts/bench_tables.py --write-readme  # refresh the README's headline table

Standalone: reads JSON only, imports neither torch nor piecewise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
README = os.path.join(ROOT, "README.md")
#: the README's generated table sits between these two lines
BEGIN, END = "<!-- bench:headline -->", "<!-- /bench:headline -->"

#: files of each benchmark; the latest run is chosen as `_latest` says
SUITE = "bench-*.json"  # `piecewise bench` / benchmarks/run.py; latest.json is a copy of the newest
GENERATION_CPU = "generation-latest.json"  # python -m piecewise.bench.generation
GPU_GENERATION = "gpu-*-generation.json"  # ... --device cuda
GPU_DECODE = "gpu-*-decode*.json"  # python -m piecewise.bench.gpu_decode
GPU_OVERHEAD = "gpu-*-overhead.json"  # python -m piecewise.bench.overhead
FLEET = "fleet.json"  # python -m piecewise.bench.fleet
VLLM_CPU = "vllm-cpu-*.json"  # make bench-vllm (benchmarks/vllm_cpu.py)
CPU_LINEAR = "cpu-linear-*.json"  # benchmarks/cpu_linear_kernels.py
GENERATION_BUSY = "generation-busy-*.json"  # python -m piecewise.bench.generation --busy-rounds N


# -- reading ----------------------------------------------------------------------------------------

def _load(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _latest(pattern: str, results: str = RESULTS) -> tuple[str, Any] | None:
    """The latest run among the files matching `pattern`: by the date the suite records in its
    ``machine`` block where there is one, else by file name (names carry a sortable timestamp)."""
    paths = sorted(glob.glob(os.path.join(results, pattern)))
    if not paths:
        return None
    loaded = [(p, _load(p)) for p in paths]
    dated = [(d["machine"]["date"], p, d) for p, d in loaded if isinstance(d, dict) and isinstance(d.get("machine"), dict)
             and "date" in d["machine"]]
    if dated:
        _, p, d = max(dated)
        return p, d
    return loaded[-1]


# -- formatting -------------------------------------------------------------------------------------

def spread(values: list[float]) -> dict[str, Any]:
    vals = [float(v) for v in values if v == v]
    if not vals:
        nan = float("nan")
        return {"value": nan, "min": nan, "max": nan, "runs": [], "noisy": False}
    value, lo, hi = statistics.median(vals), min(vals), max(vals)
    return {"value": value, "min": lo, "max": hi, "runs": vals, "noisy": hi - lo > abs(value)}


def fig(f: dict[str, Any] | None, digits: int = 2) -> str:
    """``value (min–max)`` of a figure with its spread (``noisy`` when the spread exceeds it)."""
    if not f or f["value"] != f["value"]:
        return "-"
    fmt = lambda x: f"{x:.{digits}f}"  # noqa: E731
    notes = []
    if len(f.get("runs", [])) > 1:
        notes.append(f"{fmt(f['min'])}{' to ' if f['min'] < 0 else '–'}{fmt(f['max'])}")
    if f.get("noisy"):
        notes.append("noisy")
    return f"{fmt(f['value'])} ({', '.join(notes)})" if notes else fmt(f["value"])


def num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "".join("l" if i < 1 else "r" for i in range(len(header)))
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _machine(m: dict[str, Any]) -> str:
    cpus = m.get("cpus", "?")
    return (f"{cpus} CPUs ({m.get('processor', '?')}), torch {m.get('torch', '?')}, {m.get('threads', '?')} threads; "
            f"load average {m.get('load_start', 0):.1f} at the start and {m.get('load_end', 0):.1f} at the end of the run")


# -- the suite: reference decoder against torch.compile ---------------------------------------------

def _suite() -> dict[str, Any] | None:
    found = _latest(SUITE) or _latest("latest.json")
    return None if found is None else found[1]


def suite_startup() -> str:
    r = _suite()
    if r is None:
        return "No suite results.\n"
    rows = []
    for s in r["summary"]["startup"]:
        rows.append([str(s["layers"]), fig(s["cold_full_s"]), fig(s["cold_pw_s"]), fig(s["cold_ratio"]),
                     fig(s["warm_full_s"]), fig(s["warm_pw_s"]), fig(s["warm_first_ratio"]),
                     fig(s["warm_compile_ratio"])])
    return (f"Machine: {_machine(r['machine'])}.\n\n"
            + table(["layers", "full graph cold s", "piecewise cold s", "cold ratio", "full graph warm first output s",
                     "piecewise warm first output s", "warm first-output ratio", "warm compile-phase ratio"], rows))


def suite_paired() -> str:
    r = _suite()
    if r is None:
        return "No suite results.\n"
    rows = []
    for p in r["summary"]["paired"]:
        rows.append([str(p["batch"]), fig(p["base_us"], 0), fig(p["system_us"], 0), fig(p["ratio"]),
                     ", ".join(num(x) for x in p["ratio"]["runs"])])
    return table(["batch", "full graph us", "piecewise us", "piecewise / full graph", "every round"], rows, "rrrrl")


def suite_steady() -> str:
    r = _suite()
    if r is None:
        return "No suite results.\n"
    rows = []
    for s in r["summary"]["steady"]:
        def lat(system: str) -> str:
            x = s.get(system)
            return "-" if not x else f"{x['median_us']:.0f} ({x['p10_us']:.0f}-{x['p90_us']:.0f})"
        rows.append([str(s["batch"]), lat("eager"), lat("full"), lat("piecewise-inductor"), lat("piecewise-eager"),
                     fig(s.get("pw_vs_full")), fig(s.get("pw_vs_eager"))])
    return table(["batch", "eager us", "full graph us", "piecewise (Inductor) us", "piecewise (eager pieces) us",
                  "piecewise / full graph", "piecewise / eager"], rows)


def suite_partition() -> str:
    r = _suite()
    if r is None or not r["summary"].get("partition_startup"):
        return "No split-strategy results.\n"
    rows = []
    fx = {s["layers"]: s for s in r["summary"]["startup"]}
    for s in r["summary"]["partition_startup"]:
        rows.append([str(s["layers"]), fig(fx[s["layers"]]["cold_pw_s"]), fig(s["cold_s"]), fig(s["cold_vs_fx"]),
                     fig(fx[s["layers"]]["warm_pw_s"]), fig(s["warm_s"]), fig(s["warm_vs_fx"])])
    start = table(["layers", "FX split cold s", "partition cold s", "partition / FX split", "FX split warm first output s",
                   "partition warm first output s", "partition / FX split"], rows)
    rows = []
    for s in r["summary"]["steady"]:
        fxs, part = s.get("piecewise-inductor"), s.get("piecewise-partition")
        if not fxs or not part:
            continue
        rows.append([str(s["batch"]), f"{fxs['median_us']:.0f}", f"{part['median_us']:.0f}",
                     fig(s.get("partition_vs_fx")), fig(s.get("partition_vs_full"))])
    steady = table(["batch", "FX split us", "partition us", "partition / FX split", "partition / full graph"], rows)
    return start + "\n" + steady


def suite_overheads() -> str:
    r = _suite()
    if r is None:
        return "No suite results.\n"
    rec = r["summary"]["recompiles"]
    rows = [["dispatch, per piece (a piece's runner against its compiled callable called directly)",
             f"{r['dispatch']['us_per_piece']:.2f} us"],
            ["graph-replay path, per piece (wrapper against a bare replay, on a platform whose replay does nothing)",
             f"{r['replay']['us_per_piece']:.2f} us (p90 {r['replay']['p90_us_per_piece']:.2f} us)"],
            [f"recompiles across {r['config']['sizes']} distinct sizes",
             ", ".join(f"{k} {v}" for k, v in rec.items())]]
    out = table(["figure", "value"], rows, "lr")
    pad = r.get("padding")
    if pad:
        out += "\n" + table(["capture schedule", "graphs", "pad rows", "pad share"],
                            [[k, str(v["graphs"]), f"{v['pad_rows']:.0f}", f"{v['pad_fraction']:.4f}"] for k, v in pad.items()],
                            "lrrr")
    return out


# -- generation on real weights (CPU) ----------------------------------------------------------------

def _generation(pattern: str = GENERATION_CPU) -> list[dict[str, Any]] | None:
    found = _latest(pattern)
    return None if found is None else [r for r in found[1] if "error" not in r]


def _decode_ratios(rows: list[dict[str, Any]], system: str, batch: int, phase: str, base: str) -> dict[str, Any]:
    mine = {r.get("round", 0): r for r in rows if (r["system"], r["batch"], r.get("phase")) == (system, batch, phase)}
    ref = {r.get("round", 0): r for r in rows if (r["system"], r["batch"], r.get("phase")) == (base, batch, phase)}
    return spread([ref[k]["decode_tok_s"] / mine[k]["decode_tok_s"] for k in mine if k in ref and mine[k]["decode_tok_s"]])


def generation_cpu() -> str:
    rows = _generation()
    if not rows:
        return "No generation results.\n"
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        for system in ("hf_eager", "hf_compile_static", "pw_generate", "pw_engine"):
            warm = [r for r in rows if (r["system"], r["batch"], r.get("phase")) == (system, batch, "warm")]
            cold = [r for r in rows if (r["system"], r["batch"], r.get("phase")) == (system, batch, "cold")]
            if not warm:
                continue
            base = {r.get("round", 0): r for r in rows
                    if (r["system"], r["batch"], r.get("phase")) == ("hf_compile_static", batch, "warm")}
            ttft = spread([r["first_ttft_s"] / base[r.get("round", 0)]["first_ttft_s"] for r in warm if r.get("round", 0) in base])
            out.append([str(batch), SYSTEMS.get(system, system), num(cold[0]["first_ttft_s"]) if cold else "-",
                        fig(spread([r["first_ttft_s"] for r in warm])), fig(ttft),
                        fig(spread([r["decode_tok_s"] for r in warm]), 1), str(max(r["recompiles"] for r in warm + cold))])
    text = table(["batch", "system", "cold process: first token s", "warm process: first token s",
                  "warm first token / recipe", "decode tokens/s per sequence", "recompiles"], out, "rlrrrrr")
    paired = [r for r in rows if r.get("phase") == "paired"]
    if paired:
        prow = []
        for r in paired:
            for system, steps in r["step_s"].items():
                ratios = r["ratio"].get(system)
                prow.append([str(r["batch"]), SYSTEMS.get(system, system), fig(spread([s * 1e3 for s in steps]), 1),
                             fig(spread(ratios)) if ratios else "1", ", ".join(num(x) for x in ratios) if ratios else "-",
                             str(r["recompiles"][system])])
        text += ("\nDecode step measured paired (every system in one process, taking turns on the same prompts):\n\n"
                 + table(["batch", "system", "decode step ms", "vs recipe", "every round", "recompiles"], prow, "rlrrlr"))
    return text


def generation_busy() -> str:
    """The latest busy-host run: the decode step quiet and with another process spinning on one
    core, per thread count, each busy step over its quiet one and over eager's."""
    found = _latest(GENERATION_BUSY)
    rows = [r for r in (found[1] if found else []) if r.get("phase") == "busy"]
    if not rows:
        return "No busy-host results.\n"
    out = []
    for r in rows:
        threads = f"{r['threads']} ({r.get('threads_from', '?')})"
        for system, quiet in r["step_s"]["quiet"].items():
            busy = r["step_s"]["busy"][system]
            vs_eager = r["vs_eager"]["busy"].get(system)
            out.append([str(r["batch"]), threads, SYSTEMS.get(system, system), fig(spread([x * 1e3 for x in quiet]), 1),
                        fig(spread([x * 1e3 for x in busy]), 1), fig(spread(r["busy_vs_quiet"][system])),
                        fig(spread(vs_eager)) if vs_eager else "1"])
    return table(["batch", "threads", "system", "quiet step ms", "busy step ms", "busy / quiet", "vs eager, busy"],
                 out, "rllrrrr")


SYSTEMS = {
    "hf_eager": "transformers eager",
    "hf_compile_static": "recipe: static cache + torch.compile",
    "pw_generate": "piecewise generate()",
    "pw_engine": "piecewise engine",
}


# -- GPU ------------------------------------------------------------------------------------------

def gpu_generation() -> str:
    found = _latest(GPU_GENERATION)
    if found is None:
        return "No GPU generation results.\n"
    rows = [r for r in found[1] if "error" not in r and r.get("phase") in ("cold", "warm")]
    dev = next((r.get("device_name", r["device"]) for r in rows), "?")
    torch_v = next((r.get("torch", "?") for r in rows), "?")
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        for phase in ("cold", "warm"):
            base = next((r for r in rows if (r["system"], r["batch"], r["phase"]) == ("hf_compile_static", batch, phase)), None)
            for r in rows:
                if (r["batch"], r["phase"]) != (batch, phase):
                    continue
                step = 1e3 / r["decode_tok_s"] if r["decode_tok_s"] else float("nan")
                ratio = base["decode_tok_s"] / r["decode_tok_s"] if base and r["decode_tok_s"] else float("nan")
                out.append([str(batch), SYSTEMS.get(r["system"], r["system"]), phase, num(r["first_ttft_s"]),
                            num(r["first_total_s"]), num(step), num(ratio), str(r["recompiles"])])
    return (f"{dev}, torch {torch_v}: a SmolLM2-shaped model (30 layers) with random weights, bfloat16, 128-token "
            "prompts, 64 new tokens; one process per system serves batch 1 and then batch 8; decode figures are the "
            "second `generate()` of each batch in that process.\n\n"
            + table(["batch", "system", "process", "first generate(): first token s", "first generate(): whole s",
                     "then: decode ms a step", "decode vs recipe", "recompiles"], out, "rllrrrrr"))


def gpu_decode() -> str:
    found = _latest(GPU_DECODE)
    if found is None:
        return "No GPU decode-step results.\n"
    d = found[1]
    systems = list(d["step_us"])
    batches = list(next(iter(d["step_us"].values())))
    rows = []
    for b in batches:
        med = {s: d["step_us"][s][b][0] for s in systems}
        base = med.get("compile reduce-overhead")
        rows.append([b] + [f"{med[s]:.0f}" for s in systems]
                    + ([num(med[s] / base) for s in systems if s.startswith("piecewise")] if base else []))
    ratios = [f"{s} / reduce-overhead" for s in systems if s.startswith("piecewise")] if "compile reduce-overhead" in systems else []
    return (f"{d.get('device', '?')}, torch {d.get('torch', '?')}: reference decoder, {d.get('layers', '?')} layers, "
            f"bfloat16; median microseconds of {d.get('steps', '?')} decode steps.\n\n"
            + table(["batch"] + [f"{s} us" for s in systems] + ratios, rows))


def gpu_overhead() -> str:
    found = _latest(GPU_OVERHEAD)
    if found is None:
        return "No GPU overhead results.\n"
    d = found[1]
    rows = [[name, f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})"] for name, v in d["systems"].items()]
    rows.append(["piecewise graphs over one full graph, per layer", f"{d['per_layer_us']:.1f}"])
    return (f"{d.get('layers', '?')} layers of a {d.get('hidden', '?')}-wide Linear and a splitting op that only "
            f"copies, batch {d.get('batch', '?')}, {str(d.get('dtype', '?')).replace('torch.', '')}; microseconds a "
            "forward, median (min-max) of round medians.\n\n" + table(["system", "us"], rows, "lr"))


# -- fleet ------------------------------------------------------------------------------------------

def fleet() -> str:
    found = _latest(FLEET)
    if found is None:
        return "No fleet results.\n"
    d = found[1]
    rows = [["compiler invocations, one process alone", str(d["alone_invocations"])],
            [f"compiler invocations, {d['procs']} processes together (per process)", str(d["fleet_invocations"])],
            ["processes that waited for another's compile lease", str(d["fleet_remote_waits"])],
            [f"wall time to the last first output: one alone / {d['procs']} together s",
             f"{d['alone_wall_s']:.1f} / {d['fleet_wall_s']:.1f}"],
            ["warm first output, entries on local disk s", fig(d["warm_local_s"])],
            ["warm first output, entries in Redis only s", fig(d["warm_remote_s"])],
            ["Redis / local disk", fig(d["warm_ratio"])]]
    return (f"Reference decoder, {d['layers']} layers, Inductor pieces, signed entries; {d['rounds']} interleaved rounds "
            "for the warm figures.\n\n" + table(["figure", "value"], rows, "lr"))


def _benchmark_module(name: str) -> Any:
    """``benchmarks/<name>.py`` loaded standalone (its top level imports neither torch nor vLLM)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_bench", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_cpu() -> str:
    """The latest `make bench-vllm` run: its summary and per-round ratio tables as the benchmark
    script renders them (the per-process rows stay in the JSON and the run's .md)."""
    found = _latest(VLLM_CPU)
    if found is None:
        return "No results of `make bench-vllm` committed yet.\n"
    text = _benchmark_module("vllm_cpu").to_markdown(found[1])
    return text.split("\nEvery process")[0].rstrip() + "\n"


def cpu_linear() -> str:
    """The latest ``benchmarks/cpu_linear_kernels.py`` run: mm against the packed kernel per dtype and rows."""
    found = _latest(CPU_LINEAR)
    if found is None:
        return "No results of `benchmarks/cpu_linear_kernels.py` committed yet.\n"
    return _benchmark_module("cpu_linear_kernels").to_markdown(found[1])


# -- the headline (README) ----------------------------------------------------------------------------

def headline() -> str:
    """One row per headline figure: what, the alternative, piecewise against it (below 1 is faster)."""
    rows = []
    r = _suite()
    if r is not None:
        paired = {p["batch"]: p for p in r["summary"]["paired"]}
        rows.append(["steady-state step, reference decoder, CPU (batch " + " / ".join(str(b) for b in paired) + ")",
                     "`torch.compile` full graph", " / ".join(num(p["ratio"]["value"]) for p in paired.values())])
        big = max(r["summary"]["startup"], key=lambda s: s["layers"])
        rows.append([f"cold start to first output, {big['layers']} layers", "`torch.compile` full graph",
                     num(big["cold_ratio"]["value"])])
        rows.append([f"warm start to first output, {big['layers']} layers", "`torch.compile` full graph",
                     num(big["warm_first_ratio"]["value"])])
        rec = r["summary"]["recompiles"]
        rows.append([f"recompiles over {r['config']['sizes']} distinct sizes", "`torch.compile` full graph",
                     f"{rec.get('piecewise-inductor', '?')} against {rec.get('full', '?')}"])
    gen = _generation()
    if gen:
        paired = [p for p in gen if p.get("phase") == "paired"]
        if paired:
            rows.append(["decode step, SmolLM2-135M, CPU (batch " + " / ".join(str(p["batch"]) for p in paired) + ")",
                         "transformers static cache + `torch.compile`",
                         " / ".join(num(spread(p["ratio"]["pw_generate"])["value"]) for p in paired)])
        ttft = []
        for b in sorted({x["batch"] for x in gen if x.get("phase") == "warm"}):
            base = {x.get("round", 0): x for x in gen if (x["system"], x["batch"], x.get("phase")) == ("hf_compile_static", b, "warm")}
            mine = [x for x in gen if (x["system"], x["batch"], x.get("phase")) == ("pw_generate", b, "warm")]
            ttft.append((b, spread([x["first_ttft_s"] / base[x.get("round", 0)]["first_ttft_s"] for x in mine
                                    if x.get("round", 0) in base])["value"]))
        if ttft:
            rows.append(["warm start to first token, SmolLM2-135M, CPU (batch " + " / ".join(str(b) for b, _ in ttft) + ")",
                         "transformers static cache + `torch.compile`", " / ".join(num(v) for _, v in ttft)])
    found = _latest(GPU_GENERATION)
    if found is not None:
        g = [x for x in found[1] if "error" not in x and x.get("phase") == "warm"]
        ratios = []
        for b in sorted({x["batch"] for x in g}):
            base = next((x for x in g if (x["system"], x["batch"]) == ("hf_compile_static", b)), None)
            mine = next((x for x in g if (x["system"], x["batch"]) == ("pw_generate", b)), None)
            if base and mine and mine["decode_tok_s"]:
                ratios.append((b, base["decode_tok_s"] / mine["decode_tok_s"]))
        dev = next((x.get("device_name", "GPU") for x in g), "GPU")
        if ratios:
            rows.append([f"decode step, SmolLM2-shaped, {dev} (batch " + " / ".join(str(b) for b, _ in ratios) + ")",
                         "transformers static cache + `torch.compile`", " / ".join(num(v) for _, v in ratios)])
    return table(["figure", "against", "piecewise / alternative"], rows, "llr")


TABLES: dict[str, Callable[[], str]] = {
    "headline": headline,
    "suite-startup": suite_startup,
    "suite-paired": suite_paired,
    "suite-steady": suite_steady,
    "suite-partition": suite_partition,
    "suite-overheads": suite_overheads,
    "generation-cpu": generation_cpu,
    "gpu-generation": gpu_generation,
    "gpu-decode": gpu_decode,
    "gpu-overhead": gpu_overhead,
    "fleet": fleet,
    "vllm-cpu": vllm_cpu,
    "cpu-linear": cpu_linear,
    "generation-busy": generation_busy,
}


def readme_with_headline(text: str) -> str:
    """`text` (the README) with the block between `BEGIN` and `END` replaced by `headline()`."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + headline() + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="*", choices=[[], *TABLES], help="tables to print (default: all)")
    p.add_argument("--write-readme", action="store_true", help="rewrite the README's headline table in place")
    a = p.parse_args(argv)
    if a.write_readme:
        with open(README) as f:
            text = f.read()
        with open(README, "w") as f:
            f.write(readme_with_headline(text))
        return 0
    for name in a.tables or TABLES:
        print(f"## {name}\n\n{TABLES[name]()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
