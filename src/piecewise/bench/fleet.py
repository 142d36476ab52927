"""Fleet benchmark of the remote tier (`piecewise.cache.remote`) on a private Redis server.

    .venv/bin/python -m piecewise.bench.fleet --out benchmarks/results     # ~5 minutes on 2 cores

Model: the reference decoder of the benchmark suite (`piecewise.bench.worker`), compiled with
``piecewise-inductor``. Every process is a fresh one, with an empty local cache root of its own.

1. **Compile once per fleet**: `--procs` processes (8) start together with empty local roots and
   empty Inductor caches on one Redis (entries signed). Reported: each process's
   ``compiler_invocations``, their sum, and the invocations of one process compiling alone on the
   same model (its distinct pieces x compile targets), plus the wall time until the last process's
   first output against one process alone.
2. **Warm start from Redis alone**: a process whose piecewise entries exist only in Redis (empty
   local root) against one whose entries are on its local disk, both with the same warm Inductor
   cache, so only where piecewise's entries come from differs. Time to first output (model
   construction excluded), `--rounds` interleaved rounds; medians with min-max; the ratio is the
   median of the per-round ratios (target of issue 17: <= 1.2x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .suite import fmt_spread, paired_ratio, spread

KEY = "piecewise-fleet-bench-signing-key"

CHILD = r"""
import json, sys, time
import torch
from piecewise.bench.worker import _compiled, _inputs, _model
import piecewise as pw
cfg, model = _model(int(sys.argv[1]))
gen = torch.Generator().manual_seed(0)
ids, pos, seq = _inputs(cfg, 5, gen)
t0 = time.perf_counter()
fn = _compiled("piecewise-inductor", model, 64)
out = fn(ids, pos, seq)
first = time.perf_counter() - t0
ok = torch.allclose(out, model(ids, pos, seq), rtol=1e-4, atol=1e-4)
print(json.dumps({"first_output_s": first, "equal": bool(ok), "end": time.time(), "counters": pw.counters.snapshot()}))
"""


def _spawn(root: str, inductor: str, url: str | None, layers: int) -> subprocess.Popen:
    env = dict(os.environ, PIECEWISE_CACHE_DIR=root, TORCHINDUCTOR_CACHE_DIR=inductor, PIECEWISE_CACHE_KEY=KEY,
               PIECEWISE_REMOTE_CACHE=url or "", PIECEWISE_DISABLE_BUNDLE="")
    return subprocess.Popen([sys.executable, "-c", CHILD, str(layers)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict[str, Any]:
    out, err = p.communicate(timeout=1800)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"fleet benchmark process failed ({p.returncode}):\n{err[-4000:]}")
    r = json.loads(lines[-1])
    if not r["equal"]:
        raise RuntimeError("a fleet process's output differs from eager")
    return r


def run(procs: int = 8, rounds: int = 5, layers: int = 4, log=print) -> dict[str, Any]:
    from ..testing.redis_server import RedisServer

    tmp = tempfile.mkdtemp(prefix="piecewise-fleet-")
    try:
        with RedisServer() as server:
            log(f"one process alone ({layers} layers, cold)")
            t0 = time.time()
            alone = _result(_spawn(f"{tmp}/alone", f"{tmp}/alone-inductor", None, layers))
            alone_wall = alone["end"] - t0
            log(f"{procs} processes together on one Redis (cold local and Inductor caches)")
            t0 = time.time()
            ps = [_spawn(f"{tmp}/fleet{i}", f"{tmp}/fleet{i}-inductor", server.url, layers) for i in range(procs)]
            fleet = [_result(p) for p in ps]
            fleet_wall = max(r["end"] for r in fleet) - t0
            inv = [r["counters"]["compiler_invocations"] for r in fleet]
            log(f"warm starts: local disk against Redis alone, {rounds} rounds")
            warm_inductor = f"{tmp}/fleet0-inductor"
            local_root = f"{tmp}/fleet0"  # holds the entries the fleet pulled or compiled
            local, remote = [], []
            for i in range(rounds):
                local.append(_result(_spawn(local_root, warm_inductor, None, layers)))
                empty = f"{tmp}/empty{i}"
                remote.append(_result(_spawn(empty, warm_inductor, server.url, layers)))
            for r in remote:
                if r["counters"]["compiler_invocations"] or not r["counters"]["remote_pulls"]:
                    raise RuntimeError(f"a warm start from Redis compiled or pulled nothing: {r['counters']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lf = [r["first_output_s"] for r in local]
    rf = [r["first_output_s"] for r in remote]
    return {
        "layers": layers, "procs": procs, "rounds": rounds,
        "alone_invocations": alone["counters"]["compiler_invocations"], "fleet_invocations": inv,
        "fleet_invocations_sum": sum(inv), "alone_wall_s": alone_wall, "fleet_wall_s": fleet_wall,
        "fleet_remote_waits": sum(r["counters"]["remote_waits"] for r in fleet),
        "warm_local_s": spread(lf), "warm_remote_s": spread(rf), "warm_ratio": paired_ratio(rf, lf),
        "warm_remote_pulls": [r["counters"]["remote_pulls"] for r in remote],
    }


def to_markdown(res: dict[str, Any], machine: str) -> str:
    return "\n".join([
        "# Fleet benchmark (remote tier on Redis)", "",
        f"Machine: {machine}. Reference decoder, {res['layers']} layers, piecewise-inductor, signed entries.", "",
        "| figure | value |", "|---|---|",
        f"| compiler invocations, one process alone | {res['alone_invocations']} |",
        f"| compiler invocations, {res['procs']} processes together (per process) | {res['fleet_invocations']} |",
        f"| ... their sum | {res['fleet_invocations_sum']} |",
        f"| processes that waited for another's compile lease | {res['fleet_remote_waits']} |",
        f"| wall time to the last first output: one alone / {res['procs']} together | "
        f"{res['alone_wall_s']:.1f} s / {res['fleet_wall_s']:.1f} s |",
        f"| warm first output, entries on local disk (s) | {fmt_spread(res['warm_local_s'])} |",
        f"| warm first output, entries in Redis only (s) | {fmt_spread(res['warm_remote_s'])} |",
        f"| Redis / local disk (median of per-round ratios) | {fmt_spread(res['warm_ratio'])} |",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m piecewise.bench.fleet", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for fleet.md and fleet.json")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    import platform

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res = run(args.procs, args.rounds, args.layers, log=lambda m: print(m, file=sys.stderr, flush=True))
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.2f} at the start, "
               f"{time.strftime('%Y-%m-%d %H:%M')}")
    os.makedirs(args.out, exist_ok=True)
    md = to_markdown(res, machine)
    with open(os.path.join(args.out, "fleet.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "fleet.json"), "w") as f:
        json.dump({"machine": machine, **res}, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
