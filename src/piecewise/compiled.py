"""The compiled result of one graph, one type for both ways of making it (docs/design.md §4.2, §5.5).

A cold start splits and compiles; a warm start loads the same pieces from the cache by a saved
`CompiledPlan`. Both end in `build_forward`, which installs the piece runners and eager splitting
pieces in the split module and wraps it as a `StitchedForward` (with graph capture installed when
the plan allows it), and both return a `CompiledForward`.

A `CompiledPlan` is plain, frozen data saved in warm-start bundles: for each distinct piece
(by fingerprint) one step per compile entry, `Load` (an artifact by name), `Reuse` (the callable
of an earlier entry of the same piece) or `Rebuild` (an adaptor that rebuilds from the piece graph).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch.fx

from .errors import CompileError, InputError, SizeRefusedError
from .forward_context import ForwardContext, RuntimeMode, enter_forward, exit_forward
from .graphs.install import GraphInstall, GraphPlan, install_graphs
from .ops import direct_call
from .piece import DispatchState, EntryTable, LayoutBook, PieceRunner, SplittingRunner
from .split import SplitResult, fx_forward

__all__ = ["Load", "Reuse", "Rebuild", "Step", "RunnerSpec", "SIZE_REMEDY", "SizeRefusal", "CompiledPlan", "CompiledForward", "StitchedForward",
           "build_forward"]


@dataclasses.dataclass(frozen=True)
class Load:
    """Load the compiled piece saved as artifact `name` in the compile entry."""

    name: str


@dataclasses.dataclass(frozen=True)
class Reuse:
    """Use the callable of entry `entry` of the same piece (an adaptor that does not specialise
    sizes, or a size that fell back to its range)."""

    entry: int


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """Ask the adaptor to rebuild the callable from the piece graph (adaptors that save nothing)."""


Step = Union[Load, Reuse, Rebuild]


@dataclasses.dataclass(frozen=True)
class RunnerSpec:
    """One compiled piece in call order: its attribute name in the split module, its index among
    all pieces, and the fingerprint that selects its callables."""

    name: str
    index: int
    fingerprint: str


#: what a user can do about a size refusal (`SizeRefusal`)
SIZE_REMEDY = ("Make forward independent of the size there, or let more traces serve the model's sizes "
               "(CompilationConfig(max_size_classes=...))")
#: distinct size tuples whose guard results `StitchedForward` memoises (about 100 bytes each)
SIZES_MEMOISED = 4096


@dataclasses.dataclass(frozen=True)
class SizeRefusal:
    """Dynamic sizes the traced code is wrong for, and why (`backend.size_refusal`).

    Dispatch skips Dynamo's guards, so a shape guard that the trace or a piece's compile placed on
    the dynamic sizes (a Python branch on a size, a view that holds only for one batch size, an
    input dim taken to equal another) is kept here and evaluated on the call's sizes instead; a
    call that fails one raises `SizeRefusedError` (an `InputError`) instead of running code
    specialised for other sizes.

    Attributes:
        dims: per size the guards read, ``(position among the graph's inputs, dim of that tensor
            or None for a SymInt input, name)``; the name is the dim as the user wrote it
            (``position_ids.shape[0]``).
        symbols: the sympy symbol of each of `dims`, same order.
        guards: sympy expressions over `symbols` that must all hold.
        notes: per guard, what the trace took and where (the message of a refused call).
        warning: the notes of the guards that specialise the trace (logged at compile; ties
            between input dims are not warned about: they hold for consistent inputs).
    """

    dims: tuple[tuple[int, int | None, str], ...]
    symbols: tuple[Any, ...]
    guards: tuple[Any, ...]
    notes: tuple[str, ...]
    warning: str

    def sizes(self, args: Sequence[Any]) -> tuple[int, ...]:
        """This call's value of each of `dims`."""
        return tuple([int(args[i]) if d is None else args[i].shape[d] for i, d, _ in self.dims])

    def failing(self, sizes: tuple[int, ...]) -> list[str]:
        """The notes of the guards that fail at `sizes` (one per dim); a guard that cannot be
        evaluated there (a division by zero) fails. Tens of microseconds a guard; callers memoise."""
        import sympy

        env = {s: sympy.Integer(v) for s, v in zip(self.symbols, sizes)}
        out = []
        for guard, note in zip(self.guards, self.notes):
            try:
                ok = bool(guard.xreplace(env))
            except (ArithmeticError, TypeError, ValueError):  # undefined there (a division by zero)
                ok = False
            if not ok:
                out.append(note)
        return out

    def error(self, tag: str, sizes: tuple[int, ...], failing: Sequence[str]) -> SizeRefusedError:
        what = ", ".join(f"{name} = {v}" for (_, _, name), v in zip(self.dims, sizes))
        return SizeRefusedError(f"[{tag}] {what} refused: {'; '.join(failing)}. {SIZE_REMEDY}")


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """How to rebuild a `CompiledForward` from the cache without tracing (see module doc).

    Attributes:
        runners: the compiled pieces in call order.
        steps: per fingerprint, one `Step` per compile entry (`EntryTable` order).
        sym_index: position of the token-count SymInt among the graph inputs (None: static shapes).
        graph_plan: graph capture's plan (None: static shapes).
        cache_key: the compile entry holding the artifacts (None: no cache).
        cache_meta: that entry's index meta, checked when it is opened.
        traced_files: source files Dynamo inlined.
        splitting: indices of the splitting pieces.
        device: device type of the graph's inputs.
        size_refusal: dynamic sizes the traced code is wrong for (None: it holds for all).
    """

    runners: tuple[RunnerSpec, ...]
    steps: Mapping[str, tuple[Step, ...]]
    sym_index: int | None
    graph_plan: GraphPlan | None
    cache_key: str | None
    cache_meta: Mapping[str, Any] | None
    traced_files: tuple[str, ...]
    splitting: tuple[int, ...]
    device: str
    size_refusal: SizeRefusal | None = None


