"""Re-inplacing of functionalized custom ops that mutate their inputs (built-in pass).

AOTAutograd functionalizes a call to a mutating custom op (``mutates_args=(...)``) into
``auto_functionalized(op, **kwargs)``: a functional node that returns fresh copies of the mutated
arguments, followed by ``slice_scatter``/``select_scatter`` nodes that write those copies back into
their bases and, for a mutated graph input, a ``copy_`` epilogue. Inductor then either runs the op
on the real buffers (when nothing reads the old values) or clones the buffers first.

Inductor's own reinplacing (``torch/_inductor/fx_passes/reinplace.py``, run after the custom post
passes) handles ``auto_functionalized_v2`` nodes, the default form, and those nodes are left to it.
The v1 form is what AOTAutograd emits with ``inductor_options={"enable_auto_functionalized_v2":
False}`` (a setting some serving stacks choose, since v2 regenerates the views of a mutated base
after the op). For v1 nodes, Inductor (torch 2.13) clones the buffer whenever a mutated argument is
a view - a slice of a fused QKV buffer, one layer of a KV cache, a column range of a scratch buffer
- even when nothing reads the old contents; ``tests/passes/test_reinplace.py`` shows the clone in
the generated code without this pass and its absence with it. This pass rewrites such nodes in
place:

* ``auto_functionalized(op, **kw)`` becomes the direct call ``op(**kw)``, mutating the arguments;
* a read of the i-th mutated value becomes a read of the argument itself;
* a scatter that writes that value back where it came from becomes its base (it is now a no-op);
* a ``copy_(input, input)`` left over in the epilogue is dropped.

A node is rewritten only when it is provably safe: no node after it reads the old contents of any
tensor that shares storage with a mutated argument (views, metadata-only reads, the write-back
scatters and the epilogue excepted); a mutated graph input is written in place only when the graph
copies the new value back into that input anyway; no two mutated arguments overlap; and no other
argument of the op shares storage with a mutated one. Otherwise the node is left for Inductor.
"""

from __future__ import annotations

import logging

import heapq
import itertools
import operator
from typing import Any

import torch
import torch.fx

from .._torch.ops import OpOverload, auto_functionalized, mutable_args
from . import noop as _noop
from .base import PassContext, PiecewisePass
from .noop import storage_of, node_value, scatter_writes_back_own_view

log = logging.getLogger("piecewise")

__all__ = ["ReinplaceCustomOps", "reinplace_custom_ops"]

aten = torch.ops.aten

_SCATTERS = frozenset({aten.slice_scatter.default, aten.select_scatter.default})
_META_ONLY = frozenset(
    {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}
)


class ReinplaceCustomOps(PiecewisePass):
    """Turns functionalized (``auto_functionalized``) mutating custom ops back into in-place
    calls when no copy is needed (see module doc). Switch:
    ``CompilationConfig(reinplace_custom_ops=False)``."""

    name = "reinplace_custom_ops"
    source_files = (_noop.__file__,)  # the scatter and storage helpers live there

    def __call__(self, graph: torch.fx.Graph, context: PassContext) -> int:
        return reinplace_custom_ops(graph)


def reinplace_custom_ops(graph: torch.fx.Graph) -> int:
    """Rewrite every safe ``auto_functionalized`` node of `graph` in place; returns how many.

    Each decision is taken on the graph as already rewritten. Nodes are tried last to first, and
    again until nothing changes: when two ops mutate slices of one buffer, the write-back of the
    first feeds the second, and only once the second writes in place does the graph's epilogue
    copy back a value the first can be proven to produce in place."""
    hop = auto_functionalized()
    count = 0
    pending = list(graph.find_nodes(op="call_function", target=hop))
    while pending:
        left = []
        for node in reversed(pending):
            plan = _plan(graph, node)
            if plan is None:
                left.append(node)
            else:
                _rewrite(graph, node, plan)
                count += 1
        if len(left) == len(pending):
            break
        pending = left[::-1]
    return count


class _Plan:
    """What rewriting one node in place changes: replacements in graph order, nodes to drop."""

    def __init__(self, op: Any, num_returns: int, first_mutated: int, mutated: dict[int, torch.fx.Node]) -> None:
        self.op = op
        self.num_returns = num_returns
        self.first_mutated = first_mutated
        self.mutated = mutated  # output index of af -> the argument it is the new value of
        self.replace: dict[torch.fx.Node, torch.fx.Node] = {}  # scatter -> its (resolved) base
        self.drop: list[torch.fx.Node] = []  # copy_(input, input) epilogues

    def resolve(self, n: Any) -> Any:
        while n in self.replace:
            n = self.replace[n]
        return n


