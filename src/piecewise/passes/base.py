"""The pass interface, the wrappers that turn plain callables into passes, and pass uuids (docs/design.md §7).

A pass is a post-grad FX graph transform: it receives the functionalized, decomposed ATen graph
Inductor is about to lower (one piece, one compile target) and rewrites it in place. Every pass has
a `uuid()` that enters the compile key, so the cache never serves code built by another version of
a pass, and a rerun of the same pass hits.

How a uuid is computed (never by pickling anything):

* `PiecewisePass` subclass: sha256 of the bytes of every file that defines the code of its class
  and of its base classes below `PiecewisePass` (found from the methods' code objects, so a class
  built by ``exec`` is rejected instead of being hashed as some other file) and of the files it
  lists in `PiecewisePass.source_files`, plus the class name and its options
  (`PiecewisePass.config`). File granularity follows Inductor's advice for `CustomGraphPass.uuid`
  (``get_hash_for_files``): helpers in the pass's own module are covered without listing them.
  The files' paths are not hashed, so the same code checked out elsewhere hits. The files cover
  the code, not the module-level values it reads: those are hashed as for functions (below).
* plain function or lambda (`FunctionPass`): its source text (``inspect.getsource``), a digest of
  its code object (two lambdas on one line differ; bytecode ties it to the Python version), its
  defaults, its closure values, and every module-level value its code reads (``LOAD_GLOBAL``,
  followed through modules and user classes: ``cfg.OPTION``), recursively through the helper
  functions it calls. Values are described canonically (sets and non-str-keyed dicts sorted, so
  ``PYTHONHASHSEED`` does not matter): numbers, strings, containers of any depth, enums,
  dataclass instances, dtypes, ops, classes (by name; a user class also by source), functions of
  user code in any module (walked the same way), library functions (stdlib, site-packages,
  piecewise: by name, their package's version stands for them), loggers and streams (output
  only). Anything else (an arbitrary object, a tensor, a function whose source cannot be read) is
  rejected with a `ConfigError` naming the pass, the value and its type: the compile cache could
  otherwise serve code built with another value. Values are read when the pass is built (when
  the `CompilationConfig` is made) for functions, at each ``uuid()`` for `PiecewisePass` objects.
* Inductor `CustomGraphPass` object (`InductorPass`): its own ``uuid()``.

Where the design comes from: Inductor's `CustomGraphPass` contract (a uuid per pass, part of the FX
graph cache key) and vLLM's `InductorPass`, which hashes a pass's source and its config. Ours adds
the compile target a pass runs for (`PassContext`) and rejects what cannot be hashed stably.
"""

from __future__ import annotations

import abc
import builtins
import dataclasses
import dis
import functools
import hashlib
import inspect
import logging
import os
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .._torch.ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from ..fingerprint import UNHANDLED, Indescribable, code_digest, data_digest, describe
from ..errors import ConfigError

log = logging.getLogger("piecewise")

if TYPE_CHECKING:
    from ..targets import CompileRange, CompileTarget

__all__ = [
    "PassContext",
    "PiecewisePass",
    "FunctionPass",
    "InductorPass",
    "graph_pass",
    "as_pass",
    "resolve_pass",
    "stable_digest",
]

_FIX = (
    "define it with `def` in a module file, or subclass piecewise.passes.PiecewisePass and "
    "implement uuid()"
)


# -- the context a pass runs in ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PassContext:
    """What one run of the pass pipeline is compiling for.

    Attributes:
        target: the `CompileTarget`: the general (symbolic) compile, one compile range, or one
            static compile size.
    """

    target: CompileTarget

    @property
    def compile_range(self) -> CompileRange | None:
        """The inclusive token-count range of a range compile; None for the general and size
        compiles."""
        return self.target.compile_range

    @property
    def size(self) -> int | None:
        """The token count of a static-size compile (the graph holds no SymInt); else None."""
        return self.target.size

    @property
    def is_static(self) -> bool:
        return self.target.size is not None

    @property
    def label(self) -> str:
        """``"general"``, ``"range [1, 16]"`` or ``"size 4"`` (for logs)."""
        return self.target.label

    def covers(self, n: int) -> bool:
        """Whether token count `n` can reach code compiled for this target."""
        if self.target.size is not None:
            return n == self.target.size
        if self.target.compile_range is not None:
            return n in self.target.compile_range
        return True


