"""No-op elimination: reshapes, views, slices and slice-scatters that do nothing (built-in pass).

Rewrites, on the functional post-grad graph (``meta["val"]`` fake tensors, possibly symbolic):

* ``view`` / ``reshape`` / ``_unsafe_view`` whose output has the input's shape, strides and
  offset: uses read the input instead.
* a chain of those whose source is contiguous: the outer one reads the chain's source directly, so
  ``x.reshape(a).reshape(b).reshape(c)`` keeps one reshape (to ``c``), or none when ``c`` is
  ``x``'s shape.
* ``slice`` whose output has the input's shape, strides and offset (``x[0:n]`` on a dim of size
  ``n``, ``x[:]``, an end past the size): removed. ``x[:-1]`` is not a no-op and stays.
* ``slice_scatter(base, src, ...)`` whose slice covers all of ``base``: the result is ``src``.
* ``slice_scatter(base, v, ...)`` where ``v`` is the very view of ``base`` being written back
  (same storage, strides and offset as the slice): the result is ``base``.

Sizes are compared with `statically_known_true`, so the pass never adds a shape guard: a fact that
holds only for some sizes of a range leaves the op in place.

What this adds over Inductor's own ``remove_noop_ops`` (which runs before custom post passes, when
``pattern_matcher`` is on): collapsing reshape chains, same-shape ``reshape``/``_unsafe_view``,
and scatters of a view back into its own base; user passes after it see the simpler graph. Like
Inductor's pass it never makes a returned value the same tensor as an input or another output, and
it never forwards to a tensor whose storage the graph mutates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from .._torch.dispatch import has_storage
from .base import PassContext, PiecewisePass

__all__ = ["NoOpElimination", "eliminate_noops", "scatter_writes_back_own_view"]

aten = torch.ops.aten

_INT64_MAX = 2**63 - 1  # what Python's `x[a:]` puts in a traced slice's end

RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


class NoOpElimination(PiecewisePass):
    """Removes reshapes, views, slices and slice-scatters that do nothing (see module doc).
    Switch: ``CompilationConfig(noop_elimination=False)``."""

    name = "noop_elimination"

    def __call__(self, graph: torch.fx.Graph, context: PassContext) -> int:
        return eliminate_noops(graph)


def eliminate_noops(graph: torch.fx.Graph) -> int:
    """Apply the rewrites of the module doc to `graph` in place; returns how many were made."""
    guard = _AliasGuard(graph)
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if target in RESHAPES:
            count += _collapse_reshape_chain(graph, node)
            src = node.args[0]
            if isinstance(src, torch.fx.Node) and _same_layout(node_value(node), node_value(src)) and guard.may_forward(node, src):
                count += _forward(graph, node, src)
        elif target is aten.slice.Tensor:
            src = node.args[0]
            if isinstance(src, torch.fx.Node) and _same_layout(node_value(node), node_value(src)) and guard.may_forward(node, src):
                count += _forward(graph, node, src)
        elif target is aten.slice_scatter.default:
            base, src = node.args[0], node.args[1]
            if not (isinstance(base, torch.fx.Node) and isinstance(src, torch.fx.Node)):
                continue
            if _scatter_covers_base(node) and guard.may_forward(node, src, value_copy=True):
                count += _forward(graph, node, src)
            elif scatter_writes_back_own_view(node, node_value(base), node_value(src)) and guard.may_forward(node, base, value_copy=True):
                count += _forward(graph, node, base)
    return count


# -- shared predicates (also used by the reinplacing pass) -------------------------------------
def node_value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _known_eq(a: Any, b: Any) -> bool:
    return statically_known_true(sym_eq(a, b))


def _same_layout(a: Any, b: Any) -> bool:
    """Same dtype, shape, strides and storage offset, provably for every size."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.dim() != b.dim():
        return False
    return (
        all(_known_eq(x, y) for x, y in zip(a.shape, b.shape))
        and all(_known_eq(x, y) for x, y in zip(a.stride(), b.stride()))
        and _known_eq(a.storage_offset(), b.storage_offset())
    )


def statically_contiguous(t: Any) -> bool:
    """Row-major contiguous for every size (dims of size 1 ignored); never adds a guard."""
    if not isinstance(t, torch.Tensor):
        return False
    expected: Any = 1
    for size, stride in reversed(tuple(zip(t.shape, t.stride()))):
        if statically_known_true(sym_eq(size, 1)):
            continue
        if not _known_eq(stride, expected):
            return False
        expected = expected * size
    return True


def storage_of(t: Any) -> int | None:
    if isinstance(t, torch.Tensor) and has_storage(t):
        return t.untyped_storage()._cdata
    return None


