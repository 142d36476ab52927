"""piecewise: piecewise compilation of PyTorch inference models (a torch.compile backend).

See README.md for usage; terms (docs/design.md): splitting op, piece, compile range, compile size.
"""

# The public names are imported on first use (PEP 562), so `piecewise --help` and the `piecewise
# cache` tools start without importing torch. The first public name used imports everything the
# package used to import eagerly (compilers, graph platforms, passes), so registrations happen
# exactly as before; `import piecewise.<submodule>` imports what that submodule needs.
import importlib as _importlib
from typing import TYPE_CHECKING, Any as _Any

from .errors import (
    CacheError,
    CaptureError,
    CompileError,
    ConfigError,
    GuardFailureError,
    InputError,
    PiecewiseError,
    RecompileError,
    SizeRefusedError,
    SplitError,
    TraceError,
)

# Light modules (no torch). Imported here, not lazily, because `counters` and `forward_context`
# are also submodule names: a later first import of the submodule would bind the module object
# over a lazily exported name.
from .config import CompilationConfig
from .targets import CompileRange
from .counters import counters
from .forward_context import BatchDescriptor, ForwardContext, forward_context

if TYPE_CHECKING:
    from . import compilers, graphs, passes
    from .api import CompiledModel, compile
    from .ops import mark_splitting_op, splitting_op

#: public name -> (module, attribute); attribute None means the submodule itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "compilers": (".compilers", None),
    "graphs": (".graphs", None),
    "passes": (".passes", None),
    "CompiledModel": (".api", "CompiledModel"),
    "compile": (".api", "compile"),
    "mark_splitting_op": (".ops", "mark_splitting_op"),
    "splitting_op": (".ops", "splitting_op"),
}


def _load_all() -> None:
    """Import every lazily exported name (in the order the package used to import them)."""
    g = globals()
    for name, (module, attr) in _LAZY.items():
        if name not in g:
            mod = _importlib.import_module(module, __name__)
            g[name] = mod if attr is None else getattr(mod, attr)


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        _load_all()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


from ._version import __version__

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
    "SizeRefusedError",
    "PiecewiseError",
    "RecompileError",
    "SplitError",
    "TraceError",
    "compile",
    "compilers",
    "counters",
    "graphs",
    "passes",
    "forward_context",
    "mark_splitting_op",
    "splitting_op",
]
