"""Capture-size planner: from an observed histogram of batch sizes and a budget (graph count
and/or bytes), the capture sizes with the least expected padding. Split from `capture_sizes`, whose
schedules and padding metrics it uses."""

from __future__ import annotations
import dataclasses
import logging
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple
from ..errors import ConfigError

from .capture_sizes import check_histogram, check_positive_int, check_size_list

__all__ = ["plan_capture_sizes"]

log = logging.getLogger("piecewise")


# -- the planner -------------------------------------------------------------------------------
def plan_capture_sizes(histogram: Mapping[int, float], *, max_graphs: int | None = None, max_bytes: float | None = None,
                       bytes_per_token: float | Callable[[int], float] | None = None,
                       must_include: Iterable[int] = (), search_limit: int = 5_000_000) -> list[int]:
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
    candidates). Linear in ``s`` because a graph's activations and outputs scale with its rows;
    measure the slope from the pool bytes a capture reports (docs/design.md §6.7). Additive, so
    conservative: with one shared pool, smaller graphs reuse blocks the largest one reserved and
    the real total is lower. A callable can add a fixed per-graph overhead.

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
      with ``i``, queries ``x = p_j`` rise): O(max_graphs * M) in all; for
      M = 4000, max_graphs = 200, about 1 s. A forced size resets the envelope, so no step skips one.
    - `max_bytes`: a resource-constrained shortest path, for which no polynomial exact method is
      known in general, so: (1) relax bytes with a multiplier ``lam`` (minimise
      ``waste + lam * bytes``, O(M) per ``lam`` with the same envelope) and bisect ``lam``; the
      relaxed optima, trimmed or topped up greedily to fit, give the best feasible schedule so far,
      and ``min(waste + lam * bytes) - lam * max_bytes`` a lower bound. (2) If they meet, done.
      (3) Else run the DP above keeping, per end size (and per graph count when `max_graphs` is
      also set), the Pareto front of (bytes, waste), dropping every partial schedule whose relaxed
      completion bound cannot beat the best feasible one. Exact. Measured on one CPU core: 256 or
      512 distinct sizes, under 0.3 s; 1024 (counts ~ 1/n), ~2 s; 3000, ~5 s. The worst case
      grows with the number of distinct byte totals, so the search stops after `search_limit`
      partial schedules and returns the best feasible schedule found, with a warning giving its
      proven distance from the optimum.

    Raises `ConfigError`: no budget given; `max_bytes` without `bytes_per_token` or the reverse; a
    non-positive or non-integer `max_graphs`, `search_limit`, size or key; a negative or non-finite count, byte
    value or budget; a histogram with no positive count; a budget too small for the forced sizes
    (naming what they need).
    """
    check_positive_int("search_limit", search_limit)
    hist = check_histogram(histogram)
    if not hist:
        raise ConfigError("histogram holds no batch size with a positive count; record some traffic before planning")
    forced_sizes = set(check_size_list("must_include", must_include)) | {max(hist)}
    if max_graphs is None and max_bytes is None:
        raise ConfigError("plan_capture_sizes needs a budget: pass max_graphs=<count> or max_bytes=<bytes> "
                          "(with bytes_per_token)")
    if max_graphs is not None:
        check_positive_int("max_graphs", max_graphs)
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
            chain = _plan_by_bytes(prob, max_bytes, max_graphs, search_limit)
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
    """A schedule of the candidates up to ``index`` (its largest), as a linked list. ``reduced`` is
    ``waste + lam * nbytes``, the order fronts are kept in."""

    reduced: float
    nbytes: float
    waste: float
    graphs: int
    index: int
    parent: _Partial | None


def _greedy_fill(prob: _Problem, chain: list[int], max_bytes: float, max_graphs: int | None) -> list[int]:
    """`chain` plus candidates added one at a time, each the one that cuts the most padding among
    those that still fit both budgets: a cheap way to spend what a relaxed optimum leaves over."""
    P, C, cost = prob.points, prob.C, prob.cost
    chosen = [False] * (prob.m + 1)
    for j in chain:
        chosen[j] = True
    nbytes, count = prob.bytes_of(chain), len(chain)
    while max_graphs is None or count < max_graphs:
        nxt = [0] * (prob.m + 1)  # nxt[t]: the chosen candidate after t (the last one is chosen)
        for t in range(prob.m - 1, 0, -1):
            nxt[t] = t + 1 if chosen[t + 1] else nxt[t + 1]
        best_gain, best_t, prev = 0.0, 0, 0
        for t in range(1, prob.m + 1):
            if chosen[t]:
                prev = t
                continue
            # Sizes in (p_prev, p_t] now pad to p_t instead of p_nxt.
            gain = (P[nxt[t]] - P[t]) * (C[t] - C[prev])
            if gain > best_gain and nbytes + cost[t] <= max_bytes:
                best_gain, best_t = gain, t
        if not best_t:
            break
        chosen[best_t] = True
        nbytes += cost[best_t]
        count += 1
    return [j for j in range(1, prob.m + 1) if chosen[j]]


def _greedy_trim(prob: _Problem, chain: list[int], max_bytes: float) -> list[int]:
    """`chain` less non-forced candidates until it fits `max_bytes`: a single removal that makes it
    fit with the least added padding if there is one, else the removal adding least padding per
    byte saved. Repairs a relaxed optimum that overshoots the budget by a little."""
    P, C, cost = prob.points, prob.C, prob.cost
    chain = list(chain)
    nbytes = prob.bytes_of(chain)
    while nbytes > max_bytes:
        fits, ratio = (math.inf, -1), (math.inf, -1)
        for k, r in enumerate(chain[:-1]):  # the last candidate is forced
            if prob.forced[r] or cost[r] <= 0:
                continue
            prev = chain[k - 1] if k else 0
            # Sizes in (p_prev, p_r] now pad to the next chosen size instead of p_r.
            loss = (P[chain[k + 1]] - P[r]) * (C[r] - C[prev])
            if nbytes - cost[r] <= max_bytes:
                fits = min(fits, (loss, k))
            ratio = min(ratio, (loss / cost[r], k))
        k = fits[1] if fits[1] >= 0 else ratio[1]
        if k < 0:
            break  # only forced sizes left; they were checked to fit
        nbytes -= cost[chain.pop(k)]
    return chain


def _plan_by_bytes(prob: _Problem, max_bytes: float, max_graphs: int | None, search_limit: int) -> list[int]:
    """Least-padding chain within `max_bytes` (and `max_graphs` when set): exact unless the search
    creates more than `search_limit` partial schedules (then the best found, with a warning)."""
    # (1) Feasible schedules (relaxed optima, count-DP optima, each topped up greedily) give the
    # incumbent; the relaxation and the count DP give lower bounds.
    incumbent: tuple[float, float, int, list[int]] | None = None  # (waste, bytes, graphs, chain)

    def offer(chain: list[int]) -> None:
        nonlocal incumbent
        if prob.bytes_of(chain) > max_bytes or (max_graphs is not None and len(chain) > max_graphs):
            return
        chain = _greedy_fill(prob, chain, max_bytes, max_graphs)
        key = (prob.waste_of(chain), prob.bytes_of(chain), len(chain), chain)
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

    if max_graphs is not None:  # the count-only optimum is a lower bound, each k's maybe feasible
        finals, args = _count_layers(prob, max_graphs)
        count_bound = min(finals)
        for k, value in enumerate(finals, start=1):
            if value < math.inf:
                offer(_chain_of(args, k, prob.m))
    offer([j for j in range(1, prob.m + 1) if prob.forced[j]])
    lo, hi = 0.0, 1.0 / max(1.0, max(prob.cost))
    for _ in range(200):  # grow until the relaxed optimum fits; its bytes fall as lam rises
        if relax(hi):
            break
        lo, hi = hi, hi * 2.0
    for _ in range(40):
        mid = (lo + hi) / 2.0
        if relax(mid):
            hi = mid
        else:
            lo = mid
    offer(_greedy_trim(prob, _relaxed(prob, lo)[1], max_bytes))  # the overshooting side, trimmed
    assert incumbent is not None, "the forced sizes alone were checked to fit"
    tol = 1e-9 * max(1.0, abs(incumbent[0]))
    if incumbent[0] <= max(count_bound, relaxed_bound) + tol:
        return incumbent[3]

    # (2) Pareto DP over (bytes, waste), per graph count when max_graphs is set. A partial schedule
    # ending at j survives only if its relaxed completion bound can still beat the incumbent:
    # reduced + pad + lam * cost_j + L[j] - lam * max_bytes <= incumbent. Fronts are kept in
    # ascending reduced cost, so each (i, j) pair reads only the entries that pass.
    lam, limit = best_lam, incumbent[0] + tol
    L = _completion_bounds(prob, lam)
    m, cost = prob.m, prob.cost
    rest_bytes, rest_graphs = [0.0] * (m + 1), [0] * (m + 1)  # what the forced sizes after j need
    for j in range(m - 1, -1, -1):
        rest_bytes[j] = rest_bytes[j + 1] + (cost[j + 1] if prob.forced[j + 1] else 0.0)
        rest_graphs[j] = rest_graphs[j + 1] + prob.forced[j + 1]
    layered = max_graphs is not None
    fronts: list[dict[int, list[_Partial]]] = [{} for _ in range(m + 1)]
    fronts[0] = {0: [_Partial(0.0, 0.0, 0.0, 0, 0, None)]}
    new = tuple.__new__  # skips NamedTuple's Python-level __new__: millions of partials
    by_bytes, by_reduced = operator.attrgetter("nbytes", "waste", "graphs"), operator.attrgetter("reduced")
    lo_index, created = 0, 0
    for j in range(1, m + 1):
        budget = max_bytes - rest_bytes[j]
        step = lam * cost[j]
        candidates: dict[int, list[_Partial]] = {}
        for i in range(lo_index, j):
            pad = prob.pad(i, j)
            threshold = limit + lam * max_bytes - pad - step - L[j]
            for layer, entries in fronts[i].items():
                if entries[0].reduced > threshold or (layered and layer + 1 + rest_graphs[j] > max_graphs):
                    continue
                out = candidates.setdefault(layer + 1 if layered else 0, [])
                for e in entries:  # ascending reduced cost
                    if e.reduced > threshold:
                        break
                    nbytes = e.nbytes + cost[j]
                    if nbytes <= budget:
                        out.append(new(_Partial, (e.reduced + pad + step, nbytes, e.waste + pad, e.graphs + 1, j, e)))
        created += sum(len(entries) for entries in candidates.values())
        if created > search_limit:
            gap = incumbent[0] - max(count_bound, relaxed_bound)
            log.warning("plan_capture_sizes stopped its exact search after %d partial schedules (search_limit=%d); "
                        "the schedule returned pads %.6g rows, at most %.6g more than the optimum; raise "
                        "search_limit for the exact answer", created, search_limit, incumbent[0], gap)
            return incumbent[3]
        for key, entries in candidates.items():
            entries.sort(key=by_bytes)
            front, least = [], math.inf
            for e in entries:
                if e.waste < least:
                    front.append(e)
                    least = e.waste
            if front:
                front.sort(key=by_reduced)
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