# -- the interface -------------------------------------------------------------------------------
class PiecewisePass(abc.ABC):
    """A post-grad graph pass run by `PostGradPassManager` inside Inductor.

    Subclasses implement `__call__`. Public attributes are the pass's options: they enter the
    uuid (see `config`), so keep mutable state (statistics, records) in ``_``-prefixed
    attributes. A pass must be a pure function of the graph, the `PassContext` and its options:
    when the compile cache (ours or Inductor's) hits, passes do not run at all.

    Examples:
        In a module file (the uuid hashes the class's source file), then
        ``CompilationConfig(passes=[CountAdds()])``:

            class CountAdds(PiecewisePass):
                def __call__(self, graph, context):
                    adds = [n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor]
                    log.info("%d additions in %s", len(adds), context.target.label)
                    return 0   # rewrites made
    """

    #: shown in logs and timing records; defaults to the class name
    name: str = ""
    #: more files whose code the pass runs (helpers in another module); they enter the uuid
    source_files: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = cls.__name__

    @abc.abstractmethod
    def __call__(self, graph: torch.fx.Graph, context: PassContext) -> int | None:
        """Rewrite `graph` in place (its nodes carry ``meta["val"]`` fake tensors).

        Returns:
            the number of rewrites made, or None to let the manager count changed nodes.
        """

    def applies_to(self, context: PassContext) -> bool:
        """Whether to run for this compile target (default: every target). Declare here, for
        instance, a pass that only pays off for static sizes or for large ranges."""
        return True

    def config(self) -> Mapping[str, Any]:
        """The options that change what the pass does, as plain data (enters the uuid).

        Default: the dataclass fields of a dataclass pass, else the public instance attributes.

        Raises:
            ConfigError: an option holds a value that cannot be hashed stably (override this
                method to return plain data).
        """
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def uuid(self) -> str:
        """A stable hex id of this pass's source and options (see the module doc).

        Raises:
            ConfigError: the source cannot be read or an option cannot be hashed stably.
        """
        cls = type(self)
        files = _class_source_files(cls)
        for path in self.source_files:
            if not os.path.isfile(path):
                raise ConfigError(f"pass {self.name!r}: source_files names {path!r}, which is not a readable file")
            if path not in files:
                files.append(path)
        try:
            options = _stable(dict(self.config()), f"{cls.__qualname__}.config()")
        except _Unstable as e:
            raise ConfigError(
                f"pass {self.name!r}: option {e.where} holds {e.what}, which has no stable hash; "
                "keep state in '_'-prefixed attributes, or override config() to return plain data"
            ) from None
        data: dict[str, Any] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "files": [_file_digest(f) for f in files],
            "options": options,
        }
        reads = _class_globals(cls, self.name)
        if reads:  # the files hash the code; the module-level values it reads are hashed here
            data["globals"] = reads
        return stable_digest(data)

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class FunctionPass(PiecewisePass):
    """A plain function (or lambda) as a pass.

    `fn` is called as ``fn(graph)`` or, when it takes two positional arguments,
    ``fn(graph, context)``. Its uuid comes from its source (see the module doc); `applies_to`, a
    ``(PassContext) -> bool`` callable, is hashed the same way.

    Raises:
        ConfigError: `fn`'s source cannot be read (``eval``, ``exec``, a REPL, ``python -c``) or a
            value it closes over cannot be hashed stably. Raised at construction, so a
            `CompilationConfig` holding such a pass never exists.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        applies_to: Callable[[PassContext], bool] | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"pass {fn!r} is not callable; give a function taking (graph) or (graph, context)")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._applies_to = applies_to
        self._takes_context = _positional_arity(fn) >= 2
        self._uuid = stable_digest(
            {"fn": _callable_fingerprint(fn, self.name), "applies_to": _callable_fingerprint(applies_to, self.name)}
            if applies_to is not None
            else {"fn": _callable_fingerprint(fn, self.name)}
        )

    def __call__(self, graph: torch.fx.Graph, context: PassContext) -> int | None:
        out = self.fn(graph, context) if self._takes_context else self.fn(graph)
        return out if isinstance(out, int) and not isinstance(out, bool) else None

    def applies_to(self, context: PassContext) -> bool:
        return True if self._applies_to is None else bool(self._applies_to(context))

    def uuid(self) -> str:
        return self._uuid


class InductorPass(PiecewisePass):
    """An Inductor `CustomGraphPass` object used as a pass; its ``uuid()`` is trusted as is.

    Raises:
        ConfigError: its ``uuid()`` returns None (Inductor's "do not cache" answer: our cache
            key needs an id).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = type(inner).__name__
        if inner.uuid() is None:
            raise ConfigError(
                f"Inductor pass {self.name!r} returns uuid() None, so compiles using it cannot be cached; "
                "return a stable id from uuid() (e.g. torch._inductor.custom_graph_pass.get_hash_for_files)"
            )

    def __call__(self, graph: torch.fx.Graph, context: PassContext) -> int | None:
        self.inner(graph)
        return None

    def uuid(self) -> str:
        u = self.inner.uuid()
        return stable_digest({"inductor_pass": u.hex() if isinstance(u, bytes) else repr(u)})


