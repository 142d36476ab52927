"""Capture sizes: which batch sizes get a graph, and how a runtime size is padded to one (SPEC §6.4,
§6.5).

A *capture size* is a row count (tokens; for replay batches, rows) for which a graph is captured. A
call of ``n`` rows is padded to the smallest capture size ``>= n``; above the largest it runs without
graphs. Everything here is pure Python over ints: no torch, no device.

- `default_capture_sizes`: the decode schedule (1, 2, 4, every 8 to 256, every 16 beyond).
- `windowed_capture_sizes`: the schedule for replay batches holding ``w`` rows per request.
- `validate_capture_sizes`: drop sizes above ``max_num_tokens`` (with a warning), log the result.
- `pad_to_capture_size` / `PaddingTable`: the padding rule, and its O(1) hot-path form.
- `plan_capture_sizes`: the sizes that minimise expected padding for an observed histogram of batch
  sizes under a budget of graphs or bytes.
- `padding_stats` / `padding_waste` / `padding_fraction`: what a schedule costs on a histogram.

Units: every size and every "waste" is in rows (the dynamic dim, usually tokens). A histogram maps a
batch size to a count of batches (or a frequency); waste is then total pad rows over those batches (or,
for frequencies summing to 1, expected pad rows per batch).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from ..errors import ConfigError, InputError

__all__ = [
    "default_capture_sizes",
    "windowed_capture_sizes",
    "validate_capture_sizes",
    "pad_to_capture_size",
    "PaddingTable",
    "plan_capture_sizes",
    "PaddingStats",
    "padding_stats",
    "padding_waste",
    "padding_fraction",
]

log = logging.getLogger("piecewise")


# -- validation helpers ------------------------------------------------------------------------
def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


def _size_list(name: str, sizes: Iterable[int]) -> list[int]:
    """`sizes` as a sorted, deduplicated list of positive ints; `ConfigError` on anything else."""
    if isinstance(sizes, (int, str, bytes)) or not isinstance(sizes, Iterable):
        raise ConfigError(f"{name}={sizes!r} must be a list of positive integers, e.g. {name}=[1, 2, 4, 8]")
    out = set()
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(f"{name} holds {s!r}; every capture size must be a positive integer")
        out.add(s)
    return sorted(out)


def _histogram(histogram: Mapping[int, float]) -> dict[int, float]:
    """The entries of `histogram` with a positive count, keyed by size; `ConfigError` on a key that
    is not a positive int or a count that is negative, NaN or infinite."""
    if not isinstance(histogram, Mapping):
        raise ConfigError(f"histogram={histogram!r} must be a mapping of batch size -> count, e.g. {{1: 40, 8: 3}}")
    out = {}
    for n, c in histogram.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"histogram key {n!r} must be a positive integer batch size")
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c < 0:
            raise ConfigError(f"histogram count {c!r} for size {n} must be a finite number >= 0")
        if c > 0:
            out[n] = float(c)
    return out


# -- schedules ---------------------------------------------------------------------------------
def default_capture_sizes(max_capture_size: int) -> list[int]:
    """The default schedule: 1, 2, 4, then every multiple of 8 up to 256, then every multiple of 16
    up to `max_capture_size`, which is always included (never rounded down to the grid).

    This is the decode schedule serving engines ship by default (vLLM's, for one): dense where
    decode batches are small and common, coarser above 256 where a 16-row pad is a small fraction
    of the batch. ``default_capture_sizes(300)`` ends ``..., 256, 272, 288, 300``; 35 sizes up to 256.

    Returns sorted, distinct sizes, all ``<= max_capture_size``. Raises `ConfigError` unless
    `max_capture_size` is a positive int.
    """
    top = _positive_int("max_capture_size", max_capture_size)
    grid = [1, 2, 4, *range(8, 257, 8), *range(272, top + 1, 16)]
    return sorted({s for s in grid if s <= top} | {top})


def _window_step(s: int, w: int) -> int:
    # By w, or by an eighth of the power-of-two interval [2**k, 2**(k+1)) holding s once that is
    # wider: bit_length(s) = k + 1, so 2**(k - 3) = 2**(bit_length - 4).
    return max(w, 2 ** max(s.bit_length() - 4, 0))


def windowed_capture_sizes(w: int, max_capture_size: int, max_num_seqs: int, max_num_batched_tokens: int, *,
                           whole_requests: bool = False) -> list[int]:
    """The schedule for replay batches holding `w` rows per request (e.g. a decode step verifying
    ``w - 1`` draft tokens per request, so ``w`` rows each).

    Starts at `w`; from a size ``s`` the next is ``s + max(w, 2**max(s.bit_length() - 4, 0))`` (by
    `w` while that is wider, else by one eighth of the power-of-two interval holding ``s``: 256
    inside [2048, 4096)); stops at ``bound = min(max_capture_size, max_num_seqs * w)``, which is
    always included. Sorted, distinct, every size in ``[w, bound]``.

    Multiples of `w`: a batch of ``r`` requests has ``r * w`` rows, so a size that is not a multiple
    of `w` serves exactly the batches its multiple-of-`w` floor serves, with more padding, and a
    full graph of a uniform batch wants a whole number of requests. When `w` is a power of two
    (1, 2, 4, 8) the rule above keeps every stepped size a multiple of `w` on its own: the step is
    `w` or a power of two >= `w`. For other `w` (3, 5, ...) it does not (3 + ... + 256 steps), and
    the rule above is what SPEC §6.5 fixes, so it is the default. ``whole_requests=True`` rounds
    each step up to a multiple of `w` instead (258 instead of 256 for ``w = 3``), so every stepped
    size is a whole number of requests; the bound is kept as is either way (it is a multiple of
    `w` unless `max_capture_size` is not; choose one that is).

    Raises `ConfigError` when an argument is not a positive int, when `max_capture_size` < `w`
    (no batch of even one request fits), or when the largest size exceeds
    `max_num_batched_tokens` (such a graph could never be replayed).
    """
    w = _positive_int("w", w)
    max_capture_size = _positive_int("max_capture_size", max_capture_size)
    max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
    max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if max_capture_size < w:
        raise ConfigError(f"max_capture_size={max_capture_size} is below w={w} rows per request, so no batch fits; "
                          f"raise max_capture_size to at least {w}")
    bound = min(max_capture_size, max_num_seqs * w)
    if bound > max_num_batched_tokens:
        raise ConfigError(f"windowed capture schedule reaches {bound} rows (min(max_capture_size={max_capture_size}, "
                          f"max_num_seqs={max_num_seqs} * w={w})) but max_num_batched_tokens={max_num_batched_tokens}; "
                          f"raise max_num_batched_tokens to at least {bound} or lower max_capture_size / max_num_seqs")
    sizes = []
    s = w
    while s < bound:
        sizes.append(s)
        step = _window_step(s, w)
        s += -(-step // w) * w if whole_requests else step
    sizes.append(bound)
    return sizes


def validate_capture_sizes(sizes: Iterable[int], max_num_tokens: int) -> tuple[list[int], list[int]]:
    """Split `sizes` into those a model called with at most `max_num_tokens` rows can use, and the
    rest.

    Returns ``(kept, dropped)``, each sorted and distinct: ``kept`` ``<= max_num_tokens``,
    ``dropped`` above it. Logs a warning on the ``piecewise`` logger listing ``dropped`` (when any)
    and an info line with ``kept``. Raises `ConfigError` on an entry that is not a positive int, or
    on a non-positive `max_num_tokens`.
    """
    max_num_tokens = _positive_int("max_num_tokens", max_num_tokens)
    all_sizes = _size_list("capture_sizes", sizes)
    kept = [s for s in all_sizes if s <= max_num_tokens]
    dropped = [s for s in all_sizes if s > max_num_tokens]
    if dropped:
        log.warning("capture sizes %s exceed max_num_tokens=%d and are dropped; raise max_num_tokens to capture them",
                    dropped, max_num_tokens)
    log.info("capture sizes (%d): %s", len(kept), kept)
    return kept, dropped


# -- padding -----------------------------------------------------------------------------------
def pad_to_capture_size(n: int, sizes: Iterable[int]) -> int | None:
    """The smallest capture size ``>= n`` among `sizes` (any order), or None when `n` is above all
    of them (the call runs without graphs). O(len(sizes)); the hot path uses `PaddingTable`.
    Raises `InputError` for a negative `n`."""
    if n < 0:
        raise InputError(f"row count n={n} must be >= 0")
    best = None
    for s in sizes:
        if n <= s and (best is None or s < best):
            best = s
    return best


class PaddingTable:
    """`pad_to_capture_size` precomputed for every ``n`` in ``[0, max_n]``: `padded` is one list
    index on the hot path. Holds ``max_n + 1`` references (8 bytes each: 64 KiB for max_n = 8192).

    Args:
        sizes: capture sizes (any order, duplicates allowed); may be empty (nothing is padded).
        max_n: the largest row count expected, usually ``max_num_tokens``; larger ``n`` still get
            the right answer, by bisection.

    Raises `ConfigError` for a size that is not a positive int or a negative `max_n`.
    """

    __slots__ = ("sizes", "max_n", "_table")

    def __init__(self, sizes: Iterable[int], max_n: int) -> None:
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 0:
            raise ConfigError(f"max_n={max_n!r} must be an integer >= 0")
        self.sizes: tuple[int, ...] = tuple(_size_list("capture_sizes", sizes))
        self.max_n = max_n
        table: list[int | None] = []
        k = 0
        for n in range(max_n + 1):
            while k < len(self.sizes) and self.sizes[k] < n:
                k += 1
            table.append(self.sizes[k] if k < len(self.sizes) else None)
        self._table = table

    def padded(self, n: int) -> int | None:
        """The capture size a call of `n` rows runs at, or None above the largest. Raises
        `InputError` for a negative `n`."""
        if 0 <= n <= self.max_n:
            return self._table[n]
        if n < 0:
            raise InputError(f"row count n={n} must be >= 0")
        k = bisect.bisect_left(self.sizes, n)
        return self.sizes[k] if k < len(self.sizes) else None

    def __repr__(self) -> str:
        return f"PaddingTable(sizes={list(self.sizes)}, max_n={self.max_n})"


# -- what a schedule costs on a histogram ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PaddingStats:
    """What a schedule costs on a histogram; all row fields are count-weighted sums (rows).

    Attributes:
        real_rows: sum of ``count(n) * n`` over every observed ``n``.
        pad_rows: sum of ``count(n) * (pad(n) - n)`` over the ``n`` a graph covers: the waste.
        uncovered: observed sizes above the largest capture size (they run without graphs, so they
            pad nothing: zero waste, but no graph either).
        uncovered_count: total count of those batches.
    """

    real_rows: float
    pad_rows: float
    uncovered: tuple[int, ...]
    uncovered_count: float

    @property
    def computed_rows(self) -> float:
        """Rows actually run: real rows plus pad rows."""
        return self.real_rows + self.pad_rows

    @property
    def pad_fraction(self) -> float:
        """Fraction of computed rows that are padding, in [0, 1); 0.0 for an empty histogram."""
        total = self.computed_rows
        return self.pad_rows / total if total > 0 else 0.0


def padding_stats(schedule: Iterable[int], histogram: Mapping[int, float]) -> PaddingStats:
    """Pad rows, real rows and uncovered sizes of `schedule` on `histogram` (size -> count).
    Raises `ConfigError` on an invalid schedule or histogram."""
    table = _size_list("schedule", schedule)
    hist = _histogram(histogram)
    real = pad = uncovered_count = 0.0
    uncovered = []
    for n in sorted(hist):
        c = hist[n]
        real += c * n
        k = bisect.bisect_left(table, n)
        if k == len(table):
            uncovered.append(n)
            uncovered_count += c
        else:
            pad += c * (table[k] - n)
    return PaddingStats(real_rows=real, pad_rows=pad, uncovered=tuple(uncovered), uncovered_count=uncovered_count)


def padding_waste(schedule: Iterable[int], histogram: Mapping[int, float]) -> float:
    """Pad rows: sum over observed ``n`` of ``count(n) * (pad(n) - n)``; sizes above the largest
    capture size add 0 (see `padding_stats` for them). With counts, total pad rows; with
    frequencies summing to 1, expected pad rows per batch."""
    return padding_stats(schedule, histogram).pad_rows


def padding_fraction(schedule: Iterable[int], histogram: Mapping[int, float]) -> float:
    """Fraction of computed rows (real + pad; uncovered batches count their real rows) that are
    padding."""
    return padding_stats(schedule, histogram).pad_fraction


# -- the planner -------------------------------------------------------------------------------
def plan_capture_sizes(histogram: Mapping[int, float], *, max_graphs: int | None = None, max_bytes: float | None = None,
                       bytes_per_token: float | Callable[[int], float] | None = None,
                       must_include: Iterable[int] = ()) -> list[int]:
    """The capture sizes that minimise padding on an observed `histogram` under a budget.

    Objective: ``padding_waste(schedule, histogram)``, i.e. sum over observed ``n`` of
    ``count(n) * (pad(n) - n)`` rows. Constraints: every size in `must_include` is in the schedule;
    the largest observed size is in it; at most `max_graphs` sizes; total graph bytes at most
    `max_bytes`. Returns a sorted list. Among equally wasteful schedules, `max_graphs` alone
    returns one with the fewest graphs; under a byte budget which one is unspecified.

    Why the largest observed size is always captured: sizes above the largest capture size run
    without graphs and pad nothing, so "least padding" alone is won by capturing nothing. Covering
    every observed batch turns the question into the useful one, the least padding such that every
    batch seen replays a graph, and the batches it would otherwise drop are the largest, where
    running without graphs is slowest.

    Cost model (bytes): graphs cost the sum of their sizes' costs; a graph of size ``s`` costs
    ``bytes_per_token * s`` bytes, or ``bytes_per_token(s)`` when a callable is given (e.g.
    ``lambda s: fixed + per_row * s``). The cost must not decrease with ``s`` (checked over the
    candidates). Linear in ``s`` because a graph's private activations and outputs scale with its
    rows; measure the slope from the pool bytes a capture reports (SPEC §6.7).

    Why only observed sizes (and `must_include`) are candidates: take any feasible schedule and a
    size ``s`` in it that is neither. Let ``p`` be the previous size in the schedule (0 if none).
    If some observed size lies in ``(p, s]``, lower ``s`` to the largest such ``n``: the batches
    ``s`` served are exactly those in ``(p, n]``, each pads less, the others are unchanged, and a
    graph of size ``n <= s`` costs no more bytes. If none does, ``s`` serves nothing and dropping it
    loses nothing (``s`` is not the largest observed size, which is a candidate). Repeating gives a
    schedule drawn from the candidates that is no worse, so searching candidates is exact.

    Algorithm, over the ``M`` sorted candidates ``p_1 < ... < p_M`` with prefix sums ``C`` (counts)
    and ``S`` (count * size), so padding ``(p_i, p_j]`` up to ``p_j`` costs
    ``p_j * (C_j - C_i) - (S_j - S_i)`` in O(1):

    - `max_graphs` alone: ``D_k[j] = min_i D_{k-1}[i] + pad(i, j)`` for ``k <= max_graphs``. Each
      layer is O(M) with a lower envelope of the lines ``-C_i * x + D_{k-1}[i] + S_i`` (slopes fall
      with ``i``, queries ``x = p_j`` rise): O(max_graphs * M) in all, under a second for
      M = 4000, max_graphs = 200. A forced size resets the envelope, so no step skips one.
    - `max_bytes`: a resource-constrained shortest path, which has no polynomial exact algorithm in
      general, so: (1) relax bytes with a multiplier ``lam`` (minimise ``waste + lam * bytes``, O(M)
      per ``lam``) and bisect ``lam`` for the best feasible schedule and a lower bound; (2) if they
      meet, done; else (3) the DP above keeping per end size (and per graph count when `max_graphs`
      is also set) the Pareto front of (bytes, waste), pruning every partial schedule whose
      relaxed bound on completion cannot beat the best feasible one. Exact; the pruning usually
      leaves little (measured: M = 256, ~0.3 s), but the worst case is exponential in nothing
      better than the number of distinct byte totals.

    Raises `ConfigError`: no budget given; `max_bytes` without `bytes_per_token` or the reverse; a
    non-positive or non-integer `max_graphs`, size or key; a negative or non-finite count, byte
    value or budget; a histogram with no positive count; a budget too small for the forced sizes
    (naming what they need).
    """
    hist = _histogram(histogram)
    if not hist:
        raise ConfigError("histogram holds no batch size with a positive count; record some traffic before planning")
    forced_sizes = set(_size_list("must_include", must_include)) | {max(hist)}
    if max_graphs is None and max_bytes is None:
        raise ConfigError("plan_capture_sizes needs a budget: pass max_graphs=<count> or max_bytes=<bytes> "
                          "(with bytes_per_token)")
    if max_graphs is not None:
        _positive_int("max_graphs", max_graphs)
        if max_graphs < len(forced_sizes):
            raise ConfigError(f"max_graphs={max_graphs} is below the {len(forced_sizes)} sizes that must be captured "
                              f"({sorted(forced_sizes)}: must_include plus the largest observed size); "
                              f"raise max_graphs or shorten must_include")
    if (max_bytes is None) != (bytes_per_token is None):
        raise ConfigError(f"max_bytes={max_bytes!r} and bytes_per_token={bytes_per_token!r} go together; "
                          f"pass both for a byte budget, or neither")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Real)
                                  or not math.isfinite(max_bytes) or max_bytes < 0):
        raise ConfigError(f"max_bytes={max_bytes!r} must be a finite number >= 0")

    points = sorted(set(hist) | forced_sizes)
    prob = _Problem.build(points, hist, forced_sizes, bytes_per_token)
    everything = list(range(1, prob.m + 1))
    if max_bytes is None:
        chain = everything if max_graphs >= prob.m else _plan_by_count(prob, max_graphs)
    else:
        forced_bytes = sum(prob.cost[j] for j in everything if prob.forced[j])
        if forced_bytes > max_bytes:
            raise ConfigError(f"max_bytes={max_bytes} is below the {forced_bytes} bytes the sizes that must be captured "
                              f"need ({sorted(forced_sizes)}: must_include plus the largest observed size); "
                              f"raise max_bytes or shorten must_include")
        if prob.bytes_of(everything) <= max_bytes and (max_graphs is None or max_graphs >= prob.m):
            chain = everything  # zero padding, and every candidate is needed for it
        else:
            chain = _plan_by_bytes(prob, max_bytes, max_graphs)
    return [prob.points[j] for j in chain]


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The candidates, 1-indexed (index 0 is "no size yet"), with prefix sums and graph costs."""

    points: list[int]  # [0, p_1, ..., p_M], ascending
    C: list[float]  # C[j]: total count of observed sizes <= p_j
    S: list[float]  # S[j]: total count * size of observed sizes <= p_j
    forced: list[bool]  # must be in the schedule
    cost: list[float]  # bytes of a graph at p_j (0 without a byte budget)

    @property
    def m(self) -> int:
        return len(self.points) - 1

    @classmethod
    def build(cls, points: list[int], hist: dict[int, float], forced_sizes: set[int],
              bytes_per_token: float | Callable[[int], float] | None) -> _Problem:
        pts = [0, *points]
        C, S = [0.0], [0.0]
        for p in points:
            c = hist.get(p, 0.0)
            C.append(C[-1] + c)
            S.append(S[-1] + c * p)
        cost = _graph_cost(bytes_per_token, pts) if bytes_per_token is not None else [0.0] * len(pts)
        return cls(pts, C, S, [False] + [p in forced_sizes for p in points], cost)

    def pad(self, i: int, j: int) -> float:
        """Pad rows of the observed sizes in ``(p_i, p_j]`` run at ``p_j``."""
        return self.points[j] * (self.C[j] - self.C[i]) - (self.S[j] - self.S[i])

    def waste_of(self, chain: list[int]) -> float:
        return sum(self.pad(i, j) for i, j in zip([0, *chain], chain))

    def bytes_of(self, chain: list[int]) -> float:
        return sum(self.cost[j] for j in chain)


def _graph_cost(bytes_per_token: float | Callable[[int], float], points: list[int]) -> list[float]:
    """Bytes of a graph at each candidate (index 0 costs 0); `ConfigError` unless finite, >= 0 and
    non-decreasing in size."""
    if callable(bytes_per_token):
        fn = bytes_per_token
    elif isinstance(bytes_per_token, numbers.Real) and not isinstance(bytes_per_token, bool) \
            and math.isfinite(bytes_per_token) and bytes_per_token >= 0:
        def fn(s: int) -> float:
            return bytes_per_token * s
    else:
        raise ConfigError(f"bytes_per_token={bytes_per_token!r} must be a finite number >= 0 or a callable size -> bytes")
    cost = [0.0]
    for s in points[1:]:
        b = fn(s)
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) or b < 0:
            raise ConfigError(f"graph cost {b!r} for size {s} must be a finite number of bytes >= 0")
        if b < cost[-1]:
            raise ConfigError(f"graph cost falls from {cost[-1]} to {b} bytes at size {s}; the cost model must not "
                              f"decrease with size (a larger graph holds at least the activations of a smaller one)")
        cost.append(b)
    return cost


