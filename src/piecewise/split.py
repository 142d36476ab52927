"""Cutting a Dynamo FX graph into pieces at splitting ops (docs/design.md §4.3).

Nodes are walked in graph order. Each splitting-op node opens a subgraph of its own (consecutive
splitting ops share one); the nodes between splitting ops share one subgraph. A ``getitem`` on a
tuple stays with its producer, so no piece receives a whole tuple. Node order is kept as traced:
splitting ops may mutate their inputs, so reordering is unsafe. ``x.size()`` is first rewritten to
per-dim ``x.size(i)`` calls, so a ``torch.Size`` never crosses a piece boundary.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from ._torch.ops import OpOverload, OpOverloadPacket
from .errors import SplitError
from .ops import normalize_op_name

__all__ = ["SplitItem", "SplitResult", "split_graph", "is_splitting_node", "decompose_size_calls", "fx_forward",
           "shadowed_torch_functions"]


def fx_forward(gm: torch.fx.GraphModule):
    """The generated ``forward`` of `gm`, bound, bypassing ``nn.Module.__call__`` (hooks, ~µs a call).

    Lazy graph modules generate code on first call through ``Module.__call__``, and graph modules
    unpickled from a bundle have none yet; generate it now so the bound method is the real one."""
    from ._torch.fx import force_recompile

    force_recompile(gm)
    if "forward" not in type(gm).__dict__:  # unpickled without code (warm-start bundles generate it on use)
        gm.recompile()
    return gm.forward


@dataclasses.dataclass(frozen=True)
class SplitItem:
    """One piece of a split graph.

    Attributes:
        name: the submodule's attribute name in the split module (``submod_<id>``).
        index: the integer subgraph id; items are ordered by it, never by name.
        is_splitting: True for a piece holding splitting ops (runs eagerly).
        graph: the piece's `torch.fx.GraphModule`.
    """

    name: str
    index: int
    is_splitting: bool
    graph: torch.fx.GraphModule


@dataclasses.dataclass
class SplitResult:
    split_module: torch.fx.GraphModule
    items: list[SplitItem]

    @property
    def num_splitting(self) -> int:
        return sum(i.is_splitting for i in self.items)

    @classmethod
    def from_module(cls, split_gm: torch.fx.GraphModule, splitting: Iterable[int]) -> SplitResult:
        """The result for a split module whose ``submod_<id>`` children are the pieces; `splitting`
        holds the ids of the splitting pieces."""
        splitting = set(splitting)
        items = []
        # not named_children(): it yields a module shared under several names once (a warm-start
        # bundle shares the graph of equal pieces)
        for name, sub in split_gm._modules.items():
            if name.startswith("submod_") and sub is not None:
                index = int(name[len("submod_"):])
                items.append(SplitItem(name, index, index in splitting, sub))
        items.sort(key=lambda it: it.index)
        return cls(split_gm, items)


def shadowed_torch_functions(gm: torch.fx.GraphModule) -> list[str]:
    """Torch functions the graph calls that their dotted name no longer reaches, as
    ``"<dotted name> (now <module>.<name>)"``; empty for a graph that can run as traced.

    FX's generated code names torch functions by their dotted path (``torch.nn.functional.silu``)
    and looks them up when it runs, and torch's own Python functions dispatch to themselves by
    name under a tracing mode (AOTAutograd's): after ``torch.nn.functional.silu = f`` (a user's
    patch, which Dynamo traced through, recording the original inside ``f``) the pieces ran ``f``
    again where the trace had the original, and generated tokens differed from eager's, with the
    eager and the Inductor adaptor alike."""
    from ._torch.fx import qualified_name

    out = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or isinstance(target, (OpOverload, OpOverloadPacket)):
            continue
        module = getattr(target, "__module__", None) or ""
        if module != "torch" and not module.startswith("torch."):  # not torchaudio, torch_foo
            continue
        try:
            name = qualified_name(target)
            live: object = torch
            for part in name.split(".")[1:]:
                live = getattr(live, part)
        except (AttributeError, RuntimeError, ValueError):  # not reachable by name: FX binds it as a global
            continue
        if live is not target:
            now = f"{getattr(live, '__module__', '?')}.{getattr(live, '__qualname__', type(live).__name__)}"
            out.append(f"{name} (now {now})")
    return sorted(set(out))


def _target_name(target: object) -> str | None:
    if isinstance(target, (OpOverload, OpOverloadPacket)):
        return normalize_op_name(target)
    return None


def is_splitting_node(node: torch.fx.Node, split_ops: frozenset[str]) -> bool:
    """Whether `node` calls one of the normalised `split_ops`."""
    return node.op == "call_function" and _target_name(node.target) in split_ops


#: Python's in-place operators (``x += y`` on a tensor writes x)
_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                operator.imod, operator.ipow, operator.ilshift, operator.irshift, operator.iand,
                                operator.ior, operator.ixor, operator.imatmul, operator.setitem})
#: their method spellings (``x.__iadd__(y)``)
_INPLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _INPLACE_OPERATORS)


def _writes_in_place(name: object) -> bool:
    """A method or function name that writes its first argument: ``add_``, ``_foreach_add_``,
    ``__iadd__``, ``__setitem__`` (not other dunders such as ``__add__``)."""
    if not isinstance(name, str):
        return False
    if name.startswith("__") and name.endswith("__"):
        return name in _INPLACE_DUNDERS
    return name.endswith("_")


def _written_operands(node: torch.fx.Node, split_ops: frozenset[str]) -> list[object]:
    """The operands a node of a Dynamo graph writes in place (splitting ops excluded): the first
    argument of an in-place method or function (`_writes_in_place`), of an in-place operator or
    ``x[i] = v``, or of a call with ``inplace=True``; an ``out=`` argument; and the written
    arguments of an op overload whose schema says so. An operand may be a list of tensors
    (``torch._foreach_add_``)."""
    if node.op == "call_method":
        return [node.args[0]] if node.args and _writes_in_place(node.target) else []
    if node.op != "call_function" or is_splitting_node(node, split_ops):
        return []
    target, out = node.target, []
    if "out" in node.kwargs:
        out += list(node.kwargs["out"]) if isinstance(node.kwargs["out"], (tuple, list)) else [node.kwargs["out"]]
    if node.args and (target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
                      or _writes_in_place(getattr(target, "__name__", None))):
        out.append(node.args[0])
    if isinstance(target, (OpOverload, OpOverloadPacket)):
        schemas = [target._schema] if isinstance(target, OpOverload) else [
            getattr(target, o)._schema for o in target.overloads()]
        for schema in schemas:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out


def written_inputs(gm: torch.fx.GraphModule, candidates: Iterable[int], split_ops: frozenset[str]) -> tuple[int, ...]:
    """Of the graph inputs `candidates` (placeholder indices), those whose memory a node other than
    a splitting op writes in place, directly or through a view: read from the Dynamo graph's fake
    example values, whose views share their base's (fake) storage. Splitting ops are left out: they
    write caches by design and skip writes for zero real tokens."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node: object) -> object:
        value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None

    def operands(x: object) -> list[object]:
        return [y for item in x for y in operands(item)] if isinstance(x, (list, tuple)) else [x]

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    wanted = {i: storage(placeholders[i]) for i in candidates if i < len(placeholders)}
    written: set[object] = set()
    for node in gm.graph.nodes:
        for operand in operands(_written_operands(node, split_ops)):
            ref = storage(operand)
            if ref is not None:
                written.add(ref)
    return tuple(sorted(i for i, ref in wanted.items() if ref is not None and ref in written))


