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
import torch.fx

from ._torch.dispatch import dispatch_is_plain
from ._torch.ops import FloatType, ListType, OpOverload, OpOverloadPacket, OptionalType, has_kernel_for_dispatch_key
from .errors import ConfigError

__all__ = ["splitting_op", "mark_splitting_op", "registered_splitting_ops", "normalize_op_name", "op_exists", "DirectCall",
           "direct_call"]

_lock = threading.Lock()
_registered: dict[str, None] = {}  # insertion-ordered set of normalised names
#: the Python function each `splitting_op` registered, by normalised name (what `DirectCall` runs)
_python_kernels: dict[str, Callable[..., Any]] = {}
#: device dispatch keys at which a kernel of its own (``register_kernel``) means the op's Python
#: function is not what the dispatcher would run (autograd needs no check: `DirectCall` leaves every
#: call that needs a gradient to the dispatcher)
_DEVICE_KEYS = ("CPU", "CUDA", "XPU", "MPS", "HIP", "PrivateUse1")


def normalize_op_name(op: Any) -> str:
    """Return ``"namespace::op"`` for any spelling of an op (overload dropped).

    Raises:
        ConfigError: `op` is neither a string nor a torch op object.
    """
    if isinstance(op, OpOverload):
        return f"{op.namespace}::{op._opname}"
    if isinstance(op, OpOverloadPacket):
        ns, _, name = op._qualified_op_name.partition("::")
        return f"{ns}::{name}"
    # torch.library.custom_op's CustomOpDef exposes the underlying packet via `_opoverload`.
    inner = getattr(op, "_opoverload", None)
    if isinstance(inner, OpOverload):
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
    """Add an existing op (an ``OpOverload``, ``OpOverloadPacket`` or a ``"namespace::op"`` name)
    to the default split points of every later compile; returns its normalised name.

    Examples:
        >>> import torch, piecewise as pw
        >>> pw.mark_splitting_op(torch.ops.aten.softmax.int)
        'aten::softmax'
        >>> pw.mark_splitting_op("mylib::attention")    # an op registered elsewhere (or later)
        'mylib::attention'
    """
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

    Examples:
        >>> import torch, piecewise as pw
        >>> @pw.splitting_op("mydocs::attention")
        ... def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ...     return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> @attention.register_fake
        ... def _(q, k, v):
        ...     return torch.empty_like(q)        # same shape, dtype and strides as the real op's output
        >>> q = torch.randn(1, 2, 5, 8)           # [batch, heads, tokens, head_dim]
        >>> torch.ops.mydocs.attention(q, q, q).shape
        torch.Size([1, 2, 5, 8])
    """
    if not isinstance(name, str) or "::" not in name:
        raise ConfigError(f"splitting_op name {name!r} must be 'namespace::op_name'")
    if isinstance(mutates_args, str) and mutates_args != "unknown":
        mutates_args = (mutates_args,)

    def register(f: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=mutates_args, schema=schema)(f)
        registered = mark_splitting_op(name)
        with _lock:
            _python_kernels[registered] = f
        return op

    return register(fn) if fn is not None else register


def resolve_splitting_ops(configured: Iterable[Any] | None) -> tuple[str, ...]:
    """The normalised split-op set for a config: the configured ops, or every registered one."""
    if configured is None:
        return registered_splitting_ops()
    return tuple(dict.fromkeys(normalize_op_name(o) for o in configured))


class DirectCall:
    """A splitting op called as its Python function when going through the dispatcher would end in
    the same call, and through the dispatcher otherwise.

    A `torch.library.custom_op` call passes Python kernels for autograd, for version counters of
    mutated arguments and for the backend (argument defaults filled, the outputs checked for
    aliasing): measured on a 2-core CPU, 110-150 us a call for the transformers cached attention
    (8 arguments, two mutated) against 100 us for its body, paid once per layer per forward
    between compiled pieces. The direct call bumps the mutated arguments' version counters
    (`torch.autograd.graph.increment_version`), as the dispatcher path does, and is taken only
    when nothing else could intercept the call: gradients off or no argument needing one, no
    torch-function or dispatch mode, no tensor subclass argument (nn.Parameter aside), the
    profiler off (so the op stays visible there), and not on the first call, which goes through
    the dispatcher so that its checks of the outputs run once. Made by `direct_call` at build time, when the
    op has no kernel of its own for a device key (``register_kernel``): such an op goes through the
    dispatcher always.

    Calls: the op's arguments, positional or by name, as the split graph's node passes them.
    """

    __slots__ = ("overload", "fn", "mutated", "checked", "__name__")

    def __init__(self, overload: OpOverload, fn: Callable[..., Any]) -> None:
        self.overload = overload
        self.fn = fn
        #: whether a call went through the dispatcher yet (its backend kernel checks, once, that the
        #: outputs alias no input, as ``custom_op`` requires; later calls skip the check)
        self.checked = False
        args = overload._schema.arguments
        #: (position, name) of each argument the op writes
        self.mutated = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        self.__name__ = f"direct_{overload.namespace}_{overload._opname}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.checked and self._direct(args, kwargs)):
            out = self.overload(*args, **kwargs)
            self.checked = True
            return out
        out = self.fn(*args, **kwargs)
        for i, name in self.mutated:
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):  # Tensor(a!)[] too
                if isinstance(t, torch.Tensor):
                    torch.autograd.graph.increment_version(t)
        return out

    def normalize(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A graph node's arguments (constants, containers and `torch.fx.Node` leaves) as the
        dispatcher would hand them to the function: an int constant where the schema says float
        becomes a float, a tuple where it says a list becomes a list. None when an argument the
        dispatcher would convert is only known at run time (a node where the schema wants a
        float or a list): such a call keeps the dispatcher."""
        names = [a.name for a in self.overload._schema.arguments]
        types = dict(zip(names, (a.type for a in self.overload._schema.arguments)))
        try:
            new_args = tuple(_convert(v, types[n]) for v, n in zip(args, names))
            new_kwargs = {k: _convert(v, types[k]) for k, v in kwargs.items()}
        except (_RuntimeTyped, KeyError):
            return None
        return new_args, new_kwargs

    @staticmethod
    def _direct(args: tuple, kwargs: dict) -> bool:
        if not dispatch_is_plain():
            return False
        grad = torch.is_grad_enabled()
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):  # Tensor[] arguments too
                if isinstance(t, torch.Tensor):
                    if (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter) or (grad and t.requires_grad):
                        return False
        return True

    def __repr__(self) -> str:
        return f"DirectCall({self.overload})"


