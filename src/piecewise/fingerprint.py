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
"""

from __future__ import annotations

import hashlib
import json
import types
from typing import Any

__all__ = ["code_digest", "const_repr", "canonical_json", "data_digest"]


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
