"""piecewise: piecewise compilation of PyTorch inference models (a torch.compile backend).

See README.md for usage; SPEC-level terms: splitting op, piece, compile range, compile size.
"""

from . import compilers, graphs, passes
from .api import CompiledModel, compile
from .config import CompilationConfig, CompileRange
from .counters import counters
from .errors import (
    CacheError,
    CaptureError,
    CompileError,
    ConfigError,
    GuardFailureError,
    InputError,
    PiecewiseError,
    RecompileError,
    SplitError,
)
from .forward_context import BatchDescriptor, ForwardContext, forward_context
from .ops import mark_splitting_op, splitting_op

__version__ = "0.1.0"

__all__ = [
    "BatchDescriptor",
    "CacheError",
    "CaptureError",
    "CompilationConfig",
    "CompileError",
    "CompileRange",
    "CompiledModel",
    "ConfigError",
    "ForwardContext",
    "GuardFailureError",
    "InputError",
    "PiecewiseError",
    "RecompileError",
    "SplitError",
    "compile",
    "compilers",
    "counters",
    "graphs",
    "passes",
    "forward_context",
    "mark_splitting_op",
    "splitting_op",
]