class _Envelope:
    """Lower envelope of lines ``a * x + b`` added with non-increasing slopes and queried at
    non-decreasing ``x``: amortised O(1) per add and query."""

    __slots__ = ("a", "b", "owner", "head")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.a: list[float] = []
        self.b: list[float] = []
        self.owner: list[int] = []
        self.head = 0  # lines before head lost to a later one at some query; queries only rise

    def add(self, a: float, b: float, owner: int) -> None:
        A, B = self.a, self.b
        if len(A) > self.head and A[-1] == a:  # parallel: the lower line wins everywhere
            if B[-1] <= b:
                return
            A.pop(), B.pop(), self.owner.pop()
        # The last line is never the minimum if the new one overtakes it no later than it
        # overtook its predecessor.
        while len(A) - self.head >= 2 and (b - B[-2]) * (A[-2] - A[-1]) <= (B[-1] - B[-2]) * (A[-2] - a):
            A.pop(), B.pop(), self.owner.pop()
        A.append(a), B.append(b), self.owner.append(owner)

    def query(self, x: float) -> tuple[float, int]:
        """``(min value at x, owner of the minimising line)``; ``(inf, -1)`` when empty."""
        A, B, h = self.a, self.b, self.head
        if h == len(A):
            return math.inf, -1
        while h + 1 < len(A) and A[h + 1] * x + B[h + 1] <= A[h] * x + B[h]:
            h += 1
        self.head = h
        return A[h] * x + B[h], self.owner[h]


