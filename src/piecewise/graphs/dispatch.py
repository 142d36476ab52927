"""Padding, static input buffers and graph-mode dispatch for one compiled model (docs/design.md §4.7, §6.1,
§6.4).

A call of ``n`` tokens is padded to the smallest capture size ``>= n``: each input with a dynamic
dim is copied into the first ``n`` rows of a static buffer sized for ``max_num_tokens`` (allocated
once, so its address never moves), rows ``n..padded`` are zero-filled, the model runs at the padded
size (replaying graphs), and outputs are sliced back to ``n`` rows. The forward context carries the
real and padded counts, so a splitting op can skip pad rows. Above the largest capture size the call
runs without graphs (counted; logged once).

Runtime mode per call: ``piecewise`` replays one graph per compiled piece with splitting ops run
eagerly in between; ``full`` replays one graph of the whole forward (splitting ops must be safe to
capture); ``full_and_piecewise`` uses full graphs for uniform-decode batches (`batch_hint`) and
piecewise graphs otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from .. import state
from ..counters import counters
from ..errors import CaptureError
from ..inputs import version
from ..forward_context import BatchDescriptor, ForwardContext, RuntimeMode, enter_forward, exit_forward
from .wrapper import GraphPool, PieceGraphWrapper

__all__ = ["GraphDispatcher", "StaticInput", "batch_hint"]

log = logging.getLogger("piecewise")

_uniform_decode: contextvars.ContextVar[bool] = contextvars.ContextVar("piecewise_uniform_decode", default=False)


@contextlib.contextmanager
def batch_hint(*, uniform_decode: bool) -> Iterator[None]:
    """Declare the batch shape of the calls in this block: ``uniform_decode=True`` when every
    request contributes the same number of tokens (a decode step), which `full_and_piecewise` serves
    with full graphs.

    Examples:
        >>> from piecewise.graphs import batch_hint
        >>> with batch_hint(uniform_decode=True):
        ...     pass   # call the compiled model here with one token per request
    """
    token = _uniform_decode.set(uniform_decode)
    try:
        yield
    finally:
        _uniform_decode.reset(token)


@dataclasses.dataclass
class StaticInput:
    """A graph input whose `dim` is the token dim: copied and padded into a static buffer every call.

    The buffer is one flat allocation for ``max_num_tokens`` rows; the input of padded size ``p`` is
    its first ``numel(p)`` elements viewed at the input's shape, so it is contiguous (the layout the
    pieces were compiled for) and starts at the same address for every size, whichever dim is the
    token dim (``buffer.narrow(dim, 0, p)`` of a [2, max, 8] buffer would be strided for dim 1)."""

    index: int
    dim: int
    buffer: torch.Tensor | None = None
    views: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def view(self, x: torch.Tensor, padded: int, max_num_tokens: int) -> torch.Tensor:
        """The static input of padded size `padded`, shaped like `x` with `padded` tokens."""
        v = self.views.get(padded)
        if v is None:
            shape = list(x.shape)
            shape[self.dim] = max_num_tokens
            if self.buffer is None:
                self.buffer = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
            shape[self.dim] = padded
            v = self.views[padded] = self.buffer[: math.prod(shape)].view(shape)
        return v


class Stitched(Protocol):
    """What a `GraphDispatcher` runs (the backend's `StitchedForward`)."""

    forward: Callable[..., Any]  # the split module's forward over the flat graph inputs
    split_gm: torch.fx.GraphModule
    sym_index: int | None  # position of the token-count SymInt among the graph inputs

    def select_entry(self, n: int) -> None: ...  # the compile entry (size, range, general) for n tokens

    def run_plain(self, *args: Any) -> Any: ...  # one forward without graphs at the call's own size


class GraphDispatcher:
    """Pads each call to a capture size and runs it through the graph wrappers.

    Args:
        stitched: the forward to run (`Stitched`: its split module's forward, with piece wrappers
            installed for piecewise mode; its compile-entry selection; its plain path for sizes
            above the largest capture size).
        runner: the shared `GraphPool`.
        capture_sizes: capture sizes, all <= `max_num_tokens`.
        static_inputs: the inputs with a token dim.
        output_dims: per flat output, the token dim to slice back, or None.
        cudagraph_mode: ``piecewise`` | ``full`` | ``full_and_piecewise``.
        token_count_inputs: every SymInt input that is the token count (`GraphPlan`), each given
            the padded count; empty: the first SymInt input only.
        argument_inputs: the forward's own tensor arguments without a token dim (`GraphPlan`):
            graphs read them in place, so every call checks that each is still at its capture
            address (one ``data_ptr`` each) and raises `CaptureError` naming it otherwise.
        written_inputs: graph inputs forward writes in place outside splitting ops (`GraphPlan`):
            those without a token dim (forward's arguments, module buffers) are kept across the
            extra runs (`_keep_arguments`).
    """

    def __init__(self, stitched: Stitched, runner: GraphPool, capture_sizes: Sequence[int], *,
                 static_inputs: list[StaticInput], output_dims: list[int | None], cudagraph_mode: str, max_num_tokens: int,
                 tag: str, token_count_inputs: Sequence[int] = (), argument_inputs: Sequence[int] = (),
                 written_inputs: Sequence[int] = ()) -> None:
        from .capture_sizes import PaddingTable

        forward = stitched.forward
        self.forward = forward
        self.runner = runner
        self.sizes = sorted(capture_sizes)
        self.sym_index = stitched.sym_index
        self.token_count_inputs = tuple(token_count_inputs) or (self.sym_index,)
        self.argument_inputs = tuple(argument_inputs)
        token_inputs = {si.index for si in static_inputs}
        #: written inputs graphs read in place (no token dim): arguments, module buffers
        self.written_arguments = tuple(i for i in written_inputs if i not in token_inputs)
        self.written_static = frozenset(written_inputs)
        self._argument_ptrs: tuple[tuple[int, int], ...] = ()
        self.static_inputs = static_inputs
        self.output_dims = output_dims
        self.mode = cudagraph_mode
        self.max_num_tokens = max_num_tokens
        self.select_entry = stitched.select_entry
        self.plain = stitched.run_plain
        self.tag = tag
        self.full = PieceGraphWrapper(forward, runner, mode=RuntimeMode.FULL, first=True, name="full graph") if cudagraph_mode != "piecewise" else None
        self._table_cls = PaddingTable
        self.table = PaddingTable(self.sizes, max_num_tokens)
        self.captured = False
        self.captured_ptrs = False
        self.num_tokens_device: torch.Tensor | None = None
        self._warned_above = False
        self._all_sizes = list(self.sizes)
        self.wrappers: list[PieceGraphWrapper] = []  # piece wrappers (piecewise mode), set by install_graphs
        # Inputs bound in place by every graph (weights, buffers): (index, address) at capture.
        self._bound: list[tuple[int, int]] = []
        self._state_epoch = -1
        self._padding_verified = False
        #: why graphs were turned off after the padding check (None: not refused)
        self.padding_refused: str | None = None
        #: the static inputs forward writes in place, seen by their buffers' version counters in the
        #: first padded run (None: not run yet). Graphs write the padded buffer, so each call copies
        #: its real rows back into the caller's tensor, as eager forward would have written it.
        self.written_token_inputs: list[StaticInput] | None = None
        runner.on_size_failed = self._drop_size

    def _drop_size(self, size: int) -> None:
        self.sizes = [s for s in self.sizes if s != size]
        self.table = self._table_cls(self.sizes, self.max_num_tokens)

    # -- per call -------------------------------------------------------------------------------
    def __call__(self, args: tuple[Any, ...]) -> Any:
        if self.padding_refused is not None:
            return self.plain(*args)
        if self.captured and state.EPOCH != self._state_epoch:
            self._verify_bound(args)
        if not self.captured:
            self.capture_all(args)
        n = args[self.sym_index]
        padded = self.table.padded(n)
        if not self._padding_verified and padded is not None and padded > n:
            return self._verify_padding(args, n, padded)
        if padded is None:
            counters.bump("eager_above_capture", tag=self.tag)
            if not self._warned_above:
                self._warned_above = True
                log.info("[%s] %d tokens is above the largest capture size %s; such calls run without graphs",
                         self.tag, n, self.sizes[-1] if self.sizes else None)
            return self.plain(*args)
        return self._run(args, n, padded)

    def _run(self, args: tuple[Any, ...], n: int, padded: int) -> Any:
        uniform = _uniform_decode.get()
        mode = RuntimeMode.FULL if self.mode == "full" or (self.mode == "full_and_piecewise" and uniform) else RuntimeMode.PIECEWISE
        padded_args = self._fill(args, n, padded)
        self.num_tokens_device.fill_(n)
        self.select_entry(padded)
        versions = None if self.written_token_inputs is not None else [version(padded_args[si.index]) for si in self.static_inputs]
        token = enter_forward(ForwardContext(n, padded, mode, BatchDescriptor(padded, uniform), self.tag, self.num_tokens_device))
        try:
            out = self.full(*padded_args) if mode is RuntimeMode.FULL else self.forward(*padded_args)
        finally:
            exit_forward(token)
            self.runner.flush_replays()
        if versions is not None:  # the first run is eager (a warm-up), so in-place writes bump versions
            # inference tensors have no counter: the planner's static finding (`written_static`) stands in
            self.written_token_inputs = [si for si, v in zip(self.static_inputs, versions)
                                   if (version(padded_args[si.index]) != v if v is not None else si.index in self.written_static)]
            if self.written_token_inputs:
                log.info("[%s] forward writes graph input(s) %s in place: each call copies their real rows back", self.tag,
                         [si.index for si in self.written_token_inputs])
        if n:
            for si in self.written_token_inputs:
                args[si.index].narrow(si.dim, 0, n).copy_(padded_args[si.index].narrow(si.dim, 0, n))
        return self._slice(out, n)

    def _fill(self, args: tuple[Any, ...], n: int, padded: int) -> list[Any]:
        if self.num_tokens_device is None:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            self.num_tokens_device = torch.zeros((), dtype=torch.int64, device=device)
        new = list(args)
        for si in self.static_inputs:
            x = args[si.index]
            buf = si.view(x, padded, self.max_num_tokens)
            if n:
                buf.narrow(si.dim, 0, n).copy_(x.narrow(si.dim, 0, n))
            if padded > n:
                buf.narrow(si.dim, n, padded - n).zero_()
            new[si.index] = buf
        for i in self.token_count_inputs:
            new[i] = padded
        if not self.captured_ptrs:
            # Static buffers, weights and caches: bound in place by every graph (checked at replay).
            self.captured_ptrs = True
            self.runner.stable_ptrs.update(a.data_ptr() for a in new if isinstance(a, torch.Tensor))
            statics = {si.index for si in self.static_inputs}
            self._bound = [(i, a.data_ptr()) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in statics]
            self._argument_ptrs = tuple((i, args[i].data_ptr()) for i in self.argument_inputs)
            self._state_epoch = state.EPOCH
        else:
            for i, ptr in self._argument_ptrs:
                if args[i].data_ptr() != ptr:
                    raise CaptureError(
                        f"[{self.tag}] graph input {i}, an argument of the forward without a token dim, is not the tensor "
                        "the graphs were captured with (another address); captured graphs read it in place, so they "
                        "would read stale memory. Pass the same tensor on every call (fill it in place), give it the "
                        "token dim, or set cudagraph_mode='none'")
        return new

    def _verify_padding(self, args: tuple[Any, ...], n: int, padded: int) -> Any:
        """The first call that pads: check that pad rows cannot reach real results, by running this
        call unpadded, then padded with zero pad rows, then padded with pad rows copied from real
        rows (in-domain values, so token ids stay valid), without graphs, and comparing the real
        rows of every output. A model whose real rows move with the pad rows (attention or a norm
        over tokens outside splitting ops, a convolution along tokens, the token count used as a
        value, a splitting op that ignores ``forward_context().num_tokens``) gets no graphs from
        then on, with a warning. Returns this call's (unpadded) result.

        What forward writes in place outside splitting ops is compared too (see the body).

        The model runs three times on this call's tokens: splitting ops must write the same state
        for the same tokens (true of KV-cache writes). The padded runs start from copies of the token inputs as they were before the
        real run, which may write them in place."""
        before = list(args)
        for si in self.static_inputs:
            before[si.index] = args[si.index].clone()
        kept = self._keep_arguments(args)
        expected = _clone(self.plain(*args))
        after = self._keep_arguments(args)
        args = tuple(before)
        worst = 0.0
        padded_states = []
        for fill in ("zeros", "copies"):
            padded_args = self._fill(args, n, padded)
            if fill == "copies":
                for si in self.static_inputs:
                    pad = padded_args[si.index].narrow(si.dim, n, padded - n)
                    src = padded_args[si.index].narrow(si.dim, 0, n)
                    reps = -(-(padded - n) // n)
                    pad.copy_(torch.cat([src] * reps, dim=si.dim).narrow(si.dim, 0, padded - n))
            self.select_entry(padded)
            self._restore_arguments(kept)
            token = enter_forward(ForwardContext(n, padded, RuntimeMode.NONE, None, self.tag))
            try:
                got = self._slice(self.forward(*padded_args), n)
            finally:
                exit_forward(token)
            worst = max(worst, _max_rel_diff(expected, got))
            padded_states.append(self._keep_arguments(args))
        # Row-local models differ only by rounding between an n-row and a padded call (BLAS blocks
        # by size): ~1e-6 relative in fp32, a few ulps (~1e-2) in half precision. A leak is O(1).
        half = any(isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16)
                   for a in [*_leaves(expected), *(t for t, _ in after)])
        limit = 5e-2 if half else 1e-3
        # What forward wrote in place outside splitting ops, after each padded run against after
        # the unpadded one (a buffer filled from the token count, `buf[:n] = x`, `seen += n`): a
        # replay leaves the padded call's there, which later calls may read. Compared whole and
        # tightly (rounding of real rows computed at another size stays under 1e-5 relative in
        # fp32; a count off by 1 in 1024 does not), so a scratch buffer whose pad rows no call
        # reads is refused too: telling it apart would mean running the model from altered state,
        # which also rewrites what splitting ops keep (a KV cache).
        worst_state = max((_max_rel_diff([c for _, c in after], [c for _, c in ps]) for ps in padded_states), default=0.0)
        self._restore_arguments(after)
        self._padding_verified = True
        state_limit = 1e-2 if half else 1e-5
        if worst > limit or worst_state > state_limit:
            if worst_state > state_limit:
                self.padding_refused = (f"what forward writes in place outside splitting ops (graph inputs "
                                        f"{list(self.written_arguments)}) changed by up to {worst_state:.3g} (relative) "
                                        f"when the call was padded from {n} to {padded} tokens")
                why = ("the model writes state from the token count or pad rows outside splitting ops (buf[:n] = x, "
                       "seen += n), which later calls may read")
            else:
                self.padding_refused = (f"real rows changed by up to {worst:.3g} (relative) when the call was padded from {n} "
                                        f"to {padded} tokens")
                why = ("the model mixes values across tokens outside splitting ops (or a splitting op ignores "
                       "forward_context().num_tokens)")
            log.warning("[%s] %s: %s; graph capture pads calls, so graphs are turned off for this model. Move such steps "
                        "into a splitting op that skips pad rows, or set cudagraph_mode='none'",
                        self.tag, self.padding_refused, why)
            counters.bump("padding_refusals", tag=self.tag)
            self.reset()
        return expected

    def _keep_arguments(self, args: tuple[Any, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the graph inputs without a token dim that forward writes in place outside
        splitting ops (`written_arguments`: its own arguments, module buffers such as a step
        counter; runs use them in place): warm-ups, captures
        and the padding check run forward more often than the caller called it, so those writes are
        put back afterwards (`_restore_arguments`) and the caller sees one write a call, as in
        eager. Splitting ops write nothing for zero real tokens and the same state for the same
        tokens (a KV cache), so what only they write is not copied."""
        return [(args[i], args[i].clone()) for i in self.written_arguments if isinstance(args[i], torch.Tensor)]

    @staticmethod
    def _restore_arguments(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for tensor, copy in kept:
            tensor.copy_(copy)

    def _verify_bound(self, args: tuple[Any, ...]) -> None:
        """Module state changed somewhere (`piecewise.state`): a weight or buffer every graph reads in
        place may have moved (a KV cache allocated again, ``load_state_dict(assign=True)``). Moved:
        follow it by capturing every size again on this call, logged; the old graphs are dropped."""
        moved = [i for i, ptr in self._bound if not isinstance(args[i], torch.Tensor) or args[i].data_ptr() != ptr]
        self._state_epoch = state.EPOCH
        if not moved:
            return
        log.info("[%s] graph input(s) %s moved since capture (a weight or buffer was reassigned); capturing the %d sizes "
                 "again", self.tag, moved[:8], len(self._all_sizes))
        counters.bump("recaptures", tag=self.tag)
        self.reset()

    def reset(self) -> None:
        """Drop every captured graph; the next call warms up and captures again (same sizes)."""
        for w in [*self.wrappers, *([self.full] if self.full is not None else [])]:
            w.entries.clear()
        self.runner.reset()
        self.sizes = list(self._all_sizes)
        self.table = self._table_cls(self.sizes, self.max_num_tokens)
        self.captured = False
        self.captured_ptrs = False
        self._bound = []

    def _slice(self, out: Any, n: int) -> Any:
        if isinstance(out, (tuple, list)):
            return type(out)(o.narrow(d, 0, n) if d is not None else o for o, d in zip(out, self.output_dims))
        d = self.output_dims[0]
        return out.narrow(d, 0, n) if d is not None else out

    # -- capture ------------------------------------------------------------------------------
    def capture_all(self, template: tuple[Any, ...]) -> None:
        """Warm up and capture every size, largest first (later, smaller captures reuse the pool
        memory the largest one reserved). Runs with zero real tokens, so splitting ops that honour
        ``forward_context().num_tokens`` write nothing (no KV-cache entries for dummy rows)."""
        self.captured = True
        before = counters.snapshot()
        kept = self._keep_arguments(template)
        modes = ["piecewise"] if self.mode == "piecewise" else ["full"] if self.mode == "full" else ["full", "piecewise"]
        for size in sorted(self.sizes, reverse=True):
            for mode in modes:
                hint = batch_hint(uniform_decode=(mode == "full"))
                with hint:
                    for _ in range(self.runner.num_warmups + 1):
                        if size not in self.sizes:
                            break
                        try:
                            self._run(template, 0, size)
                        except CaptureError:
                            raise
                        except Exception as e:
                            raise CaptureError(f"[{self.tag}] warm-up before graph capture failed at size {size} "
                                               f"({mode} mode): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
                                               "Set cudagraph_mode='none' to run without graphs") from e
        self._restore_arguments(kept)
        d = counters.delta_since(before)
        log.info("[%s] captured %d graphs over %d sizes (%s), pool %.1f MB; sizes %s", self.tag, d.get("graphs_captured", 0),
                 len(self.sizes), self.mode, self.runner.total_pool_bytes / 2**20, self.sizes)


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out


def _max_rel_diff(a: Any, b: Any) -> float:
    """Largest difference between two outputs relative to the reference's largest finite value
    (inf on a mismatch of structure, shape or dtype, or an infinity or NaN on one side only)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not a.is_floating_point():
            return 0.0 if torch.equal(a, b) else float("inf")
        if not a.numel():
            return 0.0
        a32, b32 = a.float(), b.float()
        same = (a32 == b32) | (a32.isnan() & b32.isnan())  # equal infinities and NaNs included
        if bool(same.all()):
            return 0.0
        d = (a32 - b32).abs().masked_fill(same, 0.0)
        if not bool(d.isfinite().all()):  # an infinity or NaN on one side only
            return float("inf")
        scale = max(a32.abs().masked_fill(~a32.isfinite(), 0.0).max().item(), 1e-6)
        return d.max().item() / scale
    if isinstance(a, (tuple, list)):
        if not isinstance(b, (tuple, list)) or len(a) != len(b):
            return float("inf")
        return max((_max_rel_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a == b else float("inf")


def _leaves(out: Any) -> list[Any]:
    return [x for o in out for x in _leaves(o)] if isinstance(out, (tuple, list)) else [out]
