"""Deciding whether and how a compiled model captures graphs (`GraphPlan`, `token_mixing`), and
installing the graph wrappers into a stitched forward (`install_graphs`) (docs/design.md §6)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..compilers.partition import PartitionedCallable
from ..counters import counters
from ..forward_context import RuntimeMode
from .dispatch import GraphDispatcher, StaticInput, Stitched
from .platform import resolve_platform
from .wrapper import GraphPool, PieceGraphWrapper

__all__ = ["GraphPlan", "GraphInstall", "graph_plan", "install_graphs", "token_mixing"]

log = logging.getLogger("piecewise")
_logged_no_platform: set[str] = set()


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """What graph capture needs to know about one traced graph, decided at compile time and saved
    in warm-start bundles (plain data: ints and strings).

    Attributes:
        device: the graph's device type (``"cuda"``, ``"cpu"``).
        static_inputs: ``(input index, token dim)`` of every graph input with a token dim; they get
            static buffers padded to the capture size.
        output_dims: per flat output, its token dim (sliced back to the real rows), or None.
        refused: why this graph gets no graphs at all (None: it may capture).
        token_count_inputs: indices of the graph's SymInt inputs that are the token count (Dynamo
            may pass it more than once, one SymInt per input dim it was read from); every one gets
            the padded count. Empty: only the first SymInt input.
        argument_inputs: indices of tensor inputs without a token dim that are the forward's own
            arguments (not parameters or buffers). Graphs read them in place, so the dispatcher
            checks on every call that each is the tensor of the capture (same address).
        written_inputs: graph inputs a non-splitting op writes in place. The dispatcher keeps a
            copy of each of them without a token dim (forward's arguments, module buffers) across
            the extra runs of warm-up, capture and the padding check, and puts it back, so the
            caller and the module see one write a call; for token
            inputs it stands in for their version counters where they have none (inference tensors).
    """

    device: str
    static_inputs: tuple[tuple[int, int], ...] = ()
    output_dims: tuple[int | None, ...] = ()
    refused: str | None = None
    token_count_inputs: tuple[int, ...] = ()
    argument_inputs: tuple[int, ...] = ()
    written_inputs: tuple[int, ...] = ()


@dataclasses.dataclass
class GraphInstall:
    """What `install_graphs` built: the dispatcher the stitched forward calls, the graph pool its
    wrappers share, and the per-piece wrappers in piece order (empty in full mode)."""

    dispatcher: GraphDispatcher
    pool: GraphPool
    wrappers: list[PieceGraphWrapper]


def _token_dim(x: Any, symbol: Any) -> int | None | bool:
    """The dim of `x` equal to the token symbol; None without one; False when the symbol appears
    in a dim in another form (2*s, s+1): such an input cannot be padded row by row."""
    if not isinstance(x, torch.Tensor):
        return None
    found = None
    for d, s in enumerate(x.shape):
        if isinstance(s, torch.SymInt) and symbol in s.node.expr.free_symbols:
            if s.node.expr != symbol or found is not None:
                return False
            found = d
    return found


def _other_symbols(x: Any, symbol: Any) -> set[Any]:
    """Free symbols of `x`'s sizes (or of `x` itself, a SymInt input) other than `symbol`."""
    if isinstance(x, torch.SymInt):
        sizes: tuple[Any, ...] = (x,)
    elif isinstance(x, torch.Tensor):
        sizes = tuple(x.shape)
    else:
        return set()
    return {f for s in sizes if isinstance(s, torch.SymInt) for f in s.node.expr.free_symbols if f != symbol}


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"size {x}"


_REQUIRED = object()
#: ops that combine values along a dim they take as argument: op -> (position of the dim argument
#: counting the tensor itself, its default; `_REQUIRED`: a call without it mixes everything). Along
#: the token dim, pad rows would flow into real rows.
_MIXING_ALONG_DIM: dict[str, tuple[int, Any]] = {
    **{op: (1, _REQUIRED) for op in ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "cumsum",
                                     "cumprod", "cummax", "cummin", "logcumsumexp", "flip", "unfold")},
    **{op: (1, -1) for op in ("sort", "argsort", "median", "nanmedian", "mode", "glu")},
    "msort": (1, 0),
    "topk": (2, -1), "kthvalue": (2, -1), "diff": (2, -1), "renorm": (2, _REQUIRED), "normalize": (2, 1),
    "roll": (2, _REQUIRED),
}
#: calls that read only the dtype and device (or nothing) of a token-dim input
_METADATA_ONLY = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "size", "sym_size", "dim",
                            "numel", "stride", "storage_offset", "type_as", "__getattr__", "element_size"})


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", None) or str(t)
    return name.split(".")[0] if "." in name and not name.startswith("_") else name


