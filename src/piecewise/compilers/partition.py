"""The Inductor-partition split strategy: the whole graph to Inductor once, cut inside its generated
code at the splitting ops (docs/design.md §4.8).

With ``CompilationConfig(split_strategy="inductor_partition")`` the backend hands Inductor the
unsplit Dynamo graph. Inductor's scheduler partitions its generated ``call`` at every splitting-op
node (``custom_should_partition_ops``): each partition becomes a function ``partition_<i>(args)``
and the splitting ops run eagerly between them, as fallback kernels. Inductor hands each partition
function to a customised wrapper hook (``set_customized_partition_wrappers``) while it builds the
callable, at compile time and again when a saved artifact is loaded. Our hook puts a
`PartitionSlot` there: it calls the partition function until graph capture installs a
`graphs.wrapper.PieceGraphWrapper` into it, so capture sizes, padding, address checks and
counters work per partition exactly as per FX piece.

The hooks are unstable Inductor APIs, so everything is scoped to one compile or load by
`partition_scope` (a context manager that restores them on exit, exceptions included):

- ``graph_partition=True`` and ``custom_should_partition_ops`` (Inductor config patches);
- the customised partition wrapper (a process-wide slot in ``torch._inductor.utils``);
- on graphs with no GPU input, the scheduler's partition rule: Inductor only makes partitions it
  could capture as CUDA graphs, so on the CPU every node would be "non-cudagraphable" and no
  partition would exist. Here CPU nodes stay inside partitions and only splitting ops cut (the CPU
  has no graphs; the partitions are there for the fake platform of the tests and for one artifact
  format across devices). On GPU graphs Inductor's own rule stands (CPU ops, device copies,
  cudagraph-unsafe ops cut too), so nothing un-capturable lands in a captured partition.

A no-op post-grad pass with its own uuid is added to every partitioned compile, so Inductor's FX
graph cache never hands an unpartitioned graph (or one partitioned under Inductor's CPU rule) to a
partitioned compile, or the other way round.

The wrapper hook and the scheduler rule are process-wide while a scope is open: an Inductor compile
that another thread runs at the same moment sees them too (scopes themselves take turns on a lock).
Compile partitioned models from one thread at a time, as Inductor itself expects.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._torch.inductor import CustomGraphPass
from .._torch.ops import OpOverloadPacket

__all__ = ["PartitionSlot", "PartitionedCallable", "PartitionMarker", "partition_scope", "uncuttable_ops"]

_lock = threading.RLock()


class PartitionSlot:
    """Stands in for one Inductor partition function inside the compiled callable.

    Inductor calls it as ``slot(args)`` with a list of the partition's inputs (tensors and ints;
    the partition clears the list) and takes back the tuple of its outputs. Until `install` puts a
    graph wrapper in, it calls the partition function itself.

    Attributes:
        fn: Inductor's partition function, ``fn(list) -> tuple``.
        index: the partition's position in its compiled graph (0 = first).
        count: partitions in that graph.
    """

    __slots__ = ("fn", "index", "count", "call", "spec", "nested")

    def __init__(self, fn: Callable[[list[Any]], Any], index: int, count: int) -> None:
        self.fn = fn
        self.index = index
        self.count = count
        self.call: Callable[[list[Any]], Any] = fn
        #: the nesting of the partition's inputs when one is a tuple or list (a splitting op with
        #: several outputs hands its whole result to the next partition), else None
        self.spec: Any = None
        #: whether any input is a tuple or list, decided on the first call: Inductor's generated
        #: code passes the same structure on every call, and the check costs ~1 us a partition
        self.nested: bool | None = None

    def __call__(self, args: list[Any]) -> Any:
        return self.call(args)

    def unpacked(self, *leaves: Any) -> Any:
        """The partition called with its inputs flattened to positional arguments, tensors and
        numbers only (what a graph wrapper calls, binds and copies one by one)."""
        if self.spec is None:
            return self.fn(list(leaves))
        from .._torch.pytree import tree_unflatten

        return self.fn(list(tree_unflatten(list(leaves), self.spec)))

    def install(self, wrapper: Callable[..., Any]) -> None:
        """Route calls through ``wrapper(*leaves)`` (a `PieceGraphWrapper` around `unpacked`).
        Inputs nested in tuples or lists are flattened first: a wrapper binds and copies flat
        tensors, and a tuple would be bound once at capture and never refreshed."""
        from .._torch.pytree import tree_flatten

        def call(args: list[Any]) -> Any:
            nested = self.nested
            if nested is None:
                nested = self.nested = any(isinstance(a, (tuple, list)) for a in args)
            if not nested:
                return wrapper(*args)
            leaves, spec = tree_flatten(list(args))
            if self.spec is not None and spec != self.spec:
                raise AssertionError(f"partition {self.index}: input nesting changed between calls ({self.spec} -> {spec})")
            self.spec = spec
            return wrapper(*leaves)

        self.call = call


class PartitionedCallable:
    """A whole-graph Inductor callable and the `PartitionSlot`s inside it, in partition order.

    Called like the graph (``fn(*graph_inputs)``); `partitions` is empty when Inductor made none
    (a graph without a splitting op and without anything it had to cut at)."""

    __slots__ = ("fn", "partitions")

    def __init__(self, fn: Callable[..., Any], partitions: Sequence[PartitionSlot]) -> None:
        self.fn = fn
        self.partitions = list(partitions)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class PartitionMarker(CustomGraphPass):
    """A post-grad pass that changes nothing; its uuid puts "partitioned by piecewise, rule version
    1" into Inductor's FX graph cache key (module doc). Bump the version when the rule changes."""

    def __call__(self, graph: Any) -> None:
        return None

    def uuid(self) -> Any:
        return "piecewise-inductor-partition-1"


