"""Packed CPU linears: a piece's matmuls with a weight run on oneDNN with the weight packed once
(built-in pass).

Rewrites, on the functional post-grad graph, ``mm(x, permute(w, [1, 0]))`` and
``addmm(b, x, permute(w, [1, 0]))`` (what ``nn.Linear`` / ``F.linear`` become), where ``w`` is a
2-D CPU input of the piece (a weight) of a dtype in `PackedLinear.dtypes`, into
``piecewise_cpu::packed_linear(x, w, b)``. When ``w`` is an ``nn.Parameter`` (a model's weight;
any other tensor runs ``F.linear``, the same values), that op packs ``w`` into oneDNN's blocked layout on its
first call and keeps the packed copy in `PACKED` for as long as ``w`` lives, packing again when
``w`` is written in place (its version counter moves) or replaced (another tensor);
`counters.weights_packed` counts the packs. torch's own CPU ``mm`` of bfloat16 reorders the weight on
every call; the packed kernel gives the same bits in about half the time for one linear whose
weight is in the CPU's caches (SmolLM2's shapes, rows 1-128), which a whole decode step, reading
every weight from memory, mostly does not see (below).

Cost: one packed copy of each packed weight, the size of the weight, for the life of the weight
(`PackedWeights.nbytes` of `PACKED`). Switch: ``CompilationConfig(cpu_packed_linear=True)`` packs
bfloat16 and float16 weights where this CPU runs them in oneDNN (same bits as eager); off by
default: on SmolLM2's whole decode step (2-core AVX-512 host) the engine's step was 4% faster and
transformers ``generate()``'s 15-20% slower with it (`benchmarks/cpu_decode_profile.py --variants
bf16,bf16_packed`), so it is a setting to measure on one's own model and machine. float32 is never
packed: oneDNN's packed float32 kernel was slower than ``mm`` there (up to 1.8x a step).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.fx
from torch.library import Library

from .._torch.onednn import pack_linear_weight, packable_dtypes, packed_linear, tensor_version
from .base import PassContext, PiecewisePass

__all__ = ["PackedLinear", "PackedWeights", "PACKED", "pack_linears"]

aten = torch.ops.aten

_lib = Library("piecewise_cpu", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


class PackedWeights:
    """Packed copies of weights, each kept while its weight lives and is unwritten.

    `get` is on every call of every packed linear, so its hit is a dict lookup by the weight's
    identity, a weak reference check and a version compare."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, tuple[weakref.ref, int, int, torch.Tensor, int]] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight`'s packed copy, made now when there is none for this tensor at its version."""
        entry = self._by_id.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == tensor_version(weight) and entry[2] == weight.data_ptr():
            return entry[3]
        return self._pack(weight)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        from ..counters import counters

        packed = pack_linear_weight(weight)
        key = id(weight)
        ref = weakref.ref(weight, lambda r, key=key: self._drop(key, r))
        with self._lock:
            self._by_id[key] = (ref, tensor_version(weight), weight.data_ptr(), packed, weight.nbytes)
        counters.bump("weights_packed")
        return packed

    def _drop(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._by_id.get(key)
            if entry is not None and entry[0] is ref:
                del self._by_id[key]

    def nbytes(self) -> int:
        """Bytes of the weights that have a packed copy now (the packed copies take about as much)."""
        return sum(e[4] for e in list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def clear(self) -> None:
        with self._lock:
            self._by_id.clear()


#: the process's packed weights
PACKED = PackedWeights()


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(weight, torch.nn.Parameter):  # an activation in a weight's place: nothing to keep
        return torch.nn.functional.linear(x, weight, bias)
    return packed_linear(x, PACKED.get(weight), bias)


def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


_lib.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("piecewise_cpu::packed_linear", _packed_linear_fake, lib=_lib)
OP = torch.ops.piecewise_cpu.packed_linear.default


class PackedLinear(PiecewisePass):
    """Runs a piece's linears with CPU weights of `dtypes` on oneDNN with packed weights (see the
    module doc). Switch: ``CompilationConfig(cpu_packed_linear=...)``.

    Args:
        dtypes: weight dtypes to pack; those this torch and CPU cannot pack are left out.
    """

    name = "packed_linear"

    def __init__(self, dtypes: frozenset[torch.dtype] | set[torch.dtype] = frozenset({torch.bfloat16})) -> None:
        self.dtypes = frozenset(dtypes) & packable_dtypes()

    def uuid(self) -> Any:
        return {"name": self.name, "version": 1, "dtypes": sorted(str(d) for d in self.dtypes)}

    def __call__(self, graph: torch.fx.Graph, context: PassContext) -> int:
        return pack_linears(graph, self.dtypes)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _weight(node: Any, dtypes: frozenset[torch.dtype]) -> torch.fx.Node | None:
    """The piece input `w` when `node` is ``permute(w, [1, 0])`` of a packable weight."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.permute.default
            and list(node.args[1]) == [1, 0]):
        return None
    w = node.args[0]
    val = _val(w)
    if not (isinstance(w, torch.fx.Node) and w.op == "placeholder" and isinstance(val, torch.Tensor)):
        return None
    if val.dim() != 2 or val.device.type != "cpu" or val.dtype not in dtypes or not val.is_contiguous():
        return None
    if any(not isinstance(s, int) for s in val.shape):  # a weight's sizes are fixed
        return None
    return w


def pack_linears(graph: torch.fx.Graph, dtypes: frozenset[torch.dtype]) -> int:
    """Rewrite the linears of `graph` whose weight dtype is in `dtypes` (see the module doc);
    returns how many were rewritten."""
    if not dtypes:
        return 0
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.mm.default:
            x, wt = node.args
            bias = None
        elif node.target is aten.addmm.default and not node.kwargs:
            bias, x, wt = node.args[:3]
            bval = _val(bias)
            if len(node.args) > 3 or not (isinstance(bval, torch.Tensor) and bval.dim() == 1):
                continue
        else:
            continue
        w = _weight(wt, dtypes)
        xval = _val(x)
        if w is None or not (isinstance(xval, torch.Tensor) and xval.dtype == _val(w).dtype and xval.dim() == 2):
            continue
        if bias is not None and _val(bias).dtype != xval.dtype:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(OP, (x, w, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
        count += 1
    return count