def graph_pass(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    applies_to: Callable[[PassContext], bool] | None = None,
) -> Any:
    """Decorator form of `FunctionPass`: ``@graph_pass`` or
    ``@graph_pass(applies_to=lambda ctx: ctx.is_static)`` over ``def my_pass(graph, context)``."""
    if fn is None:
        return lambda f: FunctionPass(f, name=name, applies_to=applies_to)
    return FunctionPass(fn, name=name, applies_to=applies_to)


# -- turning config entries into passes --------------------------------------------------------
def as_pass(obj: Any) -> PiecewisePass:
    """A `PiecewisePass` for one entry of `CompilationConfig.passes`.

    Accepts a `PiecewisePass`, a `PiecewisePass` subclass (instantiated without arguments), an
    Inductor `CustomGraphPass`, a function or lambda, or an importable name
    ``"package.module:attr"`` naming any of those.

    Raises:
        ConfigError: the entry is none of those, the name does not import, or the pass has no
            stable uuid; the message says how to fix it.
    """
    from .._torch.inductor import CustomGraphPass

    if isinstance(obj, str):
        return as_pass(resolve_pass(obj))
    if isinstance(obj, PiecewisePass):
        obj.uuid()  # surface an unhashable option or unreadable source now, not mid-compile
        return obj
    if isinstance(obj, type) and issubclass(obj, PiecewisePass):
        try:
            return as_pass(obj())
        except TypeError as e:
            raise ConfigError(
                f"pass class {obj.__qualname__} cannot be built without arguments ({e}); put an instance in passes"
            ) from None
    if isinstance(obj, CustomGraphPass):
        return InductorPass(obj)
    if isinstance(obj, (types.FunctionType, functools.partial)):
        return FunctionPass(obj)
    raise ConfigError(
        f"passes holds {obj!r} ({type(obj).__name__}); each entry must be a PiecewisePass, a function taking "
        "(graph) or (graph, context), an Inductor CustomGraphPass, or a name 'package.module:attr'"
    )