def _count_layers(prob: _Problem, max_graphs: int, lam: float = 0.0) -> tuple[list[float], list[list[int]]]:
    """``D_k[M] + lam * bytes`` minimised for exactly k = 1..max_graphs graphs, and the back
    pointers: ``args[k - 1][j]`` is the candidate before ``j`` in the best k-graph chain ending at
    ``j``. Stops early once a layer reaches zero."""
    m, P, C, S = prob.m, prob.points, prob.C, prob.S
    prev = [math.inf] * (m + 1)
    prev[0] = 0.0
    finals, args = [], []
    env = _Envelope()
    for _ in range(max_graphs):
        cur, arg = [math.inf] * (m + 1), [-1] * (m + 1)
        env.clear()
        for j in range(1, m + 1):
            i = j - 1
            if prob.forced[i]:  # no later size may pad past a forced one
                env.clear()
            if prev[i] < math.inf:
                env.add(-C[i], prev[i] + S[i], i)
            value, owner = env.query(P[j])
            cur[j] = value + P[j] * C[j] - S[j] + lam * prob.cost[j]
            arg[j] = owner
        finals.append(cur[m])
        args.append(arg)
        if cur[m] <= 0.0:
            break
        prev = cur
    return finals, args


def _chain_of(args: list[list[int]], k: int, m: int) -> list[int]:
    chain, j = [], m
    for layer in range(k, 0, -1):
        chain.append(j)
        j = args[layer - 1][j]
    assert j == 0, "a finite layer value has a complete chain"
    return chain[::-1]


