"""The runners that stand in for pieces inside the split module (docs/design.md §4.4, §4.6).

A compiled model has a small, fixed list of *entries*: the general compile, one per compile range,
one per compile size. The top-level callable resolves the token count to an entry index once per
forward (`EntryTable.index_for`, a list lookup) and stores it in the shared `DispatchState`; each
`PieceRunner` then calls ``callables[state.entry]`` - no per-piece lookups keyed by tuples.

An eager splitting piece runs through a `SplittingRunner` until its outputs are known to have the
layouts the ops' fakes promised (the layouts the compiled piece after it was built for).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import operator
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch
import torch.fx

from ._torch.ops import OpOverload, OpOverloadPacket
from ._torch.subclasses import FakeTensor
from .config import CompilationConfig
from .counters import counters
from .errors import CompileError
from .ops import normalize_op_name
from .split import fx_forward
from .targets import CompileRange, CompileTarget

__all__ = ["EntryKind", "Entry", "EntryTable", "DispatchState", "PieceRunner", "piece_fingerprint", "Layout",
           "LayoutPhase", "LayoutBook", "SplittingRunner"]

log = logging.getLogger("piecewise")


class EntryKind(enum.Enum):
    GENERAL = "general"
    RANGE = "range"
    SIZE = "size"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One compile every non-splitting piece gets."""

    kind: EntryKind
    target: CompileTarget


class EntryTable:
    """The entries of a compiled model and the size -> entry map.

    Entries: the general compile when no ranges are configured (it serves every size), else one
    per range; then one per compile size. A size resolves to its exact size entry first, then the
    range containing it, then the general entry.
    """

    def __init__(self, config: CompilationConfig, dynamic: bool) -> None:
        entries: list[Entry] = []
        ranges: tuple[CompileRange, ...] = config.ranges() if dynamic else ()
        if ranges:
            entries += [Entry(EntryKind.RANGE, CompileTarget(compile_range=r)) for r in ranges]
        else:
            entries.append(Entry(EntryKind.GENERAL, CompileTarget()))
        if dynamic:
            entries += [Entry(EntryKind.SIZE, CompileTarget(size=s)) for s in config.compile_sizes]
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.has_general = not ranges
        table = [0] * (config.max_num_tokens + 1)
        for i, e in enumerate(self.entries):
            if e.kind is EntryKind.RANGE:
                r = e.target.compile_range
                for n in range(r.start, r.end + 1):
                    table[n] = i
        for i, e in enumerate(self.entries):
            if e.kind is EntryKind.SIZE:
                table[e.target.size] = i
        if ranges:
            table[0] = 0  # size 0 (empty batch) runs through the first range's symbolic code
        self.table: list[int] = table

    def index_for(self, n: int) -> int:
        """Entry index for token count `n`; -1 when no entry covers it (above every range)."""
        if n < len(self.table):
            return self.table[n]
        return 0 if self.has_general else -1


class DispatchState:
    """The entry chosen for the forward in flight; shared by all runners of one model."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry = 0


class PieceRunner:
    """Stands in for one compiled piece inside the split module.

    Attributes:
        name, index: the piece's submodule name and subgraph id.
        callables: one callable per entry of the `EntryTable` (shared between identical pieces).
        fingerprint: content hash; equal fingerprints share compiled artifacts.
    """

    __slots__ = ("name", "index", "callables", "state", "fingerprint", "graph")

    def __init__(self, name: str, index: int, graph: torch.fx.GraphModule, state: DispatchState, fingerprint: str) -> None:
        self.name = name
        self.index = index
        self.graph = graph
        self.state = state
        self.fingerprint = fingerprint
        self.callables: list[Callable[..., Any]] = []

    def __call__(self, *args: Any) -> Any:
        return self.callables[self.state.entry](*args)

    def __repr__(self) -> str:
        return f"PieceRunner({self.name}, {len(self.callables)} entries, fp={self.fingerprint[:8]})"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes, strides (in elements), dtype and device of one tensor: what a compiled piece asserts
    of each tensor input before it runs (Inductor's ``assert_size_stride``)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout | None:
        """The layout of `t`; None when a size or stride is symbolic (a data-dependent size)."""
        size, stride = tuple(t.shape), tuple(t.stride())
        if not all(type(v) is int for v in (*size, *stride)):
            return None
        return cls(size, stride, t.dtype, t.device)

    def holds_for(self, t: torch.Tensor) -> bool:
        """Whether `t` has this layout as a compiled piece checks it: strides of dims of size 0 or 1
        and of empty tensors are not compared (they address no second element)."""
        if t.stride() == self.stride or 0 in self.size:
            return True
        return all(a == b or n <= 1 for a, b, n in zip(t.stride(), self.stride, self.size))

    def describe(self) -> str:
        return f"size {self.size} stride {self.stride}"


class LayoutPhase(enum.Enum):
    """Where a `SplittingRunner` stands with its outputs' layouts."""

    CHECKING = "checking"  # each call compares the outputs with the fakes' until a call decides
    TRUSTED = "trusted"  # the ops return their fakes' layouts: the runner uninstalled itself
    COPYING = "copying"  # an op returns another layout: its outputs are copied into the fake's


