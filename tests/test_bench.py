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
    from piecewise.bench.worker import replay_overhead

    res["replay"] = replay_overhead(layers=2, calls=200)
    assert res["replay"]["pieces"] == 3 and 0 < res["replay"]["us_per_piece"] < 1000
    res["padding"] = padding_waste_report(max_size=64)
    assert res["padding"]["planned"]["pad_rows"] <= res["padding"]["default"]["pad_rows"]
    res["summary"] = summarize(res, BenchConfig(layers=(1,), batches=(1, 4)))
    d = res["summary"]["dispatch"][1]
    assert abs(d["us_per_piece"]["value"] - (pw["latency"]["4"]["median_us"] - eager["latency"]["4"]["median_us"]) / 3) < 1e-6
    md = to_markdown(res)
    assert "| 4 |" in md and "Dispatch overhead per piece" in md and "| planned |" in md and "traced" in md
    assert f"**{res['replay']['us_per_piece']:.2f} us per piece**" in md
    runs = [{"compile_s": c, "first_output_s": c + 1} for c in (3.0, 1.0, 2.0)]
    assert _median_run(runs)["compile_s"] == 2.0 and _median_run(runs)["compile_s_runs"] == [3.0, 1.0, 2.0]
    assert _median_run(runs)["first_output_s_runs"] == [4.0, 2.0, 3.0]
    # the compile phase is measured directly (not first call minus eager first call, never clamped)
    assert pw["compile_method"].startswith("timings") and 0 < pw["compile_s"] <= pw["first_output_s"]
    assert eager["compile_s"] == 0.0


def test_spread_marks_a_figure_noisy_when_its_spread_exceeds_its_value():
    from piecewise.bench.suite import fmt_spread, paired_ratio, ratio, spread

    steady = spread([1.5, 1.4, 1.6])
    assert steady["value"] == 1.5 and steady["min"] == 1.4 and steady["max"] == 1.6 and not steady["noisy"]
    assert fmt_spread(steady) == "1.50 (1.40–1.60)"
    noisy = spread([0.05, 0.25, 0.0])  # the warm start: a near-zero compile phase, +-0.2 s of noise
    assert noisy["noisy"] and fmt_spread(noisy) == "0.05 (0.00–0.25, noisy)"
    assert fmt_spread(spread([3.68])) == "3.68"  # one process: no spread to show
    assert fmt_spread(spread([-0.1, 0.1, 0.0]), 1) == "0.0 (-0.1 to 0.1, noisy)"  # negative values are shown, not clamped
    # ratios are per round (round i ran both systems back to back), then the median of those
    r = paired_ratio([1.0, 3.0, 2.0], [2.0, 2.0, 4.0])
    assert r["runs"] == [0.5, 1.5, 0.5] and r["value"] == 0.5 and r["noisy"] and fmt_spread(r) == "0.50 (0.50–1.50, noisy)"
    assert ratio(1.0, 0.0) != ratio(1.0, 0.0)  # NaN for a zero baseline, not a clamped denominator


