"""Process-wide tallies of compile work, for tests and logs.

`counters` is the single instance. `counters.expect(**deltas)` asserts how much a block of code
did: ``with counters.expect(pieces_compiled=3, recompiles=0): model(x)``. Backends also keep
per-tag tallies (`counters.by_tag[tag]`), so several compiled regions can be told apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import defaultdict
from collections.abc import Iterator

__all__ = ["Counters", "counters", "CounterMismatch"]


class CounterMismatch(AssertionError):
    """A `Counters.expect` block did not do the expected work."""


@dataclasses.dataclass
class _Tally:
    graphs_seen: int = 0  # graphs handed to a piecewise backend by Dynamo
    dynamo_traces: int = 0  # Dynamo traces run by piecewise.compile
    pieces_seen: int = 0  # pieces produced by splitting (splitting and compiled)
    pieces_compiled: int = 0  # non-splitting pieces given compiled callables
    splitting_pieces: int = 0
    compiler_invocations: int = 0  # adaptor.compile calls (general, per range, per size)
    recompiles: int = 0  # a second graph for a region: Dynamo recompiled, or module state changed after compile
    state_changes: int = 0  # module state the trace read changed after compile (followed by a new trace)
    size_class_traces: int = 0  # sizes the first trace does not hold for, served by a trace of their own (not recompiles)
    fallbacks: int = 0  # piecewise mode fell back to a single piece
    cache_hits: int = 0
    cache_misses: int = 0
    cache_loads: int = 0  # artifacts loaded from disk
    artifacts_saved: int = 0
    cache_errors: int = 0  # bad entries found (reported, moved aside)
    bundle_hits: int = 0  # warm starts rebuilt from a bundle, without a trace
    bundle_misses: int = 0  # first calls that looked for a bundle and traced instead
    bundles_saved: int = 0
    capturable_pieces: int = 0
    graphs_captured: int = 0
    recaptures: int = 0  # every size captured again because a weight or buffer graphs read in place moved
    padding_refusals: int = 0  # graphs turned off: padding a call changed its real rows (graphs.dispatch)
    graph_replays: int = 0
    layout_mismatches: int = 0  # splitting ops returning other strides than their fake: outputs copied (piece.SplittingRunner)
    weights_packed: int = 0  # linear weights packed for oneDNN (passes.packed_linear: first use, after an in-place write)
    eager_above_capture: int = 0  # calls above the largest capture size
    remote_pulls: int = 0  # entries copied from the remote tier into the local store
    remote_publishes: int = 0  # entries published to the remote tier
    remote_rejects: int = 0  # remote entries or artifacts refused (signature, sha256, format)
    remote_errors: int = 0  # failed calls to the remote tier (each rests it; see cache.remote.REST_S)
    remote_waits: int = 0  # compiles that waited for another process's compile lease


FIELDS = tuple(f.name for f in dataclasses.fields(_Tally))


class Counters(_Tally):
    """Process-wide tallies of compile work (each field an ``int``, counted since the process
    started or the last `reset`); see the module doc and the counters reference for each field.
    Thread-safe increments through `bump`; `expect` asserts deltas and raises `CounterMismatch`.

    Examples:
        >>> import torch, piecewise as pw
        >>> compiled = pw.compile(torch.nn.Linear(4, 4), pw.CompilationConfig(backend="eager", tag="counted"),
        ...                       dynamic_arg_dims={"input": 0})
        >>> with pw.counters.expect(dynamo_traces=1):
        ...     _ = compiled(torch.randn(3, 4))        # the first call traces
        >>> with pw.counters.expect(dynamo_traces=0, recompiles=0):
        ...     _ = compiled(torch.randn(5, 4))        # another size: no trace, no recompile
        >>> pw.counters.by_tag[compiled.tag].dynamo_traces
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.by_tag: dict[str, _Tally] = defaultdict(_Tally)

    def bump(self, name: str, n: int = 1, tag: str | None = None) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)
            if tag is not None:
                t = self.by_tag[tag]
                setattr(t, name, getattr(t, name) + n)

    def snapshot(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in FIELDS}

    def reset(self) -> None:
        with self._lock:
            for f in FIELDS:
                setattr(self, f, 0)
            self.by_tag.clear()

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly the given amount.

        Raises:
            ValueError: a name is not a counter.
            CounterMismatch: listing every counter whose delta differs (on normal exit only).
        """
        unknown = sorted(set(deltas) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown counter(s) {unknown}; known: {list(FIELDS)}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        wrong = {k: (after[k] - before[k], v) for k, v in deltas.items() if after[k] - before[k] != v}
        if wrong:
            parts = ", ".join(f"{k}: got {got}, expected {exp}" for k, (got, exp) in wrong.items())
            raise CounterMismatch(f"counter deltas differ: {parts}")

    def delta_since(self, before: dict[str, int]) -> dict[str, int]:
        now = self.snapshot()
        return {k: now[k] - before[k] for k in FIELDS if now[k] != before[k]}


counters = Counters()
