import json
import os
import subprocess
import sys

from piecewise.bench.suite import BenchConfig, _median_run, summarize, to_markdown


def _worker(*args):
    p = subprocess.run([sys.executable, "-m", "piecewise.bench.worker", *args], capture_output=True, text=True,
                       env={**os.environ})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_worker_measures_and_counts_no_recompiles():
    eager = _worker("--system", "eager", "--layers", "1", "--steps", "5", "--batches", "1,4", "--sizes", "8")
    pw = _worker("--system", "piecewise-eager", "--layers", "1", "--steps", "5", "--batches", "1,4", "--sizes", "8")
    assert pw["recompiles"] == 0 and pw["pieces"] == 3
    for r in (eager, pw):
        assert set(r["latency"]) == {"1", "4"} and r["latency"]["4"]["median_us"] > 0
        assert r["first_output_s"] > 0 and r["peak_rss_mb"] > 0
    # the summary and table use the same figures, as ratios
    fake_full = {**pw, "system": "full"}
    res = {"machine": {"platform": "p", "cpus": 2, "processor": "x", "torch": "t", "threads": 2, "date": "d"},
           "config": {"steady_layers": 1, "steps": 5, "sizes": 8}, "targets": {
               "steady_vs_full": 1.05, "dispatch_us_per_piece": 5.0, "cold_compile_vs_full_at_max_layers": 0.6,
               "warm_compile_vs_full_warm": 0.25, "recompiles": 0},
           "startup": {"full/1": {"cold": fake_full, "warm": fake_full}, "piecewise-inductor/1": {"cold": pw, "warm": pw, "warm_traced": pw}},
           "steady": {"eager": eager, "full": fake_full, "piecewise-inductor": pw, "piecewise-eager": pw}}
    from piecewise.bench.suite import padding_waste_report
    from piecewise.bench.worker import dispatch_overhead

    res["dispatch"] = dispatch_overhead(layers=2, calls=200)
    assert res["dispatch"]["pieces"] == 5 and res["dispatch"]["us_per_piece"] < 1000
    res["padding"] = padding_waste_report(max_size=64)
    assert res["padding"]["planned"]["pad_rows"] <= res["padding"]["default"]["pad_rows"]
    res["summary"] = summarize(res, BenchConfig(layers=(1,), batches=(1, 4)))
    d = res["summary"]["dispatch"][1]
    assert abs(d["us_per_piece"] - (pw["latency"]["4"]["median_us"] - eager["latency"]["4"]["median_us"]) / 3) < 1e-6
    md = to_markdown(res)
    assert "| 4 |" in md and "Dispatch overhead per piece" in md and "| planned |" in md and "traced" in md
    runs = [{"compile_s": c} for c in (3.0, 1.0, 2.0)]
    assert _median_run(runs)["compile_s"] == 2.0 and _median_run(runs)["compile_s_runs"] == [3.0, 1.0, 2.0]


def test_steady_state_of_several_processes_is_the_median_process_per_batch():
    from piecewise.bench.suite import _median_latency

    def run(b1, b8, recompiles=0):
        return {"system": "s", "recompiles": recompiles,
                "latency": {"1": {"median_us": b1, "p10_us": b1 - 1, "p90_us": b1 + 1},
                            "8": {"median_us": b8, "p10_us": b8 - 1, "p90_us": b8 + 1}}}

    out = _median_latency([run(30, 5), run(10, 9, recompiles=1), run(20, 7)])
    assert out["latency"]["1"]["median_us"] == 20 and out["latency"]["1"]["p90_us"] == 21
    assert out["latency"]["8"]["median_us"] == 7 and out["latency"]["8"]["median_runs_us"] == [5, 9, 7]
    assert out["recompiles"] == 1  # the worst process counts