def resolve_pass(name: str) -> Any:
    """Import ``"package.module:attr"`` (``attr`` may be dotted) and return the object.

    Raises:
        ConfigError: the name is malformed or does not import.
    """
    import importlib

    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"pass name {name!r} must be written 'package.module:attr', e.g. 'mypkg.passes:FuseRMSNorm'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"pass {name!r}: cannot import module {module_name!r} ({e}); check the name and sys.path") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"pass {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


# -- stable hashing ------------------------------------------------------------------------------
def stable_digest(data: Any) -> str:
    """sha256 hex of the canonical JSON of `data` (plain data only: anything else raises
    ``TypeError``). `piecewise.fingerprint.data_digest`, strict."""
    return data_digest(data, strict=True)


#: a value with no deterministic description (`piecewise.fingerprint.Indescribable`)
_Unstable = Indescribable


def _stable(v: Any, where: str, seen: frozenset[int] = frozenset()) -> Any:
    """Plain JSON data that identifies `v` across processes (`piecewise.fingerprint.describe`, with
    what only passes describe: torch ops, passes, user classes and functions by their source), or
    `_Unstable`."""
    return describe(v, where, extend=_describe_pass_value, seen=seen)


def _describe_pass_value(v: Any, where: str, seen: frozenset[int]) -> Any:
    """`describe`'s ``extend`` hook for pass options and what a pass's code reads."""
    if isinstance(v, (OpOverload, OpOverloadPacket, HigherOrderOperator)):
        return {"op": str(v)}
    if isinstance(getattr(v, "_opoverload", None), OpOverload):  # torch.library CustomOpDef
        return {"op": str(v._opoverload)}
    if isinstance(v, PiecewisePass):
        return {"pass": v.uuid()}
    if isinstance(v, type):
        return _class_fingerprint(v)
    if isinstance(v, (types.FunctionType, functools.partial)):
        return {"function": _describe_function(v, where, seen)}
    return UNHANDLED


def _class_fingerprint(cls: type) -> Any:
    """A class by name; a class of user code (see `_is_library_file`) also by its source, so a
    pass that uses a helper class sees edits to it."""
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    module = inspect.getmodule(cls)
    if module is not None and not _is_library_file(getattr(module, "__file__", None)):
        try:
            out["source"] = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            pass  # a class without readable source is still named
    return out


def _describe_function(fn: Any, where: str, seen: frozenset[int]) -> Any:
    """A function of library code by name (its package's version stands for it); any other by
    `_function_fingerprint` (source, code, defaults, closure and the module-level values it
    reads). A decorated function (``functools.wraps``) also describes what it wraps."""
    if isinstance(fn, functools.partial):
        return _function_fingerprint(fn, where, seen)
    try:
        inner = inspect.unwrap(fn)
    except ValueError:
        inner = fn
    if inner is not fn:
        return {"wrapper": _describe_function(_strip_wrapped(fn), where, seen), "wrapped": _stable(inner, where, seen)}
    if _is_library_file(fn.__code__.co_filename):
        return {"library": f"{fn.__module__}.{fn.__qualname__}"}
    return _function_fingerprint(fn, where, seen)


def _strip_wrapped(fn: types.FunctionType) -> types.FunctionType:
    """`fn` without its ``__wrapped__`` (a copy), so the wrapper's own code can be described."""
    bare = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    bare.__kwdefaults__ = fn.__kwdefaults__
    bare.__qualname__ = fn.__qualname__
    bare.__module__ = fn.__module__
    return bare


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Directories of code versioned by its package: the standard library, site-packages, and
    piecewise itself (its version is a key factor)."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # some virtualenv versions
        pass
    try:
        roots.add(site.getusersitepackages())
    except AttributeError:
        pass
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../piecewise
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


@functools.lru_cache(maxsize=4096)
def _is_library_file(path: str | None) -> bool:
    if not path:
        return True  # a built-in module
    if path.startswith("<"):
        return path.startswith("<frozen ")  # frozen stdlib modules; "<string>" is user code
    real = os.path.realpath(path)
    return any(real.startswith(r) for r in _library_roots())


def _function_fingerprint(fn: Any, where: str, seen: frozenset[int]) -> Any:
    if isinstance(fn, functools.partial):
        return {
            "partial": _describe_function(fn.func, where, seen) if isinstance(fn.func, (types.FunctionType, functools.partial)) else _stable(fn.func, where, seen),
            "args": _stable(fn.args, f"{where} partial args", seen),
            "keywords": _stable(fn.keywords, f"{where} partial keywords", seen),
        }
    qual = f"{fn.__module__}.{fn.__qualname__}"
    if id(fn) in seen:  # recursion (a helper calling itself): its body is already in the digest
        return {"ref": qual}
    seen = seen | {id(fn)}
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise _NoSource(fn, str(e)) from None
    code = fn.__code__
    closure = {}
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the function was made)
            value = None
        closure[name] = _stable(value, f"variable {name!r} closed over by {fn.__qualname__}", seen)
    return {
        "qualname": qual,
        "source": source,
        "code": code_digest(code),  # the one digest, shared with the warm-start fingerprint
        "defaults": _stable(fn.__defaults__, f"defaults of {fn.__qualname__}", seen),
        "kwdefaults": _stable(fn.__kwdefaults__, f"keyword defaults of {fn.__qualname__}", seen),
        "closure": closure,
        "globals": _globals_read_by(fn, seen),
    }


