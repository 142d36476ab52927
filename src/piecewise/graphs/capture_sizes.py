"""Capture sizes: which batch sizes get a graph, and how a runtime size is padded to one (docs/design.md §6.4,
§6.5).

A *capture size* is a row count (tokens; for replay batches, rows) for which a graph is captured. A
call of ``n`` rows is padded to the smallest capture size ``>= n``; above the largest it runs without
graphs. Everything here is pure Python over ints: no torch, no device.

- `default_capture_sizes`: the decode schedule (1, 2, 4, every 8 to 256, every 16 beyond).
- `windowed_capture_sizes`: the schedule for replay batches holding ``w`` rows per request.
- `validate_capture_sizes`: drop sizes above ``max_num_tokens`` (with a warning), log the result.
- `pad_to_capture_size` / `PaddingTable`: the padding rule, and its O(1) hot-path form.
- (`piecewise.graphs.planner.plan_capture_sizes`, a module of its own: the sizes that minimise
  expected padding for an observed histogram of batch sizes under a budget of graphs or bytes.)
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
from collections.abc import Iterable, Mapping

from ..errors import ConfigError, InputError

__all__ = [
    "default_capture_sizes",
    "windowed_capture_sizes",
    "validate_capture_sizes",
    "pad_to_capture_size",
    "PaddingTable",
    "PaddingStats",
    "padding_stats",
    "padding_waste",
    "padding_fraction",
]

log = logging.getLogger("piecewise")


# -- validation helpers ------------------------------------------------------------------------
def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


def check_size_list(name: str, sizes: Iterable[int]) -> list[int]:
    """`sizes` as a sorted, deduplicated list of positive ints; `ConfigError` on anything else."""
    if isinstance(sizes, (int, str, bytes)) or not isinstance(sizes, Iterable):
        raise ConfigError(f"{name}={sizes!r} must be a list of positive integers, e.g. {name}=[1, 2, 4, 8]")
    out = set()
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(f"{name} holds {s!r}; every capture size must be a positive integer")
        out.add(s)
    return sorted(out)


def check_histogram(histogram: Mapping[int, float]) -> dict[int, float]:
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
    top = check_positive_int("max_capture_size", max_capture_size)
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
    `w` or a power of two >= `w`. For other `w` it does not: with ``w = 3`` the step becomes 4 from
    33 on (33, 37, 41, ...). The rule above is what docs/design.md §6.5 fixes, so it is the default;
    ``whole_requests=True`` rounds each step up to the next multiple of `w` instead (6 instead of
    4, 258 instead of 256 for ``w = 3``; unchanged for a power of two), so every stepped size is a
    whole number of requests. The bound is kept as is either way: it is a multiple of `w` unless
    `max_capture_size` is not, so choose one that is.

    Raises `ConfigError` when an argument is not a positive int, when `max_capture_size` < `w`
    (no batch of even one request fits), or when the largest size exceeds
    `max_num_batched_tokens` (such a graph could never be replayed).
    """
    w = check_positive_int("w", w)
    max_capture_size = check_positive_int("max_capture_size", max_capture_size)
    max_num_seqs = check_positive_int("max_num_seqs", max_num_seqs)
    max_num_batched_tokens = check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
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
    max_num_tokens = check_positive_int("max_num_tokens", max_num_tokens)
    all_sizes = check_size_list("capture_sizes", sizes)
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
        self.sizes: tuple[int, ...] = tuple(check_size_list("capture_sizes", sizes))
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
    table = check_size_list("schedule", schedule)
    hist = check_histogram(histogram)
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
