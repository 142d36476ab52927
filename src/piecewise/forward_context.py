"""Per-call state that splitting ops can read: `piecewise.forward_context()`.

Set by the compiled model around each forward (a `contextvars.ContextVar`, restored on exit even
when the forward raises), so an attention op can learn the real and the padded token count and
skip pad rows.

One writer API: `set_forward_context` (a context manager) or, on hot paths where a generator
frame per call costs too much, the pair ``token = enter_forward(ctx)`` ... ``exit_forward(token)``
in a ``try/finally``. Readers call `forward_context()` (or `current_forward_context`, the same
without a Python frame). No module touches the variable itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

__all__ = ["BatchDescriptor", "ForwardContext", "RuntimeMode", "forward_context", "set_forward_context", "enter_forward",
           "exit_forward", "current_forward_context"]


class RuntimeMode(str, enum.Enum):
    """How a forward runs (`ForwardContext.runtime_mode`). A `str` enum: ``ctx.runtime_mode ==
    "full"`` holds for `RuntimeMode.FULL`, so splitting ops written against the strings keep working.

    NONE: no graph replay (the pieces run at the call's size, or a padded size being verified).
    PIECEWISE: each compiled piece replays its own graph; splitting ops run eagerly in between.
    FULL: one graph over the whole forward, splitting ops included.
    SUB_BATCH: a `graphs.subbatch.SubBatchGraph` replays a graph over gathered rows.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    SUB_BATCH = "sub_batch"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The key that selects a captured graph: the padded token count and flags.

    Examples:
        >>> from piecewise import BatchDescriptor
        >>> BatchDescriptor(num_tokens=8, uniform_decode=True)
        BatchDescriptor(num_tokens=8, uniform_decode=True)
    """

    num_tokens: int
    uniform_decode: bool = False


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """What a forward runs with.

    Attributes:
        num_tokens: the real size of the dynamic dim.
        padded_num_tokens: the size the pieces run at (>= num_tokens; equal without graphs).
        runtime_mode: a `RuntimeMode`.
        batch_descriptor: the descriptor of the graph this call replays, or None.
        tag: the compiled region's tag.
        num_tokens_device: under graph replay, a 0-d int64 tensor on the model's device holding
            `num_tokens`, at a fixed address. A splitting op captured inside a full graph must read
            the real count from it (Python ints are frozen into the graph at capture); None without
            graphs.

    Examples:
        A splitting op skips the pad rows a graph replay adds (shapes ``[padded_num_tokens, ...]``):

            ctx = pw.forward_context()
            n = ctx.num_tokens if ctx is not None else q.shape[0]
            out[:n] = attend(q[:n], k[:n], v[:n])
    """

    num_tokens: int
    padded_num_tokens: int
    runtime_mode: RuntimeMode = RuntimeMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    tag: str | None = None
    num_tokens_device: Any = None


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("piecewise_forward_context", default=None)


def forward_context() -> ForwardContext | None:
    """The context of the forward now running, or None outside a compiled forward.

    Splitting ops call it to read the real and padded token counts of the call (`ForwardContext`).

    Examples:
        >>> import piecewise as pw
        >>> pw.forward_context() is None   # no compiled forward is running here
        True
    """
    return _current.get()


#: ``enter_forward(ctx) -> token``: make `ctx` current; undo with ``exit_forward(token)`` in a
#: ``finally`` (the allocation-free form of `set_forward_context` for per-call paths).
enter_forward = _current.set
#: ``exit_forward(token)``: restore the context current before the matching `enter_forward`.
exit_forward = _current.reset
#: `forward_context` without a Python frame (per-piece paths).
current_forward_context = _current.get


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` current for the block (restored on exit, exceptions included)."""
    token = enter_forward(ctx)
    try:
        yield ctx
    finally:
        exit_forward(token)
