"""Dynamo internals piecewise depends on.

Verified on torch 2.13.0 (CPU): ``torch._dynamo.output_graph.OutputGraph.call_user_compiler``
re-raises a backend's `ShortenTraceback` as it is and wraps every other exception in
``BackendCompilerFailed``; ``eval_frame`` re-raises a `ShortenTraceback` after trimming Dynamo's
frames (none when ``first_useful_frame`` is None).
"""

from __future__ import annotations

from typing import Any

__all__ = ["unwrapped_by_dynamo"]

_classes: dict[type, type] = {}


def unwrapped_by_dynamo(error: BaseException) -> BaseException:
    """`error` as an instance of a subclass of its own class and Dynamo's `ShortenTraceback`, so
    that raised from a backend it reaches the caller of ``torch.compile``'d code as itself (``except
    piecewise.ConfigError`` catches it) rather than wrapped in ``BackendCompilerFailed``. Same
    message, cause and attributes; `error` itself where this torch has no `ShortenTraceback` or the
    classes cannot be combined."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover - another torch
        return error
    cls = type(error)
    if isinstance(error, ShortenTraceback):
        return error
    combined = _classes.get(cls)
    if combined is None:
        try:
            combined = type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__,
                                                                    "__init__": _init})
        except TypeError:  # layouts that cannot be combined
            return error
        _classes[cls] = combined
    out = combined(*error.args)
    out.__dict__.update(error.__dict__)
    out.__cause__, out.__context__ = error.__cause__, error.__context__
    return out


def _init(self: Any, *args: Any) -> None:
    BaseException.__init__(self, *args)
    self.first_useful_frame = None