def _token_bearing_dims(v: Any, symbol: Any) -> list[int]:
    return [d for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt) and symbol in s.node.expr.free_symbols]


def token_mixing(gm: torch.fx.GraphModule, symbol: Any, split_ops: frozenset[str]) -> list[str]:
    """Nodes of `gm` outside splitting ops that combine values across tokens, as readable lines.

    Graph capture pads a call of ``n`` tokens to a capture size and runs the padded rows through
    every piece; that is only correct when each token's result depends on its own row. A node
    mixes rows when a tensor input carries the token count in a dim and (a) its output carries it
    in none (a reduction, a contraction such as ``x.T @ x``, an index picking rows), or (b) it is
    an op that combines values along a dim argument (softmax, cumsum, sort, flip, ...) and that
    dim carries the token count. Splitting ops are left out: they see the real count in the
    forward context and must skip pad rows themselves. Conservative by design: a node reported
    here turns graphs off for the model, it never changes results."""
    from ..split import is_splitting_node

    found: list[str] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or is_splitting_node(node, split_ops):
            continue
        name = _op_name(node)
        if name in _METADATA_ONLY or name.lstrip("_").startswith(("new_", "sym_")):
            continue
        ins = [a.meta.get("example_value", a.meta.get("val")) for a in node.all_input_nodes]
        token_in = [v for v in ins if isinstance(v, torch.Tensor) and _token_bearing_dims(v, symbol)]
        if not token_in:
            continue
        out = node.meta.get("example_value", node.meta.get("val"))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        where = node.meta.get("stack_trace", "").strip().splitlines()
        site = f" ({where[-2].strip()})" if len(where) >= 2 else ""
        if outs and not any(_token_bearing_dims(o, symbol) for o in outs):
            found.append(f"{node.name} ({name}) has a token-dim input and an output without one{site}")
            continue
        if name in _MIXING_ALONG_DIM:
            pos, default = _MIXING_ALONG_DIM[name]
            key = "dims" if name in ("flip", "roll") else "dimension" if name == "unfold" else "dim"
            dim = node.kwargs.get(key, node.args[pos] if len(node.args) > pos else default)
            x = token_in[0]
            dims = dim if isinstance(dim, (tuple, list)) else (dim,)
            bearing = set(_token_bearing_dims(x, symbol))
            if dim is _REQUIRED or dim is None or any(not isinstance(d, int) or d % max(x.dim(), 1) in bearing for d in dims):
                found.append(f"{node.name} ({name}) combines values along the token dim{site}")
    return found


def graph_plan(fake_inputs: Sequence[Any], fake_outputs: Any, symbol: Any, mixing: Sequence[str] = (),
               argument_inputs: Sequence[int] = (), written_inputs: Sequence[int] = ()) -> GraphPlan:
    """The `GraphPlan` of a graph from its fake inputs and outputs. `refused` is set when inputs
    cannot be padded or the graph combines values across tokens (`mixing`, from `token_mixing`):
    padding would let pad rows into real results. `argument_inputs`: the graph inputs that are
    the forward's arguments (the backend reads them from Dynamo's sources); `written_inputs`: the
    graph inputs a non-splitting op writes in place."""
    device = next((x.device.type for x in fake_inputs if isinstance(x, torch.Tensor)), "cpu")
    if mixing:
        more = f" and {len(mixing) - 2} more" if len(mixing) > 2 else ""
        return GraphPlan(device, refused=f"the model combines values across tokens outside splitting ops, so pad rows "
                f"of a padded call would change real results: {'; '.join(mixing[:2])}{more}. Graphs need every token's "
                "result to depend on its own row only; move such steps into a splitting op that honours "
                "forward_context().num_tokens, or after the compiled model, or set cudagraph_mode='none'")
    for i, x in enumerate(fake_inputs):
        other = _other_symbols(x, symbol)
        if other:
            return GraphPlan(device, refused=f"graph input {i} ({_describe(x)}) has a dynamic size other than the token "
                    f"count ({', '.join(sorted(map(str, other)))}); a captured graph replays the shapes of its capture, "
                    "one graph per token count, so another size would replay the wrong shape. Leave that dim static "
                    "(out of dynamic_arg_dims), or set cudagraph_mode='none'")
    counts = []
    for i, x in enumerate(fake_inputs):
        if isinstance(x, torch.SymInt) and symbol in x.node.expr.free_symbols:
            if x.node.expr != symbol:
                return GraphPlan(device, refused=f"graph input {i} is the token count inside an expression ({x}); "
                                 "padding could not give it its padded value")
            counts.append(i)
    statics: list[tuple[int, int]] = []
    for i, x in enumerate(fake_inputs):
        d = _token_dim(x, symbol)
        if d is False:
            return GraphPlan(device, refused=f"graph input {i} has the token count inside a dim expression")
        if d is not None:
            statics.append((i, d))
    outs = fake_outputs if isinstance(fake_outputs, (tuple, list)) else (fake_outputs,)
    output_dims = []
    for i, o in enumerate(outs):
        d = _token_dim(o, symbol)
        if d is False:  # flattened with other dims, or shortened (s - 1): cannot be sliced back to real rows
            return GraphPlan(device, refused=f"output {i} has the token count inside a dim expression "
                    f"({tuple(o.shape)}), so a padded call's pad rows could not be sliced off; return the token dim as "
                    "a dim of its own, or set cudagraph_mode='none'")
        output_dims.append(d)
    static_index = {i for i, _ in statics}
    arguments = tuple(i for i in argument_inputs if i < len(fake_inputs) and isinstance(fake_inputs[i], torch.Tensor)
                      and i not in static_index)
    return GraphPlan(device, tuple(statics), tuple(output_dims), token_count_inputs=tuple(counts),
                     argument_inputs=arguments, written_inputs=tuple(written_inputs))


