"""Greedy decoding with continuous batching: the batch a model sees changes size every step.

Requests arrive at given steps and wait for a free sequence slot. A request's first step feeds its
whole prompt (prefill; in chunks over several steps under a `max_num_tokens` budget); every later
step feeds its last generated token (decode). Prefills and
decodes of all running requests are flattened into one call of
``forward(input_ids, positions, seq_ids)``, so step sizes vary the way a serving engine's do. A
request that has generated its `max_new_tokens`, or an end-of-sequence token, frees its slot for
the next waiting one. Greedy tokens equal transformers' ``generate(do_sample=False)`` for each
prompt alone (the end-of-sequence token included, as `generate` returns it).
"""

from __future__ import annotations

import contextlib
import itertools
import dataclasses
import operator
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..errors import InputError
from ..graphs.dispatch import batch_hint

__all__ = ["DecodeResult", "DecodeTrace", "default_trace", "greedy_decode", "make_prompts"]

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class DecodeResult:
    """What a `greedy_decode` run produced.

    Attributes:
        tokens: generated ids per request, in the order the prompts were given.
        step_sizes: `num_tokens` of each forward call, in call order.
        step_seconds: wall time of each call in seconds, including the argmax that waits for it.
        stop_reasons: per request, ``"eos"`` (it generated one of `eos_token_ids`, kept as its last
            token) or ``"length"`` (it generated its `max_new_tokens`).
    """

    tokens: list[list[int]]
    step_sizes: list[int]
    step_seconds: list[float]
    stop_reasons: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class DecodeTrace:
    """A reproducible workload: prompts, the step each arrives at, and how many tokens each wants."""

    prompts: tuple[tuple[int, ...], ...]
    arrival_steps: tuple[int, ...]
    max_new_tokens: int


@dataclasses.dataclass
class _Request:
    index: int
    slot: int
    pending: list[int]  # tokens to feed at the next step
    next_position: int  # position of pending[0]
    generated: list[int]
    max_new_tokens: int


def make_prompts(n: int, vocab_size: int, seed: int = 0, min_len: int = 2, max_len: int = 16) -> list[list[int]]:
    """`n` deterministic prompts of ids in ``[0, vocab_size)``, lengths uniform in ``[min_len, max_len]``."""
    if not 1 <= min_len <= max_len:
        raise InputError(f"prompt lengths [{min_len}, {max_len}] are empty; need 1 <= min_len <= max_len")
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def default_trace(vocab_size: int = 256, seed: int = 0) -> DecodeTrace:
    """Ten requests of 3..24 prompt tokens arriving every second step, 8 new tokens each.

    With 8 slots this yields well over 8 distinct step sizes (lone decodes, decode batches of
    several widths, and decodes mixed with prefills of different lengths) and needs positions
    below 32, inside the default `LlamaConfig.max_seq_len`.
    """
    prompts = make_prompts(10, vocab_size, seed, min_len=3, max_len=24)
    return DecodeTrace(tuple(map(tuple, prompts)), tuple(2 * i for i in range(len(prompts))), max_new_tokens=8)


