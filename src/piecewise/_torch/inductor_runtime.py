"""Loading Inductor artifacts without importing Inductor's compiler (docs/design.md §4.5).

A patch of Python's import (``builtins.__import__`` is wrapped while a warm start loads artifacts,
in the loading thread only, and put back when the last load ends) and stand-ins for two Inductor
modules (``torch._inductor.select_algorithm``, ``torch._inductor.graph``). Verified on torch 2.13.0
(CPU); ``tests/compilers/test_inductor_runtime.py`` checks the stand-ins against Inductor's own
namespace, so a torch that changes them fails there, not silently.

Inductor's generated wrapper modules start with
``from torch._inductor.select_algorithm import extern_kernels`` and
``generate_example_value = AlgorithmSelectorCache.generate_example_value``. Importing
``select_algorithm`` imports the lowering registry and builds the kernel templates (Jinja): measured
on this repository's 2-core machine, 0.58-0.61 s of a warm process (``python -c`` after torch and
transformers are imported), the largest part of a warm first call that loads every piece from the
cache and compiles nothing.

Inductor's cache-hit path also imports ``torch._inductor.graph`` (which imports the lowerings and
``select_algorithm``) to read one test hook, ``GraphLowering.save_output_code``.

`light_inductor_runtime` answers those names while artifacts load, in the thread that loads them
and only while it does:

- ``extern_kernels.<name>`` is ``torch.<name>`` (as this module's import found it) for the names
  in `TORCH_EXTERN_KERNELS`, which Inductor registers as exactly that torch function (``ExternKernelChoice(torch.mm, "mm", ...)``;
  ``tests/compilers/test_inductor_runtime.py`` checks each against Inductor's own namespace); any
  other name imports the real module and returns its kernel;
- ``AlgorithmSelectorCache.generate_example_value`` forwards to the real method when called
  (autotuning code, which a loaded CPU wrapper does not run);
- ``GraphLowering.save_output_code`` is None (a test that sets the hook imports the real module
  first, and a module already imported is never stood in for);
- any other attribute of either module imports the real modules and forwards to them.

How it stays out of everyone else's way:

- The stand-ins never enter ``sys.modules``. During a load ``builtins.__import__`` is wrapped: a
  ``from <module> import ...`` of one of the two modules, in a thread that is loading, from a
  generated wrapper module or Inductor's cache-hit path, while the real module is not in
  ``sys.modules``, gets the stand-in; every other import (other threads, other importers such as
  an Inductor module imported for the first time during the load, ``import a.b`` without a
  from-list, ``importlib.import_module``, pickle) goes to the import system unchanged. The
  wrapper is taken out when the last load ends; a load that finds it no longer on the import
  chain (something put back the ``__import__`` it saw before us) installs it again.
- The stand-in ``extern_kernels`` stays bound in the wrappers that loaded through it. Once a
  stand-in was handed out, a finder on ``sys.meta_path`` waits for Inductor's real
  ``select_algorithm`` to be imported (by anyone, for any reason) and then makes the stand-in
  share the real namespace's attribute dictionary: a later registration or patch of
  ``extern_kernels.<name>`` (``unittest.mock.patch.object``) reaches warm-loaded wrappers as it
  reaches compiled ones, at no cost per call (a plain attribute lookup, as before).

Runtime modules the generated code and Inductor's runtime use without importing them (they
come with the compiler's imports: ``torch._inductor.debug`` is read on every call) are imported
by `InductorAdaptor.prepare`. What a stand-in gives is the object Inductor's own module would give
(the same torch functions), so a load through it runs the same code; only the import is skipped.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.abc
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
#: those functions as this module's import found them: Inductor's registry takes them once, when
#: it is imported, so a ``torch.addmm`` replaced for a while later (a profiler counting flops over
#: the first call) is not what loaded wrappers keep calling
_TORCH_KERNELS = {name: getattr(torch, name) for name in TORCH_EXTERN_KERNELS}
#: who gets the stand-ins: Inductor's generated wrapper modules (named under ``compile_tasks`` by
#: the code cache's loader) and its cache-hit path in ``codecache`` (a function-level import); a
#: module of Inductor's imported for the first time during a load (``compile_fx`` binds
#: ``GraphLowering`` at its top) gets the real modules, or it would keep a stand-in for good
_GENERATED_PREFIX = "torch._inductor.runtime.compile_tasks."
_CACHE_HIT_PATH = "torch._inductor.codecache"

_lock = threading.RLock()
#: thread ident -> how many loads it is inside (`light_inductor_runtime` nests)
_loading: dict[int, int] = {}
#: the ``builtins.__import__`` the wrapper calls through (set when it is installed, never cleared)
_import_before: Any = None
#: set in a thread while it checks whether the wrapper is still on ``builtins.__import__``'s chain
_probe = threading.local()
#: whether the stand-in ``extern_kernels`` now shares the real namespace's attributes
_linked = False


def _real(name: str) -> types.ModuleType:
    """Inductor's own module `name`, imported now if it was not (the stand-ins are never in
    ``sys.modules``, so Inductor's modules import one another as they always do)."""
    return importlib.import_module(name)