#: calls a `SplittingRunner` checks before it trusts outputs that always had a dim of size 1 or 0
#: (whose stride is not compared, so such a call decides nothing for the sizes to come)
LAYOUT_CALLS_CHECKED = 16
#: expected layouts a `SplittingRunner` memoises (one per distinct tuple of output shapes, about
#: 200 bytes each) before it starts over
LAYOUT_MEMO = 4096


class LayoutBook:
    """What the `SplittingRunner`s of one compiled model share: the fakes' output layouts by piece
    structure and input layouts (identical layers run their fakes once), and the ops warned about."""

    def __init__(self) -> None:
        self.expected: dict[tuple[Any, ...], tuple[Layout | None, ...]] = {}
        self.warned: set[str] = set()


class SplittingRunner:
    """Stands in for one eager splitting piece inside the split module: runs `forward` and holds
    its outputs to the layouts the ops' fakes (``register_fake``) promise for the same inputs.

    The compiled piece after a splitting op was built for the fake's output layout and asserts it
    (Inductor's generated code raises an untyped ``AssertionError: expected size 3==3, stride
    192==16``). A fake that claims other strides than the op returns is a common slip:
    ``torch.empty_like(q)`` of a transposed ``q`` keeps q's strides while the op's result is
    contiguous. The first calls run the piece's graph on fake copies of the real inputs (a few
    milliseconds, once per distinct piece structure and input layouts in the model, shared through
    `book`) and compare sizes, strides (of dims of size above 1), dtype and device of every tensor
    output with the fakes':

    - equal on a call where no output has a dim of size 1 or 0, or on `LAYOUT_CALLS_CHECKED`
      calls: the runner puts `forward` itself in its place (`LayoutPhase.TRUSTED`), so later calls
      cost nothing;
    - other strides: from then on every call copies such an output into the fake's layout
      (`LayoutPhase.COPYING`, one copy a call), warned once per op per compiled model at WARNING
      with both layouts and the fix, and counted in ``counters.layout_mismatches``;
    - other sizes, dtype or device, which no copy fixes: `CompileError` naming the op and both.

    A graph that cannot run on fakes (an op without a fake) is not checked (logged at INFO).

    Attributes:
        name: the piece's submodule name; `slots` (the split module's ``__dict__``) holds the
            runner, or `forward` once trusted.
        ops: per output of the piece, the splitting op that made it (``"namespace::op"``).
        phase: the `LayoutPhase`.
    """

    __slots__ = ("name", "graph", "forward", "slots", "tag", "book", "ops", "single", "phase", "expected",
                 "checked", "structure", "_graph_forward")

    def __init__(self, name: str, graph: torch.fx.GraphModule, forward: Callable[..., Any],
                 slots: MutableMapping[str, Any], tag: str, book: LayoutBook) -> None:
        self.name = name
        self.graph = graph
        self.forward = forward
        self.slots = slots
        self.tag = tag
        self.book = book
        self.single, self.ops = _output_ops(graph)
        #: the piece's ops and wiring, names left out (`piece_fingerprint`): equal for identical layers
        self.structure = piece_fingerprint(graph, ())
        self.phase = LayoutPhase.CHECKING
        #: per tuple of output shapes, the fakes' layouts (None: not a tensor, or not checkable)
        self.expected: dict[tuple[Any, ...], tuple[Layout | None, ...]] = {}
        self.checked = 0  # calls checked while `CHECKING`
        self._graph_forward: Callable[..., Any] | None = None

    def install(self) -> None:
        self.slots[self.name] = self

    def __call__(self, *args: Any) -> Any:
        out = self.forward(*args)
        if self.phase is LayoutPhase.TRUSTED:
            return out
        outs = (out,) if self.single else tuple(out)
        if any(isinstance(o, FakeTensor) for o in outs):
            return out  # run under a fake mode (a trace of the caller): nothing real to check
        expected = self._expected(args, outs)
        if expected is None:
            return out
        wrong = self._wrong_strides(outs, expected)
        if wrong:
            if self.phase is LayoutPhase.CHECKING:
                self.phase = LayoutPhase.COPYING
                self._report(outs, expected, wrong)
            fixed = list(outs)
            for i in wrong:
                fixed[i] = self._relaid(i, outs[i], expected[i])
            return fixed[0] if self.single else fixed if isinstance(out, list) else tuple(fixed)
        if self.phase is LayoutPhase.CHECKING:
            self.checked += 1
            if self.checked >= LAYOUT_CALLS_CHECKED or all(
                    all(n > 1 for n in o.shape) for o in outs if isinstance(o, torch.Tensor)):
                self._trust()
        return out

    def _trust(self) -> None:
        self.phase = LayoutPhase.TRUSTED
        self.expected.clear()
        self.slots[self.name] = self.forward

    def _expected(self, args: tuple[Any, ...], outs: tuple[Any, ...]) -> tuple[Layout | None, ...] | None:
        """The fakes' output layouts for this call, memoised by output shapes; None when the graph
        cannot run on fakes (then the runner trusts the outputs from now on)."""
        key = tuple(o.shape if isinstance(o, torch.Tensor) else None for o in outs)
        found = self.expected.get(key)
        if found is not None:
            return found
        shared_key = (self.structure, _layout_key(args))
        found = self.book.expected.get(shared_key)
        if found is not None:
            self._memo(key, found)
            return found
        try:
            fakes = self._run_on_fakes(args)
        except Exception as e:  # an op without a fake, a fake that reads data: not checkable
            if self.phase is LayoutPhase.COPYING:
                raise CompileError(f"[{self.tag}] the fake of splitting op {', '.join(dict.fromkeys(self.ops))} failed "
                                   f"on this call's inputs ({type(e).__name__}: {e}), so its outputs could not be copied "
                                   "into the layout the compiled pieces expect; make the fake run on every input the "
                                   "op takes") from e
            log.info("[%s] could not check the output layouts of %s against their fakes (%s: %s)", self.tag,
                     ", ".join(dict.fromkeys(self.ops)), type(e).__name__, e)
            self._trust()
            return None
        fouts = (fakes,) if self.single else tuple(fakes)
        found = tuple(Layout.of(f) if isinstance(f, torch.Tensor) else None for f in fouts)
        if len(self.book.expected) >= LAYOUT_MEMO:
            self.book.expected.clear()
        self.book.expected[shared_key] = found
        self._memo(key, found)
        return found

    def _memo(self, key: tuple[Any, ...], found: tuple[Layout | None, ...]) -> None:
        if len(self.expected) >= LAYOUT_MEMO:
            self.expected.clear()
        self.expected[key] = found

    def _run_on_fakes(self, args: tuple[Any, ...]) -> Any:
        """The piece's graph run on fake copies of `args` (static sizes: this call's), outside any
        dispatch mode the caller runs under, so the ops' fakes answer rather than their bodies."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        from ._torch.dispatch import disable_current_modes
        from ._torch.pytree import tree_map_only
        from ._torch.subclasses import FakeTensorMode

        if self._graph_forward is None:
            self._graph_forward = fx_forward(self.graph)
        with disable_current_modes():
            mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
            fake_args = tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t, static_shapes=True), args)
            with mode, torch.no_grad():
                return self._graph_forward(*fake_args)

    def _wrong_strides(self, outs: tuple[Any, ...], expected: tuple[Layout | None, ...]) -> list[int]:
        """Positions of the outputs whose strides differ from the fake's.

        Raises:
            CompileError: an output differs in size, dtype or device, which no copy fixes.
        """
        wrong = []
        for i, (o, want) in enumerate(zip(outs, expected)):
            if want is None or not isinstance(o, torch.Tensor):
                continue
            got = Layout(tuple(o.shape), tuple(o.stride()), o.dtype, o.device)
            if got.size != want.size or got.dtype != want.dtype or not _same_device(got.device, want.device):
                raise CompileError(
                    f"[{self.tag}] splitting op {self.ops[i]} returned {got.describe()} {got.dtype} on {got.device}, but "
                    f"its fake (register_fake) returns {want.describe()} {want.dtype} on {want.device} for the same "
                    "inputs; the compiled pieces after it were built for the fake's. Make the fake return a tensor of the "
                    "op's sizes, dtype and device (torch.empty(sizes, dtype=..., device=...) computed from the inputs)")
            if not want.holds_for(o):
                wrong.append(i)
        return wrong

    def _relaid(self, i: int, t: torch.Tensor, want: Layout) -> torch.Tensor:
        try:
            return torch.empty_strided(want.size, want.stride, dtype=t.dtype, device=t.device).copy_(t)
        except RuntimeError as e:  # overlapping strides (an expanded fake): no tensor of that layout can hold it
            raise CompileError(f"[{self.tag}] splitting op {self.ops[i]} returned {Layout.of(t).describe()}, but its "
                               f"fake (register_fake) returns {want.describe()}, a layout no copy can fill ({e}); make "
                               "the fake return the op's layout") from e

    def _report(self, outs: tuple[Any, ...], expected: tuple[Layout | None, ...], wrong: list[int]) -> None:
        for i in wrong:
            op = self.ops[i]
            if op in self.book.warned:
                continue
            self.book.warned.add(op)
            counters.bump("layout_mismatches", tag=self.tag)
            t, want = outs[i], expected[i]
            if t.is_contiguous():
                fix = ("make the fake return a contiguous tensor, as the op does: x.new_empty(sizes) or "
                       "torch.empty(sizes, dtype=x.dtype, device=x.device), not torch.empty_like(x) of a transposed x, "
                       "which keeps x's strides")
            else:
                fix = ("make the fake return the op's strides (torch.empty_strided), or make the op return "
                       ".contiguous() and the fake x.new_empty(sizes)")
            log.warning("[%s] splitting op %s returned %s where its fake (register_fake) returns %s for the same inputs; "
                        "the compiled piece after it was built for the fake's layout, so each call now copies the output "
                        "into that layout (one extra copy a call). Fix: %s", self.tag, op, Layout.of(t).describe(),
                        want.describe(), fix)

    def __repr__(self) -> str:
        return f"SplittingRunner({self.name}, {self.phase.value})"


def _layout_key(x: Any) -> Any:
    """A hashable key of what a fake kernel reads of its arguments: each tensor's sizes, strides,
    dtype and device, every other value itself (lists and tuples element by element)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_layout_key, x))
    if isinstance(x, dict):
        return ("dict", *((k, _layout_key(v)) for k, v in x.items()))
    try:
        hash(x)
    except TypeError:
        return ("unhashable", id(x))
    return x


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, an index-less device matching any index of its type (``cuda`` and ``cuda:0``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _output_ops(graph: torch.fx.GraphModule) -> tuple[bool, tuple[str, ...]]:
    """Whether the piece returns one value (not a tuple), and per output the op that made it."""
    out_node = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    value = out_node.args[0]
    single = not isinstance(value, (tuple, list))
    names = []
    for v in ((value,) if single else value):
        while isinstance(v, torch.fx.Node) and v.op == "call_function" and v.target is operator.getitem:
            v = v.args[0]
        if isinstance(v, torch.fx.Node) and isinstance(v.target, (OpOverload, OpOverloadPacket)):
            names.append(normalize_op_name(v.target))
        else:
            names.append(v.name if isinstance(v, torch.fx.Node) else repr(v))
    return single, tuple(names)


def _meta(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({tuple(str(s) for s in x.shape)},{tuple(str(s) for s in x.stride())},{x.dtype},{x.device.type},{x.requires_grad})"
    if isinstance(x, torch.SymInt):
        return f"S({x.node.expr})"
    return f"V({type(x).__name__}:{x!r})"


def piece_fingerprint(graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """A content hash of a piece: its ops in order with arguments renamed to positions, its
    constants' bytes, and its input metadata (shapes as symbolic expressions, strides, dtypes).

    Two transformer layers produce equal fingerprints even though their parameter placeholders have
    different names, so they are compiled once (docs/design.md §4.4)."""
    h = hashlib.sha256()
    ids: dict[torch.fx.Node, int] = {}

    def ref(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: f"%{ids[n]}")

    for i, node in enumerate(graph.graph.nodes):
        ids[node] = i
        target = node.target
        if node.op == "get_attr":
            val = getattr(graph, target)
            if isinstance(val, torch.Tensor):
                h.update(f"const{tuple(val.shape)}{val.dtype}".encode())
                h.update(val.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(val).encode())
            target = "attr"
        elif node.op == "placeholder":
            target = "in"
        elif node.op == "call_module":
            target = f"module:{type(getattr(graph, target)).__name__}"
        elif isinstance(target, (OpOverload, OpOverloadPacket)):
            target = str(target)
        elif not isinstance(target, str):
            qual = getattr(target, "__qualname__", None) if isinstance(getattr(target, "__qualname__", None), str) else None
            target = f"{getattr(target, '__module__', '')}.{qual}" if qual else repr(target)
        h.update(f"{node.op}|{target}|{ref(node.args)!r}|{ref(dict(node.kwargs))!r};".encode())
    for x in example_inputs:
        h.update(_meta(x).encode())
    return h.hexdigest()
