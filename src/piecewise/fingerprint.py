"""One digest of Python code, and one digest of plain data, for every fingerprint that must be
equal in every process.

`code_digest` hashes a code object's bytecode, names, local variable names and constants, nested
code objects included, with every constant written in a canonical form (`const_repr`): a
``frozenset`` constant - what ``x in {"a", "b"}`` compiles to - prints its items in string-hash
order, which changes with ``PYTHONHASHSEED`` from one process to the next, so it is written with
its items sorted; a nested code object is written as its own digest (its repr carries its address).

Used by the warm-start module fingerprint (`piecewise.warmstart`: functions held as module
attributes) and meant for every other code hash (pass uuids), so that the two cannot drift apart.
Bytecode is specific to the Python version: a new interpreter changes every digest.

`canonical_json` / `data_digest`: plain data (dicts, lists, strings, numbers) as compact JSON with
sorted keys, and its sha256; used by cache keys, index checksums and pass uuids alike.

`describe`: the one describer of Python values for what is hashed into a cache key - plain JSON data
that identifies a value across processes (pass options and what a pass's code reads, `piecewise.passes`),
`Indescribable` where a value has none. What only one caller knows how to describe (a pass, a user
function by its source) comes in through its ``extend`` hook.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import io
import json
import logging
import pathlib
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["code_digest", "const_repr", "canonical_json", "data_digest", "describe", "Indescribable"]


def code_digest(code: types.CodeType) -> str:
    """sha256 (hex) of `code`'s bytecode, ``co_names``, ``co_varnames`` and constants
    (`const_repr`), the same in every process for the same source and Python version."""
    h = hashlib.sha256()
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for c in code.co_consts:
        h.update(const_repr(c).encode())
    return h.hexdigest()


def const_repr(c: Any) -> str:
    """A code constant written the same way in every process: nested code as its `code_digest`,
    frozensets with their items sorted, tuples item by item, anything else by ``repr`` (code
    constants are otherwise numbers, strings, bytes, None, Ellipsis and slices of them)."""
    if isinstance(c, types.CodeType):
        return code_digest(c)
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(const_repr(x) for x in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(const_repr(x) for x in c) + ")"
    return repr(c)


def canonical_json(data: Any, *, strict: bool = False) -> bytes:
    """`data` as compact JSON with sorted keys (no insignificant whitespace). Values JSON cannot
    write are written with ``str`` unless `strict` (then they raise ``TypeError``)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=None if strict else str).encode()


def data_digest(data: Any, *, strict: bool = False) -> str:
    """sha256 (hex, 64 digits) of `canonical_json(data)`."""
    return hashlib.sha256(canonical_json(data, strict=strict)).hexdigest()