def _is_whole_size_call(node: torch.fx.Node) -> bool:
    if node.kwargs:
        return False
    if node.op == "call_method" and node.target == "size":
        return len(node.args) == 1
    return node.op == "call_function" and node.target in (torch.Tensor.size,) and len(node.args) == 1


def decompose_size_calls(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``x.size()`` into per-dim ``x.size(i)`` nodes; returns how many were rewritten.

    ``getitem(size, i)`` users read the dim node directly; other users get a tuple of dim nodes.
    """
    graph = gm.graph
    rewritten = 0
    made: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if not _is_whole_size_call(node):
            continue
        val = node.meta.get("example_value")
        if val is None:
            continue  # rank unknown: leave it, split_module passes it through unchanged
        (src,) = node.args
        dims = []
        with graph.inserting_after(node):
            for i in reversed(range(len(val))):
                d = graph.call_method("size", (src, i))
                d.meta["example_value"] = val[i]
                dims.append(d)
        dims.reverse()
        made += dims
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                user.replace_all_uses_with(dims[user.args[1]])
                graph.erase_node(user)
            else:
                user.args = torch.fx.node.map_arg(user.args, lambda n: tuple(dims) if n is node else n)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda n: tuple(dims) if n is node else n)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        # Only the dims this pass made and nothing reads go; not a general dead-code pass: FX counts
        # an in-place tensor method whose result is unused (``cache.index_put_(...)``, ``buf.add_(1)``)
        # as dead, and removing it would silently drop the write.
        for d in made:
            if not d.users:
                graph.erase_node(d)
        gm.recompile()
    return rewritten


def assign_subgraphs(graph: torch.fx.Graph, split_ops: frozenset[str]) -> tuple[dict[torch.fx.Node, int], set[int]]:
    """Map every compute node to a subgraph id; returns the map and the splitting ids."""
    node_to_id: dict[torch.fx.Node, int] = {}
    splitting_ids: set[int] = set()
    current = 0
    prev_was_split = False
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0] in node_to_id
        ):
            node_to_id[node] = node_to_id[node.args[0]]
            continue
        if is_splitting_node(node, split_ops):
            if not prev_was_split:
                current += 1
            node_to_id[node] = current
            splitting_ids.add(current)
            prev_was_split = True
            continue
        if prev_was_split:
            current += 1
            prev_was_split = False
        node_to_id[node] = current
    return node_to_id, splitting_ids


def split_graph(gm: torch.fx.GraphModule, split_ops: Iterable[str]) -> SplitResult:
    """Split `gm` at nodes calling any of the normalised `split_ops`.

    Returns the split module (its submodules are ``submod_<id>``) and the items sorted by id.
    With no split points the result has a single non-splitting item.

    Raises:
        SplitError: `split_module` failed on this graph.
    """
    ops = frozenset(split_ops)
    decompose_size_calls(gm)
    node_to_id, splitting_ids = assign_subgraphs(gm.graph, ops)
    try:
        split_gm = split_module(
            gm, None, lambda n: node_to_id[n], keep_original_order=True, keep_original_node_name=True
        )
    except Exception as e:  # split_module raises bare Exceptions of several types
        raise SplitError(f"could not split the graph at {sorted(ops)}: {e}") from e
    return SplitResult.from_module(split_gm, splitting_ids)
