"""Per-call state that splitting ops can read: `piecewise.forward_context()`.

Set by the compiled model around each forward (a `contextvars.ContextVar`, restored on exit even
when the forward raises), so an attention op can learn the real and the padded token count and
skip pad rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["BatchDescriptor", "ForwardContext", "forward_context", "set_forward_context"]


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The key that selects a captured graph: the padded token count and flags."""

    num_tokens: int
    uniform_decode: bool = False


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """What a forward runs with.

    Attributes:
        num_tokens: the real size of the dynamic dim.
        padded_num_tokens: the size the pieces run at (>= num_tokens; equal without graphs).
        runtime_mode: ``"none"``, ``"piecewise"`` or ``"full"`` graph replay.
        batch_descriptor: the descriptor of the graph this call replays, or None.
        tag: the compiled region's tag.
        num_tokens_device: under graph replay, a 0-d int64 tensor on the model's device holding
            `num_tokens`, at a fixed address. A splitting op captured inside a full graph must read
            the real count from it (Python ints are frozen into the graph at capture); None without
            graphs.
    """

    num_tokens: int
    padded_num_tokens: int
    runtime_mode: str = "none"
    batch_descriptor: BatchDescriptor | None = None
    tag: str | None = None
    num_tokens_device: Any = None


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("piecewise_forward_context", default=None)


def forward_context() -> ForwardContext | None:
    """The context of the forward now running, or None outside a compiled forward."""
    return _current.get()


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