def uncuttable_ops(targets: Sequence[Any]) -> list[str]:
    """The splitting-op targets of a graph (OpOverloads or packets) Inductor cannot cut at, as
    names: Inductor partitions only at ops it leaves as fallback kernels (``torch.library`` custom
    ops, aten ops registered as fallbacks); an op it decomposes or lowers to its own code (an aten
    ``softmax``, ``bmm``) would be fused into a partition, so it would not run eagerly between
    partitions as a splitting op must."""
    from .._torch.inductor import lowering, select_decomp_table

    fallbacks, lowerings = lowering.fallbacks, lowering.lowerings

    decomps = select_decomp_table()
    out = []
    for t in targets:
        overloads = [getattr(t, name) for name in t.overloads()] if isinstance(t, OpOverloadPacket) else [t]
        for op in overloads:
            if op in decomps or (op in lowerings and op not in fallbacks):
                out.append(str(op))
    return sorted(set(out))


def _is_gpu_graph(example_inputs: Sequence[Any]) -> bool:
    from .._torch.inductor import is_gpu

    return any(isinstance(x, torch.Tensor) and is_gpu(x.device.type) for x in example_inputs)


@contextlib.contextmanager
def partition_scope(split_ops: Sequence[str], example_inputs: Sequence[Any] = (), *,
                    gpu: bool | None = None) -> Iterator[list[PartitionSlot]]:
    """Partition the Inductor compile or artifact load run inside the block at `split_ops`
    (``"namespace::op"`` names); yields the list the block's `PartitionSlot`s are appended to.

    `gpu` (default: whether any of `example_inputs` is on a GPU) keeps Inductor's own partition
    rule; otherwise CPU nodes stay inside partitions (module doc). One scope at a time per process
    (a lock): the wrapper hook is process-wide. Every setting is restored on exit.
    """
    from .._torch.inductor import config as inductor_config
    from .._torch.inductor import scheduler
    from .._torch.inductor import utils as inductor_utils

    Scheduler = scheduler.Scheduler

    gpu = _is_gpu_graph(example_inputs) if gpu is None else gpu
    slots: list[PartitionSlot] = []

    def wrap(fn: Callable[[list[Any]], Any], meta: Any) -> Callable[[list[Any]], Any]:
        slot = PartitionSlot(fn, meta.partition_index, meta.num_partitions)
        slots.append(slot)
        return slot

    ops = list(split_ops)
    original = Scheduler.should_partition

    def should_partition(self: Any, node: Any) -> str | None:
        reason = original(self, node)
        if reason is None or reason.startswith("custom partition op"):
            return reason
        # CPU graph: only splitting ops cut; a fused node holding one is cut by the rule above
        return None

    with _lock:
        holder = inductor_utils._unstable_customized_partition_wrapper
        previous = holder.wrapper
        with inductor_config.patch(graph_partition=True, custom_should_partition_ops=ops):
            inductor_utils.set_customized_partition_wrappers(wrap)
            if not gpu:
                Scheduler.should_partition = should_partition  # type: ignore[method-assign]
            try:
                yield slots
            finally:
                Scheduler.should_partition = original  # type: ignore[method-assign]
                inductor_utils.set_customized_partition_wrappers(previous)
