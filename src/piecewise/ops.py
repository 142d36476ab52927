"""Splitting ops: the ops a graph is cut at, registered as torch custom ops.

`splitting_op` wraps `torch.library.custom_op` and records the op in a process-wide registry of
default split points (the same role `torch.library` plays for ops themselves). Names are
normalised to ``"namespace::op"`` so every spelling a user might write matches:
``"ns::op"``, ``"ns.op"``, ``"ns::op.default"``, ``torch.ops.ns.op``, ``torch.ops.ns.op.default``
and the `CustomOpDef` returned by the decorator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import ConfigError

__all__ = ["splitting_op", "mark_splitting_op", "registered_splitting_ops", "normalize_op_name", "op_exists"]

_lock = threading.Lock()
_registered: dict[str, None] = {}  # insertion-ordered set of normalised names


def normalize_op_name(op: Any) -> str:
    """Return ``"namespace::op"`` for any spelling of an op (overload dropped).

    Raises:
        ConfigError: `op` is neither a string nor a torch op object.
    """
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}::{op._opname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        ns, _, name = op._qualified_op_name.partition("::")
        return f"{ns}::{name}"
    # torch.library.custom_op's CustomOpDef exposes the underlying packet via `_opoverload`.
    inner = getattr(op, "_opoverload", None)
    if isinstance(inner, torch._ops.OpOverload):
        return normalize_op_name(inner)
    if isinstance(op, str):
        s = op.strip()
        if "::" in s:
            ns, _, rest = s.partition("::")
            name = rest.split(".", 1)[0]
        else:
            parts = s.split(".")
            if parts[:2] == ["torch", "ops"]:
                parts = parts[2:]
            if len(parts) < 2:
                raise ConfigError(f"split-op name {op!r} has no namespace; write it as 'namespace::op'")
            ns, name = parts[0], parts[1]
        if not ns or not name:
            raise ConfigError(f"split-op name {op!r} is malformed; write it as 'namespace::op'")
        return f"{ns}::{name}"
    raise ConfigError(f"split op {op!r} must be a name like 'ns::op' or a torch op object")


def op_exists(name: str) -> bool:
    """Whether ``torch.ops`` knows the normalised op `name`."""
    ns, _, op = name.partition("::")
    try:
        getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return False
    return True


def mark_splitting_op(op: Any) -> str:
    """Add an existing op to the default split points; returns its normalised name."""
    name = normalize_op_name(op)
    with _lock:
        _registered[name] = None
    return name


def registered_splitting_ops() -> tuple[str, ...]:
    """Normalised names of every op registered with `splitting_op` / `mark_splitting_op`."""
    with _lock:
        return tuple(_registered)


def splitting_op(
    name: str,
    fn: Callable[..., Any] | None = None,
    *,
    mutates_args: Iterable[str] | str = (),
    schema: str | None = None,
) -> Any:
    """Register `fn` as the torch custom op `name` and mark it as a split point.

    Usable as a decorator: ``@splitting_op("mylib::attention", mutates_args=("kv_cache",))``.
    The result is `torch.library.custom_op`'s `CustomOpDef`; register its fake (meta) kernel with
    ``@op.register_fake``. Ops that mutate an argument must list it in `mutates_args`; the piece
    holding the op runs eagerly, so the mutation happens in place.

    Raises:
        ConfigError: `name` is not of the form ``"namespace::op"``.
    """
    if not isinstance(name, str) or "::" not in name:
        raise ConfigError(f"splitting_op name {name!r} must be 'namespace::op_name'")
    if isinstance(mutates_args, str) and mutates_args != "unknown":
        mutates_args = (mutates_args,)

    def register(f: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=mutates_args, schema=schema)(f)
        mark_splitting_op(name)
        return op

    return register(fn) if fn is not None else register


def resolve_splitting_ops(configured: Iterable[Any] | None) -> tuple[str, ...]:
    """The normalised split-op set for a config: the configured ops, or every registered one."""
    if configured is None:
        return registered_splitting_ops()
    return tuple(dict.fromkeys(normalize_op_name(o) for o in configured))