def _plan_by_count(prob: _Problem, max_graphs: int) -> list[int]:
    finals, args = _count_layers(prob, max_graphs)
    k = min(range(len(finals)), key=lambda t: (finals[t], t)) + 1  # fewest graphs among the best
    return _chain_of(args, k, prob.m)


def _relaxed(prob: _Problem, lam: float) -> tuple[float, list[int]]:
    """Minimise ``waste + lam * bytes`` over all chains (any number of graphs): O(M)."""
    m, P, C, S = prob.m, prob.points, prob.C, prob.S
    best, arg = [0.0] + [math.inf] * m, [-1] * (m + 1)
    env = _Envelope()
    for j in range(1, m + 1):
        i = j - 1
        if prob.forced[i]:
            env.clear()
        if best[i] < math.inf:
            env.add(-C[i], best[i] + S[i], i)
        value, arg[j] = env.query(P[j])
        best[j] = value + P[j] * C[j] - S[j] + lam * prob.cost[j]
    chain, j = [], m
    while j > 0:
        chain.append(j)
        j = arg[j]
    return best[m], chain[::-1]


def _completion_bounds(prob: _Problem, lam: float) -> list[float]:
    """``L[j]``: least ``waste + lam * bytes`` of the sizes after ``p_j`` in any chain from ``j`` to
    the end (any number of graphs). For a partial schedule ending at ``j`` with ``b`` bytes and
    ``w`` waste, every completion within the budget has waste ``>= w + L[j] - lam * (max_bytes - b)``."""
    m, P, C, S = prob.m, prob.points, prob.C, prob.S
    L = [math.inf] * (m + 1)
    L[m] = 0.0
    env = _Envelope()
    # L[i] = S_i + min_j (P_j * C_j - S_j + lam * cost_j + L_j) + P_j * (-C_i): lines in t = -C_i,
    # added for j = m, m-1, ... (slopes P_j fall) and queried at rising t.
    for i in range(m - 1, -1, -1):
        j = i + 1
        if prob.forced[j]:  # no chain from i may skip the forced j
            env.clear()
        if L[j] < math.inf:
            env.add(P[j], P[j] * C[j] - S[j] + lam * prob.cost[j] + L[j], j)
        value, _ = env.query(-C[i])
        L[i] = value + S[i]
    return L