def _globals_read_by(fn: types.FunctionType, seen: frozenset[int]) -> dict[str, Any]:
    """``{name: description}`` of every module-level value `fn`'s code reads (nested functions and
    comprehensions included; module dunders such as ``__file__`` excluded), by `_stable`: plain
    data and containers of it at any depth, enums,
    dataclass instances, ops, classes, and functions (same-module and other user code walked
    recursively, library code by name). An attribute read through a module or a user class
    (``cfg.OPTION``, ``Options.scale``) is followed to the value read. Builtins are skipped; a
    name that is not defined (yet) is recorded as absent.

    Raises:
        _Unstable: a value read has no deterministic description (an arbitrary object, a tensor).
        _NoSource: a function of user code it calls has no readable source.
    """
    out: dict[str, Any] = {}
    for chain in sorted(_global_reads(fn.__code__)):
        name = chain[0]
        if name.startswith("__") and name.endswith("__"):
            continue  # module metadata (__file__ is a path: the same code elsewhere must hit)
        if name not in fn.__globals__:
            if not hasattr(builtins, name):
                out[name] = {"absent": True}
            continue
        value, label = fn.__globals__[name], name
        for attr in chain[1:]:
            if not (isinstance(value, types.ModuleType)
                    or (isinstance(value, type) and not _is_library_file(getattr(inspect.getmodule(value), "__file__", None)))):
                break
            try:
                value = getattr(value, attr)
            except Exception as e:  # noqa: BLE001 - not defined (yet): the pass would fail the same way
                log.debug("pass uuid: %s.%s is not readable (%s: %s)", label, attr, type(e).__name__, e)
                value = _ABSENT
            label = f"{label}.{attr}"
            if value is _ABSENT:
                break
        if label in out:
            continue
        if value is _ABSENT:
            out[label] = {"absent": True}
            continue
        try:
            out[label] = _stable(value, label, seen)
        except _Unstable as e:
            if e.global_name is None:  # the innermost reader names it (a helper's global)
                e.global_name, e.reader = label, fn.__qualname__
            raise
    return out


_ABSENT = object()


_CHAIN_SKIP = frozenset({"EXTENDED_ARG", "NOP", "CACHE"})


def _global_reads(code: types.CodeType) -> set[tuple[str, ...]]:
    """Every ``LOAD_GLOBAL name`` in `code` and the code nested in it, each with the attribute
    names loaded right after it (``cfg.OPTION.x`` gives ``("cfg", "OPTION", "x")``)."""
    out: set[tuple[str, ...]] = set()
    for c in _code_objects(code):
        chain: list[str] | None = None
        for ins in dis.get_instructions(c):
            if ins.opname in _CHAIN_SKIP:
                continue
            if chain is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(ins.argval, str):
                chain.append(ins.argval)
                continue
            if chain:
                out.add(tuple(chain))
            chain = [ins.argval] if ins.opname == "LOAD_GLOBAL" and isinstance(ins.argval, str) else None
        if chain:
            out.add(tuple(chain))
    return out


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    out = [code]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _code_objects(c)
    return out


class _NoSource(Exception):
    def __init__(self, fn: Any, reason: str) -> None:
        super().__init__(reason)
        self.fn, self.reason = fn, reason


def _callable_fingerprint(fn: Any, pass_name: str) -> Any:
    """`_function_fingerprint` with its failures turned into `ConfigError`s that say what to do."""
    try:
        if isinstance(fn, (types.FunctionType, functools.partial)):
            return _function_fingerprint(fn, pass_name, frozenset())
        return _stable(fn, pass_name)
    except _NoSource as e:
        raise ConfigError(
            f"pass {pass_name!r}: the source of {getattr(e.fn, '__qualname__', e.fn)!r} cannot be read "
            f"({e.reason}), so no stable uuid exists and the compile cache cannot tell it apart from "
            f"another pass; {_FIX}"
        ) from None
    except _Unstable as e:
        if e.global_name is not None:
            raise _global_error(pass_name, e) from None
        raise ConfigError(
            f"pass {pass_name!r}: {e.where} holds {e.what}, which has no stable hash; pass plain data "
            "(numbers, strings, tuples, dtypes) or subclass piecewise.passes.PiecewisePass and return "
            "the option from config()"
        ) from None


