"""torch's fake tensors (``torch._subclasses.fake_tensor``): tensors with sizes, strides and dtype
but no data, what Dynamo traces with.

Why piecewise needs them: a piece's graph is run on fakes to learn its output layouts (``piece``),
the backend makes fakes for Dynamo's example inputs when there is no fake mode yet (``backend``),
and a warm start rebuilds a graph's fake values (``warmstart``).

Verified on torch 2.13.0 (CPU); the module is imported by ``import torch`` since torch 2.1.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["FakeTensor", "FakeTensorMode"]
