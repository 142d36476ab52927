"""Test helpers for passes: real post-grad-style graphs without running Inductor.

`GraphHarness` compiles a function with Dynamo and AOTAutograd using Inductor's decomposition
table, so its forward graph is the functionalized, decomposed ATen graph (with ``meta["val"]`` fake
tensors and symbolic sizes) that Inductor hands its post-grad passes. The harness runs the given
passes on that graph, records op counts before and after, and then executes the rewritten graph, so
tests can compare its outputs with eager.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from piecewise.compilers.base import CompileTarget
from piecewise.passes import PassContext


def op_counts(graph: torch.fx.Graph) -> collections.Counter:
    """``{target: count}`` of the graph's call_function nodes (OpOverloads by their str name)."""
    return collections.Counter(
        str(n.target) if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "__name__", str(n.target))
        for n in graph.nodes
        if n.op == "call_function"
    )


class GraphHarness:
    """Compile `fn` so its forward graph goes through `passes` (after optional `before` rewrites
    that stand in for Inductor's own earlier passes)."""

    def __init__(
        self,
        passes: Sequence[Any],
        target: CompileTarget | None = None,
        before: Sequence[Callable[[torch.fx.Graph], None]] = (),
    ) -> None:
        self.passes = list(passes)
        self.context = PassContext(target or CompileTarget())
        self.before_passes = list(before)
        self.before: collections.Counter = collections.Counter()
        self.after: collections.Counter = collections.Counter()
        self.rewrites: list[Any] = []
        self.graph: torch.fx.Graph | None = None

    def _forward_compiler(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        for p in self.before_passes:
            p(gm.graph)
        self.before = op_counts(gm.graph)
        for p in self.passes:
            self.rewrites.append(p(gm.graph, self.context))
        gm.graph.lint()
        gm.recompile()
        self.after = op_counts(gm.graph)
        self.graph = gm.graph
        return make_boxed_func(gm.forward)

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        backend = aot_autograd(
            fw_compiler=self._forward_compiler,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,  # as Inductor: input writes stay in the graph as copy_
        )
        compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)

        def run(*args: Any) -> Any:
            with torch.no_grad():
                return compiled(*args)

        return run


def drop_clones(graph: torch.fx.Graph) -> None:
    """What Inductor's ``remove_noop_ops`` does to a same-layout ``clone`` before custom post
    passes run: its users read the source instead, so they read the source's *old* contents."""
    for n in list(graph.nodes):
        if n.target is torch.ops.aten.clone.default:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