def _global_error(pass_name: str, e: _Unstable) -> ConfigError:
    inner = "" if e.where == e.global_name else f" holds at {e.where}"
    return ConfigError(
        f"pass {pass_name!r}: module-level {e.global_name!r} read by {e.reader}{inner} {'' if inner else 'is '}{e.what}, which the "
        "pass uuid cannot describe deterministically, so the compile cache could serve code built with "
        "another value of it; make it plain data (numbers, strings, containers of them, enums, dataclasses), "
        "or subclass piecewise.passes.PiecewisePass and take the value as an option returned by config(), "
        "or give the pass a uuid() method that covers it"
    )


def _positional_arity(fn: Any) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _class_source_files(cls: type) -> list[str]:
    """The files defining the code of `cls` and its bases up to `PiecewisePass`.

    Raises:
        ConfigError: a class's code was not loaded from a readable file.
    """
    files: list[str] = []
    for klass in cls.__mro__:
        if klass is PiecewisePass or not issubclass(klass, PiecewisePass):
            continue
        found = set()
        for attr in vars(klass).values():
            for f in _functions_of(attr):
                found.add(f.__code__.co_filename)
        if not found:  # a class holding only attributes: its module's file
            module = inspect.getmodule(klass)
            found.add(getattr(module, "__file__", None) or f"<no file for module {klass.__module__}>")
        for path in sorted(found):
            if path.startswith("<") or not os.path.isfile(path):
                raise ConfigError(
                    f"pass class {klass.__qualname__} is defined in {path!r}, whose source cannot be read, so "
                    f"no stable uuid exists; define the class in a module file, or override uuid()"
                )
            if path not in files:
                files.append(path)
    return files


def _class_globals(cls: type, pass_name: str) -> dict[str, Any]:
    """The module-level values read by the methods of `cls` and its bases below `PiecewisePass`
    (see `_globals_read_by`); classes of library code (piecewise's own passes) are skipped.

    Raises:
        ConfigError: a value read has no deterministic description, or a user-code function a
            method calls has no readable source.
    """
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass is PiecewisePass or not issubclass(klass, PiecewisePass):
            continue
        for attr_name, attr in sorted(vars(klass).items()):
            for f in _functions_of(attr):
                if _is_library_file(f.__code__.co_filename):
                    continue
                try:
                    reads = _globals_read_by(f, frozenset({id(f)}))
                except _Unstable as e:
                    raise _global_error(pass_name, e) from None
                except _NoSource as e:
                    raise ConfigError(
                        f"pass {pass_name!r}: {klass.__qualname__}.{attr_name} calls "
                        f"{getattr(e.fn, '__qualname__', e.fn)!r}, whose source cannot be read ({e.reason}), so "
                        f"no stable uuid exists; {_FIX}"
                    ) from None
                if reads:
                    out[f"{klass.__qualname__}.{attr_name}"] = reads
    return out


def _functions_of(attr: Any) -> list[types.FunctionType]:
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    if isinstance(attr, property):
        return [f for f in (attr.fget, attr.fset, attr.fdel) if isinstance(f, types.FunctionType)]
    if isinstance(attr, functools.partialmethod):
        attr = attr.func
    attr = inspect.unwrap(attr) if callable(attr) else attr
    return [attr] if isinstance(attr, types.FunctionType) else []


@functools.lru_cache(maxsize=256)
def _file_digest_at(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_digest(path: str) -> str:
    """sha256 of a source file's bytes (cached per modification time and size). The path itself
    is not part of the uuid: the same code checked out elsewhere hits."""
    st = os.stat(path)
    return _file_digest_at(path, st.st_mtime_ns, st.st_size)