class _Partial(NamedTuple):
    """A schedule of the candidates up to ``index`` (its largest), as a linked list."""

    nbytes: float
    waste: float
    graphs: int
    index: int
    parent: _Partial | None


def _plan_by_bytes(prob: _Problem, max_bytes: float, max_graphs: int | None) -> list[int]:
    """Exact least-padding chain within `max_bytes` (and `max_graphs` when set)."""
    # (1) Best feasible schedule and lower bound from the relaxation, lam bisected. A schedule
    # feasible for both budgets seeds the incumbent; with max_graphs the count DP's layers help.
    incumbent: tuple[float, float, int, list[int]] | None = None  # (waste, bytes, graphs, chain)

    def offer(chain: list[int]) -> None:
        nonlocal incumbent
        nbytes = prob.bytes_of(chain)
        if nbytes <= max_bytes and (max_graphs is None or len(chain) <= max_graphs):
            key = (prob.waste_of(chain), nbytes, len(chain), chain)
            if incumbent is None or key[:3] < incumbent[:3]:
                incumbent = key

    count_bound, relaxed_bound, best_lam = -math.inf, -math.inf, 0.0

    def relax(lam: float) -> bool:
        nonlocal relaxed_bound, best_lam
        value, chain = _relaxed(prob, lam)
        offer(chain)
        if value - lam * max_bytes > relaxed_bound:
            relaxed_bound, best_lam = value - lam * max_bytes, lam
        return prob.bytes_of(chain) <= max_bytes

    if max_graphs is not None:  # the count-only optimum of each k is a lower bound and maybe feasible
        finals, args = _count_layers(prob, max_graphs)
        count_bound = min(finals)
        for k, value in enumerate(finals, start=1):
            if value < math.inf:
                offer(_chain_of(args, k, prob.m))
    offer([j for j in range(1, prob.m + 1) if prob.forced[j]])
    lo, hi = 0.0, 1.0 / max(1.0, max(prob.cost))
    for _ in range(200):  # grow until the relaxed optimum fits; bytes of it fall as lam rises
        if relax(hi):
            break
        lo, hi = hi, hi * 2.0
    for _ in range(40):
        mid = (lo + hi) / 2.0
        if relax(mid):
            hi = mid
        else:
            lo = mid
    assert incumbent is not None, "the forced sizes alone were checked to fit"
    tol = 1e-9 * max(1.0, abs(incumbent[0]))
    if incumbent[0] <= max(count_bound, relaxed_bound) + tol:
        return incumbent[3]

    # (3) Pareto DP, pruned by the relaxed completion bound against the incumbent.
    lam, limit = best_lam, incumbent[0] + tol
    L = _completion_bounds(prob, lam)
    m, P, C, S, cost = prob.m, prob.points, prob.C, prob.S, prob.cost
    rest_bytes, rest_graphs = [0.0] * (m + 1), [0] * (m + 1)  # what the forced sizes after j need
    for j in range(m - 1, -1, -1):
        rest_bytes[j] = rest_bytes[j + 1] + (cost[j + 1] if prob.forced[j + 1] else 0.0)
        rest_graphs[j] = rest_graphs[j + 1] + prob.forced[j + 1]
    layered = max_graphs is not None
    fronts: list[dict[int, list[_Partial]]] = [{} for _ in range(m + 1)]
    fronts[0] = {0: [_Partial(0.0, 0.0, 0, 0, None)]}
    lo_index = 0
    for j in range(1, m + 1):
        budget = max_bytes - rest_bytes[j]
        candidates: dict[int, list[_Partial]] = {}
        for i in range(lo_index, j):
            pad = prob.pad(i, j)
            for layer, entries in fronts[i].items():
                if layered and layer + 1 + rest_graphs[j] > max_graphs:
                    continue
                out = candidates.setdefault(layer + 1 if layered else 0, [])
                for e in entries:  # ascending bytes
                    nbytes = e.nbytes + cost[j]
                    if nbytes > budget:
                        break
                    waste = e.waste + pad
                    if waste + L[j] - lam * (max_bytes - nbytes) <= limit:
                        out.append(_Partial(nbytes, waste, e.graphs + 1, j, e))
        for key, entries in candidates.items():
            entries.sort(key=lambda e: (e.nbytes, e.waste, e.graphs))
            front, least = [], math.inf
            for e in entries:
                if e.waste < least:
                    front.append(e)
                    least = e.waste
            if front:
                fronts[j][key] = front
        if prob.forced[j]:  # later sizes may not pad past j: earlier fronts are dead
            for i in range(lo_index, j):
                fronts[i] = {}
            lo_index = j
    finals = [e for entries in fronts[m].values() for e in entries]
    if not finals:
        return incumbent[3]
    e = min(finals, key=lambda e: (e.waste, e.nbytes, e.graphs))
    if (incumbent[0], incumbent[1], incumbent[2]) <= (e.waste, e.nbytes, e.graphs):
        return incumbent[3]
    chain = []
    while e.index > 0:
        chain.append(e.index)
        e = e.parent
    return chain[::-1]
