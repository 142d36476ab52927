"""A graph platform for the CPU tier, injected by tests only (the library never registers it).

It keeps CUDA-graph semantics where they matter for correctness: `capture` runs the callable once
and then poisons its outputs with NaN (a real capture computes nothing), and `replay` reruns the
callable on the *captured argument objects* and writes the results into the *captured output
tensors*. So a replay reads whatever now lies at the captured input addresses, and a caller that
forgot to refresh a static buffer, or read outputs before a replay, sees wrong numbers. Like
CUDA, a capture refuses a host read of a tensor value (``int(t)``, ``t.item()``), splitting ops
captured inside a full graph included (`strict_capture`, on by default): on a GPU such a read fails
the capture, and a replay could not repeat it anyway.
"""

from __future__ import annotations

import contextlib

import torch

from piecewise._torch.dispatch import TorchDispatchMode
from piecewise._torch.ops import custom_op_def
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


_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default)


class _NoHostReads(TorchDispatchMode):
    """A real capture cannot read a device value on the host (``int(t)``, ``t.item()``: CUDA
    refuses a sync while capturing, and a value read then would be frozen into the graph)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            raise RuntimeError("host read of a tensor value during graph capture")
        opdef = custom_op_def(func)
        if opdef is not None:  # a custom op (a splitting op in a full graph): check what its body runs
            with _NoHostReads():
                return opdef._init_fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class FakeGraph:
    def __init__(self):
        self.fn = self.args = self.output = None
        self.replays = 0

    def replay(self):
        _copy_into(self.output, self.fn(*self.args))
        self.replays += 1


class FakePlatform(GraphPlatform):
    name = "fake"

    def __init__(self, fail_sizes=(), oom_sizes=(), strict_capture=True):
        self.fail_sizes, self.oom_sizes = set(fail_sizes), set(oom_sizes)
        #: refuse host reads of tensor values during capture, as CUDA does
        self.strict_capture = strict_capture
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
        with _NoHostReads() if self.strict_capture else contextlib.nullcontext():
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