def _layout_assertion(e: AssertionError, tag: str) -> Exception:
    """Inductor's generated code asserts the sizes and strides of the tensors it is handed
    (``assert_size_stride``): inside one compiled piece (``mode="full"``, ``split_strategy=
    "inductor_partition"``) a splitting op whose fake promised other strides than the op returns
    fails there, out of reach of the splitting runners' check (`piece.SplittingRunner`). That
    assertion becomes a `CompileError` naming the cause and the fix; any other `AssertionError` is
    returned as it is."""
    text = str(e)
    if "expected size" not in text or "stride" not in text:
        return e
    return CompileError(
        f"[{tag}] a tensor inside the compiled code has other strides than its trace promised ({text.splitlines()[0]}). "
        "The usual cause: a splitting op whose fake (register_fake) returns other strides than the op, e.g. "
        "torch.empty_like(q) of a transposed q where the op returns a contiguous tensor; make the fake return the "
        "op's layout (q.new_empty(q.shape) for a contiguous result). With mode='piecewise' and split_strategy='fx' "
        "piecewise copies such outputs into the fake's layout itself")


class StitchedForward:
    """The runtime callable Dynamo calls with the graph's flat inputs.

    Per call: read the token count (the first SymInt input), pick the compile entry once, set the
    forward context, run the split module's generated code (which calls `PieceRunner`s and eager
    splitting pieces from plain attributes). With graphs installed, the `GraphDispatcher` pads the
    call to a capture size and replays instead.
    """

    def __init__(self, split_gm: torch.fx.GraphModule, table: EntryTable, state: DispatchState,
                 sym_index: int | None, tag: str, max_num_tokens: int, refusal: SizeRefusal | None = None) -> None:
        self.forward = fx_forward(split_gm)
        self.refusal = refusal
        self._sizes_failing: dict[tuple[int, ...], tuple[str, ...]] = {}  # the guards these sizes fail
        self.split_gm = split_gm
        self.table = table
        self.state = state
        self.sym_index = sym_index
        self.tag = tag
        self.max_num_tokens = max_num_tokens
        self.graphs: Any = None  # a graphs.dispatch.GraphDispatcher when graphs are captured

    def __call__(self, *args: Any) -> Any:
        if self.refusal is not None:
            self._check_sizes(args)
        try:
            if self.graphs is not None:
                return self.graphs(args)
            return self.run_plain(*args)
        except AssertionError as e:
            raise _layout_assertion(e, self.tag) from e

    def _check_sizes(self, args: tuple) -> None:
        """Raise `SizeRefusedError` when this call's sizes fail a guard of `refusal`. A tuple of
        sizes is evaluated once (tens of microseconds a guard) and memoised; the memo holds at most
        `SIZES_MEMOISED` tuples (two dynamic dims up to 4096 would otherwise allow 16 M)."""
        sizes = self.refusal.sizes(args)
        failing = self._sizes_failing.get(sizes)
        if failing is None:
            failing = tuple(self.refusal.failing(sizes))
            if len(self._sizes_failing) >= SIZES_MEMOISED:
                self._sizes_failing.clear()  # bounded: the sizes in use fill it again within a few calls
            self._sizes_failing[sizes] = failing
        if failing:
            raise self.refusal.error(self.tag, sizes, failing)

    def run_plain(self, *args: Any) -> Any:
        """One forward without graphs, at the call's own size.

        Raises:
            InputError: the dynamic size exceeds ``max_num_tokens``.
        """
        if self.sym_index is None:  # static shapes: one entry, no token count to report
            self.state.entry = 0
            return self.forward(*args)
        n = args[self.sym_index]
        e = self.table.index_for(n)
        if e < 0:
            raise InputError(
                f"dynamic size {n} exceeds max_num_tokens={self.max_num_tokens} of tag {self.tag!r}; "
                "raise max_num_tokens in the CompilationConfig"
            )
        self.state.entry = e
        token = enter_forward(ForwardContext(n, n, RuntimeMode.NONE, None, self.tag))
        try:
            return self.forward(*args)
        finally:
            exit_forward(token)

    def select_entry(self, n: int) -> None:
        self.state.entry = self.table.index_for(n)