def test_startup_table_shows_spreads_and_first_output_ratio_beside_compile_ratio():
    from piecewise.bench.suite import TARGETS

    def run(first, comp, rss=400.0):
        return {"first_output_s": first[0], "compile_s": comp[0], "first_output_s_runs": first, "compile_s_runs": comp,
                "peak_rss_mb": rss, "compile_method": "m"}

    lat = {"1": {"median_us": 100.0, "p10_us": 90.0, "p90_us": 110.0, "median_runs_us": [100.0, 120.0]}}
    res = {"machine": {"platform": "p", "cpus": 2, "processor": "x", "torch": "t", "threads": 2, "date": "d"},
           "config": {"steady_layers": 2, "steps": 5, "sizes": 4, "warm_repeats": 3, "cold_repeats": 1, "steady_repeats": 2},
           "targets": TARGETS,
           "startup": {"full/2": {"cold": run([20.6], [20.5]), "warm": run([3.0, 3.2, 3.1], [2.9, 3.1, 3.0])},
                       "piecewise-inductor/2": {"cold": run([10.3], [10.0]), "warm": run([1.5, 1.6, 1.55], [0.05, 0.25, 0.0]),
                                                "warm_traced": run([4.0, 4.1, 4.2], [3.0, 3.1, 3.2])}},
           "steady": {s: {"latency": lat, "recompiles": 0} for s in ("eager", "full", "piecewise-inductor", "piecewise-eager")}}
    res["summary"] = summarize(res, BenchConfig(layers=(2,), batches=(1,)))
    row = res["summary"]["startup"][0]
    assert row["warm_compile_pw_s"]["noisy"] and not row["warm_full_s"]["noisy"]
    assert row["cold_ratio"]["runs"] == [0.5]
    md = to_markdown(res)
    line = next(ln for ln in md.splitlines() if ln.startswith("| 2 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:4] == ["20.60", "10.30", "0.50"]  # one cold process: its value, no spread
    assert cells[4] == "3.10 (3.00–3.20)" and cells[5] == "1.55 (1.50–1.60)"
    assert cells[6] == "0.50 (0.50–0.50)"  # first-output ratio beside the compile ratio
    assert cells[8] == "0.05 (0.00–0.25, noisy)" and cells[9].endswith("noisy)")
    assert "one process per system from empty caches (no spread)" in md and "measured directly" in md
    res["machine"].update(load_start=4.52, load_end=1.0)
    assert "; load average 4.5 at the start, 1.0 at the end." in to_markdown(res)
    assert "1.00 (1.00–1.00)" in md  # steady ratios per round, with their spread


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


def test_generation_table_ratios_against_the_recipe_per_round_and_failures():
    from piecewise.bench.generation import to_markdown

    row = dict(batch=1, first_total_s=0.0, total_s=0.0, recompiles=0, ttft_s=0.2)
    results = [
        {**row, "system": "hf_compile_static", "phase": "cold", "first_ttft_s": 60.0, "decode_tok_s": 10.0},
        {**row, "system": "pw_generate", "phase": "cold", "first_ttft_s": 30.0, "decode_tok_s": 40.0, "first_total_s": 42.0},
        {"system": "pw_engine", "batch": 1, "phase": "cold", "error": ["timed out after 900 s"]},
    ]
    for rnd, (recipe, pw, rate) in enumerate([(8.0, 2.0, 20.0), (10.0, 3.0, 10.0), (12.0, 6.0, 20.0)]):
        results += [{**row, "system": "hf_compile_static", "phase": "warm", "round": rnd, "first_ttft_s": recipe, "decode_tok_s": 10.0},
                    {**row, "system": "pw_generate", "phase": "warm", "round": rnd, "first_ttft_s": pw, "decode_tok_s": rate}]
    results.append({"system": "paired", "batch": 1, "phase": "paired", "rounds": 2,
                    "step_s": {"hf_compile_static": [0.05, 0.04], "pw_generate": [0.04, 0.04]},
                    "ratio": {"pw_generate": [0.8, 1.0]}, "recompiles": {"hf_compile_static": 1, "pw_generate": 0}})
    md = to_markdown(results)

    def cells(prefix):
        line = next(ln for ln in md.splitlines() if ln.startswith(prefix))
        return [c.strip() for c in line.strip("|").split("|")]

    assert cells("| 1 | pw_generate | cold |")[7:9] == ["0.25", "-"]
    assert cells("| 1 | pw_generate | cold |")[3:5] == ["30.00", "42.00"]  # first generate: first token, whole call  # a quarter of the recipe's step, no warm ratio
    warm = cells("| 1 | pw_generate | warm x3 |")
    # per round against the recipe's process of the same round: TTFT 0.25, 0.30, 0.50; step 0.5, 1.0, 0.5
    assert warm[3] == "3.00 (2.00–6.00, noisy)" and warm[7] == "0.50 (0.50–1.00)" and warm[8] == "0.30 (0.25–0.50)"
    assert "| 1 | pw_engine | cold | failed: timed out after 900 s |" in md
    paired = cells("| 1 | pw_generate | 40.0")
    assert paired[3:] == ["0.90 (0.80–1.00)", "0.80, 1.00", "0"]
    assert cells("| 1 | hf_compile_static | 45.0")[3:] == ["1", "-", "1"]


def test_partition_worker_counts_no_recompiles_and_the_strategy_table_compares_it():
    part = _worker("--system", "piecewise-partition", "--layers", "1", "--steps", "3", "--batches", "1,4", "--sizes", "8")
    assert part["recompiles"] == 0 and part["pieces"] == 1  # one whole-graph piece, cut by Inductor
    assert part["counters"]["compiler_invocations"] == 1

    def run(first, comp):
        return {"first_output_s": first[0], "compile_s": comp[0], "first_output_s_runs": first, "compile_s_runs": comp,
                "peak_rss_mb": 300.0, "compile_method": "m"}

    def lat(us):
        return {"latency": {"1": {"median_us": us[0], "p10_us": us[0], "p90_us": us[0], "median_runs_us": us}}, "recompiles": 0}

    from piecewise.bench.suite import TARGETS

    res = {"machine": {"platform": "p", "cpus": 2, "processor": "x", "torch": "t", "threads": 2, "date": "d"},
           "config": {"steady_layers": 2, "steps": 5, "sizes": 4, "warm_repeats": 2, "cold_repeats": 1, "steady_repeats": 2},
           "targets": TARGETS,
           "startup": {"full/2": {"cold": run([20.0], [19.0]), "warm": run([3.0, 3.0], [2.0, 2.0])},
                       "piecewise-inductor/2": {"cold": run([10.0], [9.0]), "warm": run([1.0, 1.0], [0.5, 0.5]),
                                                "warm_traced": run([2.0, 2.0], [1.0, 1.0])},
                       "piecewise-partition/2": {"cold": run([15.0], [14.0]), "warm": run([1.5, 2.0], [1.0, 1.0])}},
           "steady": {"eager": lat([400.0, 400.0]), "full": lat([100.0, 200.0]), "piecewise-inductor": lat([120.0, 200.0]),
                      "piecewise-partition": lat([90.0, 300.0]), "piecewise-eager": lat([300.0, 300.0])}}
    res["summary"] = summarize(res, BenchConfig(layers=(2,), batches=(1,)))
    (p,) = res["summary"]["partition_startup"]
    assert p["cold_vs_full"]["runs"] == [0.75] and p["cold_vs_fx"]["runs"] == [1.5]
    assert p["warm_vs_fx"]["runs"] == [1.5, 2.0] and p["warm_compile_vs_fx"]["runs"] == [2.0, 2.0]
    (row,) = res["summary"]["steady"]
    assert row["partition_vs_full"]["runs"] == [0.9, 1.5] and row["partition_vs_fx"]["runs"] == [0.75, 1.5]
    md = to_markdown(res)
    assert "Split strategies side by side" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| 2 | 15.00 |"))
    assert [c.strip() for c in line.strip("|").split("|")][2:4] == ["0.75", "1.50"]
    assert "partition / full in each interleaved round: batch 1: 0.90, 1.50" in md


def test_paired_worker_times_both_systems_in_turns_and_the_table_shows_every_round():
    r = _worker("--system", "paired", "--pair", "eager,piecewise-eager", "--layers", "1", "--steps", "6", "--batches",
                "1,4", "--sizes", "4")
    assert r["pair"] == ["eager", "piecewise-eager"] and set(r["ratio"]) == {"1", "4"}
    for b in ("1", "4"):
        base, pw = r["latency"]["eager"][b], r["latency"]["piecewise-eager"][b]
        assert 0 < base["p10_us"] <= base["median_us"] <= base["p90_us"] and pw["median_us"] > 0
        assert abs(r["ratio"][b] - pw["median_us"] / base["median_us"]) < 1e-9
    bad = subprocess.run([sys.executable, "-m", "piecewise.bench.worker", "--system", "paired", "--pair", "full"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--pair 'full': give two of" in bad.stderr

    from piecewise.bench.suite import TARGETS

    def rnd(full_us, pw_us):
        lat = lambda us: {"1": {"median_us": us, "p10_us": us, "p90_us": us}}  # noqa: E731
        return {"pair": ["full", "piecewise-inductor"], "latency": {"full": lat(full_us), "piecewise-inductor": lat(pw_us)},
                "ratio": {"1": pw_us / full_us}}

    lat = {"latency": {"1": {"median_us": 100.0, "p10_us": 90.0, "p90_us": 110.0, "median_runs_us": [100.0, 300.0]}},
           "recompiles": 0}
    res = {"machine": {"platform": "p", "cpus": 2, "processor": "x", "torch": "t", "threads": 2, "date": "d"},
           "config": {"steady_layers": 2, "steps": 5, "sizes": 4, "steady_repeats": 3}, "targets": TARGETS,
           "startup": {}, "steady": {s: lat for s in ("eager", "full", "piecewise-inductor", "piecewise-eager")},
           "paired": [rnd(4000.0, 3000.0), rnd(2000.0, 1600.0), rnd(3000.0, 3300.0)]}
    res["summary"] = summarize(res, BenchConfig(layers=(), batches=(1,)))
    (p,) = res["summary"]["paired"]
    assert p["ratio"]["runs"] == [0.75, 0.8, 1.1] and p["ratio"]["value"] == 0.8 and p["base_us"]["value"] == 3000.0
    md = to_markdown(res)
    line = next(ln for ln in md.splitlines() if ln.startswith("| 1 | 3000 (2000–4000) |"))
    assert [c.strip() for c in line.strip("|").split("|")][3:] == ["0.80 (0.75–1.10)", "0.75, 0.80, 1.10"]
    assert "measured paired" in md


def test_a_failed_generation_process_is_named_by_its_exception_line():
    """The failure cell of the generation table names the exception a worker died of, not what
    torch prints after the traceback (a pointer to tlparse was all the GPU run's table showed)."""
    from piecewise.bench.generation import _error_line

    err = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
           "piecewise.errors.CompileError: Inductor failed to compile a piece for general: CantSplit\n\n"
           "Use tlparse to see full graph. (https://github.com/pytorch/tlparse)\n")
    assert _error_line(err) == ["piecewise.errors.CompileError: Inductor failed to compile a piece for general: CantSplit"]
    assert _error_line("killed\n") == ["killed"] and _error_line("") == []