def direct_call(target: Any) -> DirectCall | None:
    """A `DirectCall` for an op overload registered with `splitting_op` that has no device kernel
    of its own; None for anything else (which keeps its dispatcher call). A packet (what Dynamo's
    graphs call) stands for its one overload; a packet with several keeps the dispatcher's choice."""
    if isinstance(target, OpOverloadPacket):
        overloads = target.overloads()
        if len(overloads) != 1:
            return None
        target = getattr(target, overloads[0])
    if not isinstance(target, OpOverload):
        return None
    name = normalize_op_name(target)
    with _lock:
        fn = _python_kernels.get(name)
    if fn is None:
        return None
    qualname = f"{target.namespace}::{target._opname}"
    if any(has_kernel_for_dispatch_key(qualname, k) for k in _DEVICE_KEYS):
        return None
    import inspect

    try:  # an explicit schema may name the arguments otherwise: keyword arguments would not bind
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    if params != [a.name for a in target._schema.arguments]:
        return None
    return DirectCall(target, fn)


class _RuntimeTyped(Exception):
    """An argument the dispatcher would convert is a graph node (its type is known at run time only)."""


def _convert(value: Any, typ: Any) -> Any:
    """`value` (a node argument) converted as the dispatcher converts it for schema type `typ`."""
    if isinstance(typ, OptionalType):
        return None if value is None else _convert(value, typ.getElementType())
    is_node = isinstance(value, torch.fx.Node)
    if isinstance(typ, FloatType):
        if is_node:
            raise _RuntimeTyped
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(typ, ListType):
        if is_node or not isinstance(value, (list, tuple)):
            raise _RuntimeTyped
        return [_convert(v, typ.getElementType()) for v in value]
    return value