def _slice_params(node: torch.fx.Node, base: Any) -> tuple[int, Any, Any, Any]:
    """(dim, start, end, step) of a slice/slice_scatter, normalised against `base`: dim >= 0,
    start >= 0 when it is an int, end clamped to the size when it provably reaches it."""
    first = 2 if node.target is aten.slice_scatter.default else 1
    names = ("dim", "start", "end", "step")
    defaults = (0, None, None, 1)
    values = []
    for i, (name, default) in enumerate(zip(names, defaults)):
        pos = first + i
        v = node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)
        values.append(node_value(v) if isinstance(v, torch.fx.Node) else v)
    dim, start, end, step = values
    dim = dim % base.dim()
    size = base.shape[dim]
    start = 0 if start is None else start
    if isinstance(start, int) and start < 0:
        start = start + size
    if end is None or (isinstance(end, int) and end >= _INT64_MAX) or statically_known_true(end >= size):
        end = size
    elif isinstance(end, int) and end < 0:
        end = end + size
    return dim, start, end, step


def _scatter_covers_base(node: torch.fx.Node) -> bool:
    """``slice_scatter(base, src, ...)`` whose slice is all of `base`: the result is `src`."""
    base, src = node_value(node.args[0]), node_value(node.args[1])
    if not (isinstance(base, torch.Tensor) and isinstance(src, torch.Tensor)) or base.dtype != src.dtype:
        return False
    dim, start, end, step = _slice_params(node, base)
    return (
        _known_eq(start, 0)
        and _known_eq(step, 1)
        and _known_eq(end, base.shape[dim])
        and src.dim() == base.dim()
        and all(_known_eq(x, y) for x, y in zip(src.shape, base.shape))
    )


def scatter_writes_back_own_view(node: torch.fx.Node, base: Any, src: Any) -> bool:
    """Whether ``slice_scatter``/``select_scatter(base, src, ...)`` writes `src` exactly where it
    already lives: `src` shares `base`'s storage with the strides and offset of the scattered
    region, so the result equals `base`. `base` and `src` are fake tensors (the caller may pass
    values other than the node's current arguments' to ask "would it be, after a rewrite")."""
    if not (isinstance(base, torch.Tensor) and isinstance(src, torch.Tensor)):
        return False
    if storage_of(base) is None or storage_of(base) != storage_of(src) or base.dtype != src.dtype:
        return False
    strides = list(base.stride())
    if node.target is aten.slice_scatter.default:
        dim, start, _end, step = _slice_params(node, base)
        offset = base.storage_offset() + start * strides[dim]
        strides[dim] = strides[dim] * step
    elif node.target is aten.select_scatter.default:
        dim, index = node.args[2], node.args[3]
        dim = dim % base.dim()
        if isinstance(index, int) and index < 0:
            index = index + base.shape[dim]
        offset = base.storage_offset() + index * strides[dim]
        del strides[dim]
    else:
        return False
    return (
        len(strides) == src.dim()
        and all(_known_eq(a, b) for a, b in zip(src.stride(), strides))
        and _known_eq(src.storage_offset(), offset)
    )


# -- rewrites ----------------------------------------------------------------------------------
def _forward(graph: torch.fx.Graph, node: torch.fx.Node, src: torch.fx.Node) -> int:
    node.replace_all_uses_with(src)
    graph.erase_node(node)
    return 1


def _collapse_reshape_chain(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    """``outer(inner(x, a), b)`` -> ``outer(x, b)`` when `inner` has no other user and `x` is
    contiguous (so any shape is a valid view of it)."""
    inner = node.args[0]
    if not (isinstance(inner, torch.fx.Node) and inner.op == "call_function" and inner.target in RESHAPES):
        return 0
    source = inner.args[0]
    if len(inner.users) != 1 or not isinstance(source, torch.fx.Node) or not statically_contiguous(node_value(source)):
        return 0
    node.update_arg(0, source)
    graph.erase_node(inner)
    return 1


class _AliasGuard:
    """The two conditions under which forwarding a node to another value is unsafe.

    1. Outputs: a returned value must not become an input or another output (Inductor and
       AOTAutograd treat input/output aliasing specially; see Inductor's ``remove_noop_ops``).
    2. Mutation (`value_copy` rewrites only, where the node is a fresh tensor): forwarding to a
       tensor whose storage the graph writes would let later readers see the write.
    """

    def __init__(self, graph: torch.fx.Graph) -> None:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.outputs = set(output.all_input_nodes)
        self.input_storages = {storage_of(node_value(n)) for n in graph.nodes if n.op in ("placeholder", "get_attr")}
        self.output_storages = {storage_of(node_value(n)) for n in self.outputs}
        self.written: set[int | None] = set()
        for n in graph.nodes:
            schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
            if schema is None:
                continue
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                    for v in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(v, torch.fx.Node):
                            self.written.add(storage_of(node_value(v)))
        self.input_storages.discard(None)
        self.output_storages.discard(None)
        self.written.discard(None)

    def may_forward(self, node: torch.fx.Node, src: torch.fx.Node, value_copy: bool = False) -> bool:
        storage = storage_of(node_value(src))
        if node in self.outputs and (src in self.outputs or storage in self.input_storages or storage in self.output_storages):
            return False
        return not (value_copy and storage in self.written)