class _ExternKernels:
    """Generated code's ``extern_kernels``: see the module doc. Before the real module is imported
    its attributes are `_TORCH_KERNELS`; after, its ``__dict__`` is the real namespace's (`_link`)."""

    def __init__(self) -> None:
        self.__dict__.update(_TORCH_KERNELS)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _TORCH_KERNELS:
            # only after `_link`, for a torch kernel Inductor has not registered yet (its kernel
            # modules import after select_algorithm): answered without writing into its namespace
            return _TORCH_KERNELS[name]
        return getattr(_real(_SELECT_ALGORITHM).extern_kernels, name)


class _AlgorithmSelectorCache:
    """Generated code binds ``AlgorithmSelectorCache.generate_example_value`` at import."""

    @staticmethod
    def generate_example_value(*args: Any, **kwargs: Any) -> Any:
        return _real(_SELECT_ALGORITHM).AlgorithmSelectorCache.generate_example_value(*args, **kwargs)


class _GraphLowering:
    """Inductor's cache-hit path reads ``GraphLowering.save_output_code`` (a test hook, None unless
    a test set it; setting it imports the real module first, so the stand-in is never handed out)."""

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


_EXTERN_KERNELS = _ExternKernels()
_STAND_INS = {_SELECT_ALGORITHM: _stand_in(_SELECT_ALGORITHM, extern_kernels=_EXTERN_KERNELS,
                                           AlgorithmSelectorCache=_AlgorithmSelectorCache),
              _GRAPH: _stand_in(_GRAPH, GraphLowering=_GraphLowering)}


def _link(real: types.ModuleType) -> None:
    """Make the stand-in ``extern_kernels`` read and write the real namespace from now on."""
    global _linked
    with _lock:
        if not _linked:
            _EXTERN_KERNELS.__dict__ = real.extern_kernels.__dict__
            _linked = True
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_FOLLOW)


class _LinkAfterExec(importlib.abc.Loader):
    """Runs Inductor's own loader for ``select_algorithm``, then `_link`; the module's
    ``__loader__`` is Inductor's own loader again afterwards."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _link(module)


class _FollowRealImport(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` from the first stand-in ``extern_kernels`` handed out until Inductor's
    ``select_algorithm`` has been imported (`_link` takes it out); answers nothing else."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _SELECT_ALGORITHM:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LinkAfterExec(spec.loader)
                return spec
        return None


_FOLLOW = _FollowRealImport()


def _for_stand_ins(globals: Any) -> bool:
    importer = (globals or {}).get("__name__") or ""
    return importer.startswith(_GENERATED_PREFIX) or importer == _CACHE_HIT_PATH


def _on_import_chain() -> bool:
    """Whether ``builtins.__import__`` still reaches `_import` (something may have wrapped it
    after us, or put back what it saw before us, dropping us with it)."""
    if builtins.__import__ is _import:
        return True
    _probe.active, _probe.seen = True, False
    try:
        builtins.__import__("sys")
    finally:
        _probe.active = False
    return _probe.seen


def _absolute(name: str, globals: Any, level: int) -> str:
    if level == 0:
        return name
    package = (globals or {}).get("__package__") or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    if getattr(_probe, "active", False):
        _probe.seen = True
    elif fromlist and _loading.get(threading.get_ident()) and _for_stand_ins(globals):
        full = _absolute(name, globals, level)
        stand_in = _STAND_INS.get(full)
        if stand_in is not None:
            with _lock:
                if full not in sys.modules:
                    if full == _SELECT_ALGORITHM and not _linked and _FOLLOW not in sys.meta_path:
                        sys.meta_path.insert(0, _FOLLOW)
                    return stand_in
    return _import_before(name, globals, locals, fromlist, level)


@contextlib.contextmanager
def light_inductor_runtime() -> Iterator[None]:
    """Within the block, in this thread, ``from torch._inductor.select_algorithm import ...`` and
    ``from torch._inductor.graph import ...`` give the stand-ins unless the real module is already
    imported; other threads, and this one after the block, import the real modules as usual.

    Loads may nest and may overlap in several threads; each thread gets the stand-ins only inside
    its own blocks."""
    global _import_before
    me = threading.get_ident()
    with _lock:
        if not _on_import_chain():
            _import_before = builtins.__import__
            builtins.__import__ = _import
        _loading[me] = _loading.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _loading[me] -= 1
            if not _loading[me]:
                del _loading[me]
            # the wrapper leaves with the last load, unless something wrapped ``__import__`` over
            # it meanwhile (then it stays in that chain, passing every import through)
            if not _loading and builtins.__import__ is _import:
                builtins.__import__ = _import_before
