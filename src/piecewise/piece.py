"""Per-piece dispatch over compile sizes and ranges (docs/design.md §4.4, §4.6).

A compiled model has a small, fixed list of *entries*: the general compile, one per compile range,
one per compile size. The top-level callable resolves the token count to an entry index once per
forward (`EntryTable.index_for`, a list lookup) and stores it in the shared `DispatchState`; each
`PieceRunner` then calls ``callables[state.entry]`` - no per-piece lookups keyed by tuples.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .config import CompilationConfig
from .targets import CompileRange, CompileTarget

__all__ = ["EntryKind", "Entry", "EntryTable", "DispatchState", "PieceRunner", "piece_fingerprint"]


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
        elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            target = str(target)
        elif not isinstance(target, str):
            qual = getattr(target, "__qualname__", None) if isinstance(getattr(target, "__qualname__", None), str) else None
            target = f"{getattr(target, '__module__', '')}.{qual}" if qual else repr(target)
        h.update(f"{node.op}|{target}|{ref(node.args)!r}|{ref(dict(node.kwargs))!r};".encode())
    for x in example_inputs:
        h.update(_meta(x).encode())
    return h.hexdigest()
