"""Per-piece graph capture and replay (docs/design.md §6.3).

A `PieceGraphWrapper` stands in for one callable (a compiled piece, or the whole model in full
mode) and keeps one `GraphEntry` per padded size. The forward context says whether this call
replays graphs of the wrapper's kind and at which size; an entry then moves through named phases:
warming up (the callable runs eagerly `num_warmups` times), captured (replayed from then on), or
failed (the size is dropped from the padding table; it never replays).

Input binding is decided once, at capture. An argument whose address is known to stay put (a
static input buffer, a weight or cache passed to the model, an output of a captured graph - the
runner's `stable_ptrs`) is bound in place; its address is recorded and checked on the first replay
of every size (on every replay in debug mode), and a moved input raises `CaptureError` instead of
reading stale memory. Any other argument (the fresh output of an eager splitting op) is copied into
a buffer the entry owns before each replay; a splitting op that writes into an output argument
instead of allocating one avoids that copy.

Output lifetime: a replay returns the tensors written during capture. Graphs of all sizes share
one pool, so those tensors are valid until the next forward of the same model; clone what must
outlive it. Intermediate outputs (read by a later piece) are held strongly by their entry.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..counters import counters
from ..errors import CaptureError
from ..forward_context import RuntimeMode, current_forward_context
from .platform import GraphPlatform, no_gc_during_capture

__all__ = ["Phase", "GraphEntry", "GraphPool", "PieceGraphWrapper"]

log = logging.getLogger("piecewise")


class Phase(enum.Enum):
    WARMING_UP = "warming up"
    CAPTURED = "captured"
    FAILED = "failed"


@dataclasses.dataclass
class GraphEntry:
    """One size of one wrapper."""

    size: int
    phase: Phase = Phase.WARMING_UP
    warmups_done: int = 0
    graph: Any = None
    output: Any = None
    input_addresses: tuple[int, ...] = ()
    copied: tuple[tuple[int, torch.Tensor], ...] = ()  # (arg index, owned buffer) refreshed per replay
    checked: bool = False
    pool_bytes: int = 0


def _addresses(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else -1 for a in args)


class GraphPool:
    """State shared by the wrappers of one backend instance: the platform, the pool (owned by this
    instance, not a class, so a second model captures cleanly after the first is freed), sizes
    removed after a failed capture, and pool bytes per size."""

    def __init__(self, platform: GraphPlatform, *, num_warmups: int = 1, debug: bool = False, tag: str = "") -> None:
        self.platform = platform
        self.pool = platform.new_pool()
        self.num_warmups = num_warmups
        self.debug = debug
        self.tag = tag
        self.failed_sizes: set[int] = set()
        self.out_of_memory = False
        self.pool_bytes: dict[int, int] = {}
        self.stable_ptrs: set[int] = set()
        self.on_size_failed: Callable[[int], None] | None = None
        #: replays since the last `flush_replays` (a plain int per replay; the shared, locked
        #: counters are bumped once per forward instead of once per piece)
        self.replays = 0

    def flush_replays(self) -> None:
        """Add the replays of the forward that just ran to ``counters.graph_replays``."""
        if self.replays:
            n, self.replays = self.replays, 0
            counters.bump("graph_replays", n, tag=self.tag)

    def fail_size(self, size: int, why: str) -> None:
        if size in self.failed_sizes:
            return
        self.failed_sizes.add(size)
        warnings.warn(f"[{self.tag}] graph capture failed at size {size} ({why}); that size now pads to the next "
                      "captured size or runs without graphs", RuntimeWarning, stacklevel=4)
        if self.on_size_failed is not None:
            self.on_size_failed(size)

    def reset(self) -> None:
        """Forget captured state (the wrappers drop their entries): addresses, failures, pool sizes."""
        self.failed_sizes.clear()
        self.out_of_memory = False
        self.pool_bytes.clear()
        self.stable_ptrs.clear()
        self.pool = self.platform.new_pool()

    @property
    def total_pool_bytes(self) -> int:
        return sum(self.pool_bytes.values())


class PieceGraphWrapper:
    """Captures `runnable` per padded size when the forward context's runtime mode is `mode`;
    otherwise calls it directly (so a full-graph wrapper and piece wrappers nest)."""

    def __init__(self, runnable: Callable[..., Any], runner: GraphPool, *, mode: RuntimeMode, first: bool, name: str) -> None:
        self.runnable = runnable
        self.runner = runner
        self.mode = mode
        self.first = first
        self.name = name
        self.entries: dict[int, GraphEntry] = {}

    def __call__(self, *args: Any) -> Any:
        ctx = current_forward_context()
        if ctx is None or ctx.runtime_mode != self.mode or ctx.batch_descriptor is None:
            return self.runnable(*args)
        size = ctx.batch_descriptor.num_tokens
        entry = self.entries.get(size)
        if entry is None:
            entry = self.entries[size] = GraphEntry(size)
        if entry.phase is Phase.CAPTURED:
            if not entry.checked or self.runner.debug:
                self._check_addresses(entry, args)
            for i, buf in entry.copied:
                buf.copy_(args[i])
            entry.graph.replay()
            self.runner.replays += 1
            return entry.output
        if entry.phase is Phase.FAILED or size in self.runner.failed_sizes:
            entry.phase = Phase.FAILED
            return self.runnable(*args)
        if entry.warmups_done < self.runner.num_warmups:
            entry.warmups_done += 1
            try:
                return self.runnable(*args)
            except Exception as e:
                raise CaptureError(f"[{self.runner.tag}] {self.name} failed in its warm-up run at size {size}: "
                                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        return self._capture(entry, args)

    def _capture(self, entry: GraphEntry, args: tuple[Any, ...]) -> Any:
        runner, platform = self.runner, self.runner.platform
        if runner.out_of_memory:
            entry.phase = Phase.FAILED
            return self.runnable(*args)
        copied = tuple((i, a.clone()) for i, a in enumerate(args)
                       if isinstance(a, torch.Tensor) and a.data_ptr() not in runner.stable_ptrs)
        bound = list(args)
        for i, buf in copied:
            bound[i] = buf
        graph = platform.new_graph()
        before = platform.memory_allocated()
        try:
            with no_gc_during_capture(not self.first):
                output = platform.capture(graph, runner.pool, self.runnable, tuple(bound), flush=self.first)
        except Exception as exc:  # any capture failure drops the size; an OOM drops the rest too
            entry.phase = Phase.FAILED
            oom = platform.is_oom(exc)
            if oom:
                runner.out_of_memory = True
            runner.fail_size(entry.size, "out of memory; skipping the remaining sizes" if oom else f"{type(exc).__name__}: {exc}")
            return self.runnable(*args)
        entry.pool_bytes = max(0, platform.memory_allocated() - before)
        runner.pool_bytes[entry.size] = runner.pool_bytes.get(entry.size, 0) + entry.pool_bytes
        entry.graph, entry.output, entry.copied = graph, output, copied
        entry.input_addresses = _addresses(tuple(None if any(i == j for j, _ in copied) else a for i, a in enumerate(args)))
        outs = output if isinstance(output, (tuple, list)) else (output,)
        runner.stable_ptrs.update(o.data_ptr() for o in outs if isinstance(o, torch.Tensor))
        entry.phase = Phase.CAPTURED
        counters.bump("graphs_captured", tag=runner.tag)
        log.debug("[%s] captured %s at size %d (%d bytes)", runner.tag, self.name, entry.size, entry.pool_bytes)
        # Capture records without computing; replay once so this call returns real values.
        graph.replay()
        return output

    def _check_addresses(self, entry: GraphEntry, args: tuple[Any, ...]) -> None:
        copied = {i for i, _ in entry.copied}
        now = _addresses(tuple(None if i in copied else a for i, a in enumerate(args)))
        if now != entry.input_addresses:
            bad = [i for i, (a, b) in enumerate(zip(now, entry.input_addresses)) if a != b]
            raise CaptureError(
                f"[{self.runner.tag}] {self.name} at size {entry.size}: input(s) {bad} moved since capture; a graph "
                "replays fixed addresses. Pass weights and caches that stay in place (no reassignment of tensors "
                "read by the model), or recompile"
            )
        entry.checked = True