def install_graphs(config: Any, tag: str, stitched: Stitched, runners: Sequence[Any], plan: GraphPlan) -> GraphInstall | None:
    """Graph capture for `stitched` (a `StitchedForward`), with a `PieceGraphWrapper` installed in
    its split module in place of each compiled piece's runner (`runners`, in piece order) for
    piecewise modes; or None when graphs do not apply (``cudagraph_mode="none"``, no graph
    platform for the device, `plan.refused`). Nothing outside `stitched` is written."""
    # "auto" is "piecewise" for a model compiled directly: its splitting ops may be the user's,
    # which need not be safe inside a full graph (the generation route resolves it per step)
    mode = "piecewise" if config.cudagraph_mode == "auto" else config.cudagraph_mode
    if mode == "none":
        return None
    device = plan.device
    platform = resolve_platform(device)
    if platform is None:
        if device not in _logged_no_platform:
            _logged_no_platform.add(device)
            log.info("no graph platform for device %r: cudagraph_mode=%r resolves to 'none'", device, mode)
        return None
    if plan.refused is not None:
        log.warning("[%s] %s; capturing no graphs", tag, plan.refused)
        return None
    from .capture_sizes import default_capture_sizes, validate_capture_sizes

    sizes = config.cudagraph_capture_sizes or default_capture_sizes(config.max_num_tokens)
    sizes, _dropped = validate_capture_sizes(sizes, config.max_num_tokens)
    pool = GraphPool(platform, num_warmups=config.cudagraph_num_warmups, debug=config.debug, tag=tag)
    wrappers: list[PieceGraphWrapper] = []
    capturable = 0  # partitions beyond one per runner
    if mode in ("piecewise", "full_and_piecewise"):
        for i, r in enumerate(runners):
            partitioned = [fn for fn in dict.fromkeys(r.callables) if isinstance(fn, PartitionedCallable)]
            if not partitioned:
                w = PieceGraphWrapper(r, pool, mode=RuntimeMode.PIECEWISE, first=(i == 0), name=r.name)
                stitched.split_gm.__dict__[r.name] = w
                wrappers.append(w)
                continue
            # Inductor partitions (split_strategy="inductor_partition"): one wrapper per partition of
            # every compile entry's callable; a size only ever reaches the entry it dispatches to, so
            # each entry's partition 0 is the first piece of the forwards it serves
            for e, fn in enumerate(partitioned):
                for slot in fn.partitions:
                    w = PieceGraphWrapper(slot.unpacked, pool, mode=RuntimeMode.PIECEWISE, first=(i == 0 and slot.index == 0),
                                          name=f"{r.name}.partition_{slot.index}" + (f"[entry {e}]" if len(partitioned) > 1 else ""))
                    slot.install(w)
                    wrappers.append(w)
            capturable += max(len(fn.partitions) for fn in partitioned) - 1  # pieces one forward runs through
        counters.bump("capturable_pieces", len(runners) + capturable, tag=tag)
    dispatcher = GraphDispatcher(stitched, pool, sizes, static_inputs=[StaticInput(i, d) for i, d in plan.static_inputs],
                                 output_dims=list(plan.output_dims), cudagraph_mode=mode, max_num_tokens=config.max_num_tokens,
                                 tag=tag, token_count_inputs=plan.token_count_inputs,
                                 argument_inputs=plan.argument_inputs, written_inputs=plan.written_inputs)
    dispatcher.wrappers = wrappers
    return GraphInstall(dispatcher, pool, wrappers)
