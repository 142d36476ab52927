"""Greedy decoding with continuous batching: the batch a model sees changes size every step.

Requests arrive at given steps and wait for a free sequence slot. A request's first step feeds its
whole prompt (prefill); every later step feeds its last generated token (decode). Prefills and
decodes of all running requests are flattened into one call of
``forward(input_ids, positions, seq_ids)``, so step sizes vary the way a serving engine's do. A
request that has generated `max_new_tokens` frees its slot for the next waiting one.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ..errors import InputError

__all__ = ["DecodeResult", "DecodeTrace", "default_trace", "greedy_decode", "make_prompts"]

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class DecodeResult:
    """What a `greedy_decode` run produced.

    Attributes:
        tokens: generated ids per request, in the order the prompts were given.
        step_sizes: `num_tokens` of each forward call, in call order.
        step_seconds: wall time of each call in seconds, including the argmax that waits for it.
    """

    tokens: list[list[int]]
    step_sizes: list[int]
    step_seconds: list[float]


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
    max_new_tokens: int,
    *,
    arrival_steps: Sequence[int] | None = None,
    max_num_seqs: int = 8,
    max_seq_len: int | None = None,
    device: torch.device | str = "cpu",
    reset: Callable[[], None] | None = None,
) -> DecodeResult:
    """Decode every prompt greedily, batching requests continuously.

    Args:
        forward: ``forward(input_ids, positions, seq_ids) -> logits``, all inputs [num_tokens]
            int64 on `device`, logits [num_tokens, vocab_size]; an eager or compiled model.
        prompts: token ids per request, each non-empty.
        max_new_tokens: tokens to generate per request (>= 1).
        arrival_steps: the step at which each request may start (default ``2 * i``: staggered).
            Waiting requests take free slots in arrival order; when nothing runs, the clock jumps
            to the next arrival rather than calling `forward` with no tokens.
        max_num_seqs: number of sequence slots; must not exceed the model's.
        max_seq_len: if given, requests needing positions beyond it are rejected up front.
        device: where the step inputs are built.
        reset: called once before the first step, e.g. ``model.reset_kv_cache``. Optional: a run
            only reads KV entries it wrote, so stale cache contents do not change its tokens.

    Raises:
        InputError: empty prompts, mismatched `arrival_steps`, or a request too long for
            `max_seq_len`.
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token; drop empty prompts")
    arrivals = list(arrival_steps) if arrival_steps is not None else [2 * i for i in range(len(prompts))]
    if len(arrivals) != len(prompts):
        raise InputError(f"arrival_steps has {len(arrivals)} entries for {len(prompts)} prompts; give one per prompt")
    if max_seq_len is not None:
        # The last generated token is never fed back, so a request needs len(prompt) + max_new_tokens - 1 positions.
        longest = max((len(p) for p in prompts), default=0) + max_new_tokens - 1
        if longest > max_seq_len:
            raise InputError(f"a request needs {longest} positions but max_seq_len={max_seq_len}; "
                             "shorten prompts or max_new_tokens")

    if reset is not None:
        reset()
    waiting = deque(sorted(range(len(prompts)), key=lambda i: (arrivals[i], i)))
    free_slots = list(range(max_num_seqs))
    running: list[_Request] = []
    tokens: list[list[int]] = [[] for _ in prompts]
    result = DecodeResult(tokens, [], [])
    step = 0
    while waiting or running:
        if not running and arrivals[waiting[0]] > step:
            step = arrivals[waiting[0]]
        while waiting and free_slots and arrivals[waiting[0]] <= step:
            i = waiting.popleft()
            running.append(_Request(i, free_slots.pop(0), list(prompts[i]), 0, tokens[i]))
        _run_step(forward, running, device, result)
        finished = [r for r in running if len(r.generated) == max_new_tokens]
        for r in finished:
            free_slots.append(r.slot)
            running.remove(r)
        free_slots.sort()  # reuse low slots first, so runs are reproducible regardless of finish order
        step += 1
    return result


def _run_step(forward: Forward, running: list[_Request], device: torch.device | str, result: DecodeResult) -> None:
    """Feed every running request's pending tokens as one flattened batch and append one token each."""
    ids, positions, seq_ids, last_rows = [], [], [], []
    for r in running:
        ids += r.pending
        positions += range(r.next_position, r.next_position + len(r.pending))
        seq_ids += [r.slot] * len(r.pending)
        last_rows.append(len(ids) - 1)
    def as_tensor(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=device)

    inputs = as_tensor(ids), as_tensor(positions), as_tensor(seq_ids)
    rows = as_tensor(last_rows)
    start = time.perf_counter()
    with torch.no_grad():
        logits = forward(*inputs)
        next_ids = logits[rows].argmax(dim=-1).tolist()  # .tolist() waits for the device
    result.step_seconds.append(time.perf_counter() - start)
    result.step_sizes.append(len(ids))
    for r, token in zip(running, next_ids):
        r.next_position += len(r.pending)
        r.pending = [token]
        r.generated.append(token)
