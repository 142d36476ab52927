"""The platform interface behind graph capture (docs/design.md §6.2).

Capture and replay need five things from a device: a graph object that records and replays work, a
memory pool handle shared by all graphs of one model, the stream to capture on, a synchronize, and
memory statistics. `GraphPlatform` names exactly those; `CudaPlatform` implements them with
``torch.cuda.CUDAGraph``. Another accelerator (an NPU graph API, say) plugs in by subclassing
`GraphPlatform` and calling `register_platform`. The CPU has no graphs: `resolve_platform("cpu")`
returns None and graph modes resolve to ``"none"`` (logged once).
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..registry import Registration, Registry

__all__ = ["GraphPlatform", "CudaPlatform", "register_platform", "resolve_platform", "platform_names"]

log = logging.getLogger("piecewise")


class GraphPlatform(abc.ABC):
    """What graph capture needs from a device type.

    A graph from `new_graph()` must offer ``replay()``. `capture` records the work of
    ``fn(*args)`` into the graph, allocating from `pool`, and returns fn's outputs; afterwards
    ``graph.replay()`` reruns that work, reading the same input addresses and writing into the same
    output tensors. Whether capture also computes the outputs is platform-specific; callers replay
    once after capture before reading them.
    """

    name: str = "?"

    @abc.abstractmethod
    def new_graph(self) -> Any: ...

    @abc.abstractmethod
    def new_pool(self) -> Any:
        """A pool handle owned by one backend instance: graphs of every size share it."""

    @abc.abstractmethod
    def capture(self, graph: Any, pool: Any, fn: Callable[..., Any], args: tuple[Any, ...], *, flush: bool) -> Any:
        """Record ``fn(*args)`` into `graph`; returns its outputs. `flush` empties the allocator's
        cache first; the wrappers pass it only for the first piece of a size (flushing per piece
        slows capture for no gain: the pieces share one pool)."""

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes currently allocated on the device (used to report pool bytes per capture)."""

    def is_oom(self, exc: BaseException) -> bool:
        """Whether `exc` is this device's out-of-memory error."""
        return isinstance(exc, torch.OutOfMemoryError)


class CudaPlatform(GraphPlatform):
    name = "cuda"

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def __init__(self) -> None:
        self._stream: Any = None

    def capture(self, graph: Any, pool: Any, fn: Callable[..., Any], args: tuple[Any, ...], *, flush: bool) -> Any:
        # torch.cuda.graph always empties the cache on entry; this does so only when asked.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        if flush:
            torch.cuda.empty_cache()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self._stream)
        return out

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()


_platforms: Registry[Callable[[], GraphPlatform]] = Registry("graph platform")
_platforms.register("cuda", CudaPlatform)


def register_platform(device_type: str, factory: Callable[[], GraphPlatform]) -> Registration:
    """Use `factory()` for graph capture on devices of `device_type` (``torch.device(...).type``).

    Returns a `Registration`: ``with register_platform("cpu", make): ...`` (or ``.remove()``) puts
    back the previous platform of that device type."""
    return _platforms.register(device_type, factory)


def platform_names() -> tuple[str, ...]:
    return _platforms.names()


def resolve_platform(device_type: str) -> GraphPlatform | None:
    """The graph platform of `device_type`, or None when it has none (the CPU)."""
    factory = _platforms.get(device_type)
    return factory() if factory is not None else None


@contextlib.contextmanager
def no_gc_during_capture(enabled: bool) -> Iterator[None]:
    """Pause Python's garbage collector (restored on exit, exceptions included).

    Capture of every piece but the first runs with collection paused: a collection per piece made
    capture about 10x slower in vLLM's measurements, and nothing collectable is created in between.
    """
    import gc

    if not enabled:
        yield
        return
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