class Indescribable(Exception):
    """A value with no deterministic description (an arbitrary object, a tensor): `where` names it,
    `what` says what it is. `global_name` / `reader` are set by a caller when the value is (inside) a
    module-level value read by a function's code."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(where)
        self.where, self.what = where, what
        self.global_name: str | None = None
        self.reader: str | None = None


#: an ``extend`` hook's answer for a value it does not describe
UNHANDLED: Any = object()

#: ``extend(value, where, seen)``: a caller's description of values `describe` leaves to it, or `UNHANDLED`
Extend = Callable[[Any, str, frozenset[int]], Any]


def describe(v: Any, where: str = "value", *, extend: Extend | None = None, seen: frozenset[int] = frozenset()) -> Any:
    """Plain JSON data that identifies `v` across processes (feed it to `data_digest`).

    Canonical: sets, and mappings, are sorted by the canonical JSON of their (keys') descriptions,
    so neither insertion order nor ``PYTHONHASHSEED`` changes the result. Numbers and strings are
    themselves; floats, complex numbers, bytes, enums, ranges, regexes, paths, dtypes and devices,
    tuples, lists, namedtuples, sets, mappings, dataclasses, modules, builtins and pybind11 enums
    are written with their kind; loggers and streams (output only) by name. `extend` is asked,
    after the containers, about every other value (and recursion passes it on).

    Raises:
        Indescribable: a value nothing here describes (an arbitrary object, a tensor), or a
            container that contains itself; `where` names the path to it.

    Example: ``describe({"eps": 1e-5, "dims": (1, 2)})`` is
    ``{"map": [("dims", {"tuple": [1, 2]}), ("eps", {"float": "1e-05"})]}``.
    """
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": repr(v)}
    if isinstance(v, complex):
        return {"complex": repr(v)}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": hashlib.sha256(bytes(v)).hexdigest()}
    if isinstance(v, enum.Enum):
        return {"enum": f"{type(v).__module__}.{type(v).__qualname__}.{v.name}"}
    if isinstance(v, range):
        return {"range": [v.start, v.stop, v.step]}
    if isinstance(v, re.Pattern):
        return {"regex": describe(v.pattern, where, extend=extend, seen=seen), "flags": v.flags}
    if isinstance(v, pathlib.PurePath):
        return {"path": str(v)}
    if isinstance(v, (logging.Logger, logging.LoggerAdapter)):  # output only: never changes a graph
        return {"logger": getattr(v, "name", None) or getattr(getattr(v, "logger", None), "name", None)}
    if isinstance(v, io.IOBase):  # sys.stderr and the like: output only
        return {"stream": f"{type(v).__module__}.{type(v).__qualname__}"}
    if isinstance(v, (tuple, list, set, frozenset, Mapping)) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
        if id(v) in seen:
            raise Indescribable(where, f"a {type(v).__qualname__} that contains itself")
        seen = seen | {id(v)}
    torch = sys.modules.get("torch")  # no torch value exists before torch is imported (cache tools never import it)
    if torch is not None and isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return {"torch": str(v)}
    if isinstance(v, (tuple, list)):
        if hasattr(v, "_fields") and type(v).__module__ not in ("builtins", "torch"):  # a namedtuple
            return {"namedtuple": f"{type(v).__module__}.{type(v).__qualname__}",
                    "fields": {f: describe(x, f"{where}.{f}", extend=extend, seen=seen) for f, x in zip(v._fields, v)}}
        return {type(v).__name__: [describe(x, f"{where}[{i}]", extend=extend, seen=seen) for i, x in enumerate(v)]}
    if isinstance(v, (set, frozenset)):
        items = [describe(x, f"{where}{{}}", extend=extend, seen=seen) for x in v]
        return {"set": sorted(items, key=lambda x: json.dumps(x, sort_keys=True))}
    if isinstance(v, Mapping):
        items = [(describe(k, f"{where} key", extend=extend, seen=seen), describe(x, f"{where}[{k!r}]", extend=extend, seen=seen))
                 for k, x in v.items()]
        return {"map": sorted(items, key=lambda kv: json.dumps(kv[0], sort_keys=True))}
    if extend is not None:
        out = extend(v, where, seen)
        if out is not UNHANDLED:
            return out
    if isinstance(v, type):
        return {"class": f"{v.__module__}.{v.__qualname__}"}
    if isinstance(v, types.ModuleType):
        return {"module": getattr(v, "__name__", type(v).__qualname__)}
    if isinstance(v, (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                      types.MethodDescriptorType, types.ClassMethodDescriptorType)):
        return {"builtin": f"{getattr(v, '__module__', None)}.{v.__qualname__}"}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = {f.name: describe(getattr(v, f.name), f"{where}.{f.name}", extend=extend, seen=seen) for f in dataclasses.fields(v)}
        return {"dataclass": f"{type(v).__module__}.{type(v).__qualname__}", "fields": fields}
    members = getattr(type(v), "__members__", None)  # a pybind11 enum (torch.Tag, ...)
    if isinstance(members, Mapping) and isinstance(getattr(v, "name", None), str) and members.get(v.name) is v:
        return {"enum": f"{type(v).__module__}.{type(v).__qualname__}.{v.name}"}
    if callable(v) and hasattr(v, "__wrapped__"):  # functools.lru_cache and other wrappers of a function
        try:
            inner = inspect.unwrap(v)
        except ValueError:
            inner = v
        if isinstance(inner, types.FunctionType):
            return {"wrapper": f"{type(v).__module__}.{type(v).__qualname__}",
                    "wrapped": describe(inner, where, extend=extend, seen=seen)}
    raise Indescribable(where, f"a {type(v).__module__}.{type(v).__qualname__}")
