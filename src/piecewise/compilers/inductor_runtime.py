"""Loading Inductor artifacts without importing Inductor's compiler (docs/design.md §4.5).

Inductor's generated wrapper modules start with
``from torch._inductor.select_algorithm import extern_kernels`` and
``generate_example_value = AlgorithmSelectorCache.generate_example_value``. Importing
``select_algorithm`` imports the lowering registry and builds the kernel templates (Jinja): measured
on this repository's 2-core machine, 0.58-0.61 s of a warm process (``python -c`` after torch and
transformers are imported), the largest part of a warm first call that loads every piece from the
cache and compiles nothing.

Inductor's cache-hit path also imports ``torch._inductor.graph`` (which imports the lowerings and
``select_algorithm``) to read one test hook, ``GraphLowering.save_output_code``.

`light_inductor_runtime` answers those names while artifacts load, and only while they load:

- ``extern_kernels.<name>`` is ``torch.<name>`` for the names in `TORCH_EXTERN_KERNELS`, which
  Inductor registers as exactly that torch function (``ExternKernelChoice(torch.mm, "mm", ...)``;
  ``tests/compilers/test_inductor_runtime.py`` checks each against Inductor's own namespace); any
  other name imports the real module and returns its kernel;
- ``AlgorithmSelectorCache.generate_example_value`` forwards to the real method when called
  (autotuning code, which a loaded CPU wrapper does not run);
- ``GraphLowering.save_output_code`` is None (a test that sets the hook imports the real module
  first, and a module already imported is never stood in for);
- any other attribute of either module imports the real modules and forwards to them.

Runtime modules the generated code and Inductor's runtime use without importing them (they
come with the compiler's imports: ``torch._inductor.debug`` is read on every call) are imported
by `InductorAdaptor.prepare`.

The stand-ins sit in ``sys.modules`` for the duration of the load and are taken out after it, so
anything imported later (a compile in the same process) gets Inductor's own modules. A process
that already imported a real module keeps it: nothing is replaced. What a stand-in gives is the
object Inductor's own module would give (the same torch functions), so a load through it runs the
same code; only the import is skipped.

Known limits (docs/design.md §4.5): the loaded wrappers keep the stand-in ``extern_kernels``, so a
later patch of Inductor's own namespace does not reach them; another thread importing these
modules' names while a load is under way gets the stand-ins' objects and keeps them.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TORCH_EXTERN_KERNELS", "light_inductor_runtime"]

_SELECT_ALGORITHM = "torch._inductor.select_algorithm"
_GRAPH = "torch._inductor.graph"

#: extern kernels Inductor registers under the name of the torch function they are
#: (``torch._inductor.kernel.mm``, ``bmm``, ``conv``: ``ExternKernelChoice(torch.<name>, "<name>")``)
TORCH_EXTERN_KERNELS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "_int_mm"})

_lock = threading.RLock()


def _real(name: str) -> types.ModuleType:
    """Inductor's own module `name`, imported now if only the stand-in was there. Every stand-in
    leaves ``sys.modules`` first, so Inductor's modules import one another as they always do."""
    with _lock:
        for mod in _STAND_INS:
            if sys.modules.get(mod.__name__) is mod:
                del sys.modules[mod.__name__]
        real = importlib.import_module(name)
        import torch._inductor as inductor_pkg

        setattr(inductor_pkg, name.rsplit(".", 1)[1], real)
        return real


class _ExternKernels:
    """Generated code's ``extern_kernels``: see the module doc."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(torch, name) if name in TORCH_EXTERN_KERNELS else getattr(_real(_SELECT_ALGORITHM).extern_kernels, name)
        setattr(self, name, value)
        return value


class _AlgorithmSelectorCache:
    """Generated code binds ``AlgorithmSelectorCache.generate_example_value`` at import."""

    @staticmethod
    def generate_example_value(*args: Any, **kwargs: Any) -> Any:
        return _real(_SELECT_ALGORITHM).AlgorithmSelectorCache.generate_example_value(*args, **kwargs)


class _GraphLowering:
    """Inductor's cache-hit path reads ``GraphLowering.save_output_code`` (a test hook, None unless
    a test set it; setting it imports the real module first, so the stand-in is never in place)."""

    save_output_code = None


class _StandIn(types.ModuleType):
    """A module whose own attributes are the few names above; any other attribute imports the real
    module and forwards to it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real(self.__name__), name)


def _stand_in(name: str, **attrs: Any) -> _StandIn:
    mod = _StandIn(name, f"piecewise's stand-in for {name} while Inductor artifacts load")
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


_STAND_INS = (_stand_in(_SELECT_ALGORITHM, extern_kernels=_ExternKernels(), AlgorithmSelectorCache=_AlgorithmSelectorCache),
              _stand_in(_GRAPH, GraphLowering=_GraphLowering))


@contextlib.contextmanager
def light_inductor_runtime() -> Iterator[None]:
    """Within the block, importing ``torch._inductor.select_algorithm`` or ``torch._inductor.graph``
    gives the stand-in unless the real module is already imported; after it (or once any name
    beyond the stand-ins' own is asked for) the real modules are imported on first use as usual.

    Two threads' loads may overlap: a load that finds the real module, or finds the stand-in
    gone, only pays for the import; what runs is the same. (Other code importing these modules in
    another thread meanwhile gets the stand-ins: see the module doc.)"""
    with _lock:
        installed = [m for m in _STAND_INS if m.__name__ not in sys.modules]
        for mod in installed:
            sys.modules[mod.__name__] = mod
    try:
        yield
    finally:
        with _lock:
            for mod in installed:
                if sys.modules.get(mod.__name__) is mod:
                    del sys.modules[mod.__name__]
