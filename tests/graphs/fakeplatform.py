"""A graph platform for the CPU tier, injected by tests only (the library never registers it).

It keeps CUDA-graph semantics where they matter for correctness: `capture` runs the callable once
and then poisons its outputs with NaN (a real capture computes nothing), and `replay` reruns the
callable on the *captured argument objects* and writes the results into the *captured output
tensors*. So a replay reads whatever now lies at the captured input addresses, and a caller that
forgot to refresh a static buffer, or read outputs before a replay, sees wrong numbers.
"""

from __future__ import annotations

import contextlib

import torch

from piecewise.forward_context import forward_context
from piecewise.graphs.platform import GraphPlatform, register_platform, resolve_platform


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _poison(out):
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        out.fill_(float("nan"))
    elif isinstance(out, (tuple, list)):
        for o in out:
            _poison(o)


def _nbytes(out):
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


class FakeGraph:
    def __init__(self):
        self.fn = self.args = self.output = None
        self.replays = 0

    def replay(self):
        _copy_into(self.output, self.fn(*self.args))
        self.replays += 1


class FakePlatform(GraphPlatform):
    name = "fake"

    def __init__(self, fail_sizes=(), oom_sizes=()):
        self.fail_sizes, self.oom_sizes = set(fail_sizes), set(oom_sizes)
        self.graphs: list[FakeGraph] = []
        self.captured_sizes: list[int] = []
        self.flushes = 0
        self.allocated = 0

    def new_graph(self):
        g = FakeGraph()
        self.graphs.append(g)
        return g

    def new_pool(self):
        return object()

    def capture(self, graph, pool, fn, args, *, flush):
        size = forward_context().batch_descriptor.num_tokens
        if size in self.oom_sizes:
            raise torch.OutOfMemoryError(f"fake OOM capturing size {size}")
        if size in self.fail_sizes:
            raise RuntimeError(f"fake capture failure at size {size}")
        self.flushes += bool(flush)
        out = fn(*args)
        graph.fn, graph.args, graph.output = fn, args, out
        self.allocated += _nbytes(out)
        self.captured_sizes.append(size)
        _poison(out)
        return out

    def synchronize(self):
        pass

    def memory_allocated(self):
        return self.allocated


@contextlib.contextmanager
def fake_cpu_platform(**kw):
    """Register a FakePlatform for device type "cpu" for the duration of the block."""
    platform = FakePlatform(**kw)
    with register_platform("cpu", lambda: platform):
        yield platform
