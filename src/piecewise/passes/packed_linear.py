"""Packed CPU linears: a piece's matmuls with a weight run on oneDNN with the weight packed once
(built-in pass, on by default).

Rewrites, on the functional post-grad graph, ``mm(x, permute(w, [1, 0]))`` and
``addmm(b, x, permute(w, [1, 0]))`` (what ``nn.Linear`` / ``F.linear`` become), where ``w`` is a
2-D CPU input of the piece (a weight) of a dtype in `PackedLinear.dtypes` (a float32 one only
when at least `FLOAT32_MIN_OUT_FEATURES` wide: narrower ones never run packed, so they keep
Inductor's ``mm``/``addmm``), into ``piecewise_cpu::packed_linear(x, w, b)``. When ``w`` is an ``nn.Parameter`` (a model's weight;
any other tensor runs ``F.linear``, the same values), that op packs ``w`` into oneDNN's blocked
layout on its first packed call and keeps the packed copy in `PACKED` for as long as ``w`` lives,
packing again when ``w`` is written in place (its version counter moves) or replaced (another
tensor); `counters.weights_packed` counts the packs.

Which calls run packed (`runs_packed`), from the kernels measured one against the other at
SmolLM2's shapes (30 layers of q/k/v/o/gate/up/down weights, distinct copies so each is read
from memory, 2 threads of a 2-core AVX-512 host; ``benchmarks/cpu_linear_kernels.py``):

* bfloat16 and float16: every call. torch's own CPU ``mm`` of bfloat16 already runs oneDNN but
  reorders the weight on every call; the packed kernel gives the same bits in 0.66-0.70x the time
  at 1-16 rows, 0.75-0.88x at 64-1024 rows (the 49152-row vocabulary projection: 0.58x at 1 row).
* float32: calls of `FLOAT32_PACKED_ROWS` rows (4-64: a decode batch) with a weight of at least
  `FLOAT32_MIN_OUT_FEATURES` (1024) output features. MKL's ``mm`` repacks the weight on every call
  and is compute-bound at so few rows where the output is wide: at 8 rows packed took 0.52x of
  ``mm``'s time for the 49152-wide vocabulary projection, 0.73x for 4096 x 128 and 0.93x for
  1536 x 576; narrower weights (128-576 outputs: a small model's, or attention's projections)
  were faster on ``mm`` (packed 1.05-2.85x), as were calls of 1-2 rows and of 1024 rows. Those
  calls run ``F.linear``: the same bits as the unpacked compile, and nothing is packed for a
  weight only ever called that way. Packed float32 values differ from ``mm``'s by rounding
  (another order of the sums), within float32's tolerance.

Cost: one packed copy of each packed weight, the size of the weight, for the life of the weight
(`PackedWeights.nbytes` of `PACKED`): a float32 model served at batch 1 only packs nothing; one
served in batches holds its weights twice. The copies stop at `MEMORY_FRACTION` of the machine's
memory (a warning says so once; later weights run unpacked), so a model too big to hold twice
still runs. Switch: ``CompilationConfig(cpu_packed_linear=False)``
turns the pass off (the memory back, the speed above given up).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

import torch
import torch.fx
from torch.library import Library

from .._torch.onednn import pack_linear_weight, packable_dtypes, packed_linear, tensor_version
from .base import PassContext, PiecewisePass

__all__ = ["FLOAT32_MIN_OUT_FEATURES", "FLOAT32_PACKED_ROWS", "MEMORY_FRACTION", "PackedLinear", "PackedWeights", "PACKED", "cpu_linear", "pack_linears", "runs_packed"]

aten = torch.ops.aten
log = logging.getLogger("piecewise")

_lib = Library("piecewise_cpu", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


#: the most memory the process's packed copies may take, as a fraction of the machine's memory
MEMORY_FRACTION = 0.25


def _memory_limit() -> int:
    """`MEMORY_FRACTION` of this machine's physical memory in bytes (no limit where it is unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_FRACTION)
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 1 << 62


