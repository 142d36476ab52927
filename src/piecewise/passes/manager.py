"""The post-grad pass manager: runs the configured passes inside Inductor, per piece and target.

The Inductor adaptor installs one `PostGradPassManager` per compile as Inductor's
``post_grad_custom_post_pass``. Inductor calls it on every piece's forward graph after AOTAutograd
has functionalized and decomposed it and after Inductor's own post-grad pattern passes, and before
Inductor's reinplacing and lowering. The manager runs, in this order (`pipeline`):

1. `NoOpElimination` (``CompilationConfig.noop_elimination``) - first, so user passes match
   patterns on a graph without do-nothing reshapes and slices;
2. the user passes of ``CompilationConfig.passes``, in the order given;
3. `PackedLinear` (``CompilationConfig.cpu_packed_linear``) - after the user passes, so they match
   ``mm`` patterns as Inductor made them;
4. `ReinplaceCustomOps` (``CompilationConfig.reinplace_custom_ops``) - last, because a rewrite
   in place is only sound when no later node reads the old value, so it must see the final uses.

A pass whose `PiecewisePass.applies_to` declines the target is skipped (and logged as skipped).

The manager's `uuid` combines the passes' uuids with the compile target, so Inductor's own FX graph
cache never hands a range compile the code built for another range by a range-aware pass. Timing
and rewrite counts per pass go to the ``piecewise.passes`` logger (DEBUG) and to `records`.

The ``eager`` adaptor runs no Inductor, so no pass runs there.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch.fx

from .._torch.inductor import CustomGraphPass
from ..targets import CompileTarget
from ..errors import CompileError
from .base import PassContext, PiecewisePass, stable_digest

__all__ = ["PassRecord", "PostGradPassManager", "pipeline"]

log = logging.getLogger("piecewise.passes")


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One pass run on one graph.

    Attributes:
        name: the pass's name.
        target: the compile target's label (``"general"``, ``"range [1, 16]"``, ``"size 4"``).
        seconds: wall time of the pass (0.0 when skipped).
        rewrites: what the pass returned, or (when it returned None) the number of nodes added,
            removed or given new arguments.
        ran: False when `PiecewisePass.applies_to` declined the target.
    """

    name: str
    target: str
    seconds: float
    rewrites: int
    ran: bool = True


def pipeline(config: Any) -> tuple[PiecewisePass, ...]:
    """The ordered passes a `CompilationConfig` asks for (see the module doc for the order)."""
    from .noop import NoOpElimination
    from .packed_linear import PackedLinear
    from .reinplace import ReinplaceCustomOps

    out: list[PiecewisePass] = []
    if config.noop_elimination:
        out.append(NoOpElimination())
    out.extend(config.passes)
    # Not where Inductor's partitions may be captured as graphs: under a graph platform for the CPU
    # (tests register one) the outputs of a partition holding the packed op came out as the
    # capture's poisoned buffers (NaN) on every replay; not diagnosed, so the pass stays out there.
    partition_graphs = config.split_strategy == "inductor_partition" and config.cudagraph_mode != "none"
    if config.cpu_packed_linear and not partition_graphs:
        packed = PackedLinear()
        if packed.dtypes:
            out.append(packed)
    if config.reinplace_custom_ops:
        out.append(ReinplaceCustomOps())
    return tuple(out)


class PostGradPassManager(CustomGraphPass):
    """The ordered passes of one compile and the target they run for.

    Args:
        passes: the pipeline, in run order.
        target: the compile target (default: the general compile).
        records: where `PassRecord`s are appended; managers made by `for_target` share their
            parent's list.
    """

    def __init__(
        self,
        passes: Sequence[PiecewisePass],
        target: CompileTarget | None = None,
        records: list[PassRecord] | None = None,
    ) -> None:
        self.passes: tuple[PiecewisePass, ...] = tuple(passes)
        self.target = target if target is not None else CompileTarget()
        self.records: list[PassRecord] = records if records is not None else []

    @classmethod
    def from_config(cls, config: Any) -> "PostGradPassManager":
        return cls(pipeline(config))

    def for_target(self, target: CompileTarget) -> "PostGradPassManager":
        """The same passes, bound to `target`, recording into the same list."""
        return PostGradPassManager(self.passes, target, self.records)

    # -- identity --------------------------------------------------------------------------------
    def pipeline_uuid(self) -> str:
        """The ordered passes' uuids, without the target (for the compiler adaptor's hash)."""
        return stable_digest({"passes": [[p.name, p.uuid()] for p in self.passes]})

    def uuid(self) -> str:
        """Inductor's cache id for this compile: the passes' uuids and the target's key."""
        return stable_digest({"pipeline": self.pipeline_uuid(), "target": self.target.key})

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        """Run every applicable pass on `graph` in order.

        Raises:
            CompileError: a pass raised or left an invalid graph; names the pass and the target.
        """
        context = PassContext(self.target)
        total = time.perf_counter()
        for p in self.passes:
            if not p.applies_to(context):
                self.records.append(PassRecord(p.name, context.label, 0.0, 0, ran=False))
                log.debug("pass %s skipped for %s (applies_to declined)", p.name, context.label)
                continue
            before = _snapshot(graph)
            t0 = time.perf_counter()
            try:
                n = p(graph, context)
                graph.lint()
            except Exception as e:
                raise CompileError(
                    f"post-grad pass {p.name!r} failed for {context.label}: {type(e).__name__}: {e}; "
                    "fix the pass or remove it from CompilationConfig.passes"
                ) from e
            dt = time.perf_counter() - t0
            rewrites = n if isinstance(n, int) and not isinstance(n, bool) else _count_changes(before, graph)
            self.records.append(PassRecord(p.name, context.label, dt, rewrites))
            log.debug("pass %s for %s: %d rewrites in %.2f ms", p.name, context.label, rewrites, dt * 1e3)
        log.debug(
            "post-grad passes for %s: %d passes, %d nodes, %.2f ms",
            context.label, len(self.passes), len(graph.nodes), (time.perf_counter() - total) * 1e3,
        )

    def __repr__(self) -> str:
        return f"PostGradPassManager([{', '.join(p.name for p in self.passes)}], {self.target.label})"


def _snapshot(graph: torch.fx.Graph) -> dict[torch.fx.Node, tuple[Any, Any, Any]]:
    return {n: (n.target, n.args, n.kwargs) for n in graph.nodes}


def _count_changes(before: dict[torch.fx.Node, tuple[Any, Any, Any]], graph: torch.fx.Graph) -> int:
    """Nodes added, removed, or given another target or arguments since `before`."""
    after = set(graph.nodes)
    # identity, not equality: FX gives a node new argument tuples only when a pass touches them,
    # and arguments may hold tensors whose `==` is elementwise
    changed = sum(
        1 for n in after
        if n not in before or any(old is not new for old, new in zip(before[n], (n.target, n.args, n.kwargs)))
    )
    return changed + sum(1 for n in before if n not in after)
