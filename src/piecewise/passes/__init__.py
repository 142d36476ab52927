"""Post-grad passes (docs/design.md §7): the pass interface, the pass manager and the built-in passes.

Configure passes on the `CompilationConfig`::

    config = pw.CompilationConfig(
        backend="inductor",
        passes=[MyFusion(eps=1e-6), "mypkg.passes:fold_scales", my_function],
        noop_elimination=True,        # built-in, on by default
        reinplace_custom_ops=True,    # built-in, on by default
        cpu_packed_linear=True,      # built-in, on by default: CPU linear weights packed for oneDNN
    )

Every pass has a `uuid()` (its source and options) that enters the compile key. Passes run inside
Inductor for every piece and every compile target (general, each range, each size) in the order
documented in `piecewise.passes.manager`; the ``eager`` adaptor runs no Inductor and no passes.
"""

from .base import FunctionPass, InductorPass, PassContext, PiecewisePass, as_pass, graph_pass, resolve_pass
from .manager import PassRecord, PostGradPassManager, pipeline
from .noop import NoOpElimination
from .packed_linear import PackedLinear
from .reinplace import ReinplaceCustomOps

__all__ = [
    "FunctionPass",
    "InductorPass",
    "NoOpElimination",
    "PassContext",
    "PackedLinear",
    "PassRecord",
    "PiecewisePass",
    "PostGradPassManager",
    "ReinplaceCustomOps",
    "as_pass",
    "graph_pass",
    "pipeline",
    "resolve_pass",
]
