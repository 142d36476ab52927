"""torch's operator objects and schemas (``torch._ops``, ``torch._C``'s schema types and dispatcher
queries, the ``auto_functionalized`` higher-order op) piecewise depends on.

Verified on torch 2.13.0 (CPU); ``torch._ops`` and the schema types are imported by ``import
torch`` in every release since 2.0, so they are re-exported as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import FloatType, ListType, OptionalType
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

__all__ = ["OpOverload", "OpOverloadPacket", "HigherOrderOperator", "OptionalType", "FloatType", "ListType",
           "has_kernel_for_dispatch_key", "auto_functionalized", "mutable_args", "custom_op_def"]

#: ``torch._ops.OpOverload`` / ``OpOverloadPacket`` / ``HigherOrderOperator``: the types of
#: ``torch.ops.ns.op.default``, ``torch.ops.ns.op`` and higher-order ops. piecewise tells splitting
#: ops, op names and graph targets apart by them (``ops``, ``split``, ``piece``, ``passes``).
#: ``torch._C.OptionalType`` / ``FloatType`` / ``ListType``: schema argument types, for converting a
#: splitting op's arguments as the dispatcher does (``ops.DirectCall``).


def has_kernel_for_dispatch_key(qualname: str, key: str) -> bool:
    """Whether op ``"ns::op"`` has a kernel of its own registered at dispatch key `key` ("CPU",
    "CUDA", ...): ``torch._C._dispatch_has_kernel_for_dispatch_key``. Why: a splitting op called
    directly (``ops.direct_call``) must not skip a device kernel a user registered."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)


def custom_op_def(op: Any) -> Any:
    """The ``torch.library.custom_op`` definition (``CustomOpDef``) behind op overload `op`, or None
    for an op not defined so: ``torch._library.custom_ops._maybe_get_opdef``. Why: the fake graph
    platform (``piecewise.testing``) runs a custom op's Python body to check what it does."""
    from torch._library.custom_ops import _maybe_get_opdef

    return _maybe_get_opdef(op)


def auto_functionalized() -> Any:
    """``torch.ops.higher_order.auto_functionalized``: the higher-order op AOTAutograd wraps a
    mutating custom op in; the re-inplacing pass (``passes.reinplace``) finds and rewrites its nodes."""
    return torch.ops.higher_order.auto_functionalized


def mutable_args(op: OpOverload) -> Any:
    """``torch._higher_order_ops.auto_functionalize.get_mutable_args(op)``: the names (and types)
    of the arguments `op`'s schema mutates, as ``auto_functionalized`` passes them (the
    re-inplacing pass matches its nodes' arguments by them)."""
    from torch._higher_order_ops.auto_functionalize import get_mutable_args

    return get_mutable_args(op)
