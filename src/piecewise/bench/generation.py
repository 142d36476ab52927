"""Generation benchmark on real weights: ``python -m piecewise.bench.generation``.

SmolLM2-135M-Instruct (fp32, CPU), greedy, 128-token prompts, 64 new tokens, batch 1 and 8, four
systems side by side in one run, each in fresh processes (a cold one with empty compile caches,
then a warm one on the caches it filled):

* ``hf_eager``: transformers ``generate()``, sdpa attention;
* ``hf_compile_static``: the recipe transformers documents, ``cache_implementation="static"`` with
  ``model.forward = torch.compile(model.forward)`` (its recompiles are counted and shown);
* ``pw_generate``: ``piecewise.compile(model).generate(...)`` (KV cache owned by piecewise);
* ``pw_engine``: the reference decoder (`LlamaForCausalLM.from_hf`) compiled piecewise, in its
  continuous-batching loop, all requests arriving at step 0.

Per process: time to first token of the first ``generate()`` (trace/compile or warm start
included), then a second ``generate()`` on other prompts of the same shape: its time to first token
and its decode rate (tokens after the first, per second, per sequence). The table gives each figure
and its ratio to the recipe's from the same run. Weights load from the weight cache (not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

SYSTEMS = ("hf_eager", "hf_compile_static", "pw_generate", "pw_engine")
PROMPT_LEN = 128
NEW_TOKENS = 64


def _prompts(tokenizer: Any, batch: int, seed: int, prompt_len: int = PROMPT_LEN) -> list[list[int]]:
    """`batch` prompts of exactly PROMPT_LEN tokens: chat-templated questions, cut or repeated."""
    from ..models.weights import chat_prompt_ids

    words = ["capital", "river", "mountain", "colour", "number", "planet", "language", "animal"]
    out = []
    for i in range(batch):
        ids = chat_prompt_ids(tokenizer, " ".join(f"Tell me about the {words[(i + seed + k) % len(words)]}." for k in range(40)))
        out.append((ids * (prompt_len // len(ids) + 1))[-prompt_len:])
    return out


def _run(system: str, batch: int, weights_root: str, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """One process's measurement (see module doc)."""
    import torch

    from ..models.weights import load_smollm2

    torch.manual_seed(0)
    model, tok = load_smollm2(weights_root)
    eos = None  # run every request to NEW_TOKENS
    runs = []
    if system == "pw_engine":
        import piecewise as pw
        from ..models.decode import greedy_decode
        from ..models.llama import LlamaForCausalLM

        decoder = LlamaForCausalLM.from_hf(model, max_num_seqs=batch, max_seq_len=prompt_len + new_tokens)
        # as a serving engine runs: the backbone compiled, the vocabulary projection for sampled rows only
        compiled = pw.compile(decoder.backbone(), pw.CompilationConfig(max_num_tokens=prompt_len * batch, tag=f"bench_engine_b{batch}"),
                              dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
        for seed in (0, 1):
            prompts = _prompts(tok, batch, seed, prompt_len)
            first: list[float] = []
            start = time.perf_counter()

            def forward(ids, pos, seq, _first=first, _start=start):
                out = compiled(ids, pos, seq)
                if not _first:
                    _first.append(time.perf_counter() - _start)
                return out

            with torch.no_grad():
                greedy_decode(forward, prompts, new_tokens, arrival_steps=[0] * batch, config=decoder.config,
                              reset=decoder.reset_kv_cache, max_num_tokens=prompt_len * batch,
                              compute_logits=decoder.compute_logits)
            runs.append((first[0], time.perf_counter() - start))
        recompiles = pw.counters.recompiles
    else:
        from transformers.generation.streamers import BaseStreamer

        kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
        gen = model.generate
        before_graphs = 0
        if system == "hf_compile_static":
            import torch._dynamo.utils

            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward)
            before_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        elif system == "pw_generate":
            import piecewise as pw
            from ..models import hf

            hf.register_hf_attention()
            model.set_attn_implementation("piecewise")
            gen = pw.compile(model, pw.CompilationConfig(max_num_seqs=batch, max_model_len=prompt_len + new_tokens,
                                                         tag=f"bench_generate_b{batch}")).generate
        for seed in (0, 1):
            ids = torch.tensor(_prompts(tok, batch, seed, prompt_len))
            first: list[float] = []

            class Clock(BaseStreamer):
                seen = 0

                def put(self, value):
                    self.seen += 1
                    if self.seen == 2:  # the first put is the prompt
                        first.append(time.perf_counter() - start)

                def end(self):
                    pass

            start = time.perf_counter()
            with torch.no_grad():
                gen(ids, attention_mask=torch.ones_like(ids), streamer=Clock(), **kw)
            total = time.perf_counter() - start
            runs.append((first[0] if first else float("nan"), total))
        if system == "hf_compile_static":
            import torch._dynamo.utils

            recompiles = max(0, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before_graphs - 1)
        elif system == "pw_generate":
            import piecewise as pw

            recompiles = pw.counters.recompiles
        else:
            recompiles = 0
    (ttft1, total1), (ttft2, total2) = runs
    return {"system": system, "batch": batch, "first_ttft_s": ttft1, "first_total_s": total1, "ttft_s": ttft2,
            "total_s": total2, "decode_tok_s": (new_tokens - 1) / (total2 - ttft2) if ttft2 == ttft2 else float("nan"),
            "recompiles": recompiles}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=int, default=900, help="seconds per process")
    p.add_argument("--out", default=None, help="write JSON and Markdown here")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--worker", nargs=3, metavar=("SYSTEM", "BATCH", "WEIGHTS_ROOT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_run(args.worker[0], int(args.worker[1]), args.worker[2], args.prompt_len, args.new_tokens)))
        return 0
    weights_root = os.environ.get("PIECEWISE_CACHE_DIR") or tempfile.mkdtemp(prefix="pw-gen-weights-")
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for system in args.systems.split(","):
            caches = tempfile.mkdtemp(prefix=f"pw-gen-{system}-")
            env = {**os.environ, "PIECEWISE_CACHE_DIR": os.path.join(caches, "pw"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
            for phase in ("cold", "warm"):
                cmd = [sys.executable, "-m", "piecewise.bench.generation", "--prompt-len", str(args.prompt_len),
                       "--new-tokens", str(args.new_tokens), "--worker", system, str(batch), weights_root]
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                    row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                        "system": system, "batch": batch, "error": proc.stderr.strip().splitlines()[-1:]}
                except subprocess.TimeoutExpired:
                    row = {"system": system, "batch": batch, "error": [f"timed out after {args.timeout} s"]}
                row.update(phase=phase, process_s=time.perf_counter() - t0)
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    md = to_markdown(results)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "generation.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "generation.md"), "w") as f:
            f.write(md)
    return 0


def to_markdown(results: list[dict[str, Any]]) -> str:
    """One row per (batch, system, cold/warm process); ratios to the recipe's row of the same batch
    and phase from the same run."""
    def find(system, batch, phase):
        return next((r for r in results if (r["system"], r["batch"], r["phase"]) == (system, batch, phase)), None)

    def num(v, digits=2):
        return "-" if v is None or v != v else f"{v:.{digits}f}"

    lines = ["| batch | system | process | first generate: time to first token s | then: time to first token s | "
             "then: decode tokens/s per sequence | decode vs recipe | warm first token vs recipe | recompiles |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['system']} | {r['phase']} | failed: {' '.join(r['error'])[:120]} | | | | | |")
            continue
        base = find("hf_compile_static", r["batch"], r["phase"])
        ok = base is not None and "error" not in base
        decode_ratio = base["decode_tok_s"] / r["decode_tok_s"] if ok and r["decode_tok_s"] else None  # step time ratio
        ttft_ratio = r["first_ttft_s"] / base["first_ttft_s"] if ok and r["phase"] == "warm" and base["first_ttft_s"] else None
        lines.append(f"| {r['batch']} | {r['system']} | {r['phase']} | {num(r['first_ttft_s'])} | {num(r['ttft_s'])} | "
                     f"{num(r['decode_tok_s'], 1)} | {num(decode_ratio)} | {num(ttft_ratio)} | {r['recompiles']} |")
    lines.append("")
    lines.append("Decode vs recipe: this system's decode step time over the torch.compile static-cache recipe's (below 1 is "
                 "faster). Warm first token vs recipe: time to first token of a fresh process on warm caches, over the "
                 "recipe's. The engine's first token is the end of its first step (the whole "
                 "prefill); transformers generate()'s is the first token its streamer receives.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
