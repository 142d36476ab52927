"""One exception hierarchy for the library.

Every message names the offending value and the remedy, so a user can act on it without reading
our source.
"""

from __future__ import annotations

__all__ = [
    "PiecewiseError",
    "ConfigError",
    "InputError", "SizeRefusedError",
    "SplitError",
    "CompileError", "TraceError",
    "RecompileError",
    "GuardFailureError",
    "CacheError",
    "CaptureError",
]


class PiecewiseError(Exception):
    """Base class of every error raised by piecewise.

    Examples:
        >>> import piecewise as pw
        >>> try:
        ...     pw.CompilationConfig(max_num_tokens=0)
        ... except pw.PiecewiseError as e:
        ...     print(type(e).__name__, e)
        ConfigError max_num_tokens=0 must be a positive integer
    """


class ConfigError(PiecewiseError, ValueError):
    """An invalid `CompilationConfig` field or combination of fields, raised when the config is made
    or when `piecewise.compile` is called, before any trace.

    Examples:
        >>> import torch, piecewise as pw
        >>> pw.compile(torch.nn.ReLU(), pw.CompilationConfig(backend="no_such"))
        Traceback (most recent call last):
            ...
        piecewise.errors.ConfigError: backend='no_such' is not a registered compiler adaptor; known: [...]; register one with piecewise.compilers.register_adaptor
    """


class InputError(PiecewiseError, ValueError):
    """A call's inputs do not match what the compiled model was built for (dtype, device, rank,
    a dynamic size above `max_num_tokens`). Raised before anything runs.

    Examples:
        >>> import torch, piecewise as pw
        >>> compiled = pw.compile(torch.nn.Linear(4, 4), pw.CompilationConfig(backend="eager", max_num_tokens=8),
        ...                       dynamic_arg_dims={"input": 0})
        >>> _ = compiled(torch.randn(2, 4))
        >>> compiled(torch.randn(9, 4))
        Traceback (most recent call last):
            ...
        piecewise.errors.InputError: [Linear] 'input' dim 0 is 9, above max_num_tokens=8; split the batch or raise max_num_tokens
    """


class SizeRefusedError(InputError):
    """A call's dynamic sizes fail a shape guard of the trace (the traced code branched on a size,
    or holds only at one size), so the compiled model would run code specialised for other sizes.
    Raised before anything runs; the message names the dim, its value and the guard's line. Such a
    call is served by a trace of its own (a size class) until `CompilationConfig.max_size_classes`
    traces exist; then, or under ``debug=True``, it is refused with this error.

    Examples:
        >>> import torch, piecewise as pw
        >>> class Gate(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x * 2 if x.shape[0] == 1 else x + 1
        >>> compiled = pw.compile(Gate(), pw.CompilationConfig(backend="eager", max_size_classes=1, tag="gate"),
        ...                       dynamic_arg_dims={"x": 0})
        >>> compiled(torch.ones(3, 2)).shape     # traced at 3 rows: serves 2..512 rows
        torch.Size([3, 2])
        >>> try:
        ...     compiled(torch.ones(1, 2))
        ... except pw.SizeRefusedError as e:
        ...     print(str(e)[:58])
        [gate] x.shape[0] = 1 refused: the trace took Ne(x.shape[0
    """


class SplitError(PiecewiseError):
    """The FX graph could not be cut into pieces."""


class CompileError(PiecewiseError):
    """A piece failed to compile with the configured compiler adaptor."""


class TraceError(CompileError, RuntimeError):
    """An op failed on the trace's fake tensors: a shape error eager raises too, or one only the
    trace's symbolic sizes meet. A `RuntimeError`, as eager's error and Dynamo's own are.

    Examples:
        >>> import torch, piecewise as pw
        >>> class Bad(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x @ torch.ones(3, 3)
        >>> compiled = pw.compile(Bad(), pw.CompilationConfig(backend="eager"), dynamic_arg_dims={"x": 0})
        >>> try:
        ...     compiled(torch.ones(2, 4))
        ... except RuntimeError as e:              # eager's (2, 4) @ (3, 3) fails the same way
        ...     print(type(e).__name__, "names the op:", "matmul" in str(e))
        TraceError names the op: True
    """


class RecompileError(PiecewiseError):
    """Dynamo asked a backend instance to compile a second graph. After warm-up a compiled model
    never recompiles; this names what changed."""


class GuardFailureError(PiecewiseError):
    """Debug mode only: a Dynamo guard of the first trace would have failed on this call, so the
    guard-free dispatch would run code traced for other inputs.

    Examples:
        >>> import torch, piecewise as pw
        >>> class Gate(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x * 2 if x.shape[0] == 1 else x + 1
        >>> compiled = pw.compile(Gate(), pw.CompilationConfig(backend="eager", debug=True, tag="gate_debug"),
        ...                       dynamic_arg_dims={"x": 0})
        >>> _ = compiled(torch.ones(3, 2))
        >>> try:
        ...     compiled(torch.ones(1, 2))      # debug=True checks every guard of the trace on each call
        ... except pw.GuardFailureError as e:
        ...     print("size()[0] != 1" in str(e))
        True
    """


class CacheError(PiecewiseError):
    """A compile-cache entry is unusable. The cache reports it and recompiles; this type reaches
    users only from the `piecewise cache` tools."""


class CaptureError(PiecewiseError):
    """Graph capture or replay failed (a moved input address, a missing graph)."""