@dataclasses.dataclass
class CompiledForward:
    """One compiled graph, however it was made.

    Attributes:
        stitched: what Dynamo's transformed code calls.
        split: the split graph (pieces and split module).
        runners: the compiled pieces' runners, in call order.
        table: the compile entries every runner selects from.
        plan: how a warm start rebuilds this (None when a piece could not be saved).
        graphs: graph capture installed for it (None: no graphs).
    """

    stitched: StitchedForward
    split: SplitResult
    runners: list[PieceRunner]
    table: EntryTable
    plan: CompiledPlan | None
    graphs: GraphInstall | None


def build_forward(config: Any, tag: str, split: SplitResult, table: EntryTable, runners: Sequence[RunnerSpec],
                  callables: Mapping[str, list[Callable[..., Any]]], sym_index: int | None, graph_plan: GraphPlan | None,
                  plan: CompiledPlan | None, refusal: SizeRefusal | None = None) -> CompiledForward:
    """Install `runners` (their callables by fingerprint, one per entry of `table`) and the eager
    splitting pieces in `split`'s module, wrap it for dispatch and graph capture. The one way a
    `CompiledForward` is made: after compiling (cold) and after loading (warm)."""
    state = DispatchState()
    by_name = {it.name: it for it in split.items}
    split_gm = split.split_module
    built: list[PieceRunner] = []
    for spec in runners:
        runner = PieceRunner(spec.name, spec.index, by_name[spec.name].graph, state, spec.fingerprint)
        runner.callables = callables[spec.fingerprint]
        built.append(runner)
    # Instance attributes win over nn.Module.__getattr__, so the generated forward calls these
    # directly; splitting pieces skip Module.__call__ overhead through their bound forward, once
    # their runner has found their outputs in the layouts the compiled pieces expect.
    book = LayoutBook()
    for item in split.items:
        if item.is_splitting:
            SplittingRunner(item.name, item.graph, _splitting_forward(item.graph), split_gm.__dict__, tag, book).install()
    for runner in built:
        split_gm.__dict__[runner.name] = runner
    stitched = StitchedForward(split_gm, table, state, sym_index, tag, config.max_num_tokens, refusal)
    graphs = install_graphs(config, tag, stitched, built, graph_plan) if graph_plan is not None else None
    if graphs is not None:
        stitched.graphs = graphs.dispatcher
    return CompiledForward(stitched, split, built, table, plan, graphs)


def _splitting_forward(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """The bound forward of an eager splitting piece, with each call of an op registered by
    `piecewise.splitting_op` made through its `DirectCall` (its Python function, without the
    dispatcher's Python kernels, when that is the same call). Runs a copy of the graph: `gm` itself
    stays as traced, for fingerprints and the warm-start bundle."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and (call := direct_call(node.target)) is not None:
            bound = call.normalize(node.args, node.kwargs)
            if bound is not None:  # else an argument the dispatcher converts is typed at run time only
                node.target, (node.args, node.kwargs) = call, bound
                changed = True
    return fx_forward(torch.fx.GraphModule(gm, graph)) if changed else fx_forward(gm)