def greedy_decode(
    forward: Forward,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    arrival_steps: Sequence[int] | None = None,
    max_num_seqs: int | None = None,
    max_seq_len: int | None = None,
    device: torch.device | str | None = None,
    reset: Callable[[], None] | None = None,
    eos_token_ids: Iterable[int] | int | None = (),
    config: Any = None,
    max_num_tokens: int | None = None,
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> DecodeResult:
    """Decode every prompt greedily, batching requests continuously.

    Args:
        forward: ``forward(input_ids, positions, seq_ids) -> logits``, all inputs [num_tokens]
            int64 on `device`, logits [num_tokens, vocab_size]; an eager or compiled model.
        prompts: token ids per request, each non-empty.
        max_new_tokens: tokens to generate per request (>= 1): one number for all, or one each.
        arrival_steps: the step at which each request may start (default ``2 * i``: staggered).
            Waiting requests take free slots in arrival order (more requests than slots queue);
            when nothing runs, the clock jumps to the next arrival rather than calling `forward`
            with no tokens.
        max_num_seqs: number of sequence slots (default: `config`'s, else 8); must not exceed the
            model's.
        max_seq_len: requests needing positions beyond it are rejected up front (default:
            `config`'s, else unchecked).
        device: where the step inputs are built. Default: the device of the model `forward` runs
            (found as for `config`: its KV cache's), else the CPU; a CUDA model given CPU inputs
            failed at its first trace.
        reset: called once before the first step, e.g. ``model.reset_kv_cache``. Optional: a run
            only reads KV entries it wrote, so stale cache contents do not change its tokens.
        eos_token_ids: a request that generates one of these stops (the token is kept), e.g.
            ``model.eos_token_ids`` of a model built by `LlamaForCausalLM.from_hf`. One integer
            (as transformers' ``generation_config.eos_token_id`` often is) is one id; None is none.
        config: the model's `LlamaConfig` (or anything with `max_num_seqs` and `max_seq_len`):
            its KV-cache limits become the defaults and bounds above, checked before the first
            step, so a request that cannot fit fails before anything is compiled. Default: the
            config of the model `forward` runs (itself, a compiled model's ``.module``, a
            backbone's ``.decoder``), else none.
        max_num_tokens: the most tokens one step may feed (a compiled model's
            `CompilationConfig.max_num_tokens`). Requests are fed in admission order until it is
            spent; a prefill that does not fit is fed in chunks over several steps (chunked
            prefill), and a request generates once its whole prompt is in the cache. Default:
            a pw.compile'd `forward`'s own `CompilationConfig.max_num_tokens`, else no limit; a
            larger value than that is refused.
        compute_logits: when given, `forward` returns hidden states ``[num_tokens, hidden]`` and
            only the rows a request samples from (its last fed token) go through
            ``compute_logits(rows) -> [rows, vocab_size]`` (e.g. a compiled
            `LlamaForCausalLM.backbone` with `LlamaForCausalLM.compute_logits`), so prompt tokens
            are never projected onto the vocabulary.

    Raises:
        InputError: empty prompts, `prompts` given as one flat list of token ids (not a list of
            prompts), token ids that are not integers or are outside `config`'s vocabulary,
            `eos_token_ids` that is not None, an integer or integers, `max_num_tokens` that is not
            a positive integer (numpy and 0-d tensor integers are taken) or exceeds a pw.compile'd `forward`'s own
            `CompilationConfig.max_num_tokens` (both named), mismatched
            or non-integer `arrival_steps` or `max_new_tokens` (numpy and 0-d tensor integers are
            taken), `max_num_seqs` below 1 or above the model's slots, a request too long for
            `max_seq_len` (naming the request, the limit and the config field), or another
            `greedy_decode` running on the same model (found through a compiled model's
            ``.module`` and a backbone's ``.decoder``): both would write the same cache slots.
    """
    _check_prompts_shape(prompts)
    limits = _counts("max_new_tokens", max_new_tokens, len(prompts), low=1)
    _check_token_ids(prompts)
    arrivals = (_counts("arrival_steps", list(arrival_steps), len(prompts), low=None) if arrival_steps is not None
                else [2 * i for i in range(len(prompts))])
    owner = _cache_owner(forward)
    if config is None:  # the model itself: its slots bound the loop's (a model with fewer slots failed mid-run)
        config = getattr(owner, "config", None)
    max_num_seqs = _cache_slots(prompts, limits, config, max_num_seqs, max_seq_len)
    max_num_tokens = _token_budget(forward, max_num_tokens)
    eos = _eos_ids(eos_token_ids)
    if device is None:
        device = _model_device(owner)

    with _running(owner):
        if reset is not None:
            reset()
        return _serve(forward, prompts, limits, arrivals, max_num_seqs, device, eos, max_num_tokens, compute_logits)


def _check_token_ids(prompts: Sequence[Sequence[int]]) -> None:
    """InputError unless every prompt is non-empty and holds integers (ints, numpy integers and 0-d
    integer tensors; a float id used to be truncated silently)."""
    if any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token; drop empty prompts")
    for i, p in enumerate(prompts):
        for t in p:
            try:  # ints, numpy integers and 0-d integer tensors; a float id used to be truncated silently
                operator.index(t)
            except TypeError:
                raise InputError(f"prompt {i} holds {t!r} ({type(t).__name__}); token ids are integers, as the "
                                 "model's tokenizer returns them") from None


def _cache_slots(prompts: Sequence[Sequence[int]], limits: list[int], config: Any, max_num_seqs: int | None,
                 max_seq_len: int | None) -> int:
    """The sequence slots of a run (`max_num_seqs`, bounded by and defaulting to `config`'s KV cache,
    else 8), after checking every prompt against `config`'s vocabulary and every request against
    the positions per sequence (`max_seq_len`, likewise bounded by `config`'s), before anything is
    compiled.

    Raises:
        InputError: see `greedy_decode` (vocabulary, slots, positions).
    """
    where = "the max_seq_len argument"
    if config is not None:
        name = type(config).__name__
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int):
            bad = next(((i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise InputError(f"prompt {bad[0]} holds token id {bad[1]}, outside the vocabulary 0..{vocab - 1} "
                                 f"({name}.vocab_size={vocab}); tokenize with the model's own tokenizer")
        if max_num_seqs is not None and max_num_seqs > config.max_num_seqs:
            raise InputError(f"max_num_seqs={max_num_seqs} exceeds the model's {config.max_num_seqs} sequence slots "
                             f"({name}.max_num_seqs); more requests than slots simply queue")
        if max_seq_len is None or max_seq_len >= config.max_seq_len:
            max_seq_len, where = config.max_seq_len, f"{name}.max_seq_len, the KV cache's positions per sequence"
    max_num_seqs = max_num_seqs if max_num_seqs is not None else config.max_num_seqs if config is not None else 8
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise InputError(f"max_num_seqs={max_num_seqs!r} must be a positive integer (sequence slots)")
    if max_seq_len is not None:
        # The last generated token is never fed back, so a request needs len(prompt) + max_new_tokens - 1 positions.
        for i, (p, n) in enumerate(zip(prompts, limits)):
            if len(p) + n - 1 > max_seq_len:
                raise InputError(
                    f"request {i} needs {len(p) + n - 1} positions (a prompt of {len(p)} tokens + max_new_tokens={n} "
                    f"- 1) but max_seq_len={max_seq_len} ({where}); shorten the prompt or max_new_tokens, or build "
                    "the model with a larger max_seq_len")
    return max_num_seqs


def _token_budget(forward: Forward, max_num_tokens: Any) -> int | None:
    """The most tokens one step may feed: `max_num_tokens` (numpy and 0-d tensor integers taken),
    by default and at most a pw.compile'd `forward`'s own ``CompilationConfig.max_num_tokens``.

    Raises:
        InputError: not a positive integer, or above the compiled budget.
    """
    # a pw.compile'd forward: its CompilationConfig's budget (a larger step failed mid-run)
    budget = getattr(getattr(forward, "config", None), "max_num_tokens", None)
    budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
    if max_num_tokens is None:
        max_num_tokens = budget
    if max_num_tokens is not None and not isinstance(max_num_tokens, (bool, int)):
        try:  # numpy and 0-d tensor integers, as for max_new_tokens
            max_num_tokens = operator.index(max_num_tokens)
        except TypeError:
            pass
    if max_num_tokens is not None and (isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int)
                                       or max_num_tokens < 1):
        raise InputError(f"max_num_tokens={max_num_tokens!r} must be a positive integer")
    if budget is not None and max_num_tokens is not None and max_num_tokens > budget:
        raise InputError(f"max_num_tokens={max_num_tokens} exceeds the compiled forward's CompilationConfig."
                         f"max_num_tokens={budget}: a step of more tokens would fail mid-run. Pass max_num_tokens <= "
                         f"{budget} (or leave it out: the compiled budget is the default), or compile with a larger "
                         "max_num_tokens")
    return max_num_tokens


def _model_device(owner: Any) -> torch.device | str:
    """The device of the model `owner` (its first buffer's, else parameter's), else the CPU."""
    held = next(itertools.chain(owner.buffers(), owner.parameters()), None) if isinstance(owner, torch.nn.Module) else None
    return held.device if held is not None else "cpu"


def _check_prompts_shape(prompts: Any) -> None:
    """InputError unless `prompts` is a sequence of prompts, each a sequence (not one flat prompt
    of token ids, which used to fail with a raw TypeError)."""
    fix = "prompts is a list of prompts, each a list of token ids; for one prompt pass [prompt], e.g. [[1, 2, 3]]"
    try:
        len(prompts)
    except TypeError:
        raise InputError(f"prompts={prompts!r} ({type(prompts).__name__}) has no length: {fix}") from None
    for i, p in enumerate(prompts):
        if not (isinstance(p, torch.Tensor) and p.ndim > 0):
            try:
                operator.index(p)
            except TypeError:
                pass
            else:  # a token id where a prompt belongs: the prompts were given flat
                raise InputError(f"prompts[{i}]={p!r} is a token id, not a prompt: {fix}")
        try:
            len(p)
        except TypeError:
            raise InputError(f"prompts[{i}]={p!r} ({type(p).__name__}) is not a sequence of token ids: {fix}") from None


def _eos_ids(value: Any) -> frozenset[int]:
    """`eos_token_ids` as a set of ints: None (no EOS), one integer (as transformers'
    ``generation_config.eos_token_id`` often is) or an iterable of integers; numpy and tensor
    integers are taken, anything else is an InputError."""
    if value is None:
        return frozenset()
    if not isinstance(value, bool):
        try:
            return frozenset({operator.index(value)})
        except TypeError:
            pass
    try:
        items = list(value)
    except TypeError:
        raise InputError(f"eos_token_ids={value!r} ({type(value).__name__}) must be None, a token id or an "
                         "iterable of token ids") from None
    out = set()
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.add(operator.index(t))
        except TypeError:
            raise InputError(f"eos_token_ids={value!r} holds {t!r} ({type(t).__name__}); token ids are "
                             "integers") from None
    return frozenset(out)


def _counts(name: str, value: Any, n: int, low: int | None) -> list[int]:
    """`value` (one integer, or one a prompt) as `n` Python ints, each >= `low` when given;
    numpy and 0-d tensor integers are taken (`operator.index`), floats and NaN are not."""
    try:
        values = [operator.index(value)] * n if not isinstance(value, bool) else [value] * n
    except TypeError:  # a sequence (a list, a tuple, a 1-D array or tensor)
        try:
            values = list(value)
        except TypeError:
            raise InputError(f"{name}={value!r} ({type(value).__name__}) must be an integer or one a prompt") from None
    if len(values) != n:
        raise InputError(f"{name} has {len(values)} entries for {n} prompts; give one per prompt")
    out = []
    for v in values:
        try:
            if isinstance(v, bool):
                raise TypeError
            v = operator.index(v)
        except TypeError:
            raise InputError(f"{name}={value!r} holds {v!r} ({type(v).__name__}); give integers") from None
        if low is not None and v < low:
            raise InputError(f"{name}={value!r} must be >= {low}")
        out.append(v)
    return out


def _cache_owner(forward: Any) -> Any:
    """The model whose KV cache `forward` writes, found through a pw.compile'd model (``.module``)
    and a backbone (``.decoder``): the module that has a config with ``max_num_seqs`` and
    ``max_seq_len`` (`LlamaForCausalLM`), else None."""
    seen, todo = set(), [forward]
    while todo:
        holder = todo.pop(0)
        if holder is None or id(holder) in seen:
            continue
        seen.add(id(holder))
        own = getattr(holder, "config", None)
        if all(isinstance(getattr(own, f, None), int) for f in ("max_num_seqs", "max_seq_len")):
            return holder
        todo += [getattr(holder, "module", None), getattr(holder, "decoder", None)]
    return None


#: models a `greedy_decode` run is using: two runs at once would hand out the same cache slots
_busy: weakref.WeakSet[Any] = weakref.WeakSet()
_busy_lock = threading.Lock()


@contextlib.contextmanager
def _running(owner: Any) -> Iterator[None]:
    """Hold `owner`'s KV cache for one run.

    Raises:
        InputError: another `greedy_decode` run (another thread, or a forward that starts one) is
            using it: both would write the same slots.
    """
    if owner is None:
        yield
        return
    with _busy_lock:
        if owner in _busy:
            raise InputError(f"greedy_decode on {type(owner).__name__} while another greedy_decode on it runs (another "
                             "thread, or nested in its forward): both would write the same KV-cache slots. Serve "
                             "every request from one loop (they batch), or give each loop a model of its own")
        _busy.add(owner)
    try:
        yield
    finally:
        with _busy_lock:
            _busy.discard(owner)


def _serve(forward: Forward, prompts: Sequence[Sequence[int]], limits: list[int], arrivals: list[int],
           max_num_seqs: int, device: torch.device | str, eos: frozenset[int], max_num_tokens: int | None,
           compute_logits: Callable[[torch.Tensor], torch.Tensor] | None) -> DecodeResult:
    """The loop of `greedy_decode`, its arguments checked."""
    waiting = deque(sorted(range(len(prompts)), key=lambda i: (arrivals[i], i)))
    free_slots = list(range(max_num_seqs))
    running: list[_Request] = []
    tokens: list[list[int]] = [[] for _ in prompts]
    result = DecodeResult(tokens, [], [], [""] * len(prompts))
    step = 0
    while waiting or running:
        if not running and arrivals[waiting[0]] > step:
            step = arrivals[waiting[0]]
        while waiting and free_slots and arrivals[waiting[0]] <= step:
            i = waiting.popleft()
            running.append(_Request(i, free_slots.pop(0), list(prompts[i]), 0, tokens[i], limits[i]))
        for r in _run_step(forward, running, device, result, max_num_tokens, compute_logits):
            if r.generated[-1] not in eos and len(r.generated) < r.max_new_tokens:
                continue
            result.stop_reasons[r.index] = "eos" if r.generated[-1] in eos else "length"
            free_slots.append(r.slot)
            running.remove(r)
        free_slots.sort()  # reuse low slots first, so runs are reproducible regardless of finish order
        step += 1
    return result


def _run_step(forward: Forward, running: list[_Request], device: torch.device | str, result: DecodeResult,
              budget: int | None, compute_logits: Callable[[torch.Tensor], torch.Tensor] | None) -> list[_Request]:
    """Feed running requests' pending tokens as one flattened batch, at most `budget` tokens in
    admission order, and append one token to each request fed all of its pending tokens; returns those."""
    ids, positions, seq_ids, last_rows, fed = [], [], [], [], []
    left = budget if budget is not None else sum(len(r.pending) for r in running)
    for r in running:
        take = min(len(r.pending), left)
        if take == 0:
            continue
        left -= take
        ids += r.pending[:take]
        positions += range(r.next_position, r.next_position + take)
        seq_ids += [r.slot] * take
        last_rows.append(len(ids) - 1)
        fed.append((r, take))
    def as_tensor(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=device)

    inputs = as_tensor(ids), as_tensor(positions), as_tensor(seq_ids)
    rows = as_tensor(last_rows)
    # a step of one token per request (decode steps; one-token prompts or prompt chunks too) is a
    # uniform batch: declared, so a model compiled with cudagraph_mode="full_and_piecewise" replays
    # one full graph for it (a step with more tokens for some request: pieces)
    uniform = batch_hint(uniform_decode=all(take == 1 for _, take in fed))
    start = time.perf_counter()
    with torch.no_grad(), uniform:
        out = forward(*inputs)
        logits = out[rows] if compute_logits is None else compute_logits(out[rows])
        next_ids = logits.argmax(dim=-1).tolist()  # .tolist() waits for the device
    result.step_seconds.append(time.perf_counter() - start)
    result.step_sizes.append(len(ids))
    generated = []
    for (r, take), token in zip(fed, next_ids):
        r.next_position += take
        r.pending = r.pending[take:]
        if not r.pending:  # else a chunk of a longer prefill: its last row predicts nothing yet
            r.pending = [token]
            r.generated.append(token)
            generated.append(r)
    return generated