def _plan(graph: torch.fx.Graph, af: torch.fx.Node) -> _Plan | None:
    op = af.args[0]
    if not isinstance(op, OpOverload):
        return None
    names, _ = mutable_args(op)
    outs = af.meta.get("val")
    if not names or not isinstance(outs, (tuple, list)):
        return None
    first_mutated = len(outs) - len(names)
    mutated: dict[int, torch.fx.Node] = {}
    for j, name in enumerate(names):
        arg = af.kwargs.get(name)
        if arg is None:
            continue
        if not isinstance(arg, torch.fx.Node) or storage_of(node_value(arg)) is None:
            return None  # a mutated list of tensors, or no fake value: leave it to Inductor
        mutated[first_mutated + j] = arg
    if not mutated or not _disjoint(af, mutated.values()):
        return None

    plan = _Plan(op, len(op._schema.returns), first_mutated, mutated)
    order = {n: i for i, n in enumerate(graph.nodes)}
    getitems: dict[torch.fx.Node, torch.fx.Node] = {}  # getitem of a mutated value -> the argument
    for user in af.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        if user.args[1] in mutated:
            getitems[user] = mutated[user.args[1]]
        elif plan.num_returns == 0 or user.args[1] >= first_mutated:
            return None  # the value of a None argument, or of an op that returns nothing

    def new_value(n: Any) -> Any:
        """The argument node `n` stands for after the rewrite (resolving planned rewrites)."""
        n = plan.resolve(n)
        return getitems.get(n, n)

    storages = {storage_of(node_value(a)) for a in mutated.values()}
    aliases = {n for n in graph.nodes if storage_of(node_value(n)) in storages}
    inputs = [n for n in aliases if n.op in ("placeholder", "get_attr")]
    if len(inputs) > 1:
        return None  # aliased graph inputs: too easy to get wrong
    # A planned write-back scatter stands for its base with some mutated arguments written back;
    # it equals the mutated base only once every mutated argument in that storage is covered.
    covered: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}

    def complete(scatter: torch.fx.Node) -> bool:
        storage = storage_of(node_value(plan.resolve(scatter)))
        return all(a in covered[scatter] for a in mutated.values() if storage_of(node_value(a)) == storage)

    after = order[af]
    # (position, tie-break, user, the planned scatter it was reached from or None for an old value)
    seq = itertools.count()
    heap = [(order[u], next(seq), u, None) for n in aliases for u in n.users if order[u] > after]
    heapq.heapify(heap)
    checked: set[tuple[torch.fx.Node, Any]] = set()
    while heap:
        _, _, user, via = heapq.heappop(heap)
        if (user, via) in checked:
            continue
        checked.add((user, via))
        if user.target in _SCATTERS and user.args[1] in getitems:
            base, src = plan.resolve(user.args[0]), getitems[user.args[1]]
            if base in aliases and scatter_writes_back_own_view(user, node_value(base), node_value(src)):
                prior = covered.get(user.args[0], frozenset()) if via is not None else frozenset()
                covered[user] = prior | {src}
                plan.replace[user] = base
                heap.extend((order[u], next(seq), u, user) for u in user.users)
                heapq.heapify(heap)
                continue
        if via is not None and not complete(via):
            return None  # reads a base with only some of the mutations written back
        if user.target in _META_ONLY or _is_view(user):
            continue
        if user.target is aten.copy_.default and user.args[0] in inputs:
            if new_value(user.args[1]) is user.args[0]:
                if user not in plan.drop:
                    plan.drop.append(user)
                continue
            return None
        if via is not None and user.op != "output" and not any(a in aliases for a in user.all_input_nodes):
            continue  # reads the new contents
        if via is not None and user.op == "output":
            continue
        return None  # reads the old contents after the op
    for inp in inputs:  # mutate a graph input only where the program writes the new value back
        if not any(c.args[0] is inp for c in plan.drop):
            return None
    return plan


def _disjoint(af: torch.fx.Node, mutated: Any) -> bool:
    """No two mutated arguments overlap, and no other argument of the op shares their storage."""
    from .._torch.dynamo import compute_overlapping_tensors

    mutated = list(mutated)
    vals = [node_value(a) for a in mutated]
    try:
        if len(vals) > 1 and compute_overlapping_tensors(vals):
            return False
    except Exception as e:  # data-dependent sizes: assume they overlap
        log.debug("re-inplacing %s: overlap not decidable (%s: %s); left functional", af, type(e).__name__, e)
        return False
    storages = {storage_of(v) for v in vals}
    others = [n for n in af.all_input_nodes if n not in mutated]
    return not any(storage_of(node_value(n)) in storages for n in others)


def _is_view(node: torch.fx.Node) -> bool:
    """A view op, or a getitem of a multi-output view (``split``, ``unbind``): no data read."""
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, torch.fx.Node) and _is_view(parent)
    if isinstance(target, OpOverload):
        args = target._schema.arguments
        return bool(args) and args[0].alias_info is not None and not args[0].alias_info.is_write
    return False


def _rewrite(graph: torch.fx.Graph, af: torch.fx.Node, plan: _Plan) -> None:
    outs = af.meta["val"]
    with graph.inserting_before(af):
        call = graph.call_function(plan.op, (), dict(af.kwargs))
    call.meta.update({k: v for k, v in af.meta.items() if k not in ("val", "eager_input_vals")})
    if "eager_input_vals" in af.meta:
        # the op's eager argument layouts, which Inductor's layout constraint for custom ops reads;
        # the HOP's record has (op,) as its positional arguments, the op has none
        call.meta["eager_input_vals"] = ((), dict(af.meta["eager_input_vals"][1]))
    returned = tuple(outs[: plan.first_mutated])
    call.meta["val"] = None if plan.num_returns == 0 else returned[0] if plan.num_returns == 1 else returned
    for user in list(af.users):
        index = user.args[1]
        if index in plan.mutated:
            user.replace_all_uses_with(plan.mutated[index])
            graph.erase_node(user)
        elif plan.num_returns == 1:
            user.replace_all_uses_with(call)
            graph.erase_node(user)
        else:
            user.update_arg(0, call)
    for scatter in plan.replace:  # graph order: an earlier scatter is the base of a later one
        scatter.replace_all_uses_with(plan.resolve(scatter))
        graph.erase_node(scatter)
    for copy in plan.drop:
        copy.replace_all_uses_with(copy.args[0])
        graph.erase_node(copy)
    graph.erase_node(af)