class PackedWeights:
    """Packed copies of weights, each kept while its weight lives and is unwritten.

    `get` is on every call of every packed linear, so its hit is a dict lookup by the weight's
    identity, a weak reference check and a version compare.

    Args:
        limit_bytes: the most the packed copies may take together (default: `MEMORY_FRACTION` of
            the machine's memory). A weight whose copy would pass it is not packed: its calls run
            unpacked, and one warning names the limit and the switch.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, tuple[weakref.ref, int, int, torch.Tensor, int]] = {}
        self.limit_bytes = _memory_limit() if limit_bytes is None else limit_bytes
        self._bytes = 0
        self._warned = False

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s packed copy, made now when there is none for this tensor at its version;
        None when making it would take the copies past `limit_bytes`."""
        entry = self._by_id.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == tensor_version(weight) and entry[2] == weight.data_ptr():
            return entry[3]
        return self._pack(weight)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        from ..counters import counters

        key = id(weight)
        with self._lock:
            old = self._by_id.get(key)
            held = self._bytes - (old[4] if old is not None else 0)
            if held + weight.nbytes > self.limit_bytes:
                if not self._warned:
                    self._warned = True
                    log.warning("packed CPU linear weights would take %.1f GB, past the limit of %.1f GB (a quarter of "
                                "this machine's memory): weights beyond it run unpacked, slower at a few rows; "
                                "CompilationConfig(cpu_packed_linear=False) packs none", (held + weight.nbytes) / 1e9,
                                self.limit_bytes / 1e9)
                return None
        packed = pack_linear_weight(weight)
        ref = weakref.ref(weight, lambda r, key=key: self._drop(key, r))
        with self._lock:
            old = self._by_id.get(key)
            self._bytes += weight.nbytes - (old[4] if old is not None else 0)
            self._by_id[key] = (ref, tensor_version(weight), weight.data_ptr(), packed, weight.nbytes)
        counters.bump("weights_packed")
        return packed

    def _drop(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._by_id.get(key)
            if entry is not None and entry[0] is ref:
                del self._by_id[key]
                self._bytes -= entry[4]

    def nbytes(self) -> int:
        """Bytes of the weights that have a packed copy now (the packed copies take about as much)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._by_id)


#: the process's packed weights
PACKED = PackedWeights()


#: rows (inclusive) of the float32 calls that run packed; outside them MKL's ``mm`` was faster
FLOAT32_PACKED_ROWS = (4, 64)
#: the fewest output features of a float32 weight that runs packed; narrower ones were faster on ``mm``
FLOAT32_MIN_OUT_FEATURES = 1024


def runs_packed(weight: torch.Tensor, rows: int) -> bool:
    """Whether a call of `rows` rows with `weight` runs the packed kernel (see the module doc):
    every call for a bfloat16/float16 parameter; for a float32 one, calls of `FLOAT32_PACKED_ROWS`
    rows when it has at least `FLOAT32_MIN_OUT_FEATURES` output features; never for a tensor that is
    not an ``nn.Parameter`` (an activation in a weight's place)."""
    if not isinstance(weight, torch.nn.Parameter):
        return False
    if weight.dtype == torch.float32:
        return (weight.shape[0] >= FLOAT32_MIN_OUT_FEATURES
                and FLOAT32_PACKED_ROWS[0] <= rows <= FLOAT32_PACKED_ROWS[1])
    return True


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = PACKED.get(weight) if runs_packed(weight, x.shape[0]) else None
    if packed is None:  # mm's rows, not a parameter, or past the memory limit
        return torch.nn.functional.linear(x, weight, bias)
    return packed_linear(x, packed, bias)


def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


_lib.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("piecewise_cpu::packed_linear", _packed_linear_fake, lib=_lib)
OP = torch.ops.piecewise_cpu.packed_linear.default


#: the weight dtypes `PackedLinear` packs by default (where this CPU runs them in oneDNN)
DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


class PackedLinear(PiecewisePass):
    """Runs a piece's linears with CPU weights of `dtypes` on oneDNN with packed weights (see the
    module doc). Switch: ``CompilationConfig(cpu_packed_linear=...)``.

    Args:
        dtypes: weight dtypes to pack; those this torch and CPU cannot pack are left out.
    """

    name = "packed_linear"

    def __init__(self, dtypes: frozenset[torch.dtype] | set[torch.dtype] = DTYPES) -> None:
        self.dtypes = frozenset(dtypes) & packable_dtypes()

    def uuid(self) -> Any:
        return {"name": self.name, "version": 5, "dtypes": sorted(str(d) for d in self.dtypes),
                "float32_rows": FLOAT32_PACKED_ROWS, "float32_min_out": FLOAT32_MIN_OUT_FEATURES}

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
    if val.dtype == torch.float32 and val.shape[0] < FLOAT32_MIN_OUT_FEATURES:
        return None  # never runs packed: left to Inductor's mm / addmm (no op call, the residual fused)
    return w


def pack_linears(graph: torch.fx.Graph, dtypes: frozenset[torch.dtype]) -> int:
    """Rewrite the linears of `graph` whose weight dtype is in `dtypes` (see the module doc);
    returns how many were rewritten. An ``addmm`` whose added term is not a bias row (Inductor
    folds a residual ``h + linear(x)`` into ``addmm(h, x, w.T)``) becomes the packed op plus an
    ``add`` that Inductor fuses into the next pointwise kernel."""
    if not dtypes:
        return 0
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.mm.default:
            x, wt = node.args
            bias = added = None
        elif node.target is aten.addmm.default and not node.kwargs and len(node.args) == 3:
            bias, x, wt = node.args
            bval, out = _val(bias), _val(node)
            if not (isinstance(bval, torch.Tensor) and isinstance(out, torch.Tensor) and bval.dtype == out.dtype):
                continue
            added = None
            if bval.dim() != 1:  # a residual (or a broadcast row) added to the product
                bias, added = None, bias
        else:
            continue
        w = _weight(wt, dtypes)
        xval = _val(x)
        if w is None or not (isinstance(xval, torch.Tensor) and xval.dtype == _val(w).dtype and xval.dim() == 2):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(OP, (x, w, bias))
            if added is not None:
                new.meta.update(node.meta)
                new = graph.call_function(aten.add.Tensor, (new, added))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
        count += 1
    return count


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for eager code on the CPU, with the kernel the pass's op picks
    (`runs_packed`): an engine's vocabulary projection of the rows it samples, outside any
    compiled piece. `x` [rows, in_features]; `weight` [out_features, in_features]; returns
    [rows, out_features] in `x`'s dtype. Any other device, dtype or rank runs ``F.linear``.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(10, 4), requires_grad=False)
        >>> cpu_linear(torch.randn(8, 4), w).shape
        torch.Size([8, 10])
    """
    if (x.device.type != "cpu" or x.dim() != 2 or weight.dtype not in packable_dtypes() or x.dtype != weight.dtype
            or (bias is not None and bias.dtype != x.dtype)):
        return torch.nn.functional.linear(x, weight, bias)
    return OP(x, weight, bias)
