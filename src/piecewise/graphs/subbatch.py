"""Sub-batch replay (docs/design.md §6.6): graphs of a callable over rows gathered from a larger batch.

The pattern of draft and verification layers in speculative decoding: a few layers run on some
rows of the batch only. `SubBatchReplay(fn, ...)(index, *inputs)` gathers ``inputs[index]`` into
static buffers (``index_select`` with ``out=``, so addresses never move), zero-fills the rows up
to the padded count, replays ``fn``'s graph captured at that count, and returns the outputs sliced
to the ``len(index)`` real rows. Without a graph platform (the CPU) or above the largest capture
size it runs ``fn`` on the gathered rows directly. Outputs live until the next call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..forward_context import BatchDescriptor, ForwardContext, RuntimeMode, enter_forward, exit_forward
from .capture_sizes import PaddingTable, validate_capture_sizes
from .platform import resolve_platform
from .wrapper import GraphPool, PieceGraphWrapper

__all__ = ["SubBatchReplay"]


class SubBatchReplay:
    """Args:
        fn: ``fn(*rows) -> Tensor | tuple[Tensor, ...]``, every input and output ``[rows, ...]``;
            weights it uses are captured in place.
        capture_sizes: row counts to capture (sizes above `max_rows` are dropped with a warning).
        max_rows: the most rows ever gathered; static buffers hold this many.
        tag: name for counters and logs.
    """

    def __init__(self, fn: Callable[..., Any], *, capture_sizes: Sequence[int], max_rows: int, tag: str = "sub_batch",
                 num_warmups: int = 1) -> None:
        self.fn = fn
        self.sizes, _ = validate_capture_sizes(capture_sizes, max_rows)
        self.table = PaddingTable(self.sizes, max_rows)
        self.max_rows = max_rows
        self.tag = tag
        self.num_warmups = num_warmups
        self.buffers: list[torch.Tensor] = []
        self.wrapper: PieceGraphWrapper | None = None
        self.num_rows_device: torch.Tensor | None = None
        self._platform_checked = False

    def _setup(self, inputs: Sequence[torch.Tensor]) -> None:
        self._platform_checked = True
        platform = resolve_platform(inputs[0].device.type)
        if platform is None:
            return
        self.buffers = [torch.zeros((self.max_rows, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in inputs]
        self.num_rows_device = torch.zeros((), dtype=torch.int64, device=inputs[0].device)
        runner = GraphPool(platform, num_warmups=self.num_warmups, tag=self.tag)
        runner.stable_ptrs.update(b.data_ptr() for b in self.buffers)
        runner.on_size_failed = self._drop_size
        self.wrapper = PieceGraphWrapper(self.fn, runner, mode=RuntimeMode.SUB_BATCH, first=True, name=f"{self.tag} graph")

    def _drop_size(self, size: int) -> None:
        self.sizes = [s for s in self.sizes if s != size]
        self.table = PaddingTable(self.sizes, self.max_rows)

    def __call__(self, index: torch.Tensor, *inputs: torch.Tensor) -> Any:
        if not self._platform_checked:
            self._setup(inputs)
        n = index.numel()
        padded = self.table.padded(n) if self.wrapper is not None else None
        if padded is None:
            return self.fn(*(x.index_select(0, index) for x in inputs))
        rows = []
        for x, buf in zip(inputs, self.buffers):
            torch.index_select(x, 0, index, out=buf.narrow(0, 0, n))
            if padded > n:
                buf.narrow(0, n, padded - n).zero_()
            rows.append(buf.narrow(0, 0, padded))
        self.num_rows_device.fill_(n)
        token = enter_forward(ForwardContext(n, padded, RuntimeMode.SUB_BATCH, BatchDescriptor(padded), self.tag, self.num_rows_device))
        try:
            out = self.wrapper(*rows)
        finally:
            exit_forward(token)
            self.wrapper.runner.flush_replays()
        if isinstance(out, (tuple, list)):
            return type(out)(o.narrow(0, 0, n) for o in out)
        return out.narrow(0, 0, n)
